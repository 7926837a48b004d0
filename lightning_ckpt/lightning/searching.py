"""Glue from a Trainer to ``search.tune``/``search.microbatch``, where the algorithm lives: the search on the first
batch through the user's own ``training_step``, in the sandbox, with Lightning's progress bars paused; its report;
and the joint search's micro-batch, set as Lightning's ``BatchSizeFinder`` sets it."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_ckpt.budget import RequestedBudget
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.guard import GuardConfig
from lightning_ckpt.lightning.ranks import StrategySync
from lightning_ckpt.lightning.reuse import PlanFile, warn_each_fit, warn_user
from lightning_ckpt.lightning.shapes import (
    SkippedBatch,
    batch_at_length,
    batch_dims,
    batch_size_of,
    batch_tensors,
    fill_grads,
    needs_transfer,
    sandbox,
    training_loss,
    zero_grad_fn,
)
from lightning_ckpt.lightning.tensorboard import TunerRun, logged_hparams
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.provenance import MicroBatch
from lightning_ckpt.plan.table import PlanTable
from lightning_ckpt.search.buckets import bucket_profile, plan_table
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.ledger import storage_for_display
from lightning_ckpt.search.pipeline import SearchHooks
from lightning_ckpt.search.result import TuneResult
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.search.trials import SearchInterrupted
from lightning_ckpt.search.tune import tune

__all__ = [
    "SearchRequest",
    "LinesAboveTheBar",
    "report_search",
    "search_first_batch",
    "search_micro_batch",
    "set_micro_batch",
]


@dataclass(frozen=True)
class SearchRequest:
    view: ModelView
    config: TuneConfig
    budget: RequestedBudget
    tb: TunerRun
    verbose: bool
    guard: GuardConfig  # its shape_key and resize size packed batches and cut them to a bucket's length
    table_lengths: tuple[int, ...] | None = None  # a plan table's bucket lengths (the last the tuned batch's)
    lines: LinesAboveTheBar | None = None  # the fit's log lines, written above the bar drawn at the time


def search_first_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, request: SearchRequest
) -> tuple[TuneResult, Any, PlanTable | None] | None:
    """Search on ``batch``: the result, the batch tuned on, and the plan table when ``request.table_lengths`` asks for
    one; None when ``training_step`` skipped the batch (the search runs on the next one)."""
    batch = trainer.strategy.batch_to_device(batch) if needs_transfer(batch, pl_module.device) else batch
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    zero_grad = zero_grad_fn(trainer, pl_module, optimizer, batch_idx)
    forward = training_loss(pl_module, trainer.strategy.precision_plugin, batch, batch_idx, zero_grad=zero_grad)
    batch_size, seq_len = batch_dims(batch)
    result = table = None
    try:  # SIGTERM goes to Lightning's own handling; the model is untouched either way (trials are sandboxed)
        with _sigterm_handed_over(), _around_trials(trainer, pl_module, request) as hooks, warnings.catch_warnings():
            # tune() warns of a fallback through the warnings module, shown once per process; said below each fit.
            warnings.filterwarnings("ignore", message="No checkpointing plan fits the budget")
            result = tune(
                request.view,
                forward,
                optimizer=optimizer,
                max_memory=request.budget,
                batch_size=batch_size,
                seq_len=seq_len,
                extra_tensors=tuple(batch_tensors(batch)),
                config=request.config,
                hooks=hooks,
            )
            if request.table_lengths is not None and not result.fell_back:
                table = _table(pl_module, batch, batch_idx, request, result, optimizer, zero_grad)
    except SkippedBatch:  # a batch ``training_step`` skips waits for the next one
        rank_zero_info(
            f"lightning_ckpt: training_step returned None for batch {batch_idx} (Lightning skips it); "
            "tuning on the next batch."
        )
    if result is None:
        return None
    if result.fell_back:
        warn_each_fit(result.fallback_message)
    return result, batch, table


def _table(
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    request: SearchRequest,
    result: TuneResult,
    optimizer: Any,
    zero_grad: Any,
) -> PlanTable | None:
    """The plan table over ``request.table_lengths``: the search's plan on top, each shorter bucket's chosen from a
    profile of ``batch`` cut to its length (no trials); under several ranks, rank 0's. None, said, where the search
    kept no profile to predict from."""
    compiled = bool(request.view.compiled)
    provenance = result.best.provenance
    saved = provenance.compiled_profile if compiled else provenance.profile
    if not saved:
        rank_zero_info(
            "lightning_ckpt: no plan table: the search kept no profile to predict shorter buckets from (it measured "
            "no plan, so its time model was not fitted); every batch runs the plan tuned for max_shape."
        )
        return None
    if compiled and result.best.compile_memory_budget is not None:
        rank_zero_info(
            "lightning_ckpt: no plan table: the search chose PT2's own activation_memory_budget, which the compiler "
            "reads when compiling and no guard sees, so switching to a shorter bucket's plan would compile afresh at "
            "every switch; every batch runs the plan tuned for max_shape."
        )
        return None
    assert request.table_lengths is not None
    guard = request.guard
    size = batch_size_of(batch, guard.shape_key)
    rows = size.rows if size is not None else 1
    precision = pl_module.trainer.strategy.precision_plugin
    # The space the search ran (for a compiled model, as its runner adapted it): the modes each bucket profiles.
    space = SearchSpace.from_config(saved["search_space"])

    def profile_at(length: int) -> Any:
        resized = batch_at_length(batch, length, rows=rows, resize=guard.resize, shape_key=guard.shape_key)
        forward = training_loss(pl_module, precision, resized, batch_idx, zero_grad=zero_grad)
        extra = tuple(batch_tensors(resized))
        return bucket_profile(request.view, forward, space=space, optimizer=optimizer, extra=extra, compiled=compiled)

    table = plan_table(result.best, profile_at, request.table_lengths, result.budget, rows=rows)
    # Every rank profiled in lockstep (a sharded model's profile gathers parameters); rank 0's table for all.
    trainer = pl_module.trainer
    return StrategySync(trainer.strategy).broadcast(table) if trainer.world_size > 1 else table


@contextlib.contextmanager
def _sigterm_handed_over() -> Iterator[None]:
    """SIGTERM during a search (plan or joint micro-batch) goes to Lightning's own handling, nothing applied."""
    try:
        yield
    except SearchInterrupted:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        rank_zero_info("lightning_ckpt: SIGTERM received; the search stopped and nothing was applied.")
        raise SIGTERMException() from None


def _sigterm_received(trainer: pl.Trainer) -> bool:
    """What every search polls between trials: Lightning's flag, set by its SIGTERM handler."""
    return bool(getattr(trainer, "received_sigterm", False))


@contextlib.contextmanager
def _around_trials(trainer: pl.Trainer, pl_module: pl.LightningModule, request: SearchRequest) -> Iterator[SearchHooks]:
    """Around a search's trials: Lightning's bars paused, the sandbox, and the gradients a real step holds. SIGTERM
    after the last round stops the search as one during it does: nothing is applied."""
    with lightning_bars_paused(trainer, request) as progress, sandbox(pl_module):
        fill_grads(pl_module)
        sync = StrategySync(trainer.strategy) if trainer.world_size > 1 else None
        yield SearchHooks(progress=progress, should_stop=lambda: _sigterm_received(trainer), sync=sync)
        if _sigterm_received(trainer):
            raise SearchInterrupted("SIGTERM arrived as the search ended; no plan was chosen.")


@contextlib.contextmanager
def _sigterm_noted(trainer: pl.Trainer) -> Iterator[None]:
    """Lightning installs its SIGTERM handler after ``on_fit_start``, where the joint micro-batch search runs: until
    then a SIGTERM would end the process mid-search. Note it as Lightning's handler would (``received_sigterm``),
    so the search stops between trials as the plan search does; the previous handler is put back afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield  # someone handles it already (Lightning's own, or the user's)
        return

    def note(signum: int, frame: Any) -> None:
        trainer._signal_connector.received_sigterm = True  # what ``Trainer.received_sigterm`` reads

    signal.signal(signal.SIGTERM, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def search_micro_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, attribute: str, request: SearchRequest
) -> tuple[TuneResult, Any]:
    """The joint search of plan and micro-batch (same global batch), before the loop draws its first batch: the
    result, and the batch tuned on."""
    from lightning.pytorch.utilities.parsing import lightning_getattr

    from lightning_ckpt.search.microbatch import resize_batch, tune_micro_batch

    check_micro_batch_tunable(trainer, pl_module, attribute)
    base = int(lightning_getattr(pl_module, attribute))
    global_batch = base * int(trainer.accumulate_grad_batches)
    trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigurationError("tune_micro_batch=True needs a single train DataLoader.")
    with isolate_rng():  # drawing the first batch must not move the data order or any RNG
        batch = trainer.strategy.batch_to_device(next(iter(loader)))
    precision = trainer.strategy.precision_plugin
    optimizer = trainer.optimizers[0] if trainer.optimizers else None

    def loss_fn_for(m: int) -> Any:
        # One micro-batch per step: the previous step's gradients live until after the forward.
        zero_grad = zero_grad_fn(trainer, pl_module, optimizer, 0) if global_batch // m == 1 else None
        return training_loss(pl_module, precision, resize_batch(batch, base, m), 0, zero_grad=zero_grad)

    with _sigterm_handed_over(), _sigterm_noted(trainer), _around_trials(trainer, pl_module, request) as hooks:
        found = tune_micro_batch(
            request.view,
            loss_fn_for,
            base_micro_batch=base,
            global_batch=global_batch,
            max_memory=request.budget,
            extra_for=lambda m: tuple(batch_tensors(resize_batch(batch, base, m))),
            optimizer=optimizer,
            config=request.config,
            hooks=hooks,
        )
    return found.result, resize_batch(batch, base, found.micro_batch)


def report_search(
    trainer: pl.Trainer, result: TuneResult, *, plan_file: PlanFile | None, tb: TunerRun, verbose: bool
) -> None:
    """After lock-in, on rank 0: TensorBoard's summary (the trials were streamed), the timing warning, the table
    when verbose, and one line saying what was chosen and where to see it."""
    from lightning_ckpt import report

    writer, log_dir = tb.writer(trainer), None
    if writer is not None:
        other, summary = logged_hparams(trainer, trainer.lightning_module), not tb.declared_in_logger
        log_dir = report.write_tensorboard(
            writer, result, log_trials=False, write_experiment_summary=summary, other_hparams=other
        )
    tb.close()
    warning = report.timing_warning(result)
    if warning:
        # Printed as the result line is, on a line of its own: through ``warnings`` it came out glued onto
        # Lightning's bar with a ``searching.py:183:`` prefix, easy to miss.
        rank_zero_info(warning)
    if verbose:
        rank_zero_info(report.summary_table(result))
    where = []
    if plan_file is not None:
        if plan_file.wrote:
            where.append(f"plan saved to {plan_file.path}")
        elif plan_file.failed is not None:
            where.append(f"plan NOT saved: {plan_file.path} could not be written ({plan_file.failed})")
        else:
            where.append(f"plan not saved: {plan_file.path} holds another run's plan")
    if log_dir is not None:
        where.append(f"view it: tensorboard --logdir {tb.view_dir(trainer, log_dir)}")
    else:
        where.append("no TensorBoard files (Trainer(logger=False); the tuner's log_dir=... writes them)")
    if result.study_name is not None:
        where.append(f"Optuna study {result.study_name!r} ({storage_for_display(result.storage)})")
    rank_zero_info(report.result_line(result) + "\nlightning_ckpt: " + "; ".join(where))


def check_micro_batch_tunable(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_arg_name: str) -> None:
    """Refuse what the joint search cannot do; warn where accumulation is not exactly the original batch."""
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
        warn_user(
            "tune_micro_batch=True: this model has BatchNorm layers, whose statistics depend on the micro-batch; "
            "gradient accumulation is then not exactly equivalent to the original batch."
        )


def set_micro_batch(
    trainer: pl.Trainer, pl_module: pl.LightningModule, batch_arg_name: str, spec: MicroBatch, *, verbose: bool
) -> bool:
    """Switch to ``spec``'s micro-batch and accumulation (True), or keep this run's when its global batch differs
    (False, with a warning); restore both if the switch fails."""
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

    if not lightning_hasattr(pl_module, batch_arg_name):
        raise ConfigurationError(
            f"The plan sets micro-batch {spec.size} x {spec.accumulation} accumulation, but the model has "
            f"no '{batch_arg_name}' attribute to set. Add it, or re-tune without tune_micro_batch."
        )
    old_size, old_accumulation = lightning_getattr(pl_module, batch_arg_name), trainer.accumulate_grad_batches
    if old_size * old_accumulation != spec.global_batch:
        warn_user(
            f"lightning_ckpt: the plan's micro-batch was tuned for a global batch of {spec.global_batch}, but this run "
            f"has {old_size} x {old_accumulation}; keeping this run's batch settings."
        )
        return False

    def switch(size: int, accumulation: int) -> None:
        lightning_setattr(pl_module, batch_arg_name, size)
        trainer.accumulate_grad_batches = accumulation
        trainer.fit_loop._combined_loader = None  # force a reload, as Lightning's batch-size tuner does
        trainer.fit_loop.setup_data()

    try:
        switch(spec.size, spec.accumulation)
        actual = getattr(trainer.train_dataloader, "batch_size", spec.size)
        if actual != spec.size:
            raise ConfigurationError(
                f"Set {batch_arg_name}={spec.size} but the reloaded train DataLoader still has batch_size "
                f"{actual}: train_dataloader() must build its DataLoader from self.{batch_arg_name}."
            )
    except BaseException:
        switch(old_size, old_accumulation)
        raise
    if verbose:
        rank_zero_info(
            f"lightning_ckpt: micro-batch {spec['size']} x {spec['accumulation']} accumulation "
            f"(global batch {spec['global']}, was {old_size} x {old_accumulation})"
        )
    return True


@contextlib.contextmanager
def lightning_bars_paused(trainer: pl.Trainer, request: SearchRequest) -> Iterator[Any]:
    """Around the search: Lightning's own bar steps aside for the tuner's (yielded; None off rank 0), and its clock
    leaves the search out, so step 1 is not reported as taking the whole search. The tuner's bar is made once
    Lightning's is stopped: a running Rich display replaces ``sys.stdout`` with a proxy that prints each redraw of a bar
    as a line of its own; a line written above the tuner's bar (``tqdm.write``) would redraw Lightning's tqdm bar."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from lightning_ckpt.report.progress import SearchProgress

    callback = trainer.progress_bar_callback
    tqdm_bar = getattr(callback, "_train_progress_bar", None) if isinstance(callback, TQDMProgressBar) else None
    rich = callback.progress if isinstance(callback, RichProgressBar) else None
    hidden = tqdm_bar is not None and not tqdm_bar.disable
    if hidden:
        tqdm_bar.clear()
        tqdm_bar.disable = True
    if rich is not None:
        rich.live.transient = True  # stopped, its display is erased, not left frozen above the tuner's bar
        rich.stop()
        rich.live.transient = False
    started, progress = time.monotonic(), None
    if trainer.is_global_zero:  # the search's bar (trial lines above it when verbose), streaming trials to TensorBoard
        # The time model measures only the plans that can win (a few of n_trials): no total, so no fiction of one.
        total = None if request.config.predict_time else request.config.n_trials
        writer, verbose = request.tb.writer(trainer), request.verbose
        progress = SearchProgress(total, writer=writer, verbose=verbose, enabled=callback is not None, file=sys.stdout)
    if request.lines is not None:
        request.lines.search_bar = progress
    try:
        yield progress
    finally:
        if request.lines is not None:
            request.lines.search_bar = None
        if progress is not None:
            progress.close()
        if hidden:
            tqdm_bar.disable = False
            tqdm_bar.unpause()  # restarts tqdm's timer from its last print: rate and elapsed leave the search out
            tqdm_bar.refresh()
        if rich is not None:
            for task in rich.tasks:
                if task.start_time is not None:
                    task.start_time += time.monotonic() - started
                task._progress.clear()  # the speed estimate's samples: none may span the search
            rich.start()


class LinesAboveTheBar(logging.Handler):
    """Every line logged during a fit (the tuner's and Lightning's own), written above whichever progress bar is
    drawn then: a line written while a bar is drawn lands on the bar's line (tqdm leaves the cursor there; Rich
    redraws over it). Installed on rank 0 for the fit in place of the loggers' console handlers (as tqdm's
    ``logging_redirect_tqdm`` does), and put back after."""

    LOGGERS = ("lightning.pytorch", "lightning_ckpt")

    def __init__(self, trainer: pl.Trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.search_bar: Any = None  # the tuner's SearchProgress while it is drawn
        self._replaced: list[tuple[logging.Logger, list[logging.Handler]]] = []
        self.stream: Any = sys.stderr

    def install(self) -> None:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            console = [
                h
                for h in logger.handlers
                if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
            ]
            if console:
                self.setFormatter(console[0].formatter)
                self.stream = console[0].stream
            elif logger.hasHandlers():
                continue  # the user's own handlers above it print its lines: left as they are
            self._replaced.append((logger, list(logger.handlers)))
            logger.handlers = [h for h in logger.handlers if h not in console] + [self]

    def remove(self) -> None:
        for logger, handlers in self._replaced:
            logger.handlers = handlers
        self._replaced = []

    def emit(self, record: logging.LogRecord) -> None:
        """The record as a line of its own above the bar drawn now, or on ``stream`` when none is."""
        from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

        try:
            text, callback = self.format(record), self.trainer.progress_bar_callback
            if self.search_bar is not None:
                return self.search_bar.write(text)
            if isinstance(callback, TQDMProgressBar):
                bars = [getattr(callback, f"_{s}_progress_bar", None) for s in ("train", "val", "test", "predict")]
                active = next((b for b in bars if b is not None and not b.disable), None)
                if active is not None:
                    return active.write(text, file=active.fp)
            rich = callback.progress if isinstance(callback, RichProgressBar) else None
            if rich is not None and rich.live.is_started:  # above its live display
                return rich.console.print(text, markup=False, highlight=False, soft_wrap=True)
            self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:
            self.handleError(record)
