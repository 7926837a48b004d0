"""``ActivationCheckpointTuner``: the Lightning callback. A thin adapter from Trainer hooks to ``tune``.

Trials are *sandboxed*. On the first training batch the callback runs
the user's real ``training_step`` (under the Trainer's precision context) forward and backward on
that batch for each candidate plan, never steps the optimizer, and restores gradients, buffers,
metric states and RNG afterwards. Only then is the winner applied, so the restore cannot undo it,
and the real first step runs as if tuning had never happened - except that it is checkpointed.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ckpt.budget import Budget, RequestedBudget, format_bytes
from lightning_ckpt.discovery import discover_blocks, unwrap_compiled
from lightning_ckpt.errors import (
    ApplyError,
    ConfigurationError,
    InfeasibleBudgetError,
    PlanFileChangedError,
    StalePlanError,
)
from lightning_ckpt.lightning.guard import RealStepReader, StepCheck, lower_plan
from lightning_ckpt.lightning.micro_batch import check_micro_batch_tunable, first_batch, set_micro_batch
from lightning_ckpt.lightning.progress import lightning_bars_paused
from lightning_ckpt.lightning.reuse import (
    check_reusable,
    condition_changes,
    reused_budget,
    run_conditions,
    wanted_budget,
)
from lightning_ckpt.lightning.sync import StrategySync
from lightning_ckpt.lightning.tensorboard import TunerRun, logged_hparams
from lightning_ckpt.lightning.trials import (
    SkippedBatch,
    batch_dims,
    batch_tensors,
    fill_grads,
    needs_transfer,
    sandbox,
    training_loss,
    zero_grad_fn,
)
from lightning_ckpt.measure.tracker import normalise_device
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.caches import disable_kv_cache
from lightning_ckpt.plan.file import plan_file_version
from lightning_ckpt.plan.foreign import existing_checkpointing
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.handle import PlanHandle
from lightning_ckpt.search.compile import is_compiled, reset_compiled
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.records import TuneResult
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.search.store import storage_for_display
from lightning_ckpt.search.tune import SearchInterrupted, tune

__all__ = ["ActivationCheckpointTuner"]


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
        n_trials: most candidate plans to measure (baselines included); plans the memory model rules
            out without running do not count.
        timeout: most seconds to search; the best plan measured so far is chosen when it runs out.
        search_space: a ``SearchSpace`` or a dict of overrides, e.g. ``{"modes": ["full"], "segments": False}``.
        sampler: an Optuna sampler proposing plans (default: TPE seeded with ``seed``).
        storage: an Optuna storage URL (e.g. ``"sqlite:///ckpt.db"``) that keeps every trial, so an
            interrupted search resumes and ``optuna-dashboard`` can show it; default: in memory.
        study_name: the Optuna study's name (default: ``lightning_ckpt-<model fingerprint>-<run digest>``).
        seed: seed of the default sampler and of the search's own tie-breaking.
        warmup_steps: steps each trial runs before timing (compilation and allocator warm-up are not throughput).
        measure_steps: timed steps per trial; the median is the trial's figure.
        block_types: override block discovery (classes, class names or FQN patterns).
        on_stale_plan: ``"retune"`` (warn and search again) or ``"raise"`` when a reused plan (resumed
            checkpoint, ``plan=``, plan file) was tuned for another model, budget or run conditions. Budgets
            are compared by value (``"20GiB"`` is ``21474836480``); without a budget argument, the plan's own counts.
        on_infeasible: ``"fallback"`` (lowest-memory plan, with a warning) or ``"raise"`` when nothing fits.
        tie_tolerance: plans whose throughput is within this fraction count as tied (widened to what the
            side-by-side timing resolves): a tuned plan must beat the fastest fitting baseline by more, and a tie
            between tuned plans goes to the one using less memory (``records.CHOICE_RULE``).
        tune_micro_batch: also search the micro-batch size with gradient accumulation (same global batch)
            jointly with the plan.
        batch_arg_name: the LightningModule/DataModule attribute holding the batch size
            (``tune_micro_batch`` sets it, as Lightning's ``BatchSizeFinder`` does).
        log_dir: TensorBoard directory when the Trainer has no TensorBoardLogger.
        verbose: print a line per trial and the full trial table (always in TensorBoard); otherwise one
            progress bar and a one-line result.
        allow_graph_breaks: under ``torch.compile``, a plan that adds graph breaks or hits the recompile
            limit is a ``conflict`` and never chosen; ``True`` lets it win on throughput (still reported).
        guard_steps: real training steps read whole after lock-in (CUDA: allocator peak; CPU: live-tensor
            tracker, slower, only those steps), at least up to the first step that starts with the
            optimizer's state (accumulation + 1); also every step on a batch larger than any checked
            before. ``0`` turns the guard off.
        on_budget_exceeded: when a guarded real step exceeds the budget: ``"switch"`` (warn loudly and
            switch to the fastest lower-memory plan expected to fit), ``"raise"`` or ``"warn"``.

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
        n_trials: int | None = None,
        timeout: float | None = None,
        search_space: SearchSpace | Mapping[str, Any] | None = None,
        sampler: Any = None,
        storage: str | None = None,
        study_name: str | None = None,
        seed: int = 0,
        warmup_steps: int = 1,
        measure_steps: int = 3,
        block_types: list[Any] | None = None,
        on_stale_plan: Literal["retune", "raise"] = "retune",
        on_infeasible: Literal["fallback", "raise"] = "fallback",
        tie_tolerance: float = 0.01,
        tune_micro_batch: bool = False,
        batch_arg_name: str = "batch_size",
        log_dir: str | os.PathLike[str] | None = None,
        verbose: bool = False,
        allow_graph_breaks: bool = False,
        guard_steps: int = 2,
        on_budget_exceeded: Literal["switch", "raise", "warn"] = "switch",
    ) -> None:
        # Parsed once: every reuse decision compares this by value ("20GiB" is 21474836480).
        self._requested = RequestedBudget.parse(max_memory, activation_budget)
        _check_types(plan=plan, plan_path=plan_path)  # the search settings are checked by TuneConfig
        # The search settings, validated once and handed as one object to tune() / tune_micro_batch().
        self.config = TuneConfig(
            n_trials=TuneConfig.n_trials if n_trials is None else n_trials, timeout=timeout,
            search_space=SearchSpace.from_config(search_space), sampler=sampler, storage=storage,
            study_name=study_name, seed=seed, warmup_steps=warmup_steps, measure_steps=measure_steps,
            block_types=block_types, on_infeasible=on_infeasible, tie_tolerance=tie_tolerance,
            allow_graph_breaks=bool(allow_graph_breaks),
        )  # fmt: skip
        if isinstance(guard_steps, bool) or not isinstance(guard_steps, int) or guard_steps < 0:
            raise ConfigurationError(
                f"guard_steps must be an integer >= 0 (e.g. 2; 0 turns the guard off), got {guard_steps!r}."
            )
        if on_budget_exceeded not in ("switch", "raise", "warn"):
            raise ConfigurationError(
                f"on_budget_exceeded must be 'switch', 'raise' or 'warn', but got {on_budget_exceeded!r}."
            )
        if on_stale_plan not in ("retune", "raise"):
            raise ConfigurationError(f"on_stale_plan must be 'retune' or 'raise', but got {on_stale_plan!r}.")
        searching = {
            k: v for k, v in {"n_trials": n_trials, "timeout": timeout, "search_space": search_space,
                              "sampler": sampler, "storage": storage}.items() if v is not None
        }  # fmt: skip
        if plan is not None and searching and on_stale_plan == "raise":
            raise ConfigurationError(
                f"plan= applies a saved plan without searching, but search settings were also given "
                f"({', '.join(searching)}) with on_stale_plan='raise', so they could never be used. "
                "Remove plan= to search, or remove the search settings to reuse the plan."
            )
        self._plan_source = plan
        self._given_plan = plan if isinstance(plan, Plan) else (Plan.load(plan) if plan is not None else None)
        self.plan_path = Path(plan_path) if plan_path is not None else None
        if self.plan_path is not None:
            _check_writable(self.plan_path)
        self.max_memory = max_memory
        self.activation_budget = activation_budget
        self.block_types = block_types
        self.on_stale_plan = on_stale_plan
        self.tune_micro_batch = bool(tune_micro_batch)
        self.batch_arg_name = batch_arg_name
        self.micro_batch: dict[str, int] | None = None  # the applied {size, accumulation, global, original_size}
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.verbose = verbose

        self.plan: Plan | None = None  # the locked-in plan
        self.result: TuneResult | None = None  # the search, when one ran in this process
        self.trials_run = 0
        self._resumed_plan: Plan | None = None
        self._handle: PlanHandle | None = None
        self._pending = False
        self._tb = TunerRun(self.log_dir)
        self.wrote_plan_file = False
        self.guard_steps = guard_steps
        self.on_budget_exceeded = on_budget_exceeded
        self.step_checks: list[StepCheck] = []  # real steps read after lock-in (see guard.py)
        self._reader: RealStepReader | None = None
        self._guard_left = 0
        self._checked_dims: tuple[int, int] = (0, 0)
        self._budget: Budget | None = None
        self._search_budget = self._requested  # what a search in this fit tunes for (see reuse.wanted_budget)
        self._plan_file_version: str | None = None  # plan_path's content when last read or written here
        self._plan_file_lost = False  # another run wrote plan_path meanwhile: never write over it this fit
        self._check_batch_of: Plan | None = None
        self._restore_cache: Any = None
        self._tuned_batch: Any = None

    def __getattr__(self, name: str) -> Any:
        # The search settings read back as the attributes they were passed as (tuner.n_trials, tuner.timeout).
        config = self.__dict__.get("config")
        if config is not None and name in TuneConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        policy = getattr(trainer.strategy, "_activation_checkpointing_kwargs", None)
        if policy:
            raise ConfigurationError(
                f"The Trainer's strategy ({type(trainer.strategy).__name__}) already applies activation checkpointing "
                f"({policy}). Checkpointing twice recomputes twice. Remove activation_checkpointing_policy from the "
                "strategy, or remove ActivationCheckpointTuner."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = unwrap_compiled(pl_module)
        discover_blocks(model, block_types=self.block_types)  # a model with nothing to checkpoint fails here
        theirs = existing_checkpointing(model)
        if theirs:
            raise ConfigurationError(
                f"The model already checkpoints activations ({'; '.join(theirs[:3])}"
                f"{f' and {len(theirs) - 3} more' if len(theirs) > 3 else ''}); a tuned plan on top would recompute "
                "those blocks twice. Turn it off and let ActivationCheckpointTuner choose (HF: "
                "model.gradient_checkpointing_disable(); timm: set_grad_checkpointing(False); or remove "
                "checkpoint_wrapper), or remove ActivationCheckpointTuner to keep yours."
            )
        self._reader = RealStepReader(normalise_device(pl_module.device))
        self._tb = TunerRun(self.log_dir)  # this fit's logger run has no tuner HParams columns yet
        self.step_checks = []
        self._checked_dims = (0, 0)
        self._search_budget = self._requested
        self._plan_file_lost = False
        # Read before the file is loaded: a save by another run after this point is then seen as a change.
        self._plan_file_version = plan_file_version(self.plan_path) if self.plan_path is not None else None
        plan, source = self._plan_to_reuse(model)
        if trainer.world_size > 1:
            # Rank 0 decides (its plan file, its checkpoint state); a rank that decided differently
            # would run trials alone and hang the others' collectives.
            data = trainer.strategy.broadcast(plan.to_dict() if plan is not None else None, src=0)
            plan = Plan.from_dict(data, source="plan broadcast from rank 0") if data is not None else None
        if plan is not None:
            wanted = self._search_budget = wanted_budget(plan, self._requested)
            try:
                check_reusable(
                    plan,
                    source,
                    changes=condition_changes(plan, run_conditions(trainer, pl_module, None), batch_known=False),
                    model=model,
                    wanted=wanted,
                    budget_given=self._requested.given,
                )
                if (plan.metadata.get("search") or {}).get("fell_back"):
                    _warn_each_fit(
                        f"lightning_ckpt: the plan from {source} was a fallback: when it was tuned no plan fitted the "
                        f"budget ({(plan.metadata.get('budget') or {}).get('description', 'unknown')}), so it may not "
                        "fit now either. Delete the plan file to search again, or raise the budget."
                    )
                self._lock_in(model, plan, source=source, trainer=trainer)
                self._budget = reused_budget(plan, wanted, pl_module.device)
                if trainer.world_size > 1:
                    # Resolved per rank (the default CUDA budget is a share of each GPU's free memory): ranks that
                    # judged a step differently would enter the switch's collectives alone and hang. Rank 0's, as
                    # a search uses.
                    self._budget = StrategySync(trainer.strategy).broadcast(self._budget)
                self._check_batch_of = plan  # its batch shape is compared with the first batch's
                if plan.metadata.get("micro_batch"):
                    self._set_micro_batch(trainer, pl_module, plan.metadata["micro_batch"])
                return
            except StalePlanError as err:
                if self.on_stale_plan == "raise":
                    raise StalePlanError(
                        f"{err} Delete or re-tune the plan, or pass on_stale_plan='retune' to search again."
                    ) from None
                rank_zero_warn(f"{err} Re-tuning for {wanted.describe()} instead (on_stale_plan='retune').")
        self._check_tunable(pl_module)
        if trainer.is_global_zero:
            self._tb.declare_hparams_table(trainer, pl_module)
        if self.tune_micro_batch:
            self._search_micro_batch(trainer, pl_module, model)  # before the loop draws its first batch
            return
        self._pending = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        model = unwrap_compiled(pl_module)
        if self._check_batch_of is not None:
            plan, self._check_batch_of = self._check_batch_of, None
            changes = condition_changes(plan, run_conditions(trainer, pl_module, batch), batch_known=True)
            if changes:
                message = f"The applied plan was tuned for other batches: {'; '.join(changes)}."
                if self.on_stale_plan == "raise":
                    raise StalePlanError(message + " Re-tune (on_stale_plan='retune') or delete the plan file.")
                rank_zero_warn(
                    f"lightning_ckpt: {message} Re-tuning on this batch for {self._search_budget.describe()} "
                    "(on_stale_plan='retune')."
                )
                self._unlock()
                self._check_tunable(pl_module)
                self._pending = True
        if self._pending:
            try:
                result = self._search(trainer, pl_module, model, batch, batch_idx)
            except SkippedBatch:
                rank_zero_info(
                    f"lightning_ckpt: training_step returned None for batch {batch_idx} (Lightning skips it); "
                    "tuning on the next batch."
                )
                return
            except SearchInterrupted:
                from lightning.pytorch.utilities.exceptions import SIGTERMException

                # The model is untouched (trials are sandboxed); hand over to Lightning's own SIGTERM handling.
                rank_zero_info("lightning_ckpt: SIGTERM received; the search stopped and nothing was applied.")
                raise SIGTERMException() from None
            self._pending = False
            self.result = result
            self.trials_run = len(result.trials)
            self._budget = result.budget
            self._lock_in(model, result.best, source="search", trainer=trainer)
            if trainer.is_global_zero:
                self._report(trainer, result)
        self._maybe_read_step(trainer, pl_module, batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        reading = self._reader.stop() if self._reader is not None else None
        if reading is not None:
            self._judge_step(trainer, pl_module, reading, batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._reader is not None:  # the closure (forward, backward) is over: what follows is the optimizer's
            self._reader.optimizer_update_starts()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed or interrupted fit leaves the model as the user gave it (no instance forwards, HF cache
        # setting back); self.plan stays, so a new fit with this callback re-applies it without searching.
        if self._reader is not None:
            self._reader.abandon()
        self._unlock()
        self._pending = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._reader is not None:
            self._reader.abandon()
        self._unlock()
        self._tb.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The model leaves fit as the user gave it; resuming or a new fit re-applies the locked-in plan.
        if self._reader is not None:
            self._reader.abandon()
        self._unlock()

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict() if self.plan is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        data = state_dict.get("plan")
        self._resumed_plan = (
            Plan.from_dict(data, source="checkpointed ActivationCheckpointTuner state") if data else None
        )

    # -- internals ---------------------------------------------------------------------------------
    def _plan_to_reuse(self, model: torch.nn.Module) -> tuple[Plan | None, str]:
        """A plan to apply without searching, and where it came from: a resumed checkpoint, ``plan=``, the
        plan this callback locked in during an earlier fit in this process, or the plan file."""
        for plan, source in (
            (self._resumed_plan, "resumed checkpoint"),
            (self._given_plan, "plan= argument"),
            (self.plan, "an earlier fit with this callback"),
        ):
            if plan is not None:
                return plan, source
        return self._reusable_plan_file(model), "plan file"

    def _reusable_plan_file(self, model: torch.nn.Module) -> Plan | None:
        if self.plan_path is None or not self.plan_path.exists():
            return None
        return Plan.load(self.plan_path)  # its budget, conditions and fingerprint are checked in on_fit_start

    def _check_tunable(self, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ConfigurationError(
                "ActivationCheckpointTuner cannot run trials with manual optimization (automatic_optimization=False): "
                "training_step steps the optimizer itself, so a trial would change the weights. Tune once with "
                "automatic optimization, or pass plan=... to apply a saved plan."
            )

    def _unlock(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._restore_cache is not None:
            self._restore_cache()
            self._restore_cache = None

    def _lock_in(self, model: torch.nn.Module, plan: Plan, *, source: str, trainer: pl.Trainer) -> None:
        if self._handle is not None:
            self._handle.remove()
        if self._restore_cache is None:
            self._restore_cache = disable_kv_cache(model)  # training forwards never need HF's KV cache
        self._handle = apply_plan(model, plan)
        self.plan = plan
        if is_compiled(model):
            reset_compiled()  # compile the locked-in plan afresh: no stale graphs, no recompiles counted (compile.py)
        if trainer.world_size > 1:
            digests = StrategySync(trainer.strategy).all_gather(plan.digest())
            if len(set(digests)) != 1:
                self._handle.remove()
                raise ApplyError(
                    f"Ranks applied different checkpointing plans (digests by rank: {digests}). Every rank must "
                    "train with the same plan; check that all ranks read the same plan file."
                )
        self._guard_left = self.guard_steps and max(self.guard_steps, int(trainer.accumulate_grad_batches) + 1)
        if source not in ("search", "joint micro-batch search") or self.verbose:  # a search ends with its own line
            rank_zero_info(f"lightning_ckpt: applied plan from {source}: {plan.describe()}")

    # -- the guard: real steps after lock-in (guard.py) --------------------------------------------
    def _maybe_read_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        if self._reader is None or self._budget is None or self._budget.kind == "none" or not self.guard_steps:
            return
        dims = tuple(d or 0 for d in batch_dims(batch))
        # Under several ranks every rank must read the same steps (the verdict is gathered), and batch shapes
        # can differ by rank (a ragged last batch): only the first steps after lock-in are read there.
        larger = (
            trainer.world_size == 1
            and bool(self.step_checks)
            and any(d > c for d, c in zip(dims, self._checked_dims, strict=True))
        )
        if self._guard_left <= 0 and not larger:
            return
        self._reader.start(
            pl_module, list(trainer.optimizers), tuple(batch_tensors(batch)), activation=self._budget.kind == "activation",
            compiled=is_compiled(pl_module),
        )  # fmt: skip

    def _judge_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, reading: Any, batch: Any) -> None:
        budget = self._budget
        assert budget is not None and self.plan is not None
        peak, act = reading.peak_bytes, reading.activation_bytes
        if trainer.world_size > 1:  # the budget holds on every rank: judge the worst one, identically everywhere
            gathered = StrategySync(trainer.strategy).all_gather((peak, act))
            peak = max(g[0] for g in gathered)
            act = max((g[1] for g in gathered if g[1] is not None), default=None)
        dims = batch_dims(batch)
        fits = budget.fits(peak, act)
        self._guard_left -= 1
        self._checked_dims = tuple(max(d or 0, c) for d, c in zip(dims, self._checked_dims, strict=True))  # type: ignore[assignment]
        self.step_checks.append(StepCheck(trainer.global_step, peak, act, dims, self.plan.describe(), fits))
        if not fits:
            self._over_budget(trainer, pl_module, budget.value_of(peak, act) or 0, dims)
        if (self._guard_left <= 0 or not fits) and trainer.is_global_zero:
            self._save_checks()

    def _over_budget(self, trainer: pl.Trainer, pl_module: pl.LightningModule, value: int, dims: Any) -> None:
        budget, plan = self._budget, self.plan
        assert budget is not None and plan is not None
        what = "activation memory" if budget.kind == "activation" else "peak memory"
        message = (
            f"lightning_ckpt: a real training step (step {trainer.global_step}, batch {dims[0]} x {dims[1]}) used "
            f"{format_bytes(value)} of {what}, over the budget of {budget.description}, under plan {plan.describe()}."
        )
        if self.on_budget_exceeded == "raise":
            raise InfeasibleBudgetError(
                message + " Raise the budget, or set on_budget_exceeded='switch' to move to a lower-memory plan."
            )
        if self.on_budget_exceeded == "warn":
            rank_zero_warn(message + " Continuing with it (on_budget_exceeded='warn').")
            return
        trials = self.result.trials if self.result is not None else ()
        lower = lower_plan(plan, value, trials, budget, unwrap_compiled(pl_module), block_types=self.block_types)
        if lower is None:
            rank_zero_warn(message + " No plan using less memory is left; continuing with this one.")
            return
        rank_zero_warn(message + f" Switching to {lower.describe()} (on_budget_exceeded='switch').")
        self._lock_in(unwrap_compiled(pl_module), lower, source="the budget guard", trainer=trainer)

    def _save_checks(self) -> None:
        if self.plan is None:
            return
        self.plan = self.plan.with_metadata(real_steps=[c.to_dict() for c in self.step_checks])
        if self.plan_path is not None:
            self._save_plan_file(self.plan)

    def _save_plan_file(self, plan: Plan) -> bool:
        """Write ``plan_path`` unless another run wrote it since this fit read it (or this run last wrote it): two
        runs tuning into one file must not both believe their plan is there. The one that finds the file
        changed keeps the other's plan, trains with its own and says so."""
        assert self.plan_path is not None
        if self._plan_file_lost:
            return False
        try:
            plan.save(self.plan_path, unchanged_since=self._plan_file_version)
        except PlanFileChangedError as err:
            self._plan_file_lost = True
            _warn_each_fit(
                f"lightning_ckpt: {self.plan_path} was written by another run while this one was tuning: it now "
                f"holds {err.held}, which is kept. This run trains with its own plan {plan.describe()} (digest "
                f"{plan.digest()}), which was not saved. Give each run its own plan_path, or tune once and pass "
                "the file to the other runs as plan=."
            )
            return False
        self._plan_file_version = plan.file_version()
        return True

    def _search(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: torch.nn.Module, batch: Any, batch_idx: int
    ) -> TuneResult:
        batch = trainer.strategy.batch_to_device(batch) if needs_transfer(batch, pl_module.device) else batch
        precision = trainer.strategy.precision_plugin

        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        forward = training_loss(
            pl_module, precision, batch, batch_idx, zero_grad=zero_grad_fn(trainer, pl_module, optimizer, batch_idx)
        )
        batch_size, seq_len = batch_dims(batch)
        progress = self._progress(trainer)

        self._tuned_batch = batch
        with lightning_bars_paused(trainer, progress), sandbox(pl_module), warnings.catch_warnings():
            # tune() warns of a fallback through the warnings module, shown once per process; said below each fit.
            warnings.filterwarnings("ignore", message="No checkpointing plan fits the budget")
            fill_grads(pl_module)
            result = tune(
                model, forward, optimizer=optimizer, **self._search_budget.arguments(), config=self.config,
                batch_size=batch_size, seq_len=seq_len,
                progress=progress, extra_tensors=tuple(batch_tensors(batch)),
                should_stop=lambda: bool(getattr(trainer, "received_sigterm", False)),
                sync=StrategySync(trainer.strategy) if trainer.world_size > 1 else None,
            )  # fmt: skip
        if result.fell_back:
            _warn_each_fit(result.fallback_message)
        return result

    def _search_micro_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: torch.nn.Module) -> None:
        from lightning.pytorch.utilities.parsing import lightning_getattr

        from lightning_ckpt.search.microbatch import resize_batch, tune_micro_batch

        check_micro_batch_tunable(trainer, pl_module, self.batch_arg_name)
        base = int(lightning_getattr(pl_module, self.batch_arg_name))
        global_batch = base * int(trainer.accumulate_grad_batches)
        batch = first_batch(trainer)
        precision = trainer.strategy.precision_plugin

        def loss_fn_for(m: int) -> Any:
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            # One micro-batch per step: the previous step's gradients live until after the forward.
            zero_grad = zero_grad_fn(trainer, pl_module, optimizer, 0) if global_batch // m == 1 else None
            return training_loss(pl_module, precision, resize_batch(batch, base, m), 0, zero_grad=zero_grad)

        progress = self._progress(trainer)

        with lightning_bars_paused(trainer, progress), sandbox(pl_module):
            fill_grads(pl_module)
            found = tune_micro_batch(
                model, loss_fn_for, base_micro_batch=base, global_batch=global_batch,
                **self._search_budget.arguments(), progress=progress,
                extra_for=lambda m: tuple(batch_tensors(resize_batch(batch, base, m))),
                optimizer=trainer.optimizers[0] if trainer.optimizers else None,
                config=replace(self.config, confirm_rounds=3),
            )  # fmt: skip
        self.result = found.result
        self.trials_run = len(found.result.trials)
        self._budget = found.result.budget
        self._tuned_batch = resize_batch(batch, base, found.micro_batch)
        self._lock_in(model, found.result.best, source="joint micro-batch search", trainer=trainer)
        self._set_micro_batch(trainer, pl_module, found.result.best.metadata["micro_batch"])
        if trainer.is_global_zero:
            self._report(trainer, found.result)

    def _set_micro_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, spec: Mapping[str, int]) -> None:
        if set_micro_batch(trainer, pl_module, self.batch_arg_name, spec, verbose=self.verbose):
            self.micro_batch = dict(spec)

    def _progress(self, trainer: pl.Trainer) -> Any:
        """One progress bar for the search on rank 0 (trial lines above it when verbose), and each trial's
        scalars streamed to TensorBoard."""
        from lightning_ckpt.report.summary import SearchProgress

        if not trainer.is_global_zero:
            return None
        return SearchProgress(
            self.config.n_trials, writer=self._tb.writer(trainer), verbose=self.verbose,
            enabled=trainer.progress_bar_callback is not None, file=sys.stdout,
        )  # fmt: skip

    def _report(self, trainer: pl.Trainer, result: TuneResult) -> None:
        from lightning_ckpt.report import summary as report

        plan = result.best.with_metadata(
            budget={**result.budget.to_dict(), "requested": self._search_budget.requested_max_memory},
            conditions=run_conditions(trainer, trainer.lightning_module, self._tuned_batch).to_dict(),
        )
        self.plan = plan
        if self.plan_path is not None:
            self.wrote_plan_file = self._save_plan_file(plan)
        writer = self._tb.writer(trainer)
        log_dir = report.write_tensorboard(
            writer, result, log_trials=False, write_experiment_summary=not self._tb.declared_in_logger,
            other_hparams=logged_hparams(trainer, trainer.lightning_module),
        )  # fmt: skip  # trials were streamed
        self._tb.close()
        warning = report.timing_warning(result)
        if warning:
            rank_zero_warn(warning)
        if self.verbose:
            rank_zero_info(report.summary_table(result))
        where = []
        if self.plan_path is not None:
            where.append(
                f"plan saved to {self.plan_path}" if self.wrote_plan_file
                else f"plan not saved: {self.plan_path} holds another run's plan"
            )  # fmt: skip
        where.append(f"view it: tensorboard --logdir {self._tb.view_dir(trainer, log_dir)}")
        if result.study_name is not None:
            where.append(f"Optuna study {result.study_name!r} ({storage_for_display(result.storage)})")
        rank_zero_info(report.result_line(result) + "\nlightning_ckpt: " + "; ".join(where))


def _check_types(**values: Any) -> None:
    """Arguments whose wrong type would only fail mid-fit (or silently do something else), refused now."""
    rules = {
        "plan": ((str, os.PathLike, Plan), "a plan file path or a Plan, e.g. plan='plans/gpt.json'"),
        "plan_path": ((str, os.PathLike), "a file path, e.g. plan_path='plans/gpt.json'"),
    }
    for name, value in values.items():
        types, example = rules[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise ConfigurationError(f"{name} must be {example}, but got {type(value).__name__} {value!r}.")


def _warn_each_fit(message: str) -> None:
    """``rank_zero_warn`` shown on every fit, not once per process: entering ``catch_warnings`` resets the
    'already shown' registry, while the user's own filters (e.g. ``ignore``) still apply."""
    with warnings.catch_warnings():
        rank_zero_warn(message)


def _check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"plan_path={str(path)!r} cannot be written: {str(probe)!r} is not a writable directory. "
            "Choose a plan_path in a directory you can write to."
        )
