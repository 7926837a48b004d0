"""``tune(model, step_fn)``: find the fastest checkpointing plan whose real training step fits a budget.

The model is resolved once (root, stacks, fingerprint, device, compiled or not); then, in order: the
memory-safe profile (``memory_model``), one measured optimizer step (``optimizer_step``), the budget
(``budget``), an untimed process warm-up, and a ``Study`` that runs every candidate through a trial
runner (``runners``: eager, or ``compile.CompiledTrials``), confirms the leaders side by side and
chooses. The same engine runs inside the Lightning callback and from a plain script.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_ckpt.budget import Budget, RequestedBudget, format_bytes, within_host
from lightning_ckpt.errors import InfeasibleBudgetError
from lightning_ckpt.measure.allocator import AllocatorRegime, search_allocator, start_expandable_segments
from lightning_ckpt.measure.device_memory import allocator_type, device_memory
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.measure.measurement import PassOutOfMemory, run_pass
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.measure.snapshot import find_parameters_written_in_forward, forget_parameters_written_in_forward
from lightning_ckpt.memory.compiled import CompiledMemoryModel
from lightning_ckpt.memory.optimizer_measure import measure_optimizer_step
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory, RealStepMemory
from lightning_ckpt.memory.profile import profile_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.apply import plan_applied
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import BlockPlan, Plan, mode_key
from lightning_ckpt.plan.skipping import full_depth
from lightning_ckpt.search.compile import (
    CompiledTrials,
    compiled_search,
    compiled_space,
    compiled_target,
    eager_while_profiling,
    release_kept_graphs,
)
from lightning_ckpt.search.config import TuneConfig, settings_into_config
from lightning_ckpt.search.distributed import LocalSync, Sync
from lightning_ckpt.search.proposers import proposer_for
from lightning_ckpt.search.records import ProgressFn, TrialRecord, TrialStatus, TuneResult, choose_best
from lightning_ckpt.search.replan import COMPILED_PROFILE_KEY, PROFILE_KEY, profile_metadata
from lightning_ckpt.search.runners import EagerRunner, TrialRunner, release_cached_memory
from lightning_ckpt.search.space import Candidate, SearchSpace, offered_candidates
from lightning_ckpt.search.study import SearchInterrupted, Study, Workload
from lightning_ckpt.search.whole_check import (
    check_whole_compile,
    holds_several_blocks,
    outside_blocks_bytes,
    partition_pt2_budgets,
    weigh_on_blocks,
)
from lightning_ckpt.versions import require_torch

__all__ = [
    "SearchInterrupted",
    "TrialRecord",
    "TrialStatus",
    "TuneConfig",
    "TuneResult",
    "allocated_bytes",
    "build_runner",
    "check_tunable",
    "choose_best",
    "lowest_memory_pass",
    "resolve_on_device",
    "run_study",
    "search_session",
    "tune",
]

log = logging.getLogger(__name__)

# The memory profile runs one no-grad capture forward and one anchor step (plus per-block passes
# that are each a fraction of a step); we count it as two steps of tuning cost.
PROFILE_STEPS = 2
# ``find_parameters_written_in_forward``: one forward without grad, under a dispatch mode.
WRITE_CHECK_STEPS = 1


def build_runner(
    resolved: ModelView,
    harness: StepHarness,
    config: TuneConfig,
    *,
    compiled: bool | None,
    reserve_headroom: int = 0,
) -> TrialRunner:
    """The runner for this model, complete: ``CompiledTrials`` when it is compiled, else an ``EagerRunner``;
    ``reserve_headroom``: the allocator's reserve the profile measured, added to the CUDA cap."""
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
    progress: ProgressFn | None = None,
    extra_tensors: tuple[Any, ...] = (),
    sync: Sync | None = None,
    compiled: bool | None = None,
    should_stop: Callable[[], bool] | None = None,
    **settings: Any,
) -> TuneResult:
    """Search checkpointing plans for the highest measured throughput within a memory budget.

    ``step_fn`` runs the forward of one training step on a fixed batch and returns the loss; tune
    calls ``backward`` on it (and never steps an optimizer), both for the memory-safe profile and for
    every measured trial. The model is left exactly as it was: the caller applies ``result.best``.
    ``config`` (a ``TuneConfig``) holds the search settings; keyword ``settings`` (``n_trials=12``, ...) still
    override its fields but are deprecated (a ``DeprecationWarning``). ``max_memory`` may be a
    ``budget.RequestedBudget`` the caller already parsed (the callback does, once, at construction). On a GPU it is
    clamped to what the process may allocate there, and the search never lets an out-of-memory error out: a trial
    records it, and a pass that needs no more than the lowest-memory plan ends in ``InfeasibleBudgetError``.

    The budget covers the training step as it will run after lock-in, not just the trial: with an
    ``optimizer``, one ``optimizer.step()`` is measured (and undone, see ``optimizer_measure.py``) and every
    trial's peak becomes ``max(forward+backward peak + the state the first step creates, the optimizer
    step's peak)``.
    HF KV caches are turned off for the search (``caches.py``).

    ``sync`` (a ``lightning_ckpt.search.distributed.Sync``) runs the search on several ranks in lockstep.
    ``compiled`` (default: detected) makes every trial compile its plan; plans that add graph breaks are ``conflict`` trials.
    ``should_stop`` is polled between trials (the callback passes Lightning's SIGTERM flag); when it
    returns True the search ends with ``SearchInterrupted`` and the model is left as it was.

    The search is an Optuna study named ``result.study_name``, with one trial per plan tried (objective
    ``samples_per_second``, the budget as a constraint, figures in user attributes; see ``study.py``). With
    ``storage=`` it persists: ``optuna.load_study(study_name=result.study_name, storage=result.storage)``,
    and a search started again on the same model and run resumes it instead of measuring again.
    """
    config = settings_into_config(config, settings, "tune")
    requested = RequestedBudget.of(max_memory, activation_budget)  # a bad budget fails before any step runs
    start_expandable_segments()  # only while CUDA has not started (a model still on the host): see measure.allocator
    resolved = ModelView.of(model, config.block_types)
    with search_session(resolved) as session:
        step_fn = session.restoring(step_fn)
        shape = {"batch_size": batch_size or 1, "seq_len": seq_len}
        steps = {"warmup_steps": config.warmup_steps, "measure_steps": config.measure_steps}
        harness = StepHarness(
            resolved.root,
            step_fn,
            resolved.device,
            optimizer,
            tuple(extra_tensors),
            **shape,
            **steps,
            view=resolved,
            clock=config.clock,
        )
        check_tunable(resolved)
        is_compiled = compiled_target(resolved.model, compiled=compiled) is not None
        with eager_while_profiling(is_compiled):
            session.check_parameter_writes(step_fn)
        return _search(
            resolved,
            harness,
            is_compiled,
            requested=requested,
            config=config,
            progress=progress,
            sync=sync,
            should_stop=should_stop,
            began=session.began,
            allocator=session.allocator,
        )


class SearchSession:
    """What every search (``tune``, and the joint micro-batch search) sets up before its first step and undoes
    after its last, however it ends: one place, so the two cannot drift apart.

    Set up: every block runs (LayerDrop and kin at full depth: the budget must hold for the deepest step), the
    modules' Python attributes are captured so each step starts from them, the allocator runs with expandable
    segments on CUDA where they can be verified on (``measure.allocator``; kept for the training after). Undone: cached device blocks and offload trials' pinned host memory released, the allocator,
    kept compiled graphs, parameters the forward writes, Python attributes (with a warning for what could not be
    restored)."""

    def __init__(self, resolved: ModelView, allocator: AllocatorRegime | None = None) -> None:
        self.resolved = resolved
        self.allocator = allocator  # what the search runs under, recorded in the plan file
        self.began = allocated_bytes(resolved.device)  # what the device held before the search: named if none fits
        self.python_state = PythonState.capture(resolved.root)

    def restoring(self, step_fn: Callable[[], Any]) -> Callable[[], Any]:
        """``step_fn`` starting from the Python attributes as they were (a counter-driven curriculum sees call 1
        each time, and so does the first real step)."""
        return self.python_state.restoring(step_fn)

    def check_parameter_writes(self, step_fn: Callable[[], Any]) -> None:
        """Find the parameters the forward itself writes (``Embedding(max_norm=...)``), to put back after each step."""
        lowest_memory_pass(
            "the parameter-write check",
            self.began,
            self.resolved,
            lambda: find_parameters_written_in_forward(self.resolved.root, step_fn),
        )

    def close(self) -> None:
        release_cached_memory(self.resolved.device)
        release_kept_graphs()  # a compiled model's re-timing rounds keep graphs (search.compile): none outlive it
        forget_parameters_written_in_forward(self.resolved.root)
        self.python_state.restore()
        self.python_state.warn_unrestorable()


@contextlib.contextmanager
def search_session(resolved: ModelView) -> Iterator[SearchSession]:
    """A ``SearchSession`` for the duration of one search (see there)."""
    # Entered before the Python attributes are captured, which would otherwise put LayerDrop's rates back after
    # every step.
    with full_depth(resolved.root, resolved.stacks) as deepened, search_allocator(resolved.device) as allocator:
        if deepened:
            log.info("lightning_ckpt: searching at full depth (every block runs): %s", deepened)
        session = SearchSession(resolved, allocator)
        try:
            yield session
        finally:
            session.close()


def _search(
    resolved: ModelView,
    harness: StepHarness,
    is_compiled: bool,
    *,
    requested: RequestedBudget,
    config: TuneConfig,
    progress: ProgressFn | None,
    sync: Sync | None,
    should_stop: Callable[[], bool] | None,
    began: int | None,
    allocator: AllocatorRegime | None = None,
) -> TuneResult:
    """Profile, resolve the budget, then run, confirm and choose the study. ``began``: what the device held before
    the search (``SearchSession.began``), named if no plan can fit; ``allocator``: the regime it runs under."""
    device, optimizer, seq_len = resolved.device, harness.optimizer, harness.seq_len
    space = config.search_space.for_device(device.type)
    if is_compiled:
        space = compiled_space(space, resolved.root)
    with eager_while_profiling(is_compiled):
        # A compiled model's blocks are timed compiled alone (regional compilation: one compile per distinct block
        # and mode the space uses), so its time model predicts compiled steps as the eager one predicts eager steps.
        # Memory-safe: no pass of it needs more than the lowest-memory plan's step, so an OOM here means none fits.
        profile = lowest_memory_pass(
            "the memory profile",
            began,
            resolved,
            lambda: profile_step(
                resolved,
                harness.step_fn,
                optimizer=optimizer,
                extra=harness.extra,
                time_blocks=space_modes(space, resolved),
                compiled_blocks=is_compiled,
            ),
        )
    if profile.time is not None:
        at = {**profile.time.measured_at, "batch_size": harness.batch_size, "seq_len": seq_len, "compiled": is_compiled}
        profile = profile.with_time(replace(profile.time, measured_at=at))
    memory_model = profile.memory
    # Built complete from the profile: the CUDA cap's headroom for the allocator's reserve, eager and compiled alike.
    runner = build_runner(
        resolved, harness, config, compiled=is_compiled, reserve_headroom=memory_model.reserve_overhead_bytes
    )
    optimizer_step = (
        measure_optimizer_step(resolved.root, optimizer, device=device, extra=harness.extra)  # an OOM: infeasible
        if optimizer is not None
        else OptimizerStepMemory.absent()
    )
    memory = RealStepMemory(memory_model, optimizer_step)
    sync = sync or LocalSync()
    budget = sync.broadcast(_resolve_budget(requested, memory, runner, resolved, sync))
    profiled = profile.compiled  # anchored on the compiled ``none`` step below, where that step ran
    if is_compiled and profile.compiled is not None:
        memory = _compiled_memory(runner, profile.compiled, optimizer_step, resolved)
        profiled = memory.model if isinstance(memory.model, CompiledMemoryModel) else profile.compiled
    proposer = proposer_for(
        profile.time,
        predicts_time=getattr(runner, "predicts_time", False),
        predict_time=config.predict_time,
        tie_tolerance=config.tie_tolerance,
        seed=config.seed,
        sampler=config.sampler,
        n_trials=config.n_trials,
    )
    study, warm_steps, stacks = run_study(
        resolved,
        [Workload(runner, memory, harness.batch_size)],
        harness=harness,
        space=space,
        budget=budget,
        config=config,
        proposer=proposer,
        memory_model=memory_model,
        hooks=SearchHooks(progress, sync, should_stop),
        run={"seq_len": seq_len, "device": _device_name(device), "compiled": is_compiled},
    )
    compiled = list(runner.regions) if is_compiled else None
    run = {"device": str(device), "batch_size": harness.batch_size, "seq_len": seq_len, "compiled": compiled}
    metadata: dict[str, Any] = {"optimizer_step": memory.optimizer.to_dict(), "run": run}
    if allocator is not None:
        metadata[ALLOCATOR_KEY] = allocator.to_dict()
    fitted = study.proposer.fitted()
    if isinstance(memory.model, CompiledMemoryModel):
        metadata["compiled_blocks"] = {**memory.model.to_dict(), "activation_errors": _activation_errors(study)}
    if isinstance(runner, CompiledTrials):
        metadata[COMPILES_KEY] = compiles_of(runner, profile.compiled)
    if fitted is not None:
        # The profile as the search fitted it: a later budget re-plans from it without a search (``replan``). A
        # compiled one is kept apart (COMPILED_PROFILE_KEY): ``replan`` predicts eager steps; a plan table predicts
        # its shorter buckets from it (``search.buckets``).
        metadata[COMPILED_PROFILE_KEY if is_compiled else PROFILE_KEY] = profile_metadata(
            profile.with_time(fitted),
            memory.optimizer,
            stacks,
            space,
            batch_size=harness.batch_size,
            seq_len=seq_len,
            tie_tolerance=config.tie_tolerance,
        )
    if isinstance(runner, CompiledTrials):
        check_pt2_budget_compiled_whole(study, runner, harness, config, metadata, profiled)
    return study.result(
        extra_steps=PROFILE_STEPS + WRITE_CHECK_STEPS + warm_steps,
        memory_table=memory_model.table(),
        memory_breakdown=memory_model.to_dict(),
        metadata=metadata,
    )


@dataclass(frozen=True)
class SearchHooks:
    """The run-time hooks every search takes from its caller: how it reports (``progress``), how ranks agree
    (``sync``), when it must stop (``should_stop``, polled between trials: the callback passes Lightning's SIGTERM
    flag)."""

    progress: ProgressFn | None = None
    sync: Sync | None = None
    should_stop: Callable[[], bool] | None = None


def run_study(
    resolved: ModelView,
    workloads: list[Workload],
    *,
    harness: StepHarness,
    space: SearchSpace,
    budget: Budget,
    config: TuneConfig,
    proposer: Any,
    memory_model: Any,
    hooks: SearchHooks,
    run: dict[str, Any],
) -> tuple[Study, int, list[Any]]:
    """The part every search shares once its memory is known: warm the process up, offer the space's candidates
    (one per plan, or one per plan and workload when there are several: the joint search's micro-batches), run the
    study, confirm its leaders side by side and give back what the trials cached. Returns the study, the warm-up's
    steps (tuning cost) and the stacks the candidates plan."""
    is_compiled = isinstance(workloads[0].runner, CompiledTrials)
    warm_steps = warm_up_process(harness, resolved, config, is_compiled)
    stacks, plain = offered_candidates(space, resolved.stacks, resolved.fingerprint, memory_model)
    several = len(workloads) > 1 or workloads[0].micro_batch is not None
    candidates = (
        [
            Candidate({**c.params, "micro_batch": w.micro_batch}, c.plan, w.labelled(c.label), c.baseline)
            for w in workloads
            for c in plain
        ]
        if several
        else plain
    )
    study = Study(
        candidates=candidates,
        space=space,
        stacks=stacks,
        budget=budget,
        config=config,
        workloads=workloads,
        proposer=proposer,
        fingerprint=resolved.fingerprint,
        device_type=allocator_type(resolved.device),
        sync=hooks.sync or LocalSync(),
        progress=hooks.progress,
        should_stop=hooks.should_stop,
        run=run,
    )
    study.run()
    study.confirm()
    release_cached_memory(resolved.device)
    return study, warm_steps, stacks


def _activation_errors(study: Study) -> dict[str, Any]:
    """How far the compiled memory predictions were from the compiled steps measured (``predicted / measured - 1``
    of the activation bytes), as the time model's summary says it of step times."""
    errors = [
        t.predicted_activation_bytes / t.activation_bytes - 1.0
        for t in study.records
        if t.memory_measured and t.predicted_activation_bytes is not None and t.activation_bytes
    ]
    return {
        "predicted_and_measured": len(errors),
        "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
        "max_abs_error": max((abs(e) for e in errors), default=None),
    }


def _compiled_memory(
    runner: CompiledTrials, compiled: CompiledMemoryModel, optimizer_step: OptimizerStepMemory, resolved: ModelView
) -> RealStepMemory:
    """What the compiled search prunes by: the blocks' compiled saved bytes anchored on the compiled ``none`` step
    (measured already: an activation budget is a fraction of it). The runner's steps are then predicted, memory
    and time; without that step (it failed) nothing is, as before."""
    none = runner.measure_compiled(Plan(fingerprint=resolved.fingerprint))
    if not none.ok or none.activation_bytes is None:
        return RealStepMemory(compiled.eager, optimizer_step)
    runner.predicts_memory = runner.predicts_time = True
    return RealStepMemory(compiled.anchored(none.activation_bytes, none.peak_bytes), optimizer_step)


def _resolve_budget(
    requested: RequestedBudget,
    memory: RealStepMemory,
    runner: TrialRunner,
    resolved: ModelView,
    sync: Sync,
) -> Budget:
    none_activation = memory.model.predict_activation(Plan())
    if isinstance(runner, CompiledTrials):  # an activation budget is a fraction of the *compiled* step's activations
        none_activation = runner.none_activation_bytes(Plan(fingerprint=resolved.fingerprint)) or none_activation
    if sync.world_size > 1:
        # The largest rank's: trials are judged by the most any rank used, so the share must be of the step that
        # needs the most (the ranks' first batches can differ in length), not rank 0's own.
        none_activation = max((n for n in sync.all_gather(none_activation) if n is not None), default=None)
    budget = resolve_on_device(requested, resolved.device, none_activation)
    predicted = format_bytes(none_activation)
    log.info(
        "lightning_ckpt: budget %s; no-checkpointing activation memory predicted %s", budget.description, predicted
    )
    step_peak = memory.optimizer.step_peak_bytes
    if budget.kind == "peak" and budget.limit_bytes is not None and step_peak > budget.limit_bytes:
        log.warning(
            "lightning_ckpt: the optimizer step alone peaks at %s (%s), over the budget (%s): no plan can fit",
            format_bytes(step_peak),
            memory.optimizer.note,
            budget.description,
        )
    return budget


def resolve_on_device(requested: RequestedBudget, device: torch.device, none_activation: int | None) -> Budget:
    """The requested budget on ``device``, its peak clamped (with one line that says so) to what the device's
    allocator lets this process have: the card, or the user's own ``set_per_process_memory_fraction`` of it; on the
    CPU, to the host's memory (``budget.within_host``)."""
    budget = requested.resolve(device=device, none_activation_bytes=none_activation)
    memory = device_memory(device)
    if memory is not None and budget.kind in ("peak", "none"):
        budget, clamped = budget.within(memory.cap_bytes(), str(device))
        if clamped is not None:
            log.warning(clamped)
    elif memory is None and device.type == "cpu":
        budget, clamped = within_host(budget)  # the host's memory (or the container's limit)
        if clamped is not None:
            log.warning(clamped)
    return budget


def allocated_bytes(device: torch.device) -> int | None:
    """What the device's allocator holds now (None without one): what an infeasible search reports it began with."""
    memory = device_memory(device)
    return memory.allocated() if memory is not None else None


def lowest_memory_pass(what: str, started: int | None, resolved: ModelView, run: Callable[[], Any]) -> Any:
    """``run()``, a pass that needs no more memory than the lowest-memory plan (the parameter-write check, the memory
    profile and its sub-passes, the optimizer-step measurement), through ``measurement.run_pass``: from an emptied
    cache, retried once split-resistant when the allocator refused what the allocated bytes fit. An out-of-memory
    error that survives means no plan can fit, so it becomes ``InfeasibleBudgetError`` naming the sub-pass that
    failed, the allocator's figures, what was allocated when the search began and what the device lets this process
    have. The pass restores the model's state itself; the error is raised once the failed pass's memory is
    released, and does not chain the OOM (whose traceback would keep the pass's tensors alive)."""
    try:
        return run_pass(what, resolved.device, run)
    except PassOutOfMemory as failed:
        failure = failed.with_traceback(None)  # its frames hold the profile's captured inputs
    memory = device_memory(resolved.device)
    facts = [f"{format_bytes(started)} was already allocated when the search began"] if started is not None else []
    if memory is not None:
        facts.append(f"this process may allocate {format_bytes(memory.cap_bytes())} there")
    error = InfeasibleBudgetError(
        f"{failure.what} ran out of memory on {resolved.device} ({failure.message}){failure.allocator_note()}. It "
        "needs no more memory than the lowest-memory plan (every block fully checkpointed), so no plan fits"
        f"{': ' + '; '.join(facts) if facts else ''}. Free memory before the fit (other models, cached tensors), use a "
        "smaller batch or micro-batch, shard the model (FSDP2), or give the process more of the device.",
        allocator=failure.figures,
    )
    raise error from None


# Where the search's allocator regime is recorded in the plan file (``measure.allocator.AllocatorRegime``).
ALLOCATOR_KEY = "allocator"
# Where a compiled search's plan keeps what it compiled (``compiles_of``): the result line, ``show`` and TensorBoard.
COMPILES_KEY = "compiles"
# A PT2 budget chosen on blocks compiled alone, checked compiled the user's way (``whole_check.WholeCheck``).
WHOLE_CHECK_KEY = "whole_compile_check"
# PT2 budgets partitioned as the user's compile partitions them (``whole_check.Partitioned``).
PARTITIONED_KEY = "pt2_partitioned_whole"


def check_pt2_budget_compiled_whole(
    study: Study,
    runner: CompiledTrials,
    harness: StepHarness,
    config: TuneConfig,
    metadata: dict[str, Any],
    profiled: CompiledMemoryModel | None = None,
) -> None:
    """Where the trials ran on blocks compiled alone and the user compiles several blocks in one graph, a PT2 budget
    the study chooses is weighed before it is kept (``whole_check``): by default against the three fastest fitting
    plans of ours on the blocks, where it must lead by ``whole_compile_margin`` (the blocks' figure flatters it); with
    ``check_whole_compile``, both compiled the user's way. What was done goes into ``metadata`` (``WHOLE_CHECK_KEY``)
    and its compiles into the search's count."""
    if runner.assembly is None or not holds_several_blocks(runner.regions, runner.assembly.blocks):
        return

    def after_choice(best: TrialRecord) -> TrialRecord:
        # PT2 budgets partitioned whole until one fits: the largest the blocks put a little over budget, then the
        # leader's unless it has room for the code outside the blocks (``whole_check.partition_pt2_budgets``).
        contender, partitioned = partition_pt2_budgets(study, best, runner, outside_blocks_bytes(profiled))
        if partitioned:
            metadata[PARTITIONED_KEY] = [p.to_dict() for p in partitioned]
            metadata[COMPILES_KEY] = compiles_of(runner, profiled)
        if contender is None and best.plan.compile_memory_budget is None:
            return best
        leader = contender or best  # no budget fits whole: the leader's is weighed as over budget
        if not config.check_whole_compile:
            kept, check = weigh_on_blocks(
                study,
                leader,
                runner,
                config.whole_compile_margin,
                leader_fits=None if not partitioned else bool(contender),
            )
            if check is not None:
                metadata[WHOLE_CHECK_KEY] = check.to_dict()
                metadata[COMPILES_KEY] = compiles_of(runner, profiled)  # a pruned rival may have compiled a segment
            return kept
        # A runner without blocks: every plan it measures is compiled the way the user compiles.
        whole = CompiledTrials(
            harness,
            regions=runner.regions,
            allow_graph_breaks=config.allow_graph_breaks,
            reserve_headroom_bytes=runner.reserve_headroom_bytes,
        )
        kept, check = check_whole_compile(study, leader, whole)
        if check is not None:
            metadata[WHOLE_CHECK_KEY] = check.to_dict()
            compiles = dict(metadata.get(COMPILES_KEY) or {})
            compiles["graphs"] = compiles.get("graphs", 0) + check.graphs
            compiles["seconds"] = compiles.get("seconds", 0.0) + check.compile_seconds
            compiles.update(whole_graphs=check.graphs, whole_seconds=check.compile_seconds)
            metadata[COMPILES_KEY] = compiles
        return kept

    study.after_choice = after_choice


def compiles_of(runner: CompiledTrials, profiled: CompiledMemoryModel | None) -> dict[str, Any]:
    """What a compiled search compiled: graphs and the seconds of the steps that compiled them, in the profile
    (each distinct block alone, once per mode) and in the trials (the modes, PT2 budgets and segments the profile
    did not compile). ``assembled``: trials ran on blocks compiled alone (``search.assembly``), so the count is
    distinct blocks x modes; otherwise every plan was compiled the user's way."""
    profile_graphs = profiled.compiles if profiled is not None else 0
    profile_seconds = profiled.compile_seconds if profiled is not None else 0.0
    trial_seconds = runner.compile_seconds
    if runner.assembly is None:  # every measured plan compiled from a reset
        trial_seconds = sum(stats.compile_seconds for _, stats in runner._cache.values())
    return {
        "assembled": runner.assembly is not None,
        "graphs": profile_graphs + runner.graphs,
        "seconds": profile_seconds + trial_seconds,
        "profile_graphs": profile_graphs,
        "profile_seconds": profile_seconds,
        "trial_graphs": runner.graphs,
        "trial_seconds": trial_seconds,
        "plans_measured": len(runner._cache),
    }


def warm_up_process(harness: StepHarness, resolved: ModelView, config: TuneConfig, compiled: bool) -> int:
    """Untimed steps before the first trial: the first steps of a process are slow (thread pools,
    oneDNN/cuBLAS handles, allocator growth) and would handicap whichever plan is measured first. Run
    under the lowest-memory plan so they cannot run out of memory; ``measure_step`` restores all state."""
    full = uniform_plan(resolved.stacks, BlockPlan("full"))
    with plan_applied(resolved, full), eager_while_profiling(compiled):
        warm = harness.measure(warmup=config.process_warmup_steps, steps=1, track_memory=False, count_flops=False)
    return warm.warmup_steps + len(warm.step_seconds)


def _device_name(device: torch.device) -> str:
    """The device as it bears on the figures (the model of GPU, not its index): part of a study's identity."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def space_modes(space: SearchSpace, resolved: ModelView) -> set[str]:
    """The mode keys (``plan.format.mode_key``) the space's plans give any block: all the time profile needs."""
    keys = {"none", "full"}
    for cand in space.enumerate(resolved.stacks, fingerprint=None):
        keys.update(mode_key(bp) for bp in cand.plan.blocks.values())
    return keys
