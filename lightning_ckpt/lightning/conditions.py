"""The conditions a plan was tuned for, and what changed since: a plan is reused only where it was measured.

A plan file is a cache of a measurement. The fastest plan that fits at micro-batch 8 in bf16 on an
80 GB card is not the one that fits at micro-batch 16 in fp32 on a 40 GB card, so everything that
moves the measurement is recorded with the plan and compared before reuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lightning_ckpt.budget import format_bytes

__all__ = ["RunConditions"]

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
        """Human-readable differences from ``saved`` (a plan's ``metadata["conditions"]``); empty if it
        matches. Conditions the saved plan does not record (older files) are not compared."""
        if not saved:
            return []
        changes = []
        for key, label in _LABELS.items():
            if key in _BATCH and not include_batch:
                continue
            if key not in saved or saved[key] is None:
                continue
            mine = getattr(self, key)
            if mine != saved[key]:
                fmt = format_bytes if key == "device_capacity_bytes" else repr
                changes.append(
                    f"{label}: tuned for {fmt(saved[key])}, this run has {fmt(mine) if mine is not None else 'none'}"
                )
        return changes
