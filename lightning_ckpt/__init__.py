"""lightning_ckpt: automatic activation checkpointing for PyTorch Lightning.

The core (discovery, plans, apply) works on any ``nn.Module``; the Lightning callback builds on it.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Where each public name lives. The package root imports nothing until a name is used (PEP 562), so that
# ``lightning-ckpt replan`` and ``show`` read a plan file without importing torch; the first name used
# imports ``versions`` first, which warns once about a torch outside the tested range before any module
# touches its internals.
_EXPORTS: dict[str, str] = {
    "Block": "lightning_ckpt.discovery",
    "LayerStack": "lightning_ckpt.discovery",
    "discover_blocks": "lightning_ckpt.discovery",
    "ApplyError": "lightning_ckpt.errors",
    "ConfigurationError": "lightning_ckpt.errors",
    "DiscoveryError": "lightning_ckpt.errors",
    "LightningCkptError": "lightning_ckpt.errors",
    "PlanError": "lightning_ckpt.errors",
    "PlanFileChangedError": "lightning_ckpt.errors",
    "StalePlanError": "lightning_ckpt.errors",
    "UnsupportedVersionError": "lightning_ckpt.errors",
    "ModelView": "lightning_ckpt.model",
    "model_fingerprint": "lightning_ckpt.model",
    "apply_plan": "lightning_ckpt.plan.apply",
    "plan_applied": "lightning_ckpt.plan.apply",
    "BASELINE_NAMES": "lightning_ckpt.plan.baselines",
    "baselines": "lightning_ckpt.plan.baselines",
    "existing_checkpointing": "lightning_ckpt.plan.foreign",
    "BlockPlan": "lightning_ckpt.plan.format",
    "Plan": "lightning_ckpt.plan.format",
    "PlanHandle": "lightning_ckpt.plan.handle",
    "applied_plan": "lightning_ckpt.plan.handle",
    "plan_handle": "lightning_ckpt.plan.handle",
    "SAVE_LISTS": "lightning_ckpt.plan.policies",
    "TuneConfig": "lightning_ckpt.search.config",
    "TuneResult": "lightning_ckpt.search.tune",
    "tune": "lightning_ckpt.search.tune",
    # The callback imports Lightning.
    "ActivationCheckpointTuner": "lightning_ckpt.lightning.callback",
    "GuardConfig": "lightning_ckpt.lightning.guard",
}

if TYPE_CHECKING:  # what type checkers, IDEs and the API docs read; at run time __getattr__ imports them
    from lightning_ckpt.discovery import Block, LayerStack, discover_blocks
    from lightning_ckpt.errors import (
        ApplyError,
        ConfigurationError,
        DiscoveryError,
        LightningCkptError,
        PlanError,
        PlanFileChangedError,
        StalePlanError,
        UnsupportedVersionError,
    )
    from lightning_ckpt.lightning.callback import ActivationCheckpointTuner
    from lightning_ckpt.lightning.guard import GuardConfig
    from lightning_ckpt.model import ModelView, model_fingerprint
    from lightning_ckpt.plan.apply import apply_plan, plan_applied
    from lightning_ckpt.plan.baselines import BASELINE_NAMES, baselines
    from lightning_ckpt.plan.foreign import existing_checkpointing
    from lightning_ckpt.plan.format import BlockPlan, Plan
    from lightning_ckpt.plan.handle import PlanHandle, applied_plan, plan_handle
    from lightning_ckpt.plan.policies import SAVE_LISTS
    from lightning_ckpt.search.config import TuneConfig
    from lightning_ckpt.search.tune import TuneResult, tune


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
    "BASELINE_NAMES",
    "ActivationCheckpointTuner",
    "GuardConfig",
    "TuneConfig",
    "TuneResult",
    "tune",
    "SAVE_LISTS",
    "ApplyError",
    "Block",
    "BlockPlan",
    "ConfigurationError",
    "DiscoveryError",
    "LayerStack",
    "LightningCkptError",
    "ModelView",
    "Plan",
    "PlanError",
    "PlanHandle",
    "PlanFileChangedError",
    "StalePlanError",
    "UnsupportedVersionError",
    "__version__",
    "applied_plan",
    "apply_plan",
    "baselines",
    "discover_blocks",
    "existing_checkpointing",
    "model_fingerprint",
    "plan_applied",
    "plan_handle",
]
