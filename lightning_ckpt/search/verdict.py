"""The verdict of a side-by-side confirmation: how much faster a tuned plan is than the fastest fitting baseline,
with the interval the rounds support, and whether that is enough to choose it (``choice.CHOICE_RULE``).

A tuned plan's figure and the baseline's are paired by round (timed at the same moment of a shared machine, so their
ratio cancels its speed then). The verdict is their geometric mean and a Student-t interval on the log ratios (90%):
not a bootstrap, which over 3-8 rounds is overconfident exactly when it matters. A holdout verdict
(``confirmation.hold_out``, ``chosen_after``) comes from fresh rounds: the rounds that chose a plan favour it.

Pure Python (no torch): a plan file's verdict is read by ``lightning-ckpt show`` without importing torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["CONFIDENCE", "RATIO_BOUND", "Verdict", "paired_interval", "t_quantile"]

# The interval's coverage: a tuned plan is chosen when it is faster than the baseline with this confidence.
CONFIDENCE = 0.90

# Student's t, the 0.95 quantile (a two-sided 90% interval) by degrees of freedom 1..30; above, the normal's.
_T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip
_Z95 = 1.645

Outcome = Literal["tuned", "baseline", "undecided"]

# The largest speed ratio a plan file holds (``plan_schema.json``'s verdict ratios).
RATIO_BOUND = 1e6


def t_quantile(df: int) -> float:
    """The 0.95 quantile of Student's t with ``df`` degrees of freedom (the two-sided 90% interval's factor)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return _T95[df - 1] if df <= len(_T95) else _Z95


def paired_interval(
    reference_seconds: Mapping[int, float], candidate_seconds: Mapping[int, float]
) -> tuple[float | None, float | None, float | None, int]:
    """(ratio, low, high, rounds): the geometric mean of the candidate's per-round speed over the reference's in the
    rounds both ran, and its 90% t interval (None under two paired rounds: one has no spread; ``ratio``: under one)."""
    logs = [
        math.log(reference_seconds[r] / candidate_seconds[r])
        for r in sorted(reference_seconds.keys() & candidate_seconds.keys())
        if reference_seconds[r] > 0 and candidate_seconds[r] > 0
    ]
    n = len(logs)
    if n == 0:
        return None, None, None, 0
    mean = statistics.fmean(logs)
    if n < 2:
        return math.exp(mean), None, None, n
    half = t_quantile(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), n


@dataclass(frozen=True)
class Verdict:
    """A tuned plan (``candidate``; None: none was confirmed) against the fastest fitting baseline (``reference``):
    the candidate's speed over the reference's (``ratio``) and its interval, and what ``low`` must clear
    (``threshold``: ``1 + tie_tolerance``)."""

    reference: str
    candidate: str | None
    ratio: float | None
    low: float | None
    high: float | None
    rounds: int
    threshold: float
    confidence: float = CONFIDENCE
    # > 0: a holdout verdict: the figures come from fresh rounds, after the ``chosen_after`` rounds that chose the
    # candidate (which decided: the fresh rounds only have to confirm the direction, not clear the threshold again).
    chosen_after: int = 0

    @classmethod
    def of(
        cls,
        reference: str,
        reference_seconds: Mapping[int, float],
        candidate: str | None,
        candidate_seconds: Mapping[int, float] | None,
        *,
        tie_tolerance: float,
    ) -> Verdict:
        """The verdict from per-round seconds (per sample) of both plans, keyed by round index."""
        if candidate is None or candidate_seconds is None:
            return cls(reference, None, None, None, None, 0, 1.0 + tie_tolerance)
        ratio, low, high, n = paired_interval(reference_seconds, candidate_seconds)
        return cls(reference, candidate, ratio, low, high, n, 1.0 + tie_tolerance)

    @property
    def wins(self) -> bool:
        """Faster by more than the tie tolerance with ``confidence``; a holdout's fresh rounds find it faster at all."""
        if self.chosen_after:
            return self.ratio is not None and self.ratio > 1.0
        return self.low is not None and self.low > self.threshold

    @property
    def cannot_win(self) -> bool:
        """Even the interval's upper bound does not clear the threshold (a holdout's rounds are fixed: not ``wins``)."""
        if self.chosen_after:
            return not self.wins
        return self.high is not None and self.high <= self.threshold

    @property
    def decided(self) -> bool:
        return self.candidate is None or self.wins or self.cannot_win

    @property
    def outcome(self) -> Outcome:
        """``tuned``, ``baseline`` (clearly not faster enough), or ``undecided`` (the baseline is kept)."""
        if self.wins:
            return "tuned"
        return "baseline" if self.decided else "undecided"

    def describe(self) -> str:
        """``1.06x [1.03, 1.09] vs sqrt_segments, 6 rounds``, or ``32 fresh rounds after the 24 that chose it``."""
        name = self.reference.removeprefix("baseline:")
        if self.candidate is None or self.ratio is None:
            return f"{name} kept: no tuned plan was re-timed beside it"
        interval = f" [{self.low:.2f}, {self.high:.2f}]" if self.low is not None and self.high is not None else ""
        rounds = f"{self.rounds} round{'s' * (self.rounds != 1)}"
        if self.chosen_after:
            rounds = f"{self.rounds} fresh round{'s' * (self.rounds != 1)} after the {self.chosen_after} that chose it"
        return f"{self.ratio:.2f}x{interval} vs {name}, {rounds}"

    def explain(self) -> str:
        """Why the verdict decided as it did (the result line and the summary add what was kept)."""
        pct = f"{self.confidence:.0%}"
        if self.outcome == "tuned" and self.chosen_after:
            return (
                f"its {pct} interval over the {self.chosen_after} rounds that chose it cleared "
                f"{self.threshold - 1:.0%}; the fresh rounds' figure is shown"
            )
        if self.outcome == "tuned":
            return f"faster than the fastest fitting baseline by more than {self.threshold - 1:.0%} ({pct} interval)"
        if self.candidate is None:
            return "no tuned plan was re-timed beside it"
        if self.chosen_after:
            return "chosen by the confirmation's rounds but not faster in fresh rounds: the baseline is kept"
        if self.outcome == "baseline":
            return f"not faster by more than {self.threshold - 1:.0%} ({pct} interval)"
        return f"the machine could not separate them ({pct} interval)"

    def to_dict(self) -> dict[str, Any]:
        """As the plan file keeps it, clamped to ``RATIO_BOUND`` (a t interval with 1 degree of freedom can pass it)."""
        data = {**asdict(self), "outcome": self.outcome}
        for key in ("ratio", "low", "high"):
            if data[key] is not None:
                data[key] = min(max(float(data[key]), 0.0), RATIO_BOUND)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @classmethod
    def recorded(cls, search: Mapping[str, Any] | None) -> Verdict | None:
        """The verdict a plan's ``provenance.search`` records, None where it records none (or a malformed one)."""
        data = search.get("verdict") if isinstance(search, Mapping) else None
        if not isinstance(data, Mapping):
            return None
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError):
            return None
