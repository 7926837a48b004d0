"""Joint search of checkpointing plan and micro-batch size at a fixed global batch.

Memory freed by checkpointing can buy a larger micro-batch, and a larger micro-batch often runs
more samples per second than the recompute costs. The user's optimisation is kept exactly: the
global batch per optimizer step (micro-batch x gradient accumulation) is fixed, the micro-batch
is a divisor of it, and for each micro-batch the best plan is searched as usual.

Memory is predicted, never discovered by crashing: activations grow linearly with the micro-batch
while parameters, gradients and optimizer state do not, so two memory-safe profiles (at the user's
micro-batch and at half of it) give an affine model per plan that prunes every (plan, micro-batch)
combination predicted over budget before anything runs.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_ckpt.budget import Budget, RequestedBudget
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.memory.optimizer_measure import measure_optimizer_step
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory
from lightning_ckpt.memory.profile import profile_memory
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.confirm import (
    ConfirmEntry,
    SideBySide,
    apply_confirmation,
    beats_by,
    confirm_interleaved,
    holdout,
    reported_verdict,
    retimer,
)
from lightning_ckpt.search.records import (
    ProgressFn,
    TrialRecord,
    TuneResult,
    announce_confirmation,
    choose_plan,
)
from lightning_ckpt.search.runners import TrialRunner
from lightning_ckpt.search.tune import Prepared, build_runner, tune
from lightning_ckpt.search.verdict import Verdict

__all__ = ["MicroBatchResult", "ScaledMemoryModel", "divisors", "resize_batch", "tune_micro_batch"]


def divisors(n: int) -> list[int]:
    """Micro-batch sizes that split a global batch of ``n`` evenly, ascending."""
    if n < 1:
        raise ConfigurationError(f"The global batch must be a positive number of samples, but got {n}.")
    return [d for d in range(1, n + 1) if n % d == 0]


def resize_batch(batch: Any, base: int, size: int) -> Any:
    """``batch`` with ``size`` samples: tensors whose first dimension is ``base`` are cut or tiled.

    Step time and memory of dense models do not depend on the values, so repeating the first
    batch's samples measures a larger micro-batch honestly without drawing more data.
    """

    def fit(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != base:
            return t
        if size <= base:
            return t[:size]
        reps = -(-size // base)
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:size]

    return tree_map(fit, batch)


@dataclass(frozen=True)
class ScaledMemoryModel:
    """A plan's memory at micro-batch ``m``, affine between two profiles (``small`` < ``large`` samples)."""

    small: Any
    large: Any
    small_size: int
    large_size: int
    size: int

    def at(self, size: int) -> ScaledMemoryModel:
        return replace(self, size=size)

    def _scale(self, a: int, b: int) -> int:
        slope = (b - a) / (self.large_size - self.small_size)
        return int(round(b + slope * (self.size - self.large_size)))

    def predict_peak(self, plan: Plan) -> int:
        return self._scale(self.small.predict_peak(plan), self.large.predict_peak(plan))

    def predict_activation(self, plan: Plan) -> int:
        return self._scale(self.small.predict_activation(plan), self.large.predict_activation(plan))

    @property
    def reserve_overhead_bytes(self) -> int:
        """The allocator's reserve above allocated memory (CUDA), scaled like the peak: the cap's headroom."""
        small = getattr(self.small, "reserve_overhead_bytes", 0)
        large = getattr(self.large, "reserve_overhead_bytes", 0)
        return max(0, self._scale(small, large))

    def can_run(self, plan: Plan) -> str | None:
        return self.large.can_run(plan)

    @property
    def inert_blocks(self) -> tuple[str, ...]:
        return self.large.inert_blocks

    def plannable_stacks(self, stacks: Any) -> Any:
        return self.large.plannable_stacks(stacks)

    def table(self) -> str:
        return f"(scaled to micro-batch {self.size} from profiles at {self.small_size} and {self.large_size})\n" + (
            self.large.table()
        )

    def to_dict(self) -> dict[str, Any]:
        return {"scaled_to": self.size, "profiled_at": [self.small_size, self.large_size], **self.large.to_dict()}


@dataclass(frozen=True)
class MicroBatchResult:
    """The chosen (plan, micro-batch, accumulation) and every trial that led there."""

    result: TuneResult  # all trials of all micro-batches; result.best carries the micro_batch metadata
    micro_batch: int
    accumulation: int
    global_batch: int
    per_micro_batch: Mapping[int, TuneResult] = field(default_factory=dict)
    skipped: Mapping[int, str] = field(default_factory=dict)  # micro-batch -> why it was not searched


@without_kv_cache
def tune_micro_batch(
    model: nn.Module,
    loss_fn_for: Callable[[int], Callable[[], Any]],
    *,
    base_micro_batch: int,
    global_batch: int,
    micro_batches: Sequence[int] | None = None,
    max_memory: int | float | str | RequestedBudget | None = None,
    activation_budget: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    progress: ProgressFn | None = None,
    extra_for: Callable[[int], tuple[Any, ...]] = lambda m: (),
    config: TuneConfig | None = None,
    **settings: Any,
) -> MicroBatchResult:
    """Search (plan, micro-batch) for the most samples/s within the budget at a fixed global batch.

    ``loss_fn_for(m)`` returns a zero-argument function running the forward on a batch of ``m``
    samples and returning the loss. The budget is resolved at ``base_micro_batch`` (the user's), so
    ``activation_budget`` means a fraction of *the user's* no-checkpointing activation memory.
    ``config``/``settings`` as for ``tune``; ``n_trials`` is shared among the micro-batches.

    Each micro-batch is searched at a different moment, so comparing their winners' figures would
    compare moments as much as configurations. The choice is therefore made in a confirmation round
    (``confirm.confirm_interleaved``, on equal samples) between the ``confirm_top`` fastest micro-batches'
    winners and the reference a user would pick by hand: no checkpointing at the largest micro-batch
    where it fits. ``confirm_top=0`` chooses from the search figures alone.
    """
    config = (config or TuneConfig()).with_overrides(settings)
    requested = RequestedBudget.of(max_memory, activation_budget)  # a bad budget fails before any step runs
    candidates = _checked_micro_batches(micro_batches, global_batch)
    started = time.perf_counter()
    resolved = ModelView.of(model, config.block_types)
    scaled, opt_mem = _scaled_profiles(resolved, loss_fn_for, extra_for, optimizer, base_micro_batch)
    none_at_base = scaled.at(base_micro_batch).predict_activation(Plan())
    budget = requested.resolve(device=resolved.device, none_activation_bytes=none_at_base)

    feasible, skipped = _feasible_micro_batches(candidates, scaled, opt_mem, budget, resolved.stacks, global_batch)
    per_m_config = replace(
        config, n_trials=max(3, config.n_trials // len(feasible)), on_infeasible="fallback", holdout_rounds=0
    )  # the joint choice is held out, not each micro-batch's
    per_m = _search_each(
        model,
        loss_fn_for,
        feasible,
        per_m_config,
        scaled,
        budget,
        opt_mem,
        optimizer,
        extra_for,
        progress,
        global_batch,
    )

    trials = _joint_trials(per_m, global_batch)
    before = sum(t.steps for t in trials)
    entries = _confirmation_entries(trials, model, resolved, loss_fn_for, extra_for, optimizer, config)
    trials, side = _confirmed(trials, entries, config, progress)
    tie = config.tie_tolerance
    # The Study's own choice and fallback, over every micro-batch's trials at once, by the same verdicts.
    best, fell_back, fallback_message = choose_plan(
        lambda: trials,
        budget,
        tie_tolerance=tie,
        on_infeasible=config.on_infeasible,
        nothing_fits=lambda _: f"No (plan, micro-batch) combination fits the budget ({budget.description}).",
        beats=beats_by(side, tie),
    )
    verdict = reported_verdict(side, trials, best, tie)
    if not fell_back:
        best, trials, verdict = _held_out(best, trials, side, entries, config, verdict)
    m = int(best.micro_batch or base_micro_batch)
    spec = {"size": m, "accumulation": global_batch // m, "global": global_batch, "original_size": base_micro_batch}
    result = TuneResult(
        best=_chosen_plan(best, per_m[m].best, {**spec, "tie_tolerance": tie}, verdict),
        best_trial=best,
        trials=tuple(trials),
        budget=budget,
        tuning_seconds=time.perf_counter() - started,
        tuning_steps=sum(r.tuning_steps for r in per_m.values()) + sum(t.steps for t in trials) - before,
        fell_back=fell_back,
        fallback_message=fallback_message,
        memory_table=scaled.at(m).table(),
        memory_breakdown=scaled.at(m).to_dict(),
    )
    return MicroBatchResult(result, m, global_batch // m, global_batch, per_m, skipped)


def _checked_micro_batches(micro_batches: Sequence[int] | None, global_batch: int) -> list[int]:
    """The micro-batches to search, ascending: every divisor of the global batch unless the user listed some."""
    candidates = sorted(micro_batches or divisors(global_batch))
    bad = [m for m in candidates if m < 1 or global_batch % m]
    if bad:
        raise ConfigurationError(
            f"Micro-batch sizes {bad} do not divide the global batch {global_batch}; choose divisors of it "
            f"({', '.join(map(str, divisors(global_batch)))})."
        )
    return candidates


def _scaled_profiles(
    resolved: ModelView,
    loss_fn_for: Callable[[int], Callable[[], Any]],
    extra_for: Callable[[int], tuple[Any, ...]],
    optimizer: torch.optim.Optimizer | None,
    base_micro_batch: int,
) -> tuple[ScaledMemoryModel, OptimizerStepMemory]:
    """Two memory-safe profiles (the user's micro-batch and half of it) as one model scaled to any micro-batch,
    and the optimizer step's memory, which does not grow with the micro-batch: measured once, shared by all."""
    root, stacks = resolved.root, resolved.stacks
    small_size = max(1, base_micro_batch // 2) if base_micro_batch > 1 else 2
    profile = {
        size: profile_memory(root, loss_fn_for(size), stacks=stacks, optimizer=optimizer, extra=extra_for(size))
        for size in sorted({base_micro_batch, small_size})
    }
    opt_mem = (
        measure_optimizer_step(root, optimizer, device=resolved.device, extra=extra_for(base_micro_batch))
        if optimizer is not None
        else OptimizerStepMemory.absent()
    )
    lo, hi = min(profile), max(profile)
    return ScaledMemoryModel(profile[lo], profile[hi], lo, hi, base_micro_batch), opt_mem


def _search_each(
    model: nn.Module,
    loss_fn_for: Callable[[int], Callable[[], Any]],
    feasible: Sequence[int],
    config: TuneConfig,
    scaled: ScaledMemoryModel,
    budget: Budget,
    opt_mem: OptimizerStepMemory,
    optimizer: torch.optim.Optimizer | None,
    extra_for: Callable[[int], tuple[Any, ...]],
    progress: ProgressFn | None,
    global_batch: int,
) -> dict[int, TuneResult]:
    """One ``tune`` per feasible micro-batch, sharing the budget, the scaled profile and the optimizer step;
    largest micro-batches first: they are the ones checkpointing can unlock."""
    per_m: dict[int, TuneResult] = {}
    streamed = itertools.count()
    for m in sorted(feasible, reverse=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # per-micro-batch fall-backs are judged jointly
            per_m[m] = tune(
                model,
                loss_fn_for(m),
                optimizer=optimizer,
                config=config,
                prepared=Prepared(scaled.at(m), budget, opt_mem),
                batch_size=m,
                extra_tensors=extra_for(m),
                progress=_labelled(progress, m, global_batch, streamed),
            )
    return per_m


def _joint_trials(per_m: Mapping[int, TuneResult], global_batch: int) -> list[TrialRecord]:
    """Every micro-batch's trials in one list, numbered on and labelled with their micro-batch. Confirmations
    within one micro-batch are dropped: the joint choice compares only figures re-timed side by side."""
    trials: list[TrialRecord] = []
    for m, res in per_m.items():
        for t in res.trials:
            label = f"{t.label} [micro-batch {m} x{global_batch // m}]"
            joint = dict(micro_batch=m, accumulation=global_batch // m, confirmation_seconds=())
            trials.append(replace(t, number=len(trials), label=label, **joint))
    return trials


def _confirmed(
    trials: list[TrialRecord], entries: Sequence[ConfirmEntry], config: TuneConfig, progress: ProgressFn | None
) -> tuple[list[TrialRecord], SideBySide | None]:
    """``trials`` with ``entries`` re-timed side by side until the verdicts are decided, and those rounds."""
    if not entries:
        return trials, None
    announce_confirmation(progress, [e.trial for e in entries])
    side = confirm_interleaved(
        entries,
        min_rounds=config.confirm_rounds,
        max_rounds=config.confirm_max_rounds,
        tie_tolerance=config.tie_tolerance,
    )
    return apply_confirmation(trials, entries, side.per_sample), side


def _held_out(
    best: TrialRecord,
    trials: list[TrialRecord],
    side: SideBySide | None,
    entries: Sequence[ConfirmEntry],
    config: TuneConfig,
    verdict: Verdict | None,
) -> tuple[TrialRecord, list[TrialRecord], Verdict | None]:
    """The joint choice held out as a single search's is (``confirm.holdout``): the chosen (plan, micro-batch) and
    the reference in fresh rounds; the reference is kept where they do not find the choice faster."""
    by_number = {e.trial.number: e for e in entries}
    held, reference, fresh = holdout(
        best,
        trials,
        side,
        lambda t: by_number[t.number],
        rounds=config.holdout_rounds,
        tie_tolerance=config.tie_tolerance,
    )
    if reference is None:
        return best, trials, verdict
    now = {t.number: t for t in held}
    kept = now[best.number] if fresh is not None and fresh.wins else now[reference.number]
    return kept, held, fresh


def _chosen_plan(best: TrialRecord, searched: Plan, micro_batch: Mapping[str, Any], verdict: Verdict | None) -> Plan:
    """The chosen plan with its micro-batch's search metadata (``searched``: that search's chosen plan), its
    own figures, the micro-batch spec and the joint confirmation's verdict (across micro-batches: the one that
    chose; without a joint confirmation, none)."""
    base = searched if searched == best.plan else best.plan
    measured = {
        "label": best.label,
        "samples_per_second": best.samples_per_second,
        "peak_bytes": best.peak_bytes,
        "activation_bytes": best.activation_bytes,
        "predicted_peak_bytes": best.predicted_peak_bytes,
    }
    search = {k: v for k, v in searched.metadata.items() if k not in ("measured",)}
    inner = {k: v for k, v in (search.get("search") or {}).items() if k != "verdict"}
    search["search"] = {**inner, **({"verdict": verdict.to_dict()} if verdict is not None else {})}
    return base.with_metadata(**search, measured=measured, micro_batch=dict(micro_batch))


def _feasible_micro_batches(
    candidates: Sequence[int],
    scaled: ScaledMemoryModel,
    opt_mem: OptimizerStepMemory,
    budget: Budget,
    stacks: Sequence[Any],
    global_batch: int,
) -> tuple[list[int], dict[int, str]]:
    """The micro-batches where at least full checkpointing is predicted to fit, and why the others are not."""
    lowest = uniform_plan(stacks, BlockPlan("full"))
    feasible, skipped = [], {}
    for m in candidates:
        model_m = scaled.at(m)
        lowest_peak = opt_mem.real_peak(model_m.predict_peak(lowest))
        if not budget.fits(lowest_peak, model_m.predict_activation(lowest)):
            skipped[m] = (
                f"even full checkpointing is predicted over budget "
                f"(activation {model_m.predict_activation(lowest)}, real-step peak {lowest_peak} bytes)"
            )
        else:
            feasible.append(m)
    if not feasible:
        raise InfeasibleBudgetError(
            f"No micro-batch of the global batch {global_batch} fits the budget ({budget.description}) even with "
            "full checkpointing. Raise the budget or reduce the global batch."
        )
    return feasible, skipped


def _confirmation_entries(
    trials: Sequence[TrialRecord],
    model: nn.Module,
    resolved: ModelView,
    loss_fn_for: Callable[[int], Callable[[], Any]],
    extra_for: Callable[[int], tuple[Any, ...]],
    optimizer: Any,
    config: TuneConfig,
) -> list[ConfirmEntry]:
    """The leading (plan, micro-batch) pairs to re-time side by side, each through its micro-batch's runner.

    Candidates: the winner of each of the ``confirm_top`` fastest micro-batches, plus no checkpointing at
    the largest micro-batch where it fits (what tuning must beat). Equal samples, not equal steps: a small
    micro-batch's steps are short, and timing only a few of them would give it a noisier window.
    """
    feasible = [t for t in trials if t.feasible and t.samples_per_second]
    if config.confirm_top <= 0 or not feasible:
        return []
    best_of: dict[int, TrialRecord] = {}
    for t in sorted(feasible, key=lambda t: -(t.samples_per_second or 0.0)):
        best_of.setdefault(int(t.micro_batch or 0), t)
    chosen = sorted(best_of.values(), key=lambda t: -(t.samples_per_second or 0.0))[: config.confirm_top]
    reference = max((t for t in feasible if t.plan.is_empty), key=lambda t: t.micro_batch or 0, default=None)
    if reference is not None and all(t.number != reference.number for t in chosen):
        chosen.append(reference)
    if len(chosen) < 2:
        return []
    samples = config.measure_steps * max(int(t.micro_batch or 1) for t in chosen)
    runners: dict[int, TrialRunner] = {}
    entries = []
    for t in chosen:
        m = int(t.micro_batch or 1)
        if m not in runners:
            harness = StepHarness(resolved.root, loss_fn_for(m), resolved.device, optimizer, extra_for(m), m)
            runners[m] = build_runner(resolved, harness, config, compiled=None)
        steps = -(-samples // m)
        entries.append(ConfirmEntry(t, retimer(runners[m], t.plan, steps), m, steps + 1))
    return entries


def _labelled(
    progress: Callable[[TrialRecord, Budget], None] | None, m: int, global_batch: int, numbers: Iterator[int]
) -> Any:
    """``progress`` for one micro-batch's search: its trials labelled with the micro-batch and numbered on
    from the searches before it (``numbers``), as in the joint result, so streamed series do not overlap."""
    if progress is None:
        return None

    def report(trial: TrialRecord, budget: Budget) -> None:
        label = f"{trial.label} [micro-batch {m} x{global_batch // m}]"
        progress(replace(trial, label=label, number=next(numbers)), budget)

    return report
