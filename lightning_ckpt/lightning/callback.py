"""``ActivationCheckpointTuner``: the Lightning callback, a thin adapter from Trainer hooks to the fit's ``FitSession``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_ckpt.budget import RequestedBudget
from lightning_ckpt.lightning.checks import (
    check_buckets,
    check_reuse_arguments,
    check_strategy,
    check_types,
    search_config,
)
from lightning_ckpt.lightning.guard import GuardConfig, StepCheck
from lightning_ckpt.lightning.reuse import PlanFile
from lightning_ckpt.lightning.session import FitSession, Found, Settings
from lightning_ckpt.lightning.shapes import BatchSize, probe_request
from lightning_ckpt.measure.allocator import start_expandable_segments
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.table import PlanTable
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.result import TuneResult

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
        search: the search's settings, a ``TuneConfig`` or a dict of its fields, e.g. ``{"n_trials": 20,
            "search_space": {"modes": ["full"], "segments": False}, "storage": "sqlite:///ckpt.db"}``.
        guard: how a reused plan and the real steps after lock-in are checked, a ``GuardConfig`` or a dict, e.g.
            ``{"steps": 2, "on_budget_exceeded": "switch", "on_stale_plan": "raise"}`` (``steps=0`` reads no steps).
            Its ``buckets`` sets the plan table of data whose lengths vary (with ``max_shape``).
        max_shape: the longest batch the run will see, ``(rows, length)`` or a length (tokens per sample), for
            data whose lengths vary: the search runs on the first batch grown to it, so the plan fits the longest
            batch, not the first. ``"probe"``: found before the first step, from the datamodule's
            ``max_seq_length`` (or ``max_length``), else from the first 64 batches of the training loader
            (``"probe:256"`` for more; training sees the same batches). Without it the plan is tuned on the first
            batch and the guard catches longer ones before their forward.
        tune_micro_batch: also search the micro-batch size with gradient accumulation (same global batch)
            jointly with the plan. ``True`` sets the LightningModule/DataModule attribute ``batch_size`` (as
            Lightning's ``BatchSizeFinder`` does); a string names another attribute.
        log_dir: TensorBoard directory when the Trainer has no TensorBoardLogger. With ``Trainer(logger=False)`` and
            no ``log_dir`` the search writes no TensorBoard files (the plan file only).
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
        search: TuneConfig | Mapping[str, Any] | None = None,
        guard: GuardConfig | Mapping[str, Any] | None = None,
        max_shape: int | tuple[int, int] | str | None = None,
        tune_micro_batch: bool | str = False,
        log_dir: str | os.PathLike[str] | None = None,
        verbose: bool = False,
    ) -> None:
        self._requested = RequestedBudget.parse(max_memory, activation_budget)
        check_types(plan=plan, plan_path=plan_path, tune_micro_batch=tune_micro_batch)
        self.config = search_config(search)
        self.guard = GuardConfig.of(guard)
        self.max_memory, self.activation_budget = max_memory, activation_budget
        self.max_shape = max_shape
        self._probe = probe_request(max_shape)  # max_shape="probe": found before the first step
        declared = None if self._probe is not None else BatchSize.declared(max_shape)
        self._bucket_edges = check_buckets(self.guard.buckets, declared or self._probe)
        check_reuse_arguments(plan, search, self.guard.on_stale_plan)
        self._given_plan = plan if isinstance(plan, Plan) else (Plan.load(plan) if plan is not None else None)
        self._given_source = "plan= argument" if plan is None or isinstance(plan, Plan) else f"plan={os.fspath(plan)!r}"
        self._plan_file = PlanFile(plan_path) if plan_path is not None else None
        self.batch_arg_name = tune_micro_batch if isinstance(tune_micro_batch, str) else "batch_size"
        self.tune_micro_batch = bool(tune_micro_batch)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.verbose = verbose
        self._found = Found(max_shape=declared)
        self._resumed_plan: Plan | None = None  # from a Lightning checkpoint (load_state_dict)
        self._session: FitSession | None = None  # the current (or last) fit's
        # Before anything starts CUDA: the search and the training after it run with expandable segments.
        start_expandable_segments()

    @property
    def plan(self) -> Plan | None:
        """The locked-in plan (kept after the fit: a new fit with this callback re-applies it)."""
        return self._found.plan

    @plan.setter
    def plan(self, value: Plan | None) -> None:
        self._found.plan = value

    @property
    def result(self) -> TuneResult | None:
        """The search, when one ran in this process."""
        return self._found.result

    @result.setter
    def result(self, value: TuneResult | None) -> None:
        self._found.result = value

    @property
    def micro_batch(self) -> dict[str, int] | None:
        """The applied micro-batch ``{size, accumulation, global, original_size}`` (``tune_micro_batch``)."""
        return self._found.micro_batch

    @property
    def plan_path(self) -> Path | None:
        return self._plan_file.path if self._plan_file is not None else None

    @property
    def trials_run(self) -> int:
        return len(self.result.trials) if self.result is not None else 0

    @property
    def plan_table(self) -> PlanTable | None:
        """The plan of each length bucket this fit follows (``guard.buckets``; ``search.buckets``), None without one."""
        return self._session.table if self._session is not None else None

    @property
    def step_checks(self) -> list[StepCheck]:
        """The real steps read after lock-in in this fit (see ``guard.py``)."""
        return self._session.step_checks if self._session is not None else []

    @property
    def wrote_plan_file(self) -> bool:
        return self._plan_file is not None and self._plan_file.wrote

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # This fit's settings, from the callback's attributes as they are now (a user may change them between fits).
        settings = Settings(
            requested=self._requested,
            config=self.config,
            guard=self.guard,
            bucket_edges=self._bucket_edges,
            probe=self._probe,
            given_plan=self._given_plan,
            given_source=self._given_source,
            plan_file=self._plan_file,
            tune_micro_batch=self.tune_micro_batch,
            batch_arg_name=self.batch_arg_name,
            log_dir=self.log_dir,
            verbose=self.verbose,
        )
        self._session = FitSession(settings, self._found, pl_module)
        self._session.fit_starts(trainer, pl_module, self._resumed_plan)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._fit().batch_starts(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._fit().batch_ends(trainer, outputs, batch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._fit().closure_ends()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._session is not None:
            self._session.end()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._session is not None:
            self._session.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit().end()

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict() if self.plan is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        data = state_dict.get("plan")
        source = "checkpointed ActivationCheckpointTuner state"
        self._resumed_plan = Plan.from_dict(data, source=source) if data else None

    def _fit(self) -> FitSession:
        assert self._session is not None, "on_fit_start starts the fit's session"
        return self._session
