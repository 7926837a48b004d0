"""Training forwards without KV caches (HF ``use_cache``).

HF decoder models build a key/value cache in every forward when ``config.use_cache`` is true, which
is the default of most configs. A training step never reads it, yet it holds every layer's K and V
until the forward ends: memory no checkpointing plan can remove, and memory the per-block profile
cannot see (the cache lives in an object the blocks append to). HF itself turns the cache off
under gradient checkpointing; we do the same for the whole time we tune and train with a plan, and
put the user's setting back afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch import nn

__all__ = ["disable_kv_cache", "kv_cache_disabled", "without_kv_cache"]

R = TypeVar("R")

log = logging.getLogger(__name__)
_said: set[str] = set()


def disable_kv_cache(model: nn.Module) -> Callable[[], None]:
    """Set ``use_cache=False`` on every HF config in ``model``; returns a function that restores them.

    Says so once per model class (as HF does), because a user who set ``use_cache=True`` should know.
    """
    changed = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for cfg in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
            if cfg is not None and getattr(cfg, "use_cache", False) is True:
                cfg.use_cache = False
                changed.append(cfg)
        if changed and type(module).__name__ not in _said:
            _said.add(type(module).__name__)
            log.warning(
                "lightning_ckpt: %s has use_cache=True, which builds a KV cache in every training forward (memory "
                "no plan can remove, and nothing reads it in training). Setting use_cache=False while tuning and "
                "training with a plan; your setting is restored afterwards.",
                type(module).__name__,
            )

    def restore() -> None:
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
        root = model
        while isinstance(getattr(root, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
            root = root._orig_mod
        with kv_cache_disabled(root):
            return fn(model, *args, **kwargs)

    return wrapper
