"""When a saved plan (resumed checkpoint, ``plan=``, plan file) may be applied without searching, and the budget
it is then guarded against. A plan file is a cache of a measurement, reused only where it was measured: everything
that moves the measurement (batch, precision, card, ranks, model, budget) is recorded with the plan and compared.
The callback's ``plan_path`` is written atomically by rank 0, and never over another run's plan: two runs tuning
into one file must not both believe their plan is there. The file is a by-product of the training run, so a save
that fails never stops the fit: the plan stays applied and in the callback's ``state_dict``, and one warning per
fit says why it could not be written."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only

from lightning_ckpt.budget import Budget, RequestedBudget
from lightning_ckpt.errors import (
    ConfigurationError,
    InfeasibleBudgetError,
    LightningCkptWarning,
    PlanError,
    PlanFileChangedError,
    StalePlanError,
    StalePlanWarning,
)
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.lightning.shapes import batch_dims
from lightning_ckpt.measure.tracker import normalise_device
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.file import plan_file_version
from lightning_ckpt.plan.format import Plan, closest_names
from lightning_ckpt.search.replan import replan

__all__ = [
    "PlanFile",
    "RunConditions",
    "condition_changes",
    "plan_to_reuse",
    "retune_for_batch",
    "reusable",
    "reused_budget",
    "run_conditions",
    "warn_each_fit",
    "warn_user",
]


def run_conditions(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> RunConditions:
    """What a plan's figures depend on in this run (batch shape only once a batch is known)."""
    device = normalise_device(pl_module.device)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    batch_size, seq_len = batch_dims(batch) if batch is not None else (None, None)
    accumulation = int(trainer.accumulate_grad_batches)
    return RunConditions(
        batch_size, seq_len, str(trainer.precision), device.type, capacity, trainer.world_size, accumulation
    )


def condition_changes(plan: Plan, now: RunConditions, *, batch_known: bool) -> list[str]:
    """What differs from the conditions ``plan`` was tuned under (batch shape only once a batch is known)."""
    saved = dict(plan.provenance.conditions)
    if plan.provenance.micro_batch is not None:  # it sets accumulation itself
        saved.pop("accumulation", None)
    return now.changes_from(saved, include_batch=batch_known)


def check_reusable(
    plan: Plan, source: str, *, changes: list[str], model: ModelView, wanted: RequestedBudget, budget_given: bool
) -> None:
    """Raise ``StalePlanError`` saying why ``plan`` (from ``source``) cannot be applied to this run as it is."""
    if changes:
        raise StalePlanError(f"The plan from {source} was tuned under other conditions: {'; '.join(changes)}.")
    modules = {name for name, _ in model.root.named_modules()}
    unknown = [fqn for fqn in (*plan.blocks, *plan.segments) if fqn not in modules]
    if unknown:  # a hand-edited file, or one for another model written without a fingerprint
        raise StalePlanError(
            f"The plan from {source} names {len(unknown)} module(s) this model does not have: "
            f"{', '.join(map(repr, unknown[:3]))} (closest: {closest_names(unknown[0], sorted(modules))})."
        )
    fingerprint = model.fingerprint
    if plan.fingerprint is not None and plan.fingerprint != fingerprint:
        raise StalePlanError(
            f"The plan from {source} was tuned for another model: {plan.model_change(model)} (fingerprint "
            f"{plan.fingerprint} in the plan, {fingerprint} for this model)."
        )
    saved = RequestedBudget.of_plan(plan)
    # A budget saved without its size is compared only with one this run asks for.
    if saved is not None and saved != wanted and (saved.recorded or budget_given):
        raise StalePlanError(
            f"The plan from {source} was tuned for {saved.describe()}, but this run asks for {wanted.describe()}."
        )


def reused_budget(plan: Plan, wanted: RequestedBudget, device: torch.device) -> Budget | None:
    """``wanted``, resolved for this device. A share of activation memory needs the no-checkpointing figure, known
    only from the plan's own record of that budget."""
    if wanted.kind == "activation":
        saved = plan.provenance.budget
        limit = saved.get("limit_bytes") if RequestedBudget.of_plan(plan) == wanted else None
        return Budget("activation", limit, wanted.value, saved.get("description", "")) if limit else None
    return wanted.resolve(device=normalise_device(device))


def plan_to_reuse(
    candidates: Sequence[tuple[Plan | None, str]], plan_file: PlanFile | None, *, on_stale_plan: str
) -> tuple[Plan | None, str]:
    """The first of ``candidates`` (plan, where it came from) that is set, else the plan in ``plan_file``; a plan file
    that no longer fits is re-tuned, as any stale plan is, and a corrupt one fails the fit."""
    for plan, source in candidates:
        if plan is not None:
            return plan, source
    if plan_file is None:
        return None, "plan file"
    source = f"the plan file {str(plan_file.path)!r}"
    try:
        return plan_file.load(), source
    except StalePlanError as err:
        warned = f"{err} Re-tuning instead (guard on_stale_plan='retune'); the search's plan replaces the file."
        _stale(on_stale_plan, f"{err} Delete or re-tune the plan, or pass guard={{'on_stale_plan': 'retune'}}.", warned)
        return None, source


def reusable(
    plan: Plan,
    source: str,
    conditions: RunConditions,
    model: ModelView,
    requested: RequestedBudget,
    *,
    on_stale_plan: str,
) -> tuple[RequestedBudget, Plan | None]:
    """The budget ``plan`` is reused under (or re-tuned for), and the plan to apply: ``plan``, or, when only the
    budget changed, the plan re-planned from its profile (zero trials); None when the caller must search. The budget
    is the callback's, or when it was given none, the plan's own."""
    saved = RequestedBudget.of_plan(plan)
    wanted = saved if not requested.given and saved is not None and saved.recorded else requested
    changes = condition_changes(plan, conditions, batch_known=False)
    try:
        check_reusable(plan, source, changes=changes, model=model, wanted=wanted, budget_given=requested.given)
    except StalePlanError as err:
        replanned = replan_for_budget(plan, source, changes=changes, model=model, wanted=wanted)
        if replanned is not None:
            return wanted, replanned
        raised = f"{err} Delete or re-tune the plan, or pass guard={{'on_stale_plan': 'retune'}} to search again."
        _stale(
            on_stale_plan, raised, f"{err} Re-tuning for {wanted.describe()} instead (guard on_stale_plan='retune')."
        )
        return wanted, None
    if plan.provenance.search.get("fell_back"):
        tuned_for = plan.provenance.budget.get("description", "unknown")
        warn_each_fit(
            f"lightning_ckpt: the plan from {source} was a fallback: when it was tuned no plan fitted the "
            f"budget ({tuned_for}), so it may not fit now either. Delete the plan file to search again, or raise "
            "the budget."
        )
    return wanted, plan


def replan_for_budget(
    plan: Plan, source: str, *, changes: list[str], model: ModelView, wanted: RequestedBudget
) -> Plan | None:
    """``plan`` re-planned for ``wanted`` from the profile it keeps, when the budget is all that differs; else None."""
    if changes or not plan.provenance.profile or not wanted.recorded:
        return None
    if plan.fingerprint is not None and plan.fingerprint != model.fingerprint:
        return None
    try:
        replanned = replan(plan, **wanted.arguments(), device=model.device, source=f"the plan from {source}")
    except (PlanError, InfeasibleBudgetError, ConfigurationError) as err:
        warn_user(f"lightning_ckpt: could not re-plan the plan from {source} for {wanted.describe()}: {err}")
        return None
    for note in replanned.notes:
        warn_user(f"lightning_ckpt: re-planning the plan from {source}: {note}")
    return replanned.plan


def retune_for_batch(plan: Plan, conditions: RunConditions, *, budget: RequestedBudget, on_stale_plan: str) -> bool:
    """True when a reused ``plan`` was tuned on batches of another shape than the first one (warned)."""
    changes = condition_changes(plan, conditions, batch_known=True)
    if not changes:
        return False
    message = f"The applied plan was tuned for other batches: {'; '.join(changes)}."
    warned = (
        f"lightning_ckpt: {message} Re-tuning on this batch for {budget.describe()} (guard on_stale_plan='retune')."
    )
    _stale(on_stale_plan, f"{message} Re-tune (guard on_stale_plan='retune') or delete the plan file.", warned)
    return True


def _stale(on_stale_plan: str, raised: str, warned: str) -> None:
    """A stale plan: raise ``raised`` under ``on_stale_plan='raise'``, else warn ``warned`` (the caller re-tunes)."""
    if on_stale_plan == "raise":
        raise StalePlanError(raised) from None
    warn_user(warned, StalePlanWarning)


_LABELS = {
    "batch_size": "micro-batch size",
    "seq_len": "sequence length",
    "precision": "precision",
    "device_type": "device type",
    "device_capacity_bytes": "device capacity",
    "world_size": "world size",
    "accumulation": "gradient accumulation",
}
_BATCH = ("batch_size", "seq_len")


@dataclass(frozen=True)
class RunConditions:
    """What a tuned plan's measurements depend on besides the model (whose fingerprint the plan carries)."""

    batch_size: int | None
    seq_len: int | None
    precision: str | None
    device_type: str
    device_capacity_bytes: int | None
    world_size: int
    accumulation: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def changes_from(self, saved: Mapping[str, Any] | None, *, include_batch: bool = True) -> list[str]:
        """Human-readable differences from ``saved`` (a plan's ``provenance.conditions``)."""
        if not saved:
            return []
        changes = []
        for key, label in _LABELS.items():
            if (key in _BATCH and not include_batch) or saved.get(key) is None:
                continue  # conditions the saved plan does not record (older files) are not compared
            mine = getattr(self, key)
            if mine != saved[key]:
                fmt = format_bytes if key == "device_capacity_bytes" else repr
                changes.append(
                    f"{label}: tuned for {fmt(saved[key])}, this run has {fmt(mine) if mine is not None else 'none'}"
                )
        return changes


class PlanFile:
    """``plan_path`` over the fits of one callback."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _check_writable(self.path)
        self._version: str | None = None  # the content when last read or written here
        self.lost = False  # another run wrote it meanwhile: never write over it this fit
        self.wrote = False
        self.failed: str | None = None  # why the last save could not write (OSError), None once one works

    def open_fit(self) -> None:
        """Note the file's content before it is loaded: a save by another run after this is then seen as a change."""
        self.lost, self.failed = False, None
        self._version = plan_file_version(self.path)

    def load(self) -> Plan | None:
        return Plan.load(self.path) if self.path.exists() else None

    def save(self, plan: Plan) -> bool:
        """Write ``plan`` unless another run wrote the file since this fit read it; False (with a warning) if so."""
        if self.lost:
            return False
        try:
            plan.save(self.path, unchanged_since=self._version)
        except PlanFileChangedError as err:
            self.lost = True
            warn_each_fit(
                f"lightning_ckpt: {self.path} was written by another run while this one was tuning: it now "
                f"holds {err.held}, which is kept. This run trains with its own plan {plan.describe()} (digest "
                f"{plan.digest()}), which was not saved. Give each run its own plan_path, or tune once and pass "
                "the file to the other runs as plan=."
            )
            return False
        except OSError as err:
            if self.failed is None:
                warn_each_fit(
                    f"lightning_ckpt: the plan file {self.path} could not be written ({type(err).__name__}: "
                    f"{err.strerror or err}). Training goes on with plan {plan.describe()} (digest {plan.digest()}), "
                    "kept in memory and in the callback's state (Lightning checkpoints carry it); any earlier file "
                    "there is intact. Free the space or fix the directory's permissions: the next save (after the "
                    "guard's steps, or the next fit) tries again."
                )
            self.failed = f"{type(err).__name__}: {err.strerror or err}"
            return False
        if self.failed is not None:
            warn_user(f"lightning_ckpt: the plan file {self.path} was written after all ({plan.describe()}).")
            self.failed = None
        self._version = plan.file_version()
        return True


def warn_each_fit(message: str, category: type[Warning] = LightningCkptWarning) -> None:
    """``warn_user`` shown on every fit: entering ``catch_warnings`` resets the 'already shown' registry, while the
    user's own filters still apply."""
    with warnings.catch_warnings():
        warn_user(message, category)


# Frames inside these packages (and Lightning's rank-zero wrapper) are not where a user's code called: a warning names
# the first frame outside them.
_INTERNAL = tuple(
    str(Path(m.__file__).parent) + os.sep
    for m in (sys.modules["lightning_ckpt"], sys.modules["lightning"], sys.modules["lightning_utilities"], torch)
    if m.__file__
)


@rank_zero_only
def warn_user(message: str, category: type[Warning] = LightningCkptWarning) -> None:
    """Warn once per process on rank 0, attributed to the user's line that started the work (``trainer.fit(...)``):
    this package's file and line said nothing to a user and could not be filtered by module."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def _check_writable(path: Path) -> None:
    probe = path.parent if str(path.parent) else Path(".")
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"plan_path={str(path)!r} cannot be written: {str(probe)!r} is not a writable directory. "
            "Choose a plan_path in a directory you can write to."
        )
