"""Training forwards without KV caches (HF ``use_cache``): a training step never reads the cache, yet holds every
layer's K and V until the forward ends. HF turns it off under gradient checkpointing; so do we."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_ckpt.discovery import unwrap_compiled
from lightning_ckpt.model import ModelView

__all__ = [
    "CACHE_ARGS",
    "disable_kv_cache",
    "forward_params",
    "kv_cache_disabled",
    "without_cache_args",
    "without_kv_cache",
]

R = TypeVar("R")

log = logging.getLogger(__name__)
_said: set[str] = set()


def _builds_cache(config: Any) -> bool:
    """Whether this HF config builds a KV cache under ``use_cache``: decoders and encoder-decoders do; encoder-only
    families (BERT, RoBERTa: ``use_cache=True`` for their rare decoder mode) ignore it unless ``is_decoder``."""
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        return True
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )
    except ImportError:
        return True
    kind = getattr(config, "model_type", None)
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _notice_on_first_call(module: nn.Module) -> Any:
    """Say, once per model class, that the cache is off: at the model's first call, if it would have built one."""

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        name = type(mod).__name__
        if kwargs.get("use_cache", True) is False or name in _said:
            return
        _said.add(name)
        log.warning(
            "lightning_ckpt: %s has use_cache=True, which builds a KV cache in every training forward (memory "
            "no plan can remove, and nothing reads it in training). Setting use_cache=False while tuning and "
            "training with a plan; your setting is restored afterwards.",
            name,
        )

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    return handle


def disable_kv_cache(model: nn.Module) -> Callable[[], None]:
    """Set ``use_cache=False`` on every HF config in ``model``; returns a function that restores them. Says so once
    per model class, for models that build a cache (as HF does)."""
    changed = []
    hooks = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        builds = False
        for cfg in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
            if cfg is not None and getattr(cfg, "use_cache", False) is True:
                cfg.use_cache = False
                changed.append(cfg)
                builds = builds or _builds_cache(cfg)
        if builds and type(module).__name__ not in _said:
            hooks.append(_notice_on_first_call(module))

    def restore() -> None:
        for handle in hooks:
            handle.remove()
        for cfg in changed:
            cfg.use_cache = True

    return restore


@contextlib.contextmanager
def kv_cache_disabled(model: nn.Module) -> Iterator[None]:
    """``disable_kv_cache`` for the duration of a block."""
    restore = disable_kv_cache(model)
    try:
        yield
    finally:
        restore()


def without_kv_cache(fn: Callable[..., R]) -> Callable[..., R]:
    """Decorate a search entry point whose first argument is the model: it runs with KV caches off."""

    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> R:
        with kv_cache_disabled(unwrap_compiled(model.root if isinstance(model, ModelView) else model)):
            return fn(model, *args, **kwargs)

    return wrapper


# Arguments that carry a KV cache: None under checkpointing (as under HF's), or a recompute would append twice.
CACHE_ARGS = frozenset({"past_key_values", "past_key_value", "layer_past", "cache"})


_FORWARD_PARAMS: dict[type, tuple[str, ...]] = {}


# Constant to dynamo, called once at trace time; a dict cache, as dynamo traces through lru_cache's wrapper.
@torch.compiler.assume_constant_result
def forward_params(cls: type) -> tuple[str, ...]:
    names = _FORWARD_PARAMS.get(cls)
    if names is None:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        _FORWARD_PARAMS[cls] = names
    return names


def without_cache_args(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A checkpointed block's call with every KV cache argument None (and ``use_cache`` False)."""
    names = forward_params(type(module))
    dropped = [n for i, n in enumerate(names[: len(args)]) if n in CACHE_ARGS and args[i] is not None]
    dropped += [k for k in kwargs if k in CACHE_ARGS and kwargs[k] is not None]
    if not dropped and not kwargs.get("use_cache"):
        return args, kwargs
    if dropped:
        _warn_cache_once(type(module).__name__, tuple(dropped))
    args = tuple(None if i < len(names) and names[i] in CACHE_ARGS else a for i, a in enumerate(args))
    kwargs = {k: (None if k in CACHE_ARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


@functools.lru_cache(maxsize=64)
def _warn_cache_once(cls_name: str, dropped: tuple[str, ...]) -> None:
    warnings.warn(
        f"lightning_ckpt: {cls_name} was called with a KV cache ({', '.join(dropped)}) while checkpointed; the cache "
        "is not passed to checkpointed blocks because recomputation would append to it twice. Training does not "
        "use the cache; pass use_cache=False to silence this warning.",
        stacklevel=4,
    )
