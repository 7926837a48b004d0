"""Which torch lightning_ckpt is tested with, and the features that need a newer one: as Lightning does, a wide range,
never refused at import; a feature is refused only where it is used, on a torch where it is known to be wrong."""

from __future__ import annotations

import os
import re
import warnings

import torch

from lightning_ckpt.errors import UnsupportedVersionError

__all__ = [
    "QUIET_ENV",
    "TORCH_NEWEST_TESTED",
    "TORCH_NEXT_MAJOR",
    "TORCH_OLDEST",
    "require_torch",
    "torch_version",
    "warn_if_untested",
]

# Keep in step with the torch requirement in pyproject.toml and the CI legs (tests check both).
TORCH_OLDEST = (2, 6)  # inclusive; the oldest CI leg
TORCH_NEWEST_TESTED = (2, 15)  # the newest CI leg; newer minors warn once at import
TORCH_NEXT_MAJOR = 3  # exclusive upper bound of the declared range
QUIET_ENV = "LIGHTNING_CKPT_ALLOW_UNTESTED_TORCH"  # "1" silences the import warning (e.g. on a nightly)

_warned = False


def torch_version(version: str | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of torch, or None for a version string with no numbers (a custom build)."""
    found = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", found)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def warn_if_untested(version: str | None = None) -> bool:
    """Warn once when torch is outside the tested range; never raise. Returns whether it warned."""
    global _warned
    found = str(torch.__version__ if version is None else version)
    parsed = torch_version(found)
    if parsed is not None and TORCH_OLDEST <= parsed <= TORCH_NEWEST_TESTED:
        return False
    if _warned or os.environ.get(QUIET_ENV, "") not in ("", "0"):
        return False
    _warned = True
    if parsed is not None and parsed < TORCH_OLDEST:
        where = f"older than the oldest supported torch ({_text(TORCH_OLDEST)})"
        fix = f"pip install 'torch>={_text(TORCH_OLDEST)}'"
    else:
        where = f"newer than the newest torch lightning_ckpt is tested with ({_text(TORCH_NEWEST_TESTED)})"
        fix = f"report what differs, or pin 'torch<={_text(TORCH_NEWEST_TESTED)}.*' for a tested setup"
    warnings.warn(
        f"lightning_ckpt: found torch {found}, {where}. It uses torch internals (memory tracking, "
        "selective-checkpoint policies, the compile memory budget) that can change between minor releases, so "
        f"check the first plan's measured figures; {fix}. Set {QUIET_ENV}=1 to silence this warning.",
        UserWarning,
        stacklevel=2,
    )
    return True


def require_torch(minimum: tuple[int, int], feature: str, why: str, fix: str) -> None:
    """Refuse ``feature`` on a torch older than ``minimum``: called where the feature is used, never at import."""
    found = torch_version()
    if found is None or found >= minimum:
        return
    raise UnsupportedVersionError(
        f"{feature} needs torch>={_text(minimum)}, but found torch {torch.__version__}: {why} "
        f"Fix: pip install 'torch>={_text(minimum)}', or {fix}."
    )


warn_if_untested()
