"""The forwards ``apply_plan`` installs, each taking the module first (bound with ``functools.partial``). They share one
module on purpose: ``search/compile.py`` tells a graph break inside one of our regions by a frame of this file named in
``CHECKPOINT_FRAMES``."""

from __future__ import annotations

import functools
import itertools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.cards import installed_card
from lightning_ckpt.plan.buffer_guard import BufferGuard, Update, eager_in_compiled
from lightning_ckpt.plan.caches import without_cache_args
from lightning_ckpt.plan.chain import (
    HiddenAt,
    StackWatch,
    hidden_of,
    hidden_slot,
    in_slot,
    rng_equal,
    rng_states,
    same_value,
    set_rng_states,
    tensor_devices,
    with_hidden,
)
from lightning_ckpt.plan.offload import OffloadPool
from lightning_ckpt.plan.policies import selective_context_fn

__all__ = [
    "CHECKPOINT_FRAMES",
    "CHILD_GUARD",
    "CHUNK_BLOCKS",
    "Chunk",
    "PREV_FORWARD",
    "checkpointed_forward",
    "child_forward",
    "is_ours",
    "is_segment_forward",
    "offloaded_forward",
    "original_forward",
    "segment_head_forward",
    "segment_member_forward",
]

# Where a patched module keeps the instance forward it had before the plan (put back by PlanHandle.remove).
PREV_FORWARD = "_lightning_ckpt_prev_forward"


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward ``module`` had before the plan: its instance forward then, or its class's."""
    prev = module.__dict__.get(PREV_FORWARD)
    # A partial, not ``type(module).forward.__get__(module)``: Dynamo before torch 2.7 cannot trace __get__.
    return prev if prev is not None else functools.partial(type(module).forward, module)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # One tuple and one dict, so a block's own kwargs can never collide with checkpoint()'s (use_reentrant, ...).
    return fn(*args, **kwargs)


def checkpointed_forward(
    module: nn.Module, save_list: str | None, guard: BufferGuard, *args: Any, **kwargs: Any
) -> Any:
    inner = original_forward(module)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    args, kwargs = without_cache_args(module, args, kwargs)
    extra = {"context_fn": selective_context_fn(save_list)} if save_list else {}
    if torch.compiler.is_compiling():
        if guard.eager_under_compile:
            return eager_in_compiled(guard, functools.partial(_call, inner), args, kwargs, **extra)
        return checkpoint(_call, inner, args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra)
    return guard.checkpoint(functools.partial(_call, inner), args, kwargs, **extra)


def offloaded_forward(
    module: nn.Module, pool: OffloadPool, checkpointed: Callable[..., Any] | None, *args: Any, **kwargs: Any
) -> Any:
    """The block's forward with its saved tensors in ``pool`` (host memory): every one, or with ``checkpointed``
    (``offload_input``) the input alone, which a non-reentrant checkpoint saves under the hooks around it."""
    inner = checkpointed or original_forward(module)
    first = next((t for t in itertools.chain(args, module.parameters()) if isinstance(t, torch.Tensor)), None)
    device = first.device if first is not None else None
    # On a CPU model the activations already live in host memory (a simulated card is a device of its own).
    if not torch.is_grad_enabled() or device is None or (device.type == "cpu" and installed_card("cpu") is None):
        return inner(*args, **kwargs)
    with pool.offloading(device):
        return inner(*args, **kwargs)


# A graph break when compiled: only a step that leaves the chain gets here (the compiled search avoids such plans).
@torch.compiler.disable
def deviate(chunk: Chunk, start: int, reason: str) -> None:
    """Give the chunk up for the rest of this step: undo the buffer updates its run made in blocks from
    ``start`` on (the parent runs those itself, or not at all), drop its outputs, and warn once per stack."""
    with torch.no_grad():
        for index, buf, before in chunk.updates:
            if index >= start and buf.shape == before.shape:
                buf.copy_(before)
    chunk.clear()
    watch = chunk.watch
    if watch.reason is not None:
        return
    watch.reason = reason
    warnings.warn(
        f"lightning_ckpt: segments[{watch.stack_fqn!r}] could not run as planned in this step: {reason}. From there on the "
        "blocks of that chunk ran without checkpointing, so the step is exact but uses more memory than the plan "
        "predicts (shown once per stack). Segments need a parent that calls every block of the stack in order, "
        "each with the previous block's output, and draws no random numbers in between. For a model that skips "
        "blocks (LayerDrop, stochastic depth, early exit), remove this stack from the plan's 'segments' and use "
        "per-block modes (e.g. 'full') instead.",
        stacklevel=4,
    )


# How a segment's chunk runs each of its blocks: ``call(block, *args, **kwargs)``, or (None) the block's forward.
# Set by ``search.assembly`` so a chunk runs each block's own compiled graph, compiling nothing new.
CHUNK_BLOCKS = types.SimpleNamespace(call=None)


class Chunk:
    """Run-time state of one segment: several consecutive blocks recomputed as one region. The parent still calls every
    block: the first runs the whole chunk in one checkpoint and the later ones are handed their outputs while the parent
    calls them as a chain (``off_chain``); any other call ends the chunk for that step (``deviate``): exact, only the
    memory is higher than planned."""

    def __init__(self, fqns: tuple[str, ...], modules: list[nn.Module], watch: StackWatch) -> None:
        self.fqns = fqns
        self.modules = modules
        self.guard = BufferGuard(modules)
        self.watch = watch
        self.recording = False  # True from the head's checkpoint call until its forward starts
        self.clear()

    def clear(self) -> None:
        """Forget this step's run: the outputs still to hand out and everything needed to check the calls."""
        self.next_index: int | None = None  # the block due next, while outputs are waiting for it
        self.outputs: tuple[Any, ...] = ()
        self.slot: HiddenAt | None = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.devices: tuple[torch.device, ...] = ()
        self.states: list[tuple[torch.Tensor, ...]] | None = None  # RNG state after each block of the chunk
        self.updates: list[Update] = []  # buffer updates made by the chunk run

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        step = Chunk.__new__(Chunk)
        step.clear()
        state.update(vars(step), recording=False)
        return state

    def run(
        self,
        slot: HiddenAt,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        after_block: Callable[[], None] | None = None,
    ) -> tuple[Any, ...]:
        outputs = []
        call = CHUNK_BLOCKS.call
        for m in self.modules:
            out = original_forward(m)(*args, **kwargs) if call is None else call(m, *args, **kwargs)
            outputs.append(out)
            if after_block is not None:
                after_block()
            args, kwargs = with_hidden(args, kwargs, slot, hidden_of(out))
        return tuple(outputs)

    def run_eager(self, slot: HiddenAt, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``run`` outside compiled code: the forward records the RNG state after each block; a recompute
        (in backward, so the step's forward is over) gives up on blocks the parent never called."""
        if not self.recording:
            if self.next_index is not None:
                why = f"{self._rest()} never ran in that step (the parent skipped it or exited early)"
                deviate(self, self.next_index, why)
            return self.run(slot, args, kwargs)
        self.recording = False
        states: list[tuple[torch.Tensor, ...]] = []
        self.states = states
        return self.run(slot, args, kwargs, lambda: states.append(rng_states(self.devices)))

    def _rest(self) -> str:
        rest = self.fqns[self.next_index or 0 :]
        return f"block {rest[0]!r}" if len(rest) == 1 else f"blocks {rest[0]!r}..{rest[-1]!r}"

    def off_chain(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why the call of block ``index`` cannot take its precomputed output, or None when it can."""
        due, fqn = self.next_index, self.fqns[index]
        if due is None:
            return f"{fqn!r} ran without {self.fqns[0]!r} before it (the parent skipped it, or called {fqn!r} again)"
        if index != due:
            return f"{fqn!r} was called where {self.fqns[due]!r} was due (the parent skipped or reordered blocks)"
        slot = self.slot
        same = (
            torch.is_grad_enabled()
            and slot is not None
            and in_slot(args, kwargs, slot) is hidden_of(self.outputs[index - 1])
            and len(args) == len(self.args)
            and kwargs.keys() == self.kwargs.keys()
            and all(
                same_value(a, b) for i, (a, b) in enumerate(zip(args, self.args, strict=True)) if ("arg", i) != slot
            )
            and all(same_value(kwargs[k], self.kwargs[k]) for k in kwargs if ("kw", k) != slot)
        )
        if not same:
            return (
                f"{fqn!r} was not called with {self.fqns[index - 1]!r}'s output and the same other arguments as "
                f"{self.fqns[0]!r}"
            )
        if self.states is not None and not rng_equal(rng_states(self.devices), self.states[index - 1]):
            return f"the parent drew random numbers before calling {fqn!r} (e.g. LayerDrop deciding whether to run it)"
        return None


def segment_head_forward(module: nn.Module, chunk: Chunk, *args: Any, **kwargs: Any) -> Any:
    if chunk.next_index is not None:  # the last step left blocks of the chunk uncalled
        deviate(chunk, chunk.next_index, f"{chunk._rest()} never ran before {chunk.fqns[0]!r} ran again")
    if not torch.is_grad_enabled():
        return original_forward(module)(*args, **kwargs)
    slot = hidden_slot(args, kwargs)
    if slot is None:
        deviate(chunk, len(chunk.modules), f"{chunk.fqns[0]!r} was called without a hidden state to hand on")
        return original_forward(module)(*args, **kwargs)
    run_args, run_kwargs = without_cache_args(module, args, kwargs)
    if torch.compiler.is_compiling() and chunk.guard.eager_under_compile:
        outputs = eager_in_compiled(chunk.guard, functools.partial(chunk.run, slot), run_args, run_kwargs)
    elif torch.compiler.is_compiling():
        # Compiled RNG is not eager RNG anyway, and reading generator state breaks graphs: no RNG tracking.
        outputs = checkpoint(chunk.run, slot, run_args, run_kwargs, use_reentrant=False, preserve_rng_state=True)
    else:
        chunk.devices = tensor_devices(run_args, run_kwargs)
        chunk.recording = True
        updates: list[Update] = []
        try:
            outputs = chunk.guard.checkpoint(functools.partial(chunk.run_eager, slot), run_args, run_kwargs, updates)
        finally:
            chunk.recording = False
        states = chunk.states
        chunk.updates = updates
        if states:  # the parent goes on from where block 0 left the generators, as without the plan
            set_rng_states(chunk.devices, states[0])
    if len(outputs) == 1:
        chunk.clear()
        return outputs[0]
    chunk.outputs, chunk.next_index, chunk.slot = outputs, 1, slot
    chunk.args, chunk.kwargs = args, kwargs
    return outputs[0]


# Functions of this module that run inside a checkpointed region: a graph break through one is in our region.
_REGION_FUNCTIONS = (checkpointed_forward, _call, segment_head_forward, Chunk.run, Chunk.run_eager)
CHECKPOINT_FRAMES = frozenset(f.__name__ for f in _REGION_FUNCTIONS)


def segment_member_forward(module: nn.Module, chunk: Chunk, index: int, *args: Any, **kwargs: Any) -> Any:
    if chunk.next_index is None and not torch.is_grad_enabled():
        return original_forward(module)(*args, **kwargs)
    why = chunk.off_chain(index, args, kwargs)
    if why is not None:
        deviate(chunk, chunk.next_index if chunk.next_index is not None else len(chunk.modules), why)
        return original_forward(module)(*args, **kwargs)
    out = chunk.outputs[index]
    if chunk.states is not None:
        set_rng_states(chunk.devices, chunk.states[index])
    if index + 1 < len(chunk.modules):
        chunk.next_index = index + 1
    else:
        # Drop every reference once handed out, or its hidden states would outlive their backward.
        chunk.clear()
    return out


# Where a child checkpointed by ``child_forward`` keeps its buffer guard (deep copies copy it with the module).
CHILD_GUARD = "_lightning_ckpt_child_guard"


def child_forward(module: nn.Module) -> types.MethodType:
    """A selectively checkpointed child's forward inside a block compiled alone: a method bound to the child, as
    dynamo guards a partial by identity (a graph per block) but a bound method by code (one graph for all). Used only
    there, as pickling a bound method leaves the copy's child unplanned."""
    return types.MethodType(_child_forward, module)


def _child_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpointed_forward(self, None, self.__dict__[CHILD_GUARD], *args, **kwargs)


_child_forward.__name__ = "forward"  # what ``pickle`` looks the method up by (see ``child_forward``)

_OUR_FORWARDS = (checkpointed_forward, offloaded_forward, segment_head_forward, segment_member_forward)


def is_ours(fn: Any) -> bool:
    if isinstance(fn, types.MethodType):
        return fn.__func__ is _child_forward
    return isinstance(fn, functools.partial) and fn.func in _OUR_FORWARDS


def is_segment_forward(fn: Any) -> bool:
    """Whether ``fn`` makes its module part of a segment's chunk (the head or a later member)."""
    return isinstance(fn, functools.partial) and fn.func in (segment_head_forward, segment_member_forward)
