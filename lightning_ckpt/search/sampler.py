"""Who picks the next plan: an Optuna sampler. ``TimeModelSampler`` (eager models, the default) proposes what the
time model predicts fastest; the user's sampler, or seeded TPE, where a step's time cannot be predicted
(``torch.compile``), with ``predict_time=False``, or when the user hands the search one.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial

from lightning_ckpt.formatting import count
from lightning_ckpt.search.ledger import Ledger, TrialRecord, TrialStatus
from lightning_ckpt.search.space import Candidate
from lightning_ckpt.timing.model import WELL_PREDICTED_ERROR, TimeModel

__all__ = ["TimeModelSampler", "error_summary", "fitted", "leaders", "sampler_for", "sampler_summary"]

log = logging.getLogger(__name__)

# The noise margin's bounds (``TimeModelSampler.noise_margin``), and the margin before any error is known.
_MARGIN_BOUNDS = (0.03, WELL_PREDICTED_ERROR)
_DEFAULT_MARGIN = 0.05
_CONFIRM_WINDOW = 0.05  # the least window of ``leaders``


def default_sampler(seed: int, n_trials: int) -> BaseSampler:
    """Seeded TPE; it reads each trial's constraints (``Trial.set_constraint``), so infeasible plans inform it too."""
    startup = min(10, max(1, n_trials // 3))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)


class TimeModelSampler(BaseSampler):
    """The time model as an Optuna sampler over ``unseen()``, refitted to the ledger's timed plans; ``fallback`` draws
    what it cannot predict. ``time_model``: the profile's, or one per micro-batch (compared per sample)."""

    name = "time_model"

    def __init__(
        self,
        time_model: TimeModel | Mapping[int, TimeModel],
        ledger: Ledger,
        unseen: Callable[[], Sequence[Candidate]],
        *,
        tie_tolerance: float,
        fallback: BaseSampler | None = None,
    ) -> None:
        models = dict(time_model) if isinstance(time_model, Mapping) else {None: time_model}
        self._models: dict[int | None, TimeModel] = models
        self.ledger, self.unseen, self.tie_tolerance = ledger, unseen, tie_tolerance
        self.fallback = fallback if fallback is not None else default_sampler(0, 40)
        self._fitted_to = -1  # the ledger's length when the models were last fitted
        self._warned = False  # the margin followed the model's error (``noise_margin``): said once

    def model_for(self, micro_batch: int | None = None) -> TimeModel:
        """The model of ``micro_batch``'s steps calibrated to every plan the ledger timed at it (fitting or not)."""
        if len(self.ledger) != self._fitted_to:
            records = self.ledger.snapshot()
            timed = [t for t in records if t.status in (TrialStatus.OK, TrialStatus.OVER_BUDGET) and t.median_seconds]
            for m, model in self._models.items():
                mine = [(t.plan, t.label, t.searched_seconds) for t in timed if t.micro_batch == m]
                self._models[m] = model.calibrated(mine)
            self._fitted_to = len(records)
        return self._models[micro_batch]

    @property
    def joint(self) -> bool:
        return None not in self._models

    def predict_seconds(self, cand: Candidate) -> float | None:
        return self.model_for(cand.micro_batch).predict_seconds(cand.plan)

    def ranked(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        ranked = [(s, c) for c in candidates if (s := self._rank_seconds(c)) is not None]
        return [c for _, c in sorted(ranked, key=lambda x: x[0])]

    def choice(self, remaining: Sequence[Candidate]) -> Candidate | None:
        """The predicted-fastest of ``remaining``; None while one of them cannot be predicted (the fallback's)."""
        ranked = self.ranked(remaining)
        return ranked[0] if ranked and len(ranked) == len(remaining) else None

    def predictable(self, cand: Candidate) -> bool:
        return self._rank_seconds(cand) is not None

    def can_win(self, cand: Candidate) -> bool:
        """Whether ``cand`` could beat the best plan measured within budget, its predicted time less the noise margin."""
        predicted = self.predict_seconds(cand)
        best = self.ledger.fastest_fitting()
        if predicted is None or not best or not best[0].median_seconds:
            return True
        theirs = _per_sample(best[0].median_seconds, best[0].micro_batch)
        return _per_sample(predicted, cand.micro_batch) * (1.0 - self.noise_margin()) < theirs

    def offload_loses(self, cand: Candidate) -> bool:
        """Whether the transfer backward waits for exceeds the recompute the offloaded blocks would cost instead, by
        more than the noise margin of the step (before any plan was timed: of the blocks' own forward and backward)."""
        model, plan = self.model_for(cand.micro_batch), cand.plan
        moves, predicted = model.transfer(plan), model.predict_seconds(plan)
        slack = self.noise_margin() * (predicted if predicted is not None else model.plain_block_seconds())
        return moves is not None and moves.exposed_seconds - moves.recompute_seconds > slack

    def nothing_left_can_win(self) -> bool:
        """The loop's stopping rule: the predicted-fastest plan left cannot beat the best measured one."""
        choice = self.choice(self.unseen())
        return choice is not None and not self.can_win(choice)

    def summary(self) -> dict[str, Any]:
        records = self.ledger.snapshot()
        errors = [e for t in records if (e := t.prediction_error) is not None]
        calibrated = {str(m): c.to_dict() for m in self._models if (c := self.model_for(m).calibration) is not None}
        return {
            "calibration": calibrated.get("None") if not self.joint else None,
            **({"calibration_by_micro_batch": calibrated} if self.joint else {}),
            "noise_margin": self.noise_margin(),
            **error_summary(errors),
            "pruned_by_time": sum(t.pruned_by == "time" for t in records),
            "margin_follows_error": self._warned,
        }

    def noise_margin(self) -> float:
        """1.25x the median of the time model's out-of-sample errors, within ``_MARGIN_BOUNDS``, never below the tie
        tolerance nor the median error itself: a model off by 21% must not prune with 8% (a warning says so)."""
        errors = [abs(e) for t in self.ledger.snapshot() if (e := t.prediction_error) is not None]
        median = statistics.median(errors) if errors else None
        observed = 1.25 * median if median is not None else _DEFAULT_MARGIN
        margin = min(_MARGIN_BOUNDS[1], max(_MARGIN_BOUNDS[0], self.tie_tolerance, observed))
        if median is None or median <= margin:
            return margin
        if not self._warned:
            self._warned = True
            log.warning(
                "lightning_ckpt: the time model's predictions were off by %.1f%% (median, %s) on this machine, more "
                "than the %.0f%% margin it prunes with when it predicts well: it now prunes only plans predicted "
                "slower than the best measured one by more than that, so more plans are measured.",
                100 * median,
                count(len(errors), "plan"),
                100 * _MARGIN_BOUNDS[1],
            )
        return median

    def _rank_seconds(self, cand: Candidate) -> float | None:
        """The predicted step per sample, or before its model's first anchor what the plan's modes add to one."""
        predicted = self.predict_seconds(cand)
        if predicted is None:
            predicted = self.model_for(cand.micro_batch).added_seconds(cand.plan)
        return _per_sample(predicted, cand.micro_batch) if predicted is not None else None

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.ledger.distributions)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        """The params of the plan predicted fastest; nothing (the fallback draws) while some plan cannot be predicted."""
        choice = self.choice(self.unseen()) if search_space else None
        return {k: v for k, v in choice.params.items() if k in search_space} if choice is not None else {}

    # The fallback draws what the time model does not propose, and sees every trial.
    def sample_independent(self, *args: Any) -> Any:
        return self.fallback.sample_independent(*args)

    def before_trial(self, *args: Any) -> None:
        self.fallback.before_trial(*args)

    def after_trial(self, *args: Any) -> None:
        self.fallback.after_trial(*args)

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()


def _per_sample(seconds: float, micro_batch: int | None) -> float:
    return seconds / micro_batch if micro_batch else seconds


def fitted(sampler: BaseSampler) -> TimeModel | None:
    """The time model as the search of one shape fitted it, for re-planning (None: none, or the joint search's)."""
    return sampler.model_for(None) if isinstance(sampler, TimeModelSampler) and not sampler.joint else None


def sampler_for(
    timing: TimeModel | Mapping[int, TimeModel] | None,
    ledger: Ledger,
    unseen: Callable[[], Sequence[Candidate]],
    config: Any,
    *,
    predicts_time: bool,
) -> BaseSampler:
    """The time model's sampler where the profile timed the blocks as the runner runs them (eager) and the user
    neither turned it off nor handed a ``sampler``; else the user's sampler, or seeded TPE."""
    if config.sampler is not None:
        return config.sampler
    fallback = default_sampler(config.seed, config.n_trials)
    if timing is not None and predicts_time and config.predict_time:
        return TimeModelSampler(timing, ledger, unseen, tie_tolerance=config.tie_tolerance, fallback=fallback)
    return fallback


def leaders(sampler: BaseSampler, tuned: Sequence[TrialRecord], top: int) -> list[TrialRecord]:
    """The tuned plans worth confirming (``tuned``: the fitting ones, fastest first). With the time model: the one
    predicted fastest first (a plan timed in a slow moment of the machine still gets its side-by-side figure), then
    the fastest measured within twice the noise margin (at least ``_CONFIRM_WINDOW``)."""
    if not isinstance(sampler, TimeModelSampler) or not tuned:
        return list(tuned[:top])
    floor = (tuned[0].samples_per_second or 0.0) * (1.0 - max(_CONFIRM_WINDOW, 2 * sampler.noise_margin()))
    by_prediction = sorted((t for t in tuned if t.predicted_seconds is not None), key=lambda t: t.predicted_seconds)
    by_measurement = [t for t in tuned if (t.samples_per_second or 0.0) >= floor]
    return list({t.number: t for t in (*by_prediction[:1], *by_measurement)}.values())[:top]


def error_summary(errors: Sequence[float]) -> dict[str, Any]:
    """``errors`` (predicted / measured - 1) as the plan file keeps them."""
    return {
        "predicted_and_measured": len(errors),
        "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
        "max_abs_error": max((abs(e) for e in errors), default=None),
    }


def sampler_summary(sampler: BaseSampler) -> dict[str, Any] | None:
    """What the sampler did, for the plan file's ``metadata.search.time_model`` (None: nothing to say)."""
    return sampler.summary() if isinstance(sampler, TimeModelSampler) else None
