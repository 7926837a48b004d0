"""``ModelView``: the model as every stage sees it, resolved once where it enters the package: computing its facts in
each stage is slow (the fingerprint hashes every parameter) and lets stages disagree."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Every module that works on a model imports this one: the version check runs before any touches torch internals.
from lightning_ckpt import versions  # noqa: F401
from lightning_ckpt.discovery import canonical_fqn, discover_blocks, is_compile_wrapper, unwrap_compiled
from lightning_ckpt.stacks import LayerStack

__all__ = ["ModelView", "compiled_regions", "is_sharded", "model_device", "model_fingerprint"]


@dataclass(frozen=True)
class ModelView:
    """One model, resolved once.

    model: what the step function calls (possibly ``torch.compile``'s wrapper). root: the module plans are
    applied to (FQNs are the same compiled or not). stacks: its layer stacks (``discover_blocks``).
    fingerprint: ``model_fingerprint(root)``. device: where its parameters live. compiled: the parts that run
    under ``torch.compile`` (``compiled_regions``; ``""`` is all of it). sharded: FSDP2 (``fully_shard``).
    """

    model: nn.Module
    root: nn.Module
    stacks: tuple[LayerStack, ...]
    fingerprint: str
    device: torch.device
    compiled: tuple[str, ...] = ()
    sharded: bool = False

    @classmethod
    def of(cls, model: nn.Module | ModelView, block_types: Any = None) -> ModelView:
        """The view of ``model`` (a view is returned as it is)."""
        if isinstance(model, ModelView):
            return model
        root = unwrap_compiled(model)
        stacks = tuple(discover_blocks(root, block_types=block_types))
        sharded = any(is_sharded(m) for m in root.modules())
        return cls(model, root, stacks, model_fingerprint(root), model_device(root), compiled_regions(model), sharded)


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the module tree (FQN, class) and parameter/buffer names, shapes and dtypes; not devices (a plan tuned
    on one GPU applies on another), and through compile wrappers (compiled and eager models share it)."""
    root = unwrap_compiled(model)
    h = hashlib.sha256()
    for fqn, mod in root.named_modules():
        if not is_compile_wrapper(mod):  # a nested torch.compile(submodule) adds a wrapper and "_orig_mod"
            h.update(f"M {canonical_fqn(fqn)} {_class_name(mod)}\n".encode())
    for fqn, p in root.named_parameters():
        h.update(f"P {canonical_fqn(fqn)} {tuple(p.shape)} {p.dtype}\n".encode())
    for fqn, b in root.named_buffers():
        h.update(f"B {canonical_fqn(fqn)} {tuple(b.shape)} {b.dtype}\n".encode())
    return h.hexdigest()[:16]


def compiled_regions(model: nn.Module) -> tuple[str, ...]:
    """Canonical FQNs of the parts of ``model`` that run under ``torch.compile`` (``""``: all of it): a wrapper (also as
    Lightning unwraps it: ``_compiler_ctx``), compiled submodules, in-place ``module.compile()``. A compiled step
    function cannot be seen from the model: pass ``compiled=True`` to ``tune`` for that."""
    regions: list[str] = []
    root = unwrap_compiled(model)
    if root is not model or getattr(root, "_compiler_ctx", None):
        regions.append("")
    for fqn, module in root.named_modules():
        if is_compile_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None:
            regions.append(canonical_fqn(fqn))
    return tuple(dict.fromkeys(regions))


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) sharded ``module``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return isinstance(module, FSDPModule)


def _class_name(module: nn.Module) -> str:
    """The module's class name, seen through FSDP2: ``fully_shard`` swaps a module's class for a generated
    ``FSDP<Name>`` subclass, which must not make a plan tuned before sharding stale after it."""
    cls = type(module)
    if is_sharded(module):
        from torch.distributed.fsdp import FSDPModule

        for base in cls.__mro__[1:]:
            if issubclass(base, nn.Module) and not issubclass(base, FSDPModule):
                return base.__name__
    return cls.__name__
