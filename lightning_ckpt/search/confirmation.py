"""The confirmation of a search: which records are re-timed side by side (the sampler's leaders and the fitting
baselines), the re-ranking when the machine's speed changed since the search, and the held-out rounds that keep a
winner honest. ``rounds.py`` owns the rounds themselves; each function here puts back into the ledger the records it
re-timed.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from optuna.samplers import BaseSampler

from lightning_ckpt.formatting import count
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.ledger import VS_REFERENCE, Ledger, ProgressFn, TrialRecord
from lightning_ckpt.search.rounds import (
    CLAIM_HALF_WIDTH,
    ConfirmEntry,
    RoundProgress,
    SideBySide,
    apply_confirmation,
    confirm_interleaved,
    retimer,
    speed_change,
)
from lightning_ckpt.search.sampler import leaders
from lightning_ckpt.search.trials import Trials
from lightning_ckpt.search.verdict import Verdict

__all__ = ["Confirmed", "confirm", "floor_seconds", "hold_out"]

log = logging.getLogger(__name__)

# After a speed change, at most this many fitting trials are re-ranked side by side before the confirmation.
_MAX_RERANKED = 24
# The fitting baselines every confirmation re-times beside the leaders: all of them in a search of one shape (at
# most five), the fastest this many by their search figures in the joint search (five per micro-batch).
_MAX_REFERENCES = 6


@dataclass(frozen=True)
class Confirmed:
    """What the confirmation found: its rounds (``side``, None where it did not run), which the verdicts come from,
    and what it saw of the machine's speed changing (the report and the plan file say it)."""

    side: SideBySide | None = None
    speed_changes: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()  # what the search's allowance ended early: the trials, rounds left undecided


def confirm(
    ledger: Ledger,
    trials: Trials,
    sampler: BaseSampler,
    progress: ProgressFn | None = None,
    left: Callable[[], float | None] | None = None,
) -> Confirmed:
    """Re-time the sampler's leaders and every fitting baseline side by side until each leader's verdict against the
    fastest baseline is decided or ``confirm_max_rounds``: the choice rests on figures paired by round. Where the
    machine's speed changed since the search, every fitting trial is re-ranked in one interleaved round first.
    ``left()``: the seconds the search's allowance has left."""
    config = trials.config
    if config.confirm_top <= 0:
        return Confirmed()
    chosen = _leaders(ledger, sampler, config.confirm_top)
    if len(chosen) < 2:
        return Confirmed()
    changes = []
    changed = _speed_changed_since_search(trials, chosen, config.measure_steps)
    if changed is not None:
        changes.append(changed)
        _rerank(ledger, trials, progress, config.confirm_steps, left)
        chosen = _leaders(ledger, sampler, config.confirm_top)
    confirming = getattr(progress, "confirming", None)  # a reporter (``report.SearchProgress``) that listens
    if confirming is not None:  # the figures of ``chosen`` are about to change
        confirming(chosen)
    entries = _entries(trials, chosen, config.confirm_steps)
    # With a hold-out the claim comes from fresh rounds (``hold_out``), so these rounds only choose: they stop once
    # the choice is decided (``SideBySide.choice_decided``). Without one they are the claim, and a plan that can win
    # is timed for every round (``confirm_interleaved``): stopping as it clears would report its luckiest moment.
    tol = config.tie_tolerance
    side = confirm_interleaved(
        entries,
        min_rounds=config.confirm_rounds,
        max_rounds=config.confirm_max_rounds,
        tie_tolerance=tol,
        sync=trials.sync,
        until=(lambda s: s.choice_decided(tol)) if config.holdout_rounds > 0 else None,
        check_stop=trials.check_stop,
        on_step=_on_step(progress, "confirming", chosen, tol),
        left=left,
        reserve_steps=2 * config.holdout_rounds * config.confirm_steps,  # the fresh rounds' floor, two plans
    )
    if side.speed_changed:
        changes.append(
            f"during the confirmation rounds (speeds {', '.join(f'{v:.2f}' for v in side.round_speeds)} of the "
            "median round): the verdicts compare plans within rounds, and each figure shown was divided by its "
            "round's speed"
        )
    labels = {t.number: t.label for t in chosen}
    for t in apply_confirmation(ledger.snapshot(), entries, side.per_sample):
        if t.number in side.per_sample:
            ledger.put(_with_note(t, side, labels, tol))
    stopped = ()
    if side.stopped_by_allowance and not (side.rounds and side.decided(tol)):
        stopped = (f"the confirmation after {count(len(side.rounds), 'round')}, before every verdict was decided",)
    return Confirmed(side, tuple(changes), stopped)


def floor_seconds(ledger: Ledger, config: TuneConfig) -> float | None:
    """Seconds the confirmation's floor would take with one more tuned plan measured (``confirm_rounds`` rounds of
    every fitting baseline and the leaders, their first-round warm-ups, and the fresh rounds' floor of two plans), at
    the fitting trials' mean step; None where no confirmation runs or nothing fits yet. The loop stops measuring
    tuned plans when the allowance cannot pay for it: a tuned plan is chosen only by its verdict, so on a fast step
    the trials had left two rounds, too few to tell baselines 3% apart (the mixer kept a 6% slower one in 2 of 10)."""
    fitting = [t for t in ledger.fastest_fitting() if t.median_seconds]
    if config.confirm_top <= 0 or not fitting:
        return None
    baselines = sum(t.baseline is not None for t in fitting)  # one more tuned plan adds at most one leader
    entries = min(baselines, _MAX_REFERENCES) + min(config.confirm_top, len(fitting) - baselines + 1)
    rounds = (
        entries * (config.confirm_rounds * config.confirm_steps + 1) + 2 * config.holdout_rounds * config.confirm_steps
    )
    steps = rounds + config.measure_steps + 1  # and the reference re-timed first (``_speed_changed_since_search``)
    return statistics.fmean(t.median_seconds for t in fitting) * steps


def _with_note(t: TrialRecord, side: SideBySide, labels: Mapping[int, str], tie_tolerance: float) -> TrialRecord:
    """``t`` with its speed over the reference from the rounds both ran in (``extra[VS_REFERENCE]``), the figure a
    report sets beside the winner's: samples/s from rounds minutes apart are not (issue #64)."""
    ref = side.reference
    if ref is None:
        return t
    verdict = side.verdict(t.number, labels, tie_tolerance) if t.number != ref else None
    note = vs_reference_note(verdict, labels.get(ref, str(ref)), len(side.by_round(ref)))
    return replace(t, extra={**t.extra, VS_REFERENCE: note}) if note is not None else t


def _leaders(ledger: Ledger, sampler: BaseSampler, top: int) -> list[TrialRecord]:
    """What the confirmation re-times: the sampler's leaders among the tuned plans and every fitting baseline (the
    fastest is the reference a tuned plan must beat). Their memory stays predicted where the model is exact (CPU)
    until one is chosen: the choice verifies it."""
    feasible = ledger.fastest_fitting()
    tuned = [t for t in feasible if t.baseline is None]
    references = [t for t in feasible if t.baseline is not None][:_MAX_REFERENCES]
    return sorted(leaders(sampler, tuned, top) + references, key=lambda t: -(t.samples_per_second or 0.0))


def _speed_changed_since_search(trials: Trials, leaders: Sequence[TrialRecord], steps: int) -> str | None:
    """Re-time the reference (the fastest fitting baseline, else the leader) once; what changed, if its speed did."""
    baselines = [t for t in leaders if t.baseline is not None]
    reference = max(baselines or leaders, key=lambda t: t.samples_per_second or 0.0)
    m = trials.workload(reference.micro_batch).runner.retime(reference.plan, steps)
    gathered = trials.sync.all_gather(m.median_seconds if m.status == "ok" else None)
    now = max(gathered) if all(g is not None for g in gathered) else None
    ratio = speed_change(reference.median_seconds, now, reference.spread_seconds or 0.0)
    if ratio is None:
        return None
    log.warning(
        "lightning_ckpt: the machine's speed changed during the search (%s re-timed at %.2fx its search speed): "
        "every fitting plan was re-ranked side by side.",
        reference.label,
        ratio,
    )
    return (
        f"between the search and the confirmation: {reference.label} re-timed at {ratio:.2f}x its search speed; "
        "every fitting plan was re-ranked side by side"
    )


def _rerank(
    ledger: Ledger, trials: Trials, progress: ProgressFn | None, steps: int, left: Callable[[], float | None] | None
) -> None:
    """One interleaved round over the fitting trials (at most ``_MAX_RERANKED``), whose figures replace the search's
    so the leaders are picked at one speed (steps back to back share the machine's moment, so one round is enough).
    They do not count as confirmed."""
    entries = _entries(trials, ledger.fastest_fitting()[:_MAX_RERANKED], steps)
    side = confirm_interleaved(
        entries,
        min_rounds=1,
        max_rounds=1,
        sync=trials.sync,
        check_stop=trials.check_stop,
        on_step=_on_step(progress, "re-ranking", [e.trial for e in entries], trials.config.tie_tolerance),
        left=left,
        reserve_steps=2 * trials.config.confirm_rounds * trials.config.confirm_steps,
    )
    for t in apply_confirmation(ledger.snapshot(), entries, side.per_sample, confirmed=False):
        if side.per_sample.get(t.number):
            ledger.put(t)


def _on_step(
    progress: ProgressFn | None, phase: str, trials: Sequence[TrialRecord], tie_tolerance: float
) -> RoundProgress | None:
    """What moves the progress line during ``phase``'s rounds, where the progress listens (a reporter with a
    ``rounds`` method, ``report.SearchProgress``)."""
    report = getattr(progress, "rounds", None)
    if report is None:
        return None
    labels = {t.number: t.label for t in trials}

    def on_step(done: int, max_rounds: int, timed: int, to_time: int, side: SideBySide) -> None:
        report(phase, done, max_rounds, timed, to_time, leader_of(side, labels, tie_tolerance))

    return on_step


def _entries(trials: Trials, records: Sequence[TrialRecord], steps: int, *, warm: bool = True) -> list[ConfirmEntry]:
    """``records`` to re-time side by side, ``steps`` timed steps a round each (and, ``warm``, one warm-up in the
    first)."""
    pairs = [(t, trials.workload(t.micro_batch)) for t in records]
    return [
        ConfirmEntry(t, retimer(w.runner, t.plan, steps, warm=warm), w.samples_per_step, steps, int(warm))
        for t, w in pairs
    ]


def hold_out(
    best: TrialRecord,
    ledger: Ledger,
    trials: Trials,
    confirmed: Confirmed,
    progress: ProgressFn | None = None,
    left: Callable[[], float | None] | None = None,
) -> tuple[TrialRecord, Verdict | None, bool]:
    """(the plan kept, the held-out verdict, whether the allowance ``left`` ended its rounds): ``best`` timed again in
    fresh interleaved rounds (at least ``holdout_rounds``, then until its ratio's interval is within
    ``CLAIM_HALF_WIDTH`` or it cannot win, at most ``holdout_max_rounds``) beside the reference the choosing rounds
    found fastest; ``best``, or that reference where they do not find ``best`` faster. The rounds that chose a plan
    among several leaders favour it (claims 5-17% above an outside re-timing, never below); fresh rounds are
    independent of that selection."""
    config, side = trials.config, confirmed.side
    rounds, tol = config.holdout_rounds, config.tie_tolerance
    chosen_after = len(side.by_round(best.number)) if side is not None else 0
    baselines = [t for t in ledger if t.baseline is not None and t.feasible and t.confirmed]
    if side is None or rounds <= 0 or best.baseline is not None or not chosen_after or not baselines:
        return best, None, False
    # The reference is the one the choosing rounds found fastest (the rule ``choose_best`` keeps it by), timed again
    # beside ``best``: choosing it again from the fresh rounds, the luckiest of near-equal baselines there, would make
    # it look faster than it is and the claim smaller (the simulated machine: -2% on average, tied baselines).
    reference = next((t for t in baselines if t.number == side.reference), None) or max(
        baselines, key=lambda t: t.samples_per_second or 0.0
    )
    # No warm-up: every plan held out was just timed in the confirmation rounds, one step after another's.
    entries = _entries(trials, [best, reference], config.confirm_steps, warm=False)
    labels = {t.number: t.label for t in (best, reference)}

    def precise(fresh: SideBySide) -> bool:
        # Stopping on the interval's width, not its place, leaves the ratio unbiased (a sample's spread and mean
        # are independent); stopping once it cannot win only decides sooner that the baseline is kept.
        verdict = fresh.verdict(best.number, labels, tol)
        if verdict is None or verdict.low is None or verdict.high is None:
            return False
        return verdict.cannot_win or math.sqrt(verdict.high / verdict.low) <= 1 + CLAIM_HALF_WIDTH

    fresh = confirm_interleaved(
        entries,
        min_rounds=rounds,
        max_rounds=max(rounds, config.holdout_max_rounds or rounds),
        sync=trials.sync,
        until=precise,
        check_stop=trials.check_stop,
        on_step=_on_step(progress, "fresh rounds", ledger.snapshot(), tol),
        left=left,
    )
    stopped = fresh.stopped_by_allowance
    if not fresh.per_sample.get(reference.number):  # none ran (the allowance may have stopped them first)
        return best, None, stopped  # the choosing rounds' verdict stands
    verdict = fresh.verdict(best.number, labels, tol, reference=reference.number)
    verdict = replace(verdict, chosen_after=chosen_after) if verdict is not None else None
    records = apply_confirmation(ledger.snapshot(), entries, fresh.per_sample)
    kept, verdict = _kept(best, reference, verdict, records, ledger, trials)
    return kept, verdict, stopped


def _kept(
    best: TrialRecord,
    reference: TrialRecord,
    verdict: Verdict | None,
    records: Sequence[TrialRecord],
    ledger: Ledger,
    trials: Trials,
) -> tuple[TrialRecord, Verdict | None]:
    """Put the fresh rounds' figures (``records``) into the ledger, so the plan file's throughput and its verdict say
    the same (the other baselines keep the confirmation's); ``best`` where they find it faster, else ``reference``
    (unless its memory, measured now, is over budget)."""
    notes = {reference.number: vs_reference_note(None, reference.label, verdict.rounds if verdict else 0)}
    if verdict is not None:
        notes[best.number] = vs_reference_note(verdict, reference.label, verdict.rounds)
    for t in records:
        if notes.get(t.number) is not None:  # the fresh rounds' figures replaced both
            t = replace(t, extra={**t.extra, VS_REFERENCE: notes[t.number]})
        if t.confirmed:
            ledger.put(t)
    if verdict is not None and verdict.wins:
        return ledger.get(best.key()), verdict
    kept = ledger.put(trials.verify(ledger.get(reference.key())))
    if not kept.feasible:  # its measured memory is over budget after all: the tuned plan stays
        return ledger.get(best.key()), None
    log.warning(
        "lightning_ckpt: %s was chosen by the confirmation but fresh rounds do not find it faster than %s (%s): "
        "the baseline is kept.",
        best.label,
        reference.label,
        verdict.describe() if verdict is not None else "it did not run",
    )
    return kept, verdict


def leader_of(side: SideBySide, labels: Mapping[int, str], tie_tolerance: float) -> str | None:
    """The leading tuned plan of the rounds so far and its verdict against the reference, the verdict first (a
    terminal cuts a long line at its right edge): ``1.04x [0.99, 1.08] vs none, 3 rounds: full h.0-3``; the fastest
    plan by its median where no tuned plan has a verdict; None before any round ended."""
    verdicts = [(n, v) for n in side.tuned() if (v := side.verdict(n, labels, tie_tolerance)) and v.ratio is not None]
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
