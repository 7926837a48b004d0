"""What every view of a search (the text, the figure, the TensorBoard table) reads off its trials the same way, so a
plan's memory or its "best baseline" cannot mean one thing in the log line and another on the plot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.search.ledger import VS_REFERENCE, TrialRecord, vs_reference
from lightning_ckpt.search.result import TuneResult

__all__ = [
    "comparable_speeds",
    "best_feasible_baseline",
    "compile_stats",
    "constrained_bytes",
    "fastest_first",
    "memory_name",
    "predicted_constrained_bytes",
]


def memory_name(budget: Budget) -> str:
    return "activation" if budget.kind == "activation" else "peak"


def constrained_bytes(trial: TrialRecord, budget: Budget) -> int | None:
    return budget.value_of(trial.peak_bytes, trial.activation_bytes)


def predicted_constrained_bytes(trial: TrialRecord, budget: Budget) -> int | None:
    return budget.value_of(trial.predicted_peak_bytes, trial.predicted_activation_bytes)


def compile_stats(trial: TrialRecord) -> Mapping[str, Any] | None:
    stats = trial.extra.get("compile") if trial.extra else None
    return stats if isinstance(stats, Mapping) else None


def best_feasible_baseline(result: TuneResult) -> tuple[str, TrialRecord] | None:
    """The fastest fitting baseline; beside a winner re-timed side by side, only baselines re-timed with it
    (a ratio of figures taken at different moments, on a machine whose load changed, means nothing)."""
    same_moment = result.best_trial is not None and result.best_trial.confirmed
    fitting = [
        (name, t)
        for name, t in result.baselines.items()
        if t.feasible and t.samples_per_second is not None and (t.confirmed or not same_moment)
    ]
    return max(fitting, key=lambda named: named[1].samples_per_second or 0.0, default=None)


def comparable_speeds(result: TuneResult) -> dict[int, float]:
    """Samples/s of every trial re-timed beside the reference, on one scale: the reference's figure times the trial's
    paired ratio to it. The leaders' own figures come from rounds minutes apart and can rank them the other way."""
    by_label = {t.label: t for t in result.trials}
    out = {}
    for t in result.trials:
        note = t.extra.get(VS_REFERENCE)
        ratio = vs_reference(t)
        reference = by_label.get(note.get("reference")) if isinstance(note, dict) else None
        if ratio is not None and reference is not None and reference.samples_per_second:
            out[t.number] = reference.samples_per_second * ratio
    return out


def fastest_first(result: TuneResult, *, fitting_first: bool = False) -> list[TrialRecord]:
    """The winner, then the other measured trials fastest first on the side-by-side scale (``comparable_speeds``),
    with ``fitting_first`` those that fit before those that do not: the order people read in."""
    winner, speeds = result.best_trial, comparable_speeds(result)
    won = None if winner is None else winner.number
    others = sorted(
        (t for t in result.trials if t.samples_per_second is not None and t.number != won),
        key=lambda t: (fitting_first and not t.feasible, -speeds.get(t.number, t.samples_per_second or 0.0), t.number),
    )
    return ([winner] if winner is not None else []) + others
