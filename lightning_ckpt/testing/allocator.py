"""CUDA's caching allocator in miniature, for ``SimulatedCard``: segments, best fit, splits, merges and refusals.

A card is more than a byte count: a request that allocated bytes alone would fit is refused when the free bytes are
scattered over cached segments. This follows ``c10/cuda/CUDACachingAllocator.cpp`` in what decides a refusal: the small
and large pools, best fit and splitting (``max_split_size`` included), releasing free segments and retrying, merging
freed neighbours, and expandable segments. ``AllocatorSizes.scaled(n)`` divides every threshold by ``n``, so a model of
a few MiB meets the allocator as a large model meets a card."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["AllocatorOutOfMemory", "AllocatorSizes", "Block", "CachingAllocator", "format_size"]

_KIB, _MIB, _GIB = 2**10, 2**20, 2**30
_VIRTUAL = 2**60  # an expandable segment's address space: never the limit, the mapped pages are


@dataclass(frozen=True)
class AllocatorSizes:
    """The allocator's thresholds in bytes (CUDA's defaults)."""

    min_block: int = 512
    small_size: int = 1 * _MIB
    small_buffer: int = 2 * _MIB
    min_large_alloc: int = 10 * _MIB
    large_buffer: int = 20 * _MIB
    round_large: int = 2 * _MIB

    @classmethod
    def scaled(cls, divisor: int) -> AllocatorSizes:
        """Every threshold divided by ``divisor`` (a power of two keeps them exact), for tiny test models."""
        if divisor < 1:
            raise ValueError(f"AllocatorSizes.scaled needs a divisor >= 1, got {divisor}")
        return cls(**{f.name: max(1, f.default // divisor) for f in fields(cls)})

    def rounded(self, nbytes: int) -> int:
        return max(self.min_block, -(-nbytes // self.min_block) * self.min_block)

    def segment_size(self, size: int) -> int:
        """How much a new segment for a rounded request of ``size`` reserves (``get_allocation_size``)."""
        if size <= self.small_size:
            return self.small_buffer
        if size < self.min_large_alloc:
            return self.large_buffer
        return -(-size // self.round_large) * self.round_large


class AllocatorOutOfMemory(Exception):
    """The allocator refused a request; the message is CUDA's out-of-memory text."""


def format_size(nbytes: int) -> str:
    """Bytes as CUDA's messages print them (``format_size`` in the allocator)."""
    if nbytes < _KIB:
        return f"{nbytes} bytes"
    if nbytes < _MIB:
        return f"{nbytes / _KIB:.2f} KiB"
    if nbytes < _GIB:
        return f"{nbytes / _MIB:.2f} MiB"
    return f"{nbytes / _GIB:.2f} GiB"


class Block:
    """A range of a segment: ``active`` (a live storage's), ``free`` (cached, mapped) or ``unmapped`` (expandable)."""

    __slots__ = ("offset", "segment", "size", "state")

    def __init__(self, segment: _Segment, offset: int, size: int, state: str) -> None:
        self.segment, self.offset, self.size, self.state = segment, offset, size, state


class _Segment:
    """One ``cudaMalloc`` (or, expandable, one address range whose pages are mapped on demand)."""

    def __init__(self, number: int, pool: str, size: int, *, expandable: bool, page: int) -> None:
        self.number, self.pool, self.expandable, self.page = number, pool, expandable, page
        self.size = _VIRTUAL if expandable else size
        self.blocks = [Block(self, 0, self.size, "unmapped" if expandable else "free")]

    def mapped_bytes(self) -> int:
        if not self.expandable:
            return self.size
        pages, last = 0, -1
        for b in self.blocks:
            if b.state == "unmapped":
                continue
            first, end = b.offset // self.page, (b.offset + b.size - 1) // self.page
            pages += end - max(first, last + 1) + 1 if end > last else 0
            last = max(last, end)
        return pages * self.page

    def fully_free(self) -> bool:
        return len(self.blocks) == 1 and self.blocks[0].state == "free"

    def merge_around(self, block: Block) -> Block:
        """Merge ``block`` with neighbours in the same state (a freed block with free ones; unmapped with unmapped)."""
        i = self.blocks.index(block)
        while i + 1 < len(self.blocks) and self.blocks[i + 1].state == block.state:
            block.size += self.blocks.pop(i + 1).size
        while i > 0 and self.blocks[i - 1].state == block.state:
            prev = self.blocks.pop(i - 1)
            block.offset, block.size = prev.offset, block.size + prev.size
            i -= 1
        return block


class CachingAllocator:
    """One device's caching allocator (see the module docstring). ``limit()`` is what reserved bytes may reach (the
    card, or its per-process fraction); ``expandable``: expandable segments as configured when the card started;
    ``runtime_switch``: whether turning them on or off later takes effect (on torch 2.11 it did not)."""

    def __init__(
        self,
        limit: Callable[[], int],
        *,
        sizes: AllocatorSizes | None = None,
        expandable: bool = False,
        runtime_switch: bool = True,
        total: Callable[[], int] | None = None,
    ) -> None:
        self.limit = limit
        self.total = total or limit
        self.sizes = sizes or AllocatorSizes()
        self.expandable = expandable
        self.runtime_switch = runtime_switch
        self.max_split_size: int | None = None  # bytes; None: every block may be split
        self.segments: list[_Segment] = []
        self._numbered = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    @property
    def reserved(self) -> int:
        return sum(s.mapped_bytes() for s in self.segments)

    def inactive_split_bytes(self) -> int:
        split = [s for s in self.segments if not s.expandable and len(s.blocks) > 1]
        return sum(b.size for s in split for b in s.blocks if b.state == "free")

    def stats(self) -> dict[str, int]:
        """The figures of ``torch.cuda.memory_stats`` that say what the allocator went through."""
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
            "inactive_split_bytes.all.current": self.inactive_split_bytes(),
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "segment.all.current": len(self.segments),
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments as ``torch.cuda.memory_snapshot()`` lists them (the fields the package reads)."""
        out = []
        for s in self.segments:
            blocks = [
                {"size": b.size, "state": "active_allocated" if b.state == "active" else "inactive"}
                for b in s.blocks
                if b.state != "unmapped"
            ]
            active = sum(b.size for b in s.blocks if b.state == "active")
            sizes = {"total_size": s.mapped_bytes(), "allocated_size": active, "active_size": active}
            kind = {"segment_type": s.pool, "is_expandable": s.expandable}
            out.append({"address": s.number << 48, **sizes, **kind, "blocks": blocks})
        return out

    def malloc(self, nbytes: int) -> Block:
        sizes = self.sizes
        size = sizes.rounded(nbytes)
        pool = "small" if size <= sizes.small_size else "large"
        block = self._free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size)
        if block is None and self.empty_cache():
            self.num_alloc_retries += 1
            block = self._new_block(pool, size)
        if block is None:
            self.num_ooms += 1
            raise AllocatorOutOfMemory(self._refusal(size))
        block = self._split(block, size)
        block.state = "active"
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: Block) -> None:
        if block.state != "active":
            return
        self.allocated -= block.size
        block.state = "free"
        block.segment.merge_around(block)

    def _free_block(self, pool: str, size: int) -> Block | None:
        best: Block | None = None
        split_max = self.max_split_size
        for s in self.segments:
            if s.pool != pool:
                continue
            for b in s.blocks:
                if b.state != "free" or b.size < size:
                    continue
                if split_max is not None and size < split_max <= b.size:
                    continue  # a block too large to split is kept whole for requests of its size
                if split_max is not None and size >= split_max and b.size >= size + self.sizes.large_buffer:
                    continue
                if best is None or (b.size, s.number, b.offset) < (best.size, best.segment.number, best.offset):
                    best = b
        return best

    def _room(self) -> int:
        return min(self.limit(), self.total())

    def _new_block(self, pool: str, size: int) -> Block | None:
        if self.expandable:
            return self._map(pool, size)
        segment_size = self.sizes.segment_size(size)
        if self.reserved + segment_size > self._room():
            return None
        self._numbered += 1
        segment = _Segment(self._numbered, pool, segment_size, expandable=False, page=segment_size)
        self.segments.append(segment)
        return segment.blocks[0]

    def _map(self, pool: str, size: int) -> Block | None:
        """Expandable: map pages for ``size`` bytes in the pool's segment, where the fewest new pages are needed."""
        segment = next((s for s in self.segments if s.expandable and s.pool == pool), None)
        if segment is None:
            self._numbered += 1
            page = self.sizes.small_buffer if pool == "small" else self.sizes.large_buffer
            segment = _Segment(self._numbered, pool, 0, expandable=True, page=page)
            self.segments.append(segment)
        for start, length in sorted(self._runs(segment), key=lambda r: (r[1], r[0])):
            if length < size:
                continue
            placed = self._place(segment, start, size)
            if self.reserved <= self._room():
                return placed
            placed.state = "unmapped"  # what was free there stays unmapped, as a release before a refusal leaves it
            segment.merge_around(placed)
            break
        if len(segment.blocks) == 1 and segment.blocks[0].state == "unmapped":
            self.segments.remove(segment)
        return None

    @staticmethod
    def _runs(segment: _Segment) -> list[tuple[int, int]]:
        """(offset, length) of each run of free or unmapped blocks: where a new mapping can go."""
        runs: list[tuple[int, int]] = []
        for b in segment.blocks:
            if b.state == "active":
                continue
            if runs and runs[-1][0] + runs[-1][1] == b.offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + b.size)
            else:
                runs.append((b.offset, b.size))
        return runs

    @staticmethod
    def _place(segment: _Segment, start: int, size: int) -> Block:
        """Carve ``[start, start + size)`` out of the free and unmapped blocks there, as one free (mapped) block."""
        end = start + size
        kept: list[Block] = []
        for b in segment.blocks:
            b_end = b.offset + b.size
            if b_end <= start or b.offset >= end or b.state == "active":
                kept.append(b)
                continue
            if b.offset < start:
                kept.append(Block(segment, b.offset, start - b.offset, b.state))
            if b_end > end:
                kept.append(Block(segment, end, b_end - end, b.state))
        placed = Block(segment, start, size, "free")
        kept.append(placed)
        kept.sort(key=lambda b: b.offset)
        segment.blocks = kept
        return placed

    def _split(self, block: Block, size: int) -> Block:
        rest = block.size - size
        keep = rest >= self.sizes.min_block if block.segment.pool == "small" else rest > self.sizes.small_size
        if not keep:
            return block
        head = Block(block.segment, block.offset, size, block.state)
        tail = Block(block.segment, block.offset + size, rest, block.state)
        i = block.segment.blocks.index(block)
        block.segment.blocks[i : i + 1] = [head, tail]
        return head

    def empty_cache(self) -> bool:
        """Release every fully free segment and unmap every free page of the expandable ones; whether any was."""
        before = self.reserved
        kept = []
        for s in self.segments:
            if s.expandable:
                for b in list(s.blocks):
                    if b.state == "free" and b in s.blocks:
                        b.state = "unmapped"
                        s.merge_around(b)
                if len(s.blocks) == 1 and s.blocks[0].state == "unmapped":
                    continue
            elif s.fully_free():
                continue
            kept.append(s)
        self.segments = kept
        return self.reserved < before

    def _refusal(self, size: int) -> str:
        reserved, room = self.reserved, self._room()
        return (
            f"CUDA out of memory. Tried to allocate {format_size(size)}. GPU 0 has a total capacity of "
            f"{format_size(self.total())} of which {format_size(max(0, room - reserved))} is free. This process "
            f"has {format_size(reserved)} memory in use (a limit of {format_size(room)}). Of the allocated memory "
            f"{format_size(self.allocated)} is allocated by PyTorch, and {format_size(reserved - self.allocated)} is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        )
