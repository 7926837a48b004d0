"""lightning_ckpt: automatic activation checkpointing for PyTorch Lightning.

The core (discovery, plans, apply) works on any ``nn.Module``; the Lightning callback builds on it.
"""

# First: a torch outside the tested range gets one warning (never a refusal) before any module touches its internals.
from lightning_ckpt import versions  # noqa: F401
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
from lightning_ckpt.model import ModelView, model_fingerprint
from lightning_ckpt.plan.apply import apply_plan, plan_applied
from lightning_ckpt.plan.baselines import BASELINE_NAMES, baselines
from lightning_ckpt.plan.foreign import existing_checkpointing
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.plan.handle import PlanHandle, applied_plan, plan_handle
from lightning_ckpt.plan.policies import SAVE_LISTS
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.tune import TuneResult, tune

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The callback imports Lightning; load it on first use so the core stays importable (and fast)
    # for users who only apply plans.
    if name == "ActivationCheckpointTuner":
        from lightning_ckpt.lightning.callback import ActivationCheckpointTuner

        return ActivationCheckpointTuner
    if name == "GuardConfig":
        from lightning_ckpt.lightning.guard import GuardConfig

        return GuardConfig
    raise AttributeError(f"module 'lightning_ckpt' has no attribute {name!r}")


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
