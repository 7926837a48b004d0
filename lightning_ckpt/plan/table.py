"""A plan table as data: one plan per range of batch lengths, as the plan file keeps it (``provenance.plan_table``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import ConfigurationError, PlanError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.plan.format import Plan

__all__ = ["MAX_BUCKETS", "Bucket", "PlanTable", "bucket_edges", "table_line"]

MAX_BUCKETS = 8  # every bucket is a profile before training and a plan to switch to (and, compiled, a graph)


def bucket_edges(shortest: int, longest: int, edges: Sequence[int] | None = None) -> tuple[int, ...]:
    """The buckets' longest lengths, ascending, the last ``longest``: the user's ``edges``, or halving from ``longest``
    while above ``shortest`` (twice as long needs at most four times the activations: no plan pays much more)."""
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
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "plan": {k: v for k, v in self.plan.to_dict().items() if k != "metadata"},
            "profile": dict(self.profile) if self.profile is not None else None,
        }


@dataclass(frozen=True)
class PlanTable:
    """Buckets by batch length, ascending; the last is the longest batch's (the search's plan)."""

    buckets: tuple[Bucket, ...]
    rows: int  # the batch rows every bucket was profiled at

    def bucket_for(self, length: int) -> int | None:
        """The index of the bucket a batch of ``length`` runs in; None when it is longer than the table covers."""
        return next((i for i, b in enumerate(self.buckets) if length <= b.max_length), None)

    @property
    def longest(self) -> int:
        return self.buckets[-1].max_length

    def with_plan(self, index: int, plan: Plan, source: str) -> PlanTable:
        """The table with bucket ``index`` running ``plan`` (the guard moved it to a lower-memory plan)."""
        new = replace(self.buckets[index], plan=plan, source=source)
        return replace(self, buckets=(*self.buckets[:index], new, *self.buckets[index + 1 :]))

    def grown(self, length: int, plan: Plan) -> PlanTable:
        """The table with a new top bucket, batches up to ``length`` running ``plan`` (the guard moved a batch longer
        than every bucket); at ``MAX_BUCKETS`` the old top bucket is stretched instead."""
        new = Bucket(max_length=length, plan=plan, source="guard")
        kept = self.buckets[:-1] if len(self.buckets) >= MAX_BUCKETS else self.buckets
        return replace(self, buckets=(*kept, new))

    def with_top(self, plan: Plan) -> PlanTable:
        """The table whose top bucket runs ``plan`` (a guard's switch above every bucket)."""
        return self.with_plan(len(self.buckets) - 1, plan, "guard")

    def describe(self) -> str:
        return "; ".join(f"<= {b.max_length}: {b.plan.describe()}" for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        return {"key": "length", "rows": self.rows, "buckets": [b.to_dict() for b in self.buckets]}

    @classmethod
    def of_plan(cls, plan: Plan, *, source: str = "the plan") -> PlanTable | None:
        """The table ``plan`` keeps (its top bucket runs ``plan``), or None; ``PlanError`` when it is malformed."""
        data = plan.provenance.plan_table or plan.provenance.other.get("plan_table")
        if not data:
            return None
        where = f"{source}'s metadata['plan_table']"
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
                predicted = [_optional(row.get(name), kind) for name, kind in _PREDICTED]
                profile = row.get("profile") if isinstance(row.get("profile"), Mapping) else None
                buckets.append(Bucket(length, bucket_plan, str(row.get("source", "predicted")), *predicted, profile))
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


def table_line(table: PlanTable, budget: Budget | None) -> str:
    """Each bucket's plan and predicted memory (the budget's kind, when it is known)."""
    parts = []
    for b in table.buckets:
        if budget is not None:
            value = budget.value_of(b.predicted_peak_bytes, b.predicted_activation_bytes)
        else:
            value = b.predicted_peak_bytes
        figure = f", {format_bytes(value)}" if value is not None else ""
        parts.append(f"<= {b.max_length}: {b.plan.describe()} ({b.source}{figure})")
    return f"plan table by length, {len(table.buckets)} buckets: " + "; ".join(parts)


_PREDICTED = (("predicted_peak_bytes", int), ("predicted_activation_bytes", int), ("predicted_seconds", float))


def _optional(value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (``int``: bytes, ``float``: seconds), never negative, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, kind)) or not value >= 0:
        what = "a byte count (an integer >= 0)" if kind is int else "seconds (a number >= 0)"
        raise ValueError(f"expected {what} or null, got {value!r}")
    return kind(value)
