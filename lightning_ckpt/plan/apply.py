"""Apply a plan to a model in place, reversibly, without changing a single FQN.

Modules are never wrapped or replaced: each planned module gets an instance-level ``forward`` that
runs the class's forward under non-reentrant checkpointing. So module names, ``state_dict`` keys and
parameter objects stay exactly as they were (a checkpoint saved with a plan applied loads into a
plain model), and ``PlanHandle.remove()`` deletes the instance attribute to restore the original.

The instance forward is a ``functools.partial`` of a module-level function bound to the module, so
``copy.deepcopy`` and ``pickle`` keep working and a deep-copied model calls its *own* layers; the model
holds its ``PlanHandle``, so a copy carries a handle of its own (``plan_handle(copy).remove()``).

A recompute never updates a buffer a second time: BatchNorm statistics, EMAs and counters end a step
exactly as in the unplanned model, and a forward that reads a buffer it updates is recomputed from
the value it read the first time (see ``_BufferGuard``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.discovery import unwrap_compiled
from lightning_ckpt.errors import ApplyError, PlanError
from lightning_ckpt.plan.format import Plan, closest_names
from lightning_ckpt.plan.policies import selective_context_fn
from lightning_ckpt.versions import torch_version

__all__ = [
    "CACHE_ARGS",
    "CHECKPOINT_FRAMES",
    "PlanHandle",
    "apply_plan",
    "applied_plan",
    "existing_checkpointing",
    "plan_handle",
    "forward_params",
    "segment_chunks",
]

log = logging.getLogger(__name__)

_PREV_FORWARD = "_lightning_ckpt_prev_forward"
_HANDLE_ATTR = "_lightning_ckpt_plan_handle"
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, PlanHandle] = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------------------------------
# The forwards we install. Each takes the module first (bound with functools.partial).
# ---------------------------------------------------------------------------------------------------
def _original_forward(module: nn.Module) -> Callable[..., Any]:
    prev = module.__dict__.get(_PREV_FORWARD)
    # A partial, not ``type(module).forward.__get__(module)``: Dynamo before torch 2.7 cannot trace __get__.
    return prev if prev is not None else functools.partial(type(module).forward, module)


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Args travel as one tuple and one dict so a block's own kwargs can never collide with
    # checkpoint()'s (use_reentrant, context_fn, debug, ...).
    return fn(*args, **kwargs)


# Arguments that carry a KV cache. A block that appends to a cache in forward would append again
# when recomputed, so the recompute would see different keys (and selective checkpointing fails with
# "encountered during backward but not found in storage"). A training step never reads the cache,
# so under checkpointing we pass None, exactly as HF's own gradient checkpointing does.
CACHE_ARGS = frozenset({"past_key_values", "past_key_value", "layer_past", "cache"})


_FORWARD_PARAMS: dict[type, tuple[str, ...]] = {}


# Called inside compiled regions: marked constant so dynamo calls it once at trace time instead of
# tracing inspect.signature. A plain dict cache rather than functools.lru_cache, whose wrapper dynamo
# traces through (with a warning) and does not treat as constant.
@torch.compiler.assume_constant_result
def forward_params(cls: type) -> tuple[str, ...]:
    names = _FORWARD_PARAMS.get(cls)
    if names is None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        _FORWARD_PARAMS[cls] = names
    return names


def _without_caches(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = forward_params(type(module))
    dropped = [n for i, n in enumerate(names[: len(args)]) if n in CACHE_ARGS and args[i] is not None]
    dropped += [k for k in kwargs if k in CACHE_ARGS and kwargs[k] is not None]
    if not dropped and not kwargs.get("use_cache"):
        return args, kwargs
    if dropped:
        _warn_cache_once(type(module).__name__, tuple(dropped))
    args = tuple(None if i < len(names) and names[i] in CACHE_ARGS else a for i, a in enumerate(args))
    kwargs = {k: (None if k in CACHE_ARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


@functools.lru_cache(maxsize=64)
def _warn_cache_once(cls_name: str, dropped: tuple[str, ...]) -> None:
    warnings.warn(
        f"lightning_ckpt: {cls_name} was called with a KV cache ({', '.join(dropped)}) while checkpointed; the cache "
        "is not passed to checkpointed blocks because recomputation would append to it twice. Training does not "
        "use the cache; pass use_cache=False to silence this warning.",
        stacklevel=4,
    )


# ---------------------------------------------------------------------------------------------------
# Buffers under recompute
# ---------------------------------------------------------------------------------------------------
# A recompute runs the region's forward a second time, in training mode, so every buffer update in it
# (BatchNorm's running_mean/running_var/num_batches_tracked, an EMA, a step counter) would happen twice,
# and a forward that reads a buffer it updates would be recomputed from the updated value (different
# saved tensors, so different gradients). So each recompute runs on throwaway copies, holding the values
# from before the original forward, of the buffers that forward updated; the model's own buffers are not
# written during backward. Under torch.compile none of this applies (nor traces): AOTAutograd's
# functionalisation applies a buffer update once, after the graph, and recomputes only what backward needs.
#
# Traps: BatchNorm updates its running statistics without bumping their version counters, so updates are
# found by comparing values; and an op-save-list recompute runs under a dispatch mode that refuses any op
# the forward did not run, so every copy the recompute uses is made before backward, outside that mode.
_BufferKey = tuple[int, str, str]  # (index of the region's module, owner FQN inside it, buffer name)
_Slot = tuple[nn.Module, str, torch.Tensor]  # (owner module, buffer name, the tensor registered there)


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

    def __init__(self, fn: Callable[[tuple[Any, ...], dict[str, Any]], Any], *, copy_in_backward: bool) -> None:
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


class _BufferGuard:
    """Checkpoints one region (a block, a child, a segment's blocks) so that its recompute leaves buffers alone.

    Which buffers the region's forward updates is learned on its first call in each train/eval
    configuration of its modules (every buffer is copied once and compared afterwards); later calls
    copy only those, so a large constant buffer (a causal mask) costs nothing per step. A buffer first
    updated on a later call is caught by its version counter or a reassignment (not by BatchNorm-style
    updates that bypass the version counter) and kept from then on. Holds no tensors between steps,
    so a planned model still deep-copies and pickles.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.updated: dict[tuple[bool, ...], set[_BufferKey]] = {}  # train/eval flags -> updated buffers
        self.eager_under_compile = _compiled_recompute_updates_twice(modules)

    def checkpoint(
        self, fn: Callable[[tuple[Any, ...], dict[str, Any]], Any], args: tuple[Any, ...], kwargs: dict[str, Any],
        updates: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None, **extra: Any,
    ) -> Any:  # fmt: skip
        """``updates``, when given, receives (region index, buffer as registered now, its pre-forward value) for
        every buffer the forward updated, so a segment can undo the updates of blocks the parent then skips."""
        recompute = _Recompute(fn, copy_in_backward="context_fn" not in extra)
        slots = _buffer_slots(self.modules)
        if not slots:
            return checkpoint(recompute, args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra)
        flags = tuple(m.training for region in self.modules for m in region.modules())
        known = self.updated.get(flags)
        versions = {k: version_counter(buf) for k, (_, _, buf) in slots.items()}
        before = _copies({k: slots[k][2] for k in (slots.keys() if known is None else known & slots.keys())})
        out = checkpoint(recompute, args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra)
        # Values are compared (torch.equal: a host sync on CUDA) only on the first call in a configuration; later
        # calls take the known set as updated and check the rest by version counter and identity alone, so real
        # training after lock-in pays no sync per region and step.
        if known is None:
            updated = {k for k, slot in slots.items() if _changed(slot, before.get(k), versions[k])}
        else:
            updated = {k for k, slot in slots.items() if k in known or _changed(slot, None, versions[k])}
        if known is None:
            self.updated[flags] = updated
        late = updated - before.keys()
        if late:  # no pre-forward value: the recompute at least updates a copy, not the buffer a second time
            known |= late
            now = {k: slots[k][0]._buffers[slots[k][1]] for k in late}
            before.update(_copies({k: t for k, t in now.items() if t is not None}))
            _warn_late_update_once(type(self.modules[0]).__name__, tuple(sorted(_key_name(k) for k in late)))
        recompute.prepare([(slots[k][0], slots[k][1], before[k]) for k in sorted(updated) if k in before])
        if updates is not None:
            for k in sorted(updated):
                now = slots[k][0]._buffers.get(slots[k][1])
                if k in before and now is not None:
                    updates.append((k[0], now, before[k]))
        return out


# Before torch 2.9 a *compiled* checkpointed region applies its buffer updates again in the recompute (seen
# with torch 2.6 and 2.8: a BatchNorm's num_batches_tracked advances by 2 per step and its running statistics
# move twice, silently); from 2.9 AOTAutograd applies them once, after the graph. So on those releases a
# region holding running statistics runs eagerly under the guard even inside a compiled model: exact, at the
# cost of a graph break there (which the compiled search reports as a conflict and avoids). Only norms with
# running statistics can be seen from the module tree; docs/versions.md lists other buffers as a limitation.
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
def _eager_in_compiled(guard: _BufferGuard, fn: Callable[..., Any], args: Any, kwargs: Any, **extra: Any) -> Any:
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


def _key_name(key: _BufferKey) -> str:
    _, owner_fqn, name = key
    return f"{owner_fqn}.{name}" if owner_fqn else name


@functools.lru_cache(maxsize=64)
def _warn_late_update_once(cls_name: str, names: tuple[str, ...]) -> None:
    warnings.warn(
        f"lightning_ckpt: a checkpointed {cls_name} updated buffer(s) {', '.join(names)} in forward although its "
        "earlier calls left them alone, so this step's recompute read the updated value(s); from now on their "
        "pre-forward values are kept for the recompute. If the forward reads them, plan this block with mode "
        "'none' or 'offload' (neither recomputes).",
        stacklevel=4,
    )


def _checkpointed_forward(
    module: nn.Module, save_list: str | None, guard: _BufferGuard, *args: Any, **kwargs: Any
) -> Any:
    inner = _original_forward(module)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    args, kwargs = _without_caches(module, args, kwargs)
    extra = {"context_fn": selective_context_fn(save_list)} if save_list else {}
    if torch.compiler.is_compiling():
        if guard.eager_under_compile:
            return _eager_in_compiled(guard, functools.partial(_call, inner), args, kwargs, **extra)
        return checkpoint(_call, inner, args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra)
    return guard.checkpoint(functools.partial(_call, inner), args, kwargs, **extra)


def _first_device(module: nn.Module, args: tuple[Any, ...]) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    p = next(module.parameters(), None)
    return p.device if p is not None else None


def _offloaded_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = _original_forward(module)
    device = _first_device(module, args)
    # On a CPU model the activations already live in host memory; save_on_cpu would only copy them.
    if not torch.is_grad_enabled() or device is None or device.type == "cpu":
        return inner(*args, **kwargs)
    with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
        return inner(*args, **kwargs)


def _hidden_of(output: Any) -> Any:
    """The part of a block's output that the next block takes as its hidden state."""
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


# Where a block call carries its hidden state: ("arg", index) or ("kw", name).
_HiddenAt = tuple[str, Any]
_HIDDEN_KEYWORDS = ("hidden_states", "x", "input", "inputs", "hidden")


def _hidden_slot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _HiddenAt | None:
    """Where this call's hidden state is: the first floating-point tensor argument, else a keyword (the usual
    names first), the rule the profile's chain check reads calls by. Blocks called with keyword arguments only
    (``block(hidden_states=h, attention_mask=m)``) get the previous block's output in the same keyword."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    for name in (*_HIDDEN_KEYWORDS, *kwargs):
        v = kwargs.get(name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", name)
    return ("arg", 0) if args else None


def _in_slot(args: tuple[Any, ...], kwargs: dict[str, Any], slot: _HiddenAt) -> Any:
    kind, key = slot
    if kind == "arg":
        return args[key] if key < len(args) else None
    return kwargs.get(key)


def _with_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], slot: _HiddenAt, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kind, key = slot
    if kind == "arg":
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a plain bool are simply "not the same"
        return False


# Random-number state around a segment. Without a plan the parent and the blocks draw from the generators in
# turn (dropout in block k, then LayerDrop's coin for block k+1 in the parent, ...); a segment's first block
# runs the whole chunk at once, so the parent would draw after every block of the chunk had drawn. So after the
# chunk the state goes back to where block 0 left it, each later block's precomputed output is handed out only
# if the state is still where that block started from inside the chunk, and then moved to where it ended.
def _tensor_devices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.device, ...]:
    """The accelerator devices a call's tensors live on (the CPU generator is always tracked)."""
    leaves = tree_leaves((args, kwargs))
    found = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")}
    return tuple(sorted(found, key=str))


def _rng_states(devices: tuple[torch.device, ...]) -> tuple[torch.Tensor, ...]:
    return (torch.get_rng_state(), *(torch.get_device_module(d.type).get_rng_state(d) for d in devices))


def _set_rng_states(devices: tuple[torch.device, ...], states: tuple[torch.Tensor, ...]) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1:], strict=True):
        torch.get_device_module(d.type).set_rng_state(state, d)


class _StackWatch:
    """How one stack's segments fared under one applied plan: the first reason a step left the chain."""

    __slots__ = ("deviations", "reason", "stack_fqn")

    def __init__(self, stack_fqn: str) -> None:
        self.stack_fqn = stack_fqn
        self.reason: str | None = None
        self.deviations = 0


class _Chunk:
    """Run-time state of one segment: several consecutive blocks recomputed as one region.

    The parent model still calls every block itself. The chunk's first block runs the whole chunk
    inside one checkpoint and hands the later blocks their outputs as the parent calls them. A later
    block gets its precomputed output only when it is the next block of the chunk, called with the
    previous block's output (in the same argument or keyword) and the same other arguments, with the
    random-number state where the chunk left it. Anything else (a parent that skips, reorders or repeats
    blocks, exits early, or draws random numbers between blocks: LayerDrop, stochastic depth) ends the
    chunk for that step: the blocks the parent calls from there on run plainly, the buffer updates of the
    blocks it did not call are undone, and one warning names the stack. So every step is exact; only
    the memory of such a step is higher than planned. The step's state is dropped once the chunk is
    handed out (or given up), and never copied or pickled.
    """

    def __init__(self, stack_fqn: str, fqns: tuple[str, ...], modules: list[nn.Module], watch: _StackWatch) -> None:
        self.stack_fqn = stack_fqn
        self.fqns = fqns
        self.modules = modules
        self.guard = _BufferGuard(modules)
        self.watch = watch
        self.recording = False  # True from the head's checkpoint call until its forward starts
        self.clear()

    def clear(self) -> None:
        """Forget this step's run: the outputs still to hand out and everything needed to check the calls."""
        self.next_index: int | None = None  # the block due next, while outputs are waiting for it
        self.outputs: tuple[Any, ...] = ()
        self.slot: _HiddenAt | None = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.devices: tuple[torch.device, ...] = ()
        self.states: list[tuple[torch.Tensor, ...]] | None = None  # RNG state after each block of the chunk
        self.updates: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # buffer updates made by the chunk run

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        step = _Chunk.__new__(_Chunk)
        step.clear()
        state.update(vars(step), recording=False)
        return state

    def run(
        self, slot: _HiddenAt, args: tuple[Any, ...], kwargs: dict[str, Any], after_block: Callable[[], None] | None = None,
    ) -> tuple[Any, ...]:  # fmt: skip
        outputs = []
        for m in self.modules:
            out = _original_forward(m)(*args, **kwargs)
            outputs.append(out)
            if after_block is not None:
                after_block()
            args, kwargs = _with_hidden(args, kwargs, slot, _hidden_of(out))
        return tuple(outputs)

    def run_eager(self, slot: _HiddenAt, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``run`` outside compiled code: the forward records the RNG state after each block; a recompute
        (in backward, so the step's forward is over) gives up on blocks the parent never called."""
        if not self.recording:
            if self.next_index is not None:
                why = f"{self._rest()} never ran in that step (the parent skipped it or exited early)"
                _deviate(self, self.next_index, why)
            return self.run(slot, args, kwargs)
        self.recording = False
        states: list[tuple[torch.Tensor, ...]] = []
        self.states = states
        return self.run(slot, args, kwargs, lambda: states.append(_rng_states(self.devices)))

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
            and _in_slot(args, kwargs, slot) is _hidden_of(self.outputs[index - 1])
            and len(args) == len(self.args)
            and kwargs.keys() == self.kwargs.keys()
            and all(_same(a, b) for i, (a, b) in enumerate(zip(args, self.args, strict=True)) if ("arg", i) != slot)
            and all(_same(kwargs[k], self.kwargs[k]) for k in kwargs if ("kw", k) != slot)
        )
        if not same:
            return (
                f"{fqn!r} was not called with {self.fqns[index - 1]!r}'s output and the same other arguments as "
                f"{self.fqns[0]!r}"
            )
        if self.states is not None and not _rng_equal(_rng_states(self.devices), self.states[index - 1]):
            return f"the parent drew random numbers before calling {fqn!r} (e.g. LayerDrop deciding whether to run it)"
        return None


def _rng_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# A graph break when compiled: only a step that leaves the chain gets here, and the compiled search reports
# a plan that breaks graphs in a checkpointed region as a conflict.
@torch.compiler.disable
def _deviate(chunk: _Chunk, start: int, reason: str) -> None:
    """Give the chunk up for the rest of this step: undo the buffer updates its run made in blocks from
    ``start`` on (the parent runs those itself, or not at all), drop its outputs, and warn once per stack."""
    with torch.no_grad():
        for index, buf, before in chunk.updates:
            if index >= start and buf.shape == before.shape:
                buf.copy_(before)
    chunk.clear()
    watch = chunk.watch
    watch.deviations += 1
    if watch.reason is not None:
        return
    watch.reason = reason
    stack = chunk.stack_fqn
    warnings.warn(
        f"lightning_ckpt: segments[{stack!r}] could not run as planned in this step: {reason}. From there on the "
        "blocks of that chunk ran without checkpointing, so the step is exact but uses more memory than the plan "
        "predicts (shown once per stack). Segments need a parent that calls every block of the stack in order, "
        "each with the previous block's output, and draws no random numbers in between. For a model that skips "
        "blocks (LayerDrop, stochastic depth, early exit), remove this stack from the plan's 'segments' and use "
        "per-block modes (e.g. 'full') instead.",
        stacklevel=4,
    )


def _segment_head_forward(module: nn.Module, chunk: _Chunk, *args: Any, **kwargs: Any) -> Any:
    if chunk.next_index is not None:  # the last step left blocks of the chunk uncalled
        _deviate(chunk, chunk.next_index, f"{chunk._rest()} never ran before {chunk.fqns[0]!r} ran again")
    if not torch.is_grad_enabled():
        return _original_forward(module)(*args, **kwargs)
    slot = _hidden_slot(args, kwargs)
    if slot is None:
        _deviate(chunk, len(chunk.modules), f"{chunk.fqns[0]!r} was called without a hidden state to hand on")
        return _original_forward(module)(*args, **kwargs)
    run_args, run_kwargs = _without_caches(module, args, kwargs)
    if torch.compiler.is_compiling() and chunk.guard.eager_under_compile:
        outputs = _eager_in_compiled(chunk.guard, functools.partial(chunk.run, slot), run_args, run_kwargs)
    elif torch.compiler.is_compiling():
        # Compiled RNG is not eager RNG anyway, and reading generator state breaks graphs: no RNG tracking.
        outputs = checkpoint(chunk.run, slot, run_args, run_kwargs, use_reentrant=False, preserve_rng_state=True)
    else:
        chunk.devices = _tensor_devices(run_args, run_kwargs)
        chunk.recording = True
        updates: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        try:
            outputs = chunk.guard.checkpoint(functools.partial(chunk.run_eager, slot), run_args, run_kwargs, updates)
        finally:
            chunk.recording = False
        states = chunk.states
        chunk.updates = updates
        if states:  # the parent goes on from where block 0 left the generators, as without the plan
            _set_rng_states(chunk.devices, states[0])
    if len(outputs) == 1:
        chunk.clear()
        return outputs[0]
    chunk.outputs, chunk.next_index, chunk.slot = outputs, 1, slot
    chunk.args, chunk.kwargs = args, kwargs
    return outputs[0]


# Functions of this module that run inside a checkpointed region when dynamo traces one: a graph break
# whose user stack passes through one of them broke a graph inside our region (compile.py counts them).
CHECKPOINT_FRAMES = frozenset(
    {
        _checkpointed_forward.__name__, _call.__name__, _segment_head_forward.__name__, _Chunk.run.__name__,
        _Chunk.run_eager.__name__,
    }
)  # fmt: skip


def _segment_member_forward(module: nn.Module, chunk: _Chunk, index: int, *args: Any, **kwargs: Any) -> Any:
    if chunk.next_index is None and not torch.is_grad_enabled():
        return _original_forward(module)(*args, **kwargs)
    why = chunk.off_chain(index, args, kwargs)
    if why is not None:
        _deviate(chunk, chunk.next_index if chunk.next_index is not None else len(chunk.modules), why)
        return _original_forward(module)(*args, **kwargs)
    out = chunk.outputs[index]
    if chunk.states is not None:
        _set_rng_states(chunk.devices, chunk.states[index])
    if index + 1 < len(chunk.modules):
        chunk.next_index = index + 1
    else:
        # Drop every reference once the chunk is handed out, or its hidden states would outlive
        # their backward (and the step).
        chunk.clear()
    return out


_OUR_FORWARDS = (_checkpointed_forward, _offloaded_forward, _segment_head_forward, _segment_member_forward)


def _is_ours(fn: Any) -> bool:
    return isinstance(fn, functools.partial) and fn.func in _OUR_FORWARDS


# ---------------------------------------------------------------------------------------------------
# Applying and removing
# ---------------------------------------------------------------------------------------------------
def segment_chunks(n_blocks: int, segments: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``segments`` near-equal chunks (first chunks get the remainder)."""
    base, extra = divmod(n_blocks, segments)
    ranges, start = [], 0
    for i in range(segments):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


@dataclass
class _Patch:
    module: nn.Module
    forward: functools.partial[Any]


class PlanHandle:
    """What ``apply_plan`` returns: the applied plan and the means to undo it exactly.

    A copy of a planned model (``copy.deepcopy``, pickle, ``torch.save``/``torch.load``) carries the plan
    with a handle of its own, bound to the copy's modules: ``applied_plan(copy)`` finds the plan and
    ``plan_handle(copy).remove()`` restores the copy. The process-wide compile memory budget stays with
    the original's handle.
    """

    def __init__(
        self, model: nn.Module | None, plan: Plan, patches: list[_Patch], previous_budget: float | None = None,
        watches: list[_StackWatch] | tuple[_StackWatch, ...] = (),
    ) -> None:  # fmt: skip
        self.plan = plan
        # None only for a handle pickled without its model (it is then removed already).
        self._model_ref: Callable[[], nn.Module | None] = weakref.ref(model) if model is not None else _no_model
        self._patches = patches
        self._previous_budget = previous_budget  # the compile memory budget to restore (plan sets one)
        self._watches = list(watches)
        self._removed = False

    @property
    def deviations(self) -> dict[str, str]:
        """Stack FQN -> why its segments could not run as planned in some step since the plan was applied
        (the first reason seen). Those steps were exact, with the memory of running the blocks plainly."""
        return {w.stack_fqn: w.reason for w in self._watches if w.reason is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied or pickled as part of its model (the model holds it): the copy's handle points at the copy's
        # modules and forwards (the same memo), and registers itself when rebuilt.
        return (_restore_handle, (self._model_ref(), self.plan, self._patches, self._watches, self._removed))

    @property
    def active(self) -> bool:
        return not self._removed

    @property
    def num_patched_modules(self) -> int:
        return len(self._patches)

    def remove(self) -> None:
        """Restore every module's original forward; idempotent."""
        if self._removed:
            return
        for p in reversed(self._patches):
            d = p.module.__dict__
            if d.get("forward") is p.forward:
                del d["forward"]
            prev = d.pop(_PREV_FORWARD, None)
            if prev is not None:
                d["forward"] = prev
        if self._previous_budget is not None:
            _set_compile_memory_budget(self._previous_budget)
        self._removed = True
        model = self._model_ref()
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        if model is not None and model.__dict__.get(_HANDLE_ATTR) is self:
            del model.__dict__[_HANDLE_ATTR]

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"PlanHandle({self.plan.describe()}, {len(self._patches)} modules, {state})"


def _set_compile_memory_budget(value: float) -> float:
    """Set PT2's activation memory budget (read by the partitioner at compile time); return the old value."""
    import torch._functorch.config as functorch_config

    previous = float(functorch_config.activation_memory_budget)
    functorch_config.activation_memory_budget = value
    return previous


def _no_model() -> None:
    return None


def _restore_handle(
    model: nn.Module | None, plan: Plan, patches: list[_Patch], watches: list[_StackWatch], removed: bool
) -> PlanHandle:
    """A copied or unpickled model's handle (see ``PlanHandle.__reduce__``), registered for that model."""
    handle = PlanHandle(model, plan, patches, None, watches)
    handle._removed = removed or model is None
    if model is not None and not handle._removed:
        _ACTIVE[model] = handle
    return handle


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model`` by ``apply_plan`` (or carried by a copy of a planned model), if any."""
    handle = plan_handle(model)
    return handle.plan if handle is not None else None


def plan_handle(model: nn.Module) -> PlanHandle | None:
    """The active ``PlanHandle`` of ``model``: the one ``apply_plan`` returned, or the one a copy of a planned
    model (deepcopy, pickle, ``torch.save``) carries, so a plan can be removed without holding its handle."""
    handle = _ACTIVE.get(unwrap_compiled(model))
    return handle if handle is not None and handle.active else None


def _installed_by(module: nn.Module) -> str:
    """Which applied plan patched ``module``, for an error message."""
    for root, handle in list(_ACTIVE.items()):
        if handle.active and any(p.module is module for p in handle._patches):
            return f"a plan applied to a {type(root).__name__} ({handle.plan.describe()})"
    return (
        "a plan applied to a model it was copied from (a copy of part of a planned model carries its "
        "checkpointing but no handle: copy the whole model, or copy before applying the plan)"
    )


# ---------------------------------------------------------------------------------------------------
# Checkpointing installed by someone else
# ---------------------------------------------------------------------------------------------------
# A plan on top of another mechanism recomputes twice (and tuning would compare plans against a
# "none" baseline that still recomputes). Attributes that, when True, mean the model checkpoints itself.
_CHECKPOINT_FLAGS = {
    "gradient_checkpointing": "Hugging Face gradient checkpointing (gradient_checkpointing=True)",
    "grad_checkpointing": "timm-style grad_checkpointing=True",
    "use_checkpoint": "the model's own checkpointing (use_checkpoint=True)",
}


def _path(fqn: str) -> str:
    """How a fix names a submodule: ``model`` is the module the plan is applied to."""
    return f"model.{fqn}" if fqn else "model"


def _flag_fix(root: nn.Module, fqn: str, attr: str) -> str:
    """How to switch a checkpointing flag off, naming the object that has the switch."""
    if attr == "gradient_checkpointing":
        # The switch is on the outermost Hugging Face model that holds this module.
        for owner_fqn, owner in root.named_modules():
            if (not owner_fqn or fqn == owner_fqn or fqn.startswith(f"{owner_fqn}.")) and callable(
                getattr(owner, "gradient_checkpointing_disable", None)
            ):
                if callable(getattr(owner, "activation_checkpointing_disable", None)):  # transformers >= 5
                    return (
                        f"call {_path(owner_fqn)}.activation_checkpointing_disable() (gradient_checkpointing_disable() "
                        "in older transformers)"
                    )
                return f"call {_path(owner_fqn)}.gradient_checkpointing_disable()"
    if attr == "grad_checkpointing" and callable(getattr(root.get_submodule(fqn), "set_grad_checkpointing", None)):
        return f"call {_path(fqn)}.set_grad_checkpointing(False)"
    return f"set {_path(fqn)}.{attr} = False (or build the model without it)"


def _torch_checkpointing_probes() -> tuple[type | None, Callable[[nn.Module], bool]]:
    """(torch's CheckpointWrapper class, a test for composable checkpoint); (None, never) without distributed."""
    try:
        from torch.distributed._composable import checkpoint as composable_checkpoint
        from torch.distributed._composable.contract import _get_registry
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # a torch build without distributed
        return None, lambda module: False

    def composable(module: nn.Module) -> bool:
        # Private in torch 2.13: the registry that the composable APIs' contract() keeps per module.
        if "checkpoint" not in (_get_registry(module) or {}):
            return False
        return bool(getattr(composable_checkpoint.state(module), "enable_hook", True))

    return CheckpointWrapper, composable


def _foreign_checkpointing(model: nn.Module) -> list[tuple[str, str, str]]:
    """(FQN, what was found, how to remove it) for every other activation-checkpointing mechanism in ``model``."""
    root = unwrap_compiled(model)
    wrapper_type, composable = _torch_checkpointing_probes()
    found = []
    for fqn, module in root.named_modules():
        for attr, what in _CHECKPOINT_FLAGS.items():
            if getattr(module, attr, None) is True:
                found.append((fqn, what, _flag_fix(root, fqn, attr)))
        if wrapper_type is not None and isinstance(module, wrapper_type):
            found.append((
                fqn, "torch checkpoint_wrapper (CheckpointWrapper)",
                f"put the wrapped module back ({_path(fqn)} = {_path(fqn)}._checkpoint_wrapped_module), or do not use "
                "apply_activation_checkpointing / Lightning's FSDP activation_checkpointing_policy",
            ))  # fmt: skip
        if composable(module):
            found.append((
                fqn, "torch.distributed._composable.checkpoint",
                "do not call checkpoint(module) on it (the hooks cannot be removed: rebuild the module)",
            ))  # fmt: skip
    return found


def existing_checkpointing(model: nn.Module) -> list[str]:
    """Activation checkpointing already installed in ``model`` by something other than lightning_ckpt.

    One ``"FQN: what"`` entry per module (``<root>`` for the model itself): Hugging Face's
    ``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``, a ``use_checkpoint=True``
    flag, torch's ``checkpoint_wrapper`` and ``torch.distributed._composable.checkpoint``. A plan
    on top of any of them would recompute twice, so ``apply_plan`` refuses such a model; the
    callback can call this to explain the refusal before tuning.
    """
    return [f"{fqn or '<root>'}: {what}" for fqn, what, _ in _foreign_checkpointing(model)]


def _refuse_foreign_checkpointing(root: nn.Module, plan: Plan) -> None:
    if not (plan.blocks or plan.segments):  # installs nothing, so there is nothing to do twice
        return
    found = _foreign_checkpointing(root)
    if not found:
        return
    listed = "; ".join(f"{fqn or '<root>'}: {what}" for fqn, what, _ in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    fixes = list(dict.fromkeys(fix for _, _, fix in found))
    raise ApplyError(
        f"This {type(root).__name__} already has activation checkpointing: {listed}{more}. A lightning_ckpt plan on "
        f"top would recompute those blocks twice. Fix: {'; '.join(fixes)}. Then apply the plan (or let the tuner "
        "choose one)."
    )


def _resolve(root: nn.Module, fqn: str, what: str) -> nn.Module:
    try:
        # Unwrapped so a block wrapped by torch.compile(block) gets its forward patched on the module
        # the compiled code calls, inside the compiled region rather than around it.
        return unwrap_compiled(root.get_submodule(fqn)) if fqn else root
    except AttributeError:
        names = [n for n, _ in root.named_modules() if n]
        raise PlanError(
            f"{what} {fqn!r} does not exist in {type(root).__name__}. Closest module names: "
            f"{closest_names(fqn, names)}. Fix the FQN in the plan, or re-tune for this model."
        ) from None


def apply_plan(model: nn.Module, plan: Plan, *, check_fingerprint: bool = True) -> PlanHandle:
    """Apply ``plan`` to ``model`` in place and return a handle whose ``remove()`` undoes it.

    Everything is validated before the first module is touched, so a refused plan leaves the model
    as it was. Apply before ``torch.compile``-ing, or reset dynamo afterwards: a compiled graph
    does not see a changed forward until it recompiles. A plan's ``compile_memory_budget`` sets
    ``torch._functorch.config.activation_memory_budget`` (process-wide) until ``remove()``.
    """
    root = unwrap_compiled(model)
    if applied_plan(root) is not None:
        raise ApplyError(
            f"A plan is already applied to this {type(root).__name__} ({_ACTIVE[root].plan.describe()}). "
            "Call handle.remove() on the handle apply_plan returned (or lightning_ckpt.plan_handle(model).remove(), "
            "e.g. for a copy or a loaded model) before applying another plan."
        )
    if check_fingerprint:
        plan.check_fingerprint(root)
    _refuse_foreign_checkpointing(root, plan)

    installs: list[tuple[nn.Module, str, functools.partial[Any]]] = []
    for fqn, bp in plan.blocks.items():
        block = _resolve(root, fqn, "Block")
        if bp.mode == "full":
            installs.append((block, fqn, functools.partial(_checkpointed_forward, block, None, _BufferGuard([block]))))
        elif bp.mode == "ops":
            installs.append(
                (block, fqn, functools.partial(_checkpointed_forward, block, bp.save_list, _BufferGuard([block])))
            )
        elif bp.mode == "offload":
            installs.append((block, fqn, functools.partial(_offloaded_forward, block)))
        elif bp.mode == "selective":
            for child_name in bp.children:
                try:
                    child = block.get_submodule(child_name)
                except AttributeError:
                    kids = [n for n, _ in block.named_children()]
                    raise PlanError(
                        f"Block {fqn!r} has no child {child_name!r} to checkpoint selectively. Its children are: "
                        f"{', '.join(kids) or '(none)'}. Fix the 'children' list of this block in the plan."
                    ) from None
                guard = _BufferGuard([child])
                installs.append(
                    (child, f"{fqn}.{child_name}", functools.partial(_checkpointed_forward, child, None, guard))
                )

    watches: list[_StackWatch] = []
    for stack_fqn, n_chunks in plan.segments.items():
        stack = _resolve(root, stack_fqn, "Stack")
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
            raise ApplyError(
                f"segments need a stack that runs its blocks in order (nn.Sequential or nn.ModuleList), but "
                f"{stack_fqn!r} is a {type(stack).__name__}, whose forward may call its children in any order. "
                "Use per-block modes for this model instead of segments."
            )
        names = [n for n, _ in stack.named_children()]
        if n_chunks > len(names):
            raise PlanError(
                f"segments[{stack_fqn!r}] = {n_chunks} but that stack has only {len(names)} blocks. "
                f"Use a chunk count between 1 and {len(names)}."
            )
        overlapping = [f for f in plan.blocks if f == stack_fqn or f.startswith(f"{stack_fqn}." if stack_fqn else "")]
        if overlapping:
            raise PlanError(
                f"Stack {stack_fqn!r} has segments and also per-block modes for {overlapping[:3]}; a plan gives a "
                "stack either segments or per-block modes. Remove one of them."
            )
        watches.append(_StackWatch(stack_fqn))
        # The last chunk is not checkpointed (as torch's checkpoint_sequential does): its activations
        # are needed first in backward, so recomputing them would cost time and save no peak memory.
        for start, end in segment_chunks(len(names), n_chunks)[:-1]:
            fqns = tuple(f"{stack_fqn}.{n}" if stack_fqn else n for n in names[start:end])
            modules = [unwrap_compiled(stack.get_submodule(n)) for n in names[start:end]]
            chunk = _Chunk(stack_fqn, fqns, modules, watches[-1])
            installs.append((modules[0], fqns[0], functools.partial(_segment_head_forward, modules[0], chunk)))
            for i, m in enumerate(modules[1:], start=1):
                installs.append((m, fqns[i], functools.partial(_segment_member_forward, m, chunk, i)))

    seen: dict[int, str] = {}
    for module, fqn, _ in installs:
        if id(module) in seen:
            raise PlanError(f"Module {fqn!r} is planned twice (also as {seen[id(module)]!r}). Give it one mode.")
        seen[id(module)] = fqn
        if _is_ours(module.__dict__.get("forward")):
            raise ApplyError(
                f"Module {fqn!r} already has lightning_ckpt checkpointing, installed by {_installed_by(module)}. "
                "Remove that plan first (handle.remove(), or lightning_ckpt.plan_handle(that model).remove())."
            )
    fqns_planned = sorted(seen.values())
    for a, b in zip(fqns_planned, fqns_planned[1:], strict=False):
        if b.startswith(a + "."):
            raise PlanError(
                f"Module {b!r} is planned inside {a!r}, which is planned too; nested checkpointing recomputes twice. "
                "Plan either the block or its children."
            )

    # The partitioner reads the budget when it compiles, so it is set process-wide for as long as the plan
    # is applied (compiles that happen later, e.g. after a recompile, must see it too).
    previous_budget = None
    if plan.compile_memory_budget is not None:
        previous_budget = _set_compile_memory_budget(plan.compile_memory_budget)
    patches: list[_Patch] = []
    for module, _fqn, fwd in installs:
        prev = module.__dict__.get("forward")
        if prev is not None:
            module.__dict__[_PREV_FORWARD] = prev
        module.__dict__["forward"] = fwd
        patches.append(_Patch(module, fwd))
    handle = PlanHandle(root, plan, patches, previous_budget, watches)
    _ACTIVE[root] = handle
    # Held by the model itself so that a copy of it (deepcopy, pickle, torch.save) carries its own handle.
    root.__dict__[_HANDLE_ATTR] = handle
    log.info("lightning_ckpt: applied plan %s (%d modules)", plan.describe(), len(patches))
    return handle


@contextlib.contextmanager
def plan_applied(model: nn.Module, plan: Plan, *, check_fingerprint: bool = True) -> Iterator[PlanHandle]:
    """Context manager form: the plan is removed on exit, even when the body raises."""
    handle = apply_plan(model, plan, check_fingerprint=check_fingerprint)
    try:
        yield handle
    finally:
        handle.remove()
