"""Where a search's time went: seconds by phase, and the same in plain training steps (a search is worth its cost
only against the steps it makes faster). Each phase is timed where it runs (``Phases.timing``); what no phase claims
is ``other`` (Python between phases, collection, synchronisation), so the phases add up to the search's wall time.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PHASES", "Phases", "SearchCost"]

# The phases in the order a search runs them (a compiled search's compiles are taken out of the phase they ran in).
PHASES = (
    "write_check",
    "profile",
    "optimizer_step",
    "warm_up",
    "trials",
    "confirmation",
    "hold_out",
    "whole_check",
    "compile",
    "re_planning",
    "other",
)


class Phases:
    """A running account of one search's phases, by ``clock`` (``TuneConfig.clock``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started = clock()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.seconds[phase] += self.clock() - t0

    def moved(self, seconds: float, source: str, to: str) -> None:
        """``seconds`` of ``source`` were really ``to``'s (a compile inside the trials)."""
        seconds = min(seconds, self.seconds.get(source, 0.0))
        if seconds > 0:
            self.seconds[source] -= seconds
            self.seconds[to] += seconds

    def cost(self, plain_step: float | None) -> SearchCost:
        """The account so far, ``other`` being what no phase claimed."""
        total = self.clock() - self.started
        seconds = {p: s for p in PHASES if (s := self.seconds.get(p, 0.0)) > 0}
        seconds["other"] = max(0.0, total - sum(v for k, v in seconds.items() if k != "other"))
        return SearchCost(total_seconds=total, seconds=seconds, plain_step_seconds=plain_step)


@dataclass(frozen=True)
class SearchCost:
    """A search's wall time by phase (``seconds``, which add up to ``total_seconds``) and, where the plain training
    step is known, in plain steps: how many steps without checkpointing the same time would have trained."""

    total_seconds: float
    seconds: Mapping[str, float] = field(default_factory=dict)
    plain_step_seconds: float | None = None

    @property
    def plain_steps(self) -> float | None:
        return self.total_seconds / self.plain_step_seconds if self.plain_step_seconds else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "plain_steps": self.plain_steps}
