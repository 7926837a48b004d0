"""How a segment tells that the parent calls the chunk's blocks as a chain (next block, previous output as hidden
state, same other arguments and random state)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = [
    "HiddenAt",
    "StackWatch",
    "hidden_of",
    "hidden_slot",
    "in_slot",
    "rng_equal",
    "rng_states",
    "same_value",
    "set_rng_states",
    "tensor_devices",
    "with_hidden",
]


def hidden_of(output: Any) -> Any:
    """The part of a block's output that the next block takes as its hidden state."""
    return output[0] if isinstance(output, (tuple, list)) and output else output


# Where a block call carries its hidden state: ("arg", index) or ("kw", name).
HiddenAt = tuple[str, Any]
_HIDDEN_KEYWORDS = ("hidden_states", "x", "input", "inputs", "hidden")


def hidden_slot(args: tuple[Any, ...], kwargs: Mapping[str, Any], *, strict: bool = False) -> HiddenAt | None:
    """Where this call's hidden state is: the first floating-point tensor argument, else keyword (the usual names
    first), else the first argument unless ``strict``. One rule for segments and the profile's chain check."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    for name in (*_HIDDEN_KEYWORDS, *kwargs):
        v = kwargs.get(name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", name)
    return ("arg", 0) if args and not strict else None


def in_slot(args: tuple[Any, ...], kwargs: dict[str, Any], slot: HiddenAt) -> Any:
    kind, key = slot
    if kind == "arg":
        return args[key] if key < len(args) else None
    return kwargs.get(key)


def with_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], slot: HiddenAt, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kind, key = slot
    if kind == "arg":
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}


def same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects whose == is not a plain bool are simply "not the same"
        return False


# Random state: a chunk runs its blocks at once, so afterwards the state goes back to where block 0 left it, and a
# later block's output is handed out only if the parent left the state where that block started inside the chunk.
def tensor_devices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.device, ...]:
    """The accelerator devices a call's tensors live on (the CPU generator is always tracked)."""
    leaves = tree_leaves((args, kwargs))
    found = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")}
    return tuple(sorted(found, key=str))


def rng_states(devices: tuple[torch.device, ...]) -> tuple[torch.Tensor, ...]:
    return (torch.get_rng_state(), *(torch.get_device_module(d.type).get_rng_state(d) for d in devices))


def set_rng_states(devices: tuple[torch.device, ...], states: tuple[torch.Tensor, ...]) -> None:
    torch.set_rng_state(states[0])
    for d, state in zip(devices, states[1:], strict=True):
        torch.get_device_module(d.type).set_rng_state(state, d)


def rng_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@dataclass(slots=True, eq=False)
class StackWatch:
    """How one stack's segments fared under one applied plan: the first reason a step left the chain."""

    stack_fqn: str
    reason: str | None = None
