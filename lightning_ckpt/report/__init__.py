"""What a search shows: the result line, summary tables, progress, the Pareto figure and TensorBoard.
TensorBoard and matplotlib are imported only here.

One module per job: ``text`` (words, plain and markdown), ``progress`` (the bar during the search), ``figure``
(the Pareto plot), ``tensorboard`` (writing the logs) and ``tags`` (the names in them); ``quantities`` holds
what they all read off a trial. The package exports the few names callers use (``from lightning_ckpt import
report``, then ``report.write_tensorboard(...)``, ``report.summary_table(...)``); the rest live in their module
(``report.tags.HPARAM_COLUMNS``, ``report.text.plan_markdown``). A name this package used to export still
resolves, with a ``DeprecationWarning`` naming its module.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from lightning_ckpt.report import figure, progress, quantities, tags, tensorboard, text
from lightning_ckpt.report.figure import pareto_figure
from lightning_ckpt.report.progress import SearchProgress
from lightning_ckpt.report.tensorboard import write_tensorboard
from lightning_ckpt.report.text import result_line, summary_table, timing_warning, trial_line

__all__ = [
    "SearchProgress",
    "figure",
    "pareto_figure",
    "progress",
    "quantities",
    "result_line",
    "summary_table",
    "tags",
    "tensorboard",
    "text",
    "timing_warning",
    "trial_line",
    "write_tensorboard",
]

_MODULES = ("tags", "text", "tensorboard", "figure")  # where the names this package exported until 0.5 live


def __getattr__(name: str) -> Any:
    for module_name in _MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        if name in getattr(module, "__all__", ()):
            warnings.warn(
                f"lightning_ckpt.report.{name} is deprecated: use lightning_ckpt.report.{module_name}.{name} (the "
                "report package exports only the names callers use). The alias will be removed in a later release.",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
