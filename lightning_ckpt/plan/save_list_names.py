"""The op save-lists' names without their ops (``plan.policies``; a test keeps them in step): read without torch."""

from __future__ import annotations

from lightning_ckpt.errors import PlanError

__all__ = ["SAVE_LIST_NAMES", "check_save_list_name"]

SAVE_LIST_NAMES: tuple[str, ...] = ("save_matmuls", "save_matmuls_alternate", "save_attention")


def check_save_list_name(name: str) -> None:
    """Refuse a save-list name that ``plan.policies`` does not define."""
    if name not in SAVE_LIST_NAMES:
        raise PlanError(
            f"Unknown op save-list {name!r}. Known save-lists: {', '.join(sorted(SAVE_LIST_NAMES))}. "
            "Use one of these names in BlockPlan(mode='ops', save_list=...)."
        )
