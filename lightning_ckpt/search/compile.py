"""torch.compile: run every trial compiled, and flag plans that fight the compiler (docs/compile.md).

A compiled step can be silently *slower* under a plan: a graph break inside a checkpointed region runs the region
eagerly (pytorch#135816, pytorch#139989), selective checkpointing can defeat compile (pytorch#161889), and every plan
change recompiles until a frame reaches ``recompile_limit`` and runs eagerly for good (pytorch#135458). So a compiled
trial compiles its plan in one untimed step (tuning cost), times the compiled steps, reads their memory, and compares
what dynamo did with the no-checkpointing reference (``dynamo.conflict_reason``): added graph breaks, a break inside
one of our regions, more eager autograd ops or the recompile limit make a **conflict**, never chosen unless
``allow_graph_breaks=True``.

**Memory.** The live-tensor tracker is a ``TorchDispatchMode``, under which dynamo runs compiled frames eagerly, so a
compiled step's **activation bytes** are the distinct storages saved for backward during the forward, read by
``saved_tensors_hooks`` (which compiled graphs honour): what checkpointing and the partitioner change, a lower bound
of the eager definition, compared only with other compiled trials. **Peak**: resting + activation bytes on CPU;
``max_memory_allocated`` on CUDA, with the budget enforced by the allocator cap. A compiled search predicts from the
blocks compiled alone (``memory.compiled``); PT2's budgets are only measured. ``compiled=True`` on an eager step
undercounts: saved-tensor hooks cannot see inside an eager checkpointed region.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_ckpt.discovery import unwrap_compiled
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.measure.harness import StepHarness, loss_of
from lightning_ckpt.measure.measurement import Measurement, classify_failure, release_memory
from lightning_ckpt.measure.saved_for_backward import SavedForBackward
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.model import ModelView, compiled_regions
from lightning_ckpt.plan.apply import apply_plan, reused_forwards
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.handle import PlanHandle
from lightning_ckpt.search.assembly import BlocksCompiledAlone, graphs_compiled, room_for_graphs
from lightning_ckpt.search.dynamo import (
    CompileStats,
    DynamoWatch,
    break_count,
    break_summaries,
    conflict_reason,
    eager_ops,
    is_dynamo_refusal,
    random_ops,
    recompile_count,
    recompile_limit,
    uses_cuda_graphs,
)

__all__ = [
    "CompiledTrials",
    "KeptGraphs",
    "compiled_search",
    "compiled_space",
    "compiled_target",
    "eager_while_profiling",
    "release_kept_graphs",
    "reset_compiled",
]

log = logging.getLogger(__name__)


def reset_compiled() -> None:
    """Forget every compiled graph, so the next call compiles what is applied now.

    ``torch._dynamo.reset()`` is process-wide: other compiled functions recompile once too, and every search's
    ``KeptGraphs`` is emptied. It is what keeps plan changes from accumulating recompiles towards the recompile
    limit (pytorch#135458).
    """
    torch._dynamo.reset()
    for graphs in list(_LIVE):
        graphs.forget()


class KeptGraphs:
    """The graphs dynamo holds for one search since the last reset: the plans re-timing rounds kept (``keys``: plan
    key and owner: another batch shape has other graphs), the PT2 budget the unmarked ones were compiled under, and
    whether trials ran on blocks compiled alone. The runners of one search share one (a joint micro-batch search's
    compile the same frames, whose graphs count together towards the recompile limit); a fit's plan table has its own.
    """

    def __init__(self) -> None:
        self.keys: set[tuple[int, str]] = set()
        self.budget: float | None = None
        self.assembled = False
        _LIVE.add(self)

    def forget(self) -> None:
        """Dynamo was reset: nothing is kept."""
        self.keys.clear()
        self.budget = None
        self.assembled = False

    def release(self) -> None:
        """Drop what was kept (re-timing rounds' graphs, the blocks compiled alone), if anything: a search ends with
        this, so the model's next step compiles the chosen plan the way the user compiles, once."""
        if self.keys or self.assembled:
            reset_compiled()

    def apply_reusing(
        self, target: nn.Module | ModelView, plan: Plan, forwards: dict[Any, Any], key: tuple[int, str]
    ) -> PlanHandle:
        """Apply ``plan`` with the forward objects it had when it was applied before under ``forwards``
        (``reused_forwards``), so dynamo's guards match the graph compiled for it then and nothing compiles again.
        The graphs kept are dropped first when one more plan would reach dynamo's recompile limit, which would run
        the model eagerly from then on."""
        if self.keys and key not in self.keys and len(self.keys) + 1 >= recompile_limit():
            self.release()
        with reused_forwards(forwards):
            return apply_plan(target, plan)


# Every KeptGraphs alive: a reset empties them all (dynamo's cache is process-wide), and ``release_kept_graphs`` (how
# the search core ends a search today, until it releases its runner's own ``kept``) releases them.
_LIVE: weakref.WeakSet[KeptGraphs] = weakref.WeakSet()


def release_kept_graphs() -> None:
    """``KeptGraphs.release`` of every search's graphs."""
    for graphs in list(_LIVE):
        graphs.release()


@contextlib.contextmanager
def eager_while_profiling(enabled: bool) -> Iterator[None]:
    """Run the enclosed passes eagerly (``set_stance("force_eager")``) when ``enabled``: the memory profile and the
    process warm-up describe the eager step and would otherwise pay a compile each (tens of seconds on CPU)."""
    if not enabled:
        yield
        return
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        # The live-tensor tracker's global module hooks make every OptimizedModule call warn that hooks
        # fire twice; nothing is compiled here, and the tracker counts by tensor, not by hook call.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


def _budget_forward(module: nn.Module, budget: str, *args: Any, **kwargs: Any) -> Any:
    """A compiled region's forward while a plan with a PT2 budget is re-timed: the class's forward, after reading
    ``budget`` so that dynamo guards on it. A string, not the float: dynamo makes a float that changed between
    compiles dynamic, and one graph would then serve every budget."""
    if budget == "":
        raise ValueError("a PT2 budget marker needs the budget")
    return type(module).forward(module, *args, **kwargs)


@dataclass
class _CompiledRun:
    """What one compiled trial found so far, filled in pass by pass (compile, timed steps, memory)."""

    compile_seconds: float = 0.0
    failure: tuple[str, str] | None = None  # (status, message) of the pass that failed
    conflict: bool = False  # the compiler refused the plan outright (fullgraph=True)
    measurement: Any = None
    recompiles: int = 0
    saved: int | None = None
    eager_ops: int | None = None
    resting: int = 0


class CompiledTrials:
    """The trial runner of a compiled model (``runners.TrialRunner``): each plan compiled from a reset.

    Every trial starts and ends with ``reset_compiled()``, so a trial compiles exactly its own plan and
    no trial's recompiles count towards the next one's limit. Re-timing rounds keep the graphs they compile
    (``retime``) in ``kept``, which the search releases when it ends, so the caller gets a dynamo state with nothing
    cached from the search.
    """

    def __init__(
        self,
        harness: StepHarness,
        *,
        regions: tuple[str, ...],
        allow_graph_breaks: bool,
        reserve_headroom_bytes: int = 0,
        blocks: tuple[str, ...] = (),
        model: nn.Module | None = None,
        kept: KeptGraphs | None = None,
    ) -> None:
        self.harness = harness
        self.kept = kept if kept is not None else KeptGraphs()  # shared by the runners of one search
        self.root, self.step_fn, self.device, self.extra = harness.root, harness.step_fn, harness.device, harness.extra
        self.regions = regions
        self.allow_graph_breaks = allow_graph_breaks
        self.memory_limit_bytes: int | None = None
        self.reserve_headroom_bytes = reserve_headroom_bytes  # the CUDA cap's headroom for the allocator's reserve
        self.reference: CompileStats | None = None
        self._cache: dict[str, tuple[Measurement, CompileStats]] = {}
        self._forwards: dict[Any, Any] = {}  # what plans installed, reinstalled as they were (``reused_forwards``)
        self.retime_compiles = 0  # re-timings that compiled (the first of a plan, or after a reset)
        # With the stacks' blocks known, trials run on them compiled alone (``search.assembly``); without, every plan
        # is compiled the user's way from a reset (a step function compiled as a whole, a model without stacks).
        self.assembly = (
            BlocksCompiledAlone(model if model is not None else self.root, self.root, blocks) if blocks else None
        )
        self.graphs = 0  # graphs the trials compiled (``search.assembly``: distinct blocks x modes, not plans)
        self.compile_seconds = 0.0  # the seconds of the steps that compiled them
        self._retimed: set[str] = set()  # plans re-timed on the blocks compiled alone (their graphs exist)

    def adapt(self, space: Any) -> Any:
        """The search space for this compiled model (``compiled_space``)."""
        return compiled_space(space, self.root)

    def describe(self) -> str:
        return ", ".join(r or "<whole model>" for r in self.regions) or "<step function>"

    def none_activation_bytes(self, none_plan: Plan) -> int | None:
        """Activation bytes of the compiled step without checkpointing: what activation budgets are fractions of."""
        return self.measure_compiled(none_plan).activation_bytes

    # Set by ``tune`` once the profile has compiled the blocks alone and the compiled ``none`` step is measured
    # (``memory.compiled``): until then nothing predicts a compiled step, and every candidate is compiled.
    predicts_memory = False
    memory_exact = False  # the blocks' saved bytes add up to a prediction, not a measurement: every trial reads its own
    predicts_time = False
    collective_steps = False

    def measure_memory(self, plan: Plan, memory_limit: int | None) -> Measurement:
        return self.measure(plan, memory_limit)  # every compiled trial is measured whole (cached)

    def measure(self, plan: Plan, memory_limit: int | None, *, memory: bool = True) -> Measurement:
        """Compile ``plan`` from a reset, measure it, and say whether it fights the compiler.

        ``memory_limit`` caps the CUDA allocator during the timed steps (as for eager trials).
        """
        self.memory_limit_bytes = memory_limit
        m = self.measure_compiled(plan)
        stats = self._cache[plan.key()][1]
        reason = None if plan.is_empty else conflict_reason(stats, self.reference)
        extra: dict[str, Any] = {**m.extra, "compiled_regions": list(self.regions)}
        steps = 1 + m.warmup_steps + len(m.step_seconds) + (1 if stats.saved_bytes is not None else 0)
        return replace(m, steps=steps, conflict=reason, extra=extra)

    def retime(self, plan: Plan, steps: int | None = None, *, warmup: int = 1) -> Measurement:
        """Time ``plan`` again, no memory pass: an untimed first step (it compiles the plan, or runs the graph compiled
        for it earlier in these rounds: every round's warm-up, so ``warmup`` is unused), then the timed steps.

        Each plan is applied with the forward objects it had the first time (``KeptGraphs.apply_reusing``), so a round
        after its first costs steps, not a compile (about 0.8 s per plan per round on the 4-layer test GPT with every
        cache warm; tens of seconds cold). A PT2 budget is read when compiling and no guard sees it, so while a plan
        with one runs each compiled region gets a forward that reads the budget as a string (``_budget_forward``),
        which dynamo guards on; where a region already has an instance forward, a budget change drops the kept
        graphs instead.
        """
        if self.assembly is not None:
            return self._assembled_retime(plan, steps, warmup)
        key = (id(self), plan.key())  # another runner (micro-batch) is another batch shape: other graphs
        handle = self.kept.apply_reusing(self.harness.target, plan, self._forwards, key)
        marked = self._mark_budget(plan.compile_memory_budget)
        if not marked and self.kept.keys and plan.compile_memory_budget != self.kept.budget:
            self.kept.release()  # the unmarked graphs kept were compiled under another budget
        compiles = key not in self.kept.keys
        snapshot = StateSnapshot.capture(self.root)
        run = _CompiledRun()
        try:
            self._compile_then_time(snapshot, run, steps)
        finally:
            for module in marked:
                del module.__dict__["forward"]
            handle.remove()
        if run.failure is not None or not run.measurement.ok:
            reset_compiled()  # whatever the failed step left compiled is not kept
        else:
            self.kept.keys.add(key)
            if not marked:
                self.kept.budget = plan.compile_memory_budget
            self.retime_compiles += compiles
        m = self._reading(run)
        return replace(m, extra={**m.extra, "compile": {"compile_seconds": run.compile_seconds, "compiled": compiles}})

    def _mark_budget(self, budget: float | None) -> list[nn.Module]:
        """Give every compiled region the forward that names ``budget`` (see ``retime``); the regions marked, none
        when there is no budget or a region already has an instance forward."""
        if budget is None:
            return []
        fqns = self.assembly.blocks if self.assembly is not None else self.regions
        # The root may be the compiled wrapper itself (``torch.compile(model)``), whose ``forward`` is an instance one.
        modules = [unwrap_compiled(self.root.get_submodule(fqn) if fqn else self.root) for fqn in fqns]
        if not modules or any("forward" in vars(m) for m in modules):
            return []
        for m in modules:
            marker = functools.partial(_budget_forward, m, repr(budget))
            m.__dict__["forward"] = self._forwards.setdefault((id(m), "budget", repr(budget)), marker)
        return modules

    def measure_compiled(self, plan: Plan, *, cached: bool = True) -> Measurement:
        """Compile ``plan`` from scratch and measure it (``cached``: reuse an earlier measurement of it). Its
        peak and activation follow the module docstring; ``extra["compile"]`` is what dynamo did."""
        key = plan.key()
        if not cached or key not in self._cache:
            assembled = self.assembly is not None
            self._cache[key] = self._assembled_measure(plan) if assembled else self._compile_and_measure(plan)
        m, stats = self._cache[key]
        if plan.is_empty and self.reference is None:
            self.reference = stats
        return m

    def measure_partitioned(self, plan: Plan) -> Measurement:
        """``plan`` (a PT2 budget) as measured on the blocks compiled alone, with the bytes the user's compile of
        several blocks in one graph saves for backward: each region partitioned as inductor partitions it, kernels not
        generated (``assembly.partition_only_backend``). The budget is one knapsack over every block's ops there and
        one per block here: ``benchmarks/compiled_exhaustive.py`` measured ``pt2_budget(0.5)`` of the 8-layer GPT
        over budget on the blocks (17,502,724 bytes) and within it compiled whole (17,039,360). The time stays the
        blocks'; the peak moves by what the saved bytes moved; the partitioning steps count among ``graphs``."""
        assert self.assembly is not None, "partitioning whole needs the blocks a compiled search ran alone"
        on_blocks = self.measure_compiled(plan)
        graphs_before = graphs_compiled()
        snapshot = StateSnapshot.capture(self.root)
        run = _CompiledRun()
        try:
            with self.assembly.partitioned(), room_for_graphs():
                handle = apply_plan(self.harness.target, plan)
                try:
                    self._compile_step(snapshot, run)
                    if run.failure is None:
                        self._memory_pass(snapshot, run)
                finally:
                    handle.remove()
        finally:
            release_memory(self.device)
        graphs = self._count_compiles(graphs_before, run)
        partition = {"graphs": graphs, "seconds": run.compile_seconds, "on_blocks_bytes": on_blocks.activation_bytes}
        if run.failure is not None or run.saved is None or on_blocks.activation_bytes is None:
            status, message = run.failure or ("error", "no saved bytes were read on the blocks or partitioned whole")
            return Measurement(status, error=message, device=str(self.device), extra={"partitioned": partition})
        shift = run.saved - on_blocks.activation_bytes
        peak = on_blocks.peak_bytes + shift if on_blocks.peak_bytes is not None else None
        partition["whole_bytes"] = run.saved
        return replace(on_blocks, activation_bytes=run.saved, peak_bytes=peak,
                       extra={**on_blocks.extra, "partitioned": partition})  # fmt: skip

    # -- on blocks compiled alone (``search.assembly``) ------------------------------------------------------------
    @contextlib.contextmanager
    def _assembled(self, plan: Plan) -> Iterator[None]:
        """``plan`` applied to the blocks compiled alone, with the forwards it had before (``reused_forwards``): its
        graphs are the ones compiled for its modes by any earlier trial. A PT2 budget is read when compiling and no
        guard sees it, so it marks the blocks' forwards (``_mark_budget``); where a planned block's forward cannot be
        marked, a budget other than the last one compiled drops the graphs (``reset_compiled``) and compiles again."""
        assert self.assembly is not None
        with self.assembly.installed(), room_for_graphs(), contextlib.ExitStack() as stack:
            with reused_forwards(self._forwards):
                handle = apply_plan(self.harness.target, plan)
            stack.callback(handle.remove)
            stack.enter_context(self.assembly.segments_eager(self.root, plan.segments))
            marked = self._mark_budget(plan.compile_memory_budget)
            if not marked and plan.compile_memory_budget != self.kept.budget and self.kept.assembled:
                reset_compiled()
            self.kept.assembled = True
            if not marked:
                self.kept.budget = plan.compile_memory_budget
            try:
                yield
            finally:
                for module in marked:
                    del module.__dict__["forward"]

    def _count_compiles(self, graphs: int, run: _CompiledRun) -> int:
        """Graphs compiled since ``graphs``, added to the search's count with the compiling step's seconds."""
        new = graphs_compiled() - graphs
        if new:
            self.graphs += new
            self.compile_seconds += run.compile_seconds
        return new

    def _assembled_measure(self, plan: Plan) -> tuple[Measurement, CompileStats]:
        """Measure ``plan`` on the blocks compiled alone: compiles only the block modes no earlier trial compiled.
        What dynamo did is read as differences (nothing is reset between trials)."""
        watch = DynamoWatch()
        breaks_before, graphs_before = break_count(), graphs_compiled()
        snapshot = StateSnapshot.capture(self.root)
        run = _CompiledRun()
        try:
            with self._assembled(plan):
                self._compile_step(snapshot, run)
                compiled_now = self._count_compiles(graphs_before, run)
                if run.failure is None:
                    graphs_timed = graphs_compiled()
                    run.measurement = self._timed_steps(None)
                    run.recompiles = graphs_compiled() - graphs_timed  # a stable plan: nothing after its first step
                    if run.measurement.ok:
                        self._memory_pass(snapshot, run)
        finally:
            release_memory(self.device)
        seconds = run.compile_seconds if compiled_now else 0.0
        return self._with_stats(run, seconds, compiled_now, break_summaries(since=breaks_before), watch.limit_hit())

    def _assembled_retime(self, plan: Plan, steps: int | None, warmup: int) -> Measurement:
        """``retime`` on the blocks compiled alone. A plan that ran before has its graphs: its round is ``warmup`` and
        ``steps`` steps, as an eager round (a plan switch swaps compiled blocks, nothing compiles); a plan's first run
        starts with the untimed step that compiles what it needs."""
        graphs_before = graphs_compiled()
        snapshot = StateSnapshot.capture(self.root)
        run = _CompiledRun()
        with self._assembled(plan):
            if plan.key() in self._cache or plan.key() in self._retimed:
                run.measurement = self._timed_steps(steps, warmup=warmup)
            else:
                self._compile_then_time(snapshot, run, steps)
        self._retimed.add(plan.key())
        compiled_now = self._count_compiles(graphs_before, run)
        self.retime_compiles += bool(compiled_now)
        m = self._reading(run)
        extra = {"compile_seconds": run.compile_seconds if compiled_now else 0.0, "compiled": bool(compiled_now)}
        return replace(m, extra={**m.extra, "compile": {**extra, "graphs": compiled_now}})

    def _compile_and_measure(self, plan: Plan) -> tuple[Measurement, CompileStats]:
        with reused_forwards(self._forwards):
            handle = apply_plan(self.harness.target, plan)
        reset_compiled()
        watch = DynamoWatch()
        snapshot = StateSnapshot.capture(self.root)
        run = _CompiledRun()
        try:
            self._compile_then_time(snapshot, run, None)
            if run.failure is None:
                run.recompiles = recompile_count()  # before the memory pass, which must not count
                if run.measurement.ok:
                    self._memory_pass(snapshot, run)
        finally:
            handle.remove()
            breaks, limit_hit = break_summaries(), watch.limit_hit()
            reset_compiled()
            release_memory(self.device)
        return self._with_stats(run, run.compile_seconds, 1, breaks, limit_hit)

    def _with_stats(
        self, run: _CompiledRun, seconds: float, graphs: int, breaks: tuple[int, int, tuple[str, ...]], limit_hit: bool
    ) -> tuple[Measurement, CompileStats]:
        """The trial's reading with what dynamo did (``breaks``: ``dynamo.break_summaries``) in its extra."""
        total, in_regions, reasons = breaks
        stats = CompileStats(seconds, graphs, total, in_regions, run.recompiles, limit_hit, run.eager_ops, run.saved,
                             reasons)  # fmt: skip
        return replace(self._reading(run), extra={"compile": stats.to_dict()}), stats

    def _compile_then_time(self, snapshot: StateSnapshot, run: _CompiledRun, steps: int | None) -> None:
        """The untimed first step (it compiles, or runs a kept graph), then the timed steps unless it failed."""
        self._compile_step(snapshot, run)
        if run.failure is None:
            run.measurement = self._timed_steps(steps)

    def _compile_step(self, snapshot: StateSnapshot, run: _CompiledRun) -> None:
        """The first step, which compiles forward and backward: tuning cost, never throughput."""
        try:
            snapshot.reset_grads()
            t0 = time.perf_counter()
            self.harness.train_step()
            run.compile_seconds = time.perf_counter() - t0
        except Exception as exc:  # the compiler refused or failed on this plan
            run.failure = classify_failure(exc)
            run.conflict = is_dynamo_refusal(exc)
        finally:
            snapshot.restore()

    def _timed_steps(self, steps: int | None, *, warmup: int | None = None) -> Measurement:
        """The compiled steps, timed; on CUDA the allocator's peak over them (and its cap), no tracked pass."""
        is_cuda = self.device.type == "cuda"
        return self.harness.measure(
            step=self.harness.train_step,
            warmup=self.harness.warmup_steps if warmup is None else warmup,
            steps=steps or self.harness.measure_steps,
            track_memory=False,
            read_allocator=is_cuda,
            count_flops=False,
            memory_limit_bytes=self.memory_limit_bytes if is_cuda else None,
            reserve_headroom_bytes=self.reserve_headroom_bytes,
        )

    def _memory_pass(self, snapshot: StateSnapshot, run: _CompiledRun) -> None:
        try:
            run.saved, run.eager_ops, run.resting = self._saved_bytes(snapshot)
        except Exception as exc:  # noqa: BLE001 - a memory pass failure fails the trial, not the search
            run.failure = classify_failure(exc)
        finally:
            snapshot.restore()

    def _reading(self, run: _CompiledRun) -> Measurement:
        """The trial's figures as the module docstring defines them for this device."""
        if run.failure is not None:
            status, message = run.failure
            return Measurement("conflict" if run.conflict else status, error=message, device=str(self.device))
        m, saved = run.measurement, run.saved
        if self.device.type == "cuda":  # the allocator's peak over the compiled steps; activation as on CPU
            return replace(m, activation_bytes=saved)
        if saved is None:
            return m
        return replace(m, peak_bytes=run.resting + saved, activation_bytes=saved)

    def _saved_bytes(self, snapshot: Any) -> tuple[int, int, int]:
        """(saved activation bytes, eager ops, resting bytes) of one compiled step; see the module docstring."""
        snapshot.reset_grads()
        with SavedForBackward(self.root, [self.harness.optimizer], self.extra) as saved:
            loss = loss_of(self.step_fn())
        eager = eager_ops(loss)
        loss.backward()
        return saved.saved_bytes, eager, saved.resting_bytes


def compiled_space(space: Any, root: nn.Module) -> Any:
    """The search space for this compiled model (``SearchSpace.for_compile``), minus unsafe PT2 budgets.

    torch 2.13's memory-budget partitioner may recompute random ops (dropout) in backward with
    fresh randomness, silently corrupting gradients at any ``activation_memory_budget < 1``
    (pytorch#190758, pytorch#190717; we reproduced it on CPU with ``fallback_random=True``). So for
    a model with active dropout the PT2 budgets are left out unless the user listed them.
    """
    adapted = space.for_compile()
    rng = random_ops(root)
    if rng and adapted.budget_choices:
        if space.compile_budgets is None:
            log.warning(
                "lightning_ckpt: not trying PT2 activation_memory_budget candidates: %s uses dropout, which "
                "the memory-budget partitioner may recompute with fresh randomness (wrong gradients, "
                "pytorch#190758). Set search_space={'compile_budgets': [...]} to try them anyway.",
                rng,
            )
            return replace(adapted, compile_budgets=())
        warnings.warn(
            f"lightning_ckpt: search_space['compile_budgets'] asks for PT2 memory budgets, but the model uses "
            f"dropout ({rng}); torch's memory-budget partitioner may then compute wrong gradients "
            "(pytorch#190758). Remove compile_budgets, or set dropout to 0, unless your torch has the fix.",
            stacklevel=3,
        )
    return adapted


def compiled_search(
    model: nn.Module,
    harness: StepHarness,
    *,
    compiled: bool | None,
    allow_graph_breaks: bool,
    reserve_headroom_bytes: int = 0,
    blocks: tuple[str, ...] = (),
    kept: KeptGraphs | None = None,
) -> CompiledTrials | None:
    """``CompiledTrials`` for ``model`` when it is compiled (``compiled_target``), else ``None``; with ``blocks`` (the
    stacks' blocks) its trials run on them compiled alone (``search.assembly``), else each compiles the user's way.
    ``kept``: the search's ``KeptGraphs``, shared by its runners."""
    regions = compiled_target(model, compiled=compiled)
    if regions is None:
        return None
    trials = CompiledTrials(
        harness,
        regions=regions,
        allow_graph_breaks=allow_graph_breaks,
        reserve_headroom_bytes=reserve_headroom_bytes,
        blocks=blocks,
        model=model,
        kept=kept,
    )
    how = "on its blocks compiled alone" if trials.assembly is not None else "every trial compiles its plan"
    log.info("lightning_ckpt: compiled model (%s): %s", trials.describe(), how)
    return trials


def compiled_target(model: nn.Module, *, compiled: bool | None) -> tuple[str, ...] | None:
    """The compiled regions of ``model`` when it is compiled (``compiled=None``: detect, one walk over the modules;
    ``True``: compiled even where none is found), else ``None``; a model compiled with CUDA graphs is refused."""
    if compiled is False:
        return None
    regions = compiled_regions(model)
    if not regions and not compiled:
        return None
    if uses_cuda_graphs(model):
        raise ConfigurationError(
            "The model is compiled with CUDA graphs (torch.compile(mode='reduce-overhead')), which the tuner does not "
            "support: a graph's memory lives in a private pool recorded once, and every plan change would record new "
            "graphs, so trials could not be measured or compared. Tune with mode='default' or "
            "mode='max-autotune-no-cudagraphs', then reuse the plan file (plan=...) with the mode you train with."
        )
    return regions
