"""Predict a *compiled* step's memory from blocks compiled alone: what the compiled search prunes by. A compiled step's
activation memory is what its graphs save for backward (the partitioner saves less than eager ops). Checkpointing a
block changes the step's saved bytes by what it changes in that block compiled alone, so, anchored on the compiled
``none`` step the search measures anyway:

    activation(plan) = activation(none) - sum over blocks of (saved[none] - saved[mode])
    peak(plan)       = peak(none)       - the same sum

A segment saves its first block's input (that block's ``full`` bytes) and nothing of the later blocks. PT2's
``activation_memory_budget`` is the partitioner's choice across the whole graph: measured, not predicted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.plan.chunks import segment_chunks
from lightning_ckpt.plan.format import Plan, mode_key

__all__ = ["CompiledBlockMemory", "CompiledMemoryModel"]


@dataclass(frozen=True)
class CompiledBlockMemory:
    """One block call: bytes its graph, compiled alone, saved for backward, per mode key (``mode_key``)."""

    fqn: str
    saved_bytes: Mapping[str, int]
    shared_with: str | None = None  # the identical block whose profile this row reuses


@dataclass(frozen=True)
class CompiledMemoryModel:
    """A compiled step's activation and peak bytes under any plan. ``eager``: the eager memory model of the same
    profile, which says whether a plan can run at all. Nothing is predicted before it is ``anchored``."""

    blocks: tuple[CompiledBlockMemory, ...]
    stacks: Mapping[str, tuple[str, ...]]
    eager: Any = None
    none_activation_bytes: int | None = None
    none_peak_bytes: int | None = None
    compile_seconds: float = 0.0
    compiles: int = 0

    def anchored(self, activation_bytes: int | None, peak_bytes: int | None) -> CompiledMemoryModel:
        """This model anchored on the measured compiled ``none`` step."""
        return replace(self, none_activation_bytes=activation_bytes, none_peak_bytes=peak_bytes)

    def saved_delta(self, plan: Plan) -> int | None:
        """Bytes ``plan`` removes from the compiled ``none`` step's saved activations; None where unpredictable."""
        if plan.compile_memory_budget is not None:
            return None
        heads: set[str] = set()
        members: set[str] = set()
        for stack_fqn, n_chunks in plan.segments.items():
            fqns = self.stacks.get(stack_fqn)
            if fqns is None or n_chunks > len(fqns):
                return None
            for start, end in segment_chunks(len(fqns), n_chunks)[:-1]:
                heads.add(fqns[start])
                members.update(fqns[start + 1 : end])
        total = 0
        for row in self.blocks:
            none, bp = row.saved_bytes.get("none"), plan.blocks.get(row.fqn)
            key = "full" if row.fqn in heads else mode_key(bp) if bp is not None else "none"
            saved = 0 if row.fqn in members else _saved(row, key)
            if none is None or saved is None:
                return None
            total += none - saved
        return total

    def predict_activation(self, plan: Plan) -> int | None:
        return _less(self.none_activation_bytes, self.saved_delta(plan))

    def predict_peak(self, plan: Plan) -> int | None:
        return _less(self.none_peak_bytes, self.saved_delta(plan))

    def can_run(self, plan: Plan) -> str | None:
        return None if self.eager is None else self.eager.can_run(replace(plan, compile_memory_budget=None))

    def to_dict(self) -> dict[str, Any]:
        """What the plan file keeps of it (``metadata.memory_breakdown.compiled``): per block, per mode."""
        return {
            "blocks": [{"fqn": b.fqn, "saved_bytes": dict(b.saved_bytes)} for b in self.blocks],
            "none_activation_bytes": self.none_activation_bytes,
            "none_peak_bytes": self.none_peak_bytes,
            "compile_seconds": self.compile_seconds,
            "compiles": self.compiles,
        }


def _less(anchor: int | None, delta: int | None) -> int | None:
    return None if anchor is None or delta is None else max(0, anchor - delta)


def _saved(row: CompiledBlockMemory, key: str) -> int | None:
    """The block's saved bytes under ``key``; a child set compiled only child by child adds its children's savings."""
    saved = row.saved_bytes.get(key)
    if saved is not None:
        return saved
    none = row.saved_bytes.get("none")
    if none is not None and key.startswith("selective:") and "," in key:
        parts = [row.saved_bytes.get(f"selective:{c}") for c in key.partition(":")[2].split(",")]
        if all(p is not None for p in parts):
            return max(0, none - sum(none - p for p in parts if p is not None))
    return None
