"""One plan per range of batch lengths: the plan table.

A plan tuned for the longest batch pays its recompute on every short one, where a cheaper plan (often none at
all) fits; a plan tuned on a short batch runs over the budget on a long one. Data whose lengths vary (SFT sets
padded per batch, curricula, packed sequences) needs both, so the table splits lengths into buckets, each with the
fastest plan predicted to fit the budget at the bucket's longest length, and the run switches plans by each batch's
bucket before its forward (``lightning.callback``).

The search itself runs once, at the longest length (``max_shape``): its plan is the top bucket's, measured and
confirmed like any search's choice. Every shorter bucket costs one profile at its own longest length (each distinct
block once per mode: seconds, not trials) and zero trials: its plan is chosen by the search's own rule
(``records.choose_best``) from the profile's predictions, with the plain step's time taken from the search's
calibrated one, scaled by the blocks' plain seconds at the two lengths (``rescaled_time``). The budget is the
search's, in bytes: an activation budget was resolved at the longest length, as the user's share of what that step
needs. Switching between the table's plans is exact (every plan leaves gradients bit-equal to no plan) and cheap
(apply and remove wrap forwards). The real steps under each bucket's plan are read by the budget guard like any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import PlanError
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.memory.profile import Profile, profile_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import BlockPlan, Plan, mode_key
from lightning_ckpt.plan.skipping import full_depth
from lightning_ckpt.plan.table import Bucket, PlanTable
from lightning_ckpt.search.replan import SavedProfile, table_bucket
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.search.tune import space_modes
from lightning_ckpt.timing.model import Calibration, TimeModel

__all__ = ["bucket_profile", "plan_table", "rescaled_time"]


def rescaled_time(time_at: TimeModel, searched: TimeModel) -> TimeModel:
    """``time_at`` (a bucket's blocks, timed at its length) calibrated from ``searched`` (the search's, fitted to
    the steps it measured at the longest length): the plain step scaled by the blocks' plain seconds at the two
    lengths. Within a bucket the plain step is the same for every plan, so it moves no plan ahead of another; it
    only sets how much a plan's recompute weighs against the step (the tie tolerance)."""
    if searched.calibration is None:
        raise PlanError("the search's time model is not calibrated (it measured no plan): no table can be predicted")
    plain = mode_key(BlockPlan("none"))
    here = sum(b.seconds.get(plain, 0.0) for b in time_at.blocks)
    there = sum(b.seconds.get(plain, 0.0) for b in searched.blocks)
    ratio = here / there if here > 0 and there > 0 else 1.0
    base = searched.calibration.base_seconds * ratio
    return replace(time_at, calibration=Calibration(base_seconds=base))


@without_kv_cache
def bucket_profile(
    view: ModelView,
    step_fn: Callable[[], Any],
    *,
    space: SearchSpace,
    optimizer: Any = None,
    extra: tuple[Any, ...] = (),
) -> Profile:
    """The profile of one bucket: ``step_fn`` runs the tuned batch at the bucket's longest length. Taken as the
    search takes its own: KV caches off, every block running (LayerDrop and kin at full depth), Python attributes
    the step writes put back, each block timed under the modes the space gives it."""
    with full_depth(view.root, view.stacks):
        state = PythonState.capture(view.root)
        try:
            modes = space_modes(space, view)
            return profile_step(view, state.restoring(step_fn), optimizer=optimizer, extra=extra, time_blocks=modes)
        finally:
            state.restore()


def plan_table(
    top: Plan,
    profile_at: Callable[[int], Any],
    edges: Sequence[int],
    budget: Budget,
    *,
    rows: int,
) -> PlanTable:
    """The table for ``edges`` (ascending, the last the length ``top`` was searched at). ``top`` is the search's
    choice and keeps the search's saved profile (``replan.SavedProfile``); ``profile_at(length)`` profiles the
    model on the tuned batch at that length (a ``memory.profile.Profile`` with block times)."""
    searched = SavedProfile.of_plan(top, source="the search's plan")
    top_bucket = Bucket(
        max_length=edges[-1],
        plan=top,
        source="search",
        predicted_peak_bytes=_measured(top, "peak_bytes"),
        predicted_activation_bytes=_measured(top, "activation_bytes"),
        predicted_seconds=_measured(top, "median_seconds"),
    )
    buckets = []
    for length in edges[:-1]:
        profile = profile_at(length)
        if profile.time is None:
            raise PlanError(f"the profile at length {length} timed no block: no plan can be predicted there")
        time = rescaled_time(profile.time, searched.time)
        buckets.append(table_bucket(length, profile.memory, time, searched, budget, rows, top))
    return PlanTable((*buckets, top_bucket), rows)


def _measured(plan: Plan, key: str) -> Any:
    measured = plan.metadata.get("measured")
    return measured.get(key) if isinstance(measured, Mapping) else None
