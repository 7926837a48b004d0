"""How big a batch is, and how a plan's memory grows with it: what lets the guard act *before* a larger batch's forward
instead of reading it after (on a GPU, after is an out-of-memory error and a dead fit).

A batch's size is ``(rows, length)``: samples and tokens per sample for token batches, else the largest tensor's
elements per row. A packed batch (sequences concatenated, boundaries in ``cu_seqlens``) says nothing by its shape about
the sequences it holds: the user's ``shape_key`` says it.

Activations at another size are predicted from a reference: linear in rows, and ``a * x + (1 - a) * x**2`` in the length
ratio ``x``, the form a transformer's activations have (attention that materialises its T x T scores grows with T**2).
Until a plan's real step is read at a second length, ``a`` is 0 (all quadratic): the guard may move to a lower-memory
plan a step early, never a step late. A fitted power would not extrapolate: the power between two short lengths is lower
than between a short and a long one.

Also here: running ``training_step`` as a trial (the sandbox), and ``max_shape="probe"``, which must not change
training: the random states a loader draws from are put back, and a one-shot iterator is refused, not consumed."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils._pytree import tree_leaves, tree_map

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.ranks import max_over_ranks
from lightning_ckpt.measure.harness import loss_of
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.measure.snapshot import StateSnapshot, mark_zero_grad, rng_state, set_rng_state

__all__ = [
    "BatchSize",
    "PROBE_BATCHES",
    "ShapeScaling",
    "SkippedBatch",
    "batch_at_length",
    "batch_dims",
    "batch_size_of",
    "batch_tensors",
    "fill_grads",
    "grown_to",
    "mark_length_dynamic",
    "needs_transfer",
    "probe_request",
    "probed_max_shape",
    "sandbox",
    "training_loss",
    "zero_grad_fn",
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
    """``batch``'s size (see the module docstring); None for a batch without tensors."""
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
    """Predicts a plan's activation bytes at one size from a reference at another, learning per plan from real steps
    how they grow with length (see the module docstring)."""

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
        """A real step read at ``at`` used ``activation``, the same plan ``reference_activation`` at ``reference``.
        Readings at the reference's length say nothing of the growth with length."""
        if at.length == reference.length or activation <= 0 or reference_activation <= 0:
            return
        x = at.length / reference.length
        per_row = (activation / at.rows) / (reference_activation / reference.rows)
        a = (x * x - per_row) / (x * x - x)  # a * x + (1 - a) * x**2 = per_row
        self.linear_shares.setdefault(plan_key, []).append(min(1.0, max(0.0, a)))


def grown_to(batch: Any, target: BatchSize) -> Any:
    """``batch`` grown to ``target`` (``rows`` 0: its own): the tokens repeat, but a step's memory and time are those
    of a batch that size, which is what the search measures. A dimension already that large keeps its size."""
    rows, length = _token_dims(batch, "max_shape needs")
    return resized_to(batch, BatchSize(max(target.rows, rows), max(target.length, length)))


def resized_to(batch: Any, target: BatchSize) -> Any:
    """``batch`` at exactly ``target`` (``rows`` 0: its own rows), tiling every dimension as long as its rows (the
    first) or its length (any later one: ``(B, T)`` ids, ``(B, 1, T, T)`` masks), or keeping the first ones."""
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
    """``batch`` at ``length``: by the user's guard ``resize`` (its result checked), else as ``resized_to``."""
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
    """Mark every dimension ``length`` long but the rows dynamic for dynamo (``maybe_mark_dynamic``: a model that
    needs it static keeps it static), so the graph compiled at a bucket's first batch serves every length of the
    bucket instead of being compiled again at the second. The number of dimensions marked."""
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


@contextlib.contextmanager
def sandbox(pl_module: pl.LightningModule) -> Iterator[None]:
    """Run trials without leaving a trace: grads, buffers, metric states, Python attributes, RNG and logging."""
    python_state = PythonState.capture(pl_module)  # tune() also restores them after every step it runs
    state = StateSnapshot.capture(pl_module)
    restore_metrics = _metric_states(pl_module)
    training = {m: m.training for m in pl_module.modules()}
    patched = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
    pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, previous in patched.items():
            if previous is None:
                pl_module.__dict__.pop(name, None)
            else:
                pl_module.__dict__[name] = previous
        state.restore()
        for m, was in training.items():
            m.training = was
        restore_metrics()
        python_state.restore()


def _metric_states(pl_module: torch.nn.Module) -> Callable[[], None]:
    """The torchmetrics states as they are now; the function returned puts them back."""
    from torchmetrics import Metric  # a dependency of lightning

    saved = []
    for m in pl_module.modules():
        if isinstance(m, Metric):
            state = {k: copy.deepcopy(getattr(m, k)) for k in m._defaults}
            saved.append((m, {**state, "_update_count": m._update_count, "_computed": copy.deepcopy(m._computed)}))

    def restore() -> None:
        for m, state in saved:
            for k, v in state.items():
                setattr(m, k, v)

    return restore


def fill_grads(pl_module: pl.LightningModule) -> None:
    """Give every trainable parameter a gradient for the trials: from the second real step on, gradients are live
    while the forward runs, so trials without them would under-state every later step."""
    for p in pl_module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
            mark_zero_grad(p.grad)  # trials' snapshots then restore zeros instead of copying to host and back


def zero_grad_fn(trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, batch_idx: int) -> Any:
    """Lightning's own zeroing between forward and backward, where it happens (not inside an accumulation window)."""
    if optimizer is None or trainer.accumulate_grad_batches > 1:
        return None
    return lambda: pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)


def training_loss(
    pl_module: pl.LightningModule, precision: Any, batch: Any, batch_idx: int, *, zero_grad: Any = None
) -> Any:
    """The user's ``training_step`` on ``batch`` under the Trainer's precision (autocast included), as a zero-argument
    loss function. ``zero_grad`` runs after the forward, where Lightning's automatic optimization zeroes gradients."""

    def forward() -> torch.Tensor:
        with precision.forward_context():
            out = pl_module.training_step(batch, batch_idx)
        if out is None:
            raise SkippedBatch  # legal in Lightning: the batch is skipped; tune on the next one
        loss = loss_of(out, require_grad=torch.is_grad_enabled())
        if zero_grad is not None:
            zero_grad()
        return loss

    return forward


class SkippedBatch(Exception):
    """training_step returned None for the batch being tuned on."""


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def needs_transfer(batch: Any, device: torch.device) -> bool:
    return any(t.device != device for t in batch_tensors(batch))


def batch_dims(batch: Any) -> tuple[int | None, int | None]:
    """Samples per batch (first dim of the first tensor) and sequence length (token-id batches)."""
    tensors = batch_tensors(batch)
    if not tensors or tensors[0].dim() == 0:
        return None, None
    first = tensors[0]
    seq = first.shape[1] if first.dim() == 2 and not first.is_floating_point() else None
    return int(first.shape[0]), (int(seq) if seq is not None else None)


PROBE_BATCHES = 64
# Where a datamodule (or the LightningModule) keeps the longest sequence it will produce, in order.
DATAMODULE_ATTRIBUTES = ("max_seq_length", "max_length", "max_seq_len")


@dataclass(frozen=True)
class Probed:
    """The longest batch found, and where it came from."""

    size: BatchSize
    source: str


def probe_request(value: Any) -> int | None:
    """``max_shape="probe"`` (``PROBE_BATCHES`` batches) or ``"probe:N"``: the number of batches to probe; None
    for any other ``max_shape``."""
    if not isinstance(value, str):
        return None
    head, _, count = value.partition(":")
    if head == "probe" and (not count or (count.isdigit() and int(count) > 0)):
        return int(count) if count else PROBE_BATCHES
    raise ConfigurationError(
        f"max_shape={value!r} is not understood. Give the longest batch, (rows, length) or a length, e.g. "
        f"max_shape=1024; or max_shape='probe' to read it from the datamodule or the first {PROBE_BATCHES} "
        "batches of the training loader ('probe:256' for more)."
    )


def _declared_length(owners: Iterable[Any]) -> tuple[int, str] | None:
    for owner in owners:
        for name in DATAMODULE_ATTRIBUTES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{type(owner).__name__}.{name}"
    return None


def probe_loader(loader: Any, size_of: Callable[[Any], BatchSize | None], batches: int) -> Probed:
    """The longest of the first ``batches`` batches of a fresh iterator over ``loader`` (shapes only)."""
    if loader is None or isinstance(loader, (dict, list, tuple)):
        raise ConfigurationError(
            "max_shape='probe' needs one training loader to probe, but the fit has "
            f"{'none' if loader is None else type(loader).__name__ + ' of loaders'}. Declare the longest batch, e.g. "
            "max_shape=1024."
        )
    states = rng_state()
    iterator = iter(loader)
    try:
        if iterator is loader:
            raise ConfigurationError(
                f"max_shape='probe' cannot probe the training data: it is a one-shot iterator "
                f"({type(loader).__name__}) that the probe would consume. Declare the longest batch, e.g. "
                "max_shape=1024, or pass a DataLoader."
            )
        seen: list[BatchSize] = []
        for _, batch in zip(range(batches), iterator, strict=False):
            size = size_of(batch)
            if size is not None:
                seen.append(size)
    finally:
        del iterator  # a DataLoader's workers shut down here
        set_rng_state(states)
    if not seen:
        raise ConfigurationError(
            "max_shape='probe' found no batch with a tensor in the training loader. Declare the longest batch, "
            "e.g. max_shape=1024."
        )
    longest, shortest = BatchSize(max(s.rows for s in seen), max(s.length for s in seen)), min(s.length for s in seen)
    return Probed(
        longest, f"a probe of {len(seen)} batches of the training loader (lengths {shortest}-{longest.length})"
    )


def probed_max_shape(trainer: Any, size_of: Callable[[Any], BatchSize | None], batches: int) -> Probed:
    """The longest batch this fit will see: the datamodule's (or module's) declared maximum length, else a probe of
    its training loader; the longest any rank found."""
    declared = _declared_length((trainer.datamodule, trainer.lightning_module))
    if declared is not None:
        probed = Probed(BatchSize(0, declared[0]), f"{declared[1]} ({declared[0]})")
    else:
        probed = probe_loader(trainer.train_dataloader, size_of, batches)
    if trainer.world_size > 1:
        rows, length = max_over_ranks(trainer.strategy, (probed.size.rows, probed.size.length))
        probed = Probed(BatchSize(rows, length), probed.source + ", the longest of every rank's")
    return probed
