"""Collectives over a Lightning strategy's process group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StrategySync", "max_over_ranks"]


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


def max_over_ranks(strategy: Any, values: Sequence[int]) -> list[int]:
    """Each of ``values`` at its largest over the ranks, on every rank (one all-reduce on the strategy's device, as
    NCCL needs): every rank then judges a step by the same batch size when their batches differ."""
    if strategy.world_size <= 1:
        return list(values)
    reduced = strategy.reduce(torch.tensor(list(values), device=strategy.root_device), reduce_op="max")
    return [int(v) for v in reduced.tolist()]
