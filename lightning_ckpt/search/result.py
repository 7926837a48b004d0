"""What a chosen plan's metadata says of how it was found: a pure function of the search's records and facts.

``Study.result`` chooses; this builds the evidence the plan file, ``lightning-ckpt show`` and the reports read
(the plan's own measured figures, every baseline's, what the search did), from values, not from the study.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.plan.format import library_versions
from lightning_ckpt.search.records import TrialRecord, TrialStatus
from lightning_ckpt.search.verdict import Verdict

__all__ = ["SearchFacts", "evidence"]


@dataclass(frozen=True)
class SearchFacts:
    """What the search was and did, beside its records: the settings and what the proposer and rounds found."""

    n_trials: int
    exhaustive: bool
    space_size: int
    seed: int
    sampler: str
    proposer: str
    study_name: str
    tie_tolerance: float
    speed_changes: tuple[str, ...] = ()
    proposer_summary: dict[str, Any] | None = None
    verdict: Verdict | None = None
    none_fits: bool = False  # no checkpointing was predicted to fit and chosen without a search (``Study._none_fits``)


def evidence(
    best: TrialRecord, records: Sequence[TrialRecord], budget: Budget, facts: SearchFacts, fell_back: bool
) -> dict[str, Any]:
    """The chosen plan's metadata: the library versions, the budget, its measured figures, the baselines' (at its
    micro-batch) and the search's own account."""
    search: dict[str, Any] = {
        "n_trials": facts.n_trials,
        "plans_considered": len(records),  # every plan the search scored: run, pruned or ruled out
        "exhaustive": facts.exhaustive,
        "space_size": facts.space_size,
        "seed": facts.seed,
        "sampler": facts.sampler,
        "proposer": facts.proposer,
        "study_name": facts.study_name,
        "status_counts": {s.value: n for s in TrialStatus if (n := sum(t.status == s for t in records))},
        "confirmed": sum(t.confirmed for t in records),
        "tie_tolerance": facts.tie_tolerance,
        "fell_back": fell_back,
        "speed_changes": list(facts.speed_changes),
    }
    if facts.none_fits:
        search["none_fits"] = True
    if facts.proposer_summary is not None:
        search["time_model"] = facts.proposer_summary
    if facts.verdict is not None:
        search["verdict"] = facts.verdict.to_dict()
    return {
        "versions": library_versions(),
        "budget": budget.to_dict(),
        "measured": _measured_figures(best),
        "baselines": {
            t.baseline: _baseline_figures(t)
            for t in records
            if t.baseline is not None and t.micro_batch == best.micro_batch
        },
        "search": search,
    }


def _measured_figures(best: TrialRecord) -> dict[str, Any]:
    return {
        "label": best.label,
        "status": best.status.value,
        "samples_per_second": best.samples_per_second,
        "median_seconds": best.median_seconds,
        "peak_bytes": best.peak_bytes,
        "activation_bytes": best.activation_bytes,
        "predicted_peak_bytes": best.predicted_peak_bytes,
        "recompute_overhead": best.recompute_overhead,
    }


def _baseline_figures(trial: TrialRecord) -> dict[str, Any]:
    return {
        "status": trial.status.value,
        "samples_per_second": trial.samples_per_second,
        "peak_bytes": trial.peak_bytes,
        "activation_bytes": trial.activation_bytes,
    }
