"""What the callback refuses, and the arguments it turns into configs: checked at construction (values) and at
fit start (the model and the Trainer), each refusal naming the fix, so nothing fails mid-fit."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.plan.foreign import existing_checkpointing
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.config import TuneConfig

__all__ = [
    "check_buckets",
    "check_reuse_arguments",
    "check_strategy",
    "check_tunable",
    "check_types",
    "refuse_existing_checkpointing",
    "search_config",
]


def check_buckets(buckets: Any, max_shape: Any) -> tuple[int, ...] | None:
    """``guard.buckets`` checked: True/False, or bucket edges (lengths) below ``max_shape``'s; the edges, or None."""
    if isinstance(buckets, bool):
        return None
    ok = isinstance(buckets, (list, tuple)) and bool(buckets)
    ok = ok and all(isinstance(e, int) and not isinstance(e, bool) and e > 0 for e in buckets)
    if not ok:
        raise ConfigurationError(
            "buckets must be True (halving from max_shape's length), False (one plan for every length) or a list "
            f"of lengths (bucket edges, e.g. guard={{'buckets': [128, 256, 512]}}), but got {buckets!r}."
        )
    if max_shape is None:
        raise ConfigurationError(
            f"buckets={list(buckets)} needs max_shape, the longest batch (the top bucket, which the search tunes "
            "for), e.g. max_shape=1024 with guard={'buckets': [128, 256, 512]}."
        )
    return tuple(sorted(set(buckets)))


def search_config(search: TuneConfig | Mapping[str, Any] | None) -> TuneConfig:
    """``search=`` as a ``TuneConfig`` (validated once, so a bad value fails at construction)."""
    if search is None or isinstance(search, TuneConfig):
        return search or TuneConfig()
    if isinstance(search, Mapping):
        return TuneConfig().with_overrides(search)
    raise ConfigurationError(
        f"search must be a TuneConfig or a dict of its settings, e.g. search={{'n_trials': 20}}, but got "
        f"{type(search).__name__} {search!r}."
    )


def check_types(**values: Any) -> None:
    """Arguments whose wrong type would only fail mid-fit (or silently do something else), refused now."""
    rules = {
        "plan": ((str, os.PathLike, Plan), "a plan file path or a Plan, e.g. plan='plans/gpt.json'"),
        "plan_path": ((str, os.PathLike), "a file path, e.g. plan_path='plans/gpt.json'"),
        "tune_micro_batch": ((bool, str), "True or the batch-size attribute's name, e.g. tune_micro_batch=True"),
    }
    for name, value in values.items():
        types, example = rules[name]
        wrong = not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
        if value is not None and wrong:
            raise ConfigurationError(f"{name} must be {example}, but got {type(value).__name__} {value!r}.")


def check_reuse_arguments(plan: Any, search: Any, on_stale_plan: str) -> None:
    if plan is not None and search is not None and on_stale_plan == "raise":
        raise ConfigurationError(
            "plan= applies a saved plan without searching, but search settings were also given "
            f"({search!r}) with guard={{'on_stale_plan': 'raise'}}, so they could never be used. "
            "Remove plan= to search, or remove search= to reuse the plan."
        )


def check_tunable(pl_module: pl.LightningModule) -> None:
    if not pl_module.automatic_optimization:
        raise ConfigurationError(
            "ActivationCheckpointTuner cannot run trials with manual optimization (automatic_optimization=False): "
            "training_step steps the optimizer itself, so a trial would change the weights. Tune once with "
            "automatic optimization, or pass plan=... to apply a saved plan."
        )


def check_strategy(trainer: pl.Trainer) -> None:
    policy = getattr(trainer.strategy, "_activation_checkpointing_kwargs", None)
    if policy:
        raise ConfigurationError(
            f"The Trainer's strategy ({type(trainer.strategy).__name__}) already applies activation checkpointing "
            f"({policy}). Checkpointing twice recomputes twice. Remove activation_checkpointing_policy from the "
            "strategy, or remove ActivationCheckpointTuner."
        )


def refuse_existing_checkpointing(model: torch.nn.Module) -> None:
    theirs = existing_checkpointing(model)
    if theirs:
        more = f" and {len(theirs) - 3} more" if len(theirs) > 3 else ""
        raise ConfigurationError(
            f"The model already checkpoints activations ({'; '.join(theirs[:3])}{more}); a tuned plan on top would "
            "recompute those blocks twice. Turn it off and let ActivationCheckpointTuner choose (HF: "
            "model.gradient_checkpointing_disable(); timm: set_grad_checkpointing(False); or remove "
            "checkpoint_wrapper), or remove ActivationCheckpointTuner to keep yours."
        )
