"""The live-tensor tracker, and the byte counts every stage shares. Activation bytes (and the CPU peak) come from
torch's ``MemTracker``, which files each live tensor under a category. It reports categories when the *total* peaks,
understating checkpointed plans' activation peak (the total peaks late in backward, activations half freed), so this
tracker keeps running maxima of both, per step and per phase."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ckpt.model import is_sharded

__all__ = ["fsdp_root", "local_tensor", "new_live_tracker", "normalise_device", "removing_grad_hooks", "tensor_bytes"]

# torch's module trackers (under MemTracker and FlopCounterMode) register a multi-grad hook on every module's inputs
# and outputs and drop the handles: hook and graph nodes hold each other through C++, a cycle ``gc`` cannot break, so
# a step that fails before backward completes (an OOM) would keep every activation it saved for the whole process.
_MULTI_GRAD_HOOK_MODULES = ("torch.distributed._tools.mod_tracker", "torch.utils.module_tracker")


@contextlib.contextmanager
def removing_grad_hooks() -> Iterator[list[Any]]:
    """Remove, on exit, every multi-grad hook torch's module trackers registered inside (see above)."""
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


class _IdSet(WeakIdKeyDictionary):
    """The part of a WeakSet ModTracker uses (add, in), by identity and without keeping modules alive."""

    def add(self, item: Any) -> None:
        self[item] = True


class _LiveTracking:
    """MemTracker with running maxima of the total and of activations+temporaries on one device, per step and per
    *phase* (caller-set labels), instead of its per-module peaks (a loop over all modules on every op)."""

    _total_key: Any = None  # mem_tracker._TOTAL_KEY
    _ref_type: Any = None  # mem_tracker._MemRefType
    _module_stats: type | None = None  # FSDP only: the module statistics to keep (``_tracker_class``)

    def __init__(self, device: torch.device, *base_args: Any) -> None:
        super().__init__(*base_args)
        if self._module_stats is not None:
            # FSDPMemTracker keeps statistics only for FSDP modules whose forward it saw, yet a block run alone
            # (the memory profile) still ends with the root's post-backward, which looks the root up.
            self.memory_tracking = self._module_stats()
        self.device = device
        # ModTracker keys modules by hash and equality, which torchmetrics' Metric overrides (``==`` builds a
        # CompositionalMetric): a LightningModule holding a metric failed with KeyError. Key by identity.
        self._mod_tracker._known_modules = WeakIdKeyDictionary()
        self._mod_tracker._seen_modules = _IdSet()
        self.total_peak = self.activation_peak = 0
        self.phase: Hashable | None = None
        self.phase_peaks: dict[Hashable, list[int]] = {}
        self._grad_hooks: Any = None

    def __enter__(self) -> Any:
        if self._grad_hooks is None:
            self._grad_hooks = removing_grad_hooks()
            self._grad_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            if self._grad_hooks is not None and getattr(self, "_depth", 0) == 0:
                hooks, self._grad_hooks = self._grad_hooks, None
                hooks.__exit__(None, None, None)

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
        # MemTracker refuses a top-level module called twice in one step ("multiple iterative calls"), ordinary in a
        # training_step (an encoder on two views); only its byte categories are needed, so a second call is fresh.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            parents = set(self._mod_tracker.parents)
            if name in parents:
                return  # re-entrant call (a module calling itself, e.g. torchmetrics' forward)
            if parents == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter, which raises for frozen ones ("cannot register a hook on a tensor that
        # doesn't require gradient"): models with frozen layers could not be tracked. Hook trainable ones only.
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._as_grad),
                        param.register_post_accumulate_grad_hook(lambda p: self._as_grad(p.grad)),
                    )
        return sizes

    # Lightning runs training_step and backward inside ``optimizer.step(closure)``, and MemTracker's optimizer
    # pre-hook files everything after it as optimizer state (a real step showed 0 activation bytes). With
    # ``closure_in_step`` the update is marked from outside (``optimizer_update_starts``, ``on_before_optimizer_step``).
    closure_in_step = False

    def _register_global_optimizer_hook(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            if not self.closure_in_step:
                self._in_opt = True

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            self._track_optimizer_states(self._ref_type.OPT, optimizer)
            self._in_opt = False

        self._optimizer_hook_handles = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))

    def optimizer_update_starts(self) -> None:
        """The closure has run; what the optimizer creates from now on is its state and temporaries."""
        self._in_opt = True

    def _as_grad(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self._update_and_maybe_create_winfos(grad, self._ref_type.GRAD)

    def _update_peak_stats(self, peak_state: Any) -> None:  # noqa: ARG002 - MemTracker's signature
        total, act = self.now()
        self.total_peak, self.activation_peak = max(self.total_peak, total), max(self.activation_peak, act)
        if self.phase is not None:
            peaks = self.phase_peaks[self.phase]
            peaks[0], peaks[1] = max(peaks[0], total), max(peaks[1], act)


@functools.cache
def _tracker_class(fsdp: bool = False) -> type:
    from torch.distributed._tools import mem_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = MemTracker
    if fsdp:
        # FSDP2: unsharded parameters and collective buffers count in the total, not as activation.
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker as base
        from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModMemStats

        class _StatsOnDemand(WeakIdKeyDictionary):  # an empty record on lookup (see ``_LiveTracking``)
            def __getitem__(self, key: Any) -> Any:
                if key not in self:
                    self[key] = _FSDPModMemStats(type(key).__name__)
                return super().__getitem__(key)

    class _LiveTracker(_LiveTracking, base):  # type: ignore[valid-type,misc]
        _total_key = mem_tracker._TOTAL_KEY
        _ref_type = mem_tracker._MemRefType
        _module_stats = _StatsOnDemand if fsdp else None

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
    """A ``MemTracker`` counting bytes on ``device`` only: enter it after ``track_external(model, optimizer,
    *tensors)``. An FSDP2 ``model`` gets torch's FSDP-aware tracker (collective buffers are no activation)."""
    device = normalise_device(torch.device(device))
    root = fsdp_root(model) if model is not None else None
    return _tracker_class(fsdp=True)(device, root, optimizer) if root is not None else _tracker_class()(device)


def normalise_device(device: torch.device) -> torch.device:
    # Tensors report cuda:N; a bare "cuda" would never match the tracker's per-device snapshots.
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
