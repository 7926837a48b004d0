"""lightning_ckpt: automatic activation checkpointing for PyTorch Lightning.

The core (discovery, plans, apply) works on any ``nn.Module``; the Lightning callback builds on it.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Where each public name lives. The root imports nothing until a name is used (PEP 562), so ``replan`` and ``show``
# run without torch; the first name used imports ``versions`` first (its warning precedes any torch internals).
_MODULES = {  # module: the names it exports here, space-separated
    "discovery": "discover_blocks",
    "errors": "ConfigurationError LightningCkptError LightningCkptWarning PlanError StalePlanError StalePlanWarning",
    "plan.apply": "apply_plan plan_applied",
    "plan.baselines": "baselines",
    "plan.format": "BlockPlan Plan",
    "plan.handle": "applied_plan plan_handle",
    "search.config": "TuneConfig",
    "search.pipeline": "SearchHooks",
    "search.result": "TuneResult",
    "search.tune": "tune",
    # The callback imports Lightning.
    "lightning.callback": "ActivationCheckpointTuner",
    "lightning.guard": "GuardConfig",
}
_EXPORTS = {name: f"lightning_ckpt.{module}" for module, names in _MODULES.items() for name in names.split()}

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
