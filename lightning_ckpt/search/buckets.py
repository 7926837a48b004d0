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
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.budget import Budget, format_bytes
from lightning_ckpt.errors import ConfigurationError, PlanError
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.memory.model import MemoryModel
from lightning_ckpt.memory.optimizer_step import RealStepMemory
from lightning_ckpt.memory.profile import Profile, profile_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.caches import without_kv_cache
from lightning_ckpt.plan.format import BlockPlan, Plan, mode_key
from lightning_ckpt.plan.skipping import full_depth
from lightning_ckpt.search.records import choose_best
from lightning_ckpt.search.replan import SavedProfile, predicted_records
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.search.tune import space_modes
from lightning_ckpt.timing.model import Calibration, TimeModel

__all__ = [
    "TABLE_KEY",
    "Bucket",
    "PlanTable",
    "bucket_edges",
    "bucket_profile",
    "plan_table",
    "rescaled_time",
    "table_line",
]

TABLE_KEY = "plan_table"
MAX_BUCKETS = 8  # every bucket is a profile before training and a plan to switch to (and, compiled, a graph)


def bucket_edges(shortest: int, longest: int, edges: Sequence[int] | None = None) -> tuple[int, ...]:
    """The buckets' longest lengths, ascending, the last ``longest``. ``edges``: the user's (every length above the
    last is the top bucket's); by default halving from ``longest`` while above ``shortest`` (the first batch's
    length): lengths in a long tail spread over octaves, and a bucket twice as long needs at most four times
    the activations, so no bucket's plan pays for much more than its batches need."""
    if edges is not None:
        chosen = sorted({int(e) for e in edges if 0 < int(e) < longest})
        if len(chosen) + 1 > MAX_BUCKETS:
            raise ConfigurationError(
                f"buckets: at most {MAX_BUCKETS} buckets (each is profiled before training and has its own plan), "
                f"but {len(chosen) + 1} were given. Merge some, e.g. buckets=[128, 256, 512]."
            )
        return (*chosen, longest)
    out = [longest]
    while len(out) < MAX_BUCKETS and out[-1] // 2 >= max(shortest, 1) and out[-1] // 2 > 0:
        out.append(out[-1] // 2)
    return tuple(sorted(out))


@dataclass(frozen=True)
class Bucket:
    """Batches up to ``max_length`` long (and longer than the bucket below) run ``plan``."""

    max_length: int
    plan: Plan
    source: str  # "search": the search's choice (measured); "predicted": chosen from a profile; "guard": switched to
    predicted_peak_bytes: int | None = None
    predicted_activation_bytes: int | None = None
    predicted_seconds: float | None = None
    profile: Mapping[str, Any] | None = None  # the memory and time model at max_length (re-planning per bucket)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_length": self.max_length,
            "plan": {k: v for k, v in self.plan.to_dict().items() if k != "metadata"},
            "source": self.source,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_activation_bytes": self.predicted_activation_bytes,
            "predicted_seconds": self.predicted_seconds,
            "profile": dict(self.profile) if self.profile is not None else None,
        }

    def describe(self) -> str:
        return f"<= {self.max_length}: {self.plan.describe()}"


@dataclass(frozen=True)
class PlanTable:
    """Buckets by batch length, ascending; the last is the longest batch's (the search's plan)."""

    buckets: tuple[Bucket, ...]
    rows: int  # the batch rows every bucket was profiled at

    def bucket_for(self, length: int) -> int | None:
        """The index of the bucket a batch of ``length`` runs in; None when it is longer than the table covers."""
        for i, b in enumerate(self.buckets):
            if length <= b.max_length:
                return i
        return None

    @property
    def longest(self) -> int:
        return self.buckets[-1].max_length

    def with_plan(self, index: int, plan: Plan, source: str) -> PlanTable:
        """The table with bucket ``index`` running ``plan`` (the guard moved it to a lower-memory plan)."""
        new = replace(self.buckets[index], plan=plan, source=source)
        return replace(self, buckets=(*self.buckets[:index], new, *self.buckets[index + 1 :]))

    def with_top(self, plan: Plan) -> PlanTable:
        """The table whose top bucket runs ``plan`` (a guard's switch above every bucket)."""
        return self.with_plan(len(self.buckets) - 1, plan, "guard")

    def describe(self) -> str:
        return "; ".join(b.describe() for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        return {"key": "length", "rows": self.rows, "buckets": [b.to_dict() for b in self.buckets]}

    @classmethod
    def of_plan(cls, plan: Plan, *, source: str = "the plan") -> PlanTable | None:
        """The table ``plan`` keeps in its metadata (the top bucket runs ``plan`` itself), None when it keeps none;
        ``PlanError`` naming the field when it is malformed."""
        data = plan.metadata.get(TABLE_KEY)
        if data is None:
            return None
        where = f"{source}'s metadata['{TABLE_KEY}']"
        try:
            if not isinstance(data, Mapping) or data.get("key") != "length":
                raise TypeError("expected an object with key 'length'")
            rows = data["rows"]
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
                raise ValueError(f"rows must be an integer >= 0, got {rows!r}")
            buckets = []
            for i, row in enumerate(data["buckets"]):
                length = row["max_length"]
                if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                    raise ValueError(f"buckets[{i}].max_length must be an integer >= 1, got {length!r}")
                body = {**row["plan"], "fingerprint": plan.fingerprint}
                bucket_plan = Plan.from_dict(body, source=f"{where}.buckets[{i}].plan")
                profile = row.get("profile")
                buckets.append(
                    Bucket(
                        max_length=length,
                        plan=bucket_plan,
                        source=str(row.get("source", "predicted")),
                        predicted_peak_bytes=_optional_int(row.get("predicted_peak_bytes")),
                        predicted_activation_bytes=_optional_int(row.get("predicted_activation_bytes")),
                        predicted_seconds=_optional_float(row.get("predicted_seconds")),
                        profile=profile if isinstance(profile, Mapping) else None,
                    )
                )
        except (KeyError, TypeError, ValueError) as err:
            raise PlanError(
                f"{where} is malformed ({type(err).__name__}: {err}); re-tune to write a new one."
            ) from None
        lengths = [b.max_length for b in buckets]
        if not buckets or lengths != sorted(set(lengths)):
            raise PlanError(f"{where} needs buckets in ascending, distinct max_length order, found {lengths}.")
        if buckets[-1].plan.key() != plan.key():
            raise PlanError(
                f"{where}'s top bucket runs {buckets[-1].plan.describe()}, not the plan itself ({plan.describe()}): "
                "the file was edited by hand. Re-tune to write a consistent one."
            )
        return cls(tuple(buckets), rows)


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
        buckets.append(_chosen(length, profile.memory, time, searched, budget, rows, top))
    return PlanTable((*buckets, top_bucket), rows)


def _chosen(
    length: int,
    memory_model: MemoryModel,
    time: TimeModel,
    searched: SavedProfile,
    budget: Budget,
    rows: int,
    top: Plan,
) -> Bucket:
    """The bucket at ``length``: the search's rule over every plan's predicted figures there; the top plan (which
    fits at the longest length, so at this one) when nothing is predicted to fit."""
    memory = RealStepMemory(memory_model, searched.optimizer)
    records = predicted_records(searched, memory, time, budget, device=memory_model.device, batch=rows,
                                model=memory_model)  # fmt: skip
    best = choose_best(records, budget, tie_tolerance=searched.tie_tolerance)
    profile = {"memory": memory_model.to_dict(), "time": time.to_dict()}
    if best is None:
        return Bucket(length, top, "search", profile=profile)
    plan = replace(best.plan, name=f"bucket <= {length}", fingerprint=top.fingerprint, metadata={})
    return Bucket(
        length,
        plan,
        "predicted",
        predicted_peak_bytes=best.peak_bytes,
        predicted_activation_bytes=best.activation_bytes,
        predicted_seconds=best.median_seconds,
        profile=profile,
    )


def table_line(table: PlanTable, budget: Budget | None) -> str:
    """One line for people: each bucket's plan and predicted memory (the budget's kind, when it is known)."""
    parts = []
    for b in table.buckets:
        if budget is not None:
            value = budget.value_of(b.predicted_peak_bytes, b.predicted_activation_bytes)
        else:
            value = b.predicted_peak_bytes
        figure = f", {format_bytes(value)}" if value is not None else ""
        parts.append(f"<= {b.max_length}: {b.plan.describe()} ({b.source}{figure})")
    return f"plan table by length, {len(table.buckets)} buckets: " + "; ".join(parts)


def _measured(plan: Plan, key: str) -> Any:
    measured = plan.metadata.get("measured")
    return measured.get(key) if isinstance(measured, Mapping) else None


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a byte count (an integer >= 0) or null, got {value!r}")
    return value


def _optional_float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"expected seconds (a number >= 0) or null, got {value!r}")
    return float(value)
