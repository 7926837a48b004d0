"""Refuse, at import, a torch that lightning_ckpt was not tested with.

lightning_ckpt reaches into torch internals that change between minor releases without notice:
``torch.distributed._tools.mem_tracker`` (CPU memory), ``torch._functorch.config`` (PT2's
activation memory budget), ``torch.utils.checkpoint``'s selective-checkpoint dispatch modes and
``torch.distributed._composable``'s registry. On another minor version these can fail late (in
the middle of tuning) or, worse, measure the wrong thing silently; a clear error at import is better.
"""

from __future__ import annotations

import os
import re
import warnings

import torch

from lightning_ckpt.errors import UnsupportedVersionError

# Keep in step with the torch requirement in pyproject.toml (a test checks they agree).
TORCH_MIN = (2, 13)  # inclusive
TORCH_BELOW = (2, 14)  # exclusive
ALLOW_ENV = "LIGHTNING_CKPT_ALLOW_UNTESTED_TORCH"


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_torch_version(version: str | None = None) -> None:
    """Raise ``UnsupportedVersionError`` unless torch is in the tested range; ``ALLOW_ENV=1`` makes it a warning."""
    found = str(torch.__version__ if version is None else version)
    parsed = _major_minor(found)
    if parsed is not None and TORCH_MIN <= parsed < TORCH_BELOW:
        return
    supported = f">={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"
    message = (
        f"lightning_ckpt needs torch{supported} (the versions it is tested with), but found torch {found}. "
        "It uses torch internals (memory tracking, selective-checkpoint policies, the compile memory budget) that "
        f"change between minor releases. Install a supported torch, e.g. pip install 'torch{supported}', or set "
        f"{ALLOW_ENV}=1 to try this torch anyway (measurements and plans may then be wrong)."
    )
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        warnings.warn(message, stacklevel=3)
        return
    raise UnsupportedVersionError(message)


check_torch_version()
