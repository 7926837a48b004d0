"""lightning_ckpt: automatic activation checkpointing for PyTorch Lightning.

The core (discovery, plans, apply) works on any ``nn.Module``; the Lightning callback builds on it.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Where each public name lives: what a user needs (the callback and its settings, tune, plans and applying them,
# discovery, the errors a user catches); the rest is imported from its subpackage (``lightning_ckpt.errors``,
# ``lightning_ckpt.model``, ``lightning_ckpt.plan.handle``, ...). The package root imports nothing until a name
# is used (PEP 562), so that ``lightning-ckpt replan`` and ``show`` read a plan file without importing torch; the
# first name used imports ``versions`` first, which warns once about a torch outside the tested range before any module
# touches its internals.
_EXPORTS: dict[str, str] = {
    "discover_blocks": "lightning_ckpt.discovery",
    "ConfigurationError": "lightning_ckpt.errors",
    "LightningCkptError": "lightning_ckpt.errors",
    "LightningCkptWarning": "lightning_ckpt.errors",
    "PlanError": "lightning_ckpt.errors",
    "StalePlanError": "lightning_ckpt.errors",
    "StalePlanWarning": "lightning_ckpt.errors",
    "apply_plan": "lightning_ckpt.plan.apply",
    "plan_applied": "lightning_ckpt.plan.apply",
    "baselines": "lightning_ckpt.plan.baselines",
    "BlockPlan": "lightning_ckpt.plan.format",
    "Plan": "lightning_ckpt.plan.format",
    "applied_plan": "lightning_ckpt.plan.handle",
    "plan_handle": "lightning_ckpt.plan.handle",
    "TuneConfig": "lightning_ckpt.search.config",
    "SearchHooks": "lightning_ckpt.search.pipeline",
    "TuneResult": "lightning_ckpt.search.result",
    "tune": "lightning_ckpt.search.tune",
    # The callback imports Lightning.
    "ActivationCheckpointTuner": "lightning_ckpt.lightning.callback",
    "GuardConfig": "lightning_ckpt.lightning.guard",
}

if TYPE_CHECKING:  # what type checkers, IDEs and the API docs read; at run time __getattr__ imports them
    from lightning_ckpt.discovery import discover_blocks
    from lightning_ckpt.errors import (
        ConfigurationError,
        LightningCkptError,
        LightningCkptWarning,
        PlanError,
        StalePlanError,
        StalePlanWarning,
    )
    from lightning_ckpt.lightning.callback import ActivationCheckpointTuner
    from lightning_ckpt.lightning.guard import GuardConfig
    from lightning_ckpt.plan.apply import apply_plan, plan_applied
    from lightning_ckpt.plan.baselines import baselines
    from lightning_ckpt.plan.format import BlockPlan, Plan
    from lightning_ckpt.plan.handle import applied_plan, plan_handle
    from lightning_ckpt.search.config import TuneConfig
    from lightning_ckpt.search.pipeline import SearchHooks
    from lightning_ckpt.search.result import TuneResult
    from lightning_ckpt.search.tune import tune


def __getattr__(name: str) -> object:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'lightning_ckpt' has no attribute {name!r}")
    import importlib

    importlib.import_module("lightning_ckpt.versions")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # later uses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "ActivationCheckpointTuner",
    "BlockPlan",
    "ConfigurationError",
    "GuardConfig",
    "LightningCkptError",
    "LightningCkptWarning",
    "Plan",
    "PlanError",
    "StalePlanError",
    "StalePlanWarning",
    "SearchHooks",
    "TuneConfig",
    "TuneResult",
    "__version__",
    "applied_plan",
    "apply_plan",
    "baselines",
    "discover_blocks",
    "plan_applied",
    "plan_handle",
    "tune",
]
