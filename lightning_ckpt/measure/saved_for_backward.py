"""What a step saves for backward, counted by storage: the activation memory of a *compiled* step. Under the live-tensor
tracker's dispatch mode dynamo runs compiled frames eagerly; ``saved_tensors_hooks`` see what compiled graphs save.
Compiled trials and the guard's real compiled steps both count this way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["SavedForBackward"]


class SavedForBackward:
    """Counts the distinct storages a step saves for backward, other than the model's state (a context manager).
    ``resting_bytes`` is the state's size when entered, ``extra`` (the batch) included. Entering it changes no
    dynamo guard (no recompile; checked with torch 2.13)."""

    def __init__(self, root: nn.Module, optimizers: Sequence[Any] = (), extra: Sequence[Any] = ()) -> None:
        self._root, self._optimizers, self._extra = root, tuple(o for o in optimizers if o is not None), extra
        self._state: dict[int, int] = {}
        self._saved: dict[int, int] = {}
        self._hooks: Any = None

    @property
    def saved_bytes(self) -> int:
        return sum(self._saved.values())

    @property
    def resting_bytes(self) -> int:
        return sum(self._state.values())

    def __enter__(self) -> SavedForBackward:
        tensors = _state_tensors(self._root, self._optimizers, self._extra)
        state = self._state = dict(key for t in tensors if (key := _storage_key(t)) is not None)
        saved = self._saved = {}

        # Called for tensors saved by eager ops too, inside frames dynamo compiles: without disable() dynamo would
        # trace the hook, graph-break on untyped_storage() and recompile it per dtype until the recompile limit.
        @torch.compiler.disable
        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if key is not None and key[0] not in state:
                saved[key[0]] = max(saved.get(key[0], 0), key[1])
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _identity)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)


@torch.compiler.disable
def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
        return None
    ptr = st.data_ptr()
    return (ptr, st.nbytes()) if ptr else None


def _state_tensors(root: nn.Module, optimizers: Sequence[Any], extra: Sequence[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = [*root.parameters(), *root.buffers()]
    tensors += [p.grad for p in root.parameters() if p.grad is not None]
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [t for t in extra if isinstance(t, torch.Tensor)]
    return tensors
