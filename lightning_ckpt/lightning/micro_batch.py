"""Switching the micro-batch for the joint search (``tune_micro_batch``): what it needs from the run, the batch it
tunes on, and setting the micro-batch and accumulation as Lightning's ``BatchSizeFinder`` does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_ckpt.errors import ConfigurationError

__all__ = ["check_micro_batch_tunable", "first_batch", "set_micro_batch"]


def check_micro_batch_tunable(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_arg_name: str) -> None:
    """Refuse what the joint search cannot do (several processes, no batch-size attribute, a scheduler that sets
    the accumulation itself); warn where accumulation is not exactly the original batch (BatchNorm)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.utilities.parsing import lightning_hasattr

    if trainer.world_size > 1:
        raise ConfigurationError("tune_micro_batch=True is not supported under multi-process training yet.")
    if not lightning_hasattr(pl_module, batch_arg_name):
        raise ConfigurationError(
            f"tune_micro_batch=True changes the micro-batch through the '{batch_arg_name}' attribute of the "
            "LightningModule or its datamodule (as Lightning's BatchSizeFinder does), but neither has it. Add "
            f"self.{batch_arg_name} and use it in train_dataloader(), or name yours: tune_micro_batch='my_batch_size'."
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        raise ConfigurationError(
            "tune_micro_batch=True sets accumulate_grad_batches itself, but a GradientAccumulationScheduler is "
            "also set. Remove one of them."
        )
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in pl_module.modules()):
        rank_zero_warn(
            "tune_micro_batch=True: this model has BatchNorm layers, whose statistics depend on the micro-batch; "
            "gradient accumulation is then not exactly equivalent to the original batch."
        )


def first_batch(trainer: pl.Trainer) -> Any:
    """The first training batch, on the device, drawn without moving the data order or any RNG."""
    trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigurationError("tune_micro_batch=True needs a single train DataLoader.")
    with isolate_rng():  # drawing a batch must not move the data order or any RNG
        batch = next(iter(loader))
    return trainer.strategy.batch_to_device(batch)


def set_micro_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch_arg_name: str, spec: Mapping[str, int], *, verbose: bool
) -> bool:
    """Switch to ``spec``'s micro-batch and accumulation (True), or keep this run's when its global batch differs
    (False, with a warning); restore both if the switch fails."""
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

    if not lightning_hasattr(pl_module, batch_arg_name):
        raise ConfigurationError(
            f"The plan sets micro-batch {spec['size']} x {spec['accumulation']} accumulation, but the model has "
            f"no '{batch_arg_name}' attribute to set. Add it, or re-tune without tune_micro_batch."
        )
    old_size = lightning_getattr(pl_module, batch_arg_name)
    old_accumulation = trainer.accumulate_grad_batches
    if old_size * old_accumulation != spec["global"]:
        rank_zero_warn(
            f"lightning_ckpt: the plan's micro-batch was tuned for a global batch of {spec['global']}, but this run "
            f"has {old_size} x {old_accumulation}; keeping this run's batch settings."
        )
        return False
    try:
        lightning_setattr(pl_module, batch_arg_name, int(spec["size"]))
        trainer.accumulate_grad_batches = int(spec["accumulation"])
        trainer.fit_loop._combined_loader = None  # force a reload, as Lightning's batch-size tuner does
        trainer.fit_loop.setup_data()
        loader = trainer.train_dataloader
        actual = getattr(loader, "batch_size", spec["size"])
        if actual != spec["size"]:
            raise ConfigurationError(
                f"Set {batch_arg_name}={spec['size']} but the reloaded train DataLoader still has batch_size "
                f"{actual}: train_dataloader() must build its DataLoader from self.{batch_arg_name}."
            )
    except BaseException:
        lightning_setattr(pl_module, batch_arg_name, old_size)
        trainer.accumulate_grad_batches = old_accumulation
        trainer.fit_loop._combined_loader = None
        trainer.fit_loop.setup_data()
        raise
    if verbose:
        rank_zero_info(
            f"lightning_ckpt: micro-batch {spec['size']} x {spec['accumulation']} accumulation "
            f"(global batch {spec['global']}, was {old_size} x {old_accumulation})"
        )
    return True
