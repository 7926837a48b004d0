"""The CUDA caching allocator's options as one value, changed one at a time and written back whole: torch's run-time
setter parses its string as the complete configuration, so setting ``expandable_segments:True`` alone reset a user's
other options. Every change here keeps the others exactly as the user wrote them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from lightning_ckpt.formatting import MIB

__all__ = ["AllocatorOptions", "ENV_VARS", "configured_options", "parse_options"]

# Read by torch when CUDA starts: PYTORCH_ALLOC_CONF from 2.9 on (the older name is still read), before it only
# PYTORCH_CUDA_ALLOC_CONF.
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorOptions:
    """``expandable_segments`` (None: not named, the allocator's default, off), ``max_split_size_mb`` in bytes
    (None: unlimited) and every other option verbatim, in the order written."""

    expandable_segments: bool | None = None
    max_split_bytes: int | None = None
    other: tuple[str, ...] = ()

    def with_expandable(self, on: bool) -> AllocatorOptions:
        return replace(self, expandable_segments=on)

    def with_max_split(self, nbytes: int | None) -> AllocatorOptions:
        return replace(self, max_split_bytes=nbytes)

    def text(self) -> str:
        """The configuration string CUDA reads (``PYTORCH_ALLOC_CONF`` syntax)."""
        parts = list(self.other)
        if self.max_split_bytes is not None:
            parts.append(f"max_split_size_mb:{max(1, -(-self.max_split_bytes // MIB))}")
        if self.expandable_segments is not None:
            parts.append(f"expandable_segments:{self.expandable_segments}")
        return ",".join(parts)


def parse_options(text: str) -> AllocatorOptions:
    expandable: bool | None = None
    max_split: int | None = None
    other: list[str] = []
    # Split at commas outside brackets: ``roundup_power2_divisions:[256:1,512:2]`` is one option.
    for option in filter(None, (part.strip() for part in re.split(r",(?![^\[]*\])", text))):
        key, _, value = option.partition(":")
        key, value = key.strip(), value.strip()
        if key == "expandable_segments":
            expandable = value.lower() == "true"
        elif key == "max_split_size_mb" and re.fullmatch(r"\d+", value):
            max_split = int(value) * MIB
        else:
            other.append(option)
    return AllocatorOptions(expandable, max_split, tuple(other))


def configured_options(environ: Mapping[str, str]) -> AllocatorOptions:
    """What the environment configures (the first of ``ENV_VARS`` set), as CUDA reads it when it starts."""
    for name in ENV_VARS:
        if environ.get(name):
            return parse_options(environ[name])
    return AllocatorOptions()
