"""Memory budgets: parse what users write ("20GiB", 0.8, 12_000_000) into one checkable limit."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.formatting import format_bytes

if TYPE_CHECKING:
    import torch

    from lightning_ckpt.plan.format import Plan

__all__ = ["Budget", "RequestedBudget", "device_type", "host_memory", "parse_bytes", "resolve_budget", "within_host"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# A size string without a unit below this is taken for a forgotten unit ("2" for "2GiB") and refused; bytes given as a
# number are taken as written.
_LEAST_UNITLESS_BYTES = 2**20

# Without a budget on CUDA this share is left free: fragmentation and other contexts make the last percent unusable.
CUDA_SAFETY_MARGIN = 0.10


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
        if value != value.strip():
            # Refused rather than stripped: stray spaces mean a config line cut wrong, and the file would record it.
            raise ConfigurationError(
                f"{what}={value!r} has spaces around the size. Write it without them, e.g. {value.strip()!r}."
            )
        m = _PATTERN.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigurationError(
                f"{what}={value!r} is not a memory size. Write a number with an optional unit, in any case: "
                "B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024), e.g. "
                "'20GiB', '20G', '20gb' or '512MB'; or a fraction of device memory as a number, like 0.8."
            )
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if _UNITS[m.group(2).lower()] == 1 and not n.is_integer():
            # "1.5" is no number of bytes, and a string is never a fraction: it must not become a 1-byte budget.
            raise ConfigurationError(
                f"{what}={value!r} is a string without a unit, read as bytes, but is not a whole number of bytes. "
                "A fraction of device memory is a number, not a string (max_memory=0.8); a size has a unit, e.g. "
                "'1.5GiB'."
            )
        if not m.group(2) and n < _LEAST_UNITLESS_BYTES:
            # "2" is 2 bytes: no step fits, and the user meant a unit.
            raise ConfigurationError(
                f"{what}={value!r} has no unit, so it reads as {value} bytes, which no training step fits in. "
                f"Give the unit, e.g. '{value}GiB' or '{value}GB'; a fraction of device memory is a number (0.8)."
            )
    else:
        raise ConfigurationError(f"{what} must be bytes, a size string or a fraction, but got {type(value).__name__}.")
    if n <= 0:
        raise ConfigurationError(f"{what} must be positive, but got {value!r}.")
    if n < 1:  # "0.8" read as bytes would be a budget of 0 bytes
        raise ConfigurationError(
            f"{what}={value!r} is less than one byte. A fraction of device memory is a number, not a string "
            "(max_memory=0.8); a size has a unit, e.g. '20GiB'."
        )
    return int(n)


@dataclass(frozen=True)
class Budget:
    """The memory limit a plan must respect. kind ``peak``: the step's peak bytes (everything) <= limit_bytes. kind
    ``activation``: the step's activation bytes <= limit_bytes (a fraction of the no-checkpointing activation memory,
    resolved once that is known). kind ``none``: no limit; the fastest plan wins."""

    kind: str
    limit_bytes: int | None = None
    fraction: float | None = None
    description: str = ""

    def fits(self, peak_bytes: int | None, activation_bytes: int | None) -> bool:
        value = self.value_of(peak_bytes, activation_bytes)
        return self.kind == "none" or self.limit_bytes is None or (value is not None and value <= self.limit_bytes)

    def value_of(self, peak_bytes: int | None, activation_bytes: int | None) -> int | None:
        """The number this budget constrains: peak or activation bytes."""
        return activation_bytes if self.kind == "activation" else peak_bytes

    def within(self, cap_bytes: int, where: str) -> tuple[Budget, str | None]:
        """This budget, its peak clamped to what the device lets this process allocate (``cap_bytes``), and the line
        that says so: plans above the cap would still run and fail. No budget means the card's own."""
        if self.kind == "none" or self.limit_bytes is None:
            return Budget("peak", int(cap_bytes), None, f"{where}: {format_bytes(cap_bytes)} peak"), None
        if self.kind != "peak" or self.limit_bytes <= cap_bytes:
            return self, None
        return self._clamped(int(cap_bytes), where, f"what this process may allocate on {where}")

    def _clamped(self, cap_bytes: int, where: str, above: str, after: str = "") -> tuple[Budget, str]:
        note = (
            f"lightning_ckpt: max_memory ({format_bytes(self.limit_bytes)}) is above {above} "
            f"({format_bytes(cap_bytes)}){after}; the budget is clamped to {format_bytes(cap_bytes)}"
        )
        description = f"{format_bytes(cap_bytes)} peak, clamped from {self.description} to {where}"
        return Budget("peak", cap_bytes, self.fraction, description), note

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RequestedBudget:
    """The budget a run asks for, parsed once from ``max_memory`` / ``activation_budget`` and compared by value
    (``"20GiB"`` and ``21474836480`` are one request), so plan reuse and the CLI's report can never disagree."""

    kind: Literal["default", "peak", "device_fraction", "activation"] = "default"
    """``default``: nothing asked (on CUDA the memory available less 10%, elsewhere no limit); ``peak``: bytes
    of peak memory; ``device_fraction``: a share of the CUDA device's memory; ``activation``: a share of the
    no-checkpointing activation memory."""
    value: int | float | None = None
    """Bytes for ``peak`` (an int), the share in (0, 1] for the fractions (a float), None for ``default`` - and
    for a saved budget that records its kind but not its size (a hand-edited plan file; see ``recorded``)."""
    written: int | float | str | None = field(default=None, compare=False)
    """The argument as the user wrote it (``"20GiB"``), for messages and plan files; not part of equality."""

    @classmethod
    def of(
        cls, max_memory: int | float | str | RequestedBudget | None = None, activation_budget: float | None = None
    ) -> RequestedBudget:
        """``max_memory`` itself when the caller already parsed it (the callback does), else ``parse``."""
        if isinstance(max_memory, RequestedBudget):
            if activation_budget is not None:
                raise ConfigurationError(
                    f"Pass the budget once: got a parsed budget ({max_memory.written!r}) and also "
                    f"activation_budget={activation_budget!r}."
                )
            return max_memory
        return cls.parse(max_memory, activation_budget)

    @classmethod
    def parse(
        cls, max_memory: int | float | str | None = None, activation_budget: float | None = None
    ) -> RequestedBudget:
        """The request behind the arguments; ``ConfigurationError`` for any budget ``resolve_budget`` would refuse."""
        validate_budget_args(max_memory, activation_budget)
        if activation_budget is not None:
            return cls("activation", float(activation_budget), activation_budget)
        if max_memory is None:
            return cls()
        if _is_device_fraction(max_memory):
            return cls("device_fraction", float(max_memory), max_memory)
        return cls("peak", parse_bytes(max_memory), max_memory)

    @classmethod
    def of_plan(cls, plan: Plan) -> RequestedBudget | None:
        """What ``plan`` was tuned for, from its ``provenance.budget``; None when it records no budget (a
        hand-written plan), which is then not compared."""
        return cls.from_saved(plan.provenance.budget)

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any] | None) -> RequestedBudget | None:
        """The request a saved ``provenance.budget`` (``Budget.to_dict()`` plus the callback's ``requested``)
        stands for; None when there is none or not even its kind can be read."""
        if not saved:
            return None
        kind, fraction, limit = saved.get("kind"), saved.get("fraction"), saved.get("limit_bytes")
        with contextlib.suppress(ConfigurationError, TypeError, ValueError):
            if kind == "activation" and fraction is not None:
                return cls.parse(activation_budget=fraction)
            if kind != "activation" and "requested" in saved:  # the callback's: the max_memory argument as given
                return cls.parse(saved["requested"])
            # Written by tune() itself, which records only the resolved limit.
            if kind == "none":
                return cls()
            if kind == "peak" and fraction is not None:
                return cls.parse(float(fraction))
            if kind == "peak" and limit is not None:
                return cls.parse(limit)
        return cls(kind) if kind in ("peak", "activation") else None  # its size is not recorded

    @property
    def recorded(self) -> bool:
        """False for a saved budget whose size is not recorded: it equals no request, and is not adopted."""
        return self.kind == "default" or self.value is not None

    @property
    def given(self) -> bool:
        return self.kind != "default"

    @property
    def requested_max_memory(self) -> int | float | str | None:
        """``max_memory`` as written, which plan files record as ``provenance.budget["requested"]``."""
        return self._as_written() if self.kind in ("peak", "device_fraction") else None

    def arguments(self) -> dict[str, Any]:
        """``max_memory`` / ``activation_budget`` for ``resolve_budget`` and ``tune``."""
        if self.kind == "activation":
            return {"max_memory": None, "activation_budget": self.value}
        return {"max_memory": self.value, "activation_budget": None}

    def resolve(
        self, *, device: torch.device | str, none_activation_bytes: int | None = None, capacity_bytes: int | None = None
    ) -> Budget:
        """The ``Budget`` this request means on ``device``. ``activation`` needs the no-checkpointing activation
        memory; a share of the device is taken of ``capacity_bytes`` when given (as a plan file recorded it)."""
        if not self.recorded:
            raise ConfigurationError(f"{self.describe()} cannot be resolved: its size is not recorded.")
        if self.kind == "activation":
            if none_activation_bytes is None:
                raise ConfigurationError(
                    "activation_budget needs the no-checkpointing activation memory, which is unknown."
                )
            limit = int(self.value * none_activation_bytes)
            # Both figures: "50% of ... (123.3 MiB)" read as if 123.3 MiB were the no-checkpointing memory.
            share = (
                f"{format_bytes(limit)} of activation memory, {self.value:.0%} of the "
                f"{format_bytes(none_activation_bytes)} without checkpointing"
            )
            return Budget("activation", limit, float(self.value), share)
        if self.kind == "device_fraction":
            if capacity_bytes is not None:
                limit = int(self.value * capacity_bytes)
                share = f"{self.value:.0%} of the recorded {format_bytes(capacity_bytes)} of {device} ({format_bytes(limit)})"
                return Budget("peak", limit, float(self.value), share)
            if device_type(device) != "cuda":
                raise ConfigurationError(
                    f"max_memory={self.value} is a fraction of device memory, but the model is on "
                    f"{device_type(device)}, which has no fixed capacity. Give bytes (e.g. '8GiB') or use "
                    "activation_budget=... instead."
                )
            import torch  # only for a CUDA device: a plan file is re-planned for a CPU budget without torch

            if not torch.cuda.is_available():
                raise ConfigurationError(
                    f"max_memory={self.value} is a fraction of {device}'s memory, but this machine has no CUDA "
                    "device and no capacity was recorded for it. Give bytes instead (e.g. '60GiB')."
                )
            limit = int(self.value * torch.cuda.get_device_properties(device).total_memory)
            return Budget("peak", limit, float(self.value), f"{self.value:.0%} of {device} ({format_bytes(limit)})")
        if self.kind == "peak":
            limit = int(self.value)
            return Budget("peak", limit, None, f"{format_bytes(limit)} peak")
        if device_type(device) == "cuda":
            limit = int((1 - CUDA_SAFETY_MARGIN) * cuda_available_bytes(device))
            less = f"memory available to this process less {CUDA_SAFETY_MARGIN:.0%} ({format_bytes(limit)})"
            return Budget("peak", limit, None, less)
        return Budget("none", None, None, "no budget (fastest plan wins)")

    def describe(self) -> str:
        """How a user would write it, e.g. ``max_memory='20GiB' (20.0 GiB)`` or ``activation_budget=0.5``."""
        if self.kind == "default":
            return "no budget (the default)"
        if self.value is None:
            return f"a {self.kind} budget of unrecorded size"
        if self.kind == "activation":
            return f"activation_budget={self.value:g}"
        if self.kind == "device_fraction":
            return f"max_memory={self.value:g} ({self.value:.0%} of device memory)"
        return f"max_memory={self._as_written()!r} ({format_bytes(self.value)})"

    def _as_written(self) -> int | float | str | None:
        return self.written if self.written is not None else self.value


def _is_device_fraction(max_memory: object) -> bool:
    """``max_memory=0.8`` is a share of the device; ``1`` (an int) is one byte, ``1.0`` the whole device."""
    return isinstance(max_memory, float) and 0 < max_memory <= 1


def device_type(device: torch.device | str) -> str:
    """``"cuda"`` for ``torch.device("cuda:1")`` and for ``"cuda:1"`` alike."""
    return device.type if not isinstance(device, str) else device.partition(":")[0]


# Where a container's memory limit is (cgroup v2, then v1): a process there cannot use the host's whole memory.
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_memory() -> tuple[int, str] | None:
    """The memory a process on this machine can have, and where that figure comes from: the host's physical memory,
    or the container's limit (cgroup) when that is lower; None where neither can be read."""
    total: tuple[int, str] | None = None
    with contextlib.suppress(AttributeError, ValueError, OSError):
        total = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total[0]):
            total = (int(text), f"this container's memory limit ({path})")
        break
    return total


def within_host(budget: Budget) -> tuple[Budget, str | None]:
    """``budget`` on the CPU, its peak clamped to ``host_memory`` (with the line that says so) where it asks for more:
    a peak no process here can reach constrains nothing, and a search for it only measures plans to choose none."""
    host = host_memory()
    if host is None or budget.kind != "peak" or budget.limit_bytes is None or budget.limit_bytes <= host[0]:
        return budget, None
    cap, where = host
    return budget._clamped(cap, where, where, ", which no step on this CPU can exceed")


def cuda_available_bytes(device: torch.device | str) -> int:
    """What this process can allocate on ``device``: free memory plus what its own allocator already holds
    (other processes and contexts excluded), never above a cap set with ``set_per_process_memory_fraction``."""
    import torch  # a CUDA device: torch is imported already

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
    if isinstance(activation_budget, str):
        raise ConfigurationError(
            f"activation_budget must be a number, a fraction of the no-checkpointing activation memory, but got the "
            f"string {activation_budget!r}. Write activation_budget={activation_budget.strip()} without quotes (YAML: "
            "unquoted)."
        )
    if activation_budget is not None:
        number = isinstance(activation_budget, (int, float)) and not isinstance(activation_budget, bool)
        if number and 1 < activation_budget <= 100:
            raise ConfigurationError(
                f"activation_budget is a fraction of the no-checkpointing activation memory in (0, 1], but got "
                f"{activation_budget!r}. For {activation_budget:g}% write activation_budget={activation_budget / 100:g}."
            )
        if not number or not 0 < activation_budget <= 1:
            raise ConfigurationError(
                f"activation_budget is a fraction of the no-checkpointing activation memory in (0, 1], "
                f"but got {activation_budget!r}. Use e.g. activation_budget=0.5."
            )
    if max_memory is None or _is_device_fraction(max_memory):
        return  # a fraction of device memory is resolved against the device later
    if not isinstance(max_memory, (int, float, str)):
        raise ConfigurationError(
            f"max_memory must be bytes, a size string or a fraction, but got {type(max_memory).__name__} "
            f"{max_memory!r}. Use e.g. max_memory='20GiB' or max_memory=0.8."
        )
    parse_bytes(max_memory)


def resolve_budget(
    max_memory: int | float | str | None,
    activation_budget: float | None,
    *,
    device: torch.device | str,
    none_activation_bytes: int | None = None,
) -> Budget:
    """Turn the user's budget arguments into a ``Budget`` for ``device`` (``RequestedBudget.parse`` then ``resolve``)."""
    requested = RequestedBudget.parse(max_memory, activation_budget)
    return requested.resolve(device=device, none_activation_bytes=none_activation_bytes)
