"""The side-by-side confirmation: re-time the leaders in interleaved rounds, so the choice compares figures
taken at the same moments of a shared machine, never a trial measured in a slow moment against one that was not.

Both searches confirm the same way (``Study.confirm`` within one micro-batch, ``tune_micro_batch`` across
micro-batches): ``confirm_interleaved`` times the entries, ``apply_confirmation`` puts its figures into the
records, and ``confirmed_tie_tolerance`` widens the tie tolerance to what those figures resolve.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from lightning_ckpt.measure.measurement import median_and_spread
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.distributed import LocalSync, Sync
from lightning_ckpt.search.records import TrialRecord
from lightning_ckpt.search.runners import TrialRunner

__all__ = [
    "ConfirmEntry",
    "SideBySide",
    "apply_confirmation",
    "confirm_interleaved",
    "confirmed_tie_tolerance",
    "retimer",
    "speed_change",
]

# A statistical tie (leaders closer than their measured spread) goes to lower memory, but never at the
# cost of more than this much throughput.
_MAX_STATISTICAL_TIE = 0.015
# A reference re-timed this much faster or slower than before, or confirmation rounds whose common speed
# differs this much, mean the machine's speed changed (another job, throttled clocks, a stalling loader):
# the figures taken before and after are not compared. Same-moment noise on a busy 2-core machine stays
# well within it (6% step-time noise in the tests).
_SPEED_CHANGE = 0.15


@dataclass(frozen=True)
class ConfirmEntry:
    """A candidate to re-time: its record, how to time one round (seconds of a step, None if it failed), and
    how many samples one step processes (candidates at different micro-batches compare per sample)."""

    trial: TrialRecord
    time_step: Callable[[], float | None]
    samples_per_step: int
    steps_per_round: int = 1  # training steps one round costs this candidate (tuning cost)


def confirm_interleaved(
    entries: Sequence[ConfirmEntry], *, min_rounds: int, max_rounds: int, sync: Sync | None = None
) -> SideBySide:
    """Re-time ``entries`` in interleaved rounds until the leader's median separates from the runner-up's
    beyond their spreads (MAD), or ``max_rounds``; seconds per sample by trial number (``SideBySide``).

    Interleaving puts every candidate through the same slow and fast moments of a shared machine, and the
    order alternates (forward, then backward) so a change part-way through a round falls on both ends
    alike. When the rounds' common speed differs by more than ``_SPEED_CHANGE`` (the machine's speed
    changed during the confirmation), every round is run and each figure is divided by its round's speed,
    so candidates are compared within rounds, never across moments.
    """
    sync = sync or LocalSync()
    rounds: list[dict[int, float]] = []
    for done in range(1, max_rounds + 1):
        row: dict[int, float] = {}
        for e in entries if done % 2 else reversed(entries):
            seconds = e.time_step()
            gathered = sync.all_gather(seconds)  # ranks step together: a step is as slow as the slowest rank
            if all(g is not None for g in gathered):
                row[e.trial.number] = max(gathered) / (e.samples_per_step * sync.world_size)
        rounds.append(row)
        result = SideBySide.of(rounds, [e.trial.number for e in entries])
        if done >= min_rounds and not result.speed_changed and _separated(result.per_sample):
            break
    return result


@dataclass(frozen=True)
class SideBySide:
    """Confirmation figures: seconds per sample by trial number (divided by each round's common speed when
    that changed), and those speeds (1.0 = the median round)."""

    per_sample: dict[int, list[float]]
    round_speeds: tuple[float, ...]

    @property
    def speed_changed(self) -> bool:
        return _speeds_differ(self.round_speeds)

    @classmethod
    def of(cls, rounds: Sequence[Mapping[int, float]], numbers: Sequence[int]) -> SideBySide:
        typical = {n: statistics.median(vals) for n in numbers if (vals := [r[n] for r in rounds if n in r])}
        # A round's speed: its figures against each candidate's typical one (the median candidate's ratio).
        speeds = tuple(statistics.median(r[n] / typical[n] for n in r if typical.get(n)) if r else 1.0 for r in rounds)
        changed = _speeds_differ(speeds)
        per_sample = {
            n: [r[n] / (speed if changed else 1.0) for r, speed in zip(rounds, speeds, strict=True) if n in r]
            for n in numbers
        }
        return cls(per_sample, speeds)


def _speeds_differ(speeds: Sequence[float]) -> bool:
    return bool(speeds) and max(speeds) > min(speeds) * (1 + _SPEED_CHANGE)


def speed_change(before_seconds: float | None, after_seconds: float | None, spread: float = 0.0) -> float | None:
    """``after / before`` speed of one plan timed twice, when it differs by more than ``_SPEED_CHANGE`` (widened
    to three relative spreads of the first figure); None when it does not, or cannot be told.

    Compared as a factor, the same either way: a speed ratio can fall at most 100% but rise without bound, so
    with a noisy first figure (two steps on a loaded machine: a 30% spread) a 5x slowdown (0.2x) would stay
    "within the noise" as a difference while a 5x speedup would not."""
    if not before_seconds or not after_seconds:
        return None
    ratio = before_seconds / after_seconds
    tolerance = max(_SPEED_CHANGE, 3 * spread / before_seconds)
    return ratio if abs(math.log(ratio)) > math.log1p(tolerance) else None


def _separated(per_sample: Mapping[int, Sequence[float]]) -> bool:
    stats = sorted(median_and_spread(v) for v in per_sample.values() if v)
    if len(stats) < 2:
        return True
    (m1, d1), (m2, d2) = stats[0], stats[1]
    return m2 - m1 > d1 + d2


def apply_confirmation(
    records: Sequence[TrialRecord],
    entries: Sequence[ConfirmEntry],
    per_sample: Mapping[int, Sequence[float]],
) -> list[TrialRecord]:
    """``records`` with each re-timed trial's throughput replaced by its side-by-side figure."""
    samples = {e.trial.number: e.samples_per_step for e in entries}
    round_steps = {e.trial.number: e.steps_per_round for e in entries}
    out = list(records)
    for i, t in enumerate(out):
        times = per_sample.get(t.number)
        if not times:
            continue
        med, per_step = statistics.median(times), samples[t.number]
        out[i] = replace(
            t,
            samples_per_second=1.0 / med,
            median_seconds=med * per_step,
            steps=t.steps + len(times) * round_steps[t.number],
            confirmation_seconds=tuple(x * per_step for x in times),
            first_samples_per_second=t.first_samples_per_second or t.samples_per_second,
        )
    return out


def confirmed_tie_tolerance(per_sample: Mapping[int, Sequence[float]], tie_tolerance: float) -> float:
    """``tie_tolerance`` widened to the uncertainty of the side-by-side medians (relative MAD / sqrt(rounds)),
    at most ``_MAX_STATISTICAL_TIE``: candidates closer than the machine resolves are a statistical tie,
    which goes to lower memory."""
    stats = [(median_and_spread(v), len(v)) for v in per_sample.values() if v]
    errors = [mad / med / math.sqrt(n) for (med, mad), n in stats if med > 0]
    return max(tie_tolerance, min(_MAX_STATISTICAL_TIE, statistics.median(errors))) if errors else tie_tolerance


def retimer(runner: TrialRunner, plan: Plan, steps: int) -> Callable[[], float | None]:
    """One confirmation round of ``plan`` through ``runner``: its median step seconds, None if it failed."""

    def time_step() -> float | None:
        m = runner.retime(plan, steps)
        return m.median_seconds if m.status == "ok" else None

    return time_step
