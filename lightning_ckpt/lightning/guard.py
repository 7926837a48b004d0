"""The check after lock-in: read real training steps' peak memory and pick a plan that fits when one does not.

Trials predict a real step from a forward+backward on one batch plus a measured optimizer step. What
they cannot see (an optimizer whose state appears late, a batch larger than the tuned one, memory a
``training_step`` keeps across steps) shows up only in real steps. So the first real steps after
lock-in, and any step on a batch larger than every one checked so far, are read whole: CUDA from the
allocator's peak, CPU with the live-tensor tracker (several times slower, so only those steps).
A compiled model's steps are read as its trials were (``compile.SavedForBackward``): the tracker's
dispatch mode would make dynamo run them eagerly and read the eager step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_ckpt.budget import Budget
from lightning_ckpt.discovery import discover_blocks
from lightning_ckpt.measure.measurement import MemoryReading
from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.search.saved_for_backward import SavedForBackward

__all__ = ["RealStepReader", "StepCheck", "lower_memory_trial", "lower_plan"]


class RealStepReader:
    """Reads one real training step, started and stopped from two hooks (batch start, batch end).

    Peak memory: CUDA from the allocator (what an OOM is decided on), CPU from the live-tensor tracker.
    Activation memory means what it means in trials (``measure``): bytes the step creates other than
    gradients and optimizer state, read by the live-tensor tracker on every device. On CUDA the
    allocator's ``peak - resting`` would also count the new gradients, the optimizer state the first
    step creates and its foreach temporaries, so an activation budget would see a step several times
    its trial. The tracker runs only when activation is asked for (it slows the step) and only on the
    few steps the guard reads.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tracker: Any = None
        self._saved: SavedForBackward | None = None
        self._resting = 0

    @property
    def active(self) -> bool:
        return (
            self._tracker is not None or self._saved is not None or (self.device.type == "cuda" and self._resting > 0)
        )

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
        tracker, self._tracker = self._tracker, None
        saved, self._saved = self._saved, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        activation = tracker.activation_peak if tracker is not None else None
        if saved is not None:
            saved.__exit__(None, None, None)
            activation = saved.saved_bytes
        if self.device.type == "cuda":
            if self._resting == 0:
                return None
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            resting, self._resting = self._resting, 0
            return MemoryReading(peak, activation, resting, str(self.device))
        resting, self._resting = self._resting, 0
        if saved is not None:
            return MemoryReading(resting + saved.saved_bytes, activation, resting, str(self.device))
        if tracker is None:
            return None
        return MemoryReading(tracker.total_peak, activation, resting, str(self.device))

    def abandon(self) -> None:
        """Stop reading without a result (the step raised, or the fit ends)."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
        if self._saved is not None:
            saved, self._saved = self._saved, None
            saved.__exit__(None, None, None)
        self._resting = 0


@dataclass(frozen=True)
class StepCheck:
    """One real step read after lock-in, as recorded in the plan file."""

    step: int
    peak_bytes: int
    activation_bytes: int | None  # None: not read (a peak budget on CUDA reads the allocator only)
    batch_dims: tuple[int | None, int | None]
    plan: str
    within_budget: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "peak_bytes": self.peak_bytes,
            "activation_bytes": self.activation_bytes,
            "batch_size": self.batch_dims[0],
            "seq_len": self.batch_dims[1],
            "plan": self.plan,
            "within_budget": self.within_budget,
        }


def lower_memory_trial(trials: Sequence[Any], current_key: str, budget: Budget, excess: int) -> Any | None:
    """The fastest measured trial that should fit once the real step's ``excess`` over its trial is added.

    ``excess`` (real peak minus the current plan's trial peak) is what trials did not see; it is assumed
    to be the same under every plan (optimizer, retained tensors, a larger batch scale it alike, roughly).
    Only plans using less memory than the current one are considered. Returns None when none qualifies.
    """
    current = next((t for t in trials if t.plan.key() == current_key), None)
    current_value = budget.value_of(current.peak_bytes, current.activation_bytes) if current is not None else None
    best = None
    for t in trials:
        if t.status not in ("ok", "over_budget") or t.plan.key() == current_key:
            continue
        value = budget.value_of(t.peak_bytes, t.activation_bytes)
        if value is None or (current_value is not None and value >= current_value):
            continue
        if budget.limit_bytes is not None and value + excess > budget.limit_bytes:
            continue
        if best is None or (t.samples_per_second or 0.0) > (best.samples_per_second or 0.0):
            best = t
    return best


def lower_plan(
    plan: Plan, real_value: int, trials: Sequence[Any], budget: Budget, model: nn.Module, *, block_types: Any = None
) -> Plan | None:
    """The plan to switch to after a real step used ``real_value`` of the budget under ``plan``: the fastest
    searched plan expected to fit (``lower_memory_trial``), else full checkpointing; None when that is ``plan``."""
    current = next((t for t in trials if t.plan.key() == plan.key()), None)
    trial_value = budget.value_of(current.peak_bytes, current.activation_bytes) if current is not None else None
    excess = max(0, real_value - trial_value) if trial_value is not None else 0
    found = lower_memory_trial(trials, plan.key(), budget, excess)
    if found is not None:
        lower = found.plan
    else:
        lower = uniform_plan(discover_blocks(model, block_types=block_types), BlockPlan("full"))
        if lower.key() == plan.key():
            return None
    return replace(
        lower,
        name="guarded",
        fingerprint=plan.fingerprint,
        metadata={**plan.metadata, "switched_from": plan.describe()},
    )
