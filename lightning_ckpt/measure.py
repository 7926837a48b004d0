"""Peak and activation memory of one training step, on CUDA and on CPU.

Definitions used everywhere in lightning_ckpt (budgets, predictions, tests):

* **peak bytes**: the highest number of bytes held by live tensors at any moment of the step,
  everything included (parameters, buffers, gradients, optimizer state, activations, temporaries).
  CUDA: ``torch.cuda.max_memory_allocated``. CPU: a live-tensor tracker, since no allocator counter exists.
* **activation bytes**: the highest number of bytes held at any moment by tensors the step itself
  created *other than* parameter gradients and optimizer state: saved activations, recomputed
  activations and backward temporaries. This is the part checkpointing changes.

torch's ``MemTracker`` reports categories at the moment the *total* peaks, which understates the
activation peak of checkpointed plans (the total peaks late in backward, when gradients already
hold memory and activations are half freed). So we keep our own running maxima of both.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryReading", "track_step_memory"]


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one step; see the module docstring for the definitions."""

    peak_bytes: int
    activation_bytes: int
    resting_bytes: int  # live bytes when the step started (parameters, existing grads, optimizer state)
    device: str


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class _RunningPeakTracker(MemTracker):
        """MemTracker that also keeps running maxima of the total and of activations+temporaries."""

        def __init__(self) -> None:
            super().__init__()
            self.total_peak = 0
            self.activation_peak = 0

        # Replaces the per-module peak bookkeeping (a loop over all modules on every op) with two
        # running maxima: all lightning_ckpt needs, and much cheaper on models with many modules.
        def _update_peak_stats(self, peak_state: Any) -> None:  # noqa: ARG002
            for snap in self._curr_mem_snap.values():
                self.total_peak = max(self.total_peak, snap[_TOTAL_KEY])
                act = snap.get(_MemRefType.ACT, 0) + snap.get(_MemRefType.TEMP, 0)
                self.activation_peak = max(self.activation_peak, act)

        def resting(self) -> int:
            return sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())

    return _RunningPeakTracker


def track_step_memory(
    step_fn: Callable[[], Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    extra: tuple[Any, ...] = (),
) -> MemoryReading:
    """Run ``step_fn`` once and read its peak and activation memory.

    On CPU this runs under a dispatch-mode tracker, which slows the step several-fold: never time
    a step and track its memory in the same pass. ``extra`` are tensors created outside the step
    (e.g. the batch) that should count as resting state.
    """
    device = torch.device(device) if device is not None else _model_device(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        gc.collect()
        resting = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step_fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        # On CUDA we cannot tell gradients from activations by category; the step's growth above
        # the resting state is the closest allocator-level reading of activation memory.
        return MemoryReading(peak, max(0, peak - resting), resting, str(device))

    tracker = _tracker_class()()
    externals = [model, *extra] + ([optimizer] if optimizer is not None else [])
    tracker.track_external(*externals)
    tracker.total_peak = resting = tracker.resting()
    with tracker:
        step_fn()
    return MemoryReading(tracker.total_peak, tracker.activation_peak, resting, str(device))


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
