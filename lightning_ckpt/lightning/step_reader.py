"""Reading a real training step's memory after lock-in. A compiled model's steps are read as its trials were
(``SavedForBackward``): the tracker's dispatch mode would make dynamo run them eagerly and read the eager step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.measure.device_memory import device_memory
from lightning_ckpt.measure.saved_for_backward import SavedForBackward
from lightning_ckpt.measure.step import MemoryReading
from lightning_ckpt.measure.tracker import new_live_tracker

__all__ = ["RealStepReader"]


class RealStepReader:
    """Reads one real training step, started and stopped from two hooks (batch start, batch end).

    Peak memory: CUDA from the allocator (what an OOM is decided on), CPU from the live-tensor tracker (several times
    slower, so only the steps the guard reads). Activation memory is read by the tracker on every device, as in trials:
    the allocator's ``peak - resting`` would also count new gradients and the optimizer's state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tracker: Any = None
        self._saved: SavedForBackward | None = None
        self._resting = 0
        self._retries = 0

    def _allocator(self, read: Callable[[Any], Any], default: Any) -> Any:
        """``read`` of the device's allocator (CUDA, or a simulated card); ``default`` where there is none to read."""
        try:
            memory = device_memory(self.device)
            return read(memory) if memory is not None else default
        except (AssertionError, RuntimeError):  # torch built without CUDA
            return default

    def _alloc_retries(self) -> int:
        return self._allocator(lambda memory: int(memory.stats().get("num_alloc_retries", 0)), 0)

    @property
    def active(self) -> bool:
        reading = self._tracker is not None or self._saved is not None
        return reading or (self.device.type == "cuda" and self._resting > 0)

    def start(
        self,
        model: nn.Module,
        optimizers: Sequence[Any],
        extra: tuple[Any, ...] = (),
        *,
        activation: bool = True,
        compiled: bool = False,
    ) -> None:
        """Start reading a step. ``compiled``: the step runs compiled code, read as compiled trials are:
        activation = bytes saved for backward, peak = the allocator's (CUDA) or resting + activation (CPU)."""
        self._retries = self._alloc_retries()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._resting = max(1, torch.cuda.memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            if not activation:
                return
        if compiled:
            self._saved = SavedForBackward(model, optimizers, extra).__enter__()
            if self.device.type != "cuda":
                self._resting = self._saved.resting_bytes
            return
        tracker = new_live_tracker(self.device, model, optimizers[0] if optimizers else None)
        tracker.track_external(model, *optimizers, *extra)
        tracker.closure_in_step = True
        if self.device.type != "cuda":
            self._resting = tracker.now()[0]
        tracker.total_peak = tracker.now()[0]
        tracker.__enter__()
        self._tracker = tracker

    def optimizer_update_starts(self) -> None:
        """Called between the closure (forward and backward) and the optimizer's update of a real step."""
        if self._tracker is not None:
            self._tracker.optimizer_update_starts()

    def stop(self) -> MemoryReading | None:
        """The step's reading, or None when no step was being read. Activation is None when it was not read."""
        tracker, saved, resting = self._tracker, self._saved, self._resting
        self.abandon()
        activation = saved.saved_bytes if saved is not None else tracker.activation_peak if tracker else None
        if self.device.type == "cuda":
            if resting == 0:
                return None
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif saved is not None:
            peak = resting + saved.saved_bytes
        elif tracker is not None:
            peak = tracker.total_peak
        else:
            return None
        retries = self._alloc_retries() - self._retries
        # A simulated card's reserved peak is the test's, not reset here.
        reserved = self._allocator(lambda memory: memory.max_reserved(), None) if self.device.type == "cuda" else None
        return MemoryReading(peak, activation, resting, str(self.device), reserved, retries)

    def abandon(self) -> None:
        """Stop reading without a result (the step raised, or the fit ends)."""
        for reading in (self._tracker, self._saved):
            if reading is not None:
                reading.__exit__(None, None, None)
        self._tracker = self._saved = None
        self._resting = 0
