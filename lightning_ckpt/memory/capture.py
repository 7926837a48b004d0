"""The capture: one ``torch.no_grad`` forward that learns how the step calls its blocks, keeping almost nothing. Forward
pre-hooks record the call order and keep the inputs and autocast regions of one representative per group of identical
blocks, so each can later run alone as the step ran it; they also check which stacks run as a chain."""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_ckpt.plan.caches import CACHE_ARGS, forward_params
from lightning_ckpt.plan.chain import hidden_slot, in_slot, rng_equal, rng_states, same_value, tensor_devices

__all__ = ["Captured", "autocast_as", "backward_leaves", "capture_calls", "captured_tensors", "hidden_tensor"]


def hidden_tensor(obj: Any) -> torch.Tensor | None:
    """A block output's hidden state: the first floating-point tensor (needing a gradient or not)."""
    leaves, _ = tree_flatten(obj)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _spec(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(("T", tuple(leaf.shape), str(leaf.dtype), str(leaf.device)))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            out.append(leaf)
        else:
            out.append(type(leaf).__qualname__)
    return (str(spec), tuple(out))


def _group_key(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    return (type(module), params, buffers, _spec(args), _spec(dict(sorted(kwargs.items()))))


def captured_tensors(cap: Captured) -> list[torch.Tensor]:
    return [t for t in tree_flatten((cap.args, cap.kwargs))[0] if isinstance(t, torch.Tensor)]


def _without_kv_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The block's arguments without KV cache: run again with the captured cache, a block would append to it twice;
    backward never reads it, and ``apply_plan`` drops it too."""
    names = forward_params(type(module))
    args = tuple(None if i < len(names) and names[i] in CACHE_ARGS else a for i, a in enumerate(args))
    kwargs = {k: (None if k in CACHE_ARGS else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


@dataclass
class Captured:
    fqn: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: tuple[tuple[str, torch.dtype, bool], ...] = ()
    # How the step called it (read in the anchor): whether its hidden input needed a gradient (not behind frozen
    # layers) and which output leaves (``tree_flatten`` positions) received one (an auxiliary loss). None: unknown.
    input_grad: bool = True
    grad_leaves: tuple[int, ...] | None = None


def _autocast_state() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """The autocast regions active now, as (device type, dtype, cache enabled): a block replayed without the step's
    autocast saves full-precision activations, over-predicting every mode but ``full`` by a quarter or more."""
    return tuple(
        (dev, torch.get_autocast_dtype(dev), torch.is_autocast_cache_enabled())
        for dev in ("cpu", "cuda")
        if torch.is_autocast_enabled(dev)
    )


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype, bool], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev, dtype, cache in state:
            stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
        yield


class _ChainCheck:
    """Whether each stack's blocks run as a chain, which segments need: each block gets the previous one's output as
    its hidden state and the same other arguments (not T5: its position bias would be lost to a segment's recompute),
    in order, none skipped, and the parent draws no random numbers between them (LayerDrop's coin)."""

    def __init__(self, stack_of: Mapping[str, str]) -> None:
        self.stack_of = stack_of
        self.unchained: set[str] = set()
        self._last: dict[str, tuple[Any, Any]] = {}  # stack -> (weakref to output, other arguments)
        members: dict[str, list[str]] = {}  # stack -> its blocks, in order
        for fqn, stack in stack_of.items():
            members.setdefault(stack, []).append(fqn)
        self._index = {fqn: i for fqns in members.values() for i, fqn in enumerate(fqns)}
        self._ran: dict[str, int] = {}  # stack -> index of the block that ran last
        self._rng: dict[str, tuple[Any, ...]] = {}  # stack -> RNG state (and its devices) when that block ended

    @staticmethod
    def _others(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: tuple[str, Any] | None) -> tuple[str, list]:
        rest_args = [a for i, a in enumerate(args) if where != ("arg", i)]
        rest_kwargs = {k: v for k, v in sorted(kwargs.items()) if where != ("kw", k)}
        leaves, spec = tree_flatten((rest_args, rest_kwargs))
        return str(spec), [weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]

    def before(self, fqn: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        stack = self.stack_of.get(fqn)
        if stack is None or stack in self.unchained:
            return
        where = hidden_slot(args, kwargs, strict=True)
        others = self._others(args, kwargs, where)
        last = self._last.get(stack)
        index, ran, rng = self._index[fqn], self._ran.get(stack), self._rng.get(stack)
        skipped = index != (0 if ran is None else ran + 1)  # a block skipped, repeated or run out of order
        drew = rng is not None and not rng_equal(rng_states(rng[0]), rng[1])  # random numbers drawn in between
        if skipped or drew:
            self.unchained.add(stack)
            return
        if last is not None:
            hidden = None if where is None else in_slot(args, kwargs, where)
            out_ref, (prev_spec, prev_leaves) = last
            chained = (
                hidden is not None
                and out_ref is not None
                and out_ref() is hidden
                and prev_spec == others[0]
                and all(_same_leaf(a, b) for a, b in zip(prev_leaves, others[1], strict=True))
            )
            if not chained:
                self.unchained.add(stack)
        self._last[stack] = (None, others)

    def after(self, fqn: str, out: Any) -> None:
        stack = self.stack_of.get(fqn)
        if stack is None or stack not in self._last:
            return
        first = out if isinstance(out, torch.Tensor) else hidden_tensor(out)
        self._last[stack] = (weakref.ref(first) if first is not None else None, self._last[stack][1])
        self._ran[stack] = self._index[fqn]
        devices = tensor_devices((out,), {})
        self._rng[stack] = (devices, rng_states(devices))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, weakref.ref) or isinstance(b, weakref.ref):
        return isinstance(a, weakref.ref) and isinstance(b, weakref.ref) and a() is not None and a() is b()
    return same_value(a, b)


def capture_calls(
    root: nn.Module, forward_fn: Callable[[], Any], blocks: dict[int, str], share: bool, stack_of: Mapping[str, str]
) -> tuple[list[str], dict[str, Captured], list[str], set[str]]:
    """No-grad forward: block call order (a block shared across depth once per call), one input per group, each
    call's representative, and the stacks that are no chain."""
    order: list[str] = []
    reps: dict[Any, Captured] = {}
    rep_of: list[str] = []
    chain = _ChainCheck(stack_of)

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fqn = blocks[id(module)]
        order.append(fqn)
        chain.before(fqn, args, kwargs)
        args, kwargs = _without_kv_cache(module, args, kwargs)
        key = _group_key(module, args, kwargs) if share else fqn
        if key not in reps:
            reps[key] = Captured(fqn, module, tuple(args), dict(kwargs), _autocast_state())
        rep_of.append(reps[key].fqn)

    def post_hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        chain.after(blocks[id(module)], out)

    modules = {fqn: root.get_submodule(fqn) for fqn in blocks.values()}
    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules.values()]
    handles += [m.register_forward_hook(post_hook) for m in modules.values()]
    try:
        with torch.no_grad():
            out = forward_fn()
        del out
    finally:
        for h in handles:
            h.remove()
    # A block called several times is one FQN in a plan: one checkpoint cannot span several calls.
    shared = {f for f, calls in collections.Counter(order).items() if calls > 1}
    unchained = chain.unchained | {stack_of[f] for f in shared if f in stack_of}
    return order, {c.fqn: c for c in reps.values()}, rep_of, unchained


def backward_leaves(out: Any, positions: tuple[int, ...] | None) -> list[torch.Tensor]:
    """The output leaves a block's backward starts from: those that received a gradient in the step
    (``positions``), or the first that needs one when that is not known."""
    leaves = [(i, t) for i, t in enumerate(tree_flatten(out)[0]) if isinstance(t, torch.Tensor) and t.requires_grad]
    if positions is None:
        return [t for _, t in leaves[:1]]
    return [t for i, t in leaves if i in positions]
