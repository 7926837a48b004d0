"""Predict a plan's step time without running it, from each block's modes timed alone (``memory.block_times``):
step(plan) = base + sum over blocks of max(0, seconds[mode] - seconds["none"]) where a segment's blocks (all but the
last chunk's) pay their ``full`` cost. ``base`` is the median of the measured steps less what their plans add
(``calibrated``). The added seconds are not rescaled: a slope fitted to a handful of steps timed minutes apart would fit
the machine's drift rather than the blocks."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_ckpt.plan.chunks import segment_chunks
from lightning_ckpt.plan.format import Plan, mode_key

__all__ = ["WELL_PREDICTED_ERROR", "BlockTime", "Calibration", "TimeModel", "Transfer"]

# The median relative error the model reaches on a steady machine; past it the search widens its pruning margin
# and a re-plan warns that its predicted speeds may rank plans wrongly.
WELL_PREDICTED_ERROR = 0.08


@dataclass(frozen=True)
class BlockTime:
    """One block call: the median seconds of its forward+backward alone, per mode key (``mode_key``)."""

    fqn: str
    seconds: Mapping[str, float]  # and ``forward``: the forward alone under ``none``
    shared_with: str | None = None  # the identical block whose timing this row reuses
    offloaded_bytes: Mapping[str, int] = field(default_factory=dict)  # offloading mode key -> bytes it moves


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
class Transfer:
    """A plan's offload in one step: bytes each way, their time on the link, the part backward waits for, and the
    recompute that checkpointing its ``offload`` blocks instead would cost."""

    bytes: int
    link_seconds: float
    exposed_seconds: float
    recompute_seconds: float


@dataclass(frozen=True)
class TimeModel:
    """Step time of any plan for one model, batch and machine (see the module docstring). blocks: one row per block
    call, in execution order. measured_at: what the timings depend on (device, batch, autocast, threads, torch, the host
    ``link``). calibration: None until a plan was measured."""

    blocks: tuple[BlockTime, ...]
    stacks: Mapping[str, tuple[str, ...]]
    measured_at: Mapping[str, Any] = field(default_factory=dict)
    calibration: Calibration | None = None

    def added_seconds(self, plan: Plan) -> float | None:
        """What ``plan``'s modes add to a step; None when a block was not timed under its mode, or for a PT2 memory
        budget (measured, not predicted). Offloaded blocks add the transfer backward waits for, where measured."""
        keys = self._keys(plan)
        if keys is None:
            return None
        moves = self.transfer(plan)
        total = moves.exposed_seconds if moves is not None else 0.0
        for row, key in zip(self.blocks, keys, strict=True):
            if key is not None and moves is not None and key.startswith("offload"):
                key = "full" if key == "offload_input" else None
            added = _added(row, key) if key is not None else 0.0
            if added is None:
                return None
            total += added
        return total

    def transfer(self, plan: Plan) -> Transfer | None:
        """What ``plan``'s offloaded blocks move over the host link (``measured_at["link"]``, bytes/s each way), and
        what of it backward waits for, replaying the step as the pool runs it: copies out queue behind each forward,
        and a block comes back when backward reaches the offloaded block after it. None without the figures."""
        keys, link = self._keys(plan), self.measured_at.get("link")
        offloaded = [i for i, k in enumerate(keys or ()) if k is not None and k.startswith("offload")]
        if keys is None or not offloaded or not link:
            return None
        forward, backward = [], []
        for row, key in zip(self.blocks, keys, strict=True):
            own = row.seconds.get("forward")
            extra = _added(row, "full" if key == "offload_input" else key) if key not in (None, "offload") else 0.0
            if own is None or extra is None or "none" not in row.seconds:
                return None
            forward.append(own)
            backward.append(max(0.0, row.seconds["none"] - own) + extra)
        moved = {i: self.blocks[i].offloaded_bytes.get(keys[i], 0) for i in offloaded}
        clock = copied = 0.0
        for i, seconds in enumerate(forward):
            clock += seconds
            if i in moved:
                copied = max(copied, clock) + moved[i] / link["to_host"]
        fetching, ready, exposed = copied, {}, 0.0
        before = dict(zip(offloaded[1:], offloaded[:-1], strict=True))
        for i in reversed(range(len(self.blocks))):
            if i in moved:
                back = ready.pop(i, max(clock, copied) + moved[i] / link["to_device"])
                exposed += max(0.0, back - clock)
                clock = max(clock, back)
                if i in before:
                    fetching = max(clock, fetching) + moved[before[i]] / link["to_device"]
                    ready[before[i]] = fetching
            clock += backward[i]
        recompute = sum(_added(self.blocks[i], "full") or 0.0 for i in offloaded if keys[i] == "offload")
        total = sum(moved.values())
        seconds = total / link["to_host"] + total / link["to_device"]
        return Transfer(total, seconds, exposed, recompute)

    def _keys(self, plan: Plan) -> list[str | None] | None:
        """Each row's mode key under ``plan`` (None: none; a segment's blocks but the last chunk's: ``full``); None for
        a PT2 memory budget or segments the stacks cannot have."""
        if plan.compile_memory_budget is not None:
            return None
        chunked: set[str] = set()
        for stack_fqn, n_chunks in plan.segments.items():
            fqns = self.stacks.get(stack_fqn)
            if fqns is None or n_chunks > len(fqns):
                return None
            for start, end in segment_chunks(len(fqns), n_chunks)[:-1]:
                chunked.update(fqns[start:end])
        modes = {fqn: mode_key(bp) for fqn, bp in plan.blocks.items()}
        return ["full" if row.fqn in chunked else modes.get(row.fqn) for row in self.blocks]

    def predict_seconds(self, plan: Plan) -> float | None:
        """``plan``'s predicted step seconds; None before calibration or when ``added_seconds`` is None. A plain step
        fitted at or below zero is taken as the blocks' own sum, or every plan would tie at the clamp."""
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
        # The median is robust to one slow step.
        base = statistics.median(m - a for _, a, m in points)
        return replace(self, calibration=Calibration(base_seconds=base, anchors=tuple(points)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``from_dict`` reads it back): rows shared with another keep only its name."""
        rows = []
        for b in self.blocks:
            row: dict[str, Any] = {"fqn": b.fqn}
            if b.shared_with is not None:
                row["shared_with"] = b.shared_with
            if b.shared_with is None or b.fqn == b.shared_with:
                row["seconds"] = dict(b.seconds)
            if b.offloaded_bytes:
                row["offloaded_bytes"] = dict(b.offloaded_bytes)
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
            blocks.append(
                BlockTime(r["fqn"], timed.get(source, {}), r.get("shared_with"), r.get("offloaded_bytes", {}))
            )
        calibration = Calibration.from_dict(data["calibration"]) if data.get("calibration") else None
        stacks = {k: tuple(v) for k, v in data["stacks"].items()}
        return cls(tuple(blocks), stacks, dict(data.get("measured_at", {})), calibration)


def _added(row: BlockTime, key: str) -> float | None:
    """Seconds ``key`` adds to the block's forward+backward; child sets timed only one by one add up. Never below
    zero: recomputing never makes a step faster."""
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
