"""Who picks the next candidate: the two strategies a ``Study`` can be handed, behind one protocol.

A ``Study`` runs one loop (ask -> prune by memory -> prune by prediction -> measure -> tell) and one
confirmation; what differs between searches is only which candidate comes next, what a plan is predicted to
take, and which measured plans are worth confirming. That is a ``Proposer``:

- ``SamplerProposer``: Optuna's sampler (seeded TPE by default), or every distinct plan when the space is
  small; no predictions. Used where a plan's step time cannot be predicted (``torch.compile``: the compiler's)
  and when ``predict_time=False`` (an exhaustive reference).
- ``TimeModelProposer``: the profile's time model (``timing.model``) scores the space whole and measures the
  predicted-fastest plans until none left can beat the best measured one by the model's own error.

Both start with every baseline the memory model lets run (the reference a tuned plan must beat, re-timed in
every confirmation), and both bound what they measure by ``n_trials`` and ``timeout``, through the study.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Protocol

from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.records import TrialRecord, TrialStatus
from lightning_ckpt.search.space import Candidate, SearchSpace
from lightning_ckpt.search.store import TrialStore
from lightning_ckpt.timing.model import TimeModel

__all__ = [
    "Proposal",
    "Proposer",
    "SamplerProposer",
    "SearchState",
    "TimeModelProposer",
    "fastest_fitting",
    "proposer_for",
]

# params, plan, label, baseline name, what prunes it without running (None: run it, unless over budget)
Proposal = tuple[Mapping[str, Any], Plan, str, str | None, str | None]
Proposals = Generator[Proposal, TrialRecord, None]

# Consecutive proposals of already-known plans after which the sampler proposer takes an unseen plan itself:
# a sampler that has seen most of a space redraws known points, and every redraw costs a suggest call whose
# cost grows with the study (54 of 105 s of a 16-layer search went there before this bound).
_MAX_REDRAWS = 2
# The noise margin a plan's predicted step time must clear to be measured (``TimeModelProposer._can_win``): the
# time model's own measured error (1.25x its median out-of-sample error), within these bounds; before any error
# is known, the default.
_MARGIN_BOUNDS = (0.03, 0.08)
_DEFAULT_MARGIN = 0.05
# The tuned plans confirmed beside the predicted-fastest one: those measured within twice the noise margin (at
# least this share) of the fastest.
_CONFIRM_WINDOW = 0.05


class SearchState(Protocol):
    """What a proposer reads of the study it serves (the ``Study`` is one): never how it measures."""

    candidates: list[Candidate]
    records: list[TrialRecord]
    by_key: Mapping[str, TrialRecord]
    space: SearchSpace
    stacks: Sequence[Any]
    fingerprint: str | None
    store: TrialStore
    exhaustive: bool

    def done(self) -> bool: ...

    def out_of_time(self) -> bool: ...

    def offered(self, plan: Plan) -> bool: ...

    def predicted_over_budget(self, plan: Plan, micro_batch: int | None = None) -> bool: ...

    def suggest(self, asked: Any) -> Candidate:
        """The candidate an Optuna trial proposes (the space's point, and the micro-batch in the joint search)."""
        ...


class Proposer(Protocol):
    """A search strategy: the candidates to run, in order, and what it predicts of each."""

    name: str

    def proposals(self, state: SearchState) -> Proposals:
        """Candidates one at a time; each ``yield`` receives (``send``) the record the candidate produced."""
        ...

    def predict_seconds(self, plan: Plan) -> float | None:
        """The plan's predicted step seconds, None when this proposer does not predict."""
        ...

    def observe(self, records: Sequence[TrialRecord]) -> None:
        """Learn from every record so far (called after each measurement)."""
        ...

    def leaders(self, tuned: Sequence[TrialRecord], top: int) -> list[TrialRecord]:
        """The tuned plans worth confirming (``tuned``: the fitting tuned trials, fastest first)."""
        ...

    def summary(self, records: Sequence[TrialRecord]) -> dict[str, Any] | None:
        """What the proposer did, for the plan file's ``metadata.search`` (None: nothing to say)."""
        ...

    def fitted(self) -> TimeModel | None:
        """The time model as fitted by the search, for re-planning from the plan file (None: none)."""
        ...


def fastest_fitting(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials that fit and were timed, fastest first."""
    timed = [t for t in records if t.feasible and t.samples_per_second]
    return sorted(timed, key=lambda t: -(t.samples_per_second or 0.0))


def _unseen(state: SearchState) -> list[Candidate]:
    return [c for c in state.candidates if c.key() not in state.by_key and state.offered(c.plan)]


def _baselines_first(state: SearchState, order: Sequence[Candidate]) -> Proposals:
    """Every baseline in ``order`` that the memory model lets run, measured whatever ``n_trials`` (at most a
    handful): the reference set every confirmation re-times. Those predicted over budget are pruned (free)."""
    for cand in order:
        if cand.baseline is None or cand.key() in state.by_key or not state.offered(cand.plan):
            continue
        if state.out_of_time():
            return
        record = yield cand.params, cand.plan, cand.label, cand.baseline, None
        state.store.learn(record)


class SamplerProposer:
    """The baselines, then every distinct plan (a space no larger than ``n_trials``) or the sampler's proposals."""

    name = "sampler"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def proposals(self, state: SearchState) -> Proposals:
        yield from _baselines_first(state, state.candidates)
        if state.exhaustive:
            for cand in _unseen(state):
                if state.done():
                    return
                if cand.key() in state.by_key or not state.offered(cand.plan):
                    continue  # a trial since saw its segments leave the chain
                record = yield cand.params, cand.plan, cand.label, cand.baseline, None
                state.store.learn(record)
            return
        redraws = 0
        while not state.done() and len(state.by_key) < len(state.candidates):
            ot = state.store.ask()
            cand = state.suggest(ot)
            if cand.key() not in state.by_key and state.offered(cand.plan):
                redraws = 0
                record = yield cand.params, cand.plan, cand.label, None, None
                state.store.tell(ot, record)
                continue
            state.store.tell(ot, None)  # a known (or unrunnable) plan
            redraws += 1
            if redraws >= _MAX_REDRAWS:
                unseen = _unseen(state)
                if not unseen:
                    return
                cand = unseen[self._rng.randrange(len(unseen))]
                redraws = 0
                record = yield cand.params, cand.plan, cand.label, cand.baseline, None
                state.store.learn(record)

    def predict_seconds(self, plan: Plan) -> float | None:
        return None

    def observe(self, records: Sequence[TrialRecord]) -> None:
        return None

    def leaders(self, tuned: Sequence[TrialRecord], top: int) -> list[TrialRecord]:
        return list(tuned[:top])

    def summary(self, records: Sequence[TrialRecord]) -> dict[str, Any] | None:
        return None

    def fitted(self) -> TimeModel | None:
        return None


class TimeModelProposer:
    """The space scored whole by the time model, measuring only the plans that can win.

    The plans predicted over budget are pruned first (free); then every baseline that fits, predicted-fastest
    first (the reference set, and the model's anchors: before any step is measured plans rank by what their
    modes add, which needs no anchor); then the predicted-fastest plan left, the model refitted after each, until
    the fastest left cannot beat the best measured plan by the noise margin (``_can_win``): the rest are pruned,
    each recorded with its prediction. A plan the model cannot predict (a mode its block could not be timed
    under) is measured."""

    name = "time_model"

    def __init__(self, time_model: TimeModel, *, tie_tolerance: float) -> None:
        self.time_model = time_model
        self.tie_tolerance = tie_tolerance
        self._records: Sequence[TrialRecord] = ()

    def proposals(self, state: SearchState) -> Proposals:
        self.observe(state.records)  # a resumed study's plans are anchors already
        for cand in _unseen(state):
            if state.predicted_over_budget(cand.plan, cand.micro_batch):
                record = yield cand.params, cand.plan, cand.label, cand.baseline, "memory"
                state.store.learn(record)
        yield from _baselines_first(state, self._ranked(_unseen(state)))
        while not state.done():
            remaining = _unseen(state)
            if not remaining:
                return
            ordered = self._ranked(remaining)
            unpredictable = [c for c in remaining if self._rank_seconds(c.plan) is None]
            cand = unpredictable[0] if unpredictable else ordered[0]
            if cand not in unpredictable and not self._can_win(self.time_model.predict_seconds(cand.plan)):
                for c in ordered:
                    record = yield c.params, c.plan, c.label, c.baseline, "time"
                    state.store.learn(record)
                return
            record = yield cand.params, cand.plan, cand.label, cand.baseline, None
            state.store.learn(record)

    def _ranked(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """``candidates`` the model can rank, predicted-fastest first."""
        ranked = [(s, i, c) for i, c in enumerate(candidates) if (s := self._rank_seconds(c.plan)) is not None]
        return [c for _, _, c in sorted(ranked, key=lambda x: (x[0], x[1]))]

    def _rank_seconds(self, plan: Plan) -> float | None:
        """What orders the plans: the predicted step, or before any anchor what the plan's modes add to one."""
        predicted = self.time_model.predict_seconds(plan)
        return predicted if predicted is not None else self.time_model.added_seconds(plan)

    def _can_win(self, predicted_seconds: float | None) -> bool:
        """Whether a plan predicted to take ``predicted_seconds`` a step could beat the best plan measured within
        budget: it could unless it is predicted slower even after the noise margin is taken off its time."""
        best = fastest_fitting(self._records)
        if predicted_seconds is None or not best or not best[0].median_seconds:
            return True
        return predicted_seconds * (1.0 - self.noise_margin()) < best[0].median_seconds

    def noise_margin(self) -> float:
        """How far the time model's predictions may be off: 1.25x the median of its errors so far (each taken
        before the plan was measured), within ``_MARGIN_BOUNDS`` and never below the tie tolerance."""
        errors = [abs(e) for t in self._records if (e := t.prediction_error) is not None]
        observed = 1.25 * statistics.median(errors) if errors else _DEFAULT_MARGIN
        return min(_MARGIN_BOUNDS[1], max(_MARGIN_BOUNDS[0], self.tie_tolerance, observed))

    def predict_seconds(self, plan: Plan) -> float | None:
        return self.time_model.predict_seconds(plan)

    def observe(self, records: Sequence[TrialRecord]) -> None:
        """Fit the time model to every plan timed so far (within budget or not: speed does not depend on it)."""
        self._records = records
        timed = [
            (t.plan, t.label, t.median_seconds)
            for t in records
            if t.status in (TrialStatus.OK, TrialStatus.OVER_BUDGET) and t.median_seconds
        ]
        self.time_model = self.time_model.calibrated(timed)

    def leaders(self, tuned: Sequence[TrialRecord], top: int) -> list[TrialRecord]:
        """The one predicted fastest first (a plan timed in a slow moment of the machine still gets its
        side-by-side figure), then the fastest measured within the window (twice the noise margin, at least
        ``_CONFIRM_WINDOW``)."""
        if not tuned:
            return []
        window = max(_CONFIRM_WINDOW, 2 * self.noise_margin())
        floor = (tuned[0].samples_per_second or 0.0) * (1.0 - window)
        by_prediction = sorted((t for t in tuned if t.predicted_seconds is not None), key=lambda t: t.predicted_seconds)
        by_measurement = [t for t in tuned if (t.samples_per_second or 0.0) >= floor]
        return list({t.number: t for t in (*by_prediction[:1], *by_measurement)}.values())[:top]

    def summary(self, records: Sequence[TrialRecord]) -> dict[str, Any] | None:
        """What the time model did: its fit, its measured errors, the margin, and what it pruned."""
        errors = [e for t in records if (e := t.prediction_error) is not None]
        calibration = self.time_model.calibration
        return {
            "calibration": calibration.to_dict() if calibration is not None else None,
            "noise_margin": self.noise_margin(),
            "predicted_and_measured": len(errors),
            "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
            "max_abs_error": max((abs(e) for e in errors), default=None),
            "pruned_by_time": sum(t.pruned_by == "time" for t in records),
        }

    def fitted(self) -> TimeModel | None:
        return self.time_model


def proposer_for(
    timing: TimeModel | None, *, predicts_time: bool, predict_time: bool, tie_tolerance: float, seed: int
) -> Proposer:
    """The time model's proposer where the profile timed the blocks and the runner's steps are the ones it timed
    (eager: a compiled step's time is the compiler's) and the user did not turn it off; else the sampler's."""
    if timing is not None and predicts_time and predict_time:
        return TimeModelProposer(timing, tie_tolerance=tie_tolerance)
    return SamplerProposer(seed)
