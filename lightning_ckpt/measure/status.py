"""The status vocabulary of one measured candidate, shared by measurements, trial records and reports."""

from __future__ import annotations

import enum

__all__ = ["TrialStatus"]


class TrialStatus(str, enum.Enum):
    """What happened to a candidate. A ``str`` so records compare and serialise as plain strings."""

    OK = "ok"  # ran within budget
    OVER_BUDGET = "over_budget"  # ran, measured over budget
    PRUNED = "pruned"  # predicted over budget (or unable to run), never run
    OOM = "oom"  # ran out of memory (or over the budget where no allocator enforces it)
    INVALID = "invalid"  # the plan cannot run on this model (CheckpointError, PlanError, ApplyError)
    ERROR = "error"  # anything else: a bug, reported with its traceback
    CONFLICT = "conflict"  # under torch.compile: graph breaks or the recompile limit (compile.py)

    def __str__(self) -> str:  # Enum's ``format()`` uses it too
        return self.value

    @property
    def severity(self) -> int:
        """Worst first: a trial measured on several ranks is as bad as its worst rank."""
        return _SEVERITY.index(self.value)

    @property
    def ran(self) -> bool:
        """A step ran to the end, so the memory and speed figures are real."""
        return self in (TrialStatus.OK, TrialStatus.OVER_BUDGET)

    @property
    def failed(self) -> bool:
        return self in (TrialStatus.OOM, TrialStatus.INVALID, TrialStatus.ERROR)


_SEVERITY = ("error", "invalid", "oom", "conflict", "over_budget", "pruned", "ok")
