"""Reading a plan file's metadata and laying out what ``show`` and ``diff`` print about it.

A plan's provenance reads a mistyped section as absent; inside a section, every reader here tolerates absent or mistyped
keys. The budget is read into fixed keys once (``budget_values``), so ``show --json``, ``diff --json`` and ``diff
--exit-code`` agree on what a budget is and when two are the same."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_ckpt.budget import RequestedBudget
from lightning_ckpt.errors import LightningCkptError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.plan.format import library_versions

__all__ = [
    "JSON_FORMAT",
    "budget_key",
    "budget_text",
    "budget_value_text",
    "budget_values",
    "bytes_text",
    "kv_text",
    "number",
    "rate_text",
    "ratio_text",
    "versions_text",
]

# The version of the ``show --json`` / ``diff --json`` objects: bumped when a key changes meaning or goes.
JSON_FORMAT = 1


# Cells: "-" where the file records nothing, or something that is not a number.
def rate_text(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "-"


def bytes_text(x: Any) -> str:
    return format_bytes(x) if isinstance(x, (int, float)) else "-"


def ratio_text(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return f"{a / b:.2f}x" if ok else "-"


def kv_text(mapping: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in mapping.items() if v is not None) or "-"


def budget_text(budget: Mapping[str, Any]) -> str:
    if not budget:
        return "-"
    text = str(budget.get("description") or budget.get("kind") or "-")
    if budget.get("requested") is not None:
        text += f" (requested max_memory={budget['requested']!r})"
    return text


def number(x: Any) -> int | float | None:
    """A JSON number, never a bool (``True`` is an ``int`` to Python, not a count to a reader)."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _requested_value(requested: Any) -> Any:
    """The user's max_memory as a value, as the callback parses it: "20GiB" and 21474836480 are the same request."""
    try:
        return RequestedBudget.parse(requested).value
    except LightningCkptError:
        return requested  # not a size: compared as written


def budget_values(budget: Mapping[str, Any]) -> dict[str, Any] | None:
    """``metadata["budget"]`` (``Budget.to_dict()``, plus the callback's ``requested``) with fixed keys."""
    if not budget:
        return None
    return {
        "kind": budget.get("kind"),
        "limit_bytes": number(budget.get("limit_bytes")),
        "fraction": number(budget.get("fraction")),
        "requested": _requested_value(budget.get("requested")),
        "description": budget.get("description"),
    }


def budget_key(values: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    """What two budgets are compared by: their values, never their text; without a limit (hand-written), the
    request, then the description."""
    if values is None:
        return None
    fallback = None
    if values["limit_bytes"] is None and values["kind"] != "none":
        fallback = values["requested"] if values["requested"] is not None else values["description"]
    return values["kind"], values["limit_bytes"], values["fraction"], fallback


def budget_value_text(values: Mapping[str, Any] | None) -> str:
    if values is None:
        return "-"
    kind = values["kind"] or "?"
    if kind == "none":
        return "none (no limit)"
    if values["limit_bytes"] is None:
        requested = values["requested"]
        if isinstance(requested, float) and requested <= 1:
            return f"{kind} (requested {requested:.0%} of device memory)"
        if isinstance(requested, int):
            return f"{kind} (requested {format_bytes(requested)})"
        return f"{kind} ({requested or values['description'] or 'no limit recorded'})"
    of = "of no-checkpointing activation memory" if kind == "activation" else "of device memory"
    share = f" ({values['fraction']:.0%} {of})" if values["fraction"] is not None else ""
    return f"{kind} <= {format_bytes(values['limit_bytes'])}{share}"


def versions_text(versions: Mapping[str, Any]) -> str:
    """Library versions the plan was tuned with, flagging the ones that differ from what is installed."""
    installed = library_versions()
    parts = [
        f"{dist} {version}" + (f" (installed: {now})" if (now := installed.get(dist)) not in (None, version) else "")
        for dist, version in versions.items()
    ]
    return ", ".join(parts) or "-"
