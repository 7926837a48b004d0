"""What a search shows: the result line, summary tables, progress, the Pareto figure and TensorBoard. TensorBoard and
matplotlib are imported only here.

The package exports the few names callers use (``report.write_tensorboard(...)``); the rest live in their module
(``report.tags.HPARAM_COLUMNS``, ``report.text.plan_markdown``)."""

from __future__ import annotations

from lightning_ckpt.report.figure import pareto_figure
from lightning_ckpt.report.progress import SearchProgress
from lightning_ckpt.report.tensorboard import write_tensorboard
from lightning_ckpt.report.text import result_line, summary_table, timing_warning, trial_line

__all__ = [
    "SearchProgress",
    "pareto_figure",
    "result_line",
    "summary_table",
    "timing_warning",
    "trial_line",
    "write_tensorboard",
]
