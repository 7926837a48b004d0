"""The plan applied to the model during a fit: applied before the step that uses it, swapped by the guard,
removed when the fit ends or fails (the model leaves ``fit`` as the user gave it), and the same on every rank."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_ckpt.errors import ApplyError
from lightning_ckpt.lightning.sync import StrategySync
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.caches import disable_kv_cache
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.handle import PlanHandle
from lightning_ckpt.search.compile import apply_reusing_graphs, count_kept, reset_compiled

__all__ = ["AppliedPlan"]


class AppliedPlan:
    """At most one plan applied to one model at a time, with the HF KV cache turned off while it is."""

    def __init__(self) -> None:
        self._handle: PlanHandle | None = None
        self._restore_cache: Any = None
        self._forwards: dict[Any, Any] = {}  # what plans installed while graphs are kept (``keep_graphs``)
        self._keeping = False  # graphs are kept since the last fresh start

    def apply(self, view: ModelView, plan: Plan, trainer: pl.Trainer, *, keep_graphs: bool = False) -> None:
        """Apply ``plan`` in place of the one applied now; every rank must have applied the same plan.

        A compiled model compiles the plan afresh (no stale graphs, no recompiles counted: ``search.compile``).
        ``keep_graphs`` (a compiled plan table switching between its buckets' plans): every plan applied again gets
        the forwards it had the first time, so dynamo runs the graph compiled for it then: a switch compiles only
        on a plan's first step. Only the first such apply starts afresh."""
        self.remove_plan()
        if self._restore_cache is None:
            self._restore_cache = disable_kv_cache(view.root)  # training forwards never need HF's KV cache
        if view.compiled and keep_graphs:
            if not self._keeping:
                reset_compiled()
                self._keeping = True
            key = (id(self), plan.key())
            self._handle = apply_reusing_graphs(view, plan, self._forwards, key)
            count_kept(key)
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
        dynamo, as any fit's compiled graphs do (their guards fail without the plan's forwards; a reset here would
        make the user's validation compile the plain model again); a later plan starts afresh."""
        self.remove_plan()
        self._forwards.clear()
        self._keeping = False
        if self._restore_cache is not None:
            self._restore_cache()
            self._restore_cache = None
