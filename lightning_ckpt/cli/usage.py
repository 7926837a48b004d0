"""What a command line can get wrong, and the exit codes every command shares: a file that is not a well-formed plan (a
``PlanError``) exits 2 as a ``UsageError`` does, so a crash never reads as a verdict; a refused plan or model (any other
``LightningCkptError``) exits 1."""

from __future__ import annotations

from pathlib import Path

from lightning_ckpt.plan.format import Plan

__all__ = ["EXIT_DIFFERENT", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "UsageError", "load_plan"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2
EXIT_DIFFERENT = 1  # diff --exit-code, as diff(1) and `git diff --exit-code`


class UsageError(Exception):
    """The command line names something that is not there (exit code 2, like argparse's own errors)."""


def load_plan(path: str) -> Plan:
    """The plan file at ``path``; a path that is not a file is the user's mistake (``UsageError``), not a bad plan."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"plan file {path!r} does not exist. Check the path (tuning writes it to plan_path=...).")
    if p.is_dir():
        raise UsageError(f"{path!r} is a directory; give the path of a plan JSON file inside it.")
    return Plan.load(p)  # a binary, empty or malformed file is a PlanError naming the file and the field
