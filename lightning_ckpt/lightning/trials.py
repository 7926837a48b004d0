"""Running the user's ``training_step`` as a trial: without a trace (the sandbox), with the gradients Lightning
would hold at that point of a real step, under the Trainer's precision; and reading a batch's shape."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ckpt.measure.harness import loss_of
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.measure.snapshot import StateSnapshot, mark_zero_grad

__all__ = [
    "SkippedBatch",
    "batch_dims",
    "batch_tensors",
    "fill_grads",
    "needs_transfer",
    "sandbox",
    "training_loss",
    "zero_grad_fn",
]


@contextlib.contextmanager
def sandbox(pl_module: pl.LightningModule) -> Iterator[None]:
    """Run trials without leaving a trace: grads, buffers, metric states, Python attributes, RNG and logging.

    Tensors and RNG are the measure stage's ``StateSnapshot`` (the one snapshot every step of the search is
    restored from), and Python attributes its ``PythonState``; what is Lightning's own (metric states, logging,
    train/eval flags) is put back here."""
    python_state = PythonState.capture(pl_module)  # tune() also restores them after every step it runs
    state = StateSnapshot.capture(pl_module)
    metric_states = _metric_states(pl_module)
    training = {m: m.training for m in pl_module.modules()}
    patched = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
    pl_module.log = _no_log  # type: ignore[method-assign]
    pl_module.log_dict = _no_log  # type: ignore[method-assign]
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
        _restore_metric_states(metric_states)
        python_state.restore()


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _metric_states(pl_module: torch.nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics ships with lightning
        return []
    saved = []
    for m in pl_module.modules():
        if isinstance(m, Metric):
            state = {k: copy.deepcopy(getattr(m, k)) for k in m._defaults}
            state.update(_update_count=m._update_count, _computed=copy.deepcopy(m._computed))
            saved.append((m, state))
    return saved


def _restore_metric_states(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for m, state in saved:
        for k, v in state.items():
            setattr(m, k, v)


def fill_grads(pl_module: pl.LightningModule) -> None:
    """Give every trainable parameter a gradient for the trials (the sandbox puts the real ones back).

    From the second real step on, gradients are live while the forward runs: Lightning zeroes them after
    ``training_step`` and before ``backward`` (and under gradient accumulation not at all within a window).
    A first batch has none, so trials without them would under-state every later step.
    """
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
    """The user's ``training_step`` on ``batch`` under the Trainer's precision, as a zero-argument loss function.

    Trials must run exactly what training runs (autocast included), so the tuner never builds its own forward.
    ``zero_grad`` runs after the forward, where Lightning's automatic optimization zeroes gradients.
    """

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
    from torch.utils._pytree import tree_leaves

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
