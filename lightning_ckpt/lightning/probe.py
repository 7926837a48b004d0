"""The longest batch a run will see, found before its first step: ``max_shape="probe"``.

A plan tuned on the first batch runs over the budget on the first long one, many steps later. Users who cannot
name their longest batch ask the run: the datamodule's declared maximum length where it exposes one (LitGPT's
data modules and many Hugging Face ones keep ``max_seq_length``), else a bounded probe of the training loader:
N batches drawn from a fresh iterator, only their shapes kept. The probe must not change training: the random
states a loader draws from (torch's for a shuffling sampler, Python's and NumPy's for user code) are put back,
and a loader that cannot be iterated afresh (a one-shot iterator or generator) is refused rather than consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.shapes import BatchSize
from lightning_ckpt.measure.snapshot import rng_state, set_rng_state

__all__ = ["DATAMODULE_ATTRIBUTES", "PROBE_BATCHES", "Probed", "probe_request", "probed_max_shape"]

PROBE_BATCHES = 64
# Where a datamodule (or the LightningModule) keeps the longest sequence it will produce, in order.
DATAMODULE_ATTRIBUTES = ("max_seq_length", "max_length", "max_seq_len")


@dataclass(frozen=True)
class Probed:
    """The longest batch found, and where it came from, for the one line the callback prints."""

    size: BatchSize
    source: str


def probe_request(value: Any) -> int | None:
    """``max_shape="probe"`` (``PROBE_BATCHES`` batches) or ``"probe:N"``: the number of batches to probe; None
    for any other ``max_shape``."""
    if not isinstance(value, str):
        return None
    head, _, count = value.partition(":")
    if head == "probe" and (not count or (count.isdigit() and int(count) > 0)):
        return int(count) if count else PROBE_BATCHES
    raise ConfigurationError(
        f"max_shape={value!r} is not understood. Give the longest batch, (rows, length) or a length, e.g. "
        f"max_shape=1024; or max_shape='probe' to read it from the datamodule or the first {PROBE_BATCHES} "
        "batches of the training loader ('probe:256' for more)."
    )


def _declared_length(owners: Iterable[Any]) -> tuple[int, str] | None:
    for owner in owners:
        for name in DATAMODULE_ATTRIBUTES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{type(owner).__name__}.{name}"
    return None


def probe_loader(loader: Any, size_of: Callable[[Any], BatchSize | None], batches: int) -> Probed:
    """The longest of the first ``batches`` batches of a fresh iterator over ``loader`` (shapes only)."""
    if loader is None or isinstance(loader, (dict, list, tuple)):
        raise ConfigurationError(
            "max_shape='probe' needs one training loader to probe, but the fit has "
            f"{'none' if loader is None else type(loader).__name__ + ' of loaders'}. Declare the longest batch, e.g. "
            "max_shape=1024."
        )
    states = rng_state()
    iterator = iter(loader)
    try:
        if iterator is loader:
            raise ConfigurationError(
                f"max_shape='probe' cannot probe the training data: it is a one-shot iterator "
                f"({type(loader).__name__}) that the probe would consume. Declare the longest batch, e.g. "
                "max_shape=1024, or pass a DataLoader."
            )
        seen: list[BatchSize] = []
        for _, batch in zip(range(batches), iterator, strict=False):
            size = size_of(batch)
            if size is not None:
                seen.append(size)
    finally:
        del iterator  # a DataLoader's workers shut down here
        set_rng_state(states)
    if not seen:
        raise ConfigurationError(
            "max_shape='probe' found no batch with a tensor in the training loader. Declare the longest batch, "
            "e.g. max_shape=1024."
        )
    longest = BatchSize(max(s.rows for s in seen), max(s.length for s in seen))
    shortest = min(s.length for s in seen)
    return Probed(
        longest, f"a probe of {len(seen)} batches of the training loader (lengths {shortest}-{longest.length})"
    )


def probed_max_shape(trainer: Any, size_of: Callable[[Any], BatchSize | None], batches: int) -> Probed:
    """The longest batch this fit will see: the datamodule's (or module's) declared maximum length, else a probe of
    ``batches`` batches of its training loader. Several ranks take the longest any rank found."""
    declared = _declared_length((trainer.datamodule, trainer.lightning_module))
    if declared is not None:
        probed = Probed(BatchSize(0, declared[0]), f"{declared[1]} ({declared[0]})")
    else:
        probed = probe_loader(trainer.train_dataloader, size_of, batches)
    if trainer.world_size > 1:
        mine = torch.tensor([probed.size.rows, probed.size.length], device=trainer.strategy.root_device)
        sizes = trainer.strategy.all_gather(mine)
        rows, length = (int(v) for v in sizes.reshape(-1, 2).max(dim=0).values)
        probed = Probed(BatchSize(rows, length), probed.source + ", the longest of every rank's")
    return probed
