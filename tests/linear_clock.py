"""A machine whose speed the test sets: a clock that moves only while ``nn.Linear`` layers run.

On a shared CPU a real search's step times follow whatever else the machine runs, and with them which plans the time
model prunes, how many plans the search measures and which one it keeps: a test that asserts those on real timings
tests the machine's load. Under ``LinearClock.installed()`` every call of a Linear's forward (a recompute's too) takes
``cost`` seconds and nothing else takes any time, both for the steps the search times (``TuneConfig.clock``) and for
the blocks the profile times alone (``memory.block_times``), so a plan's step time is the number of Linear calls it
runs and the time model's predictions agree exactly with the steps the search measures: the same search on any
machine, however busy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from unittest import mock

from torch import nn

from lightning_ckpt.memory import block_times


class LinearClock:
    """Seconds that advance by ``cost`` at each call of an ``nn.Linear``'s forward, and at nothing else."""

    def __init__(self, cost: float = 1e-3) -> None:
        self.cost = cost
        self.now = 0.0
        self.linear_calls = 0

    def __call__(self) -> float:
        return self.now

    def _tick(self, module: nn.Module, args: object) -> None:
        if isinstance(module, nn.Linear):
            self.linear_calls += 1
            self.now = self.linear_calls * self.cost

    @contextlib.contextmanager
    def installed(self) -> Iterator[LinearClock]:
        """Count Linear calls in this process and time the profile's blocks by them; pass ``clock=self`` to the
        search (``TuneConfig.clock``) for its steps."""
        handle = nn.modules.module.register_module_forward_pre_hook(self._tick)
        try:
            with mock.patch.object(block_times, "time", SimpleNamespace(perf_counter=self)):
                yield self
        finally:
            handle.remove()
