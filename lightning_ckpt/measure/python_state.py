"""The plain Python attributes of a model's modules: captured before a search, put back after every step, so a step
counter driving a curriculum is not advanced by the trials. Restored: plain values (in place for a mutated list, dict or
set), any attribute rebound, added or deleted, and the plain attributes of an object a module holds, one level deep. Not
restorable: a tensor attribute (not a registered buffer) modified in place (named in a warning), deeper mutations."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ckpt.plan.buffer_guard import version_counter
from lightning_ckpt.plan.handle import plan_attributes

__all__ = ["PythonState"]

_ATOMS = (bool, int, float, complex, str, bytes, type(None))
# nn.Module's internals (restored elsewhere or never changed by a step; ``training`` is kept), the forwards and plan
# handle that plans install, and the compiled call a compiled search gives each block (``search.assembly``).
_SKIP = frozenset(set(nn.Module().__dict__) - {"training"}) | plan_attributes() | {"_compiled_call_impl"}
# Objects of these libraries are machinery, not user state: a LightningModule holds its Trainer, whose flags
# (a SIGTERM received during the search, say) must never be rolled back.
_MACHINERY = ("lightning", "pytorch_lightning", "torch", "torchmetrics", "optuna", "lightning_ckpt")
_MISSING = object()


def _is_plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _ATOMS):
        return True
    if depth > 6:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def _holder_fields(value: Any) -> dict[str, Any] | None:
    """The plain attributes of a user object held by a module (not a module, tensor or container)."""
    if isinstance(value, (nn.Module, torch.Tensor, type, dict, list, tuple, set, frozenset)) or callable(value):
        return None
    if type(value).__module__.split(".")[0] in _MACHINERY:
        return None
    fields = getattr(value, "__dict__", None)
    if not isinstance(fields, dict):
        return None
    return {k: copy.deepcopy(v) for k, v in fields.items() if _is_plain(v)}


@dataclass
class _Entry:
    owner: Any  # the module (or held object) whose __dict__ holds the attribute
    name: str  # the attribute's qualified name, for messages
    key: str
    original: Any  # the reference held at capture
    plain_copy: Any = _MISSING  # a deep copy, for plain values
    version: int | None = None  # a tensor attribute's version counter at capture
    holder: dict[str, Any] | None = None  # a held object's plain fields at capture


def _restore_plain(owner_dict: dict[str, Any], key: str, original: Any, saved: Any) -> None:
    now = owner_dict.get(key, _MISSING)
    if now is original and now == saved and type(now) is type(saved):
        return
    if now is original and isinstance(now, list):
        now[:] = copy.deepcopy(saved)
    elif now is original and isinstance(now, (dict, set)):
        now.clear()
        now.update(copy.deepcopy(saved))
    else:
        owner_dict[key] = original if original == saved and type(original) is type(saved) else copy.deepcopy(saved)


class PythonState:
    """Captures the Python attributes of every module of a model; ``restore()`` puts them back."""

    def __init__(self, entries: list[_Entry], keys: list[tuple[nn.Module, set[str]]]) -> None:
        self._entries = entries
        self._keys = keys  # (module, its attribute names at capture)
        self.unrestorable: set[str] = set()  # attributes changed in a way that cannot be undone

    @classmethod
    def capture(cls, model: nn.Module) -> PythonState:
        entries: list[_Entry] = []
        keys: list[tuple[nn.Module, set[str]]] = []
        for fqn, module in model.named_modules(remove_duplicate=True):
            prefix = f"{fqn}." if fqn else ""
            d = module.__dict__
            keys.append((module, set(d)))
            for key, value in d.items():
                if key in _SKIP:
                    continue
                entry = _Entry(module, prefix + key, key, value)
                if _is_plain(value):
                    entry.plain_copy = copy.deepcopy(value)
                elif isinstance(value, torch.Tensor):
                    entry.version = version_counter(value)
                else:
                    entry.holder = _holder_fields(value)
                entries.append(entry)
        return cls(entries, keys)

    def restore(self) -> None:
        """Put every captured attribute back and remove the ones added since the capture."""
        for e in self._entries:
            d = e.owner.__dict__
            if e.plain_copy is not _MISSING:
                _restore_plain(d, e.key, e.original, e.plain_copy)
                continue
            d[e.key] = e.original
            if e.version is not None and version_counter(e.original) != e.version:
                self.unrestorable.add(e.name)
                e.version = version_counter(e.original)  # named once
            if e.holder:
                fields = e.original.__dict__
                for k, saved in e.holder.items():
                    _restore_plain(fields, k, fields.get(k, _MISSING), saved)
        for module, names in self._keys:
            for key in [k for k in module.__dict__ if k not in names and k not in _SKIP]:
                del module.__dict__[key]

    def restoring(self, step_fn: Callable[[], Any]) -> Callable[[], Any]:
        """``step_fn`` followed by ``restore()``: every call starts from the captured attributes."""

        def step() -> Any:
            try:
                return step_fn()
            finally:
                self.restore()

        return step

    def warn_unrestorable(self) -> None:
        if not self.unrestorable:
            return
        names = ", ".join(sorted(self.unrestorable))
        warnings.warn(
            f"lightning_ckpt: the search's steps modified tensor attribute(s) {names} in place, which are not "
            "registered buffers, so they could not be restored: the first real step sees them changed. Register "
            "them with register_buffer(..., persistent=False) to have them restored like every buffer.",
            stacklevel=3,
        )
