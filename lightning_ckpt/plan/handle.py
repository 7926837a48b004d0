"""The handle of an applied plan: which plan a model has, and the means to undo it exactly."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_ckpt.discovery import unwrap_compiled
from lightning_ckpt.plan.chain import StackWatch
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.forwards import CHILD_GUARD, PREV_FORWARD

__all__ = [
    "ACTIVE",
    "HANDLE_ATTR",
    "Patch",
    "PlanHandle",
    "applied_plan",
    "installed_by",
    "plan_attributes",
    "plan_handle",
    "set_compile_memory_budget",
]

HANDLE_ATTR = "_lightning_ckpt_plan_handle"


def plan_attributes() -> frozenset[str]:
    """The instance attributes an applied plan puts on modules: not the user's state, which snapshots leave out."""
    return frozenset({"forward", PREV_FORWARD, HANDLE_ATTR, CHILD_GUARD})


ACTIVE: weakref.WeakKeyDictionary[nn.Module, PlanHandle] = weakref.WeakKeyDictionary()


@dataclass
class Patch:
    module: nn.Module
    forward: Any  # a ``functools.partial``, or a child's bound method (``forwards.child_forward``)


class PlanHandle:
    """What ``apply_plan`` returns: the applied plan and the means to undo it exactly.

    A copy of a planned model (deepcopy, pickle, ``torch.save``) carries a handle of its own, bound to the copy's
    modules (``plan_handle(copy).remove()``); the compile memory budget stays with the original's.
    """

    def __init__(
        self,
        model: nn.Module | None,
        plan: Plan,
        patches: list[Patch],
        previous_budget: float | None = None,
        watches: Sequence[StackWatch] = (),
        *,
        offload_pool: Any = None,
    ) -> None:
        self.plan = plan
        self.offload_pool = offload_pool  # ``plan.offload.OffloadPool``: its memory goes back with the plan
        # None only for a handle pickled without its model (it is then removed already).
        self._model_ref: Callable[[], nn.Module | None] = weakref.ref(model) if model is not None else lambda: None
        self._patches = patches
        self._previous_budget = previous_budget  # the compile memory budget to restore (plan sets one)
        self._watches = list(watches)
        self._removed = False

    @property
    def deviations(self) -> dict[str, str]:
        """Stack FQN -> why its segments could not run as planned in some step since the plan was applied
        (the first reason seen). Those steps were exact, with the memory of running the blocks plainly."""
        return {w.stack_fqn: w.reason for w in self._watches if w.reason is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied as part of its model: the copy's handle points at the copy's modules, and registers itself.
        return (_restore_handle, (self._model_ref(), self.plan, self._patches, self._watches, self._removed))

    @property
    def active(self) -> bool:
        return not self._removed

    @property
    def num_patched_modules(self) -> int:
        return len(self._patches)

    def remove(self) -> None:
        """Restore every module's original forward; idempotent."""
        if self._removed:
            return
        for p in reversed(self._patches):
            d = p.module.__dict__
            if d.get("forward") is p.forward:
                del d["forward"]
            d.pop(CHILD_GUARD, None)
            prev = d.pop(PREV_FORWARD, None)
            if prev is not None:
                d["forward"] = prev
        if self._previous_budget is not None:
            set_compile_memory_budget(self._previous_budget)
        if self.offload_pool is not None:
            self.offload_pool.release()
        self._removed = True
        model = self._model_ref()
        if model is not None and ACTIVE.get(model) is self:
            del ACTIVE[model]
        if model is not None and model.__dict__.get(HANDLE_ATTR) is self:
            del model.__dict__[HANDLE_ATTR]

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"PlanHandle({self.plan.describe()}, {len(self._patches)} modules, {state})"


def set_compile_memory_budget(value: float) -> float:
    """Set PT2's activation memory budget (read by the partitioner at compile time); return the old value."""
    import torch._functorch.config as functorch_config

    previous = float(functorch_config.activation_memory_budget)
    functorch_config.activation_memory_budget = value
    return previous


def _restore_handle(
    model: nn.Module | None, plan: Plan, patches: list[Patch], watches: list[StackWatch], removed: bool
) -> PlanHandle:
    """A copied or unpickled model's handle (see ``PlanHandle.__reduce__``), registered for that model."""
    handle = PlanHandle(model, plan, patches, None, watches)
    handle._removed = removed or model is None
    if model is not None and not handle._removed:
        ACTIVE[model] = handle
    return handle


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan currently applied to ``model`` by ``apply_plan`` (or carried by a copy of a planned model), if any."""
    handle = plan_handle(model)
    return handle.plan if handle is not None else None


def plan_handle(model: nn.Module) -> PlanHandle | None:
    """The active ``PlanHandle`` of ``model`` (``apply_plan``'s, or a copy's), to remove a plan without its handle."""
    handle = ACTIVE.get(unwrap_compiled(model))
    return handle if handle is not None and handle.active else None


def installed_by(module: nn.Module) -> str:
    """Which applied plan patched ``module``, for an error message."""
    for root, handle in list(ACTIVE.items()):
        if handle.active and any(p.module is module for p in handle._patches):
            return f"a plan applied to a {type(root).__name__} ({handle.plan.describe()})"
    return (
        "a plan applied to a model it was copied from (a copy of part of a planned model carries its "
        "checkpointing but no handle: copy the whole model, or copy before applying the plan)"
    )
