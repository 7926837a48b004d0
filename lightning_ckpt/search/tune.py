"""``tune(model, step_fn)``: find the fastest checkpointing plan whose real training step fits a budget.

The model is resolved once; then, in order: the memory-safe profile, one measured optimizer step, the budget, and
the search (``pipeline``). The same engine runs inside the Lightning callback and from a plain script.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_ckpt.budget import RequestedBudget
from lightning_ckpt.measure.allocator import start_expandable_segments
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.memory.compiled import CompiledMemoryModel
from lightning_ckpt.memory.optimizer_measure import measure_optimizer_step
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory, RealStepMemory
from lightning_ckpt.memory.profile import profile_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import Plan, mode_key
from lightning_ckpt.search.compile import (
    CompiledTrials,
    compiled_search,
    compiled_space,
    compiled_target,
    eager_while_profiling,
)
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.distributed import LocalSync
from lightning_ckpt.search.pipeline import Search, SearchHooks, conclude, run_search
from lightning_ckpt.search.replan import profile_metadata
from lightning_ckpt.search.result import TuneResult
from lightning_ckpt.search.runners import EagerRunner, TrialRunner
from lightning_ckpt.search.sampler import error_summary, fitted
from lightning_ckpt.search.setup import SearchSession, lowest_memory_pass, resolve_budget, search_session
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.search.trials import Workload
from lightning_ckpt.search.whole_check import compiles_of, pt2_budget_check
from lightning_ckpt.versions import require_torch

__all__ = [
    "FSDP2_TUNING_VERIFIED",
    "PROFILE_STEPS",
    "WRITE_CHECK_STEPS",
    "build_runner",
    "check_tunable",
    "harness_for",
    "optimizer_step_memory",
    "space_modes",
    "tune",
]

log = logging.getLogger(__name__)

# The memory profile runs one no-grad capture forward and one anchor step (plus per-block passes
# that are each a fraction of a step); we count it as two steps of tuning cost.
PROFILE_STEPS = 2
# ``find_parameters_written_in_forward``: one forward without grad, under a dispatch mode.
WRITE_CHECK_STEPS = 1


def build_runner(
    resolved: ModelView, harness: StepHarness, config: TuneConfig, *, compiled: bool | None, reserve_headroom: int = 0
) -> TrialRunner:
    """``CompiledTrials`` for a compiled model, else an ``EagerRunner``; ``reserve_headroom``: added to the CUDA cap."""
    check_tunable(resolved)
    compiled_runner = compiled_search(
        resolved.model,
        harness,
        compiled=compiled,
        allow_graph_breaks=config.allow_graph_breaks,
        reserve_headroom_bytes=reserve_headroom,
        blocks=tuple(fqn for stack in resolved.stacks for fqn in stack.block_fqns),
    )
    if compiled_runner is not None:
        return compiled_runner
    return EagerRunner(harness, count_flops=config.count_flops, reserve_headroom_bytes=reserve_headroom)


def harness_for(
    resolved: ModelView,
    step_fn: Callable[[], Any],
    optimizer: torch.optim.Optimizer | None,
    extra: tuple[Any, ...],
    config: TuneConfig,
    batch_size: int,
    seq_len: int | None = None,
) -> StepHarness:
    """The harness that runs ``step_fn`` for the profile's passes and every trial, as ``config`` says to time it."""
    steps = {"warmup_steps": config.warmup_steps, "measure_steps": config.measure_steps, "clock": config.clock}
    return StepHarness(
        resolved.root, step_fn, resolved.device, optimizer, extra, batch_size, seq_len, **steps, view=resolved
    )


def optimizer_step_memory(
    resolved: ModelView, optimizer: torch.optim.Optimizer | None, extra: tuple[Any, ...]
) -> OptimizerStepMemory:
    """One ``optimizer.step()`` measured and undone (an OOM: infeasible), which does not grow with the batch."""
    if optimizer is None:
        return OptimizerStepMemory.absent()
    return measure_optimizer_step(resolved.root, optimizer, device=resolved.device, extra=extra)


def check_tunable(resolved: ModelView) -> None:
    """Refuse, before any step runs, a model this torch cannot tune (FSDP2 below ``FSDP2_TUNING_VERIFIED``)."""
    if resolved.sharded:
        require_torch(
            FSDP2_TUNING_VERIFIED,
            "Tuning a model sharded with FSDP2 (fully_shard)",
            "the per-rank memory model and the ranks' agreement are verified from torch 2.9 on; on 2.6 FSDP2 does "
            "not run on CPU and on 2.8 it trains differently from one process there, so trials could not be checked.",
            "tune once on torch>=2.9 and reuse the plan file with ActivationCheckpointTuner(plan=...) here",
        )


# The oldest torch on which the FSDP2 tests (tests/test_fsdp.py: per-rank memory, ranks agree, weights equal
# one process) pass; below it tuning a sharded model refuses, applying a saved plan does not.
FSDP2_TUNING_VERIFIED = (2, 9)


@without_kv_cache
def tune(
    model: nn.Module,
    step_fn: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    max_memory: int | float | str | RequestedBudget | None = None,
    activation_budget: float | None = None,
    config: TuneConfig | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    extra_tensors: tuple[Any, ...] = (),
    hooks: SearchHooks | None = None,
) -> TuneResult:
    """Search checkpointing plans for the highest measured throughput within a memory budget.

    ``step_fn`` runs the forward of one training step on a fixed batch and returns the loss; tune calls ``backward``
    on it (never an optimizer step), for the profile and every trial, and leaves the model exactly as it was: the
    caller applies ``result.best``. ``config`` (a ``TuneConfig``): the search's settings. ``max_memory`` may be a
    ``budget.RequestedBudget`` parsed already; on a GPU it is clamped to what the process may allocate, and no
    out-of-memory error gets out: a trial records it, and a pass that needs no more than the lowest-memory plan ends
    in ``InfeasibleBudgetError``.

    The budget covers the step as it runs after lock-in: with an ``optimizer``, one ``optimizer.step()`` is measured
    (and undone, ``optimizer_measure.py``) and a trial's peak is ``max(forward+backward peak + the state the first
    step creates, the optimizer step's peak)``. HF KV caches are off for the search (``caches.py``).

    ``hooks`` (``SearchHooks``): ``progress`` reports each trial; ``sync`` runs the search on several ranks in
    lockstep; ``should_stop`` is polled between trials and rounds (Lightning's SIGTERM flag): True ends the search
    with ``SearchInterrupted``, the model as it was. ``TuneConfig.compiled`` (default: detected): every trial compiles
    its plan, and plans that add graph breaks are ``conflict`` trials.

    The search is an Optuna study named ``result.study_name``, one trial per plan (objective ``samples_per_second``,
    the budget as a constraint, figures in user attributes; ``ledger.py``). With ``storage=`` it persists
    (``optuna.load_study(study_name=result.study_name, storage=result.storage)``), and a search started again on the
    same model and run resumes it instead of measuring again.
    """
    config = config or TuneConfig()
    requested = RequestedBudget.of(max_memory, activation_budget)  # a bad budget fails before any step runs
    start_expandable_segments()  # only while CUDA has not started (a model still on the host): see measure.allocator
    resolved = ModelView.of(model, config.block_types)
    with search_session(resolved, config.clock) as session:
        step_fn = session.python_state.restoring(step_fn)
        harness = harness_for(resolved, step_fn, optimizer, tuple(extra_tensors), config, batch_size or 1, seq_len)
        check_tunable(resolved)
        is_compiled = compiled_target(resolved.model, compiled=config.compiled) is not None
        with eager_while_profiling(is_compiled):
            session.check_parameter_writes(step_fn)
        return _search(resolved, harness, is_compiled, requested, config, hooks or SearchHooks(), session)


def _search(
    resolved: ModelView,
    harness: StepHarness,
    is_compiled: bool,
    requested: RequestedBudget,
    config: TuneConfig,
    hooks: SearchHooks,
    session: SearchSession,
) -> TuneResult:
    """Profile, resolve the budget, then run the search and conclude it, with what the plan file records."""
    space = config.search_space.for_device(resolved.device.type)
    if is_compiled:
        space = compiled_space(space, resolved.root)
    with session.phases.timing("profile"):
        profile = _profile(resolved, harness, space, is_compiled, session.began)
    # Built complete from the profile: the CUDA cap's headroom for the allocator's reserve, eager and compiled alike.
    runner = build_runner(
        resolved, harness, config, compiled=is_compiled, reserve_headroom=profile.memory.reserve_overhead_bytes
    )
    with session.phases.timing("optimizer_step"):
        optimizer_step = optimizer_step_memory(resolved, harness.optimizer, harness.extra)
    memory = RealStepMemory(profile.memory, optimizer_step)
    sync = hooks.sync or LocalSync()  # ``run_search``'s too
    budget = sync.broadcast(resolve_budget(requested, memory, runner, resolved, sync))
    profiled, predicts = profile.compiled, None  # None: the runner's own
    if is_compiled and profile.compiled is not None:
        # The blocks' compiled saved bytes anchored on the compiled ``none`` step (measured already: an activation
        # budget is a fraction of it); without that step (it failed) the eager model.
        none = runner.measure_compiled(Plan(fingerprint=resolved.fingerprint))
        predicts = none.ok and none.activation_bytes is not None
        if predicts:
            profiled = profile.compiled.anchored(none.activation_bytes, none.peak_bytes)
        memory = RealStepMemory(profiled if predicts else profile.compiled.eager, optimizer_step)
    # The model of GPU, not its index, bears on the figures: part of a study's identity.
    name = torch.cuda.get_device_name(resolved.device) if resolved.device.type == "cuda" else resolved.device.type
    run = {"seq_len": harness.seq_len, "device": name, "compiled": is_compiled}
    tracked = profile.tracked_step_seconds
    search = run_search(
        resolved,
        [Workload(runner, memory, harness.batch_size, predicts=predicts, tracked_step_seconds=tracked)],
        space,
        budget,
        config,
        timing=profile.time,
        memory_model=profile.memory,
        hooks=hooks,
        run=run,
        phases=session.phases,
    )
    sections = _sections(search, profile, memory, runner, harness, space, session)
    after_choice = None
    if isinstance(runner, CompiledTrials):
        after_choice = pt2_budget_check(search, runner, harness, config, sections, profiled)
    return conclude(
        search,
        extra_steps=PROFILE_STEPS + WRITE_CHECK_STEPS + search.warm_steps,
        sections=sections,
        memory=profile.memory,
        after_choice=after_choice,
    )


def _profile(
    resolved: ModelView, harness: StepHarness, space: SearchSpace, is_compiled: bool, began: int | None
) -> Any:
    """The memory-safe profile, its time model marked with the shape it was timed at (a compiled model's: its blocks
    compiled alone, so it predicts compiled steps)."""
    with eager_while_profiling(is_compiled):
        profile = lowest_memory_pass(
            "the memory profile",
            began,
            resolved,
            lambda: profile_step(
                resolved,
                harness.step_fn,
                optimizer=harness.optimizer,
                extra=harness.extra,
                time_blocks=space_modes(space, resolved),
                compiled_blocks=is_compiled,
            ),
        )
    if profile.time is None:
        return profile
    shape = {"batch_size": harness.batch_size, "seq_len": harness.seq_len, "compiled": is_compiled}
    return profile.with_time(replace(profile.time, measured_at={**profile.time.measured_at, **shape}))


def _sections(
    search: Search,
    profile: Any,
    memory: RealStepMemory,
    runner: TrialRunner,
    harness: StepHarness,
    space: SearchSpace,
    session: SearchSession,
) -> dict[str, Any]:
    """The plan file's sections beyond the chosen plan's evidence, among them the profile as the search fitted it (a
    later budget re-plans from it; a compiled one is kept apart, as ``replan`` predicts eager steps)."""
    is_compiled = isinstance(runner, CompiledTrials)
    regions = list(runner.regions) if is_compiled else None
    run = {"device": str(harness.device), "batch_size": harness.batch_size, "seq_len": harness.seq_len}
    sections: dict[str, Any] = {"optimizer_step": memory.optimizer.to_dict(), "run": {**run, "compiled": regions}}
    if session.allocator is not None:
        sections["allocator"] = session.allocator.to_dict()
    if isinstance(memory.model, CompiledMemoryModel):
        # How far the compiled memory predictions were from the compiled steps measured (of the activation bytes).
        measured = [t for t in search.records if t.memory_measured and t.predicted_activation_bytes is not None]
        errors = [t.predicted_activation_bytes / t.activation_bytes - 1.0 for t in measured if t.activation_bytes]
        sections["compiled_blocks"] = {**memory.model.to_dict(), "activation_errors": error_summary(errors)}
    if is_compiled:
        sections["compiles"] = compiles = compiles_of(runner, profile.compiled)
        session.phases.moved(compiles["profile_seconds"], "profile", "compile")
        session.phases.moved(compiles["trial_seconds"], "trials", "compile")
    time_model = fitted(search.sampler)
    if time_model is not None:
        sections["compiled_profile" if is_compiled else "profile"] = profile_metadata(
            profile.with_time(time_model),
            memory.optimizer,
            search.stacks,
            space,
            batch_size=harness.batch_size,
            seq_len=harness.seq_len,
            tie_tolerance=search.trials.config.tie_tolerance,
        )
    return sections


def space_modes(space: SearchSpace, resolved: ModelView) -> set[str]:
    """The mode keys (``plan.format.mode_key``) the space's plans give any block: all the time profile needs."""
    keys = {"none", "full"}
    for cand in space.enumerate(resolved.stacks, fingerprint=None):
        keys.update(mode_key(bp) for bp in cand.plan.blocks.values())
    return keys
