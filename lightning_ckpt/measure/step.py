"""``measure_step``: one training step timed and its memory read honestly, never raising for an OOM. The figures it
reads are defined once, in ``measure.measurement``'s docstring; ``StepSettings`` says which passes run."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.measure.allocator import split_resistant
from lightning_ckpt.measure.device_memory import DeviceMemory, device_memory, refused_although_it_fits, requested_bytes
from lightning_ckpt.measure.measurement import (
    Measurement,
    classify_failure,
    median_and_spread,
    release_memory,
    synchronize,
)
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.status import TrialStatus
from lightning_ckpt.measure.tracker import new_live_tracker, normalise_device, removing_grad_hooks
from lightning_ckpt.model import model_device

__all__ = ["MemoryReading", "StepSettings", "measure_step", "track_step_memory"]

# A failed step that leaves more than this allocated above where it started is reported (allocator rounding and
# cached workspaces stay below it).
LEAK_TOLERANCE_BYTES = 1 << 20
_MAX_TRACE_CHARS = 8000

log = logging.getLogger(__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ConfigurationError(f"`{name} >= {minimum}` must hold, but got {name}={value!r}.")


@dataclass(frozen=True)
class StepSettings:
    """Which passes ``measure_step`` runs and how many steps it times; checked when built. warmup: untimed steps first
    (compile and allocator warm-up are not throughput). With ``target_rel_spread``, timing goes on past ``steps`` until
    MAD/median falls below it or ``max_steps`` (default ``4 * steps``). track_memory: one step under the live-tensor
    tracker first; count_flops: one under ``FlopCounterMode`` last. read_allocator: the CUDA peak of the timed steps."""

    warmup: int = 1
    steps: int = 3
    track_memory: bool = True
    count_flops: bool = False
    memory_limit_bytes: int | None = None
    reserve_headroom_bytes: int = 0
    read_allocator: bool = False
    max_steps: int | None = None
    target_rel_spread: float | None = None
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        _check_count("warmup", self.warmup, 0)
        _check_count("steps", self.steps, 1)
        steps, max_steps, spread = self.steps, self.max_steps, self.target_rel_spread
        if max_steps is not None and (not _is_int(max_steps) or max_steps < steps):
            raise ConfigurationError(
                f"`max_steps >= steps` must hold, but got (steps={steps!r}, max_steps={max_steps!r}). "
                "Leave max_steps=None to time exactly `steps` steps."
            )
        if spread is not None and not (isinstance(spread, (int, float)) and spread > 0):
            raise ConfigurationError(f"`target_rel_spread > 0` must hold, but got {spread!r}.")
        limit = self.memory_limit_bytes
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise ConfigurationError(f"`memory_limit_bytes >= 1` must hold, but got {limit!r}.")


def _check_shape(batch_size: int | None, seq_len: int | None) -> None:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None:
            _check_count(name, value, 1)
    if seq_len is not None and batch_size is None:
        raise ConfigurationError(
            "tokens/s needs the number of sequences per step: pass batch_size together with seq_len."
        )


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one step (definitions: ``measure.measurement``)."""

    peak_bytes: int
    activation_bytes: int | None  # None only from the guard's reader when activation was not asked for
    resting_bytes: int  # live bytes when the step started (parameters, existing grads, optimizer state)
    device: str
    # The guard's real steps, from the allocator: a card near refusing what allocated bytes fit retries often.
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
    """Run ``step_fn`` once and read its peak and activation memory. Never time a step in the same pass: the
    dispatch-mode tracker slows it several-fold."""
    device = normalise_device(torch.device(device) if device is not None else model_device(model))
    return _tracked_step(step_fn, _step_tracker(device, model, optimizer, extra), device)


def _step_tracker(
    device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: tuple[Any, ...]
) -> Any:
    tracker = new_live_tracker(device, model, optimizer)
    tracker.track_external(model, *extra, *([optimizer] if optimizer is not None else []))
    tracker.resting_bytes = tracker.total_peak = tracker.now()[0]
    return tracker


def _tracked_step(step_fn: Callable[[], Any], tracker: Any, device: torch.device) -> MemoryReading:
    # With an allocator, the peak is its (what an OOM is decided on); activation bytes come from the tracker anyway.
    memory = device_memory(device)
    synchronize(device)
    resting = memory.allocated() if memory is not None else tracker.resting_bytes  # no collection: see below
    if memory is not None:
        memory.reset_peak()
    with tracker:
        step_fn()
    synchronize(device)
    peak = memory.max_allocated() if memory is not None else tracker.total_peak
    return MemoryReading(peak, tracker.activation_peak, resting, str(device))


class _BudgetExceeded(Exception):
    """The step completed above ``memory_limit_bytes`` where no allocator cap enforces it: a verdict, not an OOM,
    which would end a sharded (FSDP2) search on this rank alone while the others wait in a collective."""


@contextlib.contextmanager
def _enforced_memory_limit(memory: DeviceMemory | None, limit: int | None, reserve_headroom: int = 0) -> Iterator[bool]:
    """Cap this process's allocator near ``limit`` bytes, restoring the previous cap afterwards; yields whether it is
    tighter than the one before. The cap counts *reserved* memory, so ``reserve_headroom`` (reserve above allocated,
    measured on the profile's step) is added; the budget is still judged on ``max_memory_allocated``."""
    # Step-sized buffers from a cold cache, not from what the last plan's steps split; and cached free blocks are
    # handed out without checking the cap: a plan over budget could pass by reusing memory an earlier candidate left
    # reserved. No collection: refcounting freed a step that ran, a failed one was collected.
    if memory is not None:
        memory.empty_cache()
    if limit is None or memory is None:
        yield False
        return
    previous = memory.get_fraction()
    fraction = min(previous, (limit + max(0, reserve_headroom)) / memory.total_bytes)
    memory.set_fraction(fraction)
    try:
        yield fraction < previous
    finally:
        memory.set_fraction(previous)


class _GlobalModuleOnly(contextlib.nullcontext):
    """Stands in for ``FlopCounterMode``'s module tracker: every op is the step's ("Global"), no hook registered."""

    parents = frozenset({"Global"})
    is_bw = False


@functools.cache
def _flop_counter_class() -> type:
    from torch.utils.flop_counter import FlopCounterMode

    class _RecomputeFlopCounter(FlopCounterMode):
        """FlopCounterMode that also sums the FLOPs of ops run by checkpoint recomputation."""

        def __init__(self) -> None:
            super().__init__(display=False)
            self.recompute_flops = 0
            # No per-module attribution: torch's module tracker hooks every module's outputs, recomputed ones
            # included, and a recomputed graph whose backward never runs stays alive in a hook cycle: a fully
            # checkpointed step counted with it peaked as high as no checkpointing.
            if hasattr(self, "mod_tracker"):
                self.mod_tracker = _GlobalModuleOnly()

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            # Inside the autograd engine with grad mode on: recomputation (``measure.measurement``'s definitions).
            in_recompute = torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()
            if func_packet in self.flop_registry and in_recompute:
                self.recompute_flops += self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            return super()._count_flops(func_packet, out, args, kwargs)

    return _RecomputeFlopCounter


@dataclass
class _Passes:
    """One ``measure_step``'s passes over ``step_fn``, and what they read. The tracked step comes first, the cheapest
    way to learn that a candidate does not fit; the FLOP count last. Each step starts from the captured gradients."""

    step_fn: Callable[[], Any]
    snapshot: StateSnapshot
    device: torch.device
    settings: StepSettings
    times: list[float] = field(default_factory=list)
    reading: MemoryReading | None = None
    flops: tuple[int, int] | None = None
    tracker: Any = None  # the tracked pass's: on CPU, what tells whether a failed step freed what it allocated

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: tuple[Any, ...]) -> None:
        if self.settings.track_memory:
            self.snapshot.reset_grads()
            # Kept before the step runs: after a failed step it tells whether the step freed what it allocated.
            self.tracker = _step_tracker(self.device, model, optimizer, extra)
            self.reading = _tracked_step(self.step_fn, self.tracker, self.device)
            self._judge(self.reading.peak_bytes, "tracked peak")
        self.timed()
        if self.settings.count_flops:
            self.snapshot.reset_grads()
            counter = _flop_counter_class()()
            with removing_grad_hooks(), counter:  # FlopCounterMode's module tracker hooks every module, as MemTracker's
                self.step_fn()
            self.flops = (counter.recompute_flops, counter.get_total_flops())

    def _judge(self, peak: int, what: str) -> None:
        limit = self.settings.memory_limit_bytes
        if limit is not None and peak > limit:
            raise _BudgetExceeded(f"{what} of {peak} bytes exceeds memory_limit_bytes={limit}")

    def timed(self) -> None:
        s = self.settings
        for _ in range(s.warmup):
            self.snapshot.reset_grads()
            self.step_fn()
        self.snapshot.reset_grads()
        memory = device_memory(self.device)
        if memory is not None:
            synchronize(self.device)
            resting = memory.allocated()
            memory.reset_peak()
        while True:  # ``steps`` times, then more until MAD/median reaches ``target_rel_spread`` or ``max_steps``
            self.snapshot.reset_grads()
            synchronize(self.device)
            start = s.clock()
            self.step_fn()
            synchronize(self.device)
            self.times.append(s.clock() - start)
            if len(self.times) < s.steps:
                continue
            if s.target_rel_spread is None or len(self.times) >= (s.max_steps or 4 * s.steps):
                break
            med, spread = median_and_spread(self.times)
            if med > 0 and spread / med <= float(s.target_rel_spread or 0):
                break
        if memory is not None and (self.reading is not None or s.read_allocator):
            tracked = self.reading
            peak = max(memory.max_allocated(), tracked.peak_bytes if tracked else 0)
            self.reading = MemoryReading(peak, tracked.activation_bytes if tracked else None, resting, str(self.device))
            self._judge(peak, "peak")

    def outcome(
        self,
        failure: tuple[str, ...] | None,
        over_budget: str | None,
        batch_size: int | None,
        seq_len: int | None,
        extra: Mapping[str, Any] | None = None,
    ) -> Measurement:
        """The ``Measurement`` of these passes: failed, over budget, or timed (with their memory and FLOPs)."""
        common: dict[str, Any] = dict(
            warmup_steps=self.settings.warmup, device=str(self.device), extra=dict(extra or {})
        )
        if failure is not None:
            trace = failure[2] if len(failure) > 2 else None
            return Measurement(failure[0], error=failure[1], traceback=trace, **common)
        reading, flops = self.reading, self.flops
        if reading is not None:
            common.update(peak_bytes=reading.peak_bytes, activation_bytes=reading.activation_bytes)
            common["resting_bytes"] = reading.resting_bytes
            if over_budget is not None:
                return Measurement(TrialStatus.OVER_BUDGET.value, error=over_budget, **common)
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
            recompute_flops=flops[0] if flops else None,
            step_flops=flops[1] if flops else None,
            **common,
        )


def _failure_of(exc: Exception) -> tuple[str, ...]:
    """(status, message) for a failed step; a bug (``error``, not a verdict on the plan) also keeps its traceback."""
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
    settings: StepSettings | None = None,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    extra: tuple[Any, ...] = (),
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> Measurement:
    """Time ``step_fn`` (forward + backward of one batch) and read its memory, never raising for OOM.

    ``step_fn`` takes no arguments and must *not* step the optimizer: ``.grad``, buffers and global RNG streams are
    restored, and a parameter modified in place raises ``ConfigurationError``. ``optimizer`` and ``extra`` (the batch)
    count as resting memory. ``memory_limit_bytes`` caps the CUDA allocator (a plan over budget fails as ``oom``); a
    step that completes above it is ``over_budget``; one refused although its bytes fit reruns uncapped, split-resistant.
    """
    settings = settings or StepSettings()
    _check_shape(batch_size, seq_len)
    device = normalise_device(torch.device(device) if device is not None else model_device(model))
    memory = device_memory(device)
    snapshot = StateSnapshot.capture(model)
    cap_limit = settings.memory_limit_bytes
    notes: dict[str, Any] = {}
    request: int | None = None  # what the allocator refused, once it is retried
    while True:
        started = memory.allocated() if memory is not None else None
        passes = _Passes(step_fn, snapshot, device, settings)
        failure = over_budget = refused_but_fits = split = None
        try:
            resist = split_resistant(memory, request) if request is not None and memory is not None else None
            cap = _enforced_memory_limit(memory, cap_limit, settings.reserve_headroom_bytes)
            with cap as capped, resist or contextlib.nullcontext() as split:
                passes.run(model, optimizer, extra)
        except _BudgetExceeded as exc:
            over_budget = str(exc)
        except Exception as exc:  # BaseException (KeyboardInterrupt, SystemExit) propagates, state restored below
            failure = _failure_of(exc)
            if failure[0] == "oom" and request is None:
                # Under the search's cap: judged against the budget; under the device's own: against the device.
                limit = settings.memory_limit_bytes if capped else None
                refused_but_fits = refused_although_it_fits(exc, memory, limit)
                retry_request = requested_bytes(str(exc)) or 0
        finally:
            if failure is not None:  # its frames (held by the traceback) can hold its tensors in reference cycles
                release_memory(device)
            snapshot.restore()
        if failure is not None:
            _note_leak(notes, failure[0], memory, started, passes.tracker)
        if refused_but_fits is not None and "leaked_bytes" not in notes:  # a step that leaked would only fail again
            # Split-resistant: without expandable segments the same requests would split the cache the same way again.
            notes["cap_refused"] = refused_but_fits
            cap_limit, request = None, retry_request
            continue
        if request is not None and split:
            notes["retried_with"] = split
        break
    _refuse_changed_parameters(snapshot)
    return passes.outcome(failure, over_budget, batch_size, seq_len, notes)


def _note_leak(
    notes: dict[str, Any], status: str, memory: DeviceMemory | None, started: int | None, tracker: Any
) -> None:
    """Note and warn when a failed step left bytes allocated above where it started (allocator, else tracker)."""
    if memory is not None and started is not None:
        leaked = memory.allocated() - started
    elif tracker is not None:
        leaked = tracker.now()[0] - tracker.resting_bytes
    else:
        return
    if leaked <= LEAK_TOLERANCE_BYTES:
        return
    notes["leaked_bytes"] = leaked
    log.warning(
        "lightning_ckpt: a step that failed (%s) left %s allocated above where it started; every later step starts "
        "that much higher. Something outside the step holds its tensors (a hook whose handle was dropped, a global, "
        "a logged tensor): release them in the step's own code.",
        status,
        format_bytes(leaked),
    )
