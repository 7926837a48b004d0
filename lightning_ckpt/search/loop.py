"""The search loop: ask the sampler, prune what cannot fit or cannot win, measure the rest, tell, put into the ledger.

Ranks move in lockstep: rank 0 proposes (``_Proposals``), every rank measures, records are combined identically
(``Trials.run``). The order, whatever the sampler: the plans a resumed study stored; with the time model, every plan
predicted over budget (or over ``max_host_memory``) and every offload plan predicted to wait longer for its transfer
than it saves in recompute (``TimeModelSampler.offload_loses``; pruned, free); every baseline that can run (the
references, measured whatever ``n_trials``); then every plan when the space is no larger than ``n_trials``, else the
sampler's proposals until ``n_trials`` ran, ``timeout`` passed, the time model's ``nothing_left_can_win`` holds
(the rest pruned, each with its prediction), or ``rounds_first()`` (the search's allowance must keep what the
side-by-side rounds need: a tuned plan they cannot confirm is never chosen, so measuring it would be waste).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from optuna.samplers import BaseSampler

from lightning_ckpt.formatting import count, format_bytes
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.ledger import Ledger, ProgressFn, TrialRecord
from lightning_ckpt.search.sampler import TimeModelSampler
from lightning_ckpt.search.space import Candidate, SearchSpace
from lightning_ckpt.search.trials import Trials

__all__ = ["TrialsRun", "measure", "run_trials"]

log = logging.getLogger(__name__)

# Consecutive proposals of already-known plans after which the loop takes an unseen plan itself: a sampler that has
# seen most of a space redraws known points, and every redraw costs a suggest call whose cost grows with the study
# (54 of 105 s of a 16-layer search went there before this bound).
_MAX_REDRAWS = 2
# Rank 0's word to every rank: time the allowance's unit again (``run_trials``'s ``plain_again``).
_PLAIN_AGAIN = "plain again"


@dataclass(frozen=True)
class TrialsRun:
    """How the loop ended: ``none_fits``, no checkpointing was predicted to fit and, measured alone, fitted (no plan
    can then be faster, so nothing else was measured); ``stopped``, the allowance kept the rest for the rounds."""

    none_fits: bool = False
    stopped: str | None = None


def run_trials(
    ledger: Ledger,
    trials: Trials,
    sampler: BaseSampler,
    candidates: Sequence[Candidate],
    space: SearchSpace,
    stacks: Sequence[Any],
    *,
    progress: ProgressFn | None = None,
    rounds_first: Callable[[], bool] | None = None,
    plain_again: Callable[[], None] | None = None,
) -> TrialsRun:
    """Fill ``ledger`` (see the module docstring). ``rounds_first()``: rank 0's, polled before each tuned plan; the
    first time it would stop the trials, every rank runs ``plain_again()`` (which times the allowance's unit again)
    and it is asked once more."""
    accumulation = {m: w.accumulation for m, w in trials.workloads.items()}
    ledger.open(sampler, trials.predicted_over_budget, accumulation)
    if _none_fits(ledger, trials, sampler, candidates, progress):
        return TrialsRun(none_fits=True)
    leader = trials.sync.is_leader
    proposals = (
        _Proposals(ledger, trials, sampler, candidates, space, stacks, rounds_first, plain_again is not None)
        if leader
        else None
    )
    while True:
        trials.check_stop()
        proposal = proposals.next() if proposals is not None else None
        message = None
        if proposal == _PLAIN_AGAIN:
            message = proposal
        elif proposal is not None:
            cand, _, prune = proposal
            prune = "memory" if trials.predicted_over_budget(cand.plan, cand.micro_batch) else prune
            message = (dict(cand.params), cand.plan.to_dict(), cand.label, cand.baseline, prune)
        message = trials.sync.broadcast(message)
        if message is None:
            break
        if message == _PLAIN_AGAIN:
            plain_again()
            continue
        params, plan, label, baseline, prune = message
        if proposal is None:
            cand = Candidate(params, Plan.from_dict(plan, source="candidate from rank 0"), label, baseline)
        record = measure(ledger, trials, sampler, cand, prune=prune, progress=progress)
        if proposal is not None:
            ledger.tell(proposal[1], record)
    trials.check_stop()
    return TrialsRun(stopped=trials.sync.broadcast(proposals.stopped if proposals is not None else None))


def measure(
    ledger: Ledger,
    trials: Trials,
    sampler: BaseSampler,
    cand: Candidate,
    *,
    prune: str | None = None,
    progress: ProgressFn | None = None,
) -> TrialRecord:
    """Prune or run ``cand`` on every rank, with the time model's prediction, and put its record into the ledger."""
    timed = sampler if isinstance(sampler, TimeModelSampler) else None
    predicted = timed.predict_seconds(cand) if timed is not None else None
    moves = timed.model_for(cand.micro_batch).transfer(cand.plan) if timed is not None else None
    record = trials.run(cand, prune=prune, predicted_seconds=predicted)
    if moves is not None:  # what ``offload_figures`` reports beside the transfer measured
        record = replace(record, extra={**record.extra, "offload_exposed_seconds": moves.exposed_seconds})
    record = ledger.put(record)
    if progress is not None:
        progress(record, trials.budget)
    return record


def _none_fits(
    ledger: Ledger, trials: Trials, sampler: BaseSampler, candidates: Sequence[Candidate], progress: ProgressFn | None
) -> bool:
    """Measure the plan without checkpointing alone, and True when it fits, where the memory model predicts it does
    (rank 0's prediction decides): recompute and offload only add time, so a search would measure plans to confirm
    it. A plan measured over the budget after all (the allocator's reserve on a card) goes on to the search."""
    budget = trials.budget
    if trials.config.search_when_none_fits or budget.kind == "none" or len(trials.workloads) != 1:
        return False
    none = next((c for c in candidates if c.baseline == "none"), None)
    predicted = trials.predicted(none.plan) if none is not None else None
    if not trials.sync.broadcast(predicted is not None and budget.fits(*predicted)) or none is None:
        return False
    trial = measure(ledger, trials, sampler, none, progress=progress)
    if trial.feasible:
        return True
    log.warning(
        "lightning_ckpt: no checkpointing did not fit after all (%s: %s, budget %s), though the memory model "
        "predicted it would: searching the plans that use less memory",
        trial.status.value,
        format_bytes(budget.value_of(trial.peak_bytes, trial.activation_bytes)),
        budget.description,
    )
    return False


class _Proposals:
    """Rank 0's next candidate, each with the sampler's asked trial it is told to (see the module docstring)."""

    def __init__(
        self,
        ledger: Ledger,
        trials: Trials,
        sampler: BaseSampler,
        candidates: Sequence[Candidate],
        space: SearchSpace,
        stacks: Sequence[Any],
        rounds_first: Callable[[], bool] | None = None,
        plain_again: bool = False,
    ) -> None:
        self.ledger, self.trials, self.sampler, self.candidates = ledger, trials, sampler, candidates
        self.space, self.stacks, self.rounds_first, self.plain_again = space, stacks, rounds_first, plain_again
        self.stopped: str | None = None  # why the allowance ended the trials early
        self.timed = sampler if isinstance(sampler, TimeModelSampler) else None
        self.exhaustive = len(candidates) <= trials.config.n_trials
        self.rng = random.Random(trials.config.seed)
        self.baselines: list[Candidate] | None = None  # in the order they are measured, fixed at the first call
        self.pruning_rest = False  # the time model found that nothing left can win

    def unseen(self) -> list[Candidate]:
        return [c for c in self.candidates if c.key() not in self.ledger and self.trials.offered(c.plan)]

    def next(self) -> tuple[Candidate, Any, str | None] | str | None:
        unseen = self.unseen()
        if self.timed is not None:
            over = [c for c in unseen if self.trials.predicted_over_budget(c.plan, c.micro_batch)]
            if over:
                return self._enqueued(over[0], "memory")
            losing = next((c for c in unseen if self.timed.offload_loses(c)), None)
            if losing is not None:
                return self._enqueued(losing, "time")
        if self.baselines is None:
            order = self.timed.ranked(unseen) if self.timed is not None else self.candidates
            self.baselines = [c for c in order if c.baseline is not None]
        baseline = next((c for c in self.baselines if c.key() not in self.ledger and self.trials.offered(c.plan)), None)
        if baseline is not None and not self.trials.out_of_time():
            return self._enqueued(baseline)
        self.baselines = []
        if self.pruning_rest:
            rest = self.timed.ranked(unseen) if self.timed is not None else []
            return self._enqueued(rest[0], "time") if rest else None
        self.trials.check_stop()
        if self.ledger.measured >= self.trials.config.n_trials or self.trials.out_of_time() or not unseen:
            return None  # ``n_trials`` plans measured (pruned ones are free), or out of time
        if self.rounds_first is not None and self.rounds_first():
            if self.plain_again:  # the unit first: the floor it prices decides
                self.plain_again = False
                return _PLAIN_AGAIN
            self.stopped = (
                f"the trials after {count(self.ledger.measured, 'plan')} measured (the rest kept for the rounds)"
            )
            return None
        if self.exhaustive and self.timed is None:
            return self._enqueued(unseen[0])
        if self.timed is not None and self.timed.nothing_left_can_win():
            self.pruning_rest = True
            return self.next()
        return self._sampled(unseen)

    def _sampled(self, unseen: Sequence[Candidate]) -> tuple[Candidate, Any, str | None]:
        """The sampler's proposal; a known, unrunnable (or, by the time model, unable to win) plan is told ``FAIL``
        and asked again, and after ``_MAX_REDRAWS`` in a row an unseen plan is taken at random (one the time model
        cannot predict first: its fallback keeps drawing plans it can)."""
        for _ in range(_MAX_REDRAWS):
            asked = self.ledger.ask()
            cand = self._suggested(asked)
            new = cand.key() not in self.ledger and self.trials.offered(cand.plan)
            if new and (self.timed is None or self.timed.can_win(cand)):
                return cand, asked, None
            self.ledger.tell(asked, None)
        unpredictable = [c for c in unseen if self.timed is not None and not self.timed.predictable(c)]
        pool = unpredictable or list(unseen)
        return self._enqueued(pool[self.rng.randrange(len(pool))])

    def _suggested(self, asked: Any) -> Candidate:
        """The candidate an Optuna trial proposes: the space's point, and the micro-batch where the search has one."""
        params = dict(self.space.suggest(asked, self.stacks))
        sizes = sorted(m for m in self.trials.workloads if m is not None)
        if sizes:
            params["micro_batch"] = asked.suggest_categorical("micro_batch", sizes)
        plan = self.space.plan_for(params, self.stacks, fingerprint=self.ledger.run_info.get("fingerprint"))
        label = self.trials.workload(params.get("micro_batch")).labelled(plan.describe())
        return Candidate(params, plan, label)

    def _enqueued(self, cand: Candidate, prune: str | None = None) -> tuple[Candidate, Any, str | None]:
        return cand, self.ledger.ask(cand.params), prune
