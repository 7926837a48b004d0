"""Op-level save-lists: which aten ops' outputs an ``ops`` plan keeps. Policies return ``MUST_SAVE`` or
``PREFER_RECOMPUTE`` only, what ``torch.compile`` honours, so a plan means the same thing eager or compiled."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_ckpt import versions  # noqa: F401  (before the selective-checkpoint internals: see model.py)
from lightning_ckpt.plan.save_list_names import check_save_list_name

__all__ = ["SaveList", "SAVE_LISTS", "selective_context_fn"]

aten = torch.ops.aten


def _optional_ops(*names: str) -> tuple[Any, ...]:
    """Ops that exist only in some builds (flash/cudnn attention)."""
    found = (getattr(getattr(aten, name, None), "default", None) for name in names)
    return tuple(op for op in found if op is not None)


_MATMULS = _optional_ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear")
_ATTENTION = _optional_ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
# Reductions whose outputs are tiny but whose recompute would need a full pass over the input.
_REDUCTIONS = _optional_ops("max", "amax", "mean", "sum")


# torchtitan alternates aten.mm only (no biases); biased linears on 3-D inputs dispatch to addmm: both alternate.
_ALTERNATED = frozenset(_optional_ops("mm", "addmm"))


@dataclass(frozen=True)
class SaveList:
    """A named op-level policy; ``alternate_mm`` keeps every other matmul (torchtitan's recipe)."""

    name: str
    description: str
    ops: frozenset[Any]
    alternate_mm: bool = False


SAVE_LISTS: dict[str, SaveList] = {
    s.name: s
    for s in (
        SaveList(
            "save_matmuls",
            "keep matmul and attention outputs, recompute pointwise ops and norms",
            frozenset(_MATMULS + _ATTENTION + _REDUCTIONS),
        ),
        SaveList(
            "save_matmuls_alternate",
            "torchtitan's op SAC: keep matmul/attention outputs except every second matmul (mm/addmm)",
            frozenset(_MATMULS + _ATTENTION + _REDUCTIONS),
            alternate_mm=True,
        ),
        SaveList(
            "save_attention",
            "keep only attention outputs (the O(T^2) part), recompute matmuls and pointwise ops",
            frozenset(_ATTENTION),
        ),
    )
}
"""The op save-lists a plan's mode ``ops`` names (``BlockPlan("ops", save_list="save_matmuls")``), by name: what each
keeps from the forward; every other op's output is recomputed in backward."""


def _policy(save_list: SaveList, meta: dict[str, int], ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    if save_list.alternate_mm and func in _ALTERNATED:
        # Count forward and recompute separately so both passes make identical decisions.
        key = "recompute_mm" if ctx.is_recompute else "forward_mm"
        meta[key] = meta.get(key, 0) + 1
        if meta[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in save_list.ops else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts(name: str) -> tuple[Any, Any]:
    # Fresh counters per checkpoint call: each region decides for itself, forward and recompute alike.
    return create_selective_checkpoint_contexts(functools.partial(_policy, SAVE_LISTS[name], {}))


def selective_context_fn(name: str) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint`` implementing save-list ``name``: a partial of a module-level function, as
    dynamo accepts no closure, of the name, as dynamo guards on a partial's arguments as constants."""
    check_save_list_name(name)  # refuse unknown names here, not at the first backward
    return functools.partial(_selective_contexts, name)
