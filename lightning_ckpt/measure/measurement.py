"""What measuring one training step finds (``Measurement``), and how a failed pass is told apart and survived.

Definitions used everywhere in lightning_ckpt (budgets, predictions, tests):

* **peak bytes**: the most bytes held by live tensors at any moment of the step, everything included.
  CUDA: ``torch.cuda.max_memory_allocated``. CPU: a live-tensor tracker, since no allocator counter exists.
* **activation bytes**: the most bytes held at any moment by tensors the step created *other than* parameter
  gradients and optimizer state: the part checkpointing changes. Read with the live-tensor tracker on every
  device (the CUDA allocator cannot tell gradients from activations), so it means the same everywhere.
* **resting bytes**: live bytes when the step starts (model state, and ``extra`` tensors such as the batch).
* **recompute FLOPs**: FLOPs of forward ops run *again* during backward, counted with ``FlopCounterMode``: an
  op inside the autograd engine (``torch._C._current_graph_task_id() != -1``) with grad mode on. Backward
  formulas run with grad mode off, checkpoint recomputation enables it, so no plan is needed to tell them apart.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_ckpt.errors import ApplyError, ConfigurationError, PlanError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.measure.allocator import allocator_figures, split_resistant
from lightning_ckpt.measure.device_memory import device_memory, refused_although_it_fits, requested_bytes
from lightning_ckpt.measure.status import TrialStatus

__all__ = [
    "MEASUREMENT_STATUSES",
    "classify_failure",
    "is_out_of_memory",
    "release_memory",
    "Measurement",
    "median_and_spread",
    "PassOutOfMemory",
    "run_pass",
    "synchronize",
]

# The measurement's part of the status vocabulary (measure.status.TrialStatus owns it).
MEASUREMENT_STATUSES = tuple(s.value for s in TrialStatus if s is not TrialStatus.PRUNED)

# Messages of CPU allocation failures (c10/core/impl/alloc_cpu.cpp and friends). CPU OOM surfaces as a
# plain RuntimeError, so the message is the only way to tell it from a bug.
_OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "not enough memory",
    # Out of memory outside the caching allocator: a raw CUDA error (torch.AcceleratorError or RuntimeError,
    # e.g. pinned host memory exhausted by an offload trial), and the libraries' own workspace allocations.
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
)
_MAX_ERROR_CHARS = 2000

log = logging.getLogger(__name__)


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
    return ("invalid", message) if isinstance(exc, (CheckpointError, PlanError, ApplyError)) else ("error", message)


def release_memory(device: torch.device) -> None:
    # Called after the ``except`` clause has ended: only then are the exception, its traceback and
    # the frames holding the failed step's tensors unreachable, so collecting actually frees them.
    gc.collect()
    memory = device_memory(device)
    if memory is not None:
        memory.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PassOutOfMemory(Exception):
    """A pass ``run_pass`` ran was refused memory, also on its retry; raised once its memory is released."""

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
    """``run()``, from an emptied cache when it needs step-sized buffers (``cold``: emptying a CUDA cache synchronises);
    once more, split-resistant, when the allocator refused a request the allocated bytes fit (a fragmented cache; never
    with expandable segments), ``restore`` run in between. A refusal that stays raises ``PassOutOfMemory``."""
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


@dataclass(frozen=True)
class Measurement:
    """The outcome of measuring one training-step callable (one candidate plan). status: a ``TrialStatus`` value other
    than ``pruned`` (``over_budget``: peak and activation hold what the step reached, with no timings). median_seconds /
    spread_seconds: median of ``step_seconds`` and their unscaled median absolute deviation, a spread robust to one slow
    outlier step. steps: training steps run (tuning cost); a runner that ran more (a compiled trial's compile step) says
    so. conflict: why a plan that ran fights ``torch.compile``. extra: the runner's facts for display."""

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
        return {**asdict(self), "step_seconds": list(self.step_seconds), "extra": dict(self.extra)}


def median_and_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median and median absolute deviation of ``times`` (the statistics ``Measurement`` reports)."""
    med = statistics.median(times)
    return med, statistics.median(abs(t - med) for t in times)
