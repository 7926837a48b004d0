"""The live-tensor tracker, and the byte counts every stage shares (local shards, the device a model is on).

CPU has no allocator counter, and the CUDA allocator cannot tell gradients from activations, so activation
bytes (and the CPU peak) are read from torch's ``MemTracker``, which files each live tensor under a category.
``MemTracker`` reports categories at the moment the *total* peaks, which understates the activation peak of
checkpointed plans (the total peaks late in backward, when gradients already hold memory and activations are
half freed). So the tracker here keeps its own running maxima of both, for the whole step and per phase (the
phases the memory model is built from).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ckpt.model import is_sharded

__all__ = [
    "fsdp_root",
    "local_tensor",
    "new_live_tracker",
    "normalise_device",
    "removing_grad_hooks",
    "tensor_bytes",
]

_TRACKER_CLASSES: dict[str, type] = {}

# torch's module trackers (under MemTracker and FlopCounterMode) register a multi-grad hook on every module's
# inputs and outputs and drop the handles. The hook holds the graph's nodes and the nodes hold the hook: a cycle
# through C++ that ``gc`` cannot break. A backward that completes frees the saved tensors anyway; a step that fails
# first (an OOM in forward or backward) would keep every activation it saved alive for the rest of the process.
_MULTI_GRAD_HOOK_MODULES = ("torch.distributed._tools.mod_tracker", "torch.utils.module_tracker")


@contextlib.contextmanager
def removing_grad_hooks() -> Iterator[list[Any]]:
    """Record the handles of every multi-grad hook torch's module trackers register inside, remove them all on exit.

    Removing a hook that already fired is a no-op, so a step that completed is unaffected; one that failed lets
    its graph go. Nested uses each restore what they replaced (last in, first out).
    """
    handles: list[Any] = []
    patched: list[tuple[Any, Any]] = []
    for name in _MULTI_GRAD_HOOK_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - older torch without one of them
            continue
        original = getattr(module, "register_multi_grad_hook", None)
        if original is None:  # pragma: no cover
            continue

        def recording(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            handle = _original(*args, **kwargs)
            handles.append(handle)
            return handle

        module.register_multi_grad_hook = recording
        patched.append((module, original))
    try:
        yield handles
    finally:
        for module, original in reversed(patched):
            module.register_multi_grad_hook = original
        for handle in handles:
            handle.remove()
        handles.clear()


class _IdSet:
    """The part of a WeakSet ModTracker uses (add, in), by identity and without keeping modules alive."""

    def __init__(self) -> None:
        self._items = WeakIdKeyDictionary()

    def add(self, item: Any) -> None:
        self._items[item] = True

    def __contains__(self, item: Any) -> bool:
        return item in self._items


class _LiveTracking:
    """MemTracker with running maxima of the total and of activations+temporaries on one device.

    Replaces the per-module peak bookkeeping (a loop over all modules on every op) with running
    maxima: all lightning_ckpt needs, and much cheaper on models with many modules. Optional
    *phases* (labels set by the caller, e.g. from module hooks) keep one pair of maxima each,
    which is what the memory model is built from.

    A mixin: ``_tracker_class`` puts it in front of torch's tracker (imported only then), and sets the
    class attributes below from that tracker's module.
    """

    _total_key: Any = None  # mem_tracker._TOTAL_KEY
    _ref_type: Any = None  # mem_tracker._MemRefType
    _module_stats: type | None = None  # FSDP only: the module statistics to keep (``_fsdp_stats_on_demand``)

    def __init__(self, device: torch.device, *base_args: Any) -> None:
        super().__init__(*base_args)
        if self._module_stats is not None:
            # FSDPMemTracker keeps statistics only for FSDP modules whose forward it saw, yet a block run
            # alone (the memory profile) still ends with the root's post-backward, which looks the root up.
            self.memory_tracking = self._module_stats()
        self.device = device
        # ModTracker keys modules by hash and equality, but torchmetrics' Metric overrides both
        # (``==`` builds a CompositionalMetric, the hash follows the metric's state), so a
        # LightningModule holding a metric fails with KeyError. Modules are identities: key by id.
        self._mod_tracker._known_modules = WeakIdKeyDictionary()
        self._mod_tracker._seen_modules = _IdSet()
        self.total_peak = 0
        self.activation_peak = 0
        self.phase: Hashable | None = None
        self.phase_peaks: dict[Hashable, list[int]] = {}
        self._grad_hooks: contextlib.ExitStack | None = None

    def __enter__(self) -> Any:
        if self._grad_hooks is None:
            stack = contextlib.ExitStack()
            stack.enter_context(removing_grad_hooks())
            self._grad_hooks = stack
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            if self._grad_hooks is not None and getattr(self, "_depth", 0) == 0:
                stack, self._grad_hooks = self._grad_hooks, None
                stack.close()

    def now(self) -> tuple[int, int]:
        """(total, activation) bytes live on the tracked device right now."""
        snap = self._curr_mem_snap.get(self.device)
        if snap is None:
            return 0, 0
        return snap[self._total_key], snap.get(self._ref_type.ACT, 0) + snap.get(self._ref_type.TEMP, 0)

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

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
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
            self._track_optimizer_states(self._ref_type.OPT, optimizer)
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
            self._update_and_maybe_create_winfos(grad, self._ref_type.GRAD)

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


def _fsdp_stats_on_demand() -> type:
    """Module statistics for ``FSDPMemTracker`` that make an empty record on lookup (see ``_LiveTracking``)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModMemStats

    class _StatsOnDemand(WeakIdKeyDictionary):
        def __getitem__(self, key: Any) -> Any:
            if key not in self:
                self[key] = _FSDPModMemStats(type(key).__name__)
            return super().__getitem__(key)

    return _StatsOnDemand


def _tracker_class(fsdp: bool = False) -> type:
    key = "fsdp" if fsdp else "plain"
    if key in _TRACKER_CLASSES:
        return _TRACKER_CLASSES[key]
    from torch.distributed._tools import mem_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:
        # FSDP2: all-gathered (unsharded) parameters, all-gather and reduce-scatter buffers get categories of
        # their own, so they count in the total but not as activation.
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker as base
    else:
        base = MemTracker

    class _LiveTracker(_LiveTracking, base):  # type: ignore[valid-type,misc]
        _total_key = mem_tracker._TOTAL_KEY
        _ref_type = mem_tracker._MemRefType
        _module_stats = _fsdp_stats_on_demand() if fsdp else None

    _TRACKER_CLASSES[key] = _LiveTracker
    return _LiveTracker


def fsdp_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP2 (``fully_shard``) module in ``model``, or None."""
    return next((m for m in model.modules() if is_sharded(m)), None)


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
