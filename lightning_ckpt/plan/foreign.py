"""Activation checkpointing installed by something other than lightning_ckpt, found so a plan is never put on top: it
would recompute twice (and tuning would compare plans against a "none" that still recomputes)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_ckpt.discovery import unwrap_compiled
from lightning_ckpt.errors import ApplyError
from lightning_ckpt.plan.format import Plan

__all__ = ["existing_checkpointing", "refuse_foreign_checkpointing"]

# Attributes that, when True, mean the model checkpoints itself.
_CHECKPOINT_FLAGS = {
    "gradient_checkpointing": "Hugging Face gradient checkpointing (gradient_checkpointing=True)",
    "grad_checkpointing": "timm-style grad_checkpointing=True",
    "use_checkpoint": "the model's own checkpointing (use_checkpoint=True)",
}


def _path(fqn: str) -> str:
    return f"model.{fqn}" if fqn else "model"


def _flag_fix(root: nn.Module, fqn: str, attr: str) -> str:
    if attr == "gradient_checkpointing":  # the switch is on the outermost Hugging Face model holding this module
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
            fix = (
                f"put the wrapped module back ({_path(fqn)} = {_path(fqn)}._checkpoint_wrapped_module), or do not use "
                "apply_activation_checkpointing / Lightning's FSDP activation_checkpointing_policy"
            )
            found.append((fqn, "torch checkpoint_wrapper (CheckpointWrapper)", fix))
        if composable(module):
            fix = "do not call checkpoint(module) on it (the hooks cannot be removed: rebuild the module)"
            found.append((fqn, "torch.distributed._composable.checkpoint", fix))
    return found


def existing_checkpointing(model: nn.Module) -> list[str]:
    """Activation checkpointing already installed in ``model`` by something other than lightning_ckpt (Hugging Face,
    timm, ``use_checkpoint=True``, torch's wrappers), one ``"FQN: what"`` per module (``<root>`` for the model)."""
    return [f"{fqn or '<root>'}: {what}" for fqn, what, _ in _foreign_checkpointing(model)]


def refuse_foreign_checkpointing(root: nn.Module, plan: Plan) -> None:
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
