"""One fit of the callback (``FitSession``, moving through named ``Stage``s): what it reuses or searches, the plan it
follows, and the guard over its real steps. What outlives a fit is kept in ``Found``, which the callback owns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_ckpt.budget import Budget, RequestedBudget
from lightning_ckpt.lightning.applied import AppliedPlan, ReplanCheck
from lightning_ckpt.lightning.checks import check_tunable, refuse_existing_checkpointing
from lightning_ckpt.lightning.guard import BudgetGuard, GuardConfig, StepCheck, largest_size
from lightning_ckpt.lightning.ranks import StrategySync
from lightning_ckpt.lightning.reuse import (
    PlanFile,
    plan_to_reuse,
    retune_for_batch,
    reusable,
    reused_budget,
    run_conditions,
)
from lightning_ckpt.lightning.searching import (
    LinesAboveTheBar,
    SearchRequest,
    report_search,
    search_first_batch,
    search_micro_batch,
    set_micro_batch,
)
from lightning_ckpt.lightning.shapes import (
    BatchSize,
    batch_at_length,
    batch_size_of,
    grown_to,
    mark_length_dynamic,
    probed_max_shape,
)
from lightning_ckpt.lightning.tensorboard import TunerRun
from lightning_ckpt.measure.tracker import normalise_device
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.provenance import MicroBatch
from lightning_ckpt.plan.table import PlanTable, bucket_edges, table_line
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.result import TuneResult

__all__ = ["FitSession", "Found", "Settings"]


_SEARCHES = ("search", "joint micro-batch search")  # lock-in sources whose search ends with its own line


class Stage(enum.Enum):
    """Where a fit is; each hook acts by it."""

    IDLE = "before on_fit_start decides between reuse and search, or after the fit: the hooks do nothing"
    SEARCH_PENDING = "the search runs on the next training batch"
    CHECKING_REUSED = "a reused plan is applied; the first batch is compared with the batches it was tuned on"
    LOCKED_IN = "a plan is applied and the guard reads real steps (under a plan table, each batch's bucket plan)"


@dataclass(frozen=True)
class Settings:
    """What the user set on the callback, as it checked it: one fit's settings."""

    requested: RequestedBudget  # parsed once: every reuse decision compares this by value
    config: TuneConfig
    guard: GuardConfig
    bucket_edges: tuple[int, ...] | None
    probe: int | None  # max_shape="probe": batches to probe before the first step
    given_plan: Plan | None
    given_source: str  # where given_plan came from, as messages name it: plan='plans/gpt.json'
    plan_file: PlanFile | None
    tune_micro_batch: bool
    batch_arg_name: str
    log_dir: Path | None
    verbose: bool


@dataclass
class Found:
    """What the callback's fits found, kept across them: a later fit re-applies ``plan`` without searching."""

    plan: Plan | None = None
    result: TuneResult | None = None
    micro_batch: dict[str, int] | None = None
    max_shape: BatchSize | None = None  # declared, or probed by the first fit that needed it


class FitSession:
    """The per-fit state of the callback, and what each of its hooks does with it."""

    def __init__(self, settings: Settings, found: Found, pl_module: pl.LightningModule) -> None:
        # Resolved once for the fit (a model with nothing to checkpoint fails here).
        self.view = ModelView.of(pl_module, settings.config.block_types)
        refuse_existing_checkpointing(self.view.root)
        self.settings, self.found = settings, found
        self.device = normalise_device(pl_module.device)
        self.stage = Stage.IDLE
        self.tb = TunerRun(settings.log_dir)  # this fit's logger run has no tuner HParams columns yet
        self.applied = AppliedPlan()
        self.guard: BudgetGuard | None = None  # built at lock-in, with the budget the plan was chosen for
        self.search_budget = settings.requested  # what a search in this fit tunes for (see reuse.reusable)
        self.tuned_batch: Any = None
        self.replan_check: ReplanCheck | None = None  # a re-planned plan's predictions, beside its first real steps
        self.table: PlanTable | None = None  # a plan per length bucket (``search.buckets``); the top one: found.plan
        self.running: Plan | None = None  # the plan applied now: found.plan, or a shorter bucket's
        self.lines: LinesAboveTheBar | None = None  # rank 0 with a progress bar: log lines written above it

    @property
    def step_checks(self) -> list[StepCheck]:
        return self.guard.checks if self.guard is not None else []

    def fit_starts(self, trainer: pl.Trainer, pl_module: pl.LightningModule, resumed: Plan | None) -> None:
        """Reuse a saved plan, or search: the joint micro-batch search now (before the loop draws its first batch),
        the plan search on the first batch."""
        s = self.settings
        if trainer.is_global_zero and trainer.progress_bar_callback is not None:
            self.lines = LinesAboveTheBar(trainer)
            self.lines.install()
        if s.plan_file is not None:
            s.plan_file.open_fit()
        sources = (
            (resumed, "resumed checkpoint"),
            (s.given_plan, s.given_source),
            (self.found.plan, "an earlier fit with this callback"),
        )
        plan, source = plan_to_reuse(sources, s.plan_file, on_stale_plan=s.guard.on_stale_plan)
        if trainer.world_size > 1:
            # Rank 0 decides (its plan file, its checkpoint state); a rank that decided differently
            # would run trials alone and hang the others' collectives.
            data = trainer.strategy.broadcast(plan.to_dict() if plan is not None else None, src=0)
            plan = Plan.from_dict(data, source="plan broadcast from rank 0") if data is not None else None
        if trainer.is_global_zero:
            # In every fit's run, reused or searched: TensorBoard shows one experiment record of a logdir, and a reuse
            # run's own (Lightning's: lr, hp_metric) would hide the search's leaders and winner.
            self.tb.declare_hparams_table(trainer, pl_module)
        if plan is not None and self._reuse(trainer, pl_module, plan, source):
            return
        check_tunable(pl_module)
        if s.tune_micro_batch:
            result, self.tuned_batch = search_micro_batch(trainer, pl_module, s.batch_arg_name, self._request())
            self._searched(trainer, result, source="joint micro-batch search")
            self._set_micro_batch(trainer, pl_module, result.best.provenance.micro_batch)
            return
        self.stage = Stage.SEARCH_PENDING

    def batch_starts(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Before the forward: search (or check a reused plan) on the first batch, switch to this batch's bucket
        plan, act on a batch predicted over the budget, and start reading the step when the guard reads it."""
        if self.stage in (Stage.SEARCH_PENDING, Stage.CHECKING_REUSED):
            self._find_max_shape(trainer)
            tuning_batch = self._tuning_batch(batch)
            if self.stage is Stage.CHECKING_REUSED:
                self._check_reused(trainer, pl_module, tuning_batch)
            if self.stage is Stage.SEARCH_PENDING and not self._search(
                trainer, pl_module, batch, tuning_batch, batch_idx
            ):
                return  # training_step skipped the batch: the search runs on the next one
        guard = self.guard
        if guard is None or self.stage is not Stage.LOCKED_IN:
            return
        guard.agree(trainer, batch, table=self.table is not None)  # this step's size, alike on all ranks
        if self.table is not None:
            self._follow_table(trainer)
            if self._keeps_graphs() and guard.step_size is not None:
                mark_length_dynamic(batch, guard.step_size.length)  # one graph per bucket, not per length
        plan = self.found.plan
        if plan is not None:
            lower = guard.before_forward(trainer, batch, self.running or plan, self._trials(), self.view)
            if lower is not None:  # a larger batch predicted over the budget: moved before it runs
                self.replan_check = None
                self._guard_switched(lower, trainer)
        first_of = self.running.key() if self.table is not None and self.running is not None else None
        guard.maybe_start(trainer, pl_module, batch, compiled=bool(self.view.compiled), first_of=first_of)
        if self.replan_check is not None:
            self.replan_check.step_starts(guard_reads_it=guard.reader.active)

    def batch_ends(self, trainer: pl.Trainer, outputs: Any, batch: Any) -> None:
        """After the step: judge a read step against the budget (and act on it), then save what it showed."""
        guard = self.guard
        if guard is None:
            return
        if not outputs and guard.reader.active:
            # training_step returned None (Lightning hands this hook an empty dict): no backward ran, so the step
            # says nothing of the plan's memory and must not use up a reading.
            guard.step_skipped()
            return
        reading = guard.reader.stop()
        if reading is None or self.found.plan is None:
            self._report_replanned(trainer)
            return
        sync = StrategySync(trainer.strategy) if trainer.world_size > 1 else None
        trials = self._trials()
        running = self.running or self.found.plan
        check = guard.judge(trainer, reading, batch, running, sync, trials)
        if self.replan_check is not None:
            self.replan_check.memory_read(check.peak_bytes, check.activation_bytes)
        if not check.within_budget:
            lower = guard.over_budget(check, running, trials, self.view)
            if lower is not None:
                if self.replan_check is not None:  # its prediction was wrong: said, and not timed on another plan
                    rank_zero_info(self.replan_check.line())
                    self.replan_check = None
                self._guard_switched(lower, trainer)
        elif check.alloc_retries:  # within the budget, but the card was near refusing it: acted on before the next
            lower = guard.near_refusal(check, running, trials, self.view)
            if lower is not None:
                self._guard_switched(lower, trainer)
        plan = self.found.plan
        if (guard.done or not check.within_budget) and trainer.is_global_zero and plan is not None:
            self.found.plan = plan.with_provenance(real_steps=tuple(c.to_dict() for c in guard.checks))
            self._save()

    def closure_ends(self) -> None:
        if self.guard is not None:
            self.guard.reader.optimizer_update_starts()
        if self.replan_check is not None:
            self.replan_check.closure_ends()

    def end(self) -> None:
        """The model leaves the fit as the user gave it; the plan stays in ``found`` for a new fit to re-apply."""
        self._unlock()
        self.stage = Stage.IDLE

    def close(self) -> None:
        self.end()
        self.tb.close()
        if self.lines is not None:
            self.lines.remove()
            self.lines = None

    def _reuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Plan, source: str) -> bool:
        """Apply a saved plan without searching (True), or return False to search (it was stale)."""
        s = self.settings
        conditions = run_conditions(trainer, pl_module, None)
        wanted, reused = reusable(plan, source, conditions, self.view, s.requested, on_stale_plan=s.guard.on_stale_plan)
        self.search_budget = wanted
        if reused is None:
            return False
        if reused is not plan:  # re-planned for this budget from the saved profile: predicted, checked on real steps
            plan, source = reused, f"the profile saved with the plan from {source} (re-planned, 0 trials)"
            self.replan_check = ReplanCheck.of(plan, self.device)
            if trainer.is_global_zero and s.plan_file is not None:
                s.plan_file.wrote = s.plan_file.save(plan)
        self.table = None  # the plan table a reused plan keeps, when this fit follows one
        if s.guard.buckets is not False and self._table_refused() is None:
            self.table = PlanTable.of_plan(plan, source=source)
            if self.table is not None:
                rank_zero_info(f"lightning_ckpt: {table_line(self.table, None)}")
        budget = reused_budget(plan, wanted, pl_module.device)
        if trainer.world_size > 1:
            # Resolved per rank (the default CUDA budget is a share of each GPU's free memory): ranks that judged a
            # step differently would enter the switch's collectives alone and hang. Rank 0's, as a search uses.
            budget = StrategySync(trainer.strategy).broadcast(budget)
        # No budget known (a share of activation memory the plan never resolved): nothing to guard against.
        self.guard = BudgetGuard(s.guard, self.device, budget or Budget("none"))
        self._lock_in(plan, source=source, trainer=trainer)
        self.stage = Stage.CHECKING_REUSED  # its batch shape is compared with the first batch's
        if plan.provenance.micro_batch is not None:
            self._set_micro_batch(trainer, pl_module, plan.provenance.micro_batch)
        return True

    def _check_reused(self, trainer: pl.Trainer, pl_module: pl.LightningModule, tuning_batch: Any) -> None:
        """Keep the reused plan, or re-tune on this batch when it was tuned on batches of another shape."""
        plan = self.found.plan
        assert plan is not None
        conditions = run_conditions(trainer, pl_module, tuning_batch)
        on_stale_plan = self.settings.guard.on_stale_plan
        if not retune_for_batch(plan, conditions, budget=self.search_budget, on_stale_plan=on_stale_plan):
            self.stage = Stage.LOCKED_IN
            return
        self._unlock()
        check_tunable(pl_module)
        self.guard = self.replan_check = None  # the search's plan gets its own guard, and is no re-planned one
        self.stage = Stage.SEARCH_PENDING

    def _search(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, tuning_batch: Any, batch_idx: int
    ) -> bool:
        """Search on this batch and lock the result in; False when ``training_step`` skipped the batch."""
        lengths = self._table_lengths(trainer, batch, tuning_batch)
        found = search_first_batch(trainer, pl_module, tuning_batch, batch_idx, self._request(lengths))
        if found is None:
            return False
        result, self.tuned_batch, table = found
        # The batch the trials' figures are for (under several ranks the largest rank's, as their memory is).
        reference = largest_size(trainer, self.tuned_batch, self.settings.guard.shape_key)
        self._searched(trainer, result, source="search", table=table, reference=reference)
        return True

    def _searched(
        self,
        trainer: pl.Trainer,
        result: TuneResult,
        *,
        source: str,
        table: PlanTable | None = None,
        reference: BatchSize | None = None,
    ) -> None:
        """Lock in the search's plan, record what it was tuned for, save it and report (rank 0)."""
        s, found = self.settings, self.found
        found.result = result
        self.guard = BudgetGuard(s.guard, self.device, result.budget, reference=reference)
        self.table = table
        self._lock_in(result.best, source=source, trainer=trainer)
        if table is not None:
            found.plan = result.best.with_provenance(plan_table=table.to_dict())
        if not trainer.is_global_zero:
            return
        conditions = run_conditions(trainer, trainer.lightning_module, self.tuned_batch).to_dict()
        budget = {**result.budget.to_dict(), "requested": self.search_budget.requested_max_memory}
        found.plan = (found.plan or result.best).with_provenance(budget=budget, conditions=conditions)
        if s.plan_file is not None:
            s.plan_file.wrote = s.plan_file.save(found.plan)
        report_search(trainer, result, plan_file=s.plan_file, tb=self.tb, verbose=s.verbose)
        if table is not None:
            rank_zero_info(f"lightning_ckpt: {table_line(table, result.budget)}")

    def _request(self, table_lengths: tuple[int, ...] | None = None) -> SearchRequest:
        s = self.settings
        return SearchRequest(
            self.view, s.config, self.search_budget, self.tb, s.verbose, s.guard, table_lengths, self.lines
        )

    def _trials(self) -> tuple[Any, ...] | list[Any]:
        return self.found.result.trials if self.found.result is not None else ()

    def _find_max_shape(self, trainer: pl.Trainer) -> None:
        """``max_shape="probe"``: the longest batch, found before the first step (once per callback)."""
        s = self.settings
        if s.probe is None or self.found.max_shape is not None:
            return
        probed = probed_max_shape(trainer, partial(batch_size_of, shape_key=s.guard.shape_key), s.probe)
        self.found.max_shape = probed.size
        shape = str(probed.size) if probed.size.rows else f"length {probed.size.length}"
        rank_zero_info(f"lightning_ckpt: max_shape {shape}, from {probed.source}.")

    def _tuning_batch(self, batch: Any) -> Any:
        """What the search measures (and a reused plan is compared with): the batch, grown to ``max_shape``."""
        max_shape, guard = self.found.max_shape, self.settings.guard
        if max_shape is None:
            return batch
        grown, length, size = batch, max_shape.length, batch_size_of(batch, guard.shape_key)
        if guard.resize is None:
            grown = grown_to(batch, max_shape)
        elif size is not None and size.length < length:
            grown = batch_at_length(batch, length, resize=guard.resize, shape_key=guard.shape_key)
        if grown is not batch and self.stage is Stage.SEARCH_PENDING:
            rank_zero_info(
                f"lightning_ckpt: tuning on the first batch ({size}) grown to the declared "
                f"max_shape ({batch_size_of(grown, guard.shape_key)}): the plan fits the longest batch."
            )
        return grown

    def _table_lengths(self, trainer: pl.Trainer, batch: Any, tuning_batch: Any) -> tuple[int, ...] | None:
        s = self.settings
        if self.found.max_shape is None or s.guard.buckets is False:
            return None
        if (why := self._table_refused()) is not None:
            rank_zero_info(f"lightning_ckpt: no plan table with {why}: every batch runs the plan tuned for max_shape.")
            return None
        first, tuned = batch_size_of(batch, s.guard.shape_key), batch_size_of(tuning_batch, s.guard.shape_key)
        if first is None or tuned is None:
            return None
        edges = bucket_edges(min(first.length, tuned.length // 8), tuned.length, s.bucket_edges)
        if trainer.world_size > 1:  # rank 0's: every rank profiles the same buckets, in lockstep
            edges = StrategySync(trainer.strategy).broadcast(edges)
        return edges if len(edges) > 1 else None

    def _table_refused(self) -> str | None:
        guard = self.settings.guard
        if guard.shape_key is None or guard.resize is not None:
            return None
        return (
            "batches sized by guard's shape_key and no guard resize (a packed batch is cut to each bucket's "
            "length by resize(batch, length), which only the user can write)"
        )

    def _follow_table(self, trainer: pl.Trainer) -> None:
        """Before the forward: run the plan of this step's bucket (a batch longer than every bucket runs the top one).
        Every rank runs the same plan (the bucket of the longest batch on any rank): a sharded model's recompute
        gathers parameters, and ranks checkpointing different blocks would wait on each other."""
        table, plan, guard = self.table, self.found.plan, self.guard
        assert table is not None and plan is not None and guard is not None
        size = guard.step_size
        index = table.bucket_for(size.length) if size is not None else None
        top = index is None or index == len(table.buckets) - 1
        want = plan if top else table.buckets[index].plan
        if self.running is None or want.key() != self.running.key():
            self.applied.apply(self.view, want, trainer, keep_graphs=self._keeps_graphs())
            self.running = want

    def _keeps_graphs(self) -> bool:
        """Whether switching between the plan table's plans keeps each one's compiled graphs (``AppliedPlan``): a
        compiled model's table whose plans share one PT2 budget."""
        table = self.table
        if table is None or not self.view.compiled:
            return False
        return len({b.plan.compile_memory_budget for b in table.buckets}) == 1

    def _lock_in(self, plan: Plan, *, source: str, trainer: pl.Trainer) -> None:
        guard = self.guard
        assert guard is not None, "the guard is built, with its budget, before a plan is locked in"
        self.applied.apply(self.view, plan, trainer, keep_graphs=self._keeps_graphs())
        self.found.plan = self.running = plan
        guard.arm(int(trainer.accumulate_grad_batches))
        self.stage = Stage.LOCKED_IN
        if source not in _SEARCHES or self.settings.verbose:
            rank_zero_info(f"lightning_ckpt: applied plan from {source}: {plan.describe()}")

    def _guard_switched(self, lower: Plan, trainer: pl.Trainer) -> None:
        """The guard moved to ``lower``: lock it in, or, under a plan table, make it the plan of the bucket that went
        over. A batch longer than every bucket grows the table a bucket instead, so the top bucket keeps its plan."""
        table, running, plan, guard = self.table, self.running, self.found.plan, self.guard
        assert guard is not None
        size = guard.step_size  # the step's largest batch on any rank, as the table was followed
        length = size.length if size is not None else None
        bare = replace(lower, metadata={})
        if table is not None and length is not None and length > table.longest and plan is not None:
            self.table = table.grown(length, bare)
            rank_zero_info(
                f"lightning_ckpt: a batch of length {length} is longer than the plan table's longest bucket "
                f"({table.longest}): the table grows a bucket <= {length} running {lower.describe()}."
            )
        elif table is not None and running is not None and plan is not None and running.key() != plan.key():
            index = next(i for i, b in enumerate(table.buckets) if b.plan.key() == running.key())
            self.table = table.with_plan(index, replace(bare, name=running.name), "guard")
            self.found.plan = plan.with_provenance(plan_table=self.table.to_dict())
            self.applied.apply(self.view, self.table.buckets[index].plan, trainer, keep_graphs=self._keeps_graphs())
            self.running = self.table.buckets[index].plan
            rank_zero_info(f"lightning_ckpt: bucket <= {table.buckets[index].max_length} now runs {lower.describe()}")
            return
        elif table is not None:
            self.table = table.with_top(bare)
        if self.table is not None:
            lower = lower.with_provenance(plan_table=self.table.to_dict())
        self._lock_in(lower, source="the budget guard", trainer=trainer)

    def _report_replanned(self, trainer: pl.Trainer) -> None:
        """Once a re-planned plan's first step was timed: the side-by-side line, and the figures into the plan file."""
        check, plan = self.replan_check, self.found.plan
        if check is None or check.seconds is None or plan is None:
            return
        self.replan_check = None
        if trainer.is_global_zero:
            self.found.plan = check.report(plan)
            self._save()

    def _set_micro_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, spec: MicroBatch | None) -> None:
        name, verbose = self.settings.batch_arg_name, self.settings.verbose
        if spec is not None and set_micro_batch(trainer, pl_module, name, spec, verbose=verbose):
            self.found.micro_batch = spec.to_dict()

    def _save(self) -> None:
        if self.settings.plan_file is not None:
            self.settings.plan_file.save(self.found.plan)

    def _unlock(self) -> None:
        if self.guard is not None:
            self.guard.reader.abandon()
        self.applied.remove()
        self.running = None
