"""How a candidate becomes a record: measured on every rank through its workload's runner, combined, and judged
against the budget. ``Trials`` is what every phase that measures shares: the workloads, the budget, the allocator
caps, and on CPU the lazy memory pass (the memory model being exact, only the plans that can still be chosen get the
tracked pass). It keeps no records: what it returns goes into the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import LightningCkptError
from lightning_ckpt.measure.measurement import Measurement
from lightning_ckpt.memory.optimizer_step import RealStepMemory
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.choice import judge_status
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.distributed import LocalSync, Sync, combine_trials
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus
from lightning_ckpt.search.runners import TrialRunner
from lightning_ckpt.search.space import Candidate

__all__ = ["CollectiveTrialError", "SearchInterrupted", "Trials", "Workload", "resized", "run_info"]


@dataclass(frozen=True)
class Workload:
    """What a candidate's step runs with: its runner, its memory model, the samples one step processes. A search of
    one shape has one (``micro_batch`` None); the joint search one per micro-batch (``Candidate.micro_batch``)."""

    runner: TrialRunner
    memory: RealStepMemory | None
    samples_per_step: int = 1
    micro_batch: int | None = None
    accumulation: int | None = None
    # Whether the memory and time models' predictions hold for this workload's steps; None: the runner's own (a
    # compiled runner's hold once its blocks' saved bytes are anchored on its compiled ``none`` step).
    predicts: bool | None = None
    tracked_step_seconds: float | None = None  # the profile's tracked step (``Profile.tracked_step_seconds``)

    @property
    def predicts_memory(self) -> bool:
        return self.runner.predicts_memory if self.predicts is None else self.predicts

    @property
    def predicts_time(self) -> bool:
        return self.runner.predicts_time if self.predicts is None else self.predicts

    def labelled(self, label: str) -> str:
        """A candidate's label, with its micro-batch in the joint search: ``full [micro-batch 4 x2]``."""
        return label if self.micro_batch is None else f"{label} [micro-batch {self.micro_batch} x{self.accumulation}]"


class CollectiveTrialError(LightningCkptError):
    """A trial failed on this rank while its step ran collectives (FSDP2): the search ended here."""


class SearchInterrupted(LightningCkptError):
    """``should_stop`` asked the search to end (e.g. SIGTERM): no plan was chosen, the model is as it was."""


class Trials:
    """Measures candidates for one search (see the module docstring)."""

    def __init__(
        self,
        workloads: Sequence[Workload],
        budget: Budget,
        config: TuneConfig,
        *,
        device_type: str,
        sync: Sync | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.workloads = {w.micro_batch: w for w in workloads}
        self.budget, self.config = budget, config
        self.sync: Sync = sync or LocalSync()
        self.should_stop = should_stop
        self.lazy_memory = (
            config.memory_pass == "finalists"
            and device_type == "cpu"
            and all(w.memory is not None and w.predicts_memory and w.runner.memory_exact for w in workloads)
        )
        cuda_cap = config.enforce_budget and budget.kind == "peak" and device_type == "cuda"
        limit = budget.limit_bytes if cuda_cap else None
        self.limits = {w.micro_batch: w.memory.trial_limit(limit) if w.memory is not None else limit for w in workloads}
        # Stacks a trial saw leave the chain at run time (a parent that skips blocks on some batches only):
        # segments over them are offered no more (see runners._with_deviations).
        self.unchained: set[str] = set()
        self.started = time.perf_counter()
        self.host_limit = config.host_limit()  # what offloaded blocks may pin
        # The memory model's answers by plan key (the loop asks them of every unseen candidate at every proposal).
        self._predicted: dict[tuple[str, int | None], tuple[int, int] | None] = {}
        self._runnable: dict[str, bool] = {}

    def workload(self, micro_batch: int | None) -> Workload:
        return self.workloads[micro_batch]

    def memory_limit(self, micro_batch: int | None) -> int | None:
        """The allocator cap a trial of ``micro_batch`` runs under (None: uncapped)."""
        return self.limits[micro_batch]

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise SearchInterrupted("The search was asked to stop; no plan was chosen.")

    def out_of_time(self) -> bool:
        return self.config.timeout is not None and time.perf_counter() - self.started > self.config.timeout

    def predicted(self, plan: Plan, micro_batch: int | None = None) -> tuple[int, int] | None:
        """(peak, activation bytes) the memory model predicts for ``plan``, None where it does not predict."""
        key = (plan.key(), micro_batch)
        if key not in self._predicted:
            w = self.workload(micro_batch)
            self._predicted[key] = w.memory.predict(plan) if w.memory is not None and w.predicts_memory else None
        return self._predicted[key]

    def predicted_over_budget(self, plan: Plan, micro_batch: int | None = None) -> bool:
        """Over the budget on the card, or over ``max_host_memory`` in the host memory its offloaded blocks pin."""
        predicted, memory = self.predicted(plan, micro_batch), self.workload(micro_batch).memory
        offloads, limit = any(b.mode.startswith("offload") for b in plan.blocks.values()), self.host_limit
        if offloads and memory is not None and limit is not None and memory.host_bytes(plan) > limit:
            return True
        return predicted is not None and not self.budget.fits(*predicted)

    def offered(self, plan: Plan) -> bool:
        """Whether ``plan`` can run: the profile allows it, and no trial saw its segments leave the chain."""
        if plan.segments.keys() & self.unchained:
            return False
        if plan.key() not in self._runnable:
            memory = next(iter(self.workloads.values())).memory
            self._runnable[plan.key()] = memory is None or memory.can_run(plan) is None
        return self._runnable[plan.key()]

    def run(self, cand: Candidate, *, prune: str | None, predicted_seconds: float | None = None) -> TrialRecord:
        """``cand`` pruned (``prune``: by the ``"memory"`` or the ``"time"`` model) or run on every rank, combined."""
        local = self._trial(cand, prune, predicted_seconds)
        per_rank = self.sync.all_gather(local)
        for t in per_rank:
            self.unchained.update(t.extra.get("unchained_stacks", ()))
        return combine_trials(per_rank, self.budget)

    def _trial(self, cand: Candidate, prune: str | None, predicted_seconds: float | None) -> TrialRecord:
        t0 = time.perf_counter()
        w = self.workload(cand.micro_batch)
        predicted = self.predicted(cand.plan, cand.micro_batch)
        peak, activation = predicted if predicted else (None, None)
        new = TrialRecord(
            number=-1,  # the ledger numbers it
            plan=cand.plan,
            label=cand.label,
            params=dict(cand.params),
            baseline=cand.baseline,
            predicted_peak_bytes=peak,
            predicted_activation_bytes=activation,
            predicted_seconds=predicted_seconds,
            micro_batch=w.micro_batch,
            accumulation=w.accumulation,
        )
        if prune:
            return replace(new, status=TrialStatus.PRUNED, pruned_by=prune, seconds=time.perf_counter() - t0)
        lazy = self.lazy_memory and predicted is not None
        out = w.runner.measure(cand.plan, self.limits[w.micro_batch], memory=not lazy)
        if out.trial_status.failed and getattr(w.runner, "collective_steps", False):
            raise CollectiveTrialError(
                f"Rank {_rank()} failed inside trial {cand.label!r} of a sharded (FSDP2) model: {out.error}. A "
                "sharded step runs all-gathers and reduce-scatters on every rank, so the search cannot go on without "
                "the other ranks hanging; it ends here and nothing is applied. Fix the failure (for an out-of-memory "
                "error: a lower max_memory, a smaller batch, or search_space limited to plans that fit), or tune once "
                "without sharding and pass the plan file with plan=..."
            )
        new = replace(new, seconds=time.perf_counter() - t0)
        if lazy and out.status == TrialStatus.OK:
            # Timed only: the memory is the prediction until verify() gives the trial its memory pass.
            predicted_memory = replace(new, peak_bytes=peak, activation_bytes=activation, memory_measured=False)
            return self._judged(predicted_memory.with_measurement(out, memory=False), out)
        return self.judge(new, out)

    def judge(self, trial: TrialRecord, out: Measurement, *, keep_timing: bool = False) -> TrialRecord:
        """``trial`` with the measurement ``out`` (of its plan, by any runner), its memory taken to the real step and
        judged against the budget. ``keep_timing``: ``out`` is a memory pass whose one step says nothing of speed."""
        memory = self.workload(trial.micro_batch).memory
        peak = memory.real_peak(out.peak_bytes) if memory is not None else out.peak_bytes
        return self._judged(trial.with_measurement(out, real_peak_bytes=peak, timed=not keep_timing), out)

    def _judged(self, trial: TrialRecord, out: Measurement) -> TrialRecord:
        conflict = None if trial.plan.is_empty else out.conflict
        fits = self.budget.fits(trial.peak_bytes, trial.activation_bytes)
        status = judge_status(out.trial_status, conflict, allow_graph_breaks=self.config.allow_graph_breaks, fits=fits)
        error = trial.error or (conflict if status == TrialStatus.CONFLICT else None)
        extra = {**trial.extra, **({"conflict": conflict} if conflict else {})}
        return replace(trial, status=status, error=error, extra=extra)

    def memory_pass_seconds(self) -> float:
        """What the chosen plan's memory pass (``verify``) will cost: nothing where every trial measured its memory,
        else the profile's tracked step, twice where FLOPs are counted (a tracked step, then a counted one: 1.7-2.8x the
        profile's, in one search of each ``benchmarks/repeatability.py`` case). The tracker's cost is per op, so on a
        fast step it is many plain steps (14-18 on 30 ms ones)."""
        if not self.lazy_memory:
            return 0.0
        tracked = max(w.tracked_step_seconds or 0.0 for w in self.workloads.values())
        return tracked * (2 if self.config.count_flops else 1)

    def verify(self, trial: TrialRecord) -> TrialRecord:
        """``trial``, timed without its memory pass (``lazy_memory``), with its measured memory, on every rank: only
        plans measured within budget can be chosen."""
        if trial.memory_measured:
            return trial
        t0 = time.perf_counter()
        w = self.workload(trial.micro_batch)
        out = w.runner.measure_memory(trial.plan, self.limits[w.micro_batch])
        local = self.judge(trial, out, keep_timing=True)
        local = replace(local, seconds=trial.seconds + time.perf_counter() - t0)
        return combine_trials(self.sync.all_gather(local), self.budget)


def resized(candidates: Sequence[Candidate], workloads: Sequence[Workload]) -> list[Candidate]:
    """The candidates of a search: the space's plans as they are in a search of one shape, else one per plan and
    workload (the joint search's micro-batches)."""
    if len(workloads) == 1 and workloads[0].micro_batch is None:
        return list(candidates)
    return [
        Candidate({**c.params, "micro_batch": w.micro_batch}, c.plan, w.labelled(c.label), c.baseline)
        for w in workloads
        for c in candidates
    ]


def run_info(fingerprint: str | None, samples_per_step: int, world_size: int, run: Mapping[str, Any]) -> dict:
    """What the figures depend on, the identity of a stored study (the budget is not in it: the default CUDA budget
    follows free memory, so resumed trials are judged against today's)."""
    return {"fingerprint": fingerprint, "batch_size": samples_per_step, "world_size": world_size, **run}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
