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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_ckpt.budget import Budget, format_bytes
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError
from lightning_ckpt.lightning.trials import batch_dims, batch_tensors
from lightning_ckpt.measure.measurement import MemoryReading
from lightning_ckpt.measure.saved_for_backward import SavedForBackward
from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.stacks import LayerStack

__all__ = ["BudgetGuard", "GuardConfig", "RealStepReader", "StepCheck", "lower_memory_trial", "lower_plan"]


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
    plan: Plan, real_value: int, trials: Sequence[Any], budget: Budget, stacks: Sequence[LayerStack]
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
        lower = uniform_plan(stacks, BlockPlan("full"))
        if lower.key() == plan.key():
            return None
    return replace(
        lower,
        name="guarded",
        fingerprint=plan.fingerprint,
        metadata={**plan.metadata, "switched_from": plan.describe()},
    )


@dataclass(frozen=True)
class GuardConfig:
    """How the real steps after lock-in are checked against the budget.

    steps: real training steps read whole after lock-in (CUDA: the allocator's peak; CPU: the live-tensor
        tracker, slower, so only those steps), at least up to the first step that starts with the optimizer's
        state (accumulation + 1); also every step on a batch larger than any checked before. ``0``: no guard.
    on_budget_exceeded: when a read step exceeds the budget: ``"switch"`` (warn loudly and switch to the fastest
        lower-memory plan expected to fit), ``"raise"`` or ``"warn"``.
    """

    steps: int = 2
    on_budget_exceeded: Literal["switch", "raise", "warn"] = "switch"

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ConfigurationError(
                f"guard steps must be an integer >= 0 (e.g. guard={{'steps': 2}}; 0 turns the guard off), "
                f"got {self.steps!r}."
            )
        if self.on_budget_exceeded not in ("switch", "raise", "warn"):
            raise ConfigurationError(
                "guard on_budget_exceeded must be 'switch', 'raise' or 'warn' (e.g. guard={'on_budget_exceeded': "
                f"'raise'}}), but got {self.on_budget_exceeded!r}."
            )

    @classmethod
    def of(cls, value: GuardConfig | Mapping[str, Any] | None) -> GuardConfig:
        """``value`` as a config: a ``GuardConfig``, a dict of its fields (LightningCLI YAML), or None (defaults)."""
        if value is None or isinstance(value, GuardConfig):
            return value or cls()
        if not isinstance(value, Mapping):
            raise ConfigurationError(
                f"guard must be a GuardConfig or a dict such as {{'steps': 2, 'on_budget_exceeded': 'switch'}}, "
                f"but got {type(value).__name__} {value!r}."
            )
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigurationError(f"Unknown guard settings {unknown}. Known settings: steps, on_budget_exceeded.")
        return cls(**value)


class BudgetGuard:
    """The guard over one fit: which real steps to read, what they showed (``checks``), and the verdict.

    Every rank reads the same steps and judges the worst rank's figures, so a switch (which gathers plan
    digests) is entered by all ranks or none.
    """

    def __init__(self, config: GuardConfig, device: torch.device) -> None:
        self.config = config
        self.reader = RealStepReader(device)
        self.checks: list[StepCheck] = []
        self.budget: Budget | None = None
        self._left = 0
        self._checked_dims: tuple[int, int] = (0, 0)

    def arm(self, accumulation: int) -> None:
        """A plan was locked in: read its first steps, through the first one that holds the optimizer's state."""
        steps = self.config.steps
        self._left = steps and max(steps, accumulation + 1)

    def maybe_start(self, trainer: Any, pl_module: nn.Module, batch: Any, *, compiled: bool) -> None:
        budget = self.budget
        if budget is None or budget.kind == "none" or not self.config.steps:
            return
        dims = tuple(d or 0 for d in batch_dims(batch))
        # Under several ranks batch shapes can differ by rank (a ragged last batch) while every rank must read
        # the same steps (the verdict is gathered): only the first steps after lock-in are read there.
        larger = (
            trainer.world_size == 1
            and bool(self.checks)
            and any(d > c for d, c in zip(dims, self._checked_dims, strict=True))
        )
        if self._left <= 0 and not larger:
            return
        activation = budget.kind == "activation"
        extra = tuple(batch_tensors(batch))
        self.reader.start(pl_module, list(trainer.optimizers), extra, activation=activation, compiled=compiled)

    def judge(self, trainer: Any, reading: MemoryReading, batch: Any, plan: Plan, sync: Any) -> StepCheck:
        """Record one read step against the budget (the worst rank's figures under several ranks)."""
        budget = self.budget
        assert budget is not None
        peak, act = reading.peak_bytes, reading.activation_bytes
        if sync is not None:
            gathered = sync.all_gather((peak, act))
            peak = max(g[0] for g in gathered)
            act = max((g[1] for g in gathered if g[1] is not None), default=None)
        dims = batch_dims(batch)
        self._left -= 1
        self._checked_dims = (max(dims[0] or 0, self._checked_dims[0]), max(dims[1] or 0, self._checked_dims[1]))
        check = StepCheck(trainer.global_step, peak, act, dims, plan.describe(), budget.fits(peak, act))
        self.checks.append(check)
        return check

    @property
    def done(self) -> bool:
        """The steps after lock-in are all read (later, only a larger batch is)."""
        return self._left <= 0

    def over_budget(self, check: StepCheck, plan: Plan, trials: Sequence[Any], view: ModelView) -> Plan | None:
        """Act on a step over the budget as ``on_budget_exceeded`` says: the plan to switch to, or None to go on."""
        budget = self.budget
        assert budget is not None
        value = budget.value_of(check.peak_bytes, check.activation_bytes) or 0
        size, seq = check.batch_dims
        what = "activation memory" if budget.kind == "activation" else "peak memory"
        message = (
            f"lightning_ckpt: a real training step (step {check.step}, batch {size} x {seq}) used "
            f"{format_bytes(value)} of {what}, over the budget of {budget.description}, under plan {plan.describe()}."
        )
        if self.config.on_budget_exceeded == "raise":
            raise InfeasibleBudgetError(
                message + " Raise the budget, or set guard={'on_budget_exceeded': 'switch'} to move to a lower-memory "
                "plan."
            )
        if self.config.on_budget_exceeded == "warn":
            rank_zero_warn(message + " Continuing with it (on_budget_exceeded='warn').")
            return None
        lower = lower_plan(plan, value, trials, budget, view.stacks)
        if lower is None:
            rank_zero_warn(message + " No plan using less memory is left; continuing with this one.")
            return None
        rank_zero_warn(message + f" Switching to {lower.describe()} (on_budget_exceeded='switch').")
        return lower
