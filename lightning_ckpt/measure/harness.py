"""One training step as every part of the search runs it: the loss of a step function's output, and its harness."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.model import ModelView

if TYPE_CHECKING:
    from lightning_ckpt.measure.measurement import Measurement

__all__ = ["StepHarness", "loss_of"]


def loss_of(out: Any, *, require_grad: bool = True) -> torch.Tensor:
    """The scalar to call ``backward`` on: a tensor, a dict's ``"loss"`` (Lightning) or ``.loss`` (HF outputs).
    ``require_grad=False`` accepts a loss computed under ``torch.no_grad`` (the profile's capture pass)."""
    loss = out
    if isinstance(out, Mapping) and "loss" in out:
        loss = out["loss"]
    elif not isinstance(out, torch.Tensor) and getattr(out, "loss", None) is not None:
        loss = out.loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or (require_grad and not loss.requires_grad):
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        grad = " that does not require grad" if isinstance(loss, torch.Tensor) and not loss.requires_grad else ""
        raise ConfigurationError(
            "The step function must return the loss: a scalar tensor that requires grad (or a dict / output object "
            f"with a 'loss' entry), but it returned {type(out).__name__}{shape}{grad}. "
            "Pass e.g. lambda: model(x, targets), or lambda: module.training_step(batch, 0)."
        )
    return loss


@dataclass(frozen=True)
class StepHarness:
    """What measuring a step needs besides the plan: the model, its step function and the run's shape. ``root`` is the
    uncompiled model (plans are applied to it); ``step_fn`` runs the forward (compiled or not) on a fixed batch and
    returns the loss. Without a batch size a step counts as one sample, which ranks plans the same."""

    root: nn.Module
    step_fn: Callable[[], Any]
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None
    extra: tuple[Any, ...] = ()
    batch_size: int = 1
    seq_len: int | None = None
    warmup_steps: int = 1
    measure_steps: int = 3
    view: ModelView | None = None  # ``root`` resolved once (the search's): plans are checked against its fingerprint
    clock: Callable[[], float] = time.perf_counter  # a test's machine whose speed it sets (``TuneConfig.clock``)

    @property
    def target(self) -> nn.Module | ModelView:
        """What plans are applied to: the view when there is one (its fingerprint is not computed again)."""
        return self.view if self.view is not None else self.root

    def train_step(self) -> None:
        """Forward and backward; never the optimizer (measuring must leave training untouched)."""
        loss_of(self.step_fn()).backward()

    def measure(self, *, warmup: int, steps: int, step: Callable[[], Any] | None = None, **passes: Any) -> Measurement:
        """``step.measure_step`` of this harness's step (or ``step``, over the same model and batch, e.g. compiled),
        so every caller measures the same way. ``passes``: the other ``StepSettings``."""
        from lightning_ckpt.measure.step import StepSettings, measure_step

        return measure_step(
            step or self.train_step,
            StepSettings(warmup=warmup, steps=steps, clock=self.clock, **passes),
            model=self.root,
            optimizer=self.optimizer,
            device=self.device,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            extra=self.extra,
        )
