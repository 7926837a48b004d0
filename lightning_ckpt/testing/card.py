"""A simulated small GPU for CPU tests: CUDA's allocator failures, reproduced where CI runs.

``SimulatedCard`` is a dispatch mode that counts the bytes of live storages on its ``device`` (plus the resident
tensors it is given) and raises ``torch.OutOfMemoryError`` past what the card allows; while it is active
``lightning_ckpt.measure.device_memory`` reads it as it reads CUDA's allocator. With ``segments`` the card is a
caching allocator (``testing.allocator``), so fragmentation fails a step as on a card.

    card = SimulatedCard(total_bytes=40 * 2**20, resident=(model, optimizer))
    with card:
        result = tune(model, step, config=TuneConfig(memory_pass="every"))
    assert card.max_allocated() <= card.total_bytes
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_ckpt.cards import install_card, uninstall_card
from lightning_ckpt.measure.allocator_options import AllocatorOptions, configured_options
from lightning_ckpt.testing.allocator import AllocatorOutOfMemory, AllocatorSizes, Block, CachingAllocator

__all__ = ["SimulatedCard"]

_MIB = 2**20


def _storages(values: Iterable[Any]) -> list[torch.UntypedStorage]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and not v.is_meta:
            try:
                out.append(v.untyped_storage())
            except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some wrapper subclasses)
                continue
    return out


class SimulatedCard(TorchDispatchMode):
    """A card of ``total_bytes`` for tensors on ``device`` (CPU in the tests).

    ``resident``: modules, optimizers and tensors that already live on the card when it is entered, counted as allocated
    from the start. ``reserve_factor``: reserved bytes per allocated byte (>= 1), what the cap counts (CUDA's cap limits
    reserved memory, not allocated). ``expandable``: expandable segments when the card starts (None: read from
    ``PYTORCH_CUDA_ALLOC_CONF`` on entering); ``runtime_switch=False``: the run-time switch does nothing, as on torch
    2.11."""

    def __init__(
        self,
        total_bytes: int,
        *,
        resident: Iterable[Any] = (),
        reserve_factor: float = 1.0,
        device: torch.device | str = "cpu",
        segments: AllocatorSizes | None = None,
        expandable: bool | None = False,
        runtime_switch: bool = True,
    ) -> None:
        super().__init__()
        if total_bytes < 1 or reserve_factor < 1.0:
            raise ValueError(
                f"SimulatedCard needs total_bytes >= 1 and reserve_factor >= 1, got {total_bytes}, {reserve_factor}"
            )
        self.total_bytes = int(total_bytes)
        self.reserve_factor = float(reserve_factor)
        self.device = torch.device(device)
        self.fraction = 1.0  # the per-process cap, as ``torch.cuda.set_per_process_memory_fraction`` sets it
        self._resident = list(resident)
        self._live: dict[int, int] = {}  # id of a counted storage -> its bytes
        self._refs: dict[int, weakref.ref] = {}
        self.allocated_bytes = self.peak_bytes = 0
        self.cached_bytes = 0  # reserved high-water mark since the last ``empty_cache``
        self.refusals: list[str] = []  # the message of every OOM the card raised
        self._expandable_at_start = expandable
        self.allocator = None
        if segments is not None:
            self.allocator = CachingAllocator(
                self.cap_bytes, sizes=segments, runtime_switch=runtime_switch, total=lambda: self.total_bytes
            )
        self._blocks: dict[int, Block] = {}  # id of a counted storage -> its block (``segments``)
        self.options = AllocatorOptions()
        self.probe_bytes = 64 * _MIB // (AllocatorSizes().large_buffer // segments.large_buffer) if segments else _MIB

    # The allocator's readings, options and cap, as torch.cuda gives them.
    def allocated(self) -> int:
        return self.allocated_bytes

    def max_allocated(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        """Both peaks, as ``torch.cuda.reset_peak_memory_stats`` resets them."""
        self.peak_bytes = self.allocated_bytes
        if self.allocator is not None:
            self.allocator.peak_reserved = self.allocator.reserved

    def reserved(self) -> int:
        if self.allocator is not None:
            return self.allocator.reserved
        return max(self.cached_bytes, self._reserved_for(self.allocated_bytes))

    def max_reserved(self) -> int:
        return self.allocator.peak_reserved if self.allocator is not None else self.cached_bytes

    def empty_cache(self) -> None:
        if self.allocator is not None:
            self.allocator.empty_cache()
        self.cached_bytes = self._reserved_for(self.allocated_bytes)

    def stats(self) -> dict[str, int]:
        if self.allocator is not None:
            return self.allocator.stats()
        return {
            "allocated_bytes.all.current": self.allocated_bytes,
            "allocated_bytes.all.peak": self.peak_bytes,
            "reserved_bytes.all.current": self.reserved(),
            "reserved_bytes.all.peak": self.cached_bytes,
            "num_ooms": len(self.refusals),
        }

    def segments(self) -> list[dict[str, Any]]:
        return self.allocator.snapshot() if self.allocator is not None else []

    def allocator_options(self) -> AllocatorOptions:
        return self.options

    def set_allocator_options(self, options: AllocatorOptions) -> None:
        self.options = options
        if self.allocator is not None:
            if self.allocator.runtime_switch:  # new segments follow the run-time switch, as CUDA's do
                self.allocator.expandable = bool(options.expandable_segments)
            self.allocator.max_split_size = options.max_split_bytes

    def expandable_in_effect(self) -> bool:
        """Whether a new large segment is expandable: a probe of ``probe_bytes`` (64 MiB, scaled) is allocated and
        its segment read, as ``torch.cuda.memory_snapshot()`` is read on a card."""
        if self.allocator is None:  # nothing to fragment: the switch is only remembered
            return bool(self.options.expandable_segments)
        largest_free = max(
            (b["size"] for seg in self.segments() for b in seg["blocks"] if b["state"] == "inactive"), default=0
        )
        size = max(self.probe_bytes, largest_free + self.allocator.sizes.large_buffer)
        probe = torch.empty(size, dtype=torch.uint8, device=self.device)
        block = self._blocks.get(id(probe.untyped_storage()))
        expandable = block is not None and block.segment.expandable
        del probe
        return expandable

    def get_fraction(self) -> float:
        return self.fraction

    def set_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"a memory fraction is in [0, 1], got {fraction}")
        self.fraction = float(fraction)

    def cap_bytes(self) -> int:
        return int(self.fraction * self.total_bytes)

    def _reserved_for(self, allocated: int) -> int:
        return int(allocated * self.reserve_factor)

    def _count(self, storage: torch.UntypedStorage, block: Block | None = None) -> None:
        key = id(storage)
        if key in self._live and self._refs[key]() is storage:
            return
        if block is None and self.allocator is not None and storage.nbytes():
            block = self.allocator.malloc(storage.nbytes())  # a resident tensor: the card had room for it
        if block is not None:
            self._blocks[key] = block
        nbytes = block.size if block is not None else storage.nbytes()
        self._live[key] = nbytes
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        self.cached_bytes = max(self.cached_bytes, self._reserved_for(self.allocated_bytes))

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self._refs.pop(key, None)
        self.allocated_bytes -= nbytes
        block = self._blocks.pop(key, None)
        if block is not None and self.allocator is not None:
            self.allocator.free(block)

    def _resident_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for item in self._resident:
            if isinstance(item, nn.Module):
                tensors += [t for p in item.parameters() for t in (p, p.grad) if t is not None]
                tensors.extend(item.buffers())
            elif isinstance(item, torch.optim.Optimizer):
                for state in item.state.values():
                    tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
            elif isinstance(item, torch.Tensor):
                tensors.append(item)
        return tensors

    def __enter__(self) -> SimulatedCard:
        if self.allocator is not None:
            # The card "starts" here, and reads its configuration as CUDA does when it starts.
            configured = configured_options(os.environ)
            self.options = configured
            expandable = self._expandable_at_start
            self.allocator.expandable = bool(configured.expandable_segments if expandable is None else expandable)
            self.allocator.max_split_size = configured.max_split_bytes
        for st in _storages(self._resident_tensors()):
            if st.device == self.device:
                self._count(st)
        self.reset_peak()
        install_card(self.device.type, self)
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        uninstall_card(self.device.type, self)
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for s in _storages(tree_flatten((args, kwargs))[0])}
        new = [s for s in _storages(tree_flatten(out)[0]) if s.device == self.device and id(s) not in inputs]
        fresh = [s for s in new if not (id(s) in self._live and self._refs[id(s)]() is s)]
        request = sum(s.nbytes() for s in fresh)
        if request and self.allocator is not None:
            self._serve(fresh)
        elif request:
            after = self.allocated_bytes + request
            cap = self.cap_bytes()
            if after > self.total_bytes or self._reserved_for(after) > cap:
                del out, new, fresh
                message = (
                    f"Simulated card out of memory. Tried to allocate {request / _MIB:.2f} MiB. "
                    f"Card of {self.total_bytes / _MIB:.2f} MiB, cap {cap / _MIB:.2f} MiB "
                    f"(fraction {self.fraction:.3f}); {self.allocated_bytes / _MIB:.2f} MiB is allocated by PyTorch, "
                    f"{self.reserved() / _MIB:.2f} MiB reserved."
                )
                self.refusals.append(message)
                raise torch.OutOfMemoryError(message)
            for s in fresh:
                self._count(s)
        return out

    def _serve(self, fresh: list[torch.UntypedStorage]) -> None:
        """Each new storage from the caching allocator, one request at a time as CUDA serves them; a refusal
        gives back what this op was already given and raises CUDA's out-of-memory error."""
        given: list[Block] = []
        for s in fresh:
            if not s.nbytes():
                continue
            try:
                given.append(self.allocator.malloc(s.nbytes()))
            except AllocatorOutOfMemory as err:
                for block in given:
                    self.allocator.free(block)
                self.refusals.append(str(err))
                raise torch.OutOfMemoryError(str(err)) from None
        blocks = iter(given)
        for s in fresh:
            if s.nbytes():
                self._count(s, next(blocks))
