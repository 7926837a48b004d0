"""The device's allocator, read one way: CUDA's caching allocator, or a simulated card installed by the tests.
Everything that reads or caps device memory goes through ``device_memory(device)``, so the suite runs the CUDA path's
failures on CPU with ``lightning_ckpt.testing.SimulatedCard`` (a small card, a refusing allocator)."""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

import torch

from lightning_ckpt.cards import installed_card
from lightning_ckpt.measure.allocator_options import AllocatorOptions, configured_options, parse_options
from lightning_ckpt.measure.tracker import normalise_device

__all__ = ["DeviceMemory", "allocator_type", "device_memory", "refused_although_it_fits", "requested_bytes"]


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
    def max_reserved(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def segments(self) -> list[dict[str, Any]]: ...
    def allocator_options(self) -> AllocatorOptions: ...
    def set_allocator_options(self, options: AllocatorOptions) -> None: ...
    def expandable_in_effect(self) -> bool: ...


# The figures of ``torch.cuda.memory_stats`` that say what the allocator went through (a refusal's evidence).
STAT_KEYS = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "inactive_split_bytes.all.current",
    "num_alloc_retries",
    "num_ooms",
    "segment.all.current",
)
_PROBE_BYTES = 64 * 2**20


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

    def max_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def stats(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {k: int(stats[k]) for k in STAT_KEYS if k in stats}

    def segments(self) -> list[dict[str, Any]]:
        return [s for s in torch.cuda.memory_snapshot() if s.get("device", self.device.index) == self.device.index]

    def allocator_options(self) -> AllocatorOptions:
        """The options in force: what torch last parsed (2.9+ keeps it), else the environment it started from."""
        getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        text = getter() if getter is not None else ""
        return parse_options(text) if text else configured_options(os.environ)

    def set_allocator_options(self, options: AllocatorOptions) -> None:
        """All options at once: the setter takes the string as the whole configuration."""
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            setter = torch.cuda.memory._set_allocator_settings
        if options.max_split_bytes is not None:  # CUDA refuses max_split_size_mb at or below its 20 MiB large buffer
            options = options.with_max_split(max(options.max_split_bytes, 21 * 2**20))
        text = options.text()
        if options.expandable_segments is None:
            text = ",".join(filter(None, [text, "expandable_segments:False"]))  # the default, said explicitly
        setter(text)

    def expandable_in_effect(self) -> bool:
        """Whether a new segment is expandable, read off a probe larger than every cached free block."""
        largest_free = max(
            (b["size"] for s in self.segments() for b in s.get("blocks", ()) if b.get("state") == "inactive"), default=0
        )
        probe = torch.empty(max(_PROBE_BYTES, largest_free + 2 * 2**20), dtype=torch.uint8, device=self.device)
        try:
            address = probe.data_ptr()
            for segment in self.segments():
                if segment["address"] <= address < segment["address"] + segment["total_size"]:
                    return bool(segment.get("is_expandable", False))
            return False
        finally:
            del probe


def device_memory(device: torch.device | str) -> DeviceMemory | None:
    """A simulated card installed for ``device``'s type, CUDA's allocator on a GPU, else None (CPU: the tracker)."""
    device = torch.device(device)
    card = installed_card(device.type)
    if card is not None:
        return card
    return CudaMemory(normalise_device(device)) if device.type == "cuda" else None


def allocator_type(device: torch.device | str) -> str:
    """``"cuda"`` where an allocator caps and counts the device's memory (a GPU, a simulated card), else the device's
    type: whether trials read the allocator and run under a cap."""
    return "cuda" if device_memory(device) is not None else torch.device(device).type


def refused_although_it_fits(exc: BaseException, memory: DeviceMemory | None, limit: int | None) -> str | None:
    """Why an out-of-memory error deserves one more try: the bytes allocated when it was raised plus the request fit
    ``limit`` (default: the device's cap), so the allocator's cache refused, not the step; else None. Read inside
    the ``except``, while the failed pass's tensors are alive."""
    request = None if memory is None else requested_bytes(str(exc))
    if memory is None or request is None:
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
    return None if match is None else int(float(match.group(1)) * _UNITS[match.group(2)])
