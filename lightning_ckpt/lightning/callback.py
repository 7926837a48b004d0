"""``ActivationCheckpointTuner``: the Lightning callback. A thin adapter from Trainer hooks to the package.

Trials are *sandboxed*. On the first training batch the callback runs the user's real ``training_step``
(under the Trainer's precision context) forward and backward on that batch for each candidate plan, never
steps the optimizer, and restores gradients, buffers, metric states and RNG afterwards. Only then is the
winner applied, so the restore cannot undo it, and the real first step runs as if tuning had never
happened - except that it is checkpointed. What each hook hands over to: ``reuse`` (a saved plan),
``searching`` (the search and its report), ``guard`` (the real steps after lock-in), ``plan_file``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_ckpt.budget import RequestedBudget
from lightning_ckpt.lightning.applied import AppliedPlan
from lightning_ckpt.lightning.checks import (
    check_buckets,
    check_reuse_arguments,
    check_strategy,
    check_tunable,
    check_types,
    refuse_existing_checkpointing,
    search_config,
)
from lightning_ckpt.lightning.guard import BudgetGuard, GuardConfig, StepCheck
from lightning_ckpt.lightning.micro_batch import set_micro_batch
from lightning_ckpt.lightning.plan_file import PlanFile
from lightning_ckpt.lightning.probe import probe_request, probed_max_shape
from lightning_ckpt.lightning.replanned import ReplanCheck
from lightning_ckpt.lightning.reuse import plan_to_reuse, retune_for_batch, reusable, reused_budget, run_conditions
from lightning_ckpt.lightning.searching import SearchRequest, report_search, search_first_batch, search_micro_batch
from lightning_ckpt.lightning.shapes import BatchSize, batch_at_length, grown_to, mark_length_dynamic
from lightning_ckpt.lightning.sync import StrategySync
from lightning_ckpt.lightning.tensorboard import TunerRun
from lightning_ckpt.measure.tracker import normalise_device
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.table import TABLE_KEY, PlanTable, bucket_edges, table_line
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.records import TuneResult

__all__ = ["ActivationCheckpointTuner"]

_SEARCHES = ("search", "joint micro-batch search")  # lock-in sources whose search ends with its own line


class ActivationCheckpointTuner(Callback):
    """Find, apply and save the fastest activation-checkpointing plan that fits a memory budget.

    Args:
        max_memory: peak memory budget: bytes, a size string (``"20GiB"``) or a fraction of the CUDA
            device's memory (``0.8``). Default on CUDA: the memory available to this process less 10%.
        activation_budget: alternatively, a fraction of the no-checkpointing activation memory (``0.5``).
        plan: a plan file (or ``Plan``) to apply without searching. Without ``max_memory`` or
            ``activation_budget`` it keeps the budget it was tuned for (also when it is stale and re-tuned).
        plan_path: where to write the chosen plan (atomically; rank 0). If the file exists and was
            tuned for this model and budget, it is reused without searching. A file another run wrote
            while this one tuned is kept, with a warning naming its plan.
        block_types: override block discovery (classes, class names or FQN patterns).
        search: the search's settings, a ``TuneConfig`` or a dict of its fields, e.g. ``{"n_trials": 20,
            "measure_steps": 2, "search_space": {"modes": ["full"], "segments": False}, "storage":
            "sqlite:///ckpt.db"}`` (trials, timeout, space, Optuna sampler/storage/study, seed, steps per
            trial, ``on_infeasible``, ``tie_tolerance``, ``allow_graph_breaks``: see ``TuneConfig``).
        guard: how real steps after lock-in are checked, a ``GuardConfig`` or a dict, e.g. ``{"steps": 2,
            "on_budget_exceeded": "switch"}`` (``"raise"``, ``"warn"``; ``steps=0`` turns it off).
        max_shape: the longest batch the run will see, ``(rows, length)`` or a length (tokens per sample), for
            data whose lengths vary: the search runs on the first batch grown to it (rows and positions
            repeated), so the plan fits the longest batch, not the first; shorter batches run their bucket's plan
            (``buckets``). ``"probe"``: found before the first step, from the datamodule's ``max_seq_length``
            (or ``max_length``) where it has one, else from the first 64 batches of the training loader (shapes
            only; ``"probe:256"`` for more; random states put back, so training sees the same batches). Without it
            the plan is tuned on the first batch and the guard catches longer ones before their forward.
        buckets: with ``max_shape``, a plan table: lengths split into buckets, each running the fastest plan
            predicted to fit the budget at its longest length (one profile per bucket before training, no
            trials), switched by each batch's length before its forward. ``True`` (default): halving from the
            longest length down to the first batch's (at most 8 buckets); a list of lengths sets the edges
            (``[128, 256, 512]``: up to 128, up to 256, ...); ``False``: one plan for every length. Batches are
            measured by ``guard``'s ``shape_key`` (a packed batch's own length), and cut to each bucket's length by
            ``guard``'s ``resize`` where they have such a key (without it, no table).
        tune_micro_batch: also search the micro-batch size with gradient accumulation (same global batch)
            jointly with the plan. ``True`` sets the LightningModule/DataModule attribute ``batch_size`` (as
            Lightning's ``BatchSizeFinder`` does); a string names another attribute.
        on_stale_plan: ``"retune"`` (warn and search again) or ``"raise"`` when a reused plan (resumed
            checkpoint, ``plan=``, plan file) was tuned for another model, budget or run conditions. Budgets
            are compared by value (``"20GiB"`` is ``21474836480``); without a budget argument, the plan's own counts.
        log_dir: TensorBoard directory when the Trainer has no TensorBoardLogger.
        verbose: print a line per trial and the full trial table (always in TensorBoard); otherwise one
            progress bar and a one-line result.

    What ``max_memory`` covers: the whole training step as it runs after lock-in - parameters,
    gradients (held across micro-batches under gradient accumulation), the optimizer's state (also
    when the first step has yet to create it) and ``optimizer.step()``'s temporaries, the batch, the
    saved and recomputed activations and backward temporaries. Bytes held by live tensors (CUDA:
    ``max_memory_allocated``); not the CUDA context, the caching allocator's unused reserve, or
    tensors other code keeps outside the step.
    """

    def __init__(
        self,
        max_memory: int | float | str | None = None,
        *,
        activation_budget: float | None = None,
        plan: str | os.PathLike | Plan | None = None,  # not PathLike[str]: jsonargparse then reads the file
        plan_path: str | os.PathLike[str] | None = None,
        block_types: list[Any] | None = None,
        search: TuneConfig | Mapping[str, Any] | None = None,
        guard: GuardConfig | Mapping[str, Any] | None = None,
        max_shape: int | tuple[int, int] | str | None = None,
        buckets: bool | list[int] = True,
        tune_micro_batch: bool | str = False,
        on_stale_plan: Literal["retune", "raise"] = "retune",
        log_dir: str | os.PathLike[str] | None = None,
        verbose: bool = False,
    ) -> None:
        # Parsed once: every reuse decision compares this by value ("20GiB" is 21474836480).
        self._requested = RequestedBudget.parse(max_memory, activation_budget)
        check_types(plan=plan, plan_path=plan_path, tune_micro_batch=tune_micro_batch)
        self.config = search_config(search, block_types)
        self.guard = GuardConfig.of(guard)
        self.max_shape = max_shape
        self._probe = probe_request(max_shape)  # max_shape="probe": found before the first step
        self._max_shape = None if self._probe is not None else BatchSize.declared(max_shape)
        self.buckets = buckets
        self._bucket_edges = check_buckets(buckets, self._max_shape or self._probe)
        check_reuse_arguments(plan, search, on_stale_plan)
        self._given_plan = plan if isinstance(plan, Plan) else (Plan.load(plan) if plan is not None else None)
        self._plan_file = PlanFile(plan_path) if plan_path is not None else None
        self.max_memory, self.activation_budget, self.block_types = max_memory, activation_budget, block_types
        self.on_stale_plan = on_stale_plan
        self.batch_arg_name = tune_micro_batch if isinstance(tune_micro_batch, str) else "batch_size"
        self.tune_micro_batch = bool(tune_micro_batch)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.verbose = verbose

        self.plan: Plan | None = None  # the locked-in plan
        self.result: TuneResult | None = None  # the search, when one ran in this process
        self.micro_batch: dict[str, int] | None = None  # the applied {size, accumulation, global, original_size}
        self._resumed_plan: Plan | None = None
        self._applied = AppliedPlan()
        self._pending = False  # search on the next batch
        self._check_batch_of: Plan | None = None  # a reused plan whose batch shape the first batch is compared with
        self._search_budget = self._requested  # what a search in this fit tunes for (see reuse.wanted_budget)
        self._tuned_batch: Any = None
        self._tb = TunerRun(self.log_dir)
        self._guard = BudgetGuard(self.guard, torch.device("cpu"))
        self._view: ModelView | None = None  # the model, resolved once per fit (on_fit_start)
        self._replan_check: ReplanCheck | None = None  # a re-planned plan's predictions, beside its first real steps
        self._table: PlanTable | None = None  # a plan per length bucket (``search.buckets``); the top one: self.plan
        self._running: Plan | None = None  # the plan applied now: self.plan, or a shorter bucket's

    @property
    def plan_path(self) -> Path | None:
        return self._plan_file.path if self._plan_file is not None else None

    @property
    def trials_run(self) -> int:
        return len(self.result.trials) if self.result is not None else 0

    @property
    def plan_table(self) -> PlanTable | None:
        """The plan of each length bucket this fit follows (``buckets``; ``search.buckets``), None without one."""
        return self._table

    @property
    def step_checks(self) -> list[StepCheck]:
        """The real steps read after lock-in in this fit (see ``guard.py``)."""
        return self._guard.checks

    @property
    def wrote_plan_file(self) -> bool:
        return self._plan_file is not None and self._plan_file.wrote

    # -- Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resolved once for the fit (a model with nothing to checkpoint fails here): the search, reuse, lock-in
        # and the guard all see this one view.
        self._view = ModelView.of(pl_module, self.block_types)
        refuse_existing_checkpointing(self._view.root)
        self._guard = BudgetGuard(self.guard, normalise_device(pl_module.device))
        self._tb = TunerRun(self.log_dir)  # this fit's logger run has no tuner HParams columns yet
        self._search_budget = self._requested
        if self._plan_file is not None:
            self._plan_file.open_fit()
        sources = (
            (self._resumed_plan, "resumed checkpoint"),
            (self._given_plan, "plan= argument"),
            (self.plan, "an earlier fit with this callback"),
        )
        plan, source = plan_to_reuse(sources, self._plan_file)
        if trainer.world_size > 1:
            # Rank 0 decides (its plan file, its checkpoint state); a rank that decided differently
            # would run trials alone and hang the others' collectives.
            data = trainer.strategy.broadcast(plan.to_dict() if plan is not None else None, src=0)
            plan = Plan.from_dict(data, source="plan broadcast from rank 0") if data is not None else None
        if plan is not None and self._reuse(trainer, pl_module, plan, source):
            return
        check_tunable(pl_module)
        if trainer.is_global_zero:
            self._tb.declare_hparams_table(trainer, pl_module)
        if self.tune_micro_batch:  # before the loop draws its first batch
            result, self._tuned_batch = search_micro_batch(trainer, pl_module, self.batch_arg_name, self._request())
            self._searched(trainer, result, source="joint micro-batch search")
            self._set_micro_batch(trainer, pl_module, result.best.metadata["micro_batch"])
            return
        self._pending = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is not None and self._max_shape is None and (self._pending or self._check_batch_of is not None):
            probed = probed_max_shape(trainer, self._guard.size_of, self._probe)
            self._max_shape = probed.size
            shape = str(probed.size) if probed.size.rows else f"length {probed.size.length}"
            rank_zero_info(f"lightning_ckpt: max_shape {shape}, from {probed.source}.")
        tuning_batch = self._tuning_batch(batch) if self._check_batch_of is not None or self._pending else batch
        if self._check_batch_of is not None:
            plan, self._check_batch_of = self._check_batch_of, None
            conditions = run_conditions(trainer, pl_module, tuning_batch)
            if retune_for_batch(plan, conditions, budget=self._search_budget, on_stale_plan=self.on_stale_plan):
                self._unlock()
                check_tunable(pl_module)
                self._pending = True
        if self._pending:
            lengths = self._table_lengths(trainer, batch, tuning_batch)
            found = search_first_batch(trainer, pl_module, tuning_batch, batch_idx, self._request(lengths))
            if found is None:
                return
            result, self._tuned_batch, table = found
            self._pending = False
            # The batch the trials' figures are for (under several ranks the largest rank's, as their memory is).
            self._guard.reference = self._guard.largest_size(trainer, self._tuned_batch)
            self._searched(trainer, result, source="search", table=table)
        self._guard.agree(trainer, batch, table=self._table is not None)  # this step's size, alike on all ranks
        if self._table is not None:
            self._follow_table(trainer)
            if self._keeps_graphs() and self._guard.step_size is not None:
                mark_length_dynamic(batch, self._guard.step_size.length)  # one graph per bucket, not per length
        if self.plan is not None and self._view is not None:
            trials = self.result.trials if self.result is not None else ()
            running = self._running or self.plan
            lower = self._guard.before_forward(trainer, batch, running, trials, self._view)
            if lower is not None:  # a larger batch predicted over the budget: moved before it runs
                self._replan_check = None
                self._guard_switched(lower, trainer, batch)
        first_of = self._running.key() if self._table is not None and self._running is not None else None
        self._guard.maybe_start(trainer, pl_module, batch, compiled=bool(self._view.compiled), first_of=first_of)
        if self._replan_check is not None:
            self._replan_check.step_starts(guard_reads_it=self._guard.reader.active)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not outputs and self._guard.reader.active:
            # training_step returned None (Lightning hands this hook an empty dict): no backward ran and the
            # optimizer had no gradients, so the step says nothing of the plan's memory and must not use up a
            # reading (the next step is read instead).
            self._guard.step_skipped()
            return
        reading = self._guard.reader.stop()
        if reading is None or self.plan is None:
            self._report_replanned(trainer)
            return
        sync = StrategySync(trainer.strategy) if trainer.world_size > 1 else None
        trials = self.result.trials if self.result is not None else ()
        running = self._running or self.plan
        check = self._guard.judge(trainer, reading, batch, running, sync, trials)
        if self._replan_check is not None:
            self._replan_check.memory_read(check.peak_bytes, check.activation_bytes)
        if not check.within_budget:
            lower = self._guard.over_budget(check, running, trials, self._view)
            if lower is not None:
                if self._replan_check is not None:  # its prediction was wrong: said, and not timed on another plan
                    rank_zero_info(self._replan_check.line())
                    self._replan_check = None
                self._guard_switched(lower, trainer, batch)
        if (self._guard.done or not check.within_budget) and trainer.is_global_zero and self.plan is not None:
            self.plan = self.plan.with_metadata(real_steps=[c.to_dict() for c in self.step_checks])
            if self._plan_file is not None:
                self._plan_file.save(self.plan)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._guard.reader.optimizer_update_starts()  # the closure (forward, backward) is over
        if self._replan_check is not None:
            self._replan_check.closure_ends()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed or interrupted fit leaves the model as the user gave it (no instance forwards, HF cache
        # setting back); self.plan stays, so a new fit with this callback re-applies it without searching.
        self._unlock()
        self._pending = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unlock()
        self._tb.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unlock()  # the model leaves fit as the user gave it; resuming or a new fit re-applies the plan

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict() if self.plan is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        data = state_dict.get("plan")
        source = "checkpointed ActivationCheckpointTuner state"
        self._resumed_plan = Plan.from_dict(data, source=source) if data else None

    # -- internals ---------------------------------------------------------------------------------
    def _tuning_batch(self, batch: Any) -> Any:
        """What the search measures (and a reused plan is compared with): the batch, grown to ``max_shape`` (by
        guard ``resize`` for batches sized by ``shape_key``)."""
        if self._max_shape is None:
            return batch
        grown, length, size = batch, self._max_shape.length, self._guard.size_of(batch)
        if self.guard.resize is None:
            grown = grown_to(batch, self._max_shape)
        elif size is not None and size.length < length:
            grown = batch_at_length(batch, length, resize=self.guard.resize, shape_key=self.guard.shape_key)
        if grown is not batch and self._pending:
            rank_zero_info(
                f"lightning_ckpt: tuning on the first batch ({size}) grown to the declared "
                f"max_shape ({self._guard.size_of(grown)}): the plan fits the longest batch."
            )
        return grown

    def _reuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Plan, source: str) -> bool:
        """Apply a saved plan without searching (True), or return False to search (it was stale and re-tunes)."""
        conditions = run_conditions(trainer, pl_module, None)
        assert self._view is not None
        wanted, reused = reusable(
            plan, source, conditions, self._view, self._requested, on_stale_plan=self.on_stale_plan
        )
        self._search_budget = wanted
        if reused is None:
            return False
        if reused is not plan:  # re-planned for this budget from the saved profile: predicted, checked on real steps
            plan, source = reused, f"the profile saved with the plan from {source} (re-planned, 0 trials)"
            self._replan_check = ReplanCheck.of(plan, normalise_device(pl_module.device))
            if trainer.is_global_zero and self._plan_file is not None:
                self._plan_file.wrote = self._plan_file.save(plan)
        self._table = self._reused_table(trainer, plan, source)
        self._lock_in(plan, source=source, trainer=trainer)
        budget = reused_budget(plan, wanted, pl_module.device)
        if trainer.world_size > 1:
            # Resolved per rank (the default CUDA budget is a share of each GPU's free memory): ranks that judged a
            # step differently would enter the switch's collectives alone and hang. Rank 0's, as a search uses.
            budget = StrategySync(trainer.strategy).broadcast(budget)
        self._guard.budget = budget
        self._check_batch_of = plan  # its batch shape is compared with the first batch's
        if plan.metadata.get("micro_batch"):
            self._set_micro_batch(trainer, pl_module, plan.metadata["micro_batch"])
        return True

    def _searched(
        self, trainer: pl.Trainer, result: TuneResult, *, source: str, table: PlanTable | None = None
    ) -> None:
        """Lock in the search's plan, record what it was tuned for, save it and report (rank 0)."""
        self.result = result
        self._guard.budget = result.budget
        self._table = table
        self._lock_in(result.best, source=source, trainer=trainer)
        if table is not None:
            self.plan = result.best.with_metadata(**{TABLE_KEY: table.to_dict()})
        if not trainer.is_global_zero:
            return
        conditions = run_conditions(trainer, trainer.lightning_module, self._tuned_batch).to_dict()
        budget = {**result.budget.to_dict(), "requested": self._search_budget.requested_max_memory}
        self.plan = (self.plan or result.best).with_metadata(budget=budget, conditions=conditions)
        if self._plan_file is not None:
            self._plan_file.wrote = self._plan_file.save(self.plan)
        report_search(trainer, result, plan_file=self._plan_file, tb=self._tb, verbose=self.verbose)
        if table is not None:
            rank_zero_info(f"lightning_ckpt: {table_line(table, result.budget)}")

    def _request(self, table_lengths: tuple[int, ...] | None = None) -> SearchRequest:
        assert self._view is not None
        return SearchRequest(
            self._view,
            self.config,
            self._search_budget,
            self._tb,
            self.verbose,
            table_lengths,
            resize=self.guard.resize,
            shape_key=self.guard.shape_key,
        )

    def _table_lengths(self, trainer: pl.Trainer, batch: Any, tuning_batch: Any) -> tuple[int, ...] | None:
        """The plan table's bucket lengths for this search, None when there is none: no ``max_shape`` or
        ``buckets=False``, a compiled model (its plans' graphs), packed batches without ``resize``, or a declared
        maximum no longer than the first batch."""
        if self._max_shape is None or self.buckets is False or self._view is None:
            return None
        why = self._table_refused(trainer)
        if why is not None:
            rank_zero_info(f"lightning_ckpt: no plan table with {why}: every batch runs the plan tuned for max_shape.")
            return None
        first, tuned = self._guard.size_of(batch), self._guard.size_of(tuning_batch)
        if first is None or tuned is None:
            return None
        edges = bucket_edges(min(first.length, tuned.length // 8), tuned.length, self._bucket_edges)
        if trainer.world_size > 1:  # rank 0's: every rank profiles the same buckets, in lockstep
            edges = StrategySync(trainer.strategy).broadcast(edges)
        return edges if len(edges) > 1 else None

    def _table_refused(self, trainer: pl.Trainer) -> str | None:
        """Why this fit can follow no plan table (a search builds none, a reused one is not followed), or None."""
        if self.guard.shape_key is not None and self.guard.resize is None:
            return (
                "batches sized by guard's shape_key and no guard resize (a packed batch is cut to each bucket's "
                "length by resize(batch, length), which only the user can write)"
            )
        return None

    def _follow_table(self, trainer: pl.Trainer) -> None:
        """Before the forward: run the plan of this step's bucket (a batch longer than every bucket runs the top
        one, and the guard's before-forward check covers it). Under several ranks the bucket is that of the step's
        longest batch on any rank (``BudgetGuard.agree``), so every rank runs the same plan: a sharded model's
        recompute gathers parameters, and ranks checkpointing different blocks would wait on each other."""
        table, view = self._table, self._view
        assert table is not None and self.plan is not None and view is not None
        size = self._guard.step_size
        index = table.bucket_for(size.length) if size is not None else None
        top = index is None or index == len(table.buckets) - 1
        want = self.plan if top else table.buckets[index].plan
        if self._running is None or want.key() != self._running.key():
            self._applied.apply(view, want, trainer, keep_graphs=self._keeps_graphs())
            self._running = want

    def _keeps_graphs(self) -> bool:
        """Whether switching between the plan table's plans keeps each one's compiled graphs (``AppliedPlan``): a
        compiled model's table, whose plans share one PT2 budget (none: a search that chose one builds no table, as
        the compiler reads it when compiling and no guard sees it)."""
        table = self._table
        if table is None or self._view is None or not self._view.compiled:
            return False
        return len({b.plan.compile_memory_budget for b in table.buckets}) == 1

    def _guard_switched(self, lower: Plan, trainer: pl.Trainer, batch: Any) -> None:
        """The guard moved to ``lower``: lock it in, or, under a plan table, make it the plan of the bucket that went
        over (the top bucket's plan is the plan file's plan) and run it. A batch longer than every bucket grows the
        table a bucket up to its length instead, so the batches the top bucket covers keep their plan."""
        table, running = self._table, self._running
        size = self._guard.step_size  # the step's largest batch on any rank, as the table was followed
        length = size.length if size is not None else None
        if table is not None and length is not None and length > table.longest and self.plan is not None:
            self._table = table.grown(length, replace(lower, metadata={}))
            rank_zero_info(
                f"lightning_ckpt: a batch of length {length} is longer than the plan table's longest bucket "
                f"({table.longest}): the table grows a bucket <= {length} running {lower.describe()}."
            )
            self._lock_in(
                lower.with_metadata(**{TABLE_KEY: self._table.to_dict()}), source="the budget guard", trainer=trainer
            )
            return
        if table is None or running is None or self.plan is None or running.key() == self.plan.key():
            if table is not None:
                self._table = table.with_top(replace(lower, metadata={}))
                lower = lower.with_metadata(**{TABLE_KEY: self._table.to_dict()})
            self._lock_in(lower, source="the budget guard", trainer=trainer)
            return
        index = next(i for i, b in enumerate(table.buckets) if b.plan.key() == running.key())
        self._table = table.with_plan(index, replace(lower, metadata={}, name=running.name), "guard")
        self.plan = self.plan.with_metadata(**{TABLE_KEY: self._table.to_dict()})
        assert self._view is not None
        self._applied.apply(self._view, self._table.buckets[index].plan, trainer, keep_graphs=self._keeps_graphs())
        self._running = self._table.buckets[index].plan
        rank_zero_info(f"lightning_ckpt: bucket <= {table.buckets[index].max_length} now runs {lower.describe()}")

    def _reused_table(self, trainer: pl.Trainer, plan: Plan, source: str) -> PlanTable | None:
        """The plan table a reused plan keeps, when this fit follows one (as ``_table_lengths`` decides)."""
        if self.buckets is False or self._table_refused(trainer) is not None:
            return None
        table = PlanTable.of_plan(plan, source=source)
        if table is not None:
            rank_zero_info(f"lightning_ckpt: {table_line(table, None)}")
        return table

    def _report_replanned(self, trainer: pl.Trainer) -> None:
        """Once a re-planned plan's first step was timed (its memory read before it): the side-by-side line, and
        the measured figures into the plan file."""
        check = self._replan_check
        if check is None or check.seconds is None or self.plan is None:
            return
        self._replan_check = None
        if trainer.is_global_zero:
            self.plan = check.report(self.plan)
            if self._plan_file is not None:
                self._plan_file.save(self.plan)

    def _unlock(self) -> None:
        self._guard.reader.abandon()
        self._applied.remove()
        self._running = None

    def _lock_in(self, plan: Plan, *, source: str, trainer: pl.Trainer) -> None:
        assert self._view is not None
        self._applied.apply(self._view, plan, trainer, keep_graphs=self._keeps_graphs())
        self.plan = self._running = plan
        self._guard.arm(int(trainer.accumulate_grad_batches))
        if source not in _SEARCHES or self.verbose:
            rank_zero_info(f"lightning_ckpt: applied plan from {source}: {plan.describe()}")

    def _set_micro_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, spec: Mapping[str, int]) -> None:
        if set_micro_batch(trainer, pl_module, self.batch_arg_name, spec, verbose=self.verbose):
            self.micro_batch = dict(spec)
