"""Lightning's progress bars during the search: they step aside for the tuner's bar, and their clocks leave
the search out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl

__all__ = ["lightning_bars_paused"]


@contextlib.contextmanager
def lightning_bars_paused(trainer: pl.Trainer, progress: Any) -> Iterator[None]:
    """Around the search: Lightning's own bar steps aside for the tuner's, and its clock leaves the search
    out, so step 1 is not reported as taking the whole search (the result line reports the tuning time)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    callback = trainer.progress_bar_callback
    tqdm_bar = getattr(callback, "_train_progress_bar", None) if isinstance(callback, TQDMProgressBar) else None
    rich = callback.progress if isinstance(callback, RichProgressBar) else None
    if tqdm_bar is not None:
        tqdm_bar.clear()
    if rich is not None:
        rich.stop()
    started = time.monotonic()
    try:
        yield
    finally:
        if progress is not None:
            progress.close()
        if tqdm_bar is not None:
            tqdm_bar.unpause()  # restarts tqdm's timer from its last print: rate and elapsed leave the search out
            tqdm_bar.refresh()
        if rich is not None:
            for task in rich.tasks:
                if task.start_time is not None:
                    task.start_time += time.monotonic() - started
                task._progress.clear()  # the speed estimate's samples: none may span the search
            rich.start()
