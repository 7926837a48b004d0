"""Which device type a simulated card (``lightning_ckpt.testing.SimulatedCard``) stands in for, if any: shared by every
stage (``measure.device_memory`` reads its allocator, offload copies off a device with memory of its own)."""

from __future__ import annotations

from typing import Any

__all__ = ["install_card", "installed_card", "uninstall_card"]

_CARDS: dict[str, Any] = {}


def install_card(device_type: str, card: Any) -> None:
    """Make ``card`` the allocator of ``device_type`` (``SimulatedCard.__enter__`` calls this)."""
    _CARDS[device_type] = card


def uninstall_card(device_type: str, card: Any) -> None:
    if _CARDS.get(device_type) is card:
        del _CARDS[device_type]


def installed_card(device_type: str) -> Any:
    return _CARDS.get(device_type)
