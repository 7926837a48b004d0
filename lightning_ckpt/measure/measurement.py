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

torch's ``MemTracker`` reports categories at the moment the *total* peaks, which understates the
activation peak of checkpointed plans (the total peaks late in backward, when gradients already
hold memory and activations are half freed). So we keep our own running maxima of both.
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
import traceback
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ckpt.errors import ApplyError, ConfigurationError, PlanError
from lightning_ckpt.measure.status import TrialStatus
from lightning_ckpt.plan.apply import version_counter

__all__ = [
    "MEASUREMENT_STATUSES",
    "classify_failure",
    "find_parameters_written_in_forward",
    "forget_parameters_written_in_forward",
    "fsdp_root",
    "is_fsdp_module",
    "is_out_of_memory",
    "mark_zero_grad",
    "local_tensor",
    "model_device",
    "normalise_device",
    "release_memory",
    "tensor_bytes",
    "Measurement",
    "MemoryReading",
    "StateSnapshot",
    "measure_step",
    "median_and_spread",
    "new_live_tracker",
    "track_step_memory",
]

# The measurement's part of the status vocabulary (measure.status.TrialStatus owns it).
MEASUREMENT_STATUSES = tuple(
    s.value for s in (TrialStatus.OK, TrialStatus.OVER_BUDGET, TrialStatus.OOM, TrialStatus.INVALID, TrialStatus.ERROR)
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
_MAX_TRACE_CHARS = 8000


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one step; see the module docstring for the definitions."""

    peak_bytes: int
    activation_bytes: int | None  # None only from the guard's reader when activation was not asked for
    resting_bytes: int  # live bytes when the step started (parameters, existing grads, optimizer state)
    device: str


# ---------------------------------------------------------------------------------------------------
# Live-tensor tracking (CPU, and CUDA when a per-phase breakdown is needed)
# ---------------------------------------------------------------------------------------------------
_TRACKER_CLASSES: dict[str, type] = {}


class _IdSet:
    """The part of a WeakSet ModTracker uses (add, in), by identity and without keeping modules alive."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self._items = WeakIdKeyDictionary()

    def add(self, item: Any) -> None:
        self._items[item] = True

    def __contains__(self, item: Any) -> bool:
        return item in self._items


def _tracker_class(fsdp: bool = False) -> type:
    key = "fsdp" if fsdp else "plain"
    if key in _TRACKER_CLASSES:
        return _TRACKER_CLASSES[key]
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    if fsdp:
        # FSDP2: all-gathered (unsharded) parameters, all-gather and reduce-scatter buffers get categories of
        # their own, so they count in the total but not as activation.
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker as base
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModMemStats
        from torch.utils.weak import WeakIdKeyDictionary

        class _StatsOnDemand(WeakIdKeyDictionary):
            """Module statistics that make an empty record on lookup (see ``__init__`` below)."""

            def __getitem__(self, key: Any) -> Any:
                if key not in self:
                    self[key] = _FSDPModMemStats(type(key).__name__)
                return super().__getitem__(key)
    else:
        base = MemTracker

    class _LiveTracker(base):  # type: ignore[valid-type,misc]
        """MemTracker with running maxima of the total and of activations+temporaries on one device.

        Replaces the per-module peak bookkeeping (a loop over all modules on every op) with running
        maxima: all lightning_ckpt needs, and much cheaper on models with many modules. Optional
        *phases* (labels set by the caller, e.g. from module hooks) keep one pair of maxima each,
        which is what the memory model is built from.
        """

        def __init__(self, device: torch.device, *base_args: Any) -> None:
            super().__init__(*base_args)
            if fsdp:
                # FSDPMemTracker keeps statistics only for FSDP modules whose forward it saw, yet a block run
                # alone (the memory profile) still ends with the root's post-backward, which looks the root up.
                self.memory_tracking = _StatsOnDemand()
            self.device = device
            # ModTracker keys modules by hash and equality, but torchmetrics' Metric overrides both
            # (``==`` builds a CompositionalMetric, the hash follows the metric's state), so a
            # LightningModule holding a metric fails with KeyError. Modules are identities: key by id.
            from torch.utils.weak import WeakIdKeyDictionary

            self._mod_tracker._known_modules = WeakIdKeyDictionary()
            self._mod_tracker._seen_modules = _IdSet()
            self.total_peak = 0
            self.activation_peak = 0
            self.phase: Hashable | None = None
            self.phase_peaks: dict[Hashable, list[int]] = {}

        def now(self) -> tuple[int, int]:
            """(total, activation) bytes live on the tracked device right now."""
            snap = self._curr_mem_snap.get(self.device)
            if snap is None:
                return 0, 0
            return snap[_TOTAL_KEY], snap.get(_MemRefType.ACT, 0) + snap.get(_MemRefType.TEMP, 0)

        def enter_phase(self, label: Hashable) -> tuple[int, int]:
            """Attribute the following ops to ``label``; returns the (total, activation) level now."""
            total, act = self.now()
            self.phase = label
            peaks = self.phase_peaks.setdefault(label, [total, act])
            peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], act)
            return total, act

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            # MemTracker refuses a top-level module called twice in one step ("multiple iterative
            # calls"), which is ordinary in a training_step (an encoder applied to two views, an
            # embedding reused for an auxiliary loss). We only need its byte categories, not its
            # per-module statistics, so treat the second call as a fresh module.
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                parents = set(self._mod_tracker.parents)
                if name in parents:
                    return  # re-entrant call (a module calling itself, e.g. torchmetrics' forward)
                if parents == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            # MemTracker registers a gradient hook on every parameter, which raises for frozen ones
            # ("cannot register a hook on a tensor that doesn't require gradient"): fine-tuned models
            # with frozen layers could not be tracked at all. Hook only the trainable parameters.
            sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._as_grad),
                            param.register_post_accumulate_grad_hook(lambda p: self._as_grad(p.grad)),
                        )
            return sizes

        # Lightning runs training_step and backward inside ``optimizer.step(closure)``, and MemTracker's global
        # optimizer pre-hook files everything created after it as optimizer state: a real step read whole then
        # shows 0 activation bytes. With ``closure_in_step`` the pre-hook leaves the step's tensors alone and
        # the update is marked from outside (``optimizer_update_starts``, from ``on_before_optimizer_step``).
        closure_in_step = False

        def _register_global_optimizer_hook(self) -> None:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
                if not self.closure_in_step:
                    self._in_opt = True

            def post(optimizer: Any, args: Any, kwargs: Any) -> None:
                self._track_optimizer_states(_MemRefType.OPT, optimizer)
                self._in_opt = False

            self._optimizer_hook_handles = (
                register_optimizer_step_pre_hook(pre),
                register_optimizer_step_post_hook(post),
            )

        def optimizer_update_starts(self) -> None:
            """The closure has run; what the optimizer creates from now on is its state and temporaries."""
            self._in_opt = True

        def _as_grad(self, grad: torch.Tensor | None) -> None:
            if grad is not None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def _update_peak_stats(self, peak_state: Any) -> None:  # noqa: ARG002 - MemTracker's signature
            total, act = self.now()
            if total > self.total_peak:
                self.total_peak = total
            if act > self.activation_peak:
                self.activation_peak = act
            if self.phase is not None:
                peaks = self.phase_peaks[self.phase]
                if total > peaks[0]:
                    peaks[0] = total
                if act > peaks[1]:
                    peaks[1] = act

    _TRACKER_CLASSES[key] = _LiveTracker
    return _LiveTracker


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) sharded ``module``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return isinstance(module, FSDPModule)


def fsdp_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP2 (``fully_shard``) module in ``model``, or None."""
    return next((m for m in model.modules() if is_fsdp_module(m)), None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a sharded tensor (FSDP2's ``DTensor``) counts its local shard."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages behind ``tensors`` (non-tensors skipped), each storage once, local shards only."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = local_tensor(t).untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def new_live_tracker(device: torch.device | str, model: nn.Module | None = None, optimizer: Any = None) -> Any:
    """A live-tensor tracker (a ``MemTracker``) counting bytes on ``device`` only.

    Use it as a context manager after ``track_external(model, optimizer, *tensors)``; read
    ``total_peak``, ``activation_peak``, ``now()`` and, after ``enter_phase(label)`` calls,
    ``phase_peaks[label] == [total_max, activation_max]``. A ``model`` sharded with FSDP2 gets torch's
    FSDP-aware tracker, which keeps all-gathered parameters and collective buffers out of activations.
    """
    device = normalise_device(torch.device(device))
    root = fsdp_root(model) if model is not None else None
    if root is not None:
        return _tracker_class(fsdp=True)(device, root, optimizer)
    return _tracker_class()(device)


def normalise_device(device: torch.device) -> torch.device:
    # Tensors report cuda:N; a bare "cuda" would never match the tracker's per-device snapshots.
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    tracker = new_live_tracker(device, model, optimizer)
    externals = [model, *extra] + ([optimizer] if optimizer is not None else [])
    tracker.track_external(*externals)
    resting = tracker.now()[0]
    tracker.total_peak = resting
    if device.type == "cuda":
        # Peak from the allocator (what an OOM is decided on); activation bytes from the tracker, whose
        # categories tell them from gradients, as on CPU.
        torch.cuda.synchronize(device)
        gc.collect()
        resting = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with tracker:
            step_fn()
        torch.cuda.synchronize(device)
        return MemoryReading(torch.cuda.max_memory_allocated(device), tracker.activation_peak, resting, str(device))
    with tracker:
        step_fn()
    return MemoryReading(tracker.total_peak, tracker.activation_peak, resting, str(device))


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------
# Leaving no trace: RNG, buffers, gradients
# ---------------------------------------------------------------------------------------------------
class StateSnapshot:
    """What measuring a step may disturb, captured so it can be put back exactly.

    Covers the global RNG streams (torch CPU and CUDA, Python ``random``, NumPy), every buffer
    (BatchNorm statistics change in a training-mode forward) and every parameter's ``.grad``
    (backward creates or accumulates them). Copies live in host memory so they do not count
    against the device memory being measured. Parameters are *not* copied (that would double
    the model's memory), except the few that the model's own forward writes in place
    (``nn.Embedding(max_norm=...)``, a clamp or renorm in forward), which
    ``find_parameters_written_in_forward`` marks: those are copied and put back before every step
    and at ``restore()``. ``changed_parameters()`` detects other in-place updates via version
    counters, which is how an optimizer step inside ``step_fn`` is caught.
    """

    def __init__(self) -> None:
        self._rng: dict[str, Any] = {}
        # (parameter, weak reference to its .grad, host copy): a strong reference would keep a gradient the
        # step frees (Lightning's zero_grad between forward and backward) alive, and in the measurement.
        self._grads: list[tuple[nn.Parameter, weakref.ref[torch.Tensor] | None, Any]] = []  # copy, None or _ZERO
        self._buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._param_versions: list[tuple[str, nn.Parameter, int]] = []
        self._written: list[tuple[nn.Parameter, torch.Tensor]] = []  # parameters the forward writes, host copies

    @classmethod
    def capture(cls, model: nn.Module) -> StateSnapshot:
        """Copies of what a step may change; gradients marked by ``mark_zero_grad`` (and unchanged since) are
        recorded as zeros instead of copied (the callback's trials start from such gradients: on a 7B model a
        host copy of them is tens of GB per rank and seconds per trial)."""
        snap = cls()
        snap._rng = _rng_state()
        seen: set[int] = set()
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = p.grad
            copy = None if g is None else _ZERO if _is_known_zero(g) else g.detach().to("cpu", copy=True)
            snap._grads.append((p, weakref.ref(g) if g is not None else None, copy))
            if getattr(p, WRITTEN_IN_FORWARD, False):
                snap._written.append((p, p.detach().to("cpu", copy=True)))
            else:
                snap._param_versions.append((name, p, p._version))
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None:
                    snap._buffers.append((module, name, b, b.detach().to("cpu", copy=True)))
        return snap

    def reset_grads(self) -> None:
        """Put every ``.grad`` back as captured (``None`` stays ``None``), and the parameters the forward writes."""
        if self._written:
            with torch.no_grad():
                for p, saved in self._written:
                    p.copy_(saved)
        for p, ref, copy in self._grads:
            if ref is None or copy is None:
                p.grad = None
                continue
            g = ref()
            if copy is _ZERO:
                if g is None:  # freed by the step
                    g = torch.zeros_like(p)
                else:
                    with torch.no_grad():
                        g.zero_()
                p.grad = g
                mark_zero_grad(g)
                continue
            if g is None:  # freed by the step: a fresh tensor with the captured values
                p.grad = copy.to(device=p.device)
                continue
            if p.grad is not g:
                p.grad = g
            # Always copy: version counters are not bumped by every in-place update (BatchNorm's
            # running statistics, for one), so they cannot tell us what was left untouched.
            with torch.no_grad():
                g.copy_(copy)

    def restore_rng(self) -> None:
        _set_rng_state(self._rng)

    def restore(self) -> None:
        """Gradients, buffers and RNG streams back to the captured state."""
        self.reset_grads()
        for module, name, b, copy in self._buffers:
            if module._buffers.get(name) is not b:
                module._buffers[name] = b
            with torch.no_grad():
                b.copy_(copy)
        self.restore_rng()

    def changed_parameters(self) -> list[str]:
        """Names of parameters modified in place since the snapshot (e.g. by an optimizer step)."""
        return [name for name, p, version in self._param_versions if p._version != version]


# Gradients known to hold zeros, with the version counter they had then: a snapshot records such a gradient
# without copying it and restores it with ``zero_()``. An in-place change moves the counter and ends the mark.
_ZERO = object()
_KNOWN_ZERO: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_zero_grad(grad: torch.Tensor) -> None:
    """Declare that ``grad`` holds zeros now (e.g. made by ``torch.zeros_like``), so snapshots need not copy it."""
    _KNOWN_ZERO[grad] = version_counter(grad)


def _is_known_zero(grad: torch.Tensor) -> bool:
    return grad in _KNOWN_ZERO and _KNOWN_ZERO[grad] == version_counter(grad)


# A parameter the model's forward writes in place is marked with this attribute by
# ``find_parameters_written_in_forward``, so every ``StateSnapshot`` copies and restores it.
WRITTEN_IN_FORWARD = "_lightning_ckpt_written_in_forward"


class _ParameterWrites(TorchDispatchMode):
    """Copies each parameter to host memory before the first op that writes it (copy on write)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in model.named_parameters():
            with contextlib.suppress(RuntimeError):  # a parameter with no storage (meta, sharded): nothing to watch
                self.params.setdefault(p.untyped_storage().data_ptr(), (name, p))
        self.saved: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                with contextlib.suppress(RuntimeError):
                    hit = self.params.get(value.untyped_storage().data_ptr())
                    if hit is not None and hit[0] not in self.saved:
                        self.saved[hit[0]] = (hit[1], hit[1].detach().to("cpu", copy=True))
        return func(*args, **kwargs)


def find_parameters_written_in_forward(model: nn.Module, step_fn: Callable[[], Any]) -> tuple[str, ...]:
    """Run ``step_fn``'s forward once, without grad, and mark the parameters it writes in place.

    ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, in place, in every forward; a model may
    clamp or renormalise a weight in forward too. The search runs the forward dozens of times, so those
    parameters are copied before each step and put back after (see ``StateSnapshot``): the first real step
    starts from the weights it would have had with no search. Everything this pass changes (those
    parameters, buffers, gradients, RNG) is put back; returns the marked parameters' names.
    """
    snapshot = StateSnapshot.capture(model)
    watch = _ParameterWrites(model)
    try:
        with torch.no_grad(), watch:
            step_fn()
    finally:
        with torch.no_grad():
            for p, saved in watch.saved.values():
                p.copy_(saved)
        snapshot.restore()
    for p, _ in watch.saved.values():
        setattr(p, WRITTEN_IN_FORWARD, True)
    return tuple(watch.saved)


def forget_parameters_written_in_forward(model: nn.Module) -> None:
    for p in model.parameters():
        if getattr(p, WRITTEN_IN_FORWARD, False):
            delattr(p, WRITTEN_IN_FORWARD)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    # Only CUDA generators that exist already: reading them would otherwise initialise CUDA.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# ---------------------------------------------------------------------------------------------------
# Failure classification
# ---------------------------------------------------------------------------------------------------
class _BudgetExceeded(Exception):
    """The tracked peak exceeded ``memory_limit_bytes`` where no allocator can enforce it (CPU)."""


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
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """The outcome of measuring one training-step callable (one candidate plan).

    status: ``ok`` | ``over_budget`` (the step completed above ``memory_limit_bytes``: peak and activation
    hold what it reached, there are no timings) | ``oom`` (out of memory) | ``invalid`` (a
    ``CheckpointError``, ``PlanError`` or ``ApplyError``: the plan cannot run on this model) |
    ``error`` (anything else; ``error`` holds the exception type and message).
    step_seconds: wall time of each timed step, warm-up excluded; empty unless status is ``ok``.
    median_seconds / spread_seconds: median of ``step_seconds`` and their median absolute deviation
    (MAD, unscaled: the median of ``|t - median|``), a spread robust to one slow outlier step.
    peak_bytes / activation_bytes / resting_bytes: see the module docstring.
    recompute_flops / step_flops: only when ``count_flops=True``; see the module docstring.
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

    def __post_init__(self) -> None:
        if self.status not in MEASUREMENT_STATUSES:
            raise ConfigurationError(
                f"Measurement.status must be one of {MEASUREMENT_STATUSES}, but got {self.status!r}."
            )
        object.__setattr__(self, "step_seconds", tuple(float(t) for t in self.step_seconds))

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
        return d


def median_and_spread(times: Sequence[float]) -> tuple[float, float]:
    """Median and median absolute deviation of ``times`` (the statistics ``Measurement`` reports)."""
    med = statistics.median(times)
    return med, statistics.median(abs(t - med) for t in times)


@contextlib.contextmanager
def _enforced_memory_limit(device: torch.device, limit: int | None, reserve_headroom: int = 0) -> Iterator[None]:
    """Cap this process's CUDA allocator near ``limit`` bytes, restoring the previous cap afterwards.

    The cap (``set_per_process_memory_fraction``) counts *reserved* memory, while budgets count
    allocated bytes: ``reserve_headroom`` (the allocator's reserve above allocated, measured on the
    profile's step) is added so a plan that fits in allocated bytes is not failed by block rounding.
    The budget itself is still judged on ``max_memory_allocated``. A smaller cap the user set is kept.
    """
    if limit is None or device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    # get_per_process_memory_fraction is recent; before it, the cap could only have been the default 1.0.
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = getter(device) if getter is not None else 1.0
    # Cached free blocks are handed out without checking the cap, so empty the cache first or a
    # plan over budget could pass by reusing memory an earlier candidate left reserved.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(previous, (limit + max(0, reserve_headroom)) / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)


def _in_recompute() -> bool:
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


_FLOP_COUNTER_CLASS: type | None = None


def _flop_counter() -> Any:
    global _FLOP_COUNTER_CLASS
    if _FLOP_COUNTER_CLASS is None:
        from torch.utils.flop_counter import FlopCounterMode

        class _RecomputeFlopCounter(FlopCounterMode):
            """FlopCounterMode that also sums the FLOPs of ops run by checkpoint recomputation."""

            def __init__(self) -> None:
                super().__init__(display=False)
                self.recompute_flops = 0

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
    step_fn: Callable[[], Any], snapshot: StateSnapshot, sync: Callable[[], None], clock: Callable[[], float],
    times: list[float], steps: int, limit_steps: int, target_rel_spread: float | None,
) -> None:  # fmt: skip
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

    Passes, in order: (``track_memory``) one step under the live-tensor tracker, first because it is
    the cheapest way to learn that a candidate does not fit, and the reading of activation bytes; ``warmup`` untimed steps (compile
    and allocator warm-up are not throughput); ``steps`` timed steps (CUDA: synchronised, with peak
    stats reset first and ``max_memory_allocated`` read after); then (``count_flops``) one step under
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
    is_cuda = device.type == "cuda"
    limit_steps = steps if target_rel_spread is None else (max_steps or 4 * steps)

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize(device)

    snapshot = StateSnapshot.capture(model)
    times: list[float] = []
    reading: MemoryReading | None = None
    flops: tuple[int, int] | None = None
    failure: tuple[str, ...] | None = None
    over_budget: str | None = None
    try:
        with _enforced_memory_limit(device, memory_limit_bytes, reserve_headroom_bytes):
            if track_memory:
                snapshot.reset_grads()
                reading = track_step_memory(step_fn, model=model, optimizer=optimizer, device=device, extra=extra)
                if memory_limit_bytes is not None and reading.peak_bytes > memory_limit_bytes:
                    raise _BudgetExceeded(
                        f"tracked peak of {reading.peak_bytes} bytes exceeds memory_limit_bytes={memory_limit_bytes}"
                    )
            for _ in range(warmup):
                snapshot.reset_grads()
                step_fn()
            snapshot.reset_grads()
            if is_cuda:
                sync()
                gc.collect()
                resting = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            _timed_steps(step_fn, snapshot, sync, clock, times, steps, limit_steps, target_rel_spread)
            if is_cuda and (reading is not None or read_allocator):
                peak = torch.cuda.max_memory_allocated(device)
                if reading is not None:
                    peak = max(peak, reading.peak_bytes)
                reading = MemoryReading(peak, reading.activation_bytes if reading else None, resting, str(device))
                if memory_limit_bytes is not None and peak > memory_limit_bytes:
                    raise _BudgetExceeded(f"peak of {peak} bytes exceeds memory_limit_bytes={memory_limit_bytes}")
            if count_flops:
                snapshot.reset_grads()
                counter = _flop_counter()
                with counter:
                    step_fn()
                flops = (counter.recompute_flops, counter.get_total_flops())
    except _BudgetExceeded as exc:
        # The step completed, above the limit but within the cap: a measured verdict, not an OOM. As an OOM it
        # would end a sharded (FSDP2) search on this rank alone while the other ranks wait in a collective;
        # as ``over_budget`` every rank records the trial and the ranks' worst status is the trial's.
        over_budget = str(exc)
    except Exception as exc:  # BaseException (KeyboardInterrupt, SystemExit) propagates, state restored below
        failure = classify_failure(exc)
        if failure[0] == "error":  # a bug, not a verdict on the plan: keep where it happened for the user
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            failure = (failure[0], failure[1], trace[-_MAX_TRACE_CHARS:])
    finally:
        if failure is not None:
            # A failed step's frames (held by the traceback) can hold its tensors in reference cycles.
            # After a step that ran, refcounting has freed everything: a full collection would only cost
            # time (~0.2 s on a 32-layer model, paid by every trial and every re-timing).
            release_memory(device)
        snapshot.restore()
    changed = snapshot.changed_parameters()
    if changed:
        raise ConfigurationError(
            f"step_fn modified {len(changed)} parameter(s) in place (first: {changed[0]!r}), e.g. by calling "
            "optimizer.step(). A measured step must only run forward and backward; step the optimizer "
            "outside measure_step."
        )

    if failure is not None:
        trace = failure[2] if len(failure) > 2 else None
        return Measurement(failure[0], error=failure[1], warmup_steps=warmup, device=str(device), traceback=trace)
    if over_budget is not None and reading is not None:
        return Measurement(
            TrialStatus.OVER_BUDGET.value, peak_bytes=reading.peak_bytes, activation_bytes=reading.activation_bytes,
            resting_bytes=reading.resting_bytes, error=over_budget, warmup_steps=warmup, device=str(device),
        )  # fmt: skip
    med, spread = median_and_spread(times)
    samples = batch_size / med if batch_size is not None and med > 0 else None
    tokens = samples * seq_len if samples is not None and seq_len is not None else None
    return Measurement(
        "ok",
        step_seconds=tuple(times),
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
        device=str(device),
    )
