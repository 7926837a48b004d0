"""The search loop: propose plans, prune what cannot fit, run the rest through a runner, confirm, choose.

A ``Study`` is handed a proposer (``proposers.py``: Optuna's sampler, or the time model's ranking) and a runner
(``runners.py``), and knows nothing else of either: one loop (ask the proposer -> prune by memory or by
prediction -> measure -> tell), one confirmation, one choice. Ranks always move in lockstep through a ``Sync`` (a single process
uses ``LocalSync``): rank 0 proposes, every rank measures, results are combined identically.
``Study.confirm`` re-times the proposer's leaders and every fitting baseline side by side (``confirm.py``) until
each leader has a decided verdict (``verdict.py``); ``Study.result`` chooses by those verdicts and assembles the
plan. What the search records in Optuna, and resumes from, is ``store.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import (
    ApplyError,
    InfeasibleBudgetError,
    LightningCkptError,
    TrialsFailedError,
)
from lightning_ckpt.formatting import count, format_bytes
from lightning_ckpt.memory.optimizer_step import RealStepMemory
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.confirm import SideBySide, beats_by, reported_verdict
from lightning_ckpt.search.confirmation import Confirmation
from lightning_ckpt.search.distributed import LocalSync, Sync, combine_trials
from lightning_ckpt.search.proposers import Proposal, Proposer, SamplerProposer
from lightning_ckpt.search.records import (
    ProgressFn,
    TrialRecord,
    TrialStatus,
    TuneResult,
    choose_plan,
    judge_status,
)
from lightning_ckpt.search.result import SearchFacts, evidence
from lightning_ckpt.search.runners import TrialRunner
from lightning_ckpt.search.space import Candidate, SearchSpace
from lightning_ckpt.search.store import TrialStore
from lightning_ckpt.search.verdict import Verdict

__all__ = ["CollectiveTrialError", "SearchInterrupted", "Study", "Workload"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    """What a candidate's step runs with: its runner, its memory model, the samples one step processes. A search of
    one shape has one (``micro_batch`` None); the joint search one per micro-batch, its candidates carrying the
    micro-batch as a dimension (``Candidate.micro_batch``): one engine over the larger space."""

    runner: TrialRunner
    memory: RealStepMemory | None
    samples_per_step: int = 1
    micro_batch: int | None = None
    accumulation: int | None = None

    def labelled(self, label: str) -> str:
        """A candidate's label, with its micro-batch in the joint search: ``full [micro-batch 4 x2]``."""
        return label if self.micro_batch is None else f"{label} [micro-batch {self.micro_batch} x{self.accumulation}]"


class CollectiveTrialError(LightningCkptError):
    """A trial failed on this rank while its step ran collectives (FSDP2): the search ended here."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SearchInterrupted(LightningCkptError):
    """``should_stop`` asked the search to end (e.g. SIGTERM): no plan was chosen, the model is as it was."""


class Study:
    """One search over ``candidates`` (every distinct plan of the space), in the order ``proposer`` gives."""

    def __init__(
        self,
        *,
        candidates: Sequence[Candidate],
        space: SearchSpace,
        stacks: Sequence[Any],
        budget: Budget,
        config: TuneConfig,
        runner: TrialRunner | None = None,
        memory: RealStepMemory | None = None,
        fingerprint: str | None,
        device_type: str,
        sync: Sync | None = None,
        progress: ProgressFn | None = None,
        should_stop: Callable[[], bool] | None = None,
        samples_per_step: int = 1,
        run: Mapping[str, Any] | None = None,
        proposer: Proposer | None = None,
        workloads: Sequence[Workload] | None = None,
    ) -> None:
        """``runner``/``memory``/``samples_per_step``: a search of one shape; ``workloads`` instead: one per
        micro-batch of the joint search (each candidate's ``params["micro_batch"]`` picks its own)."""
        self.candidates = list(candidates)
        if workloads is None:
            if runner is None:
                raise TypeError("Study needs a runner (a search of one shape) or workloads (the joint search)")
            workloads = [Workload(runner, memory, samples_per_step)]
        self.workloads = {w.micro_batch: w for w in workloads}
        base = workloads[0]
        self.space, self.stacks, self.runner, self.budget = space, stacks, base.runner, budget
        self.memory, self.config, self.fingerprint = base.memory, config, fingerprint
        # On CPU the memory model is exact: trials are timed only, and the plans that can still be chosen
        # get the slow tracked pass (verify). On CUDA every trial reads the allocator anyway.
        self.lazy_memory = (
            config.memory_pass == "finalists"
            and device_type == "cpu"
            and all(w.memory is not None and w.runner.predicts_memory and w.runner.memory_exact for w in workloads)
        )
        self.sync: Sync = sync or LocalSync()
        self.progress, self.should_stop = progress, should_stop
        self.records: list[TrialRecord] = []
        self.by_key: dict[str, TrialRecord] = {}
        # Stacks a trial saw leave the chain at run time (a parent that skips blocks on some batches only):
        # segments over them are offered no more (see runners._with_deviations).
        self.unchained: set[str] = set()
        self.exhaustive = len(self.candidates) <= config.n_trials  # every distinct plan can be measured
        self.started = time.perf_counter()
        self.tie_tolerance = config.tie_tolerance
        self.side: SideBySide | None = None  # the confirmation's rounds (confirm()), which the verdicts come from
        self.held_out: Verdict | None = None  # the chosen tuned plan's verdict from fresh rounds (``_held_out``)
        # Run on the choice before the result is made (the compiled search's check of a PT2 budget compiled the user's
        # way, ``whole_check``): the plan it returns is the one kept.
        self.after_choice: Callable[[TrialRecord], TrialRecord] | None = None
        self.none_fits = False  # no checkpointing was predicted to fit and chosen without a search (``_none_fits``)
        self.speed_changes: list[str] = []  # what confirm() saw of the machine's speed changing (report, plan file)
        limit = (
            budget.limit_bytes if config.enforce_budget and budget.kind == "peak" and device_type == "cuda" else None
        )
        self.limits = {w.micro_batch: w.memory.trial_limit(limit) if w.memory is not None else limit for w in workloads}
        self.proposer: Proposer = proposer or SamplerProposer(config.seed, config.sampler, n_trials=config.n_trials)
        # What the figures depend on (``run``: seq_len, device, compiled, from ``tune``); the budget is not in
        # it (the default CUDA budget follows free memory): resumed trials are judged against today's.
        self.run_info: dict[str, Any] = {
            "fingerprint": fingerprint,
            "batch_size": samples_per_step,
            "world_size": self.sync.world_size,
            **(run or {}),
        }
        # Rank 0's Optuna studies (``store.py``), opened by run(): the study decides, the store only records.
        distributions = dict(self.space.distributions(stacks))
        sizes = sorted(m for m in self.workloads if m is not None)
        if sizes:  # the joint search: the micro-batch is one more dimension for the sampler
            import optuna

            distributions["micro_batch"] = optuna.distributions.CategoricalDistribution(sizes)
        self.store = TrialStore(
            config=config,
            run_info=self.run_info,
            budget=budget,
            distributions=distributions,
            sampler=self.proposer.sampler,
        )
        self.study_name = self.store.study_name

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[TrialRecord]:
        """Resume, then baselines, then the rest of the space or the sampler's proposals, in lockstep; or, where the
        memory model predicts that no checkpointing fits, that plan alone (``_none_fits``)."""
        self._resume()
        if self._none_fits():
            return self.records
        proposals = self.proposer.proposals(self) if self.sync.is_leader else None
        proposal = next(proposals, None) if proposals is not None else None
        while True:
            self.check_stop()
            message = None
            if proposal is not None:
                params, plan, label, baseline, pruned_by = proposal
                pruned_by = "memory" if self.predicted_over_budget(plan, params.get("micro_batch")) else pruned_by
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

    def _none_fits(self) -> bool:
        """Measure the plan without checkpointing alone, and True when it fits, where the memory model predicts it does
        (rank 0's prediction decides, for every rank): no plan can then be faster (recompute and offload only add
        time), so a search would measure plans to confirm it. Not with ``search_when_none_fits``, without a budget
        (the fastest plan is asked for), in the joint micro-batch search, nor where memory is not predicted. A plan
        measured over the budget after all (the allocator's reserve on a card) goes on to the search, saying so."""
        if self.config.search_when_none_fits or self.budget.kind == "none" or len(self.workloads) != 1:
            return False
        none = next((c for c in self.candidates if c.baseline == "none"), None)
        w = next(iter(self.workloads.values()))
        predicted = (
            w.memory.predict(none.plan)
            if none is not None and w.memory is not None and w.runner.predicts_memory
            else None
        )
        fits = self.sync.broadcast(predicted is not None and self.budget.fits(*predicted))
        if not fits or none is None:
            return False
        trial = self.measure(none.params, none.plan, none.label, none.baseline, prune=None)
        if trial.feasible:
            self.none_fits = True  # the result line says so (``report.text.result_line``)
            return True
        measured = format_bytes(self.budget.value_of(trial.peak_bytes, trial.activation_bytes))
        log.warning(
            "lightning_ckpt: no checkpointing did not fit after all (%s: %s, budget %s), though the memory model "
            "predicted it would: searching the plans that use less memory",
            trial.status.value,
            measured,
            self.budget.description,
        )
        return False

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
        earlier = self.by_key.get(trial.key())
        if earlier is None:
            self.records.append(trial)
        else:
            trial = replace(trial, number=earlier.number)
            self.records[self.records.index(earlier)] = trial
        self.update(trial)
        if trial.median_seconds:
            self.proposer.observe(self.records)
        if self.progress is not None:
            self.progress(trial, self.budget)
        return trial

    def evidence(self, best: TrialRecord, fell_back: bool) -> dict[str, Any]:
        """What the chosen plan's metadata says of how it was found (``result.evidence``, from this study's state)."""
        return evidence(
            best,
            self.records,
            self.budget,
            SearchFacts(
                n_trials=self.config.n_trials,
                exhaustive=self.exhaustive,
                space_size=len(self.candidates),
                seed=self.config.seed,
                sampler=self.store.sampler_name,
                proposer=self.proposer.name,
                study_name=self.study_name,
                tie_tolerance=self.tie_tolerance,
                speed_changes=tuple(self.speed_changes),
                proposer_summary=self.proposer.summary(self.records),
                verdict=self.final_verdict(best),
                none_fits=self.none_fits,
            ),
            fell_back,
        )

    def update(self, trial: TrialRecord) -> None:
        """``trial`` is the plan's record now (``self.records`` already holds it): index and store it."""
        self.by_key[trial.key()] = trial
        self.store.store(trial)

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise SearchInterrupted(
                f"The search was asked to stop after {len(self.records)} trials; no plan was chosen."
            )

    # -- what a proposer reads (``proposers.SearchState``) ---------------------------------------------
    def out_of_time(self) -> bool:
        return self.config.timeout is not None and time.perf_counter() - self.started > self.config.timeout

    def done(self) -> bool:
        """``n_trials`` plans measured (pruned ones are free), or out of time."""
        self.check_stop()
        measured = sum(t.status != TrialStatus.PRUNED for t in self.records)
        return measured >= self.config.n_trials or self.out_of_time()

    def workload(self, micro_batch: int | None) -> Workload:
        """The workload a candidate of ``micro_batch`` runs with (None: the search's one shape)."""
        return self.workloads[micro_batch]

    def predicted_over_budget(self, plan: Plan, micro_batch: int | None = None) -> bool:
        w = self.workload(micro_batch)
        if w.memory is None or not w.runner.predicts_memory:
            return False
        predicted = w.memory.predict(plan)
        return predicted is not None and not self.budget.fits(*predicted)

    def suggest(self, asked: Any) -> Candidate:
        """The candidate an Optuna trial (``asked``) proposes: the space's point, and the micro-batch where the
        search has one."""
        params = dict(self.space.suggest(asked, self.stacks))
        sizes = sorted(m for m in self.workloads if m is not None)
        if sizes:
            params["micro_batch"] = asked.suggest_categorical("micro_batch", sizes)
        plan = self.space.plan_for(params, self.stacks, fingerprint=self.fingerprint)
        return Candidate(params, plan, self.workload(params.get("micro_batch")).labelled(plan.describe()))

    def _trial(
        self, params: Mapping[str, Any], plan: Plan, label: str, baseline: str | None, prune: str | None
    ) -> TrialRecord:
        t0 = time.perf_counter()
        w = self.workload(params.get("micro_batch"))
        predicted = w.memory.predict(plan) if w.memory is not None and w.runner.predicts_memory else None
        peak, activation = predicted if predicted else (None, None)
        new = TrialRecord(
            number=len(self.records),
            plan=plan,
            label=label,
            params=dict(params),
            baseline=baseline,
            predicted_peak_bytes=peak,
            predicted_activation_bytes=activation,
            predicted_seconds=self.proposer.predict_seconds(plan),
            micro_batch=w.micro_batch,
            accumulation=w.accumulation,
        )
        if prune:
            return replace(new, status=TrialStatus.PRUNED, pruned_by=prune, seconds=time.perf_counter() - t0)
        lazy = self.lazy_memory and predicted is not None
        out = w.runner.measure(plan, self.limits[w.micro_batch], memory=not lazy)
        if out.trial_status.failed and getattr(w.runner, "collective_steps", False):
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

    def judge(self, trial: TrialRecord, out: Any) -> TrialRecord:
        """``trial`` with the measurement ``out`` of its plan by another runner (``whole_check``), its memory taken to
        the real step and judged against the budget; the study's records are not changed."""
        return self._with_memory(trial, out)

    def memory_limit(self, micro_batch: int | None) -> int | None:
        """The allocator cap a trial of ``micro_batch`` runs under (None: uncapped)."""
        return self.limits[micro_batch]

    def _with_memory(self, trial: TrialRecord, out: Any, *, keep_timing: bool = False) -> TrialRecord:
        """``trial`` with the measured memory (and speed, status, FLOPs) of ``out``, judged against the budget.
        ``keep_timing``: ``out`` is a memory pass whose one step says nothing about speed."""
        memory = self.workload(trial.micro_batch).memory
        peak = memory.real_peak(out.peak_bytes) if memory is not None else out.peak_bytes
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
            w = self.workload(t.micro_batch)
            local = self._with_memory(t, w.runner.measure_memory(t.plan, self.limits[w.micro_batch]), keep_timing=True)
            local = replace(local, seconds=t.seconds + time.perf_counter() - t0)
            verified = combine_trials(self.sync.all_gather(local), self.budget)
            self.records[self.records.index(t)] = verified
            self.update(verified)

    def offered(self, plan: Plan) -> bool:
        """Whether ``plan`` can run: the profile allows it, and no trial saw its segments leave the chain."""
        if plan.segments.keys() & self.unchained:
            return False
        return self.memory is None or self.memory.can_run(plan) is None

    def _resume(self) -> None:
        """Take the plans an earlier run stored (``storage=``) as they are, judged against today's budget."""
        resumed = self.store.resume(
            self.sync, self.predicted_over_budget, known=self.by_key.keys(), first_number=len(self.records)
        )
        for record in resumed:
            if record.micro_batch not in self.workloads:
                continue  # a micro-batch this search does not offer
            record = replace(record, accumulation=self.workload(record.micro_batch).accumulation)
            self.records.append(record)
            self.by_key[record.key()] = record
        if self.records:
            log.info("lightning_ckpt: resumed %d trials from the Optuna study %r", len(self.records), self.study_name)

    # -- confirmation ------------------------------------------------------------------------------
    def confirm(self) -> None:
        """Re-time the leaders and every fitting baseline side by side (``confirmation.Confirmation``)."""
        Confirmation(self).run()

    # -- the choice ----------------------------------------------------------------------------------
    def choose(self) -> tuple[TrialRecord, bool, str]:
        """(chosen trial, fell back, fallback warning) by ``records.choose_plan``: a tuned plan beats the fastest
        fitting baseline only by its verdict; a plan that never ran is never chosen, and none is chosen on
        predicted memory (``verify``); the fallback is measured if it was pruned."""
        return choose_plan(
            lambda: self.records,
            self.budget,
            tie_tolerance=self.tie_tolerance,
            on_infeasible=self.config.on_infeasible,
            nothing_fits=self._nothing_fits,
            verify=lambda t: self.verify([t]),
            measure=self._measure_again,
            beats=beats_by(self.side, self.tie_tolerance),
        )

    def final_verdict(self, best: TrialRecord) -> Verdict | None:
        """The verdict the reports show for ``best``: the fresh rounds' where a tuned plan was chosen and held out
        (``_held_out``), else the confirmation's (``confirm.reported_verdict``)."""
        if self.held_out is not None:
            return self.held_out
        return reported_verdict(self.side, self.records, best, self.tie_tolerance)

    def _measure_again(self, trial: TrialRecord) -> None:
        self.measure(trial.params, trial.plan, trial.label, trial.baseline, prune=None)

    def _nothing_fits(self, records: Sequence[TrialRecord]) -> str:
        summary = ", ".join(f"{t.label}={t.status}" for t in records[:8])
        return (
            f"No checkpointing plan fits the budget ({self.budget.description}). Tried {count(len(records), 'plan')} "
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
            if not fell_back:
                best = Confirmation(self).held_out(best)
            if not fell_back and self.after_choice is not None:
                best = self.after_choice(best)
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
            metadata={**best.plan.metadata, **self.evidence(best, fell_back), **(metadata or {})},
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


def _send(proposals: Iterator[Proposal] | Any, record: TrialRecord) -> Proposal | None:
    try:
        return proposals.send(record)
    except StopIteration:
        return None
