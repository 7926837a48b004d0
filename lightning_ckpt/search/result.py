"""The outcome of a search: ``pipeline.conclude`` chooses; ``build_result``, a pure function of the records, the
chosen one and the facts, makes the ``TuneResult`` and the evidence the plan file and the reports read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.plan.format import Plan, library_versions
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus
from lightning_ckpt.search.phases import SearchCost
from lightning_ckpt.search.verdict import Verdict

__all__ = ["SearchFacts", "TuneResult", "build_result", "offload_figures"]


@dataclass(frozen=True)
class TuneResult:
    """The outcome of a search: the plan to use and the evidence for it."""

    best: Plan  # the chosen plan, with metadata (budget, measured figures, baselines, settings)
    best_trial: TrialRecord | None
    trials: tuple[TrialRecord, ...]
    budget: Budget
    tuning_seconds: float
    tuning_steps: int
    fell_back: bool = False  # nothing fit the budget; the lowest-memory plan was chosen
    fallback_message: str = ""  # the warning that said so (the callback repeats it on every fit)
    memory_table: str = ""  # the memory model's per-block breakdown, printable
    memory_breakdown: Mapping[str, Any] = field(default_factory=dict)  # the same as data
    # The Optuna study holding one trial per plan (``optuna.load_study(study_name=..., storage=...)`` when
    # ``storage`` is set; in memory, and gone with the process, when it is None). See ``ledger.py``.
    study_name: str | None = None
    storage: str | None = None
    cost: SearchCost | None = None  # the search's wall time by phase, and in plain steps (``phases.SearchCost``)

    @property
    def baselines(self) -> dict[str, TrialRecord]:
        return {t.baseline: t for t in self.trials if t.baseline is not None}

    @property
    def n_measured(self) -> int:
        return sum(t.status != TrialStatus.PRUNED for t in self.trials)


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
    none_fits: bool = False  # no checkpointing was predicted to fit and chosen without a search (``loop._none_fits``)
    fingerprint: str | None = None
    storage: str | None = None
    cost: SearchCost | None = None  # where the search's time went (``phases``)
    allowance: dict[str, Any] | None = None  # ``search_steps``, and what it stopped before a verdict


def evidence(
    best: TrialRecord, records: Sequence[TrialRecord], budget: Budget, facts: SearchFacts, fell_back: bool
) -> dict[str, Any]:
    """The chosen plan's provenance sections: the library versions, the budget, its measured figures, the baselines'
    (at its micro-batch) and the search's own account."""
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
    optional = {
        "none_fits": facts.none_fits or None,
        "time_model": facts.proposer_summary,
        "verdict": facts.verdict.to_dict() if facts.verdict is not None else None,
        "cost": facts.cost.to_dict() if facts.cost is not None else None,
        "allowance": dict(facts.allowance) if facts.allowance is not None else None,
    }
    search.update((k, v) for k, v in optional.items() if v is not None)
    return {
        "versions": library_versions(),
        "budget": budget.to_dict(),
        "measured": _measured_figures(best),
        "baselines": {
            t.baseline: {k: v for k, v in _measured_figures(t).items() if k in _BASELINE_FIGURES}
            for t in records
            if t.baseline is not None and t.micro_batch == best.micro_batch
        },
        "search": search,
    }


def offload_figures(trial: TrialRecord) -> dict[str, Any] | None:
    """What a trial's offloaded blocks did (None where none ran): host bytes held, the host pool's size, and the
    transfer backward waited for, predicted and measured (the step less its prediction without that wait)."""
    extra = trial.extra
    if not extra.get("offload_host_pool_bytes") and extra.get("offload_exposed_seconds") is None:
        return None
    predicted, error, measured = extra.get("offload_exposed_seconds"), trial.prediction_error, None
    if predicted is not None and error is not None and trial.predicted_seconds is not None:
        measured = max(0.0, trial.predicted_seconds / (1.0 + error) - (trial.predicted_seconds - predicted))
    return {
        "offloaded_bytes": extra.get("offload_host_peak_bytes"),
        "host_pool_bytes": extra.get("offload_host_pool_bytes"),
        "exposed_predicted_seconds": predicted,
        "exposed_measured_seconds": measured,
    }


# A baseline's figures in the plan file: the chosen plan's that bear on the comparison.
_BASELINE_FIGURES = ("status", "samples_per_second", "peak_bytes", "activation_bytes")


def _measured_figures(best: TrialRecord) -> dict[str, Any]:
    offload = offload_figures(best)
    return {
        **({"offload": offload} if offload is not None else {}),
        "label": best.label,
        "status": best.status.value,
        "samples_per_second": best.samples_per_second,
        "median_seconds": best.median_seconds,
        "peak_bytes": best.peak_bytes,
        "activation_bytes": best.activation_bytes,
        "predicted_peak_bytes": best.predicted_peak_bytes,
        "recompute_overhead": best.recompute_overhead,
    }


def build_result(
    best: TrialRecord,
    records: Sequence[TrialRecord],
    budget: Budget,
    facts: SearchFacts,
    *,
    fell_back: bool,
    fallback_message: str,
    tuning_seconds: float,
    tuning_steps: int,
    sections: Mapping[str, Any] | None = None,
    memory: Any = None,
) -> TuneResult:
    """The chosen plan named, fingerprinted and carrying its evidence and ``sections``; ``memory``: the memory model."""
    chosen = replace(best.plan, name=best.plan.name or "tuned", fingerprint=facts.fingerprint).with_provenance(
        **{**evidence(best, records, budget, facts, fell_back), **(sections or {})}
    )
    return TuneResult(
        best=chosen,
        best_trial=best,
        trials=tuple(records),
        budget=budget,
        tuning_seconds=tuning_seconds,
        tuning_steps=tuning_steps,
        fell_back=fell_back,
        fallback_message=fallback_message,
        memory_table=memory.table() if memory is not None else "",
        memory_breakdown=memory.to_dict() if memory is not None else {},
        study_name=facts.study_name,
        storage=facts.storage,
        cost=facts.cost,
    )
