"""Predict a plan's step time without running it: what each block's mode costs, measured alone, on top of a
step time measured on this machine.

The profile (``memory.profile.profile_step``) runs each distinct block alone under every mode, and
``memory.block_times.time_block_modes`` times those runs (forward and backward, under the step's autocast).
Checkpointing changes a step's time by what each block's mode adds to its forward+backward: the
recompute of a checkpointed block or child, the copies of an offloaded one. So a plan's step takes

    step(plan) = base + sum over blocks of max(0, seconds[mode] - seconds["none"])

where a segment's blocks (all but the last chunk's) each pay their ``full`` cost, as ``checkpoint`` of the
chunk recomputes their forwards. ``base`` is fitted to the plans measured so far (``calibrated``): the
median of each measured step less what its plan adds, the plain step itself when the ``none`` plan ran.
The added seconds are not rescaled: they are seconds measured on this machine, and a slope fitted to a
handful of steps timed minutes apart would fit the machine's drift (another job starting, clocks
changing) rather than the blocks. A block alone cannot see everything (a plan that is faster because it
allocates less, an allocator's behaviour); the error the search measured is reported beside each plan.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_ckpt.plan.chunks import segment_chunks
from lightning_ckpt.plan.format import Plan, mode_key

__all__ = ["WELL_PREDICTED_ERROR", "BlockTime", "Calibration", "TimeModel"]

# How far (median relative error of a step's prediction against its measurement) the model predicts on a steady
# machine; more is worth a line: the search's pruning margin follows the error past it, and a re-plan says its
# predicted speeds may rank plans wrongly.
WELL_PREDICTED_ERROR = 0.08


@dataclass(frozen=True)
class BlockTime:
    """One block call: the median seconds of its forward+backward alone, per mode key (``mode_key``)."""

    fqn: str
    seconds: Mapping[str, float]
    shared_with: str | None = None  # the identical block whose timing this row reuses


@dataclass(frozen=True)
class Calibration:
    """The step with nothing added, fitted to measured steps, and the plans it was fitted on."""

    base_seconds: float  # the plain step (no checkpointing), as the measured plans put it
    anchors: tuple[tuple[str, float, float], ...] = ()  # (plan label, added seconds, measured step seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"base_seconds": self.base_seconds, "anchors": [list(a) for a in self.anchors]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        anchors = tuple((str(a[0]), float(a[1]), float(a[2])) for a in data.get("anchors", ()))
        return cls(float(data["base_seconds"]), anchors)


@dataclass(frozen=True)
class TimeModel:
    """Step time of any plan for one model, batch and machine (see the module docstring).

    blocks: one row per block call, in execution order (as ``MemoryModel.blocks``). stacks: stack FQN -> its
    block FQNs. measured_at: what the timings depend on (device, batch size, sequence length, autocast,
    threads, torch). calibration: fitted to measured steps (None until a plan was measured).
    """

    blocks: tuple[BlockTime, ...]
    stacks: Mapping[str, tuple[str, ...]]
    measured_at: Mapping[str, Any] = field(default_factory=dict)
    calibration: Calibration | None = None

    # -- prediction --------------------------------------------------------------------------------
    def added_seconds(self, plan: Plan) -> float | None:
        """What ``plan``'s modes add to a step, by the blocks' own timings; None when a block the plan
        checkpoints was not timed under its mode (it failed there, or the profile has no such mode), and for a
        plan that sets PT2's memory budget (its recompute is the partitioner's choice: measured, not predicted)."""
        if plan.compile_memory_budget is not None:
            return None
        chunked: set[str] = set()
        for stack_fqn, n_chunks in plan.segments.items():
            fqns = self.stacks.get(stack_fqn)
            if fqns is None or n_chunks > len(fqns):
                return None
            for start, end in segment_chunks(len(fqns), n_chunks)[:-1]:
                chunked.update(fqns[start:end])
        total = 0.0
        for row in self.blocks:
            if row.fqn in chunked:
                key = "full"
            else:
                bp = plan.blocks.get(row.fqn)
                if bp is None or bp.mode == "none":
                    continue
                key = mode_key(bp)
            added = _added(row, key)
            if added is None:
                return None
            total += added
        return total

    def predict_seconds(self, plan: Plan) -> float | None:
        """``plan``'s predicted step seconds; None before calibration or when ``added_seconds`` is None.

        A plain step fitted at or below zero is taken as its blocks' own forward and backward: blocks timed in a busy
        moment and steps measured in a quiet one can fit one (a plan file can keep it), and every plan would then be
        predicted at the clamp, the plan with least memory winning every tie. A positive fit is kept even below the
        blocks' sum: a card's step overlaps what the blocks, each synchronized alone, cannot."""
        added = self.added_seconds(plan)
        if added is None or self.calibration is None:
            return None
        base = self.calibration.base_seconds
        return max(1e-9, (base if base > 0 else self.plain_block_seconds()) + added)

    def plain_block_seconds(self) -> float:
        """Every block call's forward+backward under ``none``, as timed alone (what a plain step runs at least)."""
        return sum(row.seconds.get("none", 0.0) for row in self.blocks)

    def calibrated(self, measured: Iterable[tuple[Plan, str, float]]) -> TimeModel:
        """This model fitted to ``measured`` (plan, label, measured step seconds); unchanged without any."""
        points = []
        for plan, label, seconds in measured:
            added = self.added_seconds(plan)
            if added is not None and seconds and seconds > 0:
                points.append((label, added, float(seconds)))
        if not points:
            return self
        return replace(self, calibration=_fit(points))

    # -- the file --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``from_dict`` reads it back): rows shared with another keep only its name."""
        rows = []
        for b in self.blocks:
            row: dict[str, Any] = {"fqn": b.fqn}
            if b.shared_with is not None:
                row["shared_with"] = b.shared_with
            if b.shared_with is None or b.fqn == b.shared_with:
                row["seconds"] = dict(b.seconds)
            rows.append(row)
        return {
            "blocks": rows,
            "stacks": {k: list(v) for k, v in self.stacks.items()},
            "measured_at": dict(self.measured_at),
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimeModel:
        timed = {r["fqn"]: dict(r["seconds"]) for r in data["blocks"] if "seconds" in r}
        blocks = []
        for r in data["blocks"]:
            source = r.get("shared_with") if "seconds" not in r else r["fqn"]
            blocks.append(BlockTime(r["fqn"], timed.get(source, {}), r.get("shared_with")))
        calibration = data.get("calibration")
        return cls(
            blocks=tuple(blocks),
            stacks={k: tuple(v) for k, v in data["stacks"].items()},
            measured_at=dict(data.get("measured_at", {})),
            calibration=Calibration.from_dict(calibration) if calibration else None,
        )


def _added(row: BlockTime, key: str) -> float | None:
    """Seconds ``key`` adds to the block's forward+backward, never below zero; child sets timed only one by one add
    up.

    Recomputing a forward, or copying saved tensors to the host, never makes a step faster, so a mode timed below
    ``none`` (two timings of a few milliseconds taken at different moments of a busy machine) adds nothing: taken as
    it came, it once put recomputing attention at -1.35 s, and a checkpointed plan predicted 1.6x faster than the
    plain step it runs on top of (issue #64)."""
    none = row.seconds.get("none")
    if none is None:
        return None
    seconds = row.seconds.get(key)
    if seconds is not None:
        return max(0.0, seconds - none)
    if key.startswith("selective:") and "," in key:
        parts = [row.seconds.get(f"selective:{c}") for c in key.partition(":")[2].split(",")]
        if all(p is not None for p in parts):
            return sum(max(0.0, p - none) for p in parts if p is not None)
    return None


def _fit(points: Sequence[tuple[str, float, float]]) -> Calibration:
    """The plain step as the median of the measured steps less what each plan adds (robust to one slow step)."""
    return Calibration(base_seconds=statistics.median(m - a for _, a, m in points), anchors=tuple(points))
