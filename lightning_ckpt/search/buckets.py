"""One plan per range of batch lengths: the plan table.

A plan tuned for the longest batch pays its recompute on every short one, where a cheaper plan often fits. So for
data whose lengths vary, the table splits lengths into buckets, each with the fastest plan predicted to fit the budget
at its longest length, and the run switches plans by each batch's bucket (``lightning.callback``). The search runs
once, at the longest length (the top bucket); every shorter bucket costs one profile and zero trials, its plan chosen
by the search's own rule (``choice.choose_best``) from the profile's predictions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import PlanError
from lightning_ckpt.measure.measurement import is_out_of_memory, release_memory
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.memory.compiled import CompiledMemoryModel
from lightning_ckpt.memory.profile import Profile, profile_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.skipping import full_depth
from lightning_ckpt.plan.table import Bucket, PlanTable
from lightning_ckpt.search.compile import eager_while_profiling
from lightning_ckpt.search.replan import SavedProfile, table_bucket
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.search.tune import space_modes
from lightning_ckpt.timing.model import Calibration, TimeModel

log = logging.getLogger(__name__)

__all__ = ["bucket_profile", "compiled_at", "plan_table", "rescaled_time"]


def rescaled_time(time_at: TimeModel, searched: TimeModel) -> TimeModel:
    """``time_at`` (a bucket's blocks, timed at its length) calibrated from ``searched``: the plain step scaled by the
    blocks' plain seconds at the two lengths."""
    if searched.calibration is None:
        raise PlanError("the search's time model is not calibrated (it measured no plan): no table can be predicted")
    here, there = time_at.plain_block_seconds(), searched.plain_block_seconds()
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
    compiled: bool = False,
) -> Profile | None:
    """The profile of one bucket, taken as the search takes its own (``step_fn``: the tuned batch at the bucket's
    longest length). None when it ran out of memory: its lengths then run the next longer bucket's plan."""
    with full_depth(view.root, view.stacks), eager_while_profiling(compiled):
        state = PythonState.capture(view.root)
        try:
            modes = space_modes(space, view)
            step = state.restoring(step_fn)
            return profile_step(
                view, step, optimizer=optimizer, extra=extra, time_blocks=modes, compiled_blocks=compiled
            )
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            message = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            state.restore()
    release_memory(view.device)  # outside the ``except``: the failed pass's frames are gone
    log.warning(
        "lightning_ckpt: a bucket's profile ran out of memory (%s); its lengths run a longer bucket's plan", message
    )
    return None


def plan_table(
    top: Plan, profile_at: Callable[[int], Any], edges: Sequence[int], budget: Budget, *, rows: int
) -> PlanTable:
    """The table for ``edges`` (ascending, the last the length ``top``, the search's choice, was searched at);
    ``profile_at(length)`` profiles the model on the tuned batch at that length (``bucket_profile``)."""
    compiled = bool(top.provenance.compiled_profile)
    searched = SavedProfile.of_plan(top, source="the search's plan", compiled=compiled)
    measured = [top.provenance.measured.get(k) for k in ("peak_bytes", "activation_bytes", "median_seconds")]
    buckets = []
    for length in edges[:-1]:
        profile = profile_at(length)
        if profile is None:  # ran out of memory: the next longer bucket's plan covers these lengths
            continue
        if profile.time is None:
            raise PlanError(f"the profile at length {length} timed no block: no plan can be predicted there")
        time = rescaled_time(profile.time, searched.time)
        at = compiled_at(top, profile, length / edges[-1]) if compiled else None
        buckets.append(table_bucket(length, profile.memory, time, searched, budget, rows, top, compiled=at))
    return PlanTable((*buckets, Bucket(edges[-1], top, "search", *measured)), rows)


def compiled_at(top: Plan, profile: Profile, length_ratio: float) -> CompiledMemoryModel:
    """A compiled model's memory at a bucket's length (``length_ratio`` of the longest): its blocks compiled alone
    there, anchored on the search's compiled ``none`` step, whose bytes outside the blocks scale with the length."""
    if profile.compiled is None:
        raise PlanError("the bucket's profile compiled no block alone: its compiled memory cannot be predicted")
    kept = top.provenance.compiled_blocks
    none_act, none_peak = kept.get("none_activation_bytes"), kept.get("none_peak_bytes")
    if not isinstance(none_act, int) or not isinstance(none_peak, int):
        raise PlanError("the compiled search measured no compiled none step: no bucket's memory can be predicted")
    blocks_there = _blocks_none(kept.get("blocks"))
    blocks_here = _blocks_none([{"saved_bytes": b.saved_bytes} for b in profile.compiled.blocks])
    if blocks_there is None or blocks_here is None:
        raise PlanError("a block was not compiled under none: no bucket's compiled memory can be predicted")
    outside = max(0, none_act - blocks_there)
    activation = blocks_here + round(outside * length_ratio)
    return profile.compiled.anchored(activation, none_peak - (none_act - activation))


def _blocks_none(rows: Any) -> int | None:
    """The bytes every block call's compiled graph saves under ``none``, summed (None if one is missing)."""
    if not isinstance(rows, Sequence):
        return None
    saved = [r.get("saved_bytes", {}).get("none") if isinstance(r, Mapping) else None for r in rows]
    return sum(saved) if saved and all(isinstance(v, int) for v in saved) else None
