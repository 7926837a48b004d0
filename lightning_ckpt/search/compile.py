"""torch.compile: run every trial compiled, and flag plans that fight the compiler (docs/compile.md).

A compiled step can be silently *slower* under a plan: a graph break inside a checkpointed region runs it eagerly
(pytorch#135816, pytorch#139989), selective checkpointing can defeat compile (pytorch#161889), and plan changes
recompile until a frame reaches ``recompile_limit`` and runs eagerly for good (pytorch#135458). So a trial compiles
its plan in one untimed step, times the compiled steps, and compares what dynamo did with the no-checkpointing
reference (``dynamo.conflict_reason``): a **conflict**, never chosen unless ``allow_graph_breaks=True``.

**Memory.** Dynamo runs compiled frames eagerly under the live-tensor tracker (a ``TorchDispatchMode``), so a compiled
step's **activation bytes** are the storages saved for backward, read by ``saved_tensors_hooks`` (which compiled
graphs honour): a lower bound of the eager definition, compared only with other compiled trials. **Peak**: resting +
activation bytes on CPU; ``max_memory_allocated`` on CUDA. ``compiled=True`` on an eager step undercounts:
saved-tensor hooks cannot see inside an eager checkpointed region.
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
from lightning_ckpt.plan.apply import apply_plan, plan_applied, reused_forwards
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.handle import PlanHandle
from lightning_ckpt.search import dynamo
from lightning_ckpt.search.assembly import BlocksCompiledAlone, graphs_compiled, room_for_graphs

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
    """Forget every compiled graph (process-wide: every search's ``KeptGraphs`` too), so the next call compiles what
    is applied now and plan changes do not accumulate recompiles towards the limit (pytorch#135458)."""
    torch._dynamo.reset()
    for graphs in list(_LIVE):
        graphs.forget()


class KeptGraphs:
    """The graphs dynamo holds for a runner since the last reset: the plans re-timing rounds kept (``keys``: plan key
    and owner), the PT2 budget the unmarked ones were compiled under, and whether blocks ran compiled alone."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, str]] = set()
        self.forget()
        _LIVE.add(self)

    def forget(self) -> None:
        self.budget: float | None = None
        self.keys.clear()
        self.assembled = False

    def release(self) -> None:
        """Drop what was kept: the model's next step then compiles the chosen plan the way the user compiles."""
        if self.keys or self.assembled:
            reset_compiled()

    def apply_reusing(
        self, target: nn.Module | ModelView, plan: Plan, forwards: dict[Any, Any], key: tuple[int, str]
    ) -> PlanHandle:
        """Apply ``plan`` with the forward objects it had before (``reused_forwards``), so dynamo's guards match its
        graph and nothing compiles again; first drop the graphs kept where one more would reach the recompile limit."""
        if self.keys and key not in self.keys and len(self.keys) + 1 >= dynamo.recompile_limit():
            self.release()
        with reused_forwards(forwards):
            return apply_plan(target, plan)


# Every KeptGraphs alive: a reset empties them all (dynamo's cache is process-wide).
_LIVE: weakref.WeakSet[KeptGraphs] = weakref.WeakSet()


def release_kept_graphs() -> None:
    for graphs in list(_LIVE):
        graphs.release()


@contextlib.contextmanager
def eager_while_profiling(enabled: bool) -> Iterator[None]:
    """The enclosed passes eager when ``enabled``: the memory profile and the warm-up describe the eager step and
    would otherwise pay a compile each (tens of seconds on CPU)."""
    if not enabled:
        yield
        return
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        # The live-tensor tracker's global module hooks make every OptimizedModule call warn that hooks
        # fire twice; nothing is compiled here, and the tracker counts by tensor, not by hook call.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


def _budget_forward(module: nn.Module, budget: str, *args: Any, **kwargs: Any) -> Any:
    """The class's forward, after reading ``budget`` so that dynamo guards on it. A string, not the float: dynamo makes
    a float that changed between compiles dynamic, and one graph would then serve every budget."""
    if budget == "":
        raise ValueError("a PT2 budget marker needs the budget")
    return type(module).forward(module, *args, **kwargs)


@dataclass
class _CompiledRun:
    """What one compiled trial found so far, and the state each pass restores."""

    snapshot: StateSnapshot
    compile_seconds: float = 0.0
    failure: tuple[str, str] | None = None  # (status, message) of the pass that failed
    conflict: bool = False  # the compiler refused the plan outright (fullgraph=True)
    measurement: Any = None
    recompiles: int = 0
    saved: int | None = None
    eager_ops: int | None = None
    resting: int = 0


class CompiledTrials:
    """The trial runner of a compiled model: on its blocks compiled alone (``search.assembly``), else each plan
    compiled from a reset, so no trial's recompiles count towards the next one's limit."""

    def __init__(
        self,
        harness: StepHarness,
        *,
        regions: tuple[str, ...],
        allow_graph_breaks: bool,
        reserve_headroom_bytes: int = 0,
        blocks: tuple[str, ...] = (),
        model: nn.Module | None = None,
    ) -> None:
        self.harness = harness
        self.kept = KeptGraphs()
        self.root, self.step_fn, self.device, self.extra = harness.root, harness.step_fn, harness.device, harness.extra
        self.regions = regions
        self.allow_graph_breaks = allow_graph_breaks
        self.memory_limit_bytes: int | None = None
        self.reserve_headroom_bytes = reserve_headroom_bytes  # the CUDA cap's headroom for the allocator's reserve
        self.reference: dynamo.CompileStats | None = None
        self._cache: dict[str, tuple[Measurement, dynamo.CompileStats]] = {}
        self._forwards: dict[Any, Any] = {}  # what plans installed, reinstalled as they were (``reused_forwards``)
        self.retime_compiles = 0  # re-timings that compiled (the first of a plan, or after a reset)
        self.assembly = (
            BlocksCompiledAlone(model if model is not None else self.root, self.root, blocks) if blocks else None
        )
        self.graphs = 0  # graphs the trials compiled (``search.assembly``: distinct blocks x modes, not plans)
        self.compile_seconds = 0.0  # the seconds of the steps that compiled them
        self._retimed: set[str] = set()  # plans re-timed on the blocks compiled alone (their graphs exist)

    def adapt(self, space: Any) -> Any:
        return compiled_space(space, self.root)

    def describe(self) -> str:
        return ", ".join(r or "<whole model>" for r in self.regions) or "<step function>"

    def none_activation_bytes(self, none_plan: Plan) -> int | None:
        """Activation bytes of the compiled step without checkpointing: what activation budgets are fractions of."""
        return self.measure_compiled(none_plan).activation_bytes

    # Set by ``tune`` once the blocks' compiled memory is anchored (``memory.compiled``); never exact: each trial reads
    # its own memory.
    predicts_memory = False
    memory_exact = False
    predicts_time = False
    collective_steps = False

    def measure_memory(self, plan: Plan, memory_limit: int | None) -> Measurement:
        return self.measure(plan, memory_limit)  # every compiled trial is measured whole (cached)

    def measure(self, plan: Plan, memory_limit: int | None, *, memory: bool = True) -> Measurement:
        """``plan`` compiled (``memory_limit``: the CUDA cap), and whether it fights the compiler."""
        self.memory_limit_bytes = memory_limit
        m = self.measure_compiled(plan)
        stats = self._cache[plan.key()][1]
        reason = None if plan.is_empty else dynamo.conflict_reason(stats, self.reference)
        extra: dict[str, Any] = {**m.extra, "compiled_regions": list(self.regions)}
        steps = 1 + m.warmup_steps + len(m.step_seconds) + (1 if stats.saved_bytes is not None else 0)
        return replace(m, steps=steps, conflict=reason, extra=extra)

    def retime(self, plan: Plan, steps: int | None = None, *, warmup: int = 1) -> Measurement:
        """Time ``plan`` again: an untimed first step (it compiles the plan, or runs its kept graph: the warm-up),
        then the timed steps. Each plan gets the forwards it had the first time, so a later round costs no compile."""
        if self.assembly is not None:
            return self._assembled_retime(plan, steps, warmup)
        key = (id(self), plan.key())  # another runner (micro-batch) is another batch shape: other graphs
        handle = self.kept.apply_reusing(self.harness.target, plan, self._forwards, key)
        try:
            with self._budget_marked(plan.compile_memory_budget):
                compiles = key not in self.kept.keys
                run = _CompiledRun(StateSnapshot.capture(self.root))
                self._compile_then_time(run, steps)
        finally:
            handle.remove()
        if run.failure is not None or not run.measurement.ok:
            reset_compiled()  # whatever the failed step left compiled is not kept
        else:
            self.kept.keys.add(key)
            self.retime_compiles += compiles
        m = self._reading(run)
        return replace(m, extra={**m.extra, "compile": {"compile_seconds": run.compile_seconds, "compiled": compiles}})

    @contextlib.contextmanager
    def _budget_marked(self, budget: float | None) -> Iterator[None]:
        """Every compiled region given the forward that names ``budget`` (``_budget_forward``). Unmarked (no budget, or
        an instance forward already), no guard tells budgets apart: the graphs kept under another budget are dropped."""
        fqns = () if budget is None else self.assembly.blocks if self.assembly is not None else self.regions
        # The root may be the compiled wrapper itself (``torch.compile(model)``), whose ``forward`` is an instance one.
        modules = [unwrap_compiled(self.root.get_submodule(fqn) if fqn else self.root) for fqn in fqns]
        if not modules or any("forward" in vars(m) for m in modules):
            if budget != self.kept.budget:
                self.kept.release()
            self.kept.budget = budget
            yield
            return
        for m in modules:
            marker = functools.partial(_budget_forward, m, repr(budget))
            m.__dict__["forward"] = self._forwards.setdefault((id(m), "budget", repr(budget)), marker)
        try:
            yield
        finally:
            for m in modules:
                del m.__dict__["forward"]

    def measure_compiled(self, plan: Plan) -> Measurement:
        """Measure ``plan`` compiled, once (cached); ``extra["compile"]`` is what dynamo did."""
        if plan.key() not in self._cache:
            measure = self._assembled_measure if self.assembly is not None else self._compile_and_measure
            self._cache[plan.key()] = measure(plan)
        m, stats = self._cache[plan.key()]
        if plan.is_empty and self.reference is None:
            self.reference = stats
        return m

    def measure_partitioned(self, plan: Plan) -> Measurement:
        """``plan`` (a PT2 budget) measured on the blocks, with the bytes the user's compile of several blocks in one
        graph saves (``assembly.partition_only_backend``): the blocks' time, the peak moved by the saved bytes."""
        assert self.assembly is not None, "partitioning whole needs the blocks a compiled search ran alone"
        on_blocks = self.measure_compiled(plan)
        graphs_before = graphs_compiled()
        run = _CompiledRun(StateSnapshot.capture(self.root))
        try:
            with self.assembly.partitioned(), room_for_graphs(), plan_applied(self.harness.target, plan):
                self._compile_step(run)
                if run.failure is None:
                    self._memory_pass(run)
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

    @contextlib.contextmanager
    def _assembled(self, plan: Plan) -> Iterator[None]:
        """``plan`` applied to the blocks compiled alone, with the forwards it had before: earlier trials' graphs."""
        assert self.assembly is not None
        with self.assembly.installed(), room_for_graphs(), contextlib.ExitStack() as stack:
            with reused_forwards(self._forwards):
                stack.enter_context(plan_applied(self.harness.target, plan))
            stack.enter_context(self.assembly.segments_eager(self.root, plan.segments))
            stack.enter_context(self._budget_marked(plan.compile_memory_budget))
            self.kept.assembled = True
            yield

    def _count_compiles(self, graphs: int, run: _CompiledRun) -> int:
        """Graphs compiled since ``graphs``, counted with the compiling step's seconds."""
        new = graphs_compiled() - graphs
        if new:
            self.graphs += new
            self.compile_seconds += run.compile_seconds
        return new

    def _assembled_measure(self, plan: Plan) -> tuple[Measurement, dynamo.CompileStats]:
        """Measure ``plan`` on the blocks compiled alone; what dynamo did is read as differences (nothing is reset)."""
        watch = dynamo.DynamoWatch()
        breaks_before, graphs_before = dynamo.break_count(), graphs_compiled()
        run = _CompiledRun(StateSnapshot.capture(self.root))
        try:
            with self._assembled(plan):
                self._compile_step(run)
                compiled_now = self._count_compiles(graphs_before, run)
                if run.failure is None:
                    graphs_timed = graphs_compiled()
                    run.measurement = self._timed_steps(None)
                    run.recompiles = graphs_compiled() - graphs_timed  # a stable plan: nothing after its first step
                    if run.measurement.ok:
                        self._memory_pass(run)
        finally:
            release_memory(self.device)
        seconds = run.compile_seconds if compiled_now else 0.0
        return self._with_stats(
            run, seconds, compiled_now, dynamo.break_summaries(since=breaks_before), watch.limit_hit()
        )

    def _assembled_retime(self, plan: Plan, steps: int | None, warmup: int) -> Measurement:
        """``retime`` on the blocks compiled alone: a plan's first run starts with the step that compiles its graphs."""
        graphs_before = graphs_compiled()
        run = _CompiledRun(StateSnapshot.capture(self.root))
        with self._assembled(plan):
            if plan.key() in self._cache or plan.key() in self._retimed:
                run.measurement = self._timed_steps(steps, warmup=warmup)
            else:
                self._compile_then_time(run, steps)
        self._retimed.add(plan.key())
        compiled_now = self._count_compiles(graphs_before, run)
        self.retime_compiles += bool(compiled_now)
        m = self._reading(run)
        extra = {"compile_seconds": run.compile_seconds if compiled_now else 0.0, "compiled": bool(compiled_now)}
        return replace(m, extra={**m.extra, "compile": {**extra, "graphs": compiled_now}})

    def _compile_and_measure(self, plan: Plan) -> tuple[Measurement, dynamo.CompileStats]:
        with reused_forwards(self._forwards):
            handle = apply_plan(self.harness.target, plan)
        reset_compiled()
        watch = dynamo.DynamoWatch()
        run = _CompiledRun(StateSnapshot.capture(self.root))
        try:
            self._compile_then_time(run, None)
            if run.failure is None:
                run.recompiles = dynamo.recompile_count()  # before the memory pass, which must not count
                if run.measurement.ok:
                    self._memory_pass(run)
        finally:
            handle.remove()
            breaks, limit_hit = dynamo.break_summaries(), watch.limit_hit()
            reset_compiled()
            release_memory(self.device)
        return self._with_stats(run, run.compile_seconds, 1, breaks, limit_hit)

    def _with_stats(
        self, run: _CompiledRun, seconds: float, graphs: int, breaks: tuple[int, int, tuple[str, ...]], limit_hit: bool
    ) -> tuple[Measurement, dynamo.CompileStats]:
        """The trial's reading with what dynamo did (``breaks``: ``dynamo.break_summaries``) in its extra."""
        total, in_regions, reasons = breaks
        stats = dynamo.CompileStats(
            seconds, graphs, total, in_regions, run.recompiles, limit_hit, run.eager_ops, run.saved, reasons
        )
        return replace(self._reading(run), extra={"compile": stats.to_dict()}), stats

    def _compile_then_time(self, run: _CompiledRun, steps: int | None) -> None:
        self._compile_step(run)
        if run.failure is None:
            run.measurement = self._timed_steps(steps)

    def _compile_step(self, run: _CompiledRun) -> None:
        """The first step, which compiles forward and backward: tuning cost, never throughput."""
        try:
            run.snapshot.reset_grads()
            t0 = time.perf_counter()
            self.harness.train_step()
            run.compile_seconds = time.perf_counter() - t0
        except Exception as exc:  # the compiler refused or failed on this plan
            run.failure = classify_failure(exc)
            run.conflict = dynamo.is_dynamo_refusal(exc)
        finally:
            run.snapshot.restore()

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

    def _memory_pass(self, run: _CompiledRun) -> None:
        """The saved activation bytes, eager ops and resting bytes of one compiled step (see the module docstring)."""
        try:
            run.snapshot.reset_grads()
            with SavedForBackward(self.root, [self.harness.optimizer], self.extra) as saved:
                loss = loss_of(self.step_fn())
            eager = dynamo.eager_ops(loss)
            loss.backward()
            run.saved, run.eager_ops, run.resting = saved.saved_bytes, eager, saved.resting_bytes
        except Exception as exc:  # noqa: BLE001 - a memory pass failure fails the trial, not the search
            run.failure = classify_failure(exc)
        finally:
            run.snapshot.restore()

    def _reading(self, run: _CompiledRun) -> Measurement:
        """The trial's figures as the module docstring defines them."""
        if run.failure is not None:
            status, message = run.failure
            return Measurement("conflict" if run.conflict else status, error=message, device=str(self.device))
        m, saved = run.measurement, run.saved
        if self.device.type == "cuda":  # the allocator's peak over the compiled steps; activation as on CPU
            return replace(m, activation_bytes=saved)
        if saved is None:
            return m
        return replace(m, peak_bytes=run.resting + saved, activation_bytes=saved)


def compiled_space(space: Any, root: nn.Module) -> Any:
    """``space.for_compile()`` minus unsafe PT2 budgets: torch 2.13's memory-budget partitioner may recompute dropout
    in backward with fresh randomness, corrupting gradients at any budget < 1 (pytorch#190758, pytorch#190717), so
    with active dropout they are left out unless the user listed them."""
    adapted = space.for_compile()
    rng = dynamo.random_ops(root)
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
) -> CompiledTrials | None:
    """``CompiledTrials`` for ``model`` when it is compiled (``compiled_target``), else ``None``."""
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
    )
    how = "on its blocks compiled alone" if trials.assembly is not None else "every trial compiles its plan"
    log.info("lightning_ckpt: compiled model (%s): %s", trials.describe(), how)
    return trials


def compiled_target(model: nn.Module, *, compiled: bool | None) -> tuple[str, ...] | None:
    """The compiled regions of ``model`` (``compiled=None``: detect; ``True``: compiled even where none is found), else
    ``None``; a model compiled with CUDA graphs is refused."""
    if compiled is False:
        return None
    regions = compiled_regions(model)
    if not regions and not compiled:
        return None
    if dynamo.uses_cuda_graphs(model):
        raise ConfigurationError(
            "The model is compiled with CUDA graphs (torch.compile(mode='reduce-overhead')), which the tuner does not "
            "support: a graph's memory lives in a private pool recorded once, and every plan change would record new "
            "graphs, so trials could not be measured or compared. Tune with mode='default' or "
            "mode='max-autotune-no-cudagraphs', then reuse the plan file (plan=...) with the mode you train with."
        )
    return regions
