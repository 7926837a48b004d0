"""The callback's ``plan_path``: read once per fit, written atomically by rank 0, and never over another run's plan.

Two runs tuning into one file must not both believe their plan is there: the file's content is noted when
a fit reads it (or last wrote it), and a save that finds it changed keeps the other run's plan and says so.

The file is a by-product; the training run is what the user came for. A save that fails (a full disk, a
directory made read-only after the fit started, a failing rename) never stops the fit: the plan stays applied,
in memory and in the callback's ``state_dict`` (so in Lightning checkpoints), the previous file is intact (the
write is atomic), and one warning per fit says where the plan would have gone and why it could not. Later saves
still try, and the first that works says so.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

from lightning_ckpt.errors import ConfigurationError, PlanFileChangedError
from lightning_ckpt.plan.file import plan_file_version
from lightning_ckpt.plan.format import Plan

__all__ = ["PlanFile", "warn_each_fit"]


class PlanFile:
    """``plan_path`` over the fits of one callback."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _check_writable(self.path)
        self._version: str | None = None  # the content when last read or written here
        self.lost = False  # another run wrote it meanwhile: never write over it this fit
        self.wrote = False
        self.failed: str | None = None  # why the last save could not write (OSError), None once one works

    def open_fit(self) -> None:
        """Note the file's content before it is loaded: a save by another run after this is then seen as a change."""
        self.lost = False
        self.failed = None
        self._version = plan_file_version(self.path)

    def load(self) -> Plan | None:
        """The saved plan, if any (its budget, conditions and fingerprint are checked by ``reuse``)."""
        return Plan.load(self.path) if self.path.exists() else None

    def save(self, plan: Plan) -> bool:
        """Write ``plan`` unless another run wrote the file since this fit read it; False (with a warning) if so."""
        if self.lost:
            return False
        try:
            plan.save(self.path, unchanged_since=self._version)
        except PlanFileChangedError as err:
            self.lost = True
            warn_each_fit(
                f"lightning_ckpt: {self.path} was written by another run while this one was tuning: it now "
                f"holds {err.held}, which is kept. This run trains with its own plan {plan.describe()} (digest "
                f"{plan.digest()}), which was not saved. Give each run its own plan_path, or tune once and pass "
                "the file to the other runs as plan=."
            )
            return False
        except OSError as err:
            if self.failed is None:
                warn_each_fit(
                    f"lightning_ckpt: the plan file {self.path} could not be written ({type(err).__name__}: "
                    f"{err.strerror or err}). Training goes on with plan {plan.describe()} (digest {plan.digest()}), "
                    "kept in memory and in the callback's state (Lightning checkpoints carry it); any earlier file "
                    "there is intact. Free the space or fix the directory's permissions: the next save (after the "
                    "guard's steps, or the next fit) tries again."
                )
            self.failed = f"{type(err).__name__}: {err.strerror or err}"
            return False
        if self.failed is not None:
            rank_zero_warn(f"lightning_ckpt: the plan file {self.path} was written after all ({plan.describe()}).")
            self.failed = None
        self._version = plan.file_version()
        return True


def warn_each_fit(message: str) -> None:
    """``rank_zero_warn`` shown on every fit, not once per process: entering ``catch_warnings`` resets the
    'already shown' registry, while the user's own filters (e.g. ``ignore``) still apply."""
    with warnings.catch_warnings():
        rank_zero_warn(message)


def _check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"plan_path={str(path)!r} cannot be written: {str(probe)!r} is not a writable directory. "
            "Choose a plan_path in a directory you can write to."
        )
