"""The plan applied to the model during a fit (removed when the fit ends or fails: the model leaves ``fit`` as the user
gave it), and the check of a re-planned one: it ran zero trials, so its figures are predictions, put beside the first
real steps' in one line and kept in the plan's ``provenance.replanned["first_measured"]``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_ckpt.errors import ApplyError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.lightning.ranks import StrategySync
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.caches import disable_kv_cache
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.handle import PlanHandle
from lightning_ckpt.search.compile import KeptGraphs, reset_compiled

__all__ = ["AppliedPlan", "ReplanCheck"]


class AppliedPlan:
    """At most one plan applied to one model at a time, with the HF KV cache turned off while it is."""

    def __init__(self) -> None:
        self._handle: PlanHandle | None = None
        self._restore_cache: Any = None
        self._forwards: dict[Any, Any] = {}  # what plans installed while graphs are kept (``keep_graphs``)
        self._keeping = False  # graphs are kept since the last fresh start
        self._kept = KeptGraphs()  # the graphs of the table's plans

    def apply(self, view: ModelView, plan: Plan, trainer: pl.Trainer, *, keep_graphs: bool = False) -> None:
        """Apply ``plan`` in place of the one applied now; every rank must have applied the same plan.

        A compiled model compiles the plan afresh. ``keep_graphs`` (a compiled plan table switching between its
        buckets' plans): a plan applied again gets the forwards it had the first time, so dynamo reuses its graph and
        a switch compiles only on a plan's first step."""
        self.remove_plan()
        if self._restore_cache is None:
            self._restore_cache = disable_kv_cache(view.root)  # training forwards never need HF's KV cache
        if view.compiled and keep_graphs:
            if not self._keeping:
                reset_compiled()
                self._keeping = True
            key = (id(self), plan.key())
            self._handle = self._kept.apply_reusing(view, plan, self._forwards, key)
            self._kept.keys.add(key)
        else:
            self._forwards.clear()
            self._keeping = False
            self._handle = apply_plan(view, plan)
            if view.compiled:
                reset_compiled()
        if trainer.world_size > 1:
            digests = StrategySync(trainer.strategy).all_gather(plan.digest())
            if len(set(digests)) != 1:
                self.remove_plan()
                raise ApplyError(
                    f"Ranks applied different checkpointing plans (digests by rank: {digests}). Every rank must "
                    "train with the same plan; check that all ranks read the same plan file."
                )

    def remove_plan(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def remove(self) -> None:
        """The model as the user gave it: no plan, the HF cache setting back. The graphs a plan table kept stay with
        dynamo (a reset here would make the user's validation compile the plain model again)."""
        self.remove_plan()
        self._forwards.clear()
        self._keeping = False
        if self._restore_cache is not None:
            self._restore_cache()
            self._restore_cache = None


@dataclass
class ReplanCheck:
    """The predicted figures of a re-planned plan and the first measured ones, filled in as the fit goes."""

    predicted: Mapping[str, Any]
    device: torch.device
    peak_bytes: int | None = None
    activation_bytes: int | None = None
    seconds: float | None = None
    _started: float | None = field(default=None, repr=False)

    @classmethod
    def of(cls, plan: Plan, device: torch.device) -> ReplanCheck | None:
        predicted = plan.provenance.replanned
        return cls(dict(predicted), device) if predicted else None

    def memory_read(self, peak_bytes: int, activation_bytes: int | None) -> None:
        """The most of the guard's readings is kept: the prediction is for a step that holds the optimizer's state,
        which the first step does not yet."""
        self.peak_bytes = max(self.peak_bytes or 0, peak_bytes)
        if activation_bytes is not None:
            self.activation_bytes = max(self.activation_bytes or 0, activation_bytes)

    def step_starts(self, guard_reads_it: bool) -> None:
        """A batch starts: time it unless the guard reads it (its tracker slows the step) or one was timed."""
        if self.seconds is None and not guard_reads_it:
            self._sync()
            self._started = time.perf_counter()

    def closure_ends(self) -> None:
        """Forward and backward of the timed step are over (the optimizer's update is not in a trial's time)."""
        if self._started is not None and self.seconds is None:
            self._sync()
            self.seconds = time.perf_counter() - self._started
            self._started = None

    def line(self) -> str:
        p = self.predicted
        seconds = p.get("predicted_seconds")
        measured_ms = f"{1000 * self.seconds:.1f} ms" if self.seconds is not None else "not timed"
        predicted_ms = f"{1000 * seconds:.1f} ms" if seconds else "unknown"
        act = ""
        if self.activation_bytes is not None:
            act = (
                f", activations {format_bytes(p.get('predicted_activation_bytes'))} predicted / "
                f"{format_bytes(self.activation_bytes)} measured"
            )
        return (
            f"lightning_ckpt: re-planned plan (predicted from the saved profile, 0 trials) vs its first real steps: "
            f"peak {format_bytes(p.get('predicted_peak_bytes'))} predicted / {format_bytes(self.peak_bytes)} "
            f"measured{act}; forward+backward {predicted_ms} predicted / {measured_ms} measured"
        )

    def report(self, plan: Plan) -> Plan:
        """Log the side-by-side line once and return ``plan`` with the measured figures in its provenance."""
        rank_zero_info(self.line())
        first = {"peak_bytes": self.peak_bytes, "activation_bytes": self.activation_bytes, "seconds": self.seconds}
        return plan.with_provenance(replanned={**self.predicted, "first_measured": first})

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
