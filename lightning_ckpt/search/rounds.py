"""The side-by-side confirmation: leaders re-timed in interleaved rounds, so the choice compares figures taken at the
same moments of a shared machine. ``confirm_interleaved`` times entries until ``SideBySide`` decides every tuned
plan's ``verdict.Verdict`` against the fastest baseline (and, in ``confirmation.hold_out``, re-times the winner in
fresh rounds for the claim); ``apply_confirmation`` puts the figures into the records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, replace

from lightning_ckpt.measure.measurement import median_and_spread
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.distributed import LocalSync, Sync
from lightning_ckpt.search.ledger import TrialRecord
from lightning_ckpt.search.runners import TrialRunner
from lightning_ckpt.search.verdict import Verdict, paired_interval

__all__ = [
    "CLAIM_HALF_WIDTH",
    "ConfirmEntry",
    "RoundProgress",
    "SideBySide",
    "apply_confirmation",
    "beats_by",
    "confirm_interleaved",
    "retimer",
    "reported_verdict",
    "speed_change",
    "verdict_between",
]

# A reference re-timed this much faster or slower than before, or confirmation rounds whose common speed
# differs this much, mean the machine's speed changed (another job, throttled clocks, a stalling loader):
# the figures taken before and after are not compared. Same-moment noise on a busy 2-core machine stays
# well within it (6% step-time noise in the tests).
_SPEED_CHANGE = 0.15

# The held-out rounds go on (up to ``holdout_max_rounds``) until the claimed ratio's 90% interval is within this
# factor either side: a claim is then within ~5% of an outside re-timing of the same plans (the repeatability
# benchmark's target), where 3 rounds of 1+3 steps left it 6% wide on a 2-core CPU. On a quiet GPU (1% step noise)
# the fewest rounds already are.
CLAIM_HALF_WIDTH = 0.03


@dataclass(frozen=True)
class ConfirmEntry:
    """A candidate to re-time: its record, how to time one round (seconds of a step, None if it failed), and
    how many samples one step processes (candidates at different micro-batches compare per sample)."""

    trial: TrialRecord
    time_step: Callable[[], float | None]
    samples_per_step: int
    steps_per_round: int = 1  # training steps one round costs this candidate (tuning cost)
    warmup_steps: int = 0  # untimed steps its first round adds (tuning cost)


# ``on_step(round, max_rounds, timed, to_time, side)``: ``timed`` of round ``round``'s ``to_time`` plans timed, and
# the figures so far, for a progress line.
RoundProgress = Callable[[int, int, int, int, "SideBySide"], None]


def confirm_interleaved(
    entries: Sequence[ConfirmEntry],
    *,
    min_rounds: int,
    max_rounds: int,
    tie_tolerance: float = 0.0,
    sync: Sync | None = None,
    until: Callable[[SideBySide], bool] | None = None,
    check_stop: Callable[[], None] | None = None,
    on_step: RoundProgress | None = None,
    left: Callable[[], float | None] | None = None,
    reserve_steps: int = 0,
) -> SideBySide:
    """Re-time ``entries`` in interleaved rounds (every candidate through the same slow and fast moments of a shared
    machine) until the verdict is decided (or ``until`` says the figures are enough), or ``max_rounds``, or the
    allowance cannot pay for the next round (``stopped_by_allowance``). After ``min_rounds`` a settled entry stops
    being timed; a tuned plan that can win is timed for all ``max_rounds``: stopping as its interval cleared the
    threshold reported the noise's luckiest moment (claims 8-12% above an outside re-timing).

    ``left()``: the seconds the search's allowance has left (None: unbounded); a round starts only where it and
    ``reserve_steps`` more (the fresh rounds' floor) fit, at the seconds per step the last round cost. ``on_step``:
    after each plan timed (a round of six plans took 90 s on a loaded 2-core machine: a line that moved only between
    rounds looked hung)."""
    sync, on_step = sync or LocalSync(), on_step or (lambda *_: None)
    rounds: list[dict[int, float]] = []
    numbers = [e.trial.number for e in entries]
    baselines = {e.trial.number for e in entries if e.trial.baseline is not None}
    active = list(entries)
    result = SideBySide.of(rounds, numbers, baselines)
    # Seconds per step timed: from the search's figures until a round measured it (overhead included).
    per_step = statistics.fmean([e.trial.median_seconds or 0.0 for e in entries]) if entries else 0.0
    for done in range(1, max_rounds + 1):
        if check_stop is not None:
            check_stop()  # a stop request (SIGTERM) ends the search between rounds as between trials
        order = _round_order(active, done)
        steps = sum(e.steps_per_round + (e.warmup_steps if done == 1 else 0) for e in order)
        before = left() if left is not None else None
        # Rank 0's clock decides, for every rank: each rank's own would stop the ranks' collectives at different rounds.
        if left is not None and sync.broadcast(before is not None and before < per_step * (steps + reserve_steps)):
            return replace(result, stopped_by_allowance=True)
        row: dict[int, float] = {}
        on_step(done, max_rounds, 0, len(order), result)
        for i, e in enumerate(order, 1):
            seconds = e.time_step()
            gathered = sync.all_gather(seconds)  # ranks step together: a step is as slow as the slowest rank
            if all(g is not None for g in gathered):
                row[e.trial.number] = max(gathered) / (e.samples_per_step * sync.world_size)
            if i < len(order):
                on_step(done, max_rounds, i, len(order), result)
        rounds.append(row)
        after = left() if before is not None and left is not None else None
        if after is not None and steps:
            per_step = max(0.0, before - after) / steps
        result = SideBySide.of(rounds, numbers, baselines)
        on_step(done, max_rounds, len(order), len(order), result)
        # Where the allowance cannot pay for the floor, the rounds after it start from the second (the first with an
        # interval): settled plans stop being timed, and a decided choice ends them, rather than a cut left undecided.
        # Rank 0's clock decides here too: a rank that went on to the next round while rank 0 stopped waited for it
        # in that round's broadcast for ever (the FSDP2 test's hang, rank 0 already verifying the chosen plan).
        floor = (min_rounds - done) * sum(e.steps_per_round for e in active) + reserve_steps
        if done < min_rounds and not (
            done >= 2 and left is not None and sync.broadcast(after is not None and after < per_step * floor)
        ):
            continue
        if until(result) if until is not None else result.decided(tie_tolerance):
            break
        settled = result.settled(tie_tolerance)
        active = [e for e in active if e.trial.number not in settled]
    return result


@dataclass(frozen=True)
class SideBySide:
    """Confirmation figures: seconds per sample by trial number (divided by each round's common speed when that
    changed, for display), those speeds (1.0 = the median round), and each round's raw figures for the paired
    verdicts."""

    per_sample: dict[int, list[float]]
    round_speeds: tuple[float, ...]
    rounds: tuple[dict[int, float], ...] = ()
    baselines: frozenset[int] = frozenset()
    stopped_by_allowance: bool = False  # the search's allowance ended the rounds (``confirm_interleaved``'s ``left``)

    @property
    def speed_changed(self) -> bool:
        return _speeds_differ(self.round_speeds)

    @classmethod
    def of(
        cls, rounds: Sequence[Mapping[int, float]], numbers: Sequence[int], baselines: Set[int] = frozenset()
    ) -> SideBySide:
        typical = {n: statistics.median(vals) for n in numbers if (vals := [r[n] for r in rounds if n in r])}
        # A round's speed: its figures against each candidate's typical one (the median candidate's ratio).
        speeds = tuple(statistics.median(r[n] / typical[n] for n in r if typical.get(n)) if r else 1.0 for r in rounds)
        changed = _speeds_differ(speeds)
        per_sample = {
            n: [r[n] / (speed if changed else 1.0) for r, speed in zip(rounds, speeds, strict=True) if n in r]
            for n in numbers
        }
        return cls(per_sample, speeds, tuple(dict(r) for r in rounds), frozenset(baselines))

    def by_round(self, number: int) -> dict[int, float]:
        """``number``'s seconds per sample keyed by round index (only the rounds it was timed in)."""
        return {i: r[number] for i, r in enumerate(self.rounds) if number in r}

    @property
    def reference(self) -> int | None:
        """The fastest baseline re-timed (by median seconds per sample): what a tuned plan must beat. The same rule
        as ``records.choose_best``'s reference (the highest samples/s, which ``apply_confirmation`` sets from these
        medians), so the baseline the rounds settle on is the one the choice keeps."""
        timed = [n for n in self.baselines if self.per_sample.get(n)]
        return min(timed, key=lambda n: statistics.median(self.per_sample[n]), default=None)

    def verdict(
        self, number: int, labels: Mapping[int, str], tie_tolerance: float, *, reference: int | None = None
    ) -> Verdict | None:
        """Trial ``number`` against ``reference`` (default: the fastest baseline re-timed), from the rounds both ran
        in; None without a reference."""
        ref = self.reference if reference is None else reference
        if ref is None:
            return None
        candidate = None if number == ref else labels.get(number, str(number))
        return Verdict.of(
            labels.get(ref, str(ref)),
            self.by_round(ref),
            candidate,
            self.by_round(number) if candidate is not None else None,
            tie_tolerance=tie_tolerance,
        )

    def tuned(self) -> list[int]:
        return [n for n in self.per_sample if n not in self.baselines and self.per_sample[n]]

    def decided(self, tie_tolerance: float) -> bool:
        """No tuned entry can win against the reference any more, and every other baseline is clearly slower than
        the reference (without a reference: the leader is separated): further rounds could not change the choice."""
        ref = self.reference
        if ref is None:
            return _separated(self.per_sample)
        # Which baseline is the reference must be settled too: the one kept is then the fastest, not the one a
        # noisy round favoured (a 3-round tie between baselines once kept one 0.82x the fastest).
        others = {b for b in self.baselines - {ref} if self.per_sample.get(b)}
        return {*self.tuned(), *others} <= self.settled(tie_tolerance)

    def choice_decided(self, tie_tolerance: float) -> bool:
        """The choice these rounds make is settled, where a hold-out gives the claim: ``decided``, or a tuned plan
        wins against every baseline that could still be the reference (whichever it is, it is beaten) and the leading
        tuned plan is decided either way. More rounds could change only the claim, which the fresh rounds give."""
        if self.decided(tie_tolerance):
            return True
        ref = self.reference
        if ref is None:
            return False
        settled = self.settled(tie_tolerance)
        candidates = [b for b in self.baselines if self.per_sample.get(b) and b not in settled] or [ref]

        def beats_every_candidate(n: int) -> bool:
            verdicts = (self.verdict(n, {}, tie_tolerance, reference=b) for b in candidates)
            return all(v is not None and v.wins for v in verdicts)

        tuned = self.tuned()
        if not any(beats_every_candidate(n) for n in tuned):
            return False
        leader = min(tuned, key=lambda n: statistics.median(self.per_sample[n]))
        lead = self.verdict(leader, {}, tie_tolerance)
        return lead is not None and (lead.cannot_win or beats_every_candidate(leader))

    def settled(self, tie_tolerance: float) -> set[int]:
        """Entries further rounds need not time: tuned plans that cannot win, baselines clearly slower than the
        reference (the reference's interval over them lies above 1)."""
        ref = self.reference
        if ref is None:
            return set()
        out = {n for n in self.tuned() if (v := self.verdict(n, {}, tie_tolerance)) is not None and v.cannot_win}
        for b in self.baselines - {ref}:
            low = paired_interval(self.by_round(b), self.by_round(ref))[1]  # the reference's speed over b's
            if low is not None and low > 1.0:
                out.add(b)
        return out


def _round_order(entries: Sequence[ConfirmEntry], round_number: int) -> list[ConfirmEntry]:
    """Round ``round_number``'s order (from 1): rotated one entry further each round, and reversed in every other
    cycle of ``len(entries)`` rounds, so each entry runs in each position, after each neighbour, equally often
    (a plain alternation of direction would cancel the rotation for two entries: always the same one first)."""
    n = len(entries)
    if n == 0:
        return []
    shift = (round_number - 1) % n
    order = [*entries[shift:], *entries[:shift]]
    return order[::-1] if ((round_number - 1) // n) % 2 else order


def _speeds_differ(speeds: Sequence[float]) -> bool:
    return bool(speeds) and max(speeds) > min(speeds) * (1 + _SPEED_CHANGE)


def speed_change(before_seconds: float | None, after_seconds: float | None, spread: float = 0.0) -> float | None:
    """``after / before`` speed of one plan timed twice, when it differs by more than ``_SPEED_CHANGE`` (widened
    to three relative spreads of the first figure); None when it does not, or cannot be told. Compared as a factor,
    the same either way: as a difference, with a noisy first figure a 5x slowdown would stay "within the noise"
    while a 5x speedup would not."""
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
    *,
    confirmed: bool = True,
) -> list[TrialRecord]:
    """``records`` with each re-timed trial's throughput replaced by its side-by-side figure; ``confirmed=False``
    (a re-ranking round) leaves its confirmation figures as they were."""
    by_number = {e.trial.number: e for e in entries}
    out = list(records)
    for i, t in enumerate(out):
        times = per_sample.get(t.number)
        if not times:
            continue
        e, med = by_number[t.number], statistics.median(times)
        out[i] = replace(
            t,
            samples_per_second=1.0 / med,
            median_seconds=med * e.samples_per_step,
            steps=t.steps + len(times) * e.steps_per_round + e.warmup_steps,
            confirmation_seconds=tuple(x * e.samples_per_step for x in times) if confirmed else t.confirmation_seconds,
            first_samples_per_second=t.first_samples_per_second or t.samples_per_second,
        )
    return out


def verdict_between(
    side: SideBySide | None, trial: TrialRecord, reference: TrialRecord, tie_tolerance: float
) -> Verdict | None:
    """``trial`` against ``reference`` from the paired rounds of ``side``; None where either was not re-timed."""
    if side is None or not side.by_round(trial.number) or not side.by_round(reference.number):
        return None
    labels = {trial.number: trial.label, reference.number: reference.label}
    return side.verdict(trial.number, labels, tie_tolerance, reference=reference.number)


def reported_verdict(
    side: SideBySide | None, records: Sequence[TrialRecord], best: TrialRecord, tie_tolerance: float
) -> Verdict | None:
    """The verdict the reports show for a choice: the chosen tuned plan's against the fastest confirmed fitting
    baseline, or, when a baseline is kept, the best confirmed tuned plan's against it (why it was kept); None
    without a confirmed fitting baseline (nothing to compare against)."""
    confirmed = [t for t in records if t.feasible and t.confirmed and t.samples_per_second]
    baselines = [t for t in confirmed if t.baseline is not None]
    if not baselines:
        return None
    reference = max(baselines, key=lambda t: t.samples_per_second or 0.0)
    if best.baseline is None:
        return verdict_between(side, best, reference, tie_tolerance)
    tuned = [v for t in confirmed if t.baseline is None and (v := verdict_between(side, t, reference, tie_tolerance))]
    if not tuned:
        return Verdict.of(reference.label, {}, None, None, tie_tolerance=tie_tolerance)
    return max(tuned, key=lambda v: v.ratio or 0.0)


def beats_by(side: SideBySide | None, tie_tolerance: float) -> Callable[[TrialRecord, TrialRecord], bool | None]:
    """``choice.choose_best``'s ``beats`` from the confirmation ``side``: a tuned plan's verdict against the reference
    decides whether it wins; for a pair not re-timed side by side, None (the figures decide), or False where the
    allowance ended the rounds first (undecided: the reference is kept)."""

    def beats(trial: TrialRecord, reference: TrialRecord) -> bool | None:
        verdict = verdict_between(side, trial, reference, tie_tolerance)
        if verdict is None and side is not None and side.stopped_by_allowance:
            return False
        return verdict.wins if verdict is not None else None

    return beats


def retimer(runner: TrialRunner, plan: Plan, steps: int, *, warm: bool = True) -> Callable[[], float | None]:
    """One confirmation round of ``plan`` through ``runner``: its median step seconds, None if it failed. Only the
    first round has a warm-up step (none without ``warm``: a plan timed moments ago): a plan switch is a forward
    patch, and a step after another plan's step measured as fast as one after its own
    (``benchmarks/step_alternation.py``)."""
    rounds = 0

    def time_step() -> float | None:
        nonlocal rounds
        m = runner.retime(plan, steps, warmup=1 if rounds == 0 and warm else 0)
        rounds += 1
        return m.median_seconds if m.status == "ok" else None

    return time_step
