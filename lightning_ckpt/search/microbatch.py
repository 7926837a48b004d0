"""Joint search of checkpointing plan and micro-batch size at a fixed global batch.

Memory freed by checkpointing can buy a larger micro-batch, which often runs more samples per second than the
recompute costs. The user's optimisation is kept exactly: the global batch per optimizer step (micro-batch x gradient
accumulation) is fixed, and the micro-batch is a divisor of it.

Memory is predicted, never discovered by crashing: activations grow linearly with the micro-batch while parameters,
gradients and optimizer state do not, so two memory-safe profiles (at the user's micro-batch and at half of it) give
an affine model per plan that prunes every (plan, micro-batch) predicted over budget before anything runs. A block's
seconds are affine in the micro-batch too, so each micro-batch gets a time model from the same two profiles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_ckpt.budget import Budget, RequestedBudget
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError
from lightning_ckpt.measure.allocator import start_expandable_segments
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory, RealStepMemory
from lightning_ckpt.memory.profile import profile_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.plan.provenance import MicroBatch
from lightning_ckpt.search.compile import CompiledTrials
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.distributed import LocalSync
from lightning_ckpt.search.phases import Phases
from lightning_ckpt.search.pipeline import SearchHooks, conclude, run_search
from lightning_ckpt.search.result import TuneResult
from lightning_ckpt.search.setup import lowest_memory_pass, resolve_budget, search_session
from lightning_ckpt.search.trials import Workload
from lightning_ckpt.search.tune import (
    PROFILE_STEPS,
    WRITE_CHECK_STEPS,
    build_runner,
    check_tunable,
    harness_for,
    optimizer_step_memory,
    space_modes,
)
from lightning_ckpt.timing.model import BlockTime, TimeModel

__all__ = ["MicroBatchResult", "ScaledMemoryModel", "ScaledTimeModel", "divisors", "resize_batch", "tune_micro_batch"]


def divisors(n: int) -> list[int]:
    """Micro-batch sizes that split a global batch of ``n`` evenly, ascending."""
    if n < 1:
        raise ConfigurationError(f"The global batch must be a positive number of samples, but got {n}.")
    return [d for d in range(1, n + 1) if n % d == 0]


def resize_batch(batch: Any, base: int, size: int) -> Any:
    """``batch`` with ``size`` samples: tensors whose first dimension is ``base`` cut or tiled (a dense model's step
    time and memory do not depend on the values)."""

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
        scaled = f"(scaled to micro-batch {self.size} from profiles at {self.small_size} and {self.large_size})"
        return f"{scaled}\n{self.large.table()}"

    def to_dict(self) -> dict[str, Any]:
        return {"scaled_to": self.size, "profiled_at": [self.small_size, self.large_size], **self.large.to_dict()}


@dataclass(frozen=True)
class MicroBatchResult:
    """The chosen (plan, micro-batch, accumulation) and every trial that led there (one search: ``result``)."""

    result: TuneResult  # every (plan, micro-batch) trial; result.best.provenance.micro_batch
    micro_batch: int
    accumulation: int
    global_batch: int
    skipped: Mapping[int, str] = field(default_factory=dict)  # micro-batch -> why it was not searched


@without_kv_cache
def tune_micro_batch(
    model: nn.Module,
    loss_fn_for: Callable[[int], Callable[[], Any]],
    *,
    base_micro_batch: int,
    global_batch: int,
    max_memory: int | float | str | RequestedBudget | None = None,
    activation_budget: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra_for: Callable[[int], tuple[Any, ...]] = lambda m: (),
    config: TuneConfig | None = None,
    hooks: SearchHooks | None = None,
) -> MicroBatchResult:
    """Search (plan, micro-batch) pairs, compared per sample, for the most samples/s within the budget at a fixed
    global batch; the chosen plan carries its micro-batch in ``provenance.micro_batch``.

    ``loss_fn_for(m)`` returns a zero-argument function running the forward on ``m`` samples and returning the loss.
    The budget is resolved at ``base_micro_batch`` (the user's): ``activation_budget`` is a fraction of *the user's*
    no-checkpointing activations. ``config`` and ``hooks`` as for ``tune``; ``config.micro_batches``: the sizes tried
    (None: every divisor of ``global_batch``).
    """
    config, hooks = config or TuneConfig(), hooks or SearchHooks()
    requested = RequestedBudget.of(max_memory, activation_budget)  # a bad budget fails before any step runs
    sizes = _checked_micro_batches(config.micro_batches, global_batch)
    started = time.perf_counter()
    start_expandable_segments()  # as ``tune``: only while CUDA has not started
    resolved = ModelView.of(model, config.block_types)
    check_tunable(resolved)
    with search_session(resolved, config.clock) as session:  # the set-up and tear-down ``tune`` has, the same code

        def step_for(m: int) -> Callable[[], Any]:
            return session.python_state.restoring(loss_fn_for(m))

        session.check_parameter_writes(step_for(base_micro_batch))
        with session.phases.timing("profile"):
            profile = partial(_scaled_profiles, resolved, step_for, extra_for, optimizer, base_micro_batch, config)
            scaled, times, opt_mem, tracked = lowest_memory_pass("the memory profile", session.began, resolved, profile)
        sync = hooks.sync or LocalSync()
        at_base = RealStepMemory(scaled.at(base_micro_batch), opt_mem)
        budget = sync.broadcast(resolve_budget(requested, at_base, None, resolved, sync))  # as ``tune``'s
        feasible, skipped = _feasible_micro_batches(sizes, scaled, opt_mem, budget, resolved.stacks, global_batch)

        def workload(m: int) -> Workload:  # its runner built complete, with its micro-batch's memory model
            harness = harness_for(resolved, step_for(m), optimizer, extra_for(m), config, m)
            headroom = scaled.at(m).reserve_overhead_bytes
            runner = build_runner(resolved, harness, config, compiled=None, reserve_headroom=headroom)
            memory, accumulation = RealStepMemory(scaled.at(m), opt_mem), global_batch // m
            return Workload(runner, memory, m, m, accumulation, tracked_step_seconds=tracked(m))

        workloads = [workload(m) for m in sorted(feasible, reverse=True)]  # largest first: checkpointing unlocks them
        timing = {m: times.at(m) for m in feasible} if times is not None else None
        result = _search(resolved, workloads, budget, config, timing, scaled, opt_mem, hooks, session.phases)
    m = int(result.best_trial.micro_batch or base_micro_batch) if result.best_trial is not None else base_micro_batch
    spec = MicroBatch(m, global_batch // m, global_batch, base_micro_batch, config.tie_tolerance)
    run = {**result.best.provenance.run, "batch_size": m}  # the step the plan runs: the chosen micro-batch
    allocator = {"allocator": session.allocator.to_dict()} if session.allocator is not None else {}  # as tune
    best = result.best.with_provenance(**allocator, micro_batch=spec, run=run)
    at_m = {"memory_table": scaled.at(m).table(), "memory_breakdown": scaled.at(m).to_dict()}
    result = replace(result, best=best, tuning_seconds=time.perf_counter() - started, **at_m)
    return MicroBatchResult(result, m, global_batch // m, global_batch, skipped)


def _search(
    resolved: ModelView,
    workloads: list[Workload],
    budget: Budget,
    config: TuneConfig,
    timing: Mapping[int, TimeModel] | None,
    scaled: ScaledMemoryModel,
    opt_mem: OptimizerStepMemory,
    hooks: SearchHooks,
    phases: Phases,
) -> TuneResult:
    """The one search over every (plan, micro-batch), by each micro-batch's time model (``timing``; None: sampled)."""
    is_compiled = isinstance(workloads[0].runner, CompiledTrials)
    space = config.search_space.for_device(resolved.device.type)
    space = workloads[0].runner.adapt(space) if is_compiled else space
    sizes = sorted(w.micro_batch for w in workloads)
    run = {"device": resolved.device.type, "compiled": is_compiled, "micro_batches": sizes}
    search = run_search(
        resolved,
        workloads,
        space,
        budget,
        config,
        timing=timing,
        memory_model=scaled,
        hooks=hooks,
        run=run,
        phases=phases,
    )
    run = {"device": str(resolved.device), "micro_batches": sizes, "compiled": is_compiled}
    return conclude(
        search,
        extra_steps=2 * PROFILE_STEPS + WRITE_CHECK_STEPS + search.warm_steps,
        sections={"optimizer_step": opt_mem.to_dict(), "run": run},
    )


def _checked_micro_batches(micro_batches: Sequence[int] | None, global_batch: int) -> list[int]:
    """The micro-batches to search, ascending (default: every divisor of the global batch)."""
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
    step_for: Callable[[int], Callable[[], Any]],
    extra_for: Callable[[int], tuple[Any, ...]],
    optimizer: torch.optim.Optimizer | None,
    base_micro_batch: int,
    config: TuneConfig,
) -> tuple[ScaledMemoryModel, ScaledTimeModel | None, OptimizerStepMemory, Callable[[int], float | None]]:
    """Two memory-safe profiles (the user's micro-batch and half of it) as one memory model scaled to any micro-batch
    (and one time model likewise, where it proposes), the optimizer step's memory, and the tracked step's seconds at
    any micro-batch (the larger profile's, in proportion above it)."""
    timed = config.predict_time and config.sampler is None and not (resolved.compiled or config.compiled)
    time_modes = space_modes(config.search_space.for_device(resolved.device.type), resolved) if timed else False
    small_size = max(1, base_micro_batch // 2) if base_micro_batch > 1 else 2
    profiles = {
        size: profile_step(
            resolved.root,
            step_for(size),
            stacks=resolved.stacks,
            optimizer=optimizer,
            extra=extra_for(size),
            time_blocks=time_modes,
        )
        for size in sorted({base_micro_batch, small_size})
    }
    opt_mem = optimizer_step_memory(resolved, optimizer, extra_for(base_micro_batch))
    lo, hi = min(profiles), max(profiles)
    small_time, large_time = profiles[lo].time, profiles[hi].time
    times = ScaledTimeModel(small_time, large_time, lo, hi) if small_time is not None and large_time else None
    scaled = ScaledMemoryModel(profiles[lo].memory, profiles[hi].memory, lo, hi, base_micro_batch)
    seconds = profiles[hi].tracked_step_seconds

    def tracked(size: int) -> float | None:
        return seconds * max(1.0, size / hi) if seconds is not None else None

    return scaled, times, opt_mem, tracked


@dataclass(frozen=True)
class ScaledTimeModel:
    """Each block's seconds under each mode at any micro-batch, affine between two profiles' timings (``small`` <
    ``large`` samples, clamped at zero); the search calibrates each micro-batch's model to its own steps."""

    small: TimeModel
    large: TimeModel
    small_size: int
    large_size: int

    def at(self, size: int) -> TimeModel:
        t = (size - self.large_size) / (self.large_size - self.small_size)
        rows = []
        for a, b in zip(self.small.blocks, self.large.blocks, strict=True):
            keys = a.seconds.keys() & b.seconds.keys()
            seconds = {k: max(0.0, b.seconds[k] + t * (b.seconds[k] - a.seconds[k])) for k in keys}
            rows.append(BlockTime(b.fqn, seconds, b.shared_with))
        measured_at = {**self.large.measured_at, "batch_size": size}
        return TimeModel(tuple(rows), self.large.stacks, measured_at)


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
        peak, activation = opt_mem.real_peak(scaled.at(m).predict_peak(lowest)), scaled.at(m).predict_activation(lowest)
        if budget.fits(peak, activation):
            feasible.append(m)
        else:
            why = f"(activation {activation}, real-step peak {peak} bytes)"
            skipped[m] = f"even full checkpointing is predicted over budget {why}"
    if not feasible:
        raise InfeasibleBudgetError(
            f"No micro-batch of the global batch {global_batch} fits the budget ({budget.description}) even with "
            "full checkpointing. Raise the budget or reduce the global batch."
        )
    return feasible, skipped
