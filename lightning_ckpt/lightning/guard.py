"""The check after lock-in: read real training steps' peak memory and pick a plan that fits when one does not.
What trials cannot see (an optimizer whose state appears late, a batch larger than the tuned one, memory a
``training_step`` keeps across steps) shows up only in real steps, so the first ones after lock-in, and any step
on a batch larger than every one read so far, are read whole (``step_reader``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.lightning.ranks import max_over_ranks
from lightning_ckpt.lightning.shapes import BatchSize, ShapeScaling, batch_dims, batch_size_of, batch_tensors
from lightning_ckpt.lightning.step_reader import RealStepReader
from lightning_ckpt.measure.step import MemoryReading
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.search.ledger import TrialRecord, record_of
from lightning_ckpt.stacks import LayerStack

__all__ = ["BudgetGuard", "GuardConfig", "StepCheck", "largest_size", "lower_memory_trial", "lower_plan"]


@dataclass(frozen=True)
class StepCheck:
    """One real step read after lock-in, as recorded in the plan file."""

    step: int
    peak_bytes: int
    activation_bytes: int | None  # None: not read (a peak budget on CUDA reads the allocator only)
    batch_dims: tuple[int | None, int | None]
    plan: str
    within_budget: bool
    size: str | None = None  # ``rows x length`` as the guard measures batches (``lightning.shapes``)
    reserved_peak_bytes: int | None = None  # CUDA: the allocator's reserved peak over the step
    alloc_retries: int = 0  # times the allocator released its cache to serve the step: the card near refusing it

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "peak_bytes": self.peak_bytes,
            "activation_bytes": self.activation_bytes,
            "batch_size": self.batch_dims[0],
            "seq_len": self.batch_dims[1],
            "plan": self.plan,
            "within_budget": self.within_budget,
            "size": self.size,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "alloc_retries": self.alloc_retries,
        }


def trial_figures(t: TrialRecord) -> tuple[int | None, int | None]:
    """(peak, activation) bytes of a trial at the tuned batch: measured where it ran, predicted where it was pruned."""
    if t.status in ("ok", "over_budget"):
        return t.peak_bytes, t.activation_bytes
    return t.predicted_peak_bytes, t.predicted_activation_bytes


def lower_memory_trial(
    trials: Sequence[TrialRecord],
    current_key: str,
    budget: Budget,
    excess: int,
    *,
    exclude: Collection[str] = (),
    predict: Callable[[str, int | None, int | None], int | None] | None = None,
) -> TrialRecord | None:
    """The fastest measured trial that should fit once the real step's ``excess`` over its trial is added.
    ``excess``, what trials did not see, is assumed the same under every plan. ``predict``: a trial's figures as the
    budget's value at the batch at hand (default: as measured). Only plans known to need less than the current one,
    and none in ``exclude`` (they went over), qualify: each switch goes down, so the guard cannot oscillate."""
    current = record_of(trials, current_key)
    current_value = budget.value_of(*trial_figures(current)) if current is not None else None
    if current_value is None:
        return None  # a plan the search never saw: nothing is known to need less
    best = None
    for t in trials:
        if t.status not in ("ok", "over_budget") or t.plan.key() == current_key or t.plan.key() in exclude:
            continue
        value = budget.value_of(t.peak_bytes, t.activation_bytes)
        if value is None or value >= current_value:
            continue
        at_batch = predict(t.plan.key(), t.peak_bytes, t.activation_bytes) if predict is not None else value
        if budget.limit_bytes is not None and (at_batch is None or at_batch + excess > budget.limit_bytes):
            continue
        if best is None or (t.samples_per_second or 0.0) > (best.samples_per_second or 0.0):
            best = t
    return best


def lower_plan(
    plan: Plan,
    trials: Sequence[TrialRecord],
    budget: Budget,
    stacks: Sequence[LayerStack],
    *,
    excess: int = 0,
    exclude: Collection[str] = (),
    predict: Callable[[str, int | None, int | None], int | None] | None = None,
) -> Plan | None:
    """The plan to move to when ``plan`` does not fit: the fastest searched plan expected to fit, else full
    checkpointing, unless it is ``plan``, went over already, or is known to need more than ``plan``. None: stay."""
    found = lower_memory_trial(trials, plan.key(), budget, excess, exclude=exclude, predict=predict)
    if found is not None:
        lower = found.plan
    else:
        lower = uniform_plan(stacks, BlockPlan("full"))
        known = {t.plan.key(): budget.value_of(*trial_figures(t)) for t in trials}
        current, floor = known.get(plan.key()), known.get(lower.key())
        if lower.key() in (plan.key(), *exclude) or (current is not None and floor is not None and floor >= current):
            return None
    guarded = replace(lower, name="guarded", fingerprint=plan.fingerprint, metadata=plan.metadata)
    return guarded.with_provenance(switched_from=plan.describe())


@dataclass(frozen=True)
class GuardConfig:
    """How the plan is checked against the run: a reused plan against this model, budget and batches, and the real
    steps after lock-in against the budget.

    steps: real training steps read whole after lock-in (CUDA: the allocator's peak; CPU: the live-tensor
        tracker, slower, so only those steps), at least up to the first step that starts with the optimizer's
        state (accumulation + 1); also every step on a batch larger than any read before. ``0``: no guard.
    every: after those, one step in every ``every`` is read too (memory a ``training_step`` keeps across steps
        grows slowly); ``0``: only the first steps and larger batches.
    on_budget_exceeded: when a step exceeds the budget, read after it ran or predicted before a larger batch's
        forward: ``"switch"`` (warn loudly and move to the fastest lower-memory plan expected to fit; never to
        one that needs more, never back to one that went over), ``"raise"`` or ``"warn"``.
    shape_key: how big a batch is, for batches whose shape does not say it (a packed batch: ``lambda b: (1,
        int(b["cu_seqlens"][-1]))``): returns ``(rows, length)`` or a length. Default: samples x tokens for token
        batches, else the largest tensor's elements per sample (``lightning.shapes``).
    resize: ``resize(batch, length)``, the batch at ``length`` as ``shape_key`` measures it (a packed batch: its
        first ``length`` tokens with ``cu_seqlens`` clipped, or its sequences' lengths cut to sum to ``length``).
        It lets batches sized by ``shape_key`` be grown to ``max_shape`` for the search and cut to each bucket's
        length for a plan table; without it such batches get neither (the shapes alone say nothing of their size).
    buckets: with the callback's ``max_shape``, a plan table: lengths split into buckets, each running the fastest
        plan predicted to fit the budget at its longest length (no trials), switched by each batch's length before its
        forward. ``True`` (default): halving from the longest length down to the first batch's (at most 8 buckets); a
        list of lengths sets the edges (``[128, 256, 512]``); ``False``: one plan for every length. Packed batches
        need ``shape_key`` and ``resize`` for a table.
    on_stale_plan: ``"retune"`` (warn and search again) or ``"raise"`` when a reused plan (resumed checkpoint,
        ``plan=``, plan file) was tuned for another model, budget (compared by value) or run conditions.
    """

    steps: int = 2
    every: int = 100
    on_budget_exceeded: Literal["switch", "raise", "warn"] = "switch"
    shape_key: Callable[[Any], Any] | None = None
    resize: Callable[[Any, int], Any] | None = None
    buckets: bool | list[int] = True
    on_stale_plan: Literal["retune", "raise"] = "retune"

    def __post_init__(self) -> None:
        for name in ("steps", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(
                    f"guard {name} must be an integer >= 0 (e.g. guard={{'steps': 2, 'every': 100}}; 0 turns it "
                    f"off), got {value!r}."
                )
        if self.on_budget_exceeded not in ("switch", "raise", "warn"):
            raise ConfigurationError(
                "guard on_budget_exceeded must be 'switch', 'raise' or 'warn' (e.g. guard={'on_budget_exceeded': "
                f"'raise'}}), but got {self.on_budget_exceeded!r}."
            )
        if self.on_stale_plan not in ("retune", "raise"):
            raise ConfigurationError(f"on_stale_plan must be 'retune' or 'raise', but got {self.on_stale_plan!r}.")
        if self.shape_key is not None and not callable(self.shape_key):
            raise ConfigurationError(
                "guard shape_key must be a function of the batch returning (rows, length), e.g. "
                f"lambda b: (1, int(b['cu_seqlens'][-1])), but got {type(self.shape_key).__name__}."
            )
        if self.resize is not None and not callable(self.resize):
            raise ConfigurationError(
                "guard resize must be a function (batch, length) -> the batch at that length, e.g. one keeping a "
                f"packed batch's first `length` tokens, but got {type(self.resize).__name__}."
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
            known = ", ".join(f.name for f in fields(cls))
            raise ConfigurationError(f"Unknown guard settings {unknown}. Known settings: {known}.")
        return cls(**value)


def largest_size(trainer: Any, batch: Any, shape_key: Callable[[Any], Any] | None) -> BatchSize | None:
    """``batch``'s size, the largest rows and length on any rank (every rank must call it at the same point): the
    trials' memory is the largest rank's, so the size it is scaled from must be too."""
    size = batch_size_of(batch, shape_key)
    if trainer.world_size > 1:
        rows, length = max_over_ranks(trainer.strategy, (size.rows, size.length) if size else (0, 0))
        size = BatchSize(rows, length) if length else None
    return size


class BudgetGuard:
    """The guard over one fit: which real steps to read, what they showed (``checks``), and the verdict. Every rank
    reads the same steps and judges the worst rank's figures, so a switch (which gathers plan digests) is entered by
    all ranks or none."""

    def __init__(
        self, config: GuardConfig, device: torch.device, budget: Budget, *, reference: BatchSize | None = None
    ) -> None:
        """``reference``: the batch the trials measured (None: a reused plan)."""
        self.config, self.budget, self.reference = config, budget, reference
        self.reader = RealStepReader(device)
        self.checks: list[StepCheck] = []
        self.scaling = ShapeScaling()
        self._left = self._since_read = 0
        self._covered: BatchSize | None = None  # the largest rows and length read so far
        self._excess = 0  # what real steps used beyond their prediction (state trials do not see)
        self._left_behind: set[str] = set()  # plans that went over: never switched back to
        self._read_plans: dict[str, tuple[BatchSize, int | None, int]] = {}  # key -> (size, activation, peak)
        self.step_size: BatchSize | None = None  # this step's batch size; under several ranks the largest on any

    def arm(self, accumulation: int) -> None:
        """A plan was locked in: read its first steps, through the first one that holds the optimizer's state."""
        steps = self.config.steps
        self._left = steps and max(steps, accumulation + 1)

    @property
    def active(self) -> bool:
        return self.budget.kind != "none" and bool(self.config.steps)

    def agree(self, trainer: Any, batch: Any, *, table: bool = False) -> None:
        """This step's size, which the guard and a plan table's bucket go by (None while neither needs it): the
        largest on any rank, so every rank acts alike on a step whose batches differ."""
        self.step_size = largest_size(trainer, batch, self.config.shape_key) if self.active or table else None

    def maybe_start(
        self, trainer: Any, pl_module: nn.Module, batch: Any, *, compiled: bool, first_of: str | None = None
    ) -> None:
        """Read this step when it is one of the first after lock-in, a larger batch than any read, a periodic one, or
        (``first_of``: the key of a plan table's bucket plan running now) the first step under that plan."""
        if not self.active:
            return
        size = self.step_size
        larger = size is not None and self._covered is not None and size.exceeds(self._covered)
        self._since_read += 1
        periodic = bool(self.config.every) and self._since_read >= self.config.every
        first = first_of is not None and first_of not in self._read_plans
        if self._left <= 0 and not larger and not periodic and not first:
            return
        self._since_read = 0
        activation, extra = self.budget.kind == "activation", tuple(batch_tensors(batch))
        self.reader.start(pl_module, list(trainer.optimizers), extra, activation=activation, compiled=compiled)

    def predicted_value(self, plan_key: str, trials: Sequence[TrialRecord], size: BatchSize) -> int | None:
        """The budget's value for plan ``plan_key`` at ``size``: from its trial, else from a real step read under it."""
        trial = record_of(trials, plan_key)
        if trial is not None and self.reference is not None:
            value = self._scaled(plan_key, *trial_figures(trial), at=size, reference=self.reference)
        elif plan_key in self._read_plans:
            read_at, act, peak = self._read_plans[plan_key]
            value = self._scaled(plan_key, peak, act, at=size, reference=read_at)
        else:
            return None
        return value + self._excess if value is not None else None

    def _scaled(
        self, plan_key: str, peak: int | None, act: int | None, *, at: BatchSize, reference: BatchSize
    ) -> int | None:
        factor = self.scaling.scale(plan_key, at, reference)
        if self.budget.kind == "activation":
            return int(act * factor) if act is not None else None
        if peak is None:
            return None
        return int(peak - act + act * factor) if act is not None else int(peak * factor)

    def before_forward(
        self, trainer: Any, batch: Any, plan: Plan, trials: Sequence[TrialRecord], view: ModelView
    ) -> Plan | None:
        """Act on a batch larger than any read so far before it runs (on a GPU, after is an out-of-memory error): over
        the budget, the plan to switch to, or raise, or warn. The step is read either way (``maybe_start``)."""
        if not self.active:
            return None
        size = self.step_size
        covered = self._covered or self.reference
        if self._covered is not None and self.reference is not None:
            covered = self._covered.covering(self.reference)  # the trials measured the reference batch too
        if size is None or covered is None or not size.exceeds(covered):
            return None
        budget = self.budget
        value = self.predicted_value(plan.key(), trials, size)
        if value is None or budget.limit_bytes is None or value <= budget.limit_bytes:
            return None
        growth = (
            "growing with length as its read steps showed"
            if self.scaling.learned(plan.key())
            else "assuming quadratic growth in length until a step under it shows otherwise"
        )
        message = (
            f"lightning_ckpt: the next batch ({size}, larger than the {covered} read so far) is predicted to use "
            f"{format_bytes(value)} of {_what(budget)} under plan {plan.describe()} ({growth}), over the budget of "
            f"{budget.description}; checked before its forward."
        )
        return self._act("before_forward", message, plan, trials, view, at=size, reference=self.reference or covered)

    def judge(
        self, trainer: Any, reading: MemoryReading, batch: Any, plan: Plan, sync: Any, trials: Sequence[TrialRecord]
    ) -> StepCheck:
        """Record one read step against the budget (the worst rank's figures under several ranks)."""
        peak, act, retries = reading.peak_bytes, reading.activation_bytes, reading.alloc_retries
        if sync is not None:
            gathered = sync.all_gather((peak, act))
            peak = max(g[0] for g in gathered)
            act = max((g[1] for g in gathered if g[1] is not None), default=None)
            retries = max(sync.all_gather(retries))
        size = self.step_size  # the worst rank's figures go with the largest batch on any rank
        self._left -= 1
        if size is not None:
            self._learn(plan, size, peak, act, trials)
        fits, label = self.budget.fits(peak, act), str(size) if size else None
        check = StepCheck(trainer.global_step, peak, act, batch_dims(batch), plan.describe(), fits, label)
        check = replace(check, reserved_peak_bytes=reading.reserved_peak_bytes, alloc_retries=retries)
        self.checks.append(check)
        return check

    def _learn(self, plan: Plan, size: BatchSize, peak: int, act: int | None, trials: Sequence[TrialRecord]) -> None:
        """Learn from a read step: how memory grows with length, what real steps use beyond their prediction, and the
        largest size covered."""
        reference = self._read_plans.get(plan.key())
        trial = record_of(trials, plan.key())
        if act is not None and trial is not None and self.reference is not None and trial.activation_bytes:
            self.scaling.observe(plan.key(), act, size, trial.activation_bytes, self.reference)
        elif act is not None and reference is not None and reference[1]:
            self.scaling.observe(plan.key(), act, size, reference[1], reference[0])
        predicted = self.predicted_value(plan.key(), trials, size)
        value = self.budget.value_of(peak, act)
        if predicted is not None and value is not None:
            self._excess = max(self._excess, value - (predicted - self._excess))
        self._read_plans[plan.key()] = (size, act, peak)
        self._covered = size if self._covered is None else self._covered.covering(size)

    def step_skipped(self) -> None:
        """The step being read was skipped (``training_step`` returned None): read the next one in its place."""
        self.reader.abandon()
        self._since_read = max(self._since_read, self.config.every)

    @property
    def done(self) -> bool:
        """The steps after lock-in are all read (later, only larger batches and the periodic ones are)."""
        return self._left <= 0

    def over_budget(self, check: StepCheck, plan: Plan, trials: Sequence[TrialRecord], view: ModelView) -> Plan | None:
        """Act on a step over the budget as ``on_budget_exceeded`` says: the plan to switch to, or None to go on."""
        budget = self.budget
        value = budget.value_of(check.peak_bytes, check.activation_bytes) or 0
        size, seq = check.batch_dims
        message = (
            f"lightning_ckpt: a real training step (step {check.step}, batch {size} x {seq}) used "
            f"{format_bytes(value)} of {_what(budget)}, over the budget of {budget.description}, under plan {plan.describe()}."
        )
        at = self._read_plans.get(plan.key(), (None, None, None))[0]
        return self._act("over_budget", message, plan, trials, view, at=at, reference=self.reference)

    def near_refusal(self, check: StepCheck, plan: Plan, trials: Sequence[TrialRecord], view: ModelView) -> Plan | None:
        """A step within the budget that the allocator served only by releasing its cache: the card is one fragmented
        cache away from refusing a step whose allocated bytes fit. Switched away from before that step, or warned."""
        if not check.alloc_retries:
            return None
        reserved = f", reserved peak {format_bytes(check.reserved_peak_bytes)}" if check.reserved_peak_bytes else ""
        message = (
            f"lightning_ckpt: a real training step (step {check.step}) fitted the budget, but the allocator had to "
            f"release its cache {check.alloc_retries} time(s) to find room{reserved}: the card is near refusing a step "
            f"whose allocated bytes fit (fragmentation) under plan {plan.describe()}."
        )
        if self.config.on_budget_exceeded != "switch":
            rank_zero_warn(
                f"{message} Continuing with this one (on_budget_exceeded={self.config.on_budget_exceeded!r})."
            )
            return None
        return self._act("near_refusal", message, plan, trials, view)

    def _act(
        self, why: str, text: str, plan: Plan, trials: Sequence[TrialRecord], view: ModelView, **sizes: BatchSize | None
    ) -> Plan | None:
        """Raise, warn, or switch to the plan ``lower_plan`` finds (None: stay), as ``on_budget_exceeded`` says;
        ``plan`` is left behind for good once a switch is attempted. ``sizes``: ``at`` and ``reference``, to predict
        each trial's memory at the batch at hand."""
        fix, going_on, switching = _ACTIONS[why]
        if self.config.on_budget_exceeded == "raise":
            raise InfeasibleBudgetError(
                f"{text} {fix} guard={{'on_budget_exceeded': 'switch'}} to move to a lower-memory plan."
            )
        if self.config.on_budget_exceeded == "warn":
            rank_zero_warn(f"{text} {going_on.capitalize()} (on_budget_exceeded='warn').")
            return None
        self._left_behind.add(plan.key())
        known = None not in (sizes.get("at"), sizes.get("reference"))
        predict = partial(self._scaled, **sizes) if known else None
        excess, exclude = self._excess, self._left_behind
        lower = lower_plan(plan, trials, self.budget, view.stacks, excess=excess, exclude=exclude, predict=predict)
        if lower is None:
            rank_zero_warn(f"{text} No plan using less memory is left; {going_on}.")
            return None
        rank_zero_warn(f"{text} Switching to {lower.describe()} {switching}(on_budget_exceeded='switch').")
        return lower


# Why the guard acts: the fix a raise names, how it goes on under "warn", and when a switch happens.
_ACTIONS = {
    "before_forward": (
        "Raise the budget, declare the longest batch so the search covers it, or set",
        "running it with this one",
        "before it runs ",
    ),
    "over_budget": ("Raise the budget, or set", "continuing with this one", ""),
    "near_refusal": ("", "continuing with this one", "before the next step "),
}


def _what(budget: Budget) -> str:
    return "activation memory" if budget.kind == "activation" else "peak memory"
