"""The tuner's TensorBoard run beside the Trainer's: a child run of the Trainer's ``TensorBoardLogger`` (or of
``log_dir``), and the HParams table's columns declared in the Trainer's run before Lightning writes its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

__all__ = ["TunerRun", "logged_hparams"]


class TunerRun:
    """One fit's TensorBoard run for the search (opened on first use, closed by ``close``)."""

    def __init__(self, log_dir: Path | None) -> None:
        self.log_dir = log_dir
        self.declared_in_logger = False  # the Trainer's run already has the tuner's HParams columns
        self._writer: Any = None

    @staticmethod
    def trainer_logger(trainer: pl.Trainer) -> Any:
        from lightning.pytorch.loggers import TensorBoardLogger

        return next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)

    def declare_hparams_table(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Declare the HParams table's columns in the Trainer's TensorBoard run: TensorBoard keeps a run's first
        experiment summary, and Lightning writes one right after ``on_fit_start`` (the module's hyperparameters stay
        columns too)."""
        from lightning_ckpt.report.tensorboard import write_experiment

        tb = self.trainer_logger(trainer)
        if tb is None or self.log_dir is not None:
            return  # the tuner's own writer declares it (report.write_tensorboard)
        write_experiment(tb.experiment, logged_hparams(trainer, pl_module))
        self.declared_in_logger = True

    def writer(self, trainer: pl.Trainer) -> Any:
        """The search's ``SummaryWriter`` (opened once); None with ``Trainer(logger=False)`` and no ``log_dir``,
        which asks for no log files."""
        if self._writer is not None:
            return self._writer
        if self.log_dir is None and not trainer.loggers:
            return None
        from lightning_ckpt.report.tensorboard import open_writer

        # A run of its own under the Trainer's (a child run: the HParams rows live under it, see report.py).
        log_dir = self.log_dir
        if log_dir is None:
            tb = self.trainer_logger(trainer)
            # Never <cwd>/lightning_ckpt: run from a checkout, that directory shadows the package on the next import.
            base = Path(tb.log_dir) if tb is not None else Path(trainer.default_root_dir) / "lightning_logs"
            log_dir = base / "lightning_ckpt"
        self._writer = open_writer(log_dir)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def view_dir(self, trainer: pl.Trainer, log_dir: Any) -> Any:
        """What to pass to ``tensorboard --logdir``: the Trainer's root (both runs side by side), else ours."""
        tb = self.trainer_logger(trainer) if self.log_dir is None else None
        return tb.root_dir if tb is not None else log_dir


def logged_hparams(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The hyperparameters Lightning's ``TensorBoardLogger`` will log for this fit (flattened as it does)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    params: dict[str, Any] = {}
    if getattr(pl_module, "_log_hyperparams", False):
        params.update(pl_module.hparams_initial)
    datamodule = trainer.datamodule
    if datamodule is not None and getattr(datamodule, "_log_hyperparams", False):
        params.update(datamodule.hparams_initial)
    params.pop("_class_path", None)
    return dict(_flatten_dict(_convert_params(params)))
