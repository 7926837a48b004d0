"""Rank agreement for the tuner: every rank runs the same trials in lockstep and sees the same results.

The tuner talks to a ``Sync`` (the callback adapts Lightning's strategy to it). Rank 0 owns the Optuna study and
broadcasts each decision; every rank measures the candidate on its own batch with no collective inside the step, so an
OOM on one rank cannot leave another waiting in an all-reduce; then the ranks gather their measurements and combine
them identically (``combine_trials``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from lightning_ckpt.budget import Budget
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus

__all__ = ["LocalSync", "Sync", "combine_trials"]


class Sync(Protocol):
    """What the tuner needs from a process group."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects)."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""


class LocalSync:
    """The ``Sync`` of a single process: the study's one loop, with nothing to agree on."""

    is_leader = True
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


def _max(values: Sequence[int | float | None]) -> Any:
    return max((v for v in values if v is not None), default=None)


def combine_trials(per_rank: Sequence[TrialRecord], budget: Budget) -> TrialRecord:
    """One record for a trial measured on every rank (``per_rank`` in rank order)."""
    lead = per_rank[0]
    if len(per_rank) == 1:
        return lead
    status = min((t.status for t in per_rank), key=lambda s: TrialStatus(s).severity)
    peak = _max([t.peak_bytes for t in per_rank])
    activation = _max([t.activation_bytes for t in per_rank])
    sps, median = None, _max([t.median_seconds for t in per_rank])
    if status == TrialStatus.OK and all(t.samples_per_second and t.median_seconds for t in per_rank):
        # Ranks step together, so the global step takes as long as the slowest rank's.
        samples = sum((t.samples_per_second or 0.0) * (t.median_seconds or 0.0) for t in per_rank)
        sps = samples / median
    if status == TrialStatus.OK and not budget.fits(peak, activation):
        status = TrialStatus.OVER_BUDGET
    errors = [f"rank {i}: {t.error}" for i, t in enumerate(per_rank) if t.error]
    figures = [
        {"status": str(t.status), "samples_per_second": t.samples_per_second, "peak_bytes": t.peak_bytes}
        for t in per_rank
    ]
    return replace(
        lead,
        status=status,
        peak_bytes=peak,
        activation_bytes=activation,
        samples_per_second=sps if TrialStatus(status).ran else None,
        median_seconds=median,
        spread_seconds=_max([t.spread_seconds for t in per_rank]),
        seconds=_max([t.seconds for t in per_rank]) or 0.0,
        steps=_max([t.steps for t in per_rank]) or 0,
        error="; ".join(errors) or None,
        extra={**lead.extra, "ranks": len(per_rank), "per_rank": figures},
    )
