"""Memory budgets: parse what users write ("20GiB", 0.8, 12_000_000) into one checkable limit."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from lightning_ckpt.errors import ConfigurationError

__all__ = ["Budget", "parse_bytes", "resolve_budget", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# Without a budget on CUDA we leave this share of the device free: the caching allocator's
# fragmentation and other processes' contexts make the last few percent unusable in practice.
CUDA_SAFETY_MARGIN = 0.10


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_bytes(value: int | float | str, *, what: str = "max_memory") -> int:
    """Bytes from an int, or a string such as ``"20GiB"``, ``"512 MB"``, ``"1.5e9"``."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{what} must be bytes or a string like '20GiB', but got {value!r}.")
    if isinstance(value, (int, float)):
        n = float(value)
        if not math.isfinite(n):
            raise ConfigurationError(f"{what} must be a finite number of bytes, but got {value!r}. Use e.g. '20GiB'.")
        if isinstance(value, float) and n > 1 and not n.is_integer():
            raise ConfigurationError(
                f"{what}={value!r} is neither a fraction of device memory (0 < x <= 1) nor a whole number of "
                "bytes. Use e.g. 0.8 (80% of the GPU) or '20GiB'."
            )
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigurationError(
                f"{what}={value!r} is not a memory size. Write a number with an optional unit "
                "(B, KB, MB, GB, KiB, MiB, GiB, TiB), e.g. '20GiB' or '512MB', or a fraction of device memory like 0.8."
            )
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise ConfigurationError(f"{what} must be bytes, a size string or a fraction, but got {type(value).__name__}.")
    if n <= 0:
        raise ConfigurationError(f"{what} must be positive, but got {value!r}.")
    return int(n)


@dataclass(frozen=True)
class Budget:
    """The memory limit a plan must respect.

    kind ``peak``: the step's peak bytes (everything) <= limit_bytes.
    kind ``activation``: the step's activation bytes <= limit_bytes (a fraction of the
    no-checkpointing activation memory, resolved once that is known).
    kind ``none``: no limit; the fastest plan wins.
    """

    kind: str
    limit_bytes: int | None = None
    fraction: float | None = None
    description: str = ""

    def fits(self, peak_bytes: int | None, activation_bytes: int | None) -> bool:
        if self.kind == "none" or self.limit_bytes is None:
            return True
        value = peak_bytes if self.kind == "peak" else activation_bytes
        return value is not None and value <= self.limit_bytes

    def value_of(self, peak_bytes: int | None, activation_bytes: int | None) -> int | None:
        """The number this budget constrains: peak or activation bytes."""
        return activation_bytes if self.kind == "activation" else peak_bytes

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "limit_bytes": self.limit_bytes, "fraction": self.fraction,
                "description": self.description}  # fmt: skip


def cuda_available_bytes(device: torch.device) -> int:
    """What this process can allocate on ``device``: free memory plus what its own allocator already holds
    (other processes and contexts excluded), never above a cap set with ``set_per_process_memory_fraction``."""
    free, total = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        available = min(available, int(getter(device) * total))
    return int(available)


def validate_budget_args(max_memory: int | float | str | None, activation_budget: float | None) -> None:
    """Raise at construction time for any budget a later resolve would refuse."""
    if max_memory is not None and activation_budget is not None:
        raise ConfigurationError(
            f"Give either max_memory ({max_memory!r}) or activation_budget ({activation_budget!r}), not both."
        )
    if activation_budget is not None and (
        isinstance(activation_budget, bool)
        or not isinstance(activation_budget, (int, float))
        or not 0 < activation_budget <= 1
    ):
        raise ConfigurationError(
            f"activation_budget is a fraction of the no-checkpointing activation memory in (0, 1], "
            f"but got {activation_budget!r}. Use e.g. activation_budget=0.5."
        )
    if isinstance(max_memory, float) and 0 < max_memory <= 1:
        return  # a fraction of device memory; resolved against the device later
    if max_memory is not None and not isinstance(max_memory, (int, float, str)):
        raise ConfigurationError(
            f"max_memory must be bytes, a size string or a fraction, but got {type(max_memory).__name__} "
            f"{max_memory!r}. Use e.g. max_memory='20GiB' or max_memory=0.8."
        )
    if max_memory is not None:
        parse_bytes(max_memory)


def resolve_budget(
    max_memory: int | float | str | None,
    activation_budget: float | None,
    *,
    device: torch.device,
    none_activation_bytes: int | None = None,
) -> Budget:
    """Turn the user's budget arguments into a ``Budget`` for ``device``."""
    validate_budget_args(max_memory, activation_budget)
    if activation_budget is not None:
        if none_activation_bytes is None:
            raise ConfigurationError(
                "activation_budget needs the no-checkpointing activation memory, which is unknown."
            )
        limit = int(activation_budget * none_activation_bytes)
        return Budget(
            "activation",
            limit,
            float(activation_budget),
            f"{activation_budget:.0%} of no-checkpointing activation memory ({format_bytes(limit)})",
        )
    if isinstance(max_memory, float) and 0 < max_memory <= 1:
        if device.type != "cuda":
            raise ConfigurationError(
                f"max_memory={max_memory} is a fraction of device memory, but the model is on {device.type}, which "
                "has no fixed capacity. Give bytes (e.g. '8GiB') or use activation_budget=... instead."
            )
        total = torch.cuda.get_device_properties(device).total_memory
        limit = int(max_memory * total)
        return Budget("peak", limit, float(max_memory), f"{max_memory:.0%} of {device} ({format_bytes(limit)})")
    if max_memory is not None:
        limit = parse_bytes(max_memory)
        return Budget("peak", limit, None, f"{format_bytes(limit)} peak")
    if device.type == "cuda":
        available = cuda_available_bytes(device)
        limit = int((1 - CUDA_SAFETY_MARGIN) * available)
        return Budget(
            "peak",
            limit,
            None,
            f"memory available to this process less {CUDA_SAFETY_MARGIN:.0%} ({format_bytes(limit)})",
        )
    return Budget("none", None, None, "no budget (fastest plan wins)")
