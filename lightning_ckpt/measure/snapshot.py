"""Leaving no trace: what measuring a step may disturb (RNG streams, buffers, gradients, the parameters a forward writes
in place), captured so the first real step finds the model as it would with no search at all."""

from __future__ import annotations

import contextlib
import random
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ckpt.plan.buffer_guard import version_counter

__all__ = [
    "WRITTEN_IN_FORWARD",
    "StateSnapshot",
    "find_parameters_written_in_forward",
    "forget_parameters_written_in_forward",
    "mark_zero_grad",
    "rng_state",
    "set_rng_state",
]


class StateSnapshot:
    """The global RNG streams, every buffer and every ``.grad``, copied to host memory (not counted against the device
    measured). Parameters are not copied (that would double the model's memory), but for those the forward writes in
    place; ``changed_parameters()`` catches other in-place updates (an optimizer step) by version counter."""

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
        """Gradients marked by ``mark_zero_grad`` (and unchanged since) are recorded as zeros, not copied (the
        callback's trials start from such gradients: on a 7B model a host copy is tens of GB per rank)."""
        snap = cls()
        snap._rng = rng_state()
        for name, p in model.named_parameters():  # a shared parameter once
            g = p.grad
            known_zero = g is not None and g in _KNOWN_ZERO and _KNOWN_ZERO[g] == version_counter(g)
            copy = None if g is None else _ZERO if known_zero else g.detach().to("cpu", copy=True)
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

    @torch.no_grad()
    def reset_grads(self) -> None:
        """Put every ``.grad`` back as captured (``None`` stays ``None``), and the parameters the forward writes."""
        for p, saved in self._written:
            p.copy_(saved)
        for p, ref, copy in self._grads:
            g = ref() if ref is not None else None
            if copy is None:
                p.grad = None
            elif g is None:  # freed by the step: a fresh tensor with the captured values
                p.grad = torch.zeros_like(p) if copy is _ZERO else copy.to(device=p.device)
            elif copy is _ZERO:
                p.grad = g.zero_()
            else:
                # Always copy: not every in-place update bumps the version counter (BatchNorm's running statistics).
                p.grad = g.copy_(copy)
            if copy is _ZERO:
                mark_zero_grad(p.grad)

    @torch.no_grad()
    def restore(self) -> None:
        self.reset_grads()
        for module, name, b, copy in self._buffers:
            module._buffers[name] = b
            b.copy_(copy)
        set_rng_state(self._rng)

    def changed_parameters(self) -> list[str]:
        return [name for name, p, version in self._param_versions if p._version != version]


# Gradients known to hold zeros, with their version counter then: snapshots record them without a copy and restore
# them with ``zero_()``; an in-place change moves the counter and ends the mark.
_ZERO = object()
_KNOWN_ZERO: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_zero_grad(grad: torch.Tensor) -> None:
    _KNOWN_ZERO[grad] = version_counter(grad)


# Marks a parameter the model's forward writes in place, so every ``StateSnapshot`` copies and restores it.
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
    """Run ``step_fn``'s forward once, without grad, mark the parameters it writes in place and return their names;
    everything this pass changes is put back. ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in
    every forward: the search's forwards must not move the weights the first real step starts from."""
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


def rng_state() -> dict[str, Any]:
    """The global random streams (torch CPU and CUDA, Python ``random``, NumPy), for ``set_rng_state``."""
    import numpy as np  # a dependency of matplotlib's, so always there

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    # Only CUDA generators that exist already: reading them would otherwise initialise CUDA.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
