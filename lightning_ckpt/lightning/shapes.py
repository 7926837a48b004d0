"""How big a batch is, and how a plan's memory grows with it: what lets the guard act *before* a larger batch's
forward instead of reading it after (on a GPU, after is an out-of-memory error and a dead fit).

A batch's size is ``(rows, length)``: samples and tokens per sample for token batches (``trials.batch_dims``), and for
any other structure the largest tensor's elements per row, so an image batch, a dict of features or a packed batch
all have one. A packed batch (sequences concatenated, boundaries in ``cu_seqlens``) says nothing by its shape about
the sequences it holds: the user's ``shape_key`` says it (``lambda b: (1, int(b["cu_seqlens"][-1]))``).

A plan's activations at another size are predicted from a reference (a trial at the tuned batch, or a real step
read under that plan) as ``rows`` scale them linearly and ``length`` by a power ``p`` between 1 (linear layers,
fused attention) and 2 (attention that materialises its T x T scores). Until a real step has been read at a
second length, ``p`` is 2: the guard assumes the worst and may move to a lower-memory plan a step early, never a
step late. Each read step at a new length refits ``p`` (the median over readings of ``log(ratio) / log(length
ratio)``), so the next prediction is the measured growth.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.trials import batch_dims, batch_tensors

__all__ = ["BatchSize", "ShapeScaling", "batch_size_of"]

# The power of the length that activations grow with before any reading says otherwise (see the docstring).
WORST_CASE_POWER = 2.0


@dataclass(frozen=True, order=True)
class BatchSize:
    """Samples and length per sample of one batch (``length`` 1 for batches without one)."""

    rows: int
    length: int

    def exceeds(self, other: BatchSize) -> bool:
        """More rows or a longer length than ``other``: a batch whose memory no reading has covered."""
        return self.rows > other.rows or self.length > other.length

    def covering(self, other: BatchSize) -> BatchSize:
        return BatchSize(max(self.rows, other.rows), max(self.length, other.length))

    def __str__(self) -> str:
        return f"{self.rows} x {self.length}"


def batch_size_of(batch: Any, shape_key: Callable[[Any], Any] | None = None) -> BatchSize | None:
    """``batch``'s size (see the module docstring); None for a batch without tensors. ``shape_key`` (the user's)
    returns ``(rows, length)`` or a length (one row)."""
    if shape_key is not None:
        value = shape_key(batch)
        pair = value if isinstance(value, (tuple, list)) else (1, value)
        try:
            rows, length = (int(v) for v in pair)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"guard shape_key must return (rows, length) or a length as integers, e.g. "
                f"lambda b: (1, int(b['cu_seqlens'][-1])), but it returned {value!r}."
            ) from None
        return BatchSize(max(rows, 1), max(length, 1))
    rows, length = batch_dims(batch)
    if rows is None:
        return None
    if length is None:  # images, features, packed tokens: the largest tensor's elements per row
        largest = max((t.numel() for t in batch_tensors(batch)), default=0)
        length = max(1, largest // max(rows, 1))
    return BatchSize(max(rows, 1), max(length, 1))


@dataclass
class ShapeScaling:
    """Predicts activation bytes at one size from a reference at another, and learns how they grow with length from
    real steps (see the module docstring)."""

    powers: list[float] = field(default_factory=list)  # one per reading at a length other than its reference's

    @property
    def power(self) -> float:
        if not self.powers:
            return WORST_CASE_POWER
        return min(WORST_CASE_POWER, max(1.0, statistics.median(self.powers)))

    @property
    def learned(self) -> bool:
        return bool(self.powers)

    def scale(self, at: BatchSize, reference: BatchSize) -> float:
        """How many times the reference's activations a batch of size ``at`` is predicted to need."""
        return (at.rows / reference.rows) * (at.length / reference.length) ** self.power

    def observe(self, activation: int, at: BatchSize, reference_activation: int, reference: BatchSize) -> None:
        """A real step read at ``at`` used ``activation``; the same plan used ``reference_activation`` at
        ``reference``. Readings at the reference's length say nothing of the power and are left out."""
        if at.length == reference.length or activation <= 0 or reference_activation <= 0:
            return
        per_row = (activation / at.rows) / (reference_activation / reference.rows)
        self.powers.append(math.log(per_row) / math.log(at.length / reference.length))
