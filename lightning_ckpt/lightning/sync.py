"""The search's ``Sync`` (``lightning_ckpt.search.distributed``) over a Lightning strategy's process group."""

from __future__ import annotations

from typing import Any

__all__ = ["StrategySync"]


class StrategySync:
    """``lightning_ckpt.search.distributed.Sync`` over a Lightning strategy's process group."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @property
    def is_leader(self) -> bool:
        return self.strategy.global_rank == 0

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    def broadcast(self, obj: Any) -> Any:
        return self.strategy.broadcast(obj, src=0)

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
