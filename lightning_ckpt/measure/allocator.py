"""The allocator regime a search runs under: expandable segments verified on a real segment, or a clear word that they
are off; and the split-resistant setting a refused pass is retried with. The cap limits *reserved* memory, and steps of
many shapes leave split cached blocks that cannot serve a large request; expandable segments unmap free pages before
refusing, so reserved follows allocated (what the budget speaks of). A run-time switch can silently do nothing (torch
2.11), so a probe's segment is read after it. A user's own ``expandable_segments`` setting is never changed."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_ckpt.formatting import MIB
from lightning_ckpt.measure.allocator_options import ENV_VARS, configured_options
from lightning_ckpt.measure.device_memory import DeviceMemory, device_memory

__all__ = [
    "AllocatorRegime",
    "AllocatorWarning",
    "allocator_figures",
    "search_allocator",
    "split_resistant",
    "start_expandable_segments",
]

log = logging.getLogger(__name__)


class AllocatorWarning(UserWarning):
    """The allocator could not be put in the regime the search wants (filter it with ``warnings.filterwarnings``)."""


@dataclass(frozen=True)
class AllocatorRegime:
    """What the search ran under (in the plan file): ``how`` expandable segments came on, or why not; ``settings``."""

    expandable_segments: bool
    how: str
    settings: str
    torch: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return f"expandable segments {'on' if self.expandable_segments else 'off'} ({self.how})"


def start_expandable_segments(environ: dict[str, str] | None = None) -> str | None:
    """Put ``expandable_segments:True`` into the allocator's configuration before CUDA starts, keeping the user's
    other options; returns the variable set, or None (no GPU, CUDA started, or the user chose either way)."""
    environ = os.environ if environ is None else environ
    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        return None
    configured = configured_options(environ)
    if configured.expandable_segments is not None:
        return None
    torch_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    name = next((n for n in ENV_VARS if environ.get(n)), ENV_VARS[0] if torch_minor >= (2, 9) else ENV_VARS[1])
    environ[name] = configured.with_expandable(True).text()
    log.info("lightning_ckpt: %s=%s set before CUDA starts (expandable segments)", name, environ[name])
    return name


def _regime(memory: DeviceMemory) -> AllocatorRegime:
    version = torch.__version__.split("+")[0]
    options = memory.allocator_options()
    if _probe(memory):
        how = "configured before the device started" if options.expandable_segments else "already on"
        return AllocatorRegime(True, how, options.text(), version)
    if options.expandable_segments is False:
        return AllocatorRegime(False, "by your configuration (expandable_segments:False)", options.text(), version)
    try:
        memory.set_allocator_options(options.with_expandable(True))
    except Exception as err:  # a custom allocator, a platform without them
        return AllocatorRegime(
            False, f"the allocator refused the switch ({type(err).__name__}: {err})", options.text(), version
        )
    if _probe(memory):
        return AllocatorRegime(True, "run-time switch", memory.allocator_options().text(), version)
    memory.set_allocator_options(options)  # the user's configuration, exactly as it was
    warnings.warn(
        f"lightning_ckpt: expandable segments could not be turned on for the search: torch {version}'s run-time "
        "switch had no effect once CUDA had started (a new segment is not expandable). Without them a card near its "
        "limit can refuse a request that the allocated bytes fit (fragmentation); refused passes are retried with a "
        "split-resistant max_split_size_mb. To have them, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "before the process starts, or create ActivationCheckpointTuner before anything uses CUDA.",
        AllocatorWarning,
        stacklevel=2,
    )
    return AllocatorRegime(False, "the run-time switch had no effect", options.text(), version)


def _probe(memory: DeviceMemory) -> bool:
    # From an emptied cache (a cached block would be an old segment), and the probe's segment not left cached.
    memory.empty_cache()
    expandable = memory.expandable_in_effect()
    memory.empty_cache()
    return expandable


@contextlib.contextmanager
def search_allocator(device: torch.device | str) -> Iterator[AllocatorRegime | None]:
    """The allocator regime of one search (None without an allocator); nothing is put back on exit (see above)."""
    memory = device_memory(device)
    if memory is None:
        yield None
        return
    regime = _regime(memory)
    log.info("lightning_ckpt: allocator for the search: %s [%s]", regime.describe(), regime.settings or "defaults")
    yield regime


@contextlib.contextmanager
def split_resistant(memory: DeviceMemory, request: int) -> Iterator[str | None]:
    """For one retried pass, ``max_split_size_mb`` at half the refused request, so the cache cannot split the room
    such a request needs. Yields the option set (None with expandable segments or when refused)."""
    options = memory.allocator_options()
    if options.expandable_segments:
        yield None
        return
    split = options.with_max_split(max(1, request // 2))
    try:
        memory.set_allocator_options(split)
    except Exception as err:
        log.info("lightning_ckpt: the allocator refused max_split_size_mb (%s): retried as it was", err)
        yield None
        return
    try:
        yield f"max_split_size_mb:{-(-(split.max_split_bytes or 0) // MIB)}"
    finally:
        memory.set_allocator_options(options)


def allocator_figures(memory: DeviceMemory | None, *, segments: int = 12) -> dict[str, Any]:
    """What the allocator went through, for an error and the GPU check: figures and the largest segments."""
    if memory is None:
        return {}
    listed = sorted(memory.segments(), key=lambda s: -int(s.get("total_size", 0)))
    compact = [
        {
            "size": int(s.get("total_size", 0)),
            "allocated": int(s.get("allocated_size", 0)),
            "expandable": bool(s.get("is_expandable", False)),
            "pool": s.get("segment_type", ""),
            "free_blocks": [int(b["size"]) for b in s.get("blocks", ()) if b.get("state") == "inactive"][:8],
        }
        for s in listed[:segments]
    ]
    return {"stats": memory.stats(), "segments": compact, "segment_count": len(listed)}
