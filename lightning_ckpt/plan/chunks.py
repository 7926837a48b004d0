"""How a stack is cut into segments, and the sqrt(N) rule for how many: plain arithmetic, usable without torch."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from lightning_ckpt.errors import PlanError
from lightning_ckpt.stacks import LayerStack

__all__ = ["refuse_segment_misfit", "segment_chunks", "sqrt_chunks", "sqrt_segments"]


def segment_chunks(n_blocks: int, segments: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``segments`` near-equal chunks (first chunks get the remainder)."""
    base, extra = divmod(n_blocks, segments)
    ends = [(i + 1) * base + min(i + 1, extra) for i in range(segments)]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def refuse_segment_misfit(stack_fqn: str, n_chunks: int, n_blocks: int, overlapping: Sequence[str]) -> None:
    """Refuse more chunks than the stack has blocks, or a stack that also has per-block modes (``overlapping``)."""
    if n_chunks > n_blocks:
        raise PlanError(
            f"segments[{stack_fqn!r}] = {n_chunks} but that stack has only {n_blocks} blocks. "
            f"Use a chunk count between 1 and {n_blocks}."
        )
    if overlapping:
        raise PlanError(
            f"Stack {stack_fqn!r} has segments and also per-block modes for {list(overlapping)[:3]}; a plan gives a "
            "stack either segments or per-block modes. Remove one of them."
        )


def sqrt_chunks(n_blocks: int) -> int:
    """The sqrt(N) rule's chunk count for a stack of ``n_blocks`` blocks (Chen et al., 2016: stored chunk inputs
    plus one chunk's activations are smallest near sqrt(N) chunks)."""
    return max(1, round(math.sqrt(n_blocks)))


def sqrt_segments(stacks: Sequence[LayerStack], *, skipping: Collection[str] = ()) -> dict[str, int]:
    """The ``sqrt_segments`` baseline: stack FQN -> ``sqrt_chunks`` for every ``ModuleList``/``Sequential`` of 2+
    blocks not ``skipping``; empty if it repeats another."""
    segments = {
        s.fqn: sqrt_chunks(len(s.blocks))
        for s in stacks
        if s.container_class in ("ModuleList", "Sequential") and len(s.blocks) >= 2 and s.fqn not in skipping
    }
    # The last chunk is never checkpointed, so only a chunk of two or more blocks differs from "none" or "full".
    sizes = {s.fqn: len(s.blocks) for s in stacks}
    return {} if not any(1 < n < sizes[fqn] for fqn, n in segments.items()) else segments
