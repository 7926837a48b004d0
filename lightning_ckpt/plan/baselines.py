"""The named reference plans every search starts from, and every benchmark compares against."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torch import nn

from lightning_ckpt.discovery import discover_blocks, unwrap_compiled
from lightning_ckpt.model import model_fingerprint
from lightning_ckpt.plan.chunks import sqrt_segments
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.plan.skipping import skipping_stacks
from lightning_ckpt.stacks import LayerStack

if TYPE_CHECKING:  # memory_model imports the plan machinery; baselines must stay importable without it
    from lightning_ckpt.memory.model import MemoryModel

__all__ = ["BASELINE_NAMES", "baselines", "uniform_plan"]

BASELINE_NAMES = ("none", "full", "sqrt_segments", "selective_mlp", "ops_save_matmuls", "offload")
"""The fixed recipes every search measures beside its own plans: nothing checkpointed, every block, sqrt(N) segments,
each block's MLP, torchtitan-style op-level saving of matmuls, and every block's activations offloaded to the CPU.
The fastest that fits the budget is the reference a tuned plan must beat."""


def uniform_plan(
    stacks: Sequence[LayerStack], block_plan: BlockPlan, *, name: str = "", fingerprint: str | None = None
) -> Plan:
    """The same mode on every block of every stack."""
    return Plan({b.fqn: block_plan for s in stacks for b in s.blocks}, name=name, fingerprint=fingerprint)


def baselines(
    model: nn.Module,
    *,
    stacks: Sequence[LayerStack] | None = None,
    block_types: Iterable[type | str] | None = None,
    memory_model: MemoryModel | None = None,
) -> dict[str, Plan]:
    """Named baseline plans for ``model``: none, full, sqrt_segments, selective_mlp, ops_save_matmuls, offload.

    A baseline that does not make sense for the model is left out rather than faked (``sqrt_segments`` without a
    stack segments can run on, ``selective_mlp`` without a feed-forward child), and with ``memory_model`` so are
    plans its profile shows cannot run.
    """
    root = unwrap_compiled(model)
    stacks = list(stacks) if stacks is not None else discover_blocks(root, block_types=block_types)
    fp = model_fingerprint(root)
    out = {
        "none": Plan(name="none", fingerprint=fp),
        "full": uniform_plan(stacks, BlockPlan("full"), name="full", fingerprint=fp),
    }
    skipping = skipping_stacks(root, stacks)  # LayerDrop: the parent skips blocks, so segments cannot run
    segments = sqrt_segments(stacks, skipping=skipping)
    if segments:
        out["sqrt_segments"] = Plan(segments=segments, name="sqrt_segments", fingerprint=fp)
    mlp = {
        b.fqn: BlockPlan("selective", b.children_of_kind("mlp"))
        for s in stacks
        for b in s.blocks
        if b.children_of_kind("mlp")
    }
    if mlp:
        out["selective_mlp"] = Plan(mlp, name="selective_mlp", fingerprint=fp)
    out["ops_save_matmuls"] = uniform_plan(
        stacks, BlockPlan("ops", save_list="save_matmuls"), name="ops_save_matmuls", fingerprint=fp
    )
    out["offload"] = uniform_plan(stacks, BlockPlan("offload"), name="offload", fingerprint=fp)
    if memory_model is not None:
        out = {name: plan for name, plan in out.items() if memory_model.can_run(plan) is None}
        out = _without_inert_blocks(out, memory_model, stacks)
    return out


def _without_inert_blocks(
    plans: dict[str, Plan], memory_model: MemoryModel, stacks: Sequence[LayerStack]
) -> dict[str, Plan]:
    """``plans`` with no mode on a block no gradient flows through (it saves nothing for backward, so checkpointing
    it only adds recompute); a baseline left doing nothing is dropped (``none`` stays)."""
    inert = set(getattr(memory_model, "inert_blocks", ()))
    if not inert:
        return plans
    alive = {s.fqn for s in stacks if any(b.fqn not in inert for b in s.blocks)}
    out = {}
    for name, plan in plans.items():
        blocks = {fqn: bp for fqn, bp in plan.blocks.items() if fqn not in inert}
        segments = {fqn: n for fqn, n in plan.segments.items() if fqn in alive}
        if name == "none" or blocks or segments:
            out[name] = dataclasses.replace(plan, blocks=blocks, segments=segments)
    return out
