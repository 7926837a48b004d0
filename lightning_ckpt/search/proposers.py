"""Who picks the next candidate: an Optuna sampler, behind one protocol the ``Study`` drives.

A ``Study`` runs one loop (ask -> prune by memory -> prune by prediction -> measure -> tell) and one
confirmation; what differs between searches is only which candidate comes next, what a plan is predicted to
take, and which measured plans are worth confirming. That is a ``Proposer``, and each proposer's choices are
made by an Optuna sampler through the study's ``ask``/``tell`` (``store.TrialStore``): every plan measured or
pruned is one told trial of the sampler's study, so a user's sampler plugs in where ours does.

- ``TimeModelSampler`` (eager models, the default): an ``optuna.samplers.BaseSampler`` whose relative sample is
  the plan the profile's time model (``timing.model``) predicts fastest among those not yet measured; measured
  until none left can beat the best measured one by the model's own error. What it cannot predict (a mode its
  block could not be timed under) it hands to its fallback sampler, seeded TPE.
- ``SamplerProposer``: an Optuna sampler as it is (the user's ``sampler=``, else seeded TPE), or every distinct
  plan when the space is small; no predictions. Used where a plan's step time cannot be predicted
  (``torch.compile``: the compiler's), when ``predict_time=False`` (an exhaustive reference), and whenever the
  user hands the search a sampler.

Both start with every baseline the memory model lets run (the reference a tuned plan must beat, re-timed in
every confirmation), asked as enqueued trials, and both bound what they measure by ``n_trials`` and
``timeout``, through the study.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Protocol

import optuna
from optuna.samplers import BaseSampler

from lightning_ckpt.formatting import count
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.records import TrialRecord, TrialStatus
from lightning_ckpt.search.space import Candidate, SearchSpace
from lightning_ckpt.search.store import TrialStore
from lightning_ckpt.timing.model import WELL_PREDICTED_ERROR, TimeModel

__all__ = [
    "Proposal",
    "Proposer",
    "SamplerProposer",
    "SearchState",
    "TimeModelProposer",
    "TimeModelSampler",
    "default_sampler",
    "fastest_fitting",
    "proposer_for",
]

# params, plan, label, baseline name, what prunes it without running (None: run it, unless over budget)
Proposal = tuple[Mapping[str, Any], Plan, str, str | None, str | None]
Proposals = Generator[Proposal, TrialRecord, None]

log = logging.getLogger(__name__)

# Consecutive proposals of already-known plans after which the sampler proposer takes an unseen plan itself:
# a sampler that has seen most of a space redraws known points, and every redraw costs a suggest call whose
# cost grows with the study (54 of 105 s of a 16-layer search went there before this bound).
_MAX_REDRAWS = 2
# The noise margin a plan's predicted step time must clear to be measured (``TimeModelSampler._can_win``): the
# time model's own measured error (1.25x its median out-of-sample error), within these bounds, and never below the
# median error itself (a model off by 21% must not prune with 8%); before any error is known, the default.
_MARGIN_BOUNDS = (0.03, WELL_PREDICTED_ERROR)
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

    @property
    def sampler(self) -> BaseSampler:
        """The Optuna sampler the study asks (``TrialStore``'s sampler study)."""
        ...

    def proposals(self, state: SearchState) -> Proposals:
        """Candidates one at a time, each an asked trial of ``state.store`` that the proposer tells with the record
        its ``yield`` receives (``send``)."""
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


def default_sampler(seed: int, n_trials: int) -> BaseSampler:
    """Seeded TPE. It reads each trial's constraints itself (Optuna 5 deprecated ``constraints_func`` for
    ``Trial.set_constraint``, which is how trials get them here), so infeasible plans inform it too."""
    startup = min(10, max(1, n_trials // 3))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)


def fastest_fitting(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials that fit and were timed, fastest first."""
    timed = [t for t in records if t.feasible and t.samples_per_second]
    return sorted(timed, key=lambda t: -(t.samples_per_second or 0.0))


def _unseen(state: SearchState) -> list[Candidate]:
    return [c for c in state.candidates if c.key() not in state.by_key and state.offered(c.plan)]


def _enqueued(state: SearchState, cand: Candidate, prune: str | None = None) -> Proposals:
    """``cand`` as an enqueued trial of the sampler's study (its params fixed): asked, measured (or pruned by
    ``prune``), told."""
    asked = state.store.ask(cand.params)
    record = yield cand.params, cand.plan, cand.label, cand.baseline, prune
    state.store.tell(asked, record)


def _baselines_first(state: SearchState, order: Sequence[Candidate]) -> Proposals:
    """Every baseline in ``order`` that the memory model lets run, measured whatever ``n_trials`` (at most a
    handful): the reference set every confirmation re-times. Those predicted over budget are pruned (free)."""
    for cand in order:
        if cand.baseline is None or cand.key() in state.by_key or not state.offered(cand.plan):
            continue
        if state.out_of_time():
            return
        yield from _enqueued(state, cand)


def _sampled(state: SearchState, rng: random.Random) -> Proposals:
    """The sampler's proposals until the study is done or every plan is known: each an asked trial whose plan
    the sampler chose. A known (or unrunnable) plan is told ``FAIL`` and asked again; after ``_MAX_REDRAWS``
    in a row an unseen plan is taken at random (enqueued)."""
    redraws = 0
    while not state.done() and len(state.by_key) < len(state.candidates):
        asked = state.store.ask()
        cand = state.suggest(asked)
        if cand.key() not in state.by_key and state.offered(cand.plan):
            redraws = 0
            record = yield cand.params, cand.plan, cand.label, None, None
            state.store.tell(asked, record)
            continue
        state.store.tell(asked, None)  # a known (or unrunnable) plan
        redraws += 1
        if redraws >= _MAX_REDRAWS:
            unseen = _unseen(state)
            if not unseen:
                return
            redraws = 0
            yield from _enqueued(state, unseen[rng.randrange(len(unseen))])


class SamplerProposer:
    """The baselines, then every distinct plan (a space no larger than ``n_trials``) or ``sampler``'s proposals
    (the user's, else seeded TPE)."""

    name = "sampler"

    def __init__(self, seed: int = 0, sampler: BaseSampler | None = None, *, n_trials: int = 40) -> None:
        self._rng = random.Random(seed)
        self._sampler = sampler if sampler is not None else default_sampler(seed, n_trials)

    @property
    def sampler(self) -> BaseSampler:
        return self._sampler

    def proposals(self, state: SearchState) -> Proposals:
        yield from _baselines_first(state, state.candidates)
        if state.exhaustive:
            for cand in _unseen(state):
                if state.done():
                    return
                if cand.key() in state.by_key or not state.offered(cand.plan):
                    continue  # a trial since saw its segments leave the chain
                yield from _enqueued(state, cand)
            return
        yield from _sampled(state, self._rng)

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


class TimeModelSampler(BaseSampler):
    """The time model as an Optuna sampler: each asked trial's plan is the one predicted fastest of those not
    measured yet, measuring only the plans that can win.

    The plans predicted over budget are pruned first (free); then every baseline that fits, predicted-fastest
    first (the reference set, and the model's anchors: before any step is measured plans rank by what their
    modes add, which needs no anchor); then the sampler's choice, the model refitted after each, until the
    fastest left cannot beat the best measured plan by the noise margin (``_can_win``): the rest are pruned,
    each recorded with its prediction. While some plan left is one the model cannot predict (a mode its block
    could not be timed under), ``fallback`` (seeded TPE) proposes instead, and those plans get measured."""

    name = "time_model"

    def __init__(self, time_model: TimeModel, *, tie_tolerance: float, fallback: BaseSampler | None = None) -> None:
        self.time_model = time_model
        self.tie_tolerance = tie_tolerance
        self.fallback = fallback if fallback is not None else default_sampler(0, 40)
        self._records: Sequence[TrialRecord] = ()
        self._state: SearchState | None = None
        self._rng = random.Random(0)
        self._warned = False  # the margin followed the model's error (``noise_margin``): said once

    @property
    def sampler(self) -> BaseSampler:
        return self

    # -- the Proposer ---------------------------------------------------------------------------------
    def proposals(self, state: SearchState) -> Proposals:
        self._state = state
        self.observe(state.records)  # a resumed study's plans are anchors already
        for cand in _unseen(state):
            if state.predicted_over_budget(cand.plan, cand.micro_batch):
                yield from _enqueued(state, cand, "memory")
        yield from _baselines_first(state, self._ranked(_unseen(state)))
        redraws = 0
        while not state.done():
            remaining = _unseen(state)
            if not remaining:
                return
            choice = self._choice(remaining)
            if choice is not None and not self._can_win(self.time_model.predict_seconds(choice.plan)):
                for c in self._ranked(remaining):
                    yield from _enqueued(state, c, "time")
                return
            asked = state.store.ask()  # sample_relative: ``choice``, or the fallback's where it cannot predict
            cand = state.suggest(asked)
            if redraws >= _MAX_REDRAWS:  # the fallback keeps drawing plans known or unable to win
                state.store.tell(asked, None)
                redraws = 0
                unpredictable = [c for c in remaining if self._rank_seconds(c.plan) is None] or remaining
                yield from _enqueued(state, unpredictable[self._rng.randrange(len(unpredictable))])
                continue
            if cand.key() in state.by_key or not state.offered(cand.plan):
                state.store.tell(asked, None)  # the fallback redrew a known plan
                redraws += 1
                continue
            if not self._can_win(self.time_model.predict_seconds(cand.plan)):
                state.store.tell(asked, None)  # the fallback drew a plan the model says cannot win: not measured
                redraws += 1
                continue
            redraws = 0
            record = yield cand.params, cand.plan, cand.label, cand.baseline, None
            state.store.tell(asked, record)

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
            "margin_follows_error": self._warned,
        }

    def fitted(self) -> TimeModel | None:
        return self.time_model

    def noise_margin(self) -> float:
        """How far the time model's predictions may be off: 1.25x the median of its errors so far (each taken
        before the plan was measured), within ``_MARGIN_BOUNDS``, never below the tie tolerance, and never below the
        median error itself: on a machine where the model predicts badly it prunes only what is predicted slower by
        more than it has shown itself to be off (``margin_follows_error`` in the summary; a warning says so)."""
        median = self._median_error()
        observed = 1.25 * median if median is not None else _DEFAULT_MARGIN
        margin = min(_MARGIN_BOUNDS[1], max(_MARGIN_BOUNDS[0], self.tie_tolerance, observed))
        if median is not None and median > margin:
            if not self._warned:
                self._warned = True
                log.warning(
                    "lightning_ckpt: the time model's predictions were off by %.1f%% (median, %s) on this "
                    "machine, more than the %.0f%% margin it prunes with when it predicts well: it now prunes only "
                    "plans predicted slower than the best measured one by more than that, so more plans are measured.",
                    100 * median,
                    count(len(self._errors()), "plan"),
                    100 * _MARGIN_BOUNDS[1],
                )
            return median
        return margin

    def _errors(self) -> list[float]:
        return [abs(e) for t in self._records if (e := t.prediction_error) is not None]

    def _median_error(self) -> float | None:
        errors = self._errors()
        return statistics.median(errors) if errors else None

    # -- the Optuna sampler ---------------------------------------------------------------------------
    def infer_relative_search_space(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial
    ) -> dict[str, optuna.distributions.BaseDistribution]:
        """The whole space (every dimension the study's candidates have), as long as a search is bound."""
        if self._state is None:
            return {}
        return dict(self._state.store.distributions)

    def sample_relative(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        search_space: dict[str, optuna.distributions.BaseDistribution],
    ) -> dict[str, Any]:
        """The params of the plan predicted fastest among those not measured; nothing (the fallback then draws
        each dimension) while some plan left cannot be predicted."""
        if self._state is None or not search_space:
            return {}
        choice = self._choice(_unseen(self._state))
        if choice is None:
            return {}
        return {k: v for k, v in choice.params.items() if k in search_space}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        param_name: str,
        param_distribution: optuna.distributions.BaseDistribution,
    ) -> Any:
        return self.fallback.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.fallback.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        state: optuna.trial.TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.fallback.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()

    # -- ranking --------------------------------------------------------------------------------------
    def _choice(self, remaining: Sequence[Candidate]) -> Candidate | None:
        """The predicted-fastest of ``remaining``; None while one of them cannot be predicted (the fallback's)."""
        if not remaining or any(self._rank_seconds(c.plan) is None for c in remaining):
            return None
        return self._ranked(remaining)[0]

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


# The name this proposer had before it became an Optuna sampler.
TimeModelProposer = TimeModelSampler


def proposer_for(
    timing: TimeModel | None,
    *,
    predicts_time: bool,
    predict_time: bool,
    tie_tolerance: float,
    seed: int,
    sampler: BaseSampler | None = None,
    n_trials: int = 40,
) -> Proposer:
    """The time model's sampler where the profile timed the blocks, the runner's steps are the ones it timed
    (eager: a compiled step's time is the compiler's), the user did not turn it off and handed no ``sampler``
    of their own; else ``sampler`` (seeded TPE when None) as it is."""
    if timing is not None and predicts_time and predict_time and sampler is None:
        return TimeModelSampler(timing, tie_tolerance=tie_tolerance, fallback=default_sampler(seed, n_trials))
    return SamplerProposer(seed, sampler, n_trials=n_trials)
