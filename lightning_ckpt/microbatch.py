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

import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_ckpt.budget import Budget, resolve_budget
from lightning_ckpt.caches import without_kv_cache
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError
from lightning_ckpt.optimizer_step import OptimizerStepMemory, measure_optimizer_step
from lightning_ckpt.plan import Plan
from lightning_ckpt.tune import TrialRecord, TuneResult, _loss_of, choose_best, tune

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

    def can_run(self, plan: Plan) -> str | None:
        return self.large.can_run(plan)

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
    max_memory: int | float | str | None = None,
    activation_budget: float | None = None,
    n_trials: int = 40,
    optimizer: torch.optim.Optimizer | None = None,
    on_infeasible: str = "fallback",
    tie_tolerance: float = 0.01,
    progress: Callable[[TrialRecord, Budget], None] | None = None,
    extra_for: Callable[[int], tuple[Any, ...]] = lambda m: (),
    confirm_top: int = 3,
    confirm_rounds: int = 3,
    **tune_kwargs: Any,
) -> MicroBatchResult:
    """Search (plan, micro-batch) for the most samples/s within the budget at a fixed global batch.

    ``loss_fn_for(m)`` returns a zero-argument function running the forward on a batch of ``m``
    samples and returning the loss. The budget is resolved at ``base_micro_batch`` (the user's), so
    ``activation_budget`` means a fraction of *the user's* no-checkpointing activation memory.

    Each micro-batch is searched at a different moment, so comparing their winners' figures would
    compare moments as much as configurations. The choice is therefore made in a confirmation round
    (``confirm_rounds`` interleaved rounds) between the ``confirm_top`` fastest micro-batches' winners
    and the reference a user would pick by hand: no checkpointing at the largest micro-batch where it
    fits. ``confirm_top=0`` chooses from the search figures alone.
    """
    from lightning_ckpt.discovery import discover_blocks, unwrap_compiled
    from lightning_ckpt.memory_model import profile_memory

    candidates = sorted(micro_batches or divisors(global_batch))
    bad = [m for m in candidates if m < 1 or global_batch % m]
    if bad:
        raise ConfigurationError(
            f"Micro-batch sizes {bad} do not divide the global batch {global_batch}; choose divisors of it "
            f"({', '.join(map(str, divisors(global_batch)))})."
        )
    started = time.perf_counter()
    root = unwrap_compiled(model)
    stacks = discover_blocks(root, block_types=tune_kwargs.get("block_types"))
    device = next(root.parameters()).device
    small_size = max(1, base_micro_batch // 2) if base_micro_batch > 1 else 2
    profile = {
        size: profile_memory(root, loss_fn_for(size), stacks=stacks, optimizer=optimizer, extra=extra_for(size))
        for size in sorted({base_micro_batch, small_size})
    }
    # The optimizer's state and step do not grow with the micro-batch: measured once, shared by every search.
    opt_mem = (
        measure_optimizer_step(root, optimizer, device=device, extra=extra_for(base_micro_batch))
        if optimizer is not None
        else OptimizerStepMemory(0, 0, 0, measured=False, note="no optimizer given")
    )
    lo, hi = min(profile), max(profile)
    scaled = ScaledMemoryModel(profile[lo], profile[hi], lo, hi, base_micro_batch)
    none_at_base = scaled.at(base_micro_batch).predict_activation(Plan())
    budget = resolve_budget(max_memory, activation_budget, device=device, none_activation_bytes=none_at_base)

    from lightning_ckpt.baselines import uniform_plan
    from lightning_ckpt.plan import BlockPlan

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
    # Largest micro-batches first: they are the ones checkpointing can unlock.
    per_trials = max(3, n_trials // len(feasible))
    per_m: dict[int, TuneResult] = {}
    for m in sorted(feasible, reverse=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # per-micro-batch fall-backs are judged jointly below
            per_m[m] = tune(
                root, loss_fn_for(m), optimizer=optimizer, n_trials=per_trials, memory_model=scaled.at(m),
                budget=budget, optimizer_step=opt_mem, batch_size=m, on_infeasible="fallback", tie_tolerance=tie_tolerance,
                extra_tensors=extra_for(m), progress=_labelled(progress, m, global_batch), **tune_kwargs,
            )  # fmt: skip

    trials: list[TrialRecord] = []
    for m, res in per_m.items():
        for t in res.trials:
            trials.append(
                replace(
                    t, number=len(trials), label=f"{t.label} [micro-batch {m} x{global_batch // m}]",
                    extra={**t.extra, "micro_batch": m, "accumulation": global_batch // m},
                )
            )  # fmt: skip
    confirmed = _confirm_across(
        trials, loss_fn_for, extra_for, root=root, optimizer=optimizer, top=confirm_top,
        rounds=confirm_rounds, steps=int(tune_kwargs.get("measure_steps", 3)),
    )  # fmt: skip
    original = {t.number: t for t in trials}
    if confirmed:
        trials = [confirmed.get(t.number, t) for t in trials]
    best = choose_best(trials, budget, tie_tolerance=tie_tolerance, confirmed_key="micro_batch_confirmation_seconds")
    fell_back = False
    if best is None:
        if on_infeasible == "raise":
            raise InfeasibleBudgetError(f"No (plan, micro-batch) combination fits the budget ({budget.description}).")
        m_min = min(per_m)
        best = next(t for t in trials if t.extra["micro_batch"] == m_min and t.plan == per_m[m_min].best)
        fell_back = True
    m = int(best.extra["micro_batch"])
    chosen_base = per_m[m].best if per_m[m].best == best.plan else best.plan
    chosen = chosen_base.with_metadata(
        **{k: v for k, v in per_m[m].best.metadata.items() if k not in ("measured",)},
        measured={"label": best.label, "samples_per_second": best.samples_per_second, "peak_bytes": best.peak_bytes,
                  "activation_bytes": best.activation_bytes, "predicted_peak_bytes": best.predicted_peak_bytes},
        micro_batch={"size": m, "accumulation": global_batch // m, "global": global_batch,
                     "original_size": base_micro_batch},
    )  # fmt: skip
    result = TuneResult(
        best=chosen,
        best_trial=best,
        trials=tuple(trials),
        budget=budget,
        tuning_seconds=time.perf_counter() - started,
        tuning_steps=sum(r.tuning_steps for r in per_m.values())
        + sum(t.steps - original[n].steps for n, t in confirmed.items()),
        fell_back=fell_back,
        memory_table=scaled.at(m).table(),
        memory_breakdown=scaled.at(m).to_dict(),
    )
    return MicroBatchResult(result, m, global_batch // m, global_batch, per_m, skipped)


def _confirm_across(
    trials: Sequence[TrialRecord], loss_fn_for: Callable[[int], Callable[[], Any]],
    extra_for: Callable[[int], tuple[Any, ...]], *, root: nn.Module, optimizer: Any, top: int, rounds: int,
    steps: int,
) -> dict[int, TrialRecord]:  # fmt: skip
    """Re-time the leading (plan, micro-batch) pairs side by side; trial number -> re-timed record.

    Candidates: the winner of each of the ``top`` fastest micro-batches, plus no checkpointing at the
    largest micro-batch where it fits (what tuning must beat). Memory is not re-measured.
    """
    from lightning_ckpt.apply import plan_applied
    from lightning_ckpt.measure import measure_step

    feasible = [t for t in trials if t.feasible and t.samples_per_second]
    if top <= 0 or not feasible:
        return {}
    per_m: dict[int, TrialRecord] = {}
    for t in sorted(feasible, key=lambda t: -(t.samples_per_second or 0.0)):
        per_m.setdefault(int(t.extra["micro_batch"]), t)
    chosen = sorted(per_m.values(), key=lambda t: -(t.samples_per_second or 0.0))[:top]
    reference = max((t for t in feasible if t.plan.is_empty), key=lambda t: t.extra["micro_batch"], default=None)
    if reference is not None and all(t.number != reference.number for t in chosen):
        chosen.append(reference)
    if len(chosen) < 2:
        return {}
    device = next(root.parameters()).device
    # Equal samples, not equal steps: a small micro-batch's steps are short, and timing only a few
    # of them would give it a shorter (noisier) window than a large one's.
    samples = steps * max(int(t.extra["micro_batch"]) for t in chosen)
    times: dict[int, list[float]] = {t.number: [] for t in chosen}
    timed_steps: dict[int, int] = {}
    for _ in range(rounds):
        for t in chosen:
            m = int(t.extra["micro_batch"])
            timed_steps[t.number] = -(-samples // m)
            loss_fn = loss_fn_for(m)
            with plan_applied(root, t.plan, check_fingerprint=False):
                meas = measure_step(lambda loss_fn=loss_fn: _loss_of(loss_fn()).backward(), model=root,
                                    optimizer=optimizer, warmup=1, steps=timed_steps[t.number], device=device,
                                    batch_size=m, track_memory=False, count_flops=False, extra=extra_for(m))  # fmt: skip
            if meas.status == "ok":
                times[t.number].append(meas.median_seconds)
    out = {}
    for t in chosen:
        if not times[t.number]:
            continue
        median = statistics.median(times[t.number])
        m = int(t.extra["micro_batch"])
        out[t.number] = replace(
            t, samples_per_second=m / median, median_seconds=median, steps=t.steps + rounds * (timed_steps[t.number] + 1),
            extra={**t.extra, "search_samples_per_second": t.samples_per_second,
                   "micro_batch_confirmation_seconds": times[t.number]},
        )  # fmt: skip
    return out


def _labelled(progress: Callable[[TrialRecord, Budget], None] | None, m: int, global_batch: int) -> Any:
    if progress is None:
        return None

    def report(trial: TrialRecord, budget: Budget) -> None:
        progress(replace(trial, label=f"{trial.label} [micro-batch {m} x{global_batch // m}]"), budget)

    return report
