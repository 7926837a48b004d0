"""The search's phases one at a time, as ``tune`` runs them (``search.pipeline``), for tests that drive a search
with a fake runner and look between the phases: the loop (``run``), the confirmation (``confirm``) and the
conclusion (``result``), over one ledger."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import optuna

from lightning_ckpt.search.choice import choose_plan
from lightning_ckpt.search.confirmation import Confirmed, confirm
from lightning_ckpt.search.distributed import LocalSync
from lightning_ckpt.search.ledger import Ledger, TrialRecord
from lightning_ckpt.search.loop import run_trials
from lightning_ckpt.search.phases import Phases
from lightning_ckpt.search.pipeline import Search, conclude
from lightning_ckpt.search.rounds import beats_by
from lightning_ckpt.search.sampler import sampler_for
from lightning_ckpt.search.space import Candidate
from lightning_ckpt.search.trials import Trials, Workload, run_info


class Study:
    """One search over ``candidates`` with ``runner`` (and ``memory``), or ``workloads``; ``timing``: the time
    model's sampler proposes (else ``config.sampler``, else seeded TPE)."""

    def __init__(self, *, candidates: Sequence[Candidate], space: Any, stacks: Sequence[Any], budget: Any, config: Any,
                 runner: Any = None, memory: Any = None, fingerprint: str | None = None, device_type: str = "cpu",
                 sync: Any = None, progress: Callable | None = None, should_stop: Callable | None = None,
                 samples_per_step: int = 1, run: dict | None = None, timing: Any = None,
                 workloads: Sequence[Workload] | None = None) -> None:  # fmt: skip
        workloads = list(workloads or [Workload(runner, memory, samples_per_step)])
        sync = sync or LocalSync()
        self.candidates, self.space, self.stacks, self.progress = list(candidates), space, list(stacks), progress
        self.runner = workloads[0].runner
        self.trials = Trials(workloads, budget, config, device_type=device_type, sync=sync, should_stop=should_stop)
        distributions = dict(space.distributions(stacks))
        sizes = sorted(w.micro_batch for w in workloads if w.micro_batch is not None)
        if sizes:
            distributions["micro_batch"] = optuna.distributions.CategoricalDistribution(sizes)
        info = run_info(fingerprint, samples_per_step, sync.world_size, run or {})
        self.ledger = Ledger(config=config, run_info=info, budget=budget, distributions=distributions, sync=sync)
        self.proposer = sampler_for(timing, self.ledger, self._unseen, config, predicts_time=timing is not None)
        self.exhaustive = len(self.candidates) <= config.n_trials
        self.none_fits, self.confirmed, self.held_out, self.phases = False, Confirmed(), None, Phases(config.clock)

    def _unseen(self) -> list[Candidate]:
        return [c for c in self.candidates if c.key() not in self.ledger and self.trials.offered(c.plan)]

    @property
    def records(self) -> tuple[TrialRecord, ...]:
        return self.ledger.snapshot()

    @property
    def by_key(self) -> dict[str, TrialRecord]:
        return {t.key(): t for t in self.ledger}

    @property
    def side(self) -> Any:
        return self.confirmed.side

    @property
    def speed_changes(self) -> list[str]:
        return list(self.confirmed.speed_changes)

    @property
    def store(self) -> Any:
        ledger = self.ledger
        return SimpleNamespace(record=ledger.record, sampler=ledger.sampler_study, sampler_name=ledger.sampler_name)

    @property
    def study_name(self) -> str:
        return self.ledger.study_name

    def run(self) -> tuple[TrialRecord, ...]:
        self.none_fits = run_trials(self.ledger, self.trials, self.proposer, self.candidates, self.space, self.stacks,
                                    progress=self.progress).none_fits  # fmt: skip
        return self.records

    def confirm(self) -> None:
        self.confirmed = confirm(self.ledger, self.trials, self.proposer, self.progress, self._search().left)

    def _search(self) -> Search:
        return Search(self.ledger, self.trials, self.proposer, tuple(self.candidates), tuple(self.stacks),
                      self.confirmed, self.none_fits, 0, self.progress, self.phases)  # fmt: skip

    def choose(self) -> tuple[TrialRecord, bool, str]:
        ledger, trials = self.ledger, self.trials
        return choose_plan(ledger.snapshot, trials.budget, tie_tolerance=trials.config.tie_tolerance,
                           on_infeasible=trials.config.on_infeasible, nothing_fits=lambda r: "nothing fits",
                           verify=lambda t: ledger.put(trials.verify(t)),
                           beats=beats_by(self.confirmed.side, trials.config.tie_tolerance))  # fmt: skip

    def result(self, *, extra_steps: int = 0, **kwargs: Any) -> Any:
        result = conclude(self._search(), extra_steps=extra_steps, **kwargs)
        verdict = result.best.metadata["search"].get("verdict")
        self.held_out = SimpleNamespace(**verdict) if verdict and verdict.get("chosen_after") else None
        return result
