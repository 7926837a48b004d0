"""Measure one training step honestly: time, peak and activation memory, recompute FLOPs, OOM capture.

Definitions used everywhere in lightning_ckpt (budgets, predictions, tests):

* **peak bytes**: the highest number of bytes held by live tensors at any moment of the step,
  everything included (parameters, buffers, gradients, optimizer state, activations, temporaries).
  CUDA: ``torch.cuda.max_memory_allocated``. CPU: a live-tensor tracker, since no allocator counter exists.
* **activation bytes**: the highest number of bytes held at any moment by tensors the step itself
  created *other than* parameter gradients and optimizer state: saved activations, recomputed
  activations and backward temporaries. This is the part checkpointing changes. It is read with the
  live-tensor tracker on every device (the CUDA allocator cannot tell gradients from activations), so
  it means the same on a GPU as on a CPU.
* **resting bytes**: live bytes when the step starts (parameters, buffers, existing gradients,
  optimizer state, and the tensors passed as ``extra``, e.g. the batch).
* **recompute FLOPs**: FLOPs of the forward ops that run *again* during backward because of
  checkpointing. They are counted exactly with ``FlopCounterMode``: an op counts as recompute when it
  runs inside the autograd engine (``torch._C._current_graph_task_id() != -1``) with grad mode on.
  Backward formulas run with grad mode off (unless ``create_graph=True``), while checkpoint
  recomputation explicitly enables it, so the two are told apart without knowing the plan.

Memory is read by ``measure.tracker``'s live-tensor tracker (CPU, and activation bytes everywhere) and the
CUDA allocator; the state a step disturbs is put back by ``measure.snapshot``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt.errors import ApplyError, ConfigurationError, PlanError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.measure.allocator import allocator_figures, split_resistant
from lightning_ckpt.measure.device_memory import (
    DeviceMemory,
    device_memory,
    refused_although_it_fits,
    requested_bytes,
)
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.status import TrialStatus
from lightning_ckpt.measure.tracker import new_live_tracker, normalise_device, removing_grad_hooks
from lightning_ckpt.model import model_device

__all__ = [
    "MEASUREMENT_STATUSES",
    "classify_failure",
    "is_out_of_memory",
    "release_memory",
    "Measurement",
    "MemoryReading",
    "measure_step",
    "median_and_spread",
    "track_step_memory",
]

# The measurement's part of the status vocabulary (measure.status.TrialStatus owns it).
MEASUREMENT_STATUSES = tuple(
    s.value
    for s in (
        TrialStatus.OK,
        TrialStatus.OVER_BUDGET,
        TrialStatus.OOM,
        TrialStatus.INVALID,
        TrialStatus.ERROR,
        TrialStatus.CONFLICT,
    )
)

# Messages of CPU allocation failures (c10/core/impl/alloc_cpu.cpp and friends). CPU OOM surfaces as a
# plain RuntimeError, so the message is the only way to tell it from a bug.
_OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "not enough memory",
    # Out of memory outside the caching allocator: a raw CUDA error (torch.AcceleratorError or RuntimeError,
    # e.g. pinned host memory exhausted by an offload trial), and the libraries' own workspace allocations.
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
)
_MAX_ERROR_CHARS = 2000
# A failed step that leaves more than this allocated above where it started is reported (allocator rounding and
# cached workspaces stay below it).
LEAK_TOLERANCE_BYTES = 1 << 20

log = logging.getLogger(__name__)
_MAX_TRACE_CHARS = 8000


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one step; see the module docstring for the definitions."""

    peak_bytes: int
    activation_bytes: int | None  # None only from the guard's reader when activation was not asked for
    resting_bytes: int  # live bytes when the step started (parameters, existing grads, optimizer state)
    device: str
    # The allocator's, where there is one (the guard's real steps): its reserved peak, and how many times it had to
    # release its cache to serve a request (``num_alloc_retries``): a card near refusing what allocated bytes fit.
    reserved_peak_bytes: int | None = None
    alloc_retries: int = 0


def track_step_memory(
    step_fn: Callable[[], Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    extra: tuple[Any, ...] = (),
) -> MemoryReading:
    """Run ``step_fn`` once and read its peak and activation memory.

    On CPU this runs under a dispatch-mode tracker, which slows the step several-fold: never time
    a step and track its memory in the same pass. ``extra`` are tensors created outside the step
    (e.g. the batch) that should count as resting state.
    """
    device = normalise_device(torch.device(device) if device is not None else model_device(model))
    return _tracked_step(step_fn, _step_tracker(device, model, optimizer, extra), device)


def _step_tracker(
    device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: tuple[Any, ...]
) -> Any:
    """A live-tensor tracker counting ``model``, ``optimizer`` and ``extra`` as resting state, its peak at rest."""
    tracker = new_live_tracker(device, model, optimizer)
    externals = [model, *extra] + ([optimizer] if optimizer is not None else [])
    tracker.track_external(*externals)
    tracker.resting_bytes = tracker.total_peak = tracker.now()[0]
    return tracker


def _tracked_step(step_fn: Callable[[], Any], tracker: Any, device: torch.device) -> MemoryReading:
    memory = device_memory(device)
    if memory is not None:
        # Peak from the allocator (what an OOM is decided on); activation bytes from the tracker, whose
        # categories tell them from gradients, as on CPU.
        _synchronize(device)
        gc.collect()
        resting = memory.allocated()
        memory.reset_peak()
        with tracker:
            step_fn()
        _synchronize(device)
        return MemoryReading(memory.max_allocated(), tracker.activation_peak, resting, str(device))
    resting = tracker.total_peak
    with tracker:
        step_fn()
    return MemoryReading(tracker.total_peak, tracker.activation_peak, resting, str(device))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------
# Failure classification
# ---------------------------------------------------------------------------------------------------
class _BudgetExceeded(Exception):
    """The step completed above ``memory_limit_bytes`` where no allocator cap enforces it (CPU, or on CUDA
    between the limit and the cap).

    A measured verdict, not an OOM: as an OOM it would end a sharded (FSDP2) search on this rank alone while
    the other ranks wait in a collective; as ``over_budget`` every rank records the trial and the ranks' worst
    status is the trial's.
    """


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc``, or any exception it was raised from or during (Dynamo wraps an OOM in the compiled
    backend in ``BackendCompilerFailed``), is an out-of-memory error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _OOM_MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False


def classify_failure(exc: Exception) -> tuple[str, str]:
    """(status, message) for an exception raised while running a step."""
    from torch.utils.checkpoint import CheckpointError

    message = f"{type(exc).__name__}: {exc}"
    if len(message) > _MAX_ERROR_CHARS:
        message = message[: _MAX_ERROR_CHARS - 3] + "..."
    if is_out_of_memory(exc):
        return "oom", message
    # A checkpoint or plan error means "this plan cannot run on this model", not "the code is broken".
    if isinstance(exc, (CheckpointError, PlanError, ApplyError)):
        return "invalid", message
    return "error", message


def release_memory(device: torch.device) -> None:
    # Called after the ``except`` clause has ended: only then are the exception, its traceback and
    # the frames holding the failed step's tensors unreachable, so collecting actually frees them.
    gc.collect()
    memory = device_memory(device)
    if memory is not None:
        memory.empty_cache()


class PassOutOfMemory(Exception):
    """A pass that ``run_pass`` ran was refused memory, also on its retry: which pass, the refusal's message and
    the allocator's figures when it was refused. Raised once the pass's memory is released, holding no tensor."""

    def __init__(self, what: str, message: str, figures: dict[str, Any], retry: str | None) -> None:
        super().__init__(f"{what} ran out of memory: {message}")
        self.what, self.message, self.figures, self.retry = what, message, figures, retry

    def allocator_note(self) -> str:
        """The allocator's figures in a few words, for the error a user reads."""
        stats = self.figures.get("stats", {})
        if not stats:
            return ""
        parts = [
            f"{format_bytes(stats.get('allocated_bytes.all.current', 0))} allocated",
            f"{format_bytes(stats.get('reserved_bytes.all.current', 0))} reserved",
            f"{format_bytes(stats.get('inactive_split_bytes.all.current', 0))} free in split blocks",
            f"{stats.get('num_alloc_retries', 0)} allocator retries",
            f"reserved peak {format_bytes(stats.get('reserved_bytes.all.peak', 0))}",
        ]
        retry = f"; retried from an emptied cache with {self.retry}" if self.retry else "; not retried"
        return f"; the allocator had {', '.join(parts)}{retry}"


def run_pass(
    what: str,
    device: torch.device,
    run: Callable[[], Any],
    restore: Callable[[], None] | None = None,
    *,
    cold: bool = True,
) -> Any:
    """``run()``, from an emptied cache when it needs step-sized buffers (``cold``; a block run alone does not, and
    emptying a CUDA cache synchronises); once more, from an emptied cache, when the allocator refused a request that
    the allocated bytes fit (its cache was fragmented), this time split-resistant (``allocator.split_resistant``;
    nothing to change with expandable segments, so no retry). ``restore`` puts the model back between the two. A
    refusal that stays raises ``PassOutOfMemory``; other errors pass through."""
    memory = device_memory(device)
    retry: str | None = None
    request = 0
    for attempt in (1, 2):
        if memory is not None and cold and attempt == 1:  # the retry's cache was emptied by ``release_memory``
            memory.empty_cache()
        try:
            resist = split_resistant(memory, request) if attempt == 2 and memory is not None else None
            with resist or contextlib.nullcontext() as retry:
                return run()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            message = f"{type(exc).__name__}: {str(exc)[:_MAX_ERROR_CHARS]}"
            figures = allocator_figures(memory)
            fits = refused_although_it_fits(exc, memory, None)
            request = requested_bytes(str(exc)) or 0
        release_memory(device)  # outside the ``except``: the failed pass's frames are gone
        if restore is not None:
            restore()
        if attempt == 2 or fits is None or memory is None or memory.allocator_options().expandable_segments:
            break
        log.info("lightning_ckpt: %s was refused memory (%s); once more, split-resistant", what, fits)
    raise PassOutOfMemory(what, message, figures, retry)


# ---------------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """The outcome of measuring one training-step callable (one candidate plan).

    status: ``ok`` | ``over_budget`` (the step completed above ``memory_limit_bytes``: peak and activation
    hold what it reached, there are no timings) | ``oom`` (out of memory) | ``invalid`` (a
    ``CheckpointError``, ``PlanError`` or ``ApplyError``: the plan cannot run on this model) |
    ``error`` (anything else; ``error`` holds the exception type and message) | ``conflict`` (the compiler
    refused the plan outright: ``fullgraph=True`` and a graph break).
    step_seconds: wall time of each timed step, warm-up excluded; empty unless status is ``ok``.
    median_seconds / spread_seconds: median of ``step_seconds`` and their median absolute deviation
    (MAD, unscaled: the median of ``|t - median|``), a spread robust to one slow outlier step.
    peak_bytes / activation_bytes / resting_bytes: see the module docstring.
    recompute_flops / step_flops: only when ``count_flops=True``; see the module docstring.
    steps: training steps the measurement ran (tuning cost): by default its warm-up, timed steps and memory
    pass; a runner that ran more (a compiled trial's compile step) says so.
    conflict: why a plan that ran fights ``torch.compile`` (graph breaks, the recompile limit), else None.
    extra: facts for display that the runner adds (compile statistics, pinned host memory, stacks a segment
    left the chain on).

    This is the one shape a trial's figures take before ``TrialRecord.with_measurement`` puts them in the
    study's record: a new figure is added here and there.
    """

    status: str
    step_seconds: tuple[float, ...] = ()
    median_seconds: float | None = None
    spread_seconds: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    peak_bytes: int | None = None
    activation_bytes: int | None = None
    recompute_flops: int | None = None
    error: str | None = None
    warmup_steps: int = 0
    step_flops: int | None = None
    resting_bytes: int | None = None
    device: str = ""
    traceback: str | None = None  # status ``error`` only: where the step failed
    steps: int | None = None
    conflict: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in MEASUREMENT_STATUSES:
            raise ConfigurationError(
                f"Measurement.status must be one of {MEASUREMENT_STATUSES}, but got {self.status!r}."
            )
        object.__setattr__(self, "status", str(TrialStatus(self.status).value))
        object.__setattr__(self, "step_seconds", tuple(float(t) for t in self.step_seconds))
        if self.steps is None:
            memory_pass = 1 if self.peak_bytes is not None else 0
            object.__setattr__(self, "steps", self.warmup_steps + len(self.step_seconds) + memory_pass)

    @property
    def trial_status(self) -> TrialStatus:
        return TrialStatus(self.status)

    @property
    def recompute_overhead(self) -> float | None:
        """Recomputed FLOPs as a fraction of the step without them (None without a FLOP count)."""
        if self.recompute_flops is None or not self.step_flops:
            return None
        return self.recompute_flops / max(1, self.step_flops - self.recompute_flops)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def relative_spread(self) -> float | None:
        """``spread_seconds / median_seconds``: below ~0.02 two candidates' medians are comparable."""
        if not self.median_seconds or self.spread_seconds is None:
            return None
        return self.spread_seconds / self.median_seconds

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step_seconds"] = list(self.step_seconds)
        d["extra"] = dict(self.extra)
        return d


def median_and_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median and median absolute deviation of ``times`` (the statistics ``Measurement`` reports)."""
    med = statistics.median(times)
    return med, statistics.median(abs(t - med) for t in times)


@contextlib.contextmanager
def _enforced_memory_limit(memory: DeviceMemory | None, limit: int | None, reserve_headroom: int = 0) -> Iterator[bool]:
    """Cap this process's allocator near ``limit`` bytes, restoring the previous cap afterwards; yields whether
    the cap set is tighter than the one before (the user's own fraction, or the whole card).

    The cap (``set_per_process_memory_fraction``) counts *reserved* memory, while budgets count
    allocated bytes: ``reserve_headroom`` (the allocator's reserve above allocated, measured on the
    profile's step) is added so a plan that fits in allocated bytes is rarely failed by block rounding, and
    ``measure_step`` re-runs once without it a step the cap refused although its allocated bytes fitted.
    The budget itself is still judged on ``max_memory_allocated``. A smaller cap the user set is kept.
    """
    if limit is None or memory is None:
        if memory is not None:
            memory.empty_cache()  # step-sized buffers from a cold cache, not from what the last plan's steps split
        yield False
        return
    previous = memory.get_fraction()
    # Cached free blocks are handed out without checking the cap, so empty the cache first or a
    # plan over budget could pass by reusing memory an earlier candidate left reserved.
    gc.collect()
    memory.empty_cache()
    fraction = min(previous, (limit + max(0, reserve_headroom)) / memory.total_bytes)
    memory.set_fraction(fraction)
    try:
        yield fraction < previous
    finally:
        memory.set_fraction(previous)


def _in_recompute() -> bool:
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


_FLOP_COUNTER_CLASS: type | None = None


class _GlobalModuleOnly:
    """Stands in for ``FlopCounterMode``'s module tracker: every op is the step's ("Global"), no hook registered."""

    parents = frozenset({"Global"})
    is_bw = False

    def __enter__(self) -> _GlobalModuleOnly:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def _flop_counter() -> Any:
    global _FLOP_COUNTER_CLASS
    if _FLOP_COUNTER_CLASS is None:
        from torch.utils.flop_counter import FlopCounterMode

        class _RecomputeFlopCounter(FlopCounterMode):
            """FlopCounterMode that also sums the FLOPs of ops run by checkpoint recomputation."""

            def __init__(self) -> None:
                super().__init__(display=False)
                self.recompute_flops = 0
                # Only the step's total is read, so no per-module attribution: torch's module tracker registers a
                # multi-grad hook on every module's outputs, recomputed ones included, and a recomputed graph whose
                # backward never runs stays alive in a hook cycle until the pass ends: a fully checkpointed step
                # counted with it peaked as high as no checkpointing, enough to fail a plan on a card it fits.
                if hasattr(self, "mod_tracker"):
                    self.mod_tracker = _GlobalModuleOnly()

            def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
                if func_packet in self.flop_registry and _in_recompute():
                    self.recompute_flops += self.flop_registry[func_packet](*args, **kwargs, out_val=out)
                return super()._count_flops(func_packet, out, args, kwargs)

        _FLOP_COUNTER_CLASS = _RecomputeFlopCounter
    return _FLOP_COUNTER_CLASS()


def _validate(
    warmup: int,
    steps: int,
    max_steps: int | None,
    target_rel_spread: float | None,
    batch_size: int | None,
    seq_len: int | None,
    memory_limit_bytes: int | None,
) -> None:
    def _is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not _is_int(warmup) or warmup < 0:
        raise ConfigurationError(f"`warmup >= 0` must hold, but got warmup={warmup!r}.")
    if not _is_int(steps) or steps < 1:
        raise ConfigurationError(f"`steps >= 1` must hold, but got steps={steps!r}.")
    if max_steps is not None and (not _is_int(max_steps) or max_steps < steps):
        raise ConfigurationError(
            f"`max_steps >= steps` must hold, but got (steps={steps!r}, max_steps={max_steps!r}). "
            "Leave max_steps=None to time exactly `steps` steps."
        )
    if target_rel_spread is not None and not (isinstance(target_rel_spread, (int, float)) and target_rel_spread > 0):
        raise ConfigurationError(f"`target_rel_spread > 0` must hold, but got {target_rel_spread!r}.")
    if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
        raise ConfigurationError(f"`batch_size >= 1` must hold, but got batch_size={batch_size!r}.")
    if seq_len is not None and (not _is_int(seq_len) or seq_len < 1):
        raise ConfigurationError(f"`seq_len >= 1` must hold, but got seq_len={seq_len!r}.")
    if seq_len is not None and batch_size is None:
        raise ConfigurationError(
            "tokens/s needs the number of sequences per step: pass batch_size together with seq_len."
        )
    if memory_limit_bytes is not None and (not _is_int(memory_limit_bytes) or memory_limit_bytes < 1):
        raise ConfigurationError(f"`memory_limit_bytes >= 1` must hold, but got {memory_limit_bytes!r}.")


def _timed_steps(
    step_fn: Callable[[], Any],
    snapshot: StateSnapshot,
    sync: Callable[[], None],
    clock: Callable[[], float],
    times: list[float],
    steps: int,
    limit_steps: int,
    target_rel_spread: float | None,
) -> None:
    """Append step times to ``times``: ``steps`` of them, then more until MAD/median reaches
    ``target_rel_spread`` or ``limit_steps`` were timed."""
    while True:
        snapshot.reset_grads()
        sync()
        start = clock()
        step_fn()
        sync()
        times.append(clock() - start)
        if len(times) < steps:
            continue
        if len(times) >= limit_steps:
            return
        med, spread = median_and_spread(times)
        if med > 0 and spread / med <= float(target_rel_spread or 0):
            return


@dataclass
class _Passes:
    """One ``measure_step``'s passes over ``step_fn``, and what they read.

    In order: (``tracked``) one step under the live-tensor tracker, first because it is the cheapest way
    to learn that a candidate does not fit, and the reading of activation bytes; (``timed``) the untimed
    warm-up steps (compile and allocator warm-up are not throughput), then the timed steps (CUDA:
    synchronised, with peak stats reset first and ``max_memory_allocated`` read after); then
    (``counted``) one step under ``FlopCounterMode``. Each step starts from the captured gradients.
    """

    step_fn: Callable[[], Any]
    snapshot: StateSnapshot
    device: torch.device
    limit: int | None  # memory_limit_bytes
    times: list[float] = field(default_factory=list)
    reading: MemoryReading | None = None
    flops: tuple[int, int] | None = None
    tracker: Any = None  # the tracked pass's: on CPU, what tells whether a failed step freed what it allocated

    def tracked(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: tuple[Any, ...]) -> None:
        self.snapshot.reset_grads()
        self.tracker = _step_tracker(self.device, model, optimizer, extra)
        reading = _tracked_step(self.step_fn, self.tracker, self.device)
        self.reading = reading
        if self.limit is not None and reading.peak_bytes > self.limit:
            raise _BudgetExceeded(f"tracked peak of {reading.peak_bytes} bytes exceeds memory_limit_bytes={self.limit}")

    def timed(
        self,
        warmup: int,
        steps: int,
        limit_steps: int,
        target_rel_spread: float | None,
        clock: Callable[[], float],
        read_allocator: bool,
    ) -> None:
        for _ in range(warmup):
            self.snapshot.reset_grads()
            self.step_fn()
        self.snapshot.reset_grads()
        memory = device_memory(self.device)
        if memory is not None:
            self._sync()
            gc.collect()
            resting = memory.allocated()
            memory.reset_peak()
        _timed_steps(self.step_fn, self.snapshot, self._sync, clock, self.times, steps, limit_steps, target_rel_spread)
        if memory is not None and (self.reading is not None or read_allocator):
            peak = memory.max_allocated()
            if self.reading is not None:
                peak = max(peak, self.reading.peak_bytes)
            activation = self.reading.activation_bytes if self.reading else None
            self.reading = MemoryReading(peak, activation, resting, str(self.device))
            if self.limit is not None and peak > self.limit:
                raise _BudgetExceeded(f"peak of {peak} bytes exceeds memory_limit_bytes={self.limit}")

    def counted(self) -> None:
        self.snapshot.reset_grads()
        counter = _flop_counter()
        with removing_grad_hooks(), counter:  # FlopCounterMode's module tracker hooks every module, as MemTracker's
            self.step_fn()
        self.flops = (counter.recompute_flops, counter.get_total_flops())

    def _sync(self) -> None:
        _synchronize(self.device)

    def outcome(
        self,
        warmup: int,
        failure: tuple[str, ...] | None,
        over_budget: str | None,
        batch_size: int | None,
        seq_len: int | None,
        extra: Mapping[str, Any] | None = None,
    ) -> Measurement:
        """The ``Measurement`` of these passes: failed, over budget, or timed (with their memory and FLOPs)."""
        device, reading, flops, extra = str(self.device), self.reading, self.flops, dict(extra or {})
        if failure is not None:
            trace = failure[2] if len(failure) > 2 else None
            return Measurement(
                failure[0], error=failure[1], warmup_steps=warmup, device=device, traceback=trace, extra=extra
            )
        if over_budget is not None and reading is not None:
            return Measurement(
                TrialStatus.OVER_BUDGET.value,
                peak_bytes=reading.peak_bytes,
                activation_bytes=reading.activation_bytes,
                resting_bytes=reading.resting_bytes,
                error=over_budget,
                warmup_steps=warmup,
                device=device,
                extra=extra,
            )
        med, spread = median_and_spread(self.times)
        samples = batch_size / med if batch_size is not None and med > 0 else None
        tokens = samples * seq_len if samples is not None and seq_len is not None else None
        return Measurement(
            "ok",
            step_seconds=tuple(self.times),
            median_seconds=med,
            spread_seconds=spread,
            samples_per_second=samples,
            tokens_per_second=tokens,
            peak_bytes=reading.peak_bytes if reading else None,
            activation_bytes=reading.activation_bytes if reading else None,
            recompute_flops=flops[0] if flops else None,
            error=None,
            warmup_steps=warmup,
            step_flops=flops[1] if flops else None,
            resting_bytes=reading.resting_bytes if reading else None,
            device=device,
            extra=extra,
        )


def _failure_of(exc: Exception) -> tuple[str, ...]:
    """(status, message) for a failed step; a bug (``error``, not a verdict on the plan) also keeps where it
    happened, for the user."""
    failure = classify_failure(exc)
    if failure[0] == "error":
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return (failure[0], failure[1], trace[-_MAX_TRACE_CHARS:])
    return failure


def _refuse_changed_parameters(snapshot: StateSnapshot) -> None:
    changed = snapshot.changed_parameters()
    if changed:
        raise ConfigurationError(
            f"step_fn modified {len(changed)} parameter(s) in place (first: {changed[0]!r}), e.g. by calling "
            "optimizer.step(). A measured step must only run forward and backward; step the optimizer "
            "outside measure_step."
        )


def measure_step(
    step_fn: Callable[[], Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int = 1,
    steps: int = 3,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    track_memory: bool = True,
    count_flops: bool = False,
    memory_limit_bytes: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    max_steps: int | None = None,
    target_rel_spread: float | None = None,
    extra: tuple[Any, ...] = (),
    reserve_headroom_bytes: int = 0,
    read_allocator: bool = False,
) -> Measurement:
    """Time ``step_fn`` (forward + backward of one batch) and read its memory, never raising for OOM.

    ``step_fn`` takes no arguments and must *not* step the optimizer: measuring must leave training
    untouched. ``measure_step`` itself restores every ``.grad``, every buffer and the global RNG
    streams afterwards, resets ``.grad`` to its starting state before every step (so each step
    allocates its gradients as a real step does), and raises ``ConfigurationError`` if a parameter
    was modified in place. ``optimizer`` is only used to count its state as resting memory.

    Passes, in order (see ``_Passes``): (``track_memory``) one step under the live-tensor tracker;
    ``warmup`` untimed steps; ``steps`` timed steps; then (``count_flops``) one step under
    ``FlopCounterMode``. With ``target_rel_spread``, timing continues past ``steps`` until
    MAD/median falls below it or ``max_steps`` (default ``4 * steps``) steps were timed.

    ``read_allocator`` (CUDA, with ``track_memory=False``): the peak is the allocator's over the timed steps
    alone, with no tracker pass. A compiled step needs it: under the tracker's dispatch mode dynamo runs
    the frame eagerly, so the tracked pass would read (and budget) the eager step, not the compiled one.
    The activation figure is then left to the caller (``compile.SavedForBackward``).

    ``memory_limit_bytes`` enforces a budget: on CUDA for real, by capping the allocator with
    ``torch.cuda.set_per_process_memory_fraction`` (never above a cap already set, plus
    ``reserve_headroom_bytes`` for the allocator's reserve; the previous cap is restored), so a plan over
    budget fails with an OOM instead of passing by luck; on CPU by comparing the tracked peak with
    the limit (needs ``track_memory``). A step that runs out of memory under the cap is ``oom``; one that
    completes above the limit (CPU, or on CUDA between the limit and the cap) is ``over_budget``.

    Failures never escape as exceptions (except ``BaseException``s such as ``KeyboardInterrupt``,
    which are re-raised after restoring state); see ``Measurement`` for the statuses. Memory of a
    failed step is released after the ``except`` clause, so the caller can go on to the next plan.
    """
    _validate(warmup, steps, max_steps, target_rel_spread, batch_size, seq_len, memory_limit_bytes)
    device = normalise_device(torch.device(device) if device is not None else model_device(model))
    limit_steps = steps if target_rel_spread is None else (max_steps or 4 * steps)
    memory = device_memory(device)
    snapshot = StateSnapshot.capture(model)
    cap_limit = memory_limit_bytes
    notes: dict[str, Any] = {}
    retried = False
    request = 0  # what the allocator refused, on the retry
    while True:
        started = memory.allocated() if memory is not None else None
        passes = _Passes(step_fn, snapshot, device, memory_limit_bytes)
        failure: tuple[str, ...] | None = None
        over_budget: str | None = None
        refused_but_fits: str | None = None
        split: str | None = None
        try:
            resist = split_resistant(memory, request) if retried and memory is not None else contextlib.nullcontext()
            with _enforced_memory_limit(memory, cap_limit, reserve_headroom_bytes) as capped, resist as split:
                if track_memory:
                    passes.tracked(model, optimizer, extra)
                passes.timed(warmup, steps, limit_steps, target_rel_spread, clock, read_allocator)
                if count_flops:
                    passes.counted()
        except _BudgetExceeded as exc:
            over_budget = str(exc)
        except Exception as exc:  # BaseException (KeyboardInterrupt, SystemExit) propagates, state restored below
            failure = _failure_of(exc)
            if failure[0] == "oom" and not retried:
                # Under the search's cap: judged against the budget; under the device's own: against the device.
                refused_but_fits = refused_although_it_fits(exc, memory, memory_limit_bytes if capped else None)
                request = requested_bytes(str(exc)) or 0
        finally:
            if failure is not None:
                # A failed step's frames (held by the traceback) can hold its tensors in reference cycles.
                # After a step that ran, refcounting has freed everything: a full collection would only cost
                # time (~0.2 s on a 32-layer model, paid by every trial and every re-timing).
                release_memory(device)
            snapshot.restore()
        if failure is not None:
            leaked = _left_allocated(memory, started, passes.tracker)
            if leaked is not None and leaked > LEAK_TOLERANCE_BYTES:
                notes["leaked_bytes"] = leaked
                log.warning(
                    "lightning_ckpt: a step that failed (%s) left %s allocated above where it started; every "
                    "later step starts that much higher. Something outside the step holds its tensors (a hook whose "
                    "handle was dropped, a global, a logged tensor): release them in the step's own code.",
                    failure[0],
                    format_bytes(leaked),
                )
        if refused_but_fits is not None and "leaked_bytes" not in notes:  # a step that leaked would only fail again
            # The allocator's cap counts reserved bytes: run once more from an emptied cache, under the user's own cap
            # only and split-resistant (without expandable segments the same sequence of requests would split the
            # cache the same way again), and judge the budget on the allocated peak, as the memory model and the
            # guard do.
            notes["cap_refused"] = refused_but_fits
            cap_limit, retried = None, True
            continue
        if retried and split:
            notes["retried_with"] = split
        break
    _refuse_changed_parameters(snapshot)
    return passes.outcome(warmup, failure, over_budget, batch_size, seq_len, notes)


def _left_allocated(memory: DeviceMemory | None, started: int | None, tracker: Any) -> int | None:
    """Bytes a failed step left allocated above where it started: the allocator's (CUDA, a simulated card), else the
    tracker's live bytes when the tracked pass ran (CPU). None when nothing can tell."""
    if memory is not None and started is not None:
        return memory.allocated() - started
    if tracker is not None:
        return tracker.now()[0] - tracker.resting_bytes
    return None
