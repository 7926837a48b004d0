"""The device's allocator, read one way: CUDA's caching allocator, or a simulated card installed by the tests.

Budgets are judged on *allocated* bytes (what the memory model and the guard speak of); the allocator's cap
(``set_per_process_memory_fraction``) limits *reserved* bytes. Everything that reads or caps device memory goes
through ``device_memory(device)``, so the suite can run the CUDA path's failures on CPU with
``lightning_ckpt.testing.SimulatedCard`` (a small card, an allocator that refuses, a cache that grew).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = [
    "DeviceMemory",
    "allocator_type",
    "device_memory",
    "expandable_segments",
    "refused_although_it_fits",
    "install_card",
    "requested_bytes",
    "uninstall_card",
]


class DeviceMemory(Protocol):
    """What the package reads of a device's allocator (all bytes; fractions of ``total_bytes``)."""

    total_bytes: int

    def allocated(self) -> int: ...
    def max_allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def reserved(self) -> int: ...
    def empty_cache(self) -> None: ...
    def get_fraction(self) -> float: ...
    def set_fraction(self, fraction: float) -> None: ...
    def cap_bytes(self) -> int: ...


class CudaMemory:
    """``torch.cuda``'s readings for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total_bytes = int(torch.cuda.get_device_properties(device).total_memory)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def get_fraction(self) -> float:
        # get_per_process_memory_fraction is recent; before it, the cap could only have been the default 1.0.
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return float(getter(self.device)) if getter is not None else 1.0

    def set_fraction(self, fraction: float) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def cap_bytes(self) -> int:
        return int(self.get_fraction() * self.total_bytes)


_CARDS: dict[str, Any] = {}


def install_card(device_type: str, card: Any) -> None:
    """Make ``card`` the allocator of ``device_type`` (``SimulatedCard.__enter__`` calls this)."""
    _CARDS[device_type] = card


def uninstall_card(device_type: str, card: Any) -> None:
    if _CARDS.get(device_type) is card:
        del _CARDS[device_type]


def device_memory(device: torch.device | str) -> DeviceMemory | None:
    """The allocator of ``device``: a simulated card if one is installed for its type, CUDA's on a GPU, else None
    (CPU: no allocator counter; the live-tensor tracker reads memory there)."""
    device = torch.device(device)
    card = _CARDS.get(device.type)
    if card is not None:
        return card
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaMemory(device)
    return None


def allocator_type(device: torch.device | str) -> str:
    """``"cuda"`` where an allocator caps and counts the device's memory (a GPU, or a simulated card), else the
    device's type: what decides whether trials read the allocator and run under a cap, as on a GPU."""
    device = torch.device(device)
    return "cuda" if device_memory(device) is not None else device.type


log = logging.getLogger(__name__)


@contextlib.contextmanager
def expandable_segments(device: torch.device | str) -> Iterator[bool]:
    """CUDA's allocator with ``expandable_segments`` for the search, put back as it was afterwards; yields whether it
    was turned on.

    The per-process cap limits *reserved* memory. A search runs steps of many shapes one after another, and the
    cached blocks they leave can be too small for the next large request: on one H200 made 21.8 GiB, the memory
    profile was refused 6.14 GiB with 11.17 GiB allocated and 4.73 GiB reserved but free. Expandable segments grow one
    segment instead of caching fixed blocks, so what is reserved stays close to what is allocated, which is what the
    budget, the memory model and the guard speak of. Left alone when the user configured the allocator themselves
    (``PYTORCH_CUDA_ALLOC_CONF``), or where torch cannot change it at run time."""
    device = torch.device(device)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if device.type != "cuda" or "expandable_segments" in conf or setter is None:
        yield False
        return
    try:
        setter("expandable_segments:True")
    except Exception as err:  # an allocator that refuses (a custom one, an older torch)
        log.debug("lightning_ckpt: expandable segments not available: %s", err)
        yield False
        return
    try:
        yield True
    finally:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        setter("expandable_segments:False")


def refused_although_it_fits(exc: BaseException, memory: DeviceMemory | None, limit: int | None) -> str | None:
    """Why an out-of-memory error deserves one more try: the bytes allocated when it was raised plus the request fit
    ``limit`` (default: what the device lets this process have), so the refusal came from the allocator's cache (its
    reserve, its fragments), not from the step. None otherwise. Read inside the ``except``: the failed pass's tensors
    are still alive, so ``allocated`` is where it stopped."""
    if memory is None:
        return None
    request = requested_bytes(str(exc))
    if request is None:
        return None
    limit = memory.cap_bytes() if limit is None else limit
    allocated = memory.allocated()
    if allocated + request > limit:
        return None
    return (
        f"the allocator refused {request} bytes with {allocated} allocated ({memory.reserved()} reserved), within "
        f"{limit} bytes"
    )


_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str) -> int | None:
    """The size an out-of-memory message says was asked for (CUDA's "Tried to allocate 6.14 GiB"), else None."""
    match = re.search(r"Tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)", message)
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])
