"""Buffers under recompute: a checkpointed region's recompute runs on throwaway copies of the pre-forward values, or
BatchNorm statistics, EMAs and counters would advance twice per step. (Compiled, AOTAutograd updates once.)"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.versions import torch_version

__all__ = ["BufferGuard", "COMPILED_BUFFER_UPDATES_EXACT", "Update", "eager_in_compiled", "version_counter"]

# Traps: BatchNorm updates its running statistics without bumping their version counters, so updates are
# found by comparing values; and an op-save-list recompute runs under a dispatch mode that refuses any op
# the forward did not run, so every copy the recompute uses is made before backward, outside that mode.
_BufferKey = tuple[int, str, str]  # (index of the region's module, owner FQN inside it, buffer name)
_Slot = tuple[nn.Module, str, torch.Tensor]  # (owner module, buffer name, the tensor registered there)
# What a region runs: its args as one tuple and its kwargs as one dict (see forwards._call).
RegionFn = Callable[[tuple[Any, ...], dict[str, Any]], Any]
Update = tuple[int, torch.Tensor, torch.Tensor]  # (region index, buffer as registered now, its pre-forward value)


def _buffer_slots(modules: list[nn.Module]) -> dict[_BufferKey, _Slot]:
    slots = {}
    for i, region in enumerate(modules):
        for owner_fqn, owner in region.named_modules():
            for name, buf in owner._buffers.items():
                if buf is not None:
                    slots[(i, owner_fqn, name)] = (owner, name, buf)
    return slots


def version_counter(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by most in-place ops), or None for an inference tensor."""
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter, and no in-place update outside inference mode
        return None


def _copies(tensors: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    """Detached copies; a tensor registered under two names (tied buffers) gets one copy, so they stay tied."""
    memo: dict[int, torch.Tensor] = {}
    out = {}
    for key, t in tensors.items():
        if id(t) not in memo:
            c = t.detach().clone()
            memo[id(t)] = c.requires_grad_() if t.requires_grad else c
        out[key] = memo[id(t)]
    return out


def _changed(slot: _Slot, before: torch.Tensor | None, version: int | None) -> bool:
    owner, name, buf = slot
    now = owner._buffers.get(name)
    if now is not buf or version_counter(buf) != version:
        return True
    if before is None:
        return False
    return before.shape != buf.shape or before.dtype != buf.dtype or not torch.equal(before, buf)


class _Recompute:
    """The function handed to ``checkpoint``: its first call is the forward, every later call a recompute."""

    __slots__ = ("calls", "copy_in_backward", "fn", "pristine", "working")

    def __init__(self, fn: RegionFn, *, copy_in_backward: bool) -> None:
        self.fn = fn
        self.calls = 0
        self.copy_in_backward = copy_in_backward  # False under an op save-list: its recompute mode refuses new ops
        self.pristine: list[tuple[nn.Module, str, torch.Tensor]] = []  # pre-forward values of updated buffers
        self.working: list[torch.Tensor] | None = None  # their copies for the next recompute to update

    def prepare(self, pristine: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        self.pristine = pristine
        self.working = list(_copies(dict(enumerate(t for _, _, t in pristine))).values()) if pristine else None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        if self.calls == 1 or not self.pristine:
            return self.fn(args, kwargs)
        working = self.working
        if working is None:  # a second recompute, after backward(retain_graph=True)
            source = dict(enumerate(t for _, _, t in self.pristine))
            working = list((_copies(source) if self.copy_in_backward else source).values())
        self.working = None
        current = [(owner, name, owner._buffers.get(name)) for owner, name, _ in self.pristine]
        for (owner, name, _), copy_ in zip(self.pristine, working, strict=True):
            owner._buffers[name] = copy_
        try:  # checkpoint's early stop ends a recompute with an exception
            return self.fn(args, kwargs)
        finally:
            for owner, name, buf in reversed(current):
                owner._buffers[name] = buf


class BufferGuard:
    """Checkpoints one region (a block, a child, a segment's blocks) so that its recompute leaves buffers alone. Which
    buffers the forward updates is learned on its first call per train/eval configuration; later calls copy only those,
    so a constant buffer (a causal mask) costs nothing per step. Holds no tensors between steps."""

    def __init__(self, modules: list[nn.Module], *, saves_inputs: bool = False) -> None:
        self.modules = modules
        # Inputs handed to checkpoint one by one are saved under the hooks around it (``offload_input``'s pool).
        self.saves_inputs = saves_inputs
        self.updated: dict[tuple[bool, ...], set[_BufferKey]] = {}  # train/eval flags -> updated buffers
        self.eager_under_compile = _compiled_recompute_updates_twice(modules)

    def checkpoint(
        self,
        fn: RegionFn,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        updates: list[Update] | None = None,
        **extra: Any,
    ) -> Any:
        """``updates``, when given, receives (region index, buffer as registered now, its pre-forward value) for
        every buffer the forward updated, so a segment can undo the updates of blocks the parent then skips."""
        recompute = _Recompute(fn, copy_in_backward="context_fn" not in extra)
        slots = _buffer_slots(self.modules)
        if not slots:
            return self._checkpoint(recompute, args, kwargs, extra)
        flags = tuple(m.training for region in self.modules for m in region.modules())
        known = self.updated.get(flags)
        versions = {k: version_counter(buf) for k, (_, _, buf) in slots.items()}
        before = _copies({k: slots[k][2] for k in (slots.keys() if known is None else known & slots.keys())})
        out = self._checkpoint(recompute, args, kwargs, extra)
        # Values are compared (a host sync on CUDA) only on a configuration's first call.
        if known is None:
            updated = self.updated[flags] = {k for k, s in slots.items() if _changed(s, before.get(k), versions[k])}
        else:
            updated = {k for k, slot in slots.items() if k in known or _changed(slot, None, versions[k])}
        late = updated - before.keys()
        if late:  # no pre-forward value: the recompute at least updates a copy, not the buffer a second time
            known |= late
            now = {k: slots[k][0]._buffers[slots[k][1]] for k in late}
            before.update(_copies({k: t for k, t in now.items() if t is not None}))
            names = tuple(sorted(f"{owner}.{name}" if owner else name for _, owner, name in late))
            _warn_late_update_once(type(self.modules[0]).__name__, names)
        recompute.prepare([(slots[k][0], slots[k][1], before[k]) for k in sorted(updated) if k in before])
        if updates is not None:
            for k in sorted(updated):
                now = slots[k][0]._buffers.get(slots[k][1])
                if k in before and now is not None:
                    updates.append((k[0], now, before[k]))
        return out

    def _checkpoint(self, recompute: _Recompute, args: tuple[Any, ...], kwargs: dict[str, Any], extra: Any) -> Any:
        if not self.saves_inputs:
            return checkpoint(recompute, args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra)
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        slot = object()  # where a tensor goes: held by checkpoint alone (saved), not by this closure
        rest = [slot if isinstance(x, torch.Tensor) else x for x in leaves]

        def run(*given: torch.Tensor) -> Any:
            it = iter(given)
            return recompute(*tree_unflatten([next(it) if x is slot else x for x in rest], spec))

        return checkpoint(run, *tensors, use_reentrant=False, preserve_rng_state=True, **extra)


# Before torch 2.9 a *compiled* checkpointed region applies its buffer updates again in the recompute, silently; so
# there a region holding running statistics runs eagerly under the guard (a graph break). docs/versions.md.
COMPILED_BUFFER_UPDATES_EXACT = (2, 9)


def _compiled_recompute_updates_twice(modules: list[nn.Module]) -> bool:
    found = torch_version()
    if found is None or found >= COMPILED_BUFFER_UPDATES_EXACT:
        return False
    return any(
        isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        for region in modules
        for m in region.modules()
    )


@torch.compiler.disable
def eager_in_compiled(guard: BufferGuard, fn: Callable[..., Any], args: Any, kwargs: Any, **extra: Any) -> Any:
    _warn_eager_in_compiled_once(type(guard.modules[0]).__name__, str(torch.__version__))
    return guard.checkpoint(fn, args, kwargs, **extra)


@functools.lru_cache(maxsize=16)
def _warn_eager_in_compiled_once(cls_name: str, version: str) -> None:
    warnings.warn(
        f"lightning_ckpt: a checkpointed {cls_name} holds BatchNorm running statistics; torch {version} would update "
        f"them twice per step in a compiled recompute, so it runs eagerly (a graph break) to stay exact. torch>="
        f"{COMPILED_BUFFER_UPDATES_EXACT[0]}.{COMPILED_BUFFER_UPDATES_EXACT[1]} compiles it exactly.",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=64)
def _warn_late_update_once(cls_name: str, names: tuple[str, ...]) -> None:
    warnings.warn(
        f"lightning_ckpt: a checkpointed {cls_name} updated buffer(s) {', '.join(names)} in forward although its "
        "earlier calls left them alone, so this step's recompute read the updated value(s); from now on their "
        "pre-forward values are kept for the recompute. If the forward reads them, plan this block with mode "
        "'none' or 'offload' (neither recomputes).",
        stacklevel=4,
    )
