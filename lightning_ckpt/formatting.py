"""How the package writes sizes and tables, so a figure reads the same on every page: fixed-width tables are
``tabulate``'s; markdown tables (TensorBoard's Text tab) need no widths, and unpadded rows keep the logged text small.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tabulate import tabulate

__all__ = ["MIB", "count", "format_bytes", "markdown_table", "offload_phrase", "table"]

MIB = 1024 * 1024
_UNITS = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024**3, "TiB": 1024**4}


def count(n: int, noun: str) -> str:
    """``"1 plan"``, ``"2 plans"``: a count and its noun, agreeing."""
    return f"{n} {noun if n == 1 else noun + 's'}"


def format_bytes(n: float | None, *, unit: str | None = None, digits: int = 1, suffix: bool = True) -> str:
    """``n`` bytes as text: in the largest binary unit it reaches (``1.5 GiB``), or in ``unit`` for a table column
    of one unit (``format_bytes(n, unit="MiB", suffix=False)`` is ``"12.3"``). ``None`` (nothing recorded): ``-``."""
    if n is None:
        return "-"
    if unit is None:
        unit = next((u for u, size in _UNITS.items() if abs(n) < size * 1024), "TiB")
    if unit not in _UNITS:
        raise ValueError(f"format_bytes: unit {unit!r} is none of {', '.join(_UNITS)}")
    if unit == "B":
        return f"{int(n)} B" if suffix else str(int(n))
    text = f"{n / _UNITS[unit]:.{digits}f}"
    return f"{text} {unit}" if suffix else text


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Sequence[int] = (),
    rule: bool = False,
    indent: str = "",
) -> str:
    """Aligned columns two spaces apart. ``right``: the columns of numbers, right-aligned (header too) so digits
    line up; the rest left-aligned. ``rule``: a line of dashes under the header, as wide as the table."""
    align = ["right" if i in right else "left" for i in range(len(headers))]
    # The header goes in as a row: tabulate widens a header's column by two spaces, which the rows do not need.
    cells = [list(map(str, headers)), *[list(map(str, r)) for r in rows]]
    text = tabulate(cells, tablefmt="plain", colalign=align, disable_numparse=True)
    lines = [(indent + line).rstrip() for line in text.splitlines()]
    if rule and lines:
        lines.insert(1, indent + "-" * (max(len(line) for line in lines) - len(indent)))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; cells are written as given (escape ``|`` in text that may hold one)."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def offload_phrase(figures: Mapping[str, Any]) -> str:
    """``offload_figures`` in words: what the offloaded blocks held in host memory, and the transfer they exposed."""
    exposed = [
        f"{1000 * figures[k]:.1f} ms {w}"
        for k, w in (("exposed_predicted_seconds", "predicted"), ("exposed_measured_seconds", "measured"))
        if figures.get(k) is not None
    ]
    return (
        f"offloads {format_bytes(figures.get('offloaded_bytes'))} to a {format_bytes(figures.get('host_pool_bytes'))} "
        f"pinned host pool, exposed transfer {', '.join(exposed) or 'not predicted'}"
    )
