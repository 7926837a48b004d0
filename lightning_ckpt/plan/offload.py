"""Offload that hides behind compute (``save_on_cpu`` copies on the compute stream): saved activations copied to host
memory on their own stream, into one pool of power-of-two host chunks per plan, bump-allocated and reused every step,
and back a block ahead of backward. Without streams (CPU, ``SimulatedCard``) the copies are synchronous."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["OffloadPool", "OffloadStats"]

_MIB = 2**20
SMALLEST_OFFLOADED = 64 * 2**10  # smaller saved tensors stay where they are: a copy would cost more than it saves


@dataclass(frozen=True)
class OffloadStats:
    """What a pool holds and did: host bytes reserved and at most in use, tensors offloaded and fetched ahead."""

    capacity_bytes: int
    peak_bytes: int
    offloaded_tensors: int
    prefetched_tensors: int
    chunks: int


class _Packed:
    """One saved tensor in host memory: where it lies, what it was, and (once fetched) its device copy."""

    __slots__ = ("__weakref__", "device", "event", "fetched", "group", "host")

    def __init__(self, host: torch.Tensor, device: torch.device, group: int):
        self.host, self.device, self.group = host, device, group
        self.fetched: torch.Tensor | None = None
        self.event: Any = None

    def to_device(self) -> torch.Tensor:
        """A device copy of the host bytes, on the current stream (a tracker counts it; the host chunk it does not)."""
        out = torch.empty_strided(self.host.shape, self.host.stride(), dtype=self.host.dtype, device=self.device)
        with _disable_current_modes():
            out.copy_(self.host, non_blocking=self.device.type == "cuda")
        return out


class OffloadPool:
    """Host memory and streams of one plan's offloaded blocks; ``chunk_bytes``: a chunk's size (a power of two)."""

    def __init__(self, *, chunk_bytes: int = 64 * _MIB) -> None:
        if chunk_bytes < 1 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"OffloadPool needs chunk_bytes to be a power of two, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.pinned: bool | None = None  # page-locked chunks, for asynchronous copies: on CUDA (set by the first pack)
        self.min_bytes = SMALLEST_OFFLOADED
        self._chunks: list[torch.Tensor] = []
        self._at = (0, 0)  # (chunk, offset) of the next free byte
        self._live = 0  # packed tensors autograd still holds (of this generation)
        self._generation = 0  # a step abandoned starts a new one: its packed tensors, dropped later, count for none
        # Per block call of this step, in forward order; weak, so that autograd alone decides when one is dropped.
        self._groups: dict[int, list[weakref.ref[_Packed]]] = {}
        self._next_group = 0
        self._reached: set[int] = set()  # groups backward reached (and fetched the one before ahead of)
        self._last: tuple[weakref.ref[torch.Tensor], _Packed] | None = None  # one tensor saved twice is copied once
        self._streams: tuple[Any, Any] | None = None
        self._in_use = 0
        self.peak_bytes = 0
        self.offloaded = 0
        self.prefetched = 0

    @property
    def capacity_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks)

    def stats(self) -> OffloadStats:
        return OffloadStats(self.capacity_bytes, self.peak_bytes, self.offloaded, self.prefetched, len(self._chunks))

    def release(self) -> None:
        """Give the chunks back (the search's end, a plan removed); the next step allocates them again."""
        self.abandon()
        self._chunks.clear()

    @contextlib.contextmanager
    def offloading(self, device: torch.device) -> Iterator[None]:
        """Run one block's forward with its saved tensors offloaded (a new group: what backward fetches together)."""
        group, self._next_group = self._next_group, self._next_group + 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, device, group), lambda p: self._unpack(p)
            ):
                yield
        except BaseException:
            self.abandon()
            raise
        finally:
            self._last = None  # held only within the block: autograd alone keeps a packed tensor alive

    def abandon(self) -> None:
        """A step that failed: wait for every copy in flight (their host memory is reused), then rewind the pool."""
        if self._streams is not None:
            for stream in self._streams:
                stream.synchronize()
        for group in self._groups.values():
            for ref in group:
                packed = ref()
                if packed is not None:
                    packed.fetched = packed.event = None
        self._live = 0
        self._generation += 1
        self._rewind()

    def _rewind(self) -> None:
        self._groups.clear()
        self._last = None
        self._at = (0, 0)
        self._reached.clear()
        self._in_use = 0

    def _take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory from the pool (aligned to 64 bytes), a new chunk when the current one is full."""
        nbytes = -(-nbytes // 64) * 64
        chunk, offset = self._at
        while chunk < len(self._chunks) and offset + nbytes > self._chunks[chunk].numel():
            chunk, offset = chunk + 1, 0
        if chunk == len(self._chunks):
            size = max(self.chunk_bytes, 1 << (nbytes - 1).bit_length())
            with _disable_current_modes():  # host memory: not the (simulated) card's
                self._chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=bool(self.pinned)))
        self._at = (chunk, offset + nbytes)
        self._in_use += nbytes
        self.peak_bytes = max(self.peak_bytes, self._in_use)
        return self._chunks[chunk][offset : offset + nbytes]

    def _stream_pair(self, device: torch.device) -> tuple[Any, Any] | None:
        if device.type != "cuda":
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    def _pack(self, t: torch.Tensor, device: torch.device, group: int) -> Any:
        if t.device != device or t.nbytes < self.min_bytes or isinstance(t, torch.nn.Parameter) or t.is_sparse:
            return t  # parameters and small tensors stay: nothing to win
        if self._last is not None and self._last[0]() is t:  # ``x * x`` saves x twice
            return self._last[1]
        if self.pinned is None:
            self.pinned = device.type == "cuda"
        with _disable_current_modes():  # a view of a host chunk: no tracker or card may count the chunk
            # The saved tensor's layout kept (what ``empty_like`` keeps: channels-last and other dense permutations):
            # backward computes in the layout it was given, and a contiguous copy changed ConvNeXt's gradients.
            stride = torch.empty_like(t, device="meta").stride()
            host = self._take(t.nbytes).view(t.dtype)[: t.numel()].as_strided(t.shape, stride)
        streams = self._stream_pair(device)
        if streams is None:
            with _disable_current_modes():
                host.copy_(t)
        else:
            out_stream = streams[0]
            out_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(out_stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(out_stream)  # its memory is reused only after this copy, with no wait on compute
        packed = _Packed(host, device, group)
        self._groups.setdefault(group, []).append(weakref.ref(packed))
        self._last = (weakref.ref(t), packed)
        self._live += 1
        self.offloaded += 1
        # Counted out when autograd drops it, not when unpacked: it is unpacked twice (retain_graph) or never.
        weakref.finalize(packed, self._dropped, self._generation)
        return packed

    def _dropped(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._live -= 1
        if self._live == 0:  # nothing of the step is held any more: the next one reuses the pool from its start
            self._rewind()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.fetched is None:
            self._fetch(packed.group, ahead=False)
        if packed.group not in self._reached:  # the block backward reaches next, once per group: also when this
            self._reached.add(packed.group)  # group came ahead (only every other block was fetched ahead before)
            self._fetch(packed.group - 1, ahead=True)
        if packed.fetched is None:  # a second unpack (retain_graph), or its group forgotten: this one alone
            packed.fetched = packed.to_device()
        out = packed.fetched
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
            out.record_stream(torch.cuda.current_stream(packed.device))
        packed.fetched = packed.event = None  # autograd holds the device copy now (a second unpack copies again)
        return out

    def _fetch(self, group: int, *, ahead: bool) -> None:
        """Copy a group's tensors back to the device: on the fetch stream when ahead of use, else on the current one."""
        todo = [p for ref in self._groups.get(group, ()) if (p := ref()) is not None and p.fetched is None]
        if not todo:
            return
        streams = self._stream_pair(todo[0].device)
        if streams is not None:  # the host copies must be complete before they are read back (the copy stream's)
            (streams[1] if ahead else torch.cuda.current_stream(todo[0].device)).wait_stream(streams[0])
        if streams is None or not ahead:  # on the current stream (synchronous without streams), in backward's order
            for p in todo:
                p.fetched = p.to_device()
            self.prefetched += len(todo) if ahead else 0
            return
        fetch_stream = streams[1]
        fetch_stream.wait_stream(torch.cuda.current_stream(todo[0].device))  # ahead: issued after backward reached it
        with torch.cuda.stream(fetch_stream):
            for p in todo:
                p.fetched = p.to_device()
                p.event = torch.cuda.Event()
                p.event.record(fetch_stream)
        self.prefetched += len(todo)
