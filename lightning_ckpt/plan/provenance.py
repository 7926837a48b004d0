"""What a plan file records beyond the plan: one typed object, ``Plan.provenance``, the only reader of
``Plan.metadata``'s sections. A section of the wrong JSON type (a hand edit) reads as absent and is kept in ``other``,
so no reader checks types again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

__all__ = ["MicroBatch", "Provenance"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _section() -> Any:
    return field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch a joint search chose: ``size`` x ``accumulation`` = ``global_batch`` samples per optimizer
    step, where the user's loader gave ``original_size``."""

    size: int
    accumulation: int
    global_batch: int
    original_size: int
    tie_tolerance: float | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MicroBatch:
        size, accumulation = int(data["size"]), int(data["accumulation"])
        tolerance = None if data.get("tie_tolerance") is None else float(data["tie_tolerance"])
        global_batch, original = int(data.get("global", size * accumulation)), int(data.get("original_size", size))
        return cls(size, accumulation, global_batch, original, tolerance)

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "accumulation": self.accumulation,
            "global": self.global_batch,
            "original_size": self.original_size,
            "tie_tolerance": self.tie_tolerance,
        }


@dataclass(frozen=True)
class Provenance:
    """The sections of a plan file's ``metadata``, each named after its key there. A section is an empty mapping
    (or ``None``/``()``) where the file has none."""

    versions: Mapping[str, Any] = _section()  # library versions the plan was tuned with
    run: Mapping[str, Any] = _section()  # what the figures depend on: device, batch, compiled regions
    budget: Mapping[str, Any] = _section()  # ``Budget.to_dict()`` plus the callback's ``requested``
    conditions: Mapping[str, Any] = _section()  # the callback's ``RunConditions`` the plan was tuned under
    allocator: Mapping[str, Any] = _section()  # the CUDA allocator's settings the search ran under
    optimizer_step: Mapping[str, Any] = _section()  # the optimizer update's measured memory
    measured: Mapping[str, Any] = _section()  # the chosen plan's figures
    baselines: Mapping[str, Any] = _section()  # name -> the baseline's figures
    search: Mapping[str, Any] = _section()  # the search's evidence: counts, verdict, cost, time model
    profile: Mapping[str, Any] = _section()  # what re-planning predicts from (``search.replan.SavedProfile``)
    compiled_profile: Mapping[str, Any] = _section()  # the same, for a compiled search
    compiled_blocks: Mapping[str, Any] = _section()  # the compiled memory model's blocks
    compiles: Mapping[str, Any] = _section()  # graphs compiled and their seconds
    memory_breakdown: Mapping[str, Any] = _section()  # the memory model, per block
    whole_compile_check: Mapping[str, Any] = _section()  # a PT2 budget checked against the whole model
    plan_table: Mapping[str, Any] = _section()  # one plan per range of batch lengths (``plan.table.PlanTable``)
    replanned: Mapping[str, Any] = _section()  # predicted without a search, and the first steps' figures
    pt2_partitioned_whole: tuple[Mapping[str, Any], ...] = ()  # PT2 budgets the whole model was partitioned at
    real_steps: tuple[Mapping[str, Any], ...] = ()  # the budget guard's checks of the first training steps
    micro_batch: MicroBatch | None = None
    switched_from: str | None = None  # the plan the budget guard replaced with this one
    other: Mapping[str, Any] = _section()  # sections this release does not read, kept as written

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> Provenance:
        """The sections of ``metadata``, each checked for its JSON type (a mistyped one goes to ``other``)."""
        known: dict[str, Any] = {}
        other: dict[str, Any] = {}
        for key, value in metadata.items():
            kind = _KINDS.get(key)
            if kind is None:
                other[key] = value
            elif kind is MicroBatch and isinstance(value, Mapping):
                try:
                    known[key] = MicroBatch.from_dict(value)
                except (KeyError, TypeError, ValueError):
                    other[key] = value
            elif kind is tuple and isinstance(value, (list, tuple)) and all(isinstance(v, Mapping) for v in value):
                known[key] = tuple(MappingProxyType(dict(v)) for v in value)
            elif kind is Mapping and isinstance(value, Mapping):
                known[key] = MappingProxyType(dict(value))
            elif kind is str and isinstance(value, str):
                known[key] = value
            elif value is not None:
                other[key] = value
        return cls(**known, other=MappingProxyType(other))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the metadata it reads: its read-only mappings cannot be."""
        present = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "other"}
        return (Provenance.of, ({**self.other, **Provenance.sections(**{k: v for k, v in present.items() if v})},))

    @staticmethod
    def sections(**sections: Any) -> dict[str, Any]:
        """``sections`` in the file's JSON form, refusing a name that is no section (``None`` removes one)."""
        unknown = sorted(set(sections) - set(_KINDS))
        if unknown:
            raise TypeError(
                f"Plan provenance has no section {', '.join(map(repr, unknown))}; its sections are "
                f"{', '.join(sorted(_KINDS))}. Add a field to lightning_ckpt.plan.provenance.Provenance first."
            )
        return {key: _to_json(value) for key, value in sections.items()}


def _to_json(value: Any) -> Any:
    if isinstance(value, MicroBatch):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _to_json(v) for k, v in value.items()}
    return [_to_json(v) for v in value] if isinstance(value, tuple) else value


def _kind(annotation: str) -> type:
    if annotation.startswith("tuple"):
        return tuple
    if annotation.startswith("MicroBatch"):
        return MicroBatch
    return str if annotation.startswith("str") else Mapping


_KINDS: dict[str, type] = {f.name: _kind(str(f.type)) for f in fields(Provenance) if f.name != "other"}
