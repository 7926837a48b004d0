"""The search loop: propose plans, prune what cannot fit, run the rest through a runner, confirm, choose.

``Study.run`` goes: resume a persisted study, then the baselines, then every distinct plan (small
spaces) or the sampler's proposals. One place decides per candidate: prune (predicted over budget) or
measure, and records the result. Ranks always move in lockstep through a ``Sync`` (a single process
uses ``LocalSync``): rank 0 proposes, every rank measures, results are combined identically.
``Study.confirm`` re-times the leaders side by side (``confirm.py``); ``Study.result`` chooses and
assembles the plan. What the search records in Optuna, and resumes from, is ``store.py``'s.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import (
    ApplyError,
    InfeasibleBudgetError,
    LightningCkptError,
    TrialsFailedError,
)
from lightning_ckpt.memory.optimizer_step import RealStepMemory
from lightning_ckpt.plan.format import Plan, library_versions
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.confirm import (
    ConfirmEntry,
    apply_confirmation,
    confirm_interleaved,
    confirmed_tie_tolerance,
    retimer,
    speed_change,
)
from lightning_ckpt.search.distributed import LocalSync, Sync, combine_trials
from lightning_ckpt.search.records import (
    ProgressFn,
    TrialRecord,
    TrialStatus,
    TuneResult,
    announce_confirmation,
    choose_plan,
    judge_status,
)
from lightning_ckpt.search.runners import TrialRunner
from lightning_ckpt.search.space import Candidate, SearchSpace
from lightning_ckpt.search.store import TrialStore
from lightning_ckpt.timing.model import TimeModel

__all__ = ["CollectiveTrialError", "SearchInterrupted", "Study"]

log = logging.getLogger(__name__)

# Consecutive proposals of already-known plans after which the study takes an unseen plan itself:
# a sampler that has seen most of a space redraws known points, and every redraw costs a suggest call
# whose cost grows with the study (54 of 105 s of a 16-layer search went there before this bound).
_MAX_REDRAWS = 2
# After a speed change, at most this many fitting trials are re-ranked side by side before the confirmation.
_MAX_RERANKED = 24
# The noise margin a plan's predicted step time must clear to be measured (``Study._can_win``): the time
# model's own measured error (1.25x its median out-of-sample error), within these bounds; before any error
# is known, the default.
_MARGIN_BOUNDS = (0.03, 0.08)
_DEFAULT_MARGIN = 0.05
# With the time model, the confirmation re-times only what could still be chosen (``Study._leaders_by_both``):
# the tuned plans measured within twice the noise margin (at least this share) of the fastest, the plans
# predicted fastest and the reference; for exactly ``confirm_rounds`` rounds (the model has already ranked
# them: more rounds only split plans a few percent apart).
_CONFIRM_WINDOW = 0.05

# params, plan, label, baseline name, what prunes it without running (None: run it, unless over budget)
Proposal = tuple[Mapping[str, Any], Plan, str, str | None, str | None]


class CollectiveTrialError(LightningCkptError):
    """A trial failed on this rank while its step ran collectives (FSDP2): the search ended here."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SearchInterrupted(LightningCkptError):
    """``should_stop`` asked the search to end (e.g. SIGTERM): no plan was chosen, the model is as it was."""


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
        # The time model (``timing.model``) decides what is measured, when the profile timed the blocks and the
        # runner's steps are the ones it timed (eager: a compiled step's time is the compiler's).
        timing = getattr(memory.model, "timing", None) if memory is not None else None
        usable = config.predict_time and getattr(runner, "predicts_time", False)
        self.time_model: TimeModel | None = timing if usable else None
        self._rng = random.Random(config.seed)
        # What the figures depend on (``run``: seq_len, device, compiled, from ``tune``); the budget is not in
        # it (the default CUDA budget follows free memory): resumed trials are judged against today's.
        self.run_info: dict[str, Any] = {
            "fingerprint": fingerprint,
            "batch_size": samples_per_step,
            "world_size": self.sync.world_size,
            **(run or {}),
        }
        # Rank 0's Optuna studies (``store.py``), opened by run(): the study decides, the store only records.
        self.store = TrialStore(
            config=config, run_info=self.run_info, budget=budget, distributions=self.space.distributions(stacks)
        )
        self.study_name = self.store.study_name

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[TrialRecord]:
        """Resume, then baselines, then the rest of the space or the sampler's proposals, in lockstep."""
        self._resume()
        proposals = self._proposals() if self.sync.is_leader else None
        proposal = next(proposals, None) if proposals is not None else None
        while True:
            message = None
            if proposal is not None:
                params, plan, label, baseline, pruned_by = proposal
                pruned_by = "memory" if self._predicted_over_budget(plan) else pruned_by
                message = (dict(params), plan.to_dict(), label, baseline, pruned_by)
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
        self, params: Mapping[str, Any], plan: Plan, label: str, baseline: str | None, *, prune: str | None
    ) -> TrialRecord:
        """Prune (``prune``: by the ``"memory"`` or the ``"time"`` model) or run one candidate on every rank,
        combine, record and report it. A plan measured again (the fallback measuring a pruned plan) replaces its
        record, so there is one record per plan."""
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
        if self.time_model is not None and trial.median_seconds:
            self._calibrate()
        if self.progress is not None:
            self.progress(trial, self.budget)
        return trial

    def _update(self, trial: TrialRecord) -> None:
        """``trial`` is the plan's record now (``self.records`` already holds it): index and store it."""
        self.by_key[trial.plan.key()] = trial
        self.store.store(trial)

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
        self, params: Mapping[str, Any], plan: Plan, label: str, baseline: str | None, prune: str | None
    ) -> TrialRecord:
        t0 = time.perf_counter()
        predicted = self.memory.predict(plan) if self.memory is not None and self.runner.predicts_memory else None
        peak, activation = predicted if predicted else (None, None)
        new = TrialRecord(
            number=len(self.records),
            plan=plan,
            label=label,
            params=dict(params),
            baseline=baseline,
            predicted_peak_bytes=peak,
            predicted_activation_bytes=activation,
            predicted_seconds=self.time_model.predict_seconds(plan) if self.time_model is not None else None,
        )
        if prune:
            return replace(new, status=TrialStatus.PRUNED, pruned_by=prune, seconds=time.perf_counter() - t0)
        lazy = self.lazy_memory and predicted is not None
        out = self.runner.measure(plan, self.memory_limit, memory=not lazy)
        if out.trial_status.failed and getattr(self.runner, "collective_steps", False):
            self._end_on_collective_failure(label, out)
        new = replace(new, seconds=time.perf_counter() - t0)
        if lazy and out.status == TrialStatus.OK:
            # Timed only: the memory is the prediction until verify() gives the trial its memory pass.
            predicted_memory = replace(new, peak_bytes=peak, activation_bytes=activation, memory_measured=False)
            return self._judged(predicted_memory.with_measurement(out, memory=False), out)
        return self._with_memory(new, out)

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
        return self._judged(trial.with_measurement(out, real_peak_bytes=peak, timed=not keep_timing), out)

    def _judged(self, trial: TrialRecord, out: Any) -> TrialRecord:
        conflict = None if trial.plan.is_empty else out.conflict
        fits = self.budget.fits(trial.peak_bytes, trial.activation_bytes)
        status = judge_status(out.trial_status, conflict, allow_graph_breaks=self.config.allow_graph_breaks, fits=fits)
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
        tuned plan must beat is re-timed beside it whatever its first figure), each with measured memory.

        With the time model, only what could still be chosen (``_leaders_by_both``): the leaders by measurement
        and by prediction, and the fastest fitting baseline (the reference) whatever its figure. Their memory
        stays predicted (exact on CPU) until one is chosen: ``choose`` verifies the winner, and chooses again if
        it does not fit."""
        if self.time_model is not None:
            feasible = _fastest_fitting(self.records)
            return self._leaders_by_both(feasible, top) if feasible else []
        while True:
            feasible = _fastest_fitting(self.records)
            leaders = feasible[:top]
            leaders += [t for t in feasible if t.baseline is not None and t not in leaders]
            unverified = [t for t in leaders if not t.memory_measured]
            if not unverified:
                return leaders
            self.verify(unverified)

    def _leaders_by_both(self, feasible: Sequence[TrialRecord], top: int) -> list[TrialRecord]:
        """With the time model: ``top`` tuned plans, the one predicted fastest first (a plan timed in a slow moment
        of the machine still gets its side-by-side figure), then the fastest measured within the window (twice
        the noise margin, ``_CONFIRM_WINDOW`` at least); the baseline predicted fastest; and the fastest fitting
        baseline by measurement (the reference)."""
        assert self.time_model is not None
        window = max(_CONFIRM_WINDOW, 2 * self.noise_margin())
        floor = (feasible[0].samples_per_second or 0.0) * (1.0 - window)
        tuned = [t for t in feasible if t.baseline is None]
        baselines = [t for t in feasible if t.baseline is not None]
        by_prediction = sorted((t for t in tuned if t.predicted_seconds is not None), key=lambda t: t.predicted_seconds)
        by_measurement = [t for t in tuned if (t.samples_per_second or 0.0) >= floor]
        leaders = list({t.number: t for t in (*by_prediction[:1], *by_measurement)}.values())[:top]
        predicted_baselines = [t for t in baselines if t.predicted_seconds is not None]
        if predicted_baselines:
            leaders.append(min(predicted_baselines, key=lambda t: t.predicted_seconds or 0.0))
        leaders += baselines[:1]
        unique = {t.number: t for t in leaders}
        return sorted(unique.values(), key=lambda t: -(t.samples_per_second or 0.0))

    # -- proposals (rank 0) ------------------------------------------------------------------------
    def _proposals(self) -> Iterator[Proposal]:
        """Rank 0's candidates; each ``yield`` receives (via ``send``) the record the candidate produced. The
        sampler's study learns every record (``measure`` has already written it to the record study)."""
        if self.time_model is not None:
            yield from self._predicted_proposals()
            return
        queue = [c for c in self.candidates if c.baseline is not None]
        if self.exhaustive:
            queue += [c for c in self.candidates if c.baseline is None]
        for cand in queue:
            if self._done():
                return
            if cand.plan.key() in self.by_key or not self._offered(cand.plan):
                continue
            record = yield cand.params, cand.plan, cand.label, cand.baseline, None
            self.store.learn(record)
        redraws = 0
        while not self.exhaustive and not self._done() and len(self.by_key) < len(self.candidates):
            ot = self.store.ask()
            params = self.space.suggest(ot, self.stacks)
            plan = self.space.plan_for(params, self.stacks, fingerprint=self.fingerprint)
            if plan.key() not in self.by_key and self._offered(plan):
                redraws = 0
                record = yield params, plan, plan.describe(), None, None
                self.store.tell(ot, record)
                continue
            self.store.tell(ot, None)  # a known (or unrunnable) plan
            redraws += 1
            if redraws >= _MAX_REDRAWS:
                unseen = [c for c in self.candidates if c.plan.key() not in self.by_key and self._offered(c.plan)]
                if not unseen:
                    return
                cand = unseen[self._rng.randrange(len(unseen))]
                redraws = 0
                record = yield cand.params, cand.plan, cand.label, cand.baseline, None
                self.store.learn(record)

    def _predicted_proposals(self) -> Iterator[Proposal]:
        """The space scored whole by the time model. The plans predicted over budget are pruned first (free). Then
        the fitting baseline predicted fastest is measured (the reference a tuned plan must beat, and the model's
        first anchor; before any step is measured plans rank by what their modes add, which needs no anchor),
        then the predicted-fastest plan left, baseline or not, the model refitted after each, until the fastest
        left cannot beat the best measured plan by the noise margin (``_can_win``): the rest are pruned then,
        each recorded with its prediction. A plan the model cannot predict (a mode its block could not be timed
        under) is measured; ``n_trials`` and ``timeout`` still bound the measured ones."""
        assert self.time_model is not None
        self._calibrate()  # a resumed study's plans are anchors already
        for cand in self._unseen():
            if self._predicted_over_budget(cand.plan):
                record = yield cand.params, cand.plan, cand.label, cand.baseline, "memory"
                self.store.learn(record)
        while not self._done():
            remaining = self._unseen()
            if not remaining:
                return
            ranked = {c.plan.key(): self._rank_seconds(c.plan) for c in remaining}
            unpredictable = [c for c in remaining if ranked[c.plan.key()] is None]
            ordered = sorted((c for c in remaining if c not in unpredictable), key=lambda c: ranked[c.plan.key()])
            baselines = [c for c in ordered if c.baseline is not None]
            if baselines and not any(t.baseline is not None and t.feasible for t in self.records):
                cand = baselines[0]  # until a baseline is measured within budget: the reference
            else:
                cand = unpredictable[0] if unpredictable else ordered[0]
            if cand not in unpredictable and not self._can_win(self.time_model.predict_seconds(cand.plan)):
                for c in ordered:
                    record = yield c.params, c.plan, c.label, c.baseline, "time"
                    self.store.learn(record)
                return
            record = yield cand.params, cand.plan, cand.label, cand.baseline, None
            self.store.learn(record)

    def _rank_seconds(self, plan: Plan) -> float | None:
        """What orders the plans: the predicted step, or before any anchor what the plan's modes add to one."""
        assert self.time_model is not None
        predicted = self.time_model.predict_seconds(plan)
        return predicted if predicted is not None else self.time_model.added_seconds(plan)

    def _unseen(self) -> list[Candidate]:
        return [c for c in self.candidates if c.plan.key() not in self.by_key and self._offered(c.plan)]

    def _can_win(self, predicted_seconds: float | None) -> bool:
        """Whether a plan predicted to take ``predicted_seconds`` a step could beat the best plan measured within
        budget: it could unless it is predicted slower even after the noise margin is taken off its time."""
        best = _fastest_fitting(self.records)
        if predicted_seconds is None or not best or not best[0].median_seconds:
            return True
        return predicted_seconds * (1.0 - self.noise_margin()) < best[0].median_seconds

    def noise_margin(self) -> float:
        """How far the time model's predictions may be off: 1.25x the median of its errors so far (each taken
        before the plan was measured), within ``_MARGIN_BOUNDS`` and never below the tie tolerance."""
        errors = [abs(e) for t in self.records if (e := t.prediction_error) is not None]
        observed = 1.25 * statistics.median(errors) if errors else _DEFAULT_MARGIN
        return min(_MARGIN_BOUNDS[1], max(_MARGIN_BOUNDS[0], self.config.tie_tolerance, observed))

    def time_model_summary(self) -> dict[str, Any]:
        """What the time model did: its fit, its measured errors, the margin, and what it pruned."""
        errors = [e for t in self.records if (e := t.prediction_error) is not None]
        calibration = self.time_model.calibration if self.time_model is not None else None
        return {
            "calibration": calibration.to_dict() if calibration is not None else None,
            "noise_margin": self.noise_margin(),
            "predicted_and_measured": len(errors),
            "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
            "max_abs_error": max((abs(e) for e in errors), default=None),
            "pruned_by_time": sum(t.pruned_by == "time" for t in self.records),
        }

    def _calibrate(self) -> None:
        """Fit the time model to every plan timed so far (within budget or not: speed does not depend on it)."""
        if self.time_model is None:
            return
        timed = [
            (t.plan, t.label, t.median_seconds)
            for t in self.records
            if t.status in (TrialStatus.OK, TrialStatus.OVER_BUDGET) and t.median_seconds
        ]
        self.time_model = self.time_model.calibrated(timed)

    def _offered(self, plan: Plan) -> bool:
        """Whether ``plan`` can run: the profile allows it, and no trial saw its segments leave the chain."""
        if plan.segments.keys() & self.unchained:
            return False
        return self.memory is None or self.memory.can_run(plan) is None

    def _resume(self) -> None:
        """Take the plans an earlier run stored (``storage=``) as they are, judged against today's budget."""
        resumed = self.store.resume(
            self.sync, self._predicted_over_budget, known=self.by_key.keys(), first_number=len(self.records)
        )
        for record in resumed:
            self.records.append(record)
            self.by_key[record.plan.key()] = record
        if self.records:
            log.info("lightning_ckpt: resumed %d trials from the Optuna study %r", len(self.records), self.study_name)

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
        # With the time model the leaders are picked by prediction as well as by measurement, so a plan timed in
        # a slow (or fast) moment is among them anyway: no re-ranking. The reference's first confirmation round
        # says whether the machine's speed changed since the search timed it (reported, not acted on).
        if self.time_model is None and self._speed_changed_since_search(chosen, steps):
            self._rerank(steps)
            chosen = self._verified_leaders(config.confirm_top)
        entries, side = self._confirm_rounds(chosen, steps)
        if self.time_model is not None:
            self._reference_moved(chosen, side)
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

    def _confirm_rounds(self, chosen: Sequence[TrialRecord], steps: int) -> tuple[list[ConfirmEntry], Any]:
        """The interleaved rounds over ``chosen``: ``confirm_rounds`` to ``confirm_max_rounds`` of them, and with
        the time model (which already ranked them) exactly ``confirm_rounds``."""
        config = self.config
        announce_confirmation(self.progress, chosen)
        entries = self._entries(chosen, steps)
        max_rounds = config.confirm_rounds if self.time_model is not None else config.confirm_max_rounds
        side = confirm_interleaved(entries, min_rounds=config.confirm_rounds, max_rounds=max_rounds, sync=self.sync)
        return entries, side

    def _reference(self, leaders: Sequence[TrialRecord]) -> TrialRecord:
        """The plan whose speed is compared before and after: the fastest fitting baseline, else the leader."""
        baselines = [t for t in leaders if t.baseline is not None]
        return max(baselines or leaders, key=lambda t: t.samples_per_second or 0.0)

    def _speed_changed_since_search(self, leaders: Sequence[TrialRecord], steps: int) -> bool:
        """Re-time the reference once; True if its speed changed since the search timed it."""
        reference = self._reference(leaders)
        m = self.runner.retime(reference.plan, steps)
        seconds = m.median_seconds if m.status == "ok" else None
        gathered = self.sync.all_gather(seconds)
        now = max(gathered) if all(g is not None for g in gathered) else None
        return self._speed_changed(reference, now)

    def _reference_moved(self, leaders: Sequence[TrialRecord], side: Any) -> bool:
        """True if the reference's first confirmation round shows the machine's speed changed since the search."""
        reference = self._reference(leaders)
        times = side.per_sample.get(reference.number)
        return self._speed_changed(reference, times[0] * self.samples_per_step if times else None)

    def _speed_changed(self, reference: TrialRecord, now: float | None) -> bool:
        ratio = speed_change(reference.median_seconds, now, reference.spread_seconds or 0.0)
        if ratio is None:
            return False
        done = (
            "the leaders by measurement and by prediction were confirmed side by side"
            if self.time_model is not None
            else "every fitting plan was re-ranked side by side"
        )
        self.speed_changes.append(
            f"between the search and the confirmation: {reference.label} re-timed at {ratio:.2f}x its search speed; "
            + done
        )
        log.warning(
            "lightning_ckpt: the machine's speed changed during the search (%s re-timed at %.2fx its search "
            "speed): %s.",
            reference.label,
            ratio,
            done,
        )
        return True

    def _rerank(self, steps: int) -> None:
        """One interleaved round over the fitting trials (at most ``_MAX_RERANKED``): figures taken side by side
        replace the search's, so the leaders are picked at one speed. They do not count as confirmed."""
        entries = self._entries(_fastest_fitting(self.records)[:_MAX_RERANKED], steps)
        side = confirm_interleaved(entries, min_rounds=1, max_rounds=1, sync=self.sync)
        for i, t in enumerate(self.records):
            times = side.per_sample.get(t.number)
            if times:
                self.records[i] = replace(
                    t,
                    samples_per_second=1.0 / times[0],
                    median_seconds=times[0] * self.samples_per_step,
                    steps=t.steps + steps + 1,
                    first_samples_per_second=t.first_samples_per_second or t.samples_per_second,
                )
                self._update(self.records[i])

    def _entries(self, trials: Sequence[TrialRecord], steps: int) -> list[ConfirmEntry]:
        """``trials`` to re-time side by side, ``steps`` timed steps (and one warm-up) a round each."""
        return [ConfirmEntry(t, retimer(self.runner, t.plan, steps), self.samples_per_step, steps + 1) for t in trials]

    # -- the choice ----------------------------------------------------------------------------------
    def choose(self) -> tuple[TrialRecord, bool, str]:
        """(chosen trial, fell back, fallback warning) by ``records.choose_plan``: a plan that never ran is never
        chosen, and none is chosen on predicted memory (``verify``); the fallback is measured if it was pruned."""
        return choose_plan(
            lambda: self.records,
            self.budget,
            tie_tolerance=self.tie_tolerance,
            on_infeasible=self.config.on_infeasible,
            nothing_fits=self._nothing_fits,
            verify=lambda t: self.verify([t]),
            measure=self._measure_again,
        )

    def _measure_again(self, trial: TrialRecord) -> None:
        self.measure(trial.params, trial.plan, trial.label, trial.baseline, prune=None)

    def _nothing_fits(self, records: Sequence[TrialRecord]) -> str:
        summary = ", ".join(f"{t.label}={t.status}" for t in records[:8])
        return (
            f"No checkpointing plan fits the budget ({self.budget.description}). Tried {len(records)} plans "
            f"({summary}). Raise max_memory/activation_budget, reduce the batch size, or widen the search space."
        )

    def result(
        self,
        *,
        extra_steps: int,
        memory_table: str = "",
        memory_breakdown: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> TuneResult:
        """Choose, then the ``TuneResult`` with the chosen plan carrying its evidence as metadata."""
        import warnings

        try:
            best, fell_back, fallback_message = self.choose()
        except (InfeasibleBudgetError, TrialsFailedError):
            self.store.finish(self.by_key)  # the search is over: the record shows what was tried
            raise
        self.store.finish(self.by_key)
        self.store.mark_chosen(best)
        if fell_back:
            warnings.warn(fallback_message, stacklevel=3)
        chosen = replace(
            best.plan,
            name=best.plan.name or "tuned",
            fingerprint=self.fingerprint,
            metadata={**best.plan.metadata, **self._evidence(best, fell_back), **(metadata or {})},
        )
        leader_digest = self.sync.broadcast(chosen.digest())
        if leader_digest != chosen.digest():
            raise ApplyError(
                f"Ranks disagree on the tuned plan: rank 0 chose {leader_digest}, this rank {chosen.digest()} "
                f"({chosen.describe()}). Trials must be combined identically on every rank; please report this."
            )
        return TuneResult(
            best=chosen,
            best_trial=best,
            trials=tuple(self.records),
            budget=self.budget,
            tuning_seconds=time.perf_counter() - self.started,
            tuning_steps=sum(t.steps for t in self.records) + extra_steps,
            fell_back=fell_back,
            fallback_message=fallback_message,
            memory_table=memory_table,
            memory_breakdown=dict(memory_breakdown or {}),
            study_name=self.study_name,
            storage=self.config.storage,
        )

    def _evidence(self, best: TrialRecord, fell_back: bool) -> dict[str, Any]:
        """What the chosen plan's metadata says of how it was found: its figures, the baselines', the search's."""
        search = {
            "n_trials": self.config.n_trials,
            "trials_run": len(self.records),
            "exhaustive": self.exhaustive,
            "space_size": len(self.candidates),
            "seed": self.config.seed,
            "sampler": self.store.sampler_name,
            "study_name": self.study_name,
            "status_counts": {s.value: n for s in TrialStatus if (n := sum(t.status == s for t in self.records))},
            "confirmed": sum(t.confirmed for t in self.records),
            "tie_tolerance": self.tie_tolerance,
            "fell_back": fell_back,
            "speed_changes": self.speed_changes,
        }
        if self.time_model is not None:
            search["time_model"] = self.time_model_summary()
        return {
            "versions": library_versions(),
            "budget": self.budget.to_dict(),
            "measured": _measured_figures(best),
            "baselines": {t.baseline: _baseline_figures(t) for t in self.records if t.baseline is not None},
            "search": search,
        }


def _send(proposals: Iterator[Proposal] | Any, record: TrialRecord) -> Proposal | None:
    try:
        return proposals.send(record)
    except StopIteration:
        return None


def _fastest_fitting(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """The trials that fit and were timed, fastest first."""
    timed = [t for t in records if t.feasible and t.samples_per_second]
    return sorted(timed, key=lambda t: -(t.samples_per_second or 0.0))


def _measured_figures(best: TrialRecord) -> dict[str, Any]:
    return {
        "label": best.label,
        "status": best.status.value,
        "samples_per_second": best.samples_per_second,
        "median_seconds": best.median_seconds,
        "peak_bytes": best.peak_bytes,
        "activation_bytes": best.activation_bytes,
        "predicted_peak_bytes": best.predicted_peak_bytes,
        "recompute_overhead": best.recompute_overhead,
    }


def _baseline_figures(trial: TrialRecord) -> dict[str, Any]:
    return {
        "status": trial.status.value,
        "samples_per_second": trial.samples_per_second,
        "peak_bytes": trial.peak_bytes,
        "activation_bytes": trial.activation_bytes,
    }
