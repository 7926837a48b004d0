"""A study's confirmation: the leaders and every fitting baseline re-timed side by side, the speed change between
the search and the rounds, and the held-out rounds that keep a winner honest.

``confirm.py`` owns the rounds themselves (interleaving, paired ratios, when a verdict is decided); this module owns
what a ``Study`` does with them: which trials enter (the proposer's leaders and the fitting baselines), re-ranking
when the machine's speed changed since the search, and the hold-out of the chosen tuned plan. It reads and writes
the study's records and its ``side``, ``held_out`` and ``speed_changes``, which the reports and the plan file show.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from lightning_ckpt.search.confirm import (
    ConfirmEntry,
    RoundProgress,
    SideBySide,
    apply_confirmation,
    confirm_interleaved,
    holdout,
    retimer,
    speed_change,
)
from lightning_ckpt.search.distributed import Sync
from lightning_ckpt.search.proposers import Proposer, fastest_fitting
from lightning_ckpt.search.records import VS_REFERENCE, ProgressFn, TrialRecord, announce_confirmation
from lightning_ckpt.search.verdict import Verdict

__all__ = ["Confirmation", "ConfirmedStudy", "leader_of", "vs_reference_note"]

log = logging.getLogger(__name__)

# After a speed change, at most this many fitting trials are re-ranked side by side before the confirmation.
_MAX_RERANKED = 24
# The fitting baselines every confirmation re-times beside the leaders: all of them in a search of one shape (at
# most five), the fastest this many by their search figures in the joint search (five per micro-batch).
_MAX_REFERENCES = 6


class ConfirmedStudy(Protocol):
    """What a confirmation reads and writes of its study (``study.Study`` is one)."""

    records: list[TrialRecord]
    by_key: Mapping[str, TrialRecord]
    config: Any
    sync: Sync
    progress: ProgressFn | None
    proposer: Proposer
    tie_tolerance: float
    side: SideBySide | None
    held_out: Verdict | None
    speed_changes: list[str]
    check_stop: Callable[[], None]

    def workload(self, micro_batch: int | None) -> Any: ...

    def update(self, trial: TrialRecord) -> None: ...

    def verify(self, trials: Sequence[TrialRecord]) -> None: ...


class Confirmation:
    """The confirmation of one ``study`` (see the module docstring)."""

    def __init__(self, study: ConfirmedStudy) -> None:
        self.study = study

    def run(self) -> None:
        """Re-time the proposer's leaders and every fitting baseline side by side, in interleaved rounds, until each
        leader's verdict against the fastest baseline is decided (``verdict.py``) or ``confirm_max_rounds``.

        The choice then rests on figures taken side by side, paired by round, never on one trial measured in a
        slow moment. The machine's speed may also change between the search and the confirmation (another job
        starts, clocks throttle): the reference (the fastest fitting baseline) is re-timed first and compared with
        its search figure; when its speed changed, the search's figures were taken at different speeds and cannot
        pick the leaders, so every fitting trial is re-ranked in one interleaved round first. ``speed_changes``
        says what was seen.
        """
        config = self.study.config
        if config.confirm_top <= 0:
            return
        chosen = self._leaders(config.confirm_top)
        if len(chosen) < 2:
            return
        if self._speed_changed_since_search(chosen, config.measure_steps):
            self._rerank(config.confirm_steps)
            chosen = self._leaders(config.confirm_top)
        announce_confirmation(self.study.progress, chosen)
        entries = self._entries(chosen, config.confirm_steps)
        # With a hold-out the claim comes from fresh rounds (``held_out``), so these rounds only choose: they stop
        # once the choice is decided (``SideBySide.choice_decided``). Without one they are the claim, and a plan that
        # can win is timed for every round (``confirm_interleaved``): stopping as it clears would report its luckiest
        # moment.
        tol = config.tie_tolerance
        side = confirm_interleaved(
            entries,
            min_rounds=config.confirm_rounds,
            max_rounds=config.confirm_max_rounds,
            tie_tolerance=tol,
            sync=self.study.sync,
            until=(lambda s: s.choice_decided(tol)) if config.holdout_rounds > 0 else None,
            check_stop=self.study.check_stop,
            on_step=self._on_step("confirming", chosen),
        )
        if side.speed_changed:
            self.study.speed_changes.append(
                f"during the confirmation rounds (speeds {', '.join(f'{v:.2f}' for v in side.round_speeds)} of the "
                "median round): the verdicts compare plans within rounds, and each figure shown was divided by its "
                "round's speed"
            )
        self.study.records = apply_confirmation(self.study.records, entries, side.per_sample)
        self._note_vs_reference(side, {t.number: t.label for t in chosen})
        for t in self.study.records:
            if t.number in side.per_sample:
                self.study.update(t)
        self.study.side = side

    def _note_vs_reference(self, side: SideBySide, labels: Mapping[int, str]) -> None:
        """Each re-timed trial's speed over the reference from the rounds both ran in (``extra[VS_REFERENCE]``): the
        figure a report can set beside the winner's. Their samples/s are not: the rounds run for minutes on a shared
        machine, and a leader timed in a fast stretch read 3.62 samples/s beside a winner at 2.7 (issue #64)."""
        ref = side.reference
        for i, t in enumerate(self.study.records):
            if t.number not in side.per_sample or ref is None:
                continue
            verdict = side.verdict(t.number, labels, self.study.tie_tolerance) if t.number != ref else None
            note = vs_reference_note(verdict, labels.get(ref, str(ref)), len(side.by_round(ref)))
            if note is not None:
                self.study.records[i] = replace(t, extra={**t.extra, VS_REFERENCE: note})

    def _leaders(self, top: int) -> list[TrialRecord]:
        """What the confirmation re-times: the proposer's leaders among the tuned plans, and every fitting baseline
        (at most a handful: the fastest of them is the reference a tuned plan must beat, whatever its first
        figure). Their memory stays predicted where the model is exact (CPU) until one is chosen: ``choose``
        verifies the winner, and chooses again if it does not fit."""
        feasible = fastest_fitting(self.study.records)
        tuned = [t for t in feasible if t.baseline is None]
        references = [t for t in feasible if t.baseline is not None][:_MAX_REFERENCES]
        leaders = self.study.proposer.leaders(tuned, top) + references
        return sorted(leaders, key=lambda t: -(t.samples_per_second or 0.0))

    def _reference(self, leaders: Sequence[TrialRecord]) -> TrialRecord:
        """The plan whose speed is compared before and after: the fastest fitting baseline, else the leader."""
        baselines = [t for t in leaders if t.baseline is not None]
        return max(baselines or leaders, key=lambda t: t.samples_per_second or 0.0)

    def _speed_changed_since_search(self, leaders: Sequence[TrialRecord], steps: int) -> bool:
        """Re-time the reference once; True if its speed changed since the search timed it."""
        reference = self._reference(leaders)
        m = self.study.workload(reference.micro_batch).runner.retime(reference.plan, steps)
        seconds = m.median_seconds if m.status == "ok" else None
        gathered = self.study.sync.all_gather(seconds)
        now = max(gathered) if all(g is not None for g in gathered) else None
        ratio = speed_change(reference.median_seconds, now, reference.spread_seconds or 0.0)
        if ratio is None:
            return False
        self.study.speed_changes.append(
            f"between the search and the confirmation: {reference.label} re-timed at {ratio:.2f}x its search speed; "
            "every fitting plan was re-ranked side by side"
        )
        log.warning(
            "lightning_ckpt: the machine's speed changed during the search (%s re-timed at %.2fx its search "
            "speed): every fitting plan was re-ranked side by side.",
            reference.label,
            ratio,
        )
        return True

    def _rerank(self, steps: int) -> None:
        """One interleaved round over the fitting trials (at most ``_MAX_RERANKED``), ``steps`` timed steps each (the
        confirmation's: steps back to back share the machine's moment, so one is enough to rank at one speed):
        figures taken side by side replace the search's, so the leaders are picked at one speed. They do not count
        as confirmed."""
        entries = self._entries(fastest_fitting(self.study.records)[:_MAX_RERANKED], steps)
        side = confirm_interleaved(
            entries,
            min_rounds=1,
            max_rounds=1,
            sync=self.study.sync,
            check_stop=self.study.check_stop,
            on_step=self._on_step("re-ranking", [e.trial for e in entries]),
        )
        for i, t in enumerate(self.study.records):
            times = side.per_sample.get(t.number)
            if times:
                self.study.records[i] = replace(
                    t,
                    samples_per_second=1.0 / times[0],
                    median_seconds=times[0] * self.study.workload(t.micro_batch).samples_per_step,
                    steps=t.steps + steps + 1,
                    first_samples_per_second=t.first_samples_per_second or t.samples_per_second,
                )
                self.study.update(self.study.records[i])

    def _on_step(self, phase: str, trials: Sequence[TrialRecord]) -> RoundProgress | None:
        """What moves the progress line during ``phase``'s rounds, where the study's progress listens (a reporter with
        a ``rounds`` method, ``report.SearchProgress``): the round, the plans timed in it, and the current leader with
        its interval against the reference, from the rounds so far."""
        report = getattr(self.study.progress, "rounds", None)
        if report is None:
            return None
        labels = {t.number: t.label for t in trials}
        tol = self.study.tie_tolerance

        def on_step(done: int, max_rounds: int, timed: int, to_time: int, side: SideBySide) -> None:
            report(phase, done, max_rounds, timed, to_time, leader_of(side, labels, tol))

        return on_step

    def _entries(self, trials: Sequence[TrialRecord], steps: int, *, warm: bool = True) -> list[ConfirmEntry]:
        """``trials`` to re-time side by side, ``steps`` timed steps a round each (and, ``warm``, one warm-up in the
        first)."""
        entries = []
        for t in trials:
            w = self.study.workload(t.micro_batch)
            timer = retimer(w.runner, t.plan, steps, warm=warm)
            entries.append(ConfirmEntry(t, timer, w.samples_per_step, steps, 1 if warm else 0))
        return entries

    def held_out(self, best: TrialRecord) -> TrialRecord:
        """``best``, or the reference where fresh rounds (``confirm.holdout``, ``holdout_rounds``) do not find the
        tuned plan the confirmation chose faster than it. Their figures replace both plans' confirmation figures,
        so the plan file's throughput and its verdict say the same."""
        steps = self.study.config.confirm_steps
        self.study.records, reference, self.study.held_out = holdout(
            best,
            self.study.records,
            self.study.side,
            # No warm-up: every plan held out was just timed in the confirmation rounds, one step after another's.
            lambda t: self._entries([t], steps, warm=False)[0],
            rounds=self.study.config.holdout_rounds,
            max_rounds=self.study.config.holdout_max_rounds,
            tie_tolerance=self.study.tie_tolerance,
            sync=self.study.sync,
            check_stop=self.study.check_stop,
            on_step=self._on_step("fresh rounds", self.study.records),
        )
        if reference is None:
            return best
        verdict = self.study.held_out
        fresh = {reference.number: vs_reference_note(None, reference.label, verdict.rounds if verdict else 0)}
        if verdict is not None:
            fresh[best.number] = vs_reference_note(verdict, reference.label, verdict.rounds)
        for i, t in enumerate(self.study.records):
            if t.number in fresh and fresh[t.number] is not None:  # the fresh rounds' figures replaced both
                self.study.records[i] = replace(t, extra={**t.extra, VS_REFERENCE: fresh[t.number]})
        for t in self.study.records:
            if t.confirmed:
                self.study.update(t)
        if verdict is not None and verdict.wins:
            return self.study.by_key[best.key()]
        self.study.verify([self.study.by_key[reference.key()]])
        kept = self.study.by_key[reference.key()]
        if not kept.feasible:  # its measured memory is over budget after all: the tuned plan stays
            self.study.held_out = None
            return self.study.by_key[best.key()]
        log.warning(
            "lightning_ckpt: %s was chosen by the confirmation but fresh rounds do not find it faster than %s (%s): "
            "the baseline is kept.",
            best.label,
            reference.label,
            verdict.describe() if verdict is not None else "it did not run",
        )
        return kept


def leader_of(side: SideBySide, labels: Mapping[int, str], tie_tolerance: float) -> str | None:
    """The leading tuned plan of the rounds so far and its verdict against the reference, the verdict first (a
    terminal cuts a long line at its right edge): ``1.04x [0.99, 1.08] vs none, 3 rounds: full h.0-3``; the fastest
    plan by its median where no tuned plan has a verdict; None before any round ended."""
    verdicts = [(n, v) for n in side.tuned() if (v := side.verdict(n, labels, tie_tolerance)) is not None]
    verdicts = [(n, v) for n, v in verdicts if v.ratio is not None]
    if verdicts:
        n, v = max(verdicts, key=lambda nv: nv[1].ratio or 0.0)
        return f"{v.describe()}: {labels.get(n, n)}"
    timed = {n: statistics.median(x) for n, x in side.per_sample.items() if x}
    if not timed:
        return None
    fastest = min(timed, key=timed.__getitem__)
    return f"{labels.get(fastest, fastest)} fastest so far"


def vs_reference_note(verdict: Verdict | None, reference: str, rounds: int) -> dict[str, Any] | None:
    """What ``extra[VS_REFERENCE]`` holds: ``verdict``'s ratio and interval against ``reference`` (None: the trial is the
    reference itself, at 1.0), or None where the verdict has no ratio."""
    if verdict is None:
        return {"reference": reference, "ratio": 1.0, "low": None, "high": None, "rounds": rounds, "fresh": False}
    if verdict.ratio is None:
        return None
    return {
        "reference": verdict.reference,
        "ratio": verdict.ratio,
        "low": verdict.low,
        "high": verdict.high,
        "rounds": verdict.rounds,
        "fresh": bool(verdict.chosen_after),
    }
