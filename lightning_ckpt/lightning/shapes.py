"""How big a batch is, and how a plan's memory grows with it: what lets the guard act *before* a larger batch's
forward instead of reading it after (on a GPU, after is an out-of-memory error and a dead fit).

A batch's size is ``(rows, length)``: samples and tokens per sample for token batches (``trials.batch_dims``), and for
any other structure the largest tensor's elements per row, so an image batch, a dict of features or a packed batch
all have one. A packed batch (sequences concatenated, boundaries in ``cu_seqlens``) says nothing by its shape about
the sequences it holds: the user's ``shape_key`` says it (``lambda b: (1, int(b["cu_seqlens"][-1]))``).

A plan's activations at another size are predicted from a reference (a trial at the tuned batch, or a real step
read under that plan): rows scale them linearly; length as ``a * x + (1 - a) * x**2`` of the reference's, ``x``
the length ratio, the form a transformer's activations have (linear layers and fused attention grow with T,
attention that materialises its T x T scores with T**2). Until a real step of that plan has been read at a second
length, ``a`` is 0 (all quadratic): the guard assumes the worst and may move to a lower-memory plan a step early,
never a step late. A reading at another length solves for ``a`` (the smallest over readings is kept, the more
quadratic one), which then extrapolates exactly for that form where a fitted power would not: the power between
two short lengths is lower than between a short and a long one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.trials import batch_dims, batch_tensors

__all__ = [
    "BatchSize",
    "ShapeScaling",
    "batch_at_length",
    "batch_size_of",
    "grown_to",
    "mark_length_dynamic",
    "resized_to",
]


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

    @classmethod
    def declared(cls, value: Any) -> BatchSize | None:
        """The user's ``max_shape``: ``(rows, length)``, a length, or None (not declared)."""
        if value is None:
            return None
        pair = tuple(value) if isinstance(value, (tuple, list)) else (None, value)
        ok = len(pair) == 2 and all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in pair
        )
        if not ok or pair[1] is None:
            raise ConfigurationError(
                f"max_shape must be the longest batch the run will see, as (rows, length) or a length (tokens per "
                f"sample), e.g. max_shape=(8, 1024) or max_shape=1024, but got {value!r}."
            )
        return cls(pair[0] or 0, pair[1])


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
    """Predicts a plan's activation bytes at one size from a reference at another, and learns per plan how they
    grow with length from real steps (see the module docstring)."""

    linear_shares: dict[str, list[float]] = field(default_factory=dict)  # plan key -> ``a`` of each reading

    def linear_share(self, plan_key: str) -> float:
        """``a``: the part of the plan's activations that grows linearly with length (0 until a reading says)."""
        shares = self.linear_shares.get(plan_key)
        return min(shares) if shares else 0.0

    def learned(self, plan_key: str) -> bool:
        return bool(self.linear_shares.get(plan_key))

    def scale(self, plan_key: str, at: BatchSize, reference: BatchSize) -> float:
        """How many times the reference's activations plan ``plan_key`` is predicted to need at size ``at``."""
        x = at.length / reference.length
        a = self.linear_share(plan_key)
        return (at.rows / reference.rows) * (a * x + (1.0 - a) * x * x)

    def observe(
        self, plan_key: str, activation: int, at: BatchSize, reference_activation: int, reference: BatchSize
    ) -> None:
        """A real step under plan ``plan_key`` read at ``at`` used ``activation``; the same plan used
        ``reference_activation`` at ``reference``. Readings at the reference's length say nothing of the growth
        with length and are left out."""
        if at.length == reference.length or activation <= 0 or reference_activation <= 0:
            return
        x = at.length / reference.length
        per_row = (activation / at.rows) / (reference_activation / reference.rows)
        a = (x * x - per_row) / (x * x - x)  # a * x + (1 - a) * x**2 = per_row
        self.linear_shares.setdefault(plan_key, []).append(min(1.0, max(0.0, a)))


def grown_to(batch: Any, target: BatchSize) -> Any:
    """``batch`` grown to ``target`` (``rows`` 0: keep the batch's own) by repeating its rows and positions: every
    tensor dimension that has the batch's row count (the first) or its length (any later one: ``(B, T)`` ids and
    labels, ``(B, 1, T, T)`` masks) is tiled to the target and cut there. The tokens repeat; the memory and time a
    step takes are those of a batch that size, which is what the search measures. A batch already at least that
    large in a dimension keeps it. Batches whose shape does not carry the length (packed) cannot be grown: the
    caller passes such a batch at its largest itself."""
    rows, length = _token_dims(batch, "max_shape needs")
    return resized_to(batch, BatchSize(max(target.rows, rows), max(target.length, length)))


def resized_to(batch: Any, target: BatchSize) -> Any:
    """``batch`` at exactly ``target`` (``rows`` 0: its own rows): rows and positions repeated to grow it, the first
    ones kept to shrink it (as ``grown_to``). What a plan table's buckets are profiled on: the first batch at each
    bucket's longest length."""
    rows, length = _token_dims(batch, "a plan table needs")
    to_rows, to_length = target.rows or rows, target.length
    if (to_rows, to_length) == (rows, length):
        return batch

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != rows:
            return t
        t = t[torch.arange(to_rows, device=t.device) % rows]
        for dim in range(1, t.dim()):
            if t.shape[dim] == length:
                t = t.index_select(dim, torch.arange(to_length, device=t.device) % length)
        return t

    resized = tree_map(resize, batch)
    if batch_dims(resized) != (to_rows, to_length):
        raise ConfigurationError(
            f"This batch ({type(batch).__name__}, first tensor {_shapes(batch)}) could not be resized to "
            f"{to_rows} x {to_length}: its structure is not one torch's pytree walks. Pass the batch as a dict, "
            "tuple or list of tensors, or tune on the largest batch."
        )
    return resized


def batch_at_length(
    batch: Any,
    length: int,
    *,
    rows: int = 0,
    resize: Callable[[Any, int], Any] | None = None,
    shape_key: Callable[[Any], Any] | None = None,
) -> Any:
    """``batch`` at ``length``: by the user's ``resize`` (guard ``resize``, for batches sized by ``shape_key``, whose
    result is checked with it), else as ``resized_to`` (``rows`` 0: the batch's own)."""
    if resize is None:
        return resized_to(batch, BatchSize(rows, length))
    out = resize(batch, length)
    size = batch_size_of(out, shape_key)
    if size is None or size.length != length:
        found = "no tensors" if size is None else f"length {size.length}"
        raise ConfigurationError(
            f"guard resize(batch, {length}) returned a batch of {found}"
            f"{' by guard shape_key' if shape_key is not None else ''}, not {length}. It must return the batch at "
            "exactly that length, e.g. a packed batch's first `length` tokens with cu_seqlens clipped to them."
        )
    return out


def mark_length_dynamic(batch: Any, length: int) -> int:
    """Mark every dimension ``length`` long of the batch's tensors, but the first (the rows), dynamic for dynamo
    (``maybe_mark_dynamic``: a model that needs the length static keeps it static, without an error). The graph a
    compiled plan gets at its bucket's first batch then serves every length of the bucket; otherwise it would be
    compiled for that one length, and dynamo's automatic dynamic shapes would compile it again at the second. The
    number of dimensions marked."""
    if length < 2:  # dynamo specialises sizes 0 and 1 whatever is marked
        return 0
    marked = 0
    for tensor in batch_tensors(batch):
        for dim in range(1, tensor.dim()):
            if tensor.shape[dim] == length:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
                marked += 1
    return marked


def _token_dims(batch: Any, needs: str) -> tuple[int, int]:
    rows, length = batch_dims(batch)
    if rows is None or length is None:
        raise ConfigurationError(
            f"{needs} token batches, whose tensors are (samples, length) like input_ids, to resize the first "
            f"batch to other lengths; this batch's first tensor is {_shapes(batch)}. Tune on the largest batch "
            "instead (the first batch the loader yields is what the search measures)."
        )
    return rows, length


def _shapes(batch: Any) -> str:
    tensors = batch_tensors(batch)
    return f"of shape {tuple(tensors[0].shape)}" if tensors else "missing (no tensors)"
