"""The host link, measured: how fast pinned memory moves between the card and the host, each way. Offload can only hide
behind compute what the link moves in that time, and what a link reaches varies by machine, so it is measured with
pinned buffers as the offload pool uses, timed with CUDA events."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

__all__ = ["LinkBandwidth", "measure_link"]


@dataclass(frozen=True)
class LinkBandwidth:
    """Bytes per second of pinned copies to the host (``to_host``) and back (``to_device``), over ``nbytes``."""

    to_host: float
    to_device: float
    nbytes: int


def measure_link(device: torch.device | str, *, nbytes: int = 256 * 2**20, repeats: int = 5) -> LinkBandwidth | None:
    """The median of ``repeats`` pinned copies of ``nbytes`` each way on ``device`` (None on a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    card = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        card.copy_(host, non_blocking=True)  # first copies set up the mappings: not timed
        host.copy_(card, non_blocking=True)
        for _ in range(repeats):
            for to_host in (True, False):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                destination, source = (host, card) if to_host else (card, host)
                start.record()
                destination.copy_(source, non_blocking=True)
                end.record()
                end.synchronize()
                rates[to_host].append(nbytes / (start.elapsed_time(end) / 1000))
    finally:
        del host, card
    return LinkBandwidth(statistics.median(rates[True]), statistics.median(rates[False]), nbytes)
