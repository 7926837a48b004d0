"""The search loop: propose plans, prune what cannot fit, run the rest through a runner, confirm, choose.

``Study.run`` goes: resume a persisted study, then the baselines, then every distinct plan (small
spaces) or the sampler's proposals. One place decides per candidate: prune (predicted over budget) or
measure, and records the result. Ranks always move in lockstep through a ``Sync`` (a single process
uses ``LocalSync``): rank 0 proposes, every rank measures, results are combined identically.
``Study.confirm`` re-times the leaders side by side; ``Study.result`` chooses and assembles the plan.

Two Optuna studies, on rank 0 only. The *sampler's* study lives in memory: it proposes plans, and a
sampler that redraws a plan already measured leaves a ``FAIL`` trial there (Optuna stores every
``ask``). The *record* (``study_name``, in ``storage`` when given) holds exactly one trial per distinct
plan, added when the plan is first measured or pruned and ``RUNNING`` while the search goes on: a
trial cannot change once finished, and confirmation, the memory pass of a finalist and the fallback
still change figures. When the search ends every trial is finished with its final figures, so
``optuna.load_study`` shows what the tuner chose from. A killed search leaves its trials ``RUNNING``
with their figures in user attributes; the next run resumes them and finishes them.

The record, for ``optuna.load_study`` and Optuna's plots:

* one objective, maximised, named ``samples_per_second`` (memory is the budget's constraint, not a
  second objective to trade against speed);
* state: ``COMPLETE`` for a plan that ran a step (``value`` = its samples/s, the confirmed figure when
  the confirmation round re-timed it), ``PRUNED`` for one predicted over budget, ``FAIL`` for one that
  failed (out of memory, error, invalid); ``params`` as the search space suggests them (empty for a
  baseline outside a restricted space);
* constraints (``trial.constraints``; feasible when all are <= 0, exactly the tuner's status ``ok``):
  ``over_budget_bytes`` = the figure the budget limits (peak or activation bytes; measured, else
  predicted) minus the limit, and ``failed`` = 1.0 for a trial that failed or fought ``torch.compile``;
* user attributes, the same names on every trial (None where unknown), named after ``TrialRecord``'s
  fields: see ``TRIAL_ATTRS``;
* study user attributes: ``run`` (what the figures depend on: model fingerprint, batch size, world
  size, device, compiled; a stored study made for another run is refused) and, once chosen,
  ``chosen_trial`` (the trial number of the plan the tuner chose: ties go to lower memory and a win
  inside the noise to the baseline, so it can differ from ``best_trial``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import (
    ApplyError,
    ConfigurationError,
    InfeasibleBudgetError,
    LightningCkptError,
    TrialsFailedError,
)
from lightning_ckpt.measure.measurement import median_and_spread
from lightning_ckpt.memory.optimizer_step import RealStepMemory
from lightning_ckpt.plan.format import Plan, library_versions
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.distributed import LocalSync, Sync, combine_trials
from lightning_ckpt.search.records import (
    ProgressFn,
    TrialRecord,
    TrialStatus,
    TuneResult,
    announce_confirmation,
    choose_best,
    failures_message,
    judge_status,
    lowest_memory,
)
from lightning_ckpt.search.runners import TrialRunner
from lightning_ckpt.search.space import Candidate, SearchSpace

__all__ = [
    "FAILED_CONSTRAINT",
    "METRIC_NAMES",
    "OVER_BUDGET_CONSTRAINT",
    "TRIAL_ATTRS",
    "CollectiveTrialError",
    "ConfirmEntry",
    "SearchInterrupted",
    "SideBySide",
    "Study",
    "confirm_interleaved",
    "retimer",
    "storage_for_display",
]

log = logging.getLogger(__name__)

# Consecutive proposals of already-known plans after which the study takes an unseen plan itself:
# a sampler that has seen most of a space redraws known points, and every redraw costs a suggest call
# whose cost grows with the study (54 of 105 s of a 16-layer search went there before this bound).
_MAX_REDRAWS = 2
# A statistical tie (leaders closer than their measured spread) goes to lower memory, but never at the
# cost of more than this much throughput.
_MAX_STATISTICAL_TIE = 0.015
# A reference re-timed this much faster or slower than before, or confirmation rounds whose common speed
# differs this much, mean the machine's speed changed (another job, throttled clocks, a stalling loader):
# the figures taken before and after are not compared. Same-moment noise on a busy 2-core machine stays
# well within it (6% step-time noise in the tests).
_SPEED_CHANGE = 0.15
# After a speed change, at most this many fitting trials are re-ranked side by side before the confirmation.
_MAX_RERANKED = 24

Proposal = tuple[Mapping[str, Any], Plan, str, str | None]  # params, plan, label, baseline name

# The stored study's vocabulary (see the module docstring): one place, read by tests and by users' scripts.
METRIC_NAMES = ("samples_per_second",)
OVER_BUDGET_CONSTRAINT = "over_budget_bytes"
FAILED_CONSTRAINT = "failed"
_RECORD_FIELDS = (
    "label", "status", "predicted_peak_bytes", "predicted_activation_bytes", "peak_bytes", "activation_bytes",
    "samples_per_second", "median_seconds", "spread_seconds", "recompute_flops", "recompute_overhead",
    "seconds", "steps", "error", "forward_backward_peak_bytes", "baseline", "memory_measured",
    "first_samples_per_second", "confirmation_seconds",
)  # fmt: skip
# Every stored trial's user attributes: the record's fields above (status as its string, e.g. "ok"), plus
# ``plan`` (the plan as ``Plan.to_dict``, what a resumed search rebuilds) and ``params`` (the search
# dimensions, also for plans outside the Optuna distributions, which store no Optuna params).
TRIAL_ATTRS = (*_RECORD_FIELDS, "plan", "params")


class CollectiveTrialError(LightningCkptError):
    """A trial failed on this rank while its step ran collectives (FSDP2): the search ended here."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SearchInterrupted(LightningCkptError):
    """``should_stop`` asked the search to end (e.g. SIGTERM): no plan was chosen, the model is as it was."""


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
    to three relative spreads of the first figure); None when it does not, or cannot be told."""
    if not before_seconds or not after_seconds:
        return None
    ratio = before_seconds / after_seconds
    tolerance = max(_SPEED_CHANGE, 3 * spread / before_seconds)
    return ratio if abs(ratio - 1) > tolerance else None


def _separated(per_sample: Mapping[int, Sequence[float]]) -> bool:
    stats = sorted(median_and_spread(v) for v in per_sample.values() if v)
    if len(stats) < 2:
        return True
    (m1, d1), (m2, d2) = stats[0], stats[1]
    return m2 - m1 > d1 + d2


class Study:
    """One search over ``candidates`` (every distinct plan of the space, baselines first)."""

    def __init__(
        self,
        *,
        candidates: Sequence[Candidate],
        space: SearchSpace,
        stacks: Sequence[Any],
        runner: TrialRunner,
        budget: Budget,
        memory: RealStepMemory | None,
        config: TuneConfig,
        fingerprint: str | None,
        device_type: str,
        sync: Sync | None = None,
        progress: ProgressFn | None = None,
        should_stop: Callable[[], bool] | None = None,
        samples_per_step: int = 1,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        self.candidates = list(candidates)
        self.space, self.stacks, self.runner, self.budget = space, stacks, runner, budget
        self.memory, self.config, self.fingerprint = memory, config, fingerprint
        # On CPU the memory model is exact: trials are timed only, and the plans that can still be chosen
        # get the slow tracked pass (verify). On CUDA every trial reads the allocator anyway.
        self.lazy_memory = (
            config.memory_pass == "finalists" and device_type == "cpu" and memory is not None and runner.predicts_memory
        )
        self.sync: Sync = sync or LocalSync()
        self.progress, self.should_stop = progress, should_stop
        self.samples_per_step = samples_per_step
        self.records: list[TrialRecord] = []
        self.by_key: dict[str, TrialRecord] = {}
        # Stacks a trial saw leave the chain at run time (a parent that skips blocks on some batches only):
        # segments over them are offered no more (see runners._with_deviations).
        self.unchained: set[str] = set()
        self.exhaustive = len(self.candidates) <= config.n_trials  # every distinct plan can be measured
        self.started = time.perf_counter()
        self.tie_tolerance = config.tie_tolerance  # widened by confirm() when the leaders are statistically tied
        self.speed_changes: list[str] = []  # what confirm() saw of the machine's speed changing (report, plan file)
        limit = (
            budget.limit_bytes if config.enforce_budget and budget.kind == "peak" and device_type == "cuda" else None
        )
        self.memory_limit = memory.trial_limit(limit) if memory is not None else limit
        self._rng = random.Random(config.seed)
        # What the figures depend on (``run``: seq_len, device, compiled, from ``tune``); the budget is not in
        # it (the default CUDA budget follows free memory): resumed trials are judged against today's.
        self.run_info: dict[str, Any] = {
            "fingerprint": fingerprint, "batch_size": samples_per_step, "world_size": self.sync.world_size,
            **(run or {}),
        }  # fmt: skip
        self.study_name = config.study_name or _default_study_name(self.run_info)
        # Rank 0's Optuna studies, opened by run() (see the module docstring), and the record's trial per plan.
        self._optuna: Any = None
        self._sampler_study: Any = None
        self._stored: dict[str, _StoredTrial] = {}
        self._distributions: dict[str, Any] = self.space.distributions(stacks)

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[TrialRecord]:
        """Resume, then baselines, then the rest of the space or the sampler's proposals, in lockstep."""
        self._resume()
        proposals = self._proposals() if self.sync.is_leader else None
        proposal = next(proposals, None) if proposals is not None else None
        while True:
            message = None
            if proposal is not None:
                params, plan, label, baseline = proposal
                message = (dict(params), plan.to_dict(), label, baseline, self._predicted_over_budget(plan))
            message = self.sync.broadcast(message)
            if message is None:
                break
            params, plan_dict, label, baseline, prune = message
            plan = proposal[1] if proposal is not None else Plan.from_dict(plan_dict, source="candidate from rank 0")
            trial = self.measure(params, plan, label, baseline, prune=prune)
            proposal = _send(proposals, trial) if proposals is not None else None
        self.check_stop()
        return self.records

    def measure(
        self, params: Mapping[str, Any], plan: Plan, label: str, baseline: str | None, *, prune: bool
    ) -> TrialRecord:
        """Prune or run one candidate on every rank, combine, record and report it. A plan measured again (the
        fallback measuring a pruned plan) replaces its record, so there is one record per plan."""
        local = self._trial(params, plan, label, baseline, prune)
        per_rank = self.sync.all_gather(local)
        for t in per_rank:
            self.unchained.update(t.extra.get("unchained_stacks", ()))
        trial = combine_trials(per_rank, self.budget)
        earlier = self.by_key.get(trial.plan.key())
        if earlier is None:
            self.records.append(trial)
        else:
            trial = replace(trial, number=earlier.number)
            self.records[self.records.index(earlier)] = trial
        self._update(trial)
        if self.progress is not None:
            self.progress(trial, self.budget)
        return trial

    def _update(self, trial: TrialRecord) -> None:
        """``trial`` is the plan's record now (``self.records`` already holds it): index and store it."""
        self.by_key[trial.plan.key()] = trial
        self._store(trial)

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise SearchInterrupted(
                f"The search was asked to stop after {len(self.records)} trials; no plan was chosen."
            )

    def _done(self) -> bool:
        self.check_stop()
        measured = sum(t.status != TrialStatus.PRUNED for t in self.records)
        out_of_time = self.config.timeout is not None and time.perf_counter() - self.started > self.config.timeout
        return measured >= self.config.n_trials or out_of_time

    def _predicted_over_budget(self, plan: Plan) -> bool:
        if self.memory is None or not self.runner.predicts_memory:
            return False
        return not self.budget.fits(*self.memory.predict(plan))

    def _trial(
        self, params: Mapping[str, Any], plan: Plan, label: str, baseline: str | None, prune: bool
    ) -> TrialRecord:
        t0 = time.perf_counter()
        predicted = self.memory.predict(plan) if self.memory is not None and self.runner.predicts_memory else None
        common: dict[str, Any] = dict(
            number=len(self.records), plan=plan, label=label, params=dict(params), baseline=baseline,
            predicted_peak_bytes=predicted[0] if predicted else None,
            predicted_activation_bytes=predicted[1] if predicted else None,
        )  # fmt: skip
        if prune:
            return TrialRecord(status=TrialStatus.PRUNED, seconds=time.perf_counter() - t0, **common)
        lazy = self.lazy_memory and predicted is not None
        out = self.runner.measure(plan, self.memory_limit, memory=not lazy)
        if out.status.failed and getattr(self.runner, "collective_steps", False):
            self._end_on_collective_failure(label, out)
        if lazy and out.status == TrialStatus.OK:
            trial = TrialRecord(
                status=TrialStatus.OK, peak_bytes=predicted[0], activation_bytes=predicted[1], memory_measured=False,
                samples_per_second=out.samples_per_second, median_seconds=out.median_seconds,
                spread_seconds=out.spread_seconds, seconds=time.perf_counter() - t0, steps=out.steps,
                extra=dict(out.extra), **common,
            )  # fmt: skip
            return self._judged(trial, out)
        return self._with_memory(TrialRecord(seconds=time.perf_counter() - t0, **common), out)

    def _end_on_collective_failure(self, label: str, out: Any) -> None:
        """A step of a sharded model (FSDP2) is a collective of all ranks: when it fails on this rank, the
        others may be waiting inside an all-gather this rank will never join, and going on to the next
        trial would pair mismatched collectives. End the search here, clearly, on this rank; the others
        end when the process group's timeout expires (or the launcher stops them)."""
        raise CollectiveTrialError(
            f"Rank {_rank()} failed inside trial {label!r} of a sharded (FSDP2) model: {out.error}. A sharded step "
            "runs all-gathers and reduce-scatters on every rank, so the search cannot go on without the other "
            "ranks hanging; it ends here and nothing is applied. Fix the failure (for an out-of-memory error: a "
            "lower max_memory, a smaller batch, or search_space limited to plans that fit), or tune once without "
            "sharding and pass the plan file with plan=..."
        )

    def _with_memory(self, trial: TrialRecord, out: Any, *, keep_timing: bool = False) -> TrialRecord:
        """``trial`` with the measured memory (and speed, status, FLOPs) of ``out``, judged against the budget.
        ``keep_timing``: ``out`` is a memory pass whose one step says nothing about speed."""
        peak = self.memory.real_peak(out.peak_bytes) if self.memory is not None else out.peak_bytes
        timed = out.samples_per_second is not None and not keep_timing
        trial = replace(
            trial, peak_bytes=peak, activation_bytes=out.activation_bytes, forward_backward_peak_bytes=out.peak_bytes,
            memory_measured=True, recompute_flops=out.recompute_flops, recompute_overhead=out.recompute_overhead,
            samples_per_second=out.samples_per_second if timed else trial.samples_per_second,
            median_seconds=out.median_seconds if timed else trial.median_seconds,
            spread_seconds=out.spread_seconds if timed else trial.spread_seconds,
            steps=trial.steps + out.steps, traceback=out.traceback, error=out.error,
            extra={**trial.extra, **out.extra},
        )  # fmt: skip
        return self._judged(trial, out)

    def _judged(self, trial: TrialRecord, out: Any) -> TrialRecord:
        conflict = None if trial.plan.is_empty else out.conflict
        fits = self.budget.fits(trial.peak_bytes, trial.activation_bytes)
        status = judge_status(out.status, conflict, allow_graph_breaks=self.config.allow_graph_breaks, fits=fits)
        error = trial.error or (conflict if status == TrialStatus.CONFLICT else None)
        extra = {**trial.extra, **({"conflict": conflict} if conflict else {})}
        return replace(trial, status=status, error=error, extra=extra)

    def verify(self, trials: Sequence[TrialRecord]) -> None:
        """Give trials timed without their memory pass (``lazy_memory``) their measured memory, on every rank:
        only plans measured within budget can be chosen."""
        for t in trials:
            if t.memory_measured:
                continue
            t0 = time.perf_counter()
            local = self._with_memory(t, self.runner.measure_memory(t.plan, self.memory_limit), keep_timing=True)
            local = replace(local, seconds=t.seconds + time.perf_counter() - t0)
            verified = combine_trials(self.sync.all_gather(local), self.budget)
            self.records[self.records.index(t)] = verified
            self._update(verified)

    def _verified_leaders(self, top: int) -> list[TrialRecord]:
        """The ``top`` fastest feasible trials and every fitting baseline (at most a handful: the reference a
        tuned plan must beat is re-timed beside it whatever its first figure), each with measured memory."""
        while True:
            feasible = sorted((t for t in self.records if t.feasible and t.samples_per_second),
                              key=lambda t: -(t.samples_per_second or 0.0))  # fmt: skip
            leaders = feasible[:top]
            leaders += [t for t in feasible if t.baseline is not None and t not in leaders]
            unverified = [t for t in leaders if not t.memory_measured]
            if not unverified:
                return leaders
            self.verify(unverified)

    # -- proposals (rank 0) ------------------------------------------------------------------------
    def _proposals(self) -> Iterator[Proposal]:
        """Rank 0's candidates; each ``yield`` receives (via ``send``) the record the candidate produced. The
        sampler's study learns every record (``measure`` has already written it to the record study)."""
        import optuna

        queue = [c for c in self.candidates if c.baseline is not None]
        if self.exhaustive:
            queue += [c for c in self.candidates if c.baseline is None]
        for cand in queue:
            if self._done():
                return
            if cand.plan.key() in self.by_key or not self._offered(cand.plan):
                continue
            record = yield cand.params, cand.plan, cand.label, cand.baseline
            self._sampler_study.add_trial(self._frozen(record))
        redraws = 0
        while not self.exhaustive and not self._done() and len(self.by_key) < len(self.candidates):
            ot = self._sampler_study.ask()
            params = self.space.suggest(ot, self.stacks)
            plan = self.space.plan_for(params, self.stacks, fingerprint=self.fingerprint)
            if plan.key() not in self.by_key and self._offered(plan):
                redraws = 0
                record = yield params, plan, plan.describe(), None
                state, value, constraints = _outcome(record, self.budget, for_sampler=True)
                for name, violation in constraints.items():
                    ot.set_constraint(name, violation)
                self._sampler_study.tell(ot, value, state=state)
                continue
            # A known (or unrunnable) plan: FAIL keeps it out of the sampler's history, which it already has.
            # Only the in-memory sampler's study holds these trials, never the record.
            self._sampler_study.tell(ot, state=optuna.trial.TrialState.FAIL)
            redraws += 1
            if redraws >= _MAX_REDRAWS:
                unseen = [c for c in self.candidates if c.plan.key() not in self.by_key and self._offered(c.plan)]
                if not unseen:
                    return
                cand = unseen[self._rng.randrange(len(unseen))]
                redraws = 0
                record = yield cand.params, cand.plan, cand.label, cand.baseline
                self._sampler_study.add_trial(self._frozen(record))

    def _offered(self, plan: Plan) -> bool:
        """Whether ``plan`` can run: the profile allows it, and no trial saw its segments leave the chain."""
        if plan.segments.keys() & self.unchained:
            return False
        return self.memory is None or self.memory.can_run(plan) is None

    # -- the Optuna studies (rank 0) ---------------------------------------------------------------
    def _open_studies(self) -> None:
        """The sampler's study (in memory) and the record (``storage`` or in memory), named ``study_name``."""
        import warnings

        import optuna

        config = self.config
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = config.sampler
        if sampler is None:
            # TPE reads each trial's constraints itself (Optuna 5 deprecated ``constraints_func`` for
            # ``Trial.set_constraint``, which is how trials get them here), so infeasible plans inform it too.
            sampler = optuna.samplers.TPESampler(
                seed=config.seed, n_startup_trials=min(10, max(1, config.n_trials // 3))
            )
        self._sampler_study = optuna.create_study(direction="maximize", sampler=sampler, study_name=self.study_name)
        # Nothing is ever sampled from the record; whoever loads it chooses their own sampler.
        self._optuna = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.RandomSampler(seed=config.seed), storage=config.storage,
            study_name=self.study_name, load_if_exists=config.storage is not None,
        )  # fmt: skip
        run = json.loads(json.dumps(self.run_info, default=str))  # as storage gives it back
        stored_run = self._optuna.user_attrs.get("run")
        if stored_run is not None and stored_run != run:
            differ = ", ".join(f"{k} {stored_run.get(k)!r} there, {v!r} now" for k, v in run.items()
                               if stored_run.get(k) != v)  # fmt: skip
            raise ConfigurationError(
                f"The Optuna study {self.study_name!r} in {storage_for_display(config.storage)} was made for another "
                f"run ({differ}), so its measurements do not apply to this one. Pass a new study_name, or leave "
                "study_name unset to get one study per model and run."
            )
        if stored_run is None:
            self._optuna.set_user_attr("run", run)
        if self._optuna.metric_names != list(METRIC_NAMES):
            with warnings.catch_warnings():  # experimental since Optuna 3.2, and still the way to name a metric
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self._optuna.set_metric_names(list(METRIC_NAMES))
        log.info("lightning_ckpt: Optuna study %r (%s)", self.study_name, storage_for_display(config.storage))

    def _frozen(self, trial: TrialRecord) -> Any:
        """``trial`` as a finished Optuna trial for the sampler's study (failures count as infeasible)."""
        import optuna

        state, value, constraints = _outcome(trial, self.budget, for_sampler=True)
        params = _optuna_params(trial.params, self._distributions)
        return optuna.trial.create_trial(
            state=state, value=value, params=params, distributions={k: self._distributions[k] for k in params},
            constraints=constraints,
        )  # fmt: skip

    def _store(self, trial: TrialRecord) -> None:
        """Write ``trial``, the plan's record now, to the record study: a new ``RUNNING`` trial for a new plan,
        else the attributes that changed. A trial finished by an earlier run keeps that run's figures (Optuna
        never changes a finished trial, and adding another would store the plan twice)."""
        if self._optuna is None:
            return
        import optuna

        key, attrs = trial.plan.key(), _attrs(trial)
        stored = self._stored.get(key)
        if stored is None:
            params = _optuna_params(trial.params, self._distributions)
            self._optuna.add_trial(
                optuna.trial.create_trial(
                    state=optuna.trial.TrialState.RUNNING, params=params,
                    distributions={k: self._distributions[k] for k in params}, user_attrs=attrs,
                )
            )  # fmt: skip
            added = self._optuna.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))[-1]
            self._stored[key] = _StoredTrial(added.number, added._trial_id, running=True, attrs=attrs)
            return
        changed = {k: v for k, v in attrs.items() if stored.attrs.get(k, _UNSET) != v}
        if stored.running and changed:
            handle = optuna.trial.Trial(self._optuna, stored.trial_id)
            for k, v in changed.items():
                handle.set_user_attr(k, v)
            stored.attrs.update(changed)

    def _finish(self) -> None:
        """Finish every trial of the record this run holds ``RUNNING`` with its final figures and constraints."""
        if self._optuna is None:
            return
        import optuna

        for key, stored in self._stored.items():
            if not stored.running:
                continue
            trial = self.by_key.get(key) or _record_from_attrs(0, stored.attrs)
            if trial is None:
                continue
            self._store(trial)
            state, value, constraints = _outcome(trial, self.budget)
            handle = optuna.trial.Trial(self._optuna, stored.trial_id)
            for name, violation in constraints.items():
                handle.set_constraint(name, violation)
            self._optuna.tell(stored.number, value, state=state)
            stored.running = False

    def _resume(self) -> None:
        """Open the studies (rank 0) and take the plans an earlier run stored (``storage=``) as they are, judged
        against today's budget; the trials it left ``RUNNING`` (it was killed) this run finishes."""
        problem, stored = None, []
        if self.sync.is_leader:
            try:
                self._open_studies()
                stored = self._stored_records()
            except Exception as exc:  # the other ranks must not wait in the broadcast below for ever
                problem = exc
        message = self.sync.broadcast((repr(problem) if problem is not None else None, stored))
        if problem is not None:
            raise problem
        if message[0] is not None:
            raise ConfigurationError(f"Rank 0 could not open the Optuna study {self.study_name!r}: {message[0]}")
        for attrs in message[1]:
            resumed = _record_from_attrs(len(self.records), attrs)
            if resumed is not None and resumed.plan.key() not in self.by_key:
                self.records.append(resumed)
                self.by_key[resumed.plan.key()] = resumed
                if self._sampler_study is not None:
                    self._sampler_study.add_trial(self._frozen(resumed))
        if self.records:
            log.info("lightning_ckpt: resumed %d trials from the Optuna study %r", len(self.records), self.study_name)

    def _stored_records(self) -> list[dict[str, Any]]:
        """Rank 0: the record study's plans (the first trial of each), as attributes of records judged against
        this run's budget; a plan pruned under another budget that now may fit is left out, to be measured."""
        import optuna

        out = []
        for t in self._optuna.get_trials(deepcopy=False):
            record = _record_from_attrs(0, t.user_attrs)
            if record is None or record.plan.key() in self._stored:
                continue  # not ours (no record attributes), or a duplicate left by an older version
            running = t.state == optuna.trial.TrialState.RUNNING
            self._stored[record.plan.key()] = _StoredTrial(t.number, t._trial_id, running, dict(t.user_attrs))
            if record.status == TrialStatus.PRUNED and not self._predicted_over_budget(record.plan):
                continue
            if record.status.ran:
                fits = self.budget.fits(record.peak_bytes, record.activation_bytes)
                record = replace(record, status=TrialStatus.OK if fits else TrialStatus.OVER_BUDGET)
            out.append(_attrs(record))
        return out

    # -- confirmation ------------------------------------------------------------------------------
    def confirm(self) -> None:
        """Re-time the ``confirm_top`` fastest feasible trials and every fitting baseline, interleaved.

        The choice then rests on figures taken side by side, not on one trial measured in a slow moment.
        A leader whose median is within the spread of the runner-up's is a statistical tie (``tie_tolerance``
        widens to the measured relative spread; see ``records.CHOICE_RULE``). Memory is kept as measured.

        The machine's speed may change during the search (another job starts, clocks throttle): first the
        reference (the fastest fitting baseline) is re-timed and compared with its search figure. When its
        speed changed, the search's figures were taken at different speeds and cannot pick the leaders, so
        every fitting trial is re-ranked in one interleaved round first. ``speed_changes`` says what was seen.
        """
        config = self.config
        if config.confirm_top <= 0:
            return
        chosen = self._verified_leaders(config.confirm_top)
        if len(chosen) < 2:
            return
        steps = config.measure_steps
        if self._speed_changed_since_search(chosen, steps):
            self._rerank(steps)
            chosen = self._verified_leaders(config.confirm_top)
        announce_confirmation(self.progress, chosen)
        entries = [
            ConfirmEntry(t, retimer(self.runner, t.plan, steps), self.samples_per_step, steps + 1) for t in chosen
        ]
        side = confirm_interleaved(
            entries, min_rounds=config.confirm_rounds, max_rounds=config.confirm_max_rounds, sync=self.sync
        )
        if side.speed_changed:
            self.speed_changes.append(
                f"during the confirmation rounds (speeds {', '.join(f'{v:.2f}' for v in side.round_speeds)} of the "
                "median round): each figure was divided by its round's speed"
            )
        self.records = apply_confirmation(self.records, entries, side.per_sample)
        for t in self.records:
            if t.number in side.per_sample:
                self._update(t)
        self.tie_tolerance = confirmed_tie_tolerance(side.per_sample, config.tie_tolerance)

    def _speed_changed_since_search(self, leaders: Sequence[TrialRecord], steps: int) -> bool:
        """Re-time the reference (fastest fitting baseline, else the leader) once; True if its speed changed."""
        baselines = [t for t in leaders if t.baseline is not None]
        reference = max(baselines or leaders, key=lambda t: t.samples_per_second or 0.0)
        m = self.runner.retime(reference.plan, steps)
        seconds = m.median_seconds if m.status == "ok" else None
        gathered = self.sync.all_gather(seconds)
        now = max(gathered) if all(g is not None for g in gathered) else None
        ratio = speed_change(reference.median_seconds, now, reference.spread_seconds or 0.0)
        if ratio is None:
            return False
        self.speed_changes.append(
            f"between the search and the confirmation: {reference.label} re-timed at {ratio:.2f}x its search speed; "
            "every fitting plan was re-ranked side by side"
        )
        log.warning("lightning_ckpt: the machine's speed changed during the search (%s re-timed at %.2fx its "
                    "search speed): re-ranking every fitting plan side by side.", reference.label, ratio)  # fmt: skip
        return True

    def _rerank(self, steps: int) -> None:
        """One interleaved round over the fitting trials (at most ``_MAX_RERANKED``): figures taken side by side
        replace the search's, so the leaders are picked at one speed. They do not count as confirmed."""
        feasible = sorted((t for t in self.records if t.feasible and t.samples_per_second),
                          key=lambda t: -(t.samples_per_second or 0.0))[:_MAX_RERANKED]  # fmt: skip
        entries = [ConfirmEntry(t, retimer(self.runner, t.plan, steps), self.samples_per_step, steps + 1)
                   for t in feasible]  # fmt: skip
        side = confirm_interleaved(entries, min_rounds=1, max_rounds=1, sync=self.sync)
        for i, t in enumerate(self.records):
            times = side.per_sample.get(t.number)
            if times:
                self.records[i] = replace(
                    t, samples_per_second=1.0 / times[0], median_seconds=times[0] * self.samples_per_step,
                    steps=t.steps + steps + 1, first_samples_per_second=t.first_samples_per_second or t.samples_per_second,
                )  # fmt: skip
                self._update(self.records[i])

    # -- the choice ----------------------------------------------------------------------------------
    def choose(self) -> tuple[TrialRecord, bool, str]:
        """(chosen trial, fell back, fallback warning). A plan that never ran is never chosen."""
        while True:
            best = choose_best(self.records, self.budget, tie_tolerance=self.tie_tolerance, confirmed_only=True)
            if best is None or best.memory_measured:
                break
            self.verify([best])  # never choose on a prediction alone
        if best is not None:
            return best, False, ""
        if self.config.on_infeasible == "fallback" and lowest_memory(self.records, self.budget) is None:
            # Everything was pruned (or failed): measure the plan predicted to use least memory first.
            pruned = [t for t in self.records if t.status == TrialStatus.PRUNED]
            if pruned:
                cand = min(
                    pruned,
                    key=lambda t: self.budget.value_of(t.predicted_peak_bytes, t.predicted_activation_bytes) or 0,
                )
                self.measure(cand.params, cand.plan, cand.label, cand.baseline, prune=False)
        lowest = lowest_memory(self.records, self.budget)
        while lowest is not None and not lowest.memory_measured:  # a fallback is measured too, never predicted
            self.verify([lowest])
            lowest = lowest_memory(self.records, self.budget)
        summary = ", ".join(f"{t.label}={t.status}" for t in self.records[:8])
        message = (
            f"No checkpointing plan fits the budget ({self.budget.description}). Tried {len(self.records)} plans "
            f"({summary}). Raise max_memory/activation_budget, reduce the batch size, or widen the search space."
        )
        if lowest is None and any(t.status == TrialStatus.ERROR for t in self.records):
            raise TrialsFailedError(
                "No checkpointing plan could be measured: every trial that ran failed, so there is nothing to apply."
                + failures_message(self.records)
                + "\nFix the error above (it comes from the training step, not from the budget) and run again."
            )
        if self.config.on_infeasible == "raise" or lowest is None:
            raise InfeasibleBudgetError(message + failures_message(self.records))
        return lowest, True, message + f" Falling back to the lowest-memory plan: {lowest.label}."

    def result(self, *, extra_steps: int, memory_table: str = "", memory_breakdown: Mapping[str, Any] | None = None,
               metadata: Mapping[str, Any] | None = None) -> TuneResult:  # fmt: skip
        """Choose, then the ``TuneResult`` with the chosen plan carrying its evidence as metadata."""
        import warnings

        try:
            best, fell_back, fallback_message = self.choose()
        except (InfeasibleBudgetError, TrialsFailedError):
            self._finish()  # the search is over: the record shows what was tried
            raise
        self._finish()
        if self._optuna is not None and best.plan.key() in self._stored:
            self._optuna.set_user_attr("chosen_trial", self._stored[best.plan.key()].number)
        if fell_back:
            warnings.warn(fallback_message, stacklevel=3)
        baselines = {
            t.baseline: {"status": t.status.value, "samples_per_second": t.samples_per_second,
                         "peak_bytes": t.peak_bytes, "activation_bytes": t.activation_bytes}
            for t in self.records if t.baseline is not None
        }  # fmt: skip
        chosen = replace(
            best.plan, name=best.plan.name or "tuned", fingerprint=self.fingerprint,
            metadata={
                **best.plan.metadata, "versions": library_versions(), "budget": self.budget.to_dict(),
                "measured": {
                    "label": best.label, "status": best.status.value, "samples_per_second": best.samples_per_second,
                    "median_seconds": best.median_seconds, "peak_bytes": best.peak_bytes,
                    "activation_bytes": best.activation_bytes, "predicted_peak_bytes": best.predicted_peak_bytes,
                    "recompute_overhead": best.recompute_overhead,
                },
                "baselines": baselines,
                "search": {
                    "n_trials": self.config.n_trials, "trials_run": len(self.records), "exhaustive": self.exhaustive,
                    "space_size": len(self.candidates), "seed": self.config.seed,
                    "sampler": type(self._sampler_study.sampler).__name__ if self._sampler_study is not None else None,
                    "study_name": self.study_name,
                    "status_counts": {s.value: n for s in TrialStatus if (n := sum(t.status == s for t in self.records))},
                    "confirmed": sum(t.confirmed for t in self.records),
                    "tie_tolerance": self.tie_tolerance, "fell_back": fell_back, "speed_changes": self.speed_changes,
                },
                **(metadata or {}),
            },
        )  # fmt: skip
        leader_digest = self.sync.broadcast(chosen.digest())
        if leader_digest != chosen.digest():
            raise ApplyError(
                f"Ranks disagree on the tuned plan: rank 0 chose {leader_digest}, this rank {chosen.digest()} "
                f"({chosen.describe()}). Trials must be combined identically on every rank; please report this."
            )
        return TuneResult(
            best=chosen, best_trial=best, trials=tuple(self.records), budget=self.budget,
            tuning_seconds=time.perf_counter() - self.started,
            tuning_steps=sum(t.steps for t in self.records) + extra_steps, fell_back=fell_back,
            fallback_message=fallback_message, memory_table=memory_table, memory_breakdown=dict(memory_breakdown or {}),
            study_name=self.study_name, storage=self.config.storage,
        )  # fmt: skip


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
        med = statistics.median(times)
        out[i] = replace(
            t, samples_per_second=1.0 / med, median_seconds=med * samples[t.number],
            steps=t.steps + len(times) * round_steps[t.number], confirmation_seconds=tuple(x * samples[t.number] for x in times),
            first_samples_per_second=t.first_samples_per_second or t.samples_per_second,
        )  # fmt: skip
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


def _send(proposals: Iterator[Proposal] | Any, record: TrialRecord) -> Proposal | None:
    try:
        return proposals.send(record)
    except StopIteration:
        return None


def _outcome(
    trial: TrialRecord, budget: Budget, *, for_sampler: bool = False
) -> tuple[Any, float | None, dict[str, float]]:
    """(Optuna state, value, constraints) of ``trial``. Feasible in Optuna's sense (every constraint <= 0)
    exactly when the tuner's status is ``ok``. ``for_sampler``: a failure is a ``COMPLETE`` trial scoring 0
    with its constraints violated, so the sampler learns to avoid it (samplers ignore ``FAIL`` trials)."""
    from optuna.trial import TrialState

    failed = trial.status.failed or trial.status == TrialStatus.CONFLICT
    constraints = {OVER_BUDGET_CONSTRAINT: _over_budget_bytes(trial, budget), FAILED_CONSTRAINT: float(failed)}
    if trial.status == TrialStatus.PRUNED:
        return TrialState.PRUNED, None, constraints
    if trial.samples_per_second is not None and not trial.status.failed:
        return TrialState.COMPLETE, float(trial.samples_per_second), constraints
    return (TrialState.COMPLETE, 0.0, constraints) if for_sampler else (TrialState.FAIL, None, constraints)


def _over_budget_bytes(trial: TrialRecord, budget: Budget) -> float:
    """The figure ``budget`` limits (measured, else predicted) minus the limit; 0 without a limit or a figure."""
    if budget.kind == "none" or budget.limit_bytes is None:
        return 0.0
    value = budget.value_of(trial.peak_bytes, trial.activation_bytes)
    if value is None:
        value = budget.value_of(trial.predicted_peak_bytes, trial.predicted_activation_bytes)
    over = float(value - budget.limit_bytes) if value is not None else 0.0
    if trial.status in (TrialStatus.OVER_BUDGET, TrialStatus.PRUNED):
        # Judged over budget on a figure not kept here (one rank's, or a figure missing): the status decides.
        over = max(over, 1.0)
    return over


def _attrs(trial: TrialRecord) -> dict[str, Any]:
    """The user attributes of ``trial``'s stored Optuna trial (``TRIAL_ATTRS``): all a resumed search rebuilds
    the record from (``storage=``), plain JSON."""
    attrs = {k: getattr(trial, k) for k in _RECORD_FIELDS}
    attrs["status"] = trial.status.value
    attrs["confirmation_seconds"] = list(trial.confirmation_seconds)
    attrs["plan"] = trial.plan.to_dict()
    attrs["params"] = dict(trial.params)
    return attrs


def _record_from_attrs(number: int, attrs: Mapping[str, Any]) -> TrialRecord | None:
    if "plan" not in attrs or attrs.get("status") not in {s.value for s in TrialStatus}:
        return None
    plan = Plan.from_dict(attrs["plan"], source="stored Optuna trial")
    fields = {k: attrs.get(k) for k in _RECORD_FIELDS}
    fields["seconds"] = float(fields["seconds"] or 0.0)
    fields["steps"] = int(fields["steps"] or 0)
    fields["memory_measured"] = fields["memory_measured"] is not False  # older studies measured every trial
    fields["confirmation_seconds"] = tuple(fields["confirmation_seconds"] or ())
    return TrialRecord(number=number, plan=plan, params=dict(attrs.get("params", {})), resumed=True, **fields)


def _optuna_params(params: Mapping[str, Any], distributions: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` as Optuna params: empty when outside the space's distributions (a baseline outside the user's
    restricted space), which keeps the trial out of the sampler's model; the ``params`` attribute keeps them."""
    inside = {k: v for k, v in params.items() if k in distributions}
    if len(inside) != len(params) or any(v not in distributions[k].choices for k, v in inside.items()):
        return {}
    return inside


@dataclass
class _StoredTrial:
    """The record study's trial of one plan: its number and id, whether it is still open, the attributes written."""

    number: int
    trial_id: int  # FrozenTrial._trial_id: Optuna has no public id, and ``optuna.trial.Trial`` needs it
    running: bool
    attrs: dict[str, Any]


_UNSET = object()


def _default_study_name(run: Mapping[str, Any]) -> str:
    """``lightning_ckpt-<model fingerprint>-<digest of the rest of the run>``: one study per model and run, so
    that a search interrupted and started again resumes, and a different batch size or device never does."""
    rest = {k: v for k, v in run.items() if k != "fingerprint"}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return "-".join(str(p) for p in ("lightning_ckpt", run.get("fingerprint"), digest) if p is not None)


def storage_for_display(storage: str | None) -> str:
    """``storage`` for a log line: the password of a database URL hidden; ``"in memory"`` for None."""
    if storage is None:
        return "in memory"
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", storage)
