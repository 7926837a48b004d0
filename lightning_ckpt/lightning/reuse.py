"""When a saved plan (resumed checkpoint, ``plan=``, plan file) may be applied without searching: the run's
conditions, the model, and the budget it was tuned for must match this run's; and the budget it is then
guarded against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_ckpt.budget import Budget, RequestedBudget
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError, PlanError, StalePlanError
from lightning_ckpt.lightning.conditions import RunConditions
from lightning_ckpt.lightning.plan_file import warn_each_fit
from lightning_ckpt.lightning.trials import batch_dims
from lightning_ckpt.measure.tracker import normalise_device
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.replan import PROFILE_KEY, replan

__all__ = [
    "check_reusable",
    "condition_changes",
    "plan_to_reuse",
    "replan_for_budget",
    "reusable",
    "reused_budget",
    "run_conditions",
    "wanted_budget",
]


def run_conditions(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> RunConditions:
    """What a plan's figures depend on in this run (batch shape only once a batch is known)."""
    device = normalise_device(pl_module.device)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    batch_size, seq_len = batch_dims(batch) if batch is not None else (None, None)
    return RunConditions(
        batch_size=batch_size,
        seq_len=seq_len,
        precision=str(trainer.precision),
        device_type=device.type,
        device_capacity_bytes=capacity,
        world_size=trainer.world_size,
        accumulation=int(trainer.accumulate_grad_batches),
    )


def condition_changes(plan: Plan, now: RunConditions, *, batch_known: bool) -> list[str]:
    """What differs from the conditions ``plan`` was tuned under (batch shape only once a batch is known)."""
    saved = dict(plan.metadata.get("conditions") or {})
    if plan.metadata.get("micro_batch"):
        # The plan sets micro-batch and accumulation itself; the callback checks the global batch.
        saved.pop("accumulation", None)
        if not batch_known:
            saved.pop("batch_size", None)
    return now.changes_from(saved, include_batch=batch_known)


def wanted_budget(plan: Plan, requested: RequestedBudget) -> RequestedBudget:
    """The budget a reused ``plan`` must have been tuned for, and a re-tune tunes for: the callback's, or
    when it was given none, the plan's own (a plan applied as it was saved keeps its budget)."""
    saved = RequestedBudget.of_plan(plan)
    return saved if not requested.given and saved is not None and saved.recorded else requested


def check_reusable(
    plan: Plan, source: str, *, changes: list[str], model: ModelView, wanted: RequestedBudget, budget_given: bool
) -> None:
    """Raise ``StalePlanError`` saying why ``plan`` (from ``source``) cannot be applied to this run as it is."""
    if changes:
        raise StalePlanError(f"The plan from {source} was tuned under other conditions: {'; '.join(changes)}.")
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
    """The budget a reused plan is guarded against: ``wanted``, resolved for this device. A share of activation
    memory needs the no-checkpointing figure, known only from the plan's own record of that budget."""
    if wanted.kind == "activation":
        saved = plan.metadata.get("budget") or {}
        limit = saved.get("limit_bytes") if RequestedBudget.of_plan(plan) == wanted else None
        return Budget("activation", limit, wanted.value, saved.get("description", "")) if limit else None
    return wanted.resolve(device=normalise_device(device))


def plan_to_reuse(candidates: Sequence[tuple[Plan | None, str]], plan_file: Any) -> tuple[Plan | None, str]:
    """The first of ``candidates`` (plan, where it came from) that is set, else the plan in ``plan_file``."""
    for plan, source in candidates:
        if plan is not None:
            return plan, source
    return (plan_file.load() if plan_file is not None else None), "plan file"


def reusable(
    plan: Plan,
    source: str,
    conditions: RunConditions,
    model: ModelView,
    requested: RequestedBudget,
    *,
    on_stale_plan: str,
) -> tuple[RequestedBudget, Plan | None]:
    """The budget ``plan`` is reused under (or re-tuned for), and the plan to apply: ``plan`` as it is, or, when
    only the budget changed and ``plan`` keeps its profile, the plan re-planned for this budget from it (zero
    trials, marked predicted); None when the caller must search. A stale plan raises under
    ``on_stale_plan='raise'``; otherwise it warns and the caller searches again."""
    wanted = wanted_budget(plan, requested)
    changes = condition_changes(plan, conditions, batch_known=False)
    try:
        check_reusable(plan, source, changes=changes, model=model, wanted=wanted, budget_given=requested.given)
    except StalePlanError as err:
        replanned = replan_for_budget(plan, source, changes=changes, model=model, wanted=wanted)
        if replanned is not None:
            return wanted, replanned
        if on_stale_plan == "raise":
            raise StalePlanError(
                f"{err} Delete or re-tune the plan, or pass on_stale_plan='retune' to search again."
            ) from None
        rank_zero_warn(f"{err} Re-tuning for {wanted.describe()} instead (on_stale_plan='retune').")
        return wanted, None
    if (plan.metadata.get("search") or {}).get("fell_back"):
        tuned_for = (plan.metadata.get("budget") or {}).get("description", "unknown")
        warn_each_fit(
            f"lightning_ckpt: the plan from {source} was a fallback: when it was tuned no plan fitted the "
            f"budget ({tuned_for}), so it may not fit now either. Delete the plan file to search again, or raise "
            "the budget."
        )
    return wanted, plan


def replan_for_budget(
    plan: Plan, source: str, *, changes: list[str], model: ModelView, wanted: RequestedBudget
) -> Plan | None:
    """``plan`` re-planned for ``wanted`` from the profile it keeps (``search.replan``), when the budget is all that
    differs: same model, same run conditions. None when something else differs, the plan keeps no profile, or
    no plan is predicted to fit (warned: the caller searches)."""
    if changes or PROFILE_KEY not in plan.metadata or not wanted.recorded:
        return None
    if plan.fingerprint is not None and plan.fingerprint != model.fingerprint:
        return None
    try:
        return replan(plan, **wanted.arguments(), device=model.device, source=f"the plan from {source}").plan
    except (PlanError, InfeasibleBudgetError, ConfigurationError) as err:
        rank_zero_warn(f"lightning_ckpt: could not re-plan the plan from {source} for {wanted.describe()}: {err}")
        return None


def retune_for_batch(plan: Plan, conditions: RunConditions, *, budget: RequestedBudget, on_stale_plan: str) -> bool:
    """True when a reused ``plan`` was tuned on batches of another shape than the first one (warned: the
    caller re-tunes on it); raises under ``on_stale_plan='raise'``."""
    changes = condition_changes(plan, conditions, batch_known=True)
    if not changes:
        return False
    message = f"The applied plan was tuned for other batches: {'; '.join(changes)}."
    if on_stale_plan == "raise":
        raise StalePlanError(message + " Re-tune (on_stale_plan='retune') or delete the plan file.")
    rank_zero_warn(
        f"lightning_ckpt: {message} Re-tuning on this batch for {budget.describe()} (on_stale_plan='retune')."
    )
    return True
