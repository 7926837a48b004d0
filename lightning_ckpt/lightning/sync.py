"""The search's ``Sync`` (``lightning_ckpt.search.distributed``) over a Lightning strategy's process group."""

from __future__ import annotations

from typing import Any

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


def max_over_ranks(strategy: Any, value: int) -> int:
    """The largest ``value`` any rank holds, on every rank: one all-reduce of one integer (on the strategy's device,
    as NCCL needs), which is what lets every rank pick the same plan table bucket for a step whose batches differ
    in length from rank to rank."""
    import torch

    if strategy.world_size <= 1:
        return value
    reduced = strategy.reduce(torch.tensor(value, device=strategy.root_device), reduce_op="max")
    return int(reduced.item())
