"""A simulated small GPU for CPU tests: CUDA's allocator failures, reproduced where CI runs.

The tool exists for the card a model does not fit on, and CI has no card. ``SimulatedCard`` is a dispatch mode
that counts the bytes of live storages created under it (plus the resident tensors it is given), and raises
``torch.OutOfMemoryError`` when an op would take the total past what the card allows. While it is active the
package reads memory from it as it reads CUDA's allocator (``lightning_ckpt.measure.device_memory``): allocated
and peak bytes, the per-process cap (``set_per_process_memory_fraction``), the cache. So the CUDA path's
failures run on CPU:

* **a small card**: ``total_bytes`` between the full-checkpointing and no-checkpointing peaks;
* **an allocator that refuses memory allocated bytes would fit**: ``reserve_factor > 1`` makes the cap count
  reserved bytes (allocated times the factor, as the caching allocator's rounding and fragmentation do), so a
  cap set at the budget refuses a step whose allocated peak fits it;
* **a cache that grew**: reserved bytes keep their high-water mark until ``empty_cache()``;
* **a leak**: anything a failed step leaves alive stays counted, so every later step starts higher.

Host copies are not counted: a storage on another device than the card's (``device``) is not the card's.

    card = SimulatedCard(total_bytes=40 * 2**20, resident=(model, optimizer))
    with card:
        result = tune(model, step, config=TuneConfig(memory_pass="every"))
    assert card.max_allocated() <= card.total_bytes
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_ckpt.measure import device_memory

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

    ``resident``: modules (their parameters, buffers and gradients), optimizers (their state) and tensors that
    already live on the card when it is entered, counted as allocated from the start.
    ``reserve_factor``: reserved bytes per allocated byte (>= 1), what the cap counts (CUDA's cap limits reserved
    memory, not allocated).
    """

    def __init__(
        self,
        total_bytes: int,
        *,
        resident: Iterable[Any] = (),
        reserve_factor: float = 1.0,
        device: torch.device | str = "cpu",
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
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.cached_bytes = 0  # reserved high-water mark since the last ``empty_cache``
        self.refusals: list[str] = []  # the message of every OOM the card raised

    # -- the allocator's readings, as torch.cuda gives them --------------------------------------------------
    def allocated(self) -> int:
        return self.allocated_bytes

    def max_allocated(self) -> int:
        return self.peak_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.allocated_bytes

    def reserved(self) -> int:
        return max(self.cached_bytes, self._reserved_for(self.allocated_bytes))

    def empty_cache(self) -> None:
        self.cached_bytes = self._reserved_for(self.allocated_bytes)

    def get_fraction(self) -> float:
        return self.fraction

    def set_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"a memory fraction is in [0, 1], got {fraction}")
        self.fraction = float(fraction)

    def cap_bytes(self) -> int:
        return int(self.fraction * self.total_bytes)

    # -- counting ---------------------------------------------------------------------------------------------
    def _reserved_for(self, allocated: int) -> int:
        return int(allocated * self.reserve_factor)

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live and self._refs[key]() is storage:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        self.cached_bytes = max(self.cached_bytes, self._reserved_for(self.allocated_bytes))

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self._refs.pop(key, None)
        self.allocated_bytes -= nbytes

    def _resident_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for item in self._resident:
            if isinstance(item, nn.Module):
                for p in item.parameters():
                    tensors.append(p)
                    if p.grad is not None:
                        tensors.append(p.grad)
                tensors.extend(item.buffers())
            elif isinstance(item, torch.optim.Optimizer):
                for state in item.state.values():
                    tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
            elif isinstance(item, torch.Tensor):
                tensors.append(item)
        return tensors

    def __enter__(self) -> SimulatedCard:
        for st in _storages(self._resident_tensors()):
            if st.device == self.device:
                self._count(st)
        self.reset_peak()
        device_memory.install_card(self.device.type, self)
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        device_memory.uninstall_card(self.device.type, self)
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for s in _storages(tree_flatten((args, kwargs))[0])}
        new = [s for s in _storages(tree_flatten(out)[0]) if s.device == self.device and id(s) not in inputs]
        fresh = [s for s in new if not (id(s) in self._live and self._refs[id(s)]() is s)]
        request = sum(s.nbytes() for s in fresh)
        if request:
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
