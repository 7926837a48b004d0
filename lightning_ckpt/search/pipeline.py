"""One search, from the space's candidates to a ``TuneResult``, the same for ``tune`` and the joint micro-batch search:
``run_search`` (warm-up, loop, confirmation), then ``conclude`` (choice, hold-out, the caller's check, the result).
Between the two the caller reads the ledger for what the plan file records.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from optuna.samplers import BaseSampler

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import ApplyError, InfeasibleBudgetError, TrialsFailedError
from lightning_ckpt.formatting import count
from lightning_ckpt.measure.device_memory import allocator_type
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.apply import plan_applied
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.search.choice import choose_plan
from lightning_ckpt.search.compile import CompiledTrials, eager_while_profiling
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.confirmation import Confirmed, confirm, floor_seconds, hold_out
from lightning_ckpt.search.distributed import LocalSync, Sync
from lightning_ckpt.search.ledger import Ledger, ProgressFn, TrialRecord
from lightning_ckpt.search.loop import measure, run_trials
from lightning_ckpt.search.phases import Phases, SearchCost
from lightning_ckpt.search.result import SearchFacts, TuneResult, build_result
from lightning_ckpt.search.rounds import beats_by, reported_verdict
from lightning_ckpt.search.runners import TrialRunner, release_cached_memory
from lightning_ckpt.search.sampler import TimeModelSampler, fitted, sampler_for, sampler_summary
from lightning_ckpt.search.space import Candidate, SearchSpace, offered_candidates
from lightning_ckpt.search.trials import Trials, Workload, resized, run_info
from lightning_ckpt.search.verdict import Verdict
from lightning_ckpt.timing.model import TimeModel

__all__ = ["TAIL_STEPS", "UNIT_SPREAD", "Search", "SearchHooks", "conclude", "run_search", "warm_up_process"]

# Plain steps the allowance keeps for what follows the side-by-side rounds: the record, the result and part of a kept
# reference's memory pass. The winner's memory pass is priced apart (``Trials.memory_pass_seconds``): it runs between
# the choosing rounds and the fresh ones.
TAIL_STEPS = 5
# The share of the allowance the search leaves unplanned: a plain step timed at another moment of the same process
# differs from the search's unit by up to about 10% either way (``benchmarks/tuning_cost.py --shapes``: the searches
# that ran over 150 steps counted against the step timed after them had a unit 6-10% off), so a search planned to the
# whole allowance ran over it in one of five counts.
UNIT_SPREAD = 0.1
# Plain steps the warm-up times for the search's plain step (``warm_up_process``): the fastest counts.
PLAIN_TIMED_STEPS = 3
# ... and again before the trials stop for the rounds (``_plain_again``).
LATE_PLAIN_STEPS = 2


@dataclass(frozen=True)
class SearchHooks:
    """The run-time hooks every search takes from its caller: how it reports (``progress``), how ranks agree
    (``sync``), when it must stop (``should_stop``, polled between trials: the callback passes Lightning's SIGTERM
    flag)."""

    progress: ProgressFn | None = None
    sync: Sync | None = None
    should_stop: Callable[[], bool] | None = None


@dataclass(frozen=True)
class Search:
    """A search that has run and confirmed: its ledger (the records), how it measured (``trials``), the sampler,
    what the confirmation found, and what ``conclude`` needs besides."""

    ledger: Ledger
    trials: Trials
    sampler: BaseSampler
    candidates: tuple[Candidate, ...]
    stacks: tuple[Any, ...]
    confirmed: Confirmed
    none_fits: bool
    warm_steps: int
    progress: ProgressFn | None = None
    phases: Phases = field(default_factory=Phases)
    plain_seconds: float | None = None  # the warm-up's plain step, where it timed one (``warm_up_process``)

    @property
    def records(self) -> tuple[TrialRecord, ...]:
        return self.ledger.snapshot()

    def cost(self) -> SearchCost:
        """What the search has cost so far, by phase and in plain steps: the ``none`` baseline's search figure (within
        budget or not), else the warm-up's plain step, else the time model's."""
        none = next((t for t in self.records if t.baseline == "none" and t.median_seconds and t.status.ran), None)
        timed = fitted(self.sampler)
        plain = none.searched_seconds if none is not None else self.plain_seconds
        if plain is None and timed is not None:
            plain = timed.predict_seconds(Plan())
        return self.phases.cost(plain)

    def rounds_first(self) -> bool:
        """Whether the allowance left could no longer pay for the side-by-side rounds' floor (``floor_seconds``)."""
        left, floor = self.left(), floor_seconds(self.ledger, self.trials.config)
        return left is not None and floor is not None and left < floor

    def left(self, *, chosen: bool = False) -> float | None:
        """Seconds of the search's allowance (``TuneConfig.search_steps`` plain steps, less ``UNIT_SPREAD``) left for
        its rounds, less ``TAIL_STEPS`` and, until a plan is ``chosen``, the winner's memory pass, which runs between the
        choosing rounds and the fresh ones: priced at a fixed ten steps, it cost 14-18 on 30 ms steps, and the fresh
        rounds lost their floor of six (two ran). None without an allowance or a plain step."""
        allowance = self.trials.config.search_steps
        cost = self.cost() if allowance is not None else None
        if cost is None or not cost.plain_step_seconds:
            return None
        reserve = TAIL_STEPS * cost.plain_step_seconds + (0.0 if chosen else self.trials.memory_pass_seconds())
        return allowance * (1 - UNIT_SPREAD) * cost.plain_step_seconds - reserve - cost.total_seconds


def run_search(
    resolved: ModelView,
    workloads: Sequence[Workload],
    space: SearchSpace,
    budget: Budget,
    config: TuneConfig,
    *,
    timing: TimeModel | None,
    memory_model: Any,
    hooks: SearchHooks,
    run: Mapping[str, Any],
    phases: Phases,
) -> Search:
    """Warm up, then the loop and the confirmation over the space's candidates (one per plan, or one per plan and
    workload: the joint search's micro-batches); what the trials cached is given back. ``timing``: the profile's
    time model, for the time model's sampler where the runner's steps are the ones it timed. The warm-up runs the
    first workload's step (its runner's harness)."""
    runner = workloads[0].runner
    sync = hooks.sync or LocalSync()
    # Rank 0 decides, as every choice of the search: ranks that warmed up with different steps would run different
    # numbers of a sharded step's collectives (each rank reads its own free memory).
    plain_fits = sync.broadcast(_plain_fits_host(resolved, workloads, config))
    with phases.timing("warm_up"):
        warm_steps, plain_seconds = warm_up_process(
            runner.harness, resolved, config, isinstance(runner, CompiledTrials), plain=plain_fits
        )
    stacks, plain = offered_candidates(space, resolved.stacks, resolved.fingerprint, memory_model)
    candidates = resized(plain, workloads)
    trials = Trials(
        workloads, budget, config, device_type=allocator_type(resolved.device), sync=sync, should_stop=hooks.should_stop
    )
    info = run_info(resolved.fingerprint, workloads[0].samples_per_step, sync.world_size, run)
    ledger = Ledger(
        config=config, run_info=info, budget=budget, distributions=_distributions(space, stacks, workloads), sync=sync
    )

    def unseen() -> list[Candidate]:
        return [c for c in candidates if c.key() not in ledger and trials.offered(c.plan)]

    sampler = sampler_for(timing, ledger, unseen, config, predicts_time=workloads[0].predicts_time)
    search = Search(
        ledger, trials, sampler, tuple(candidates), tuple(stacks), Confirmed(), False, warm_steps,
        progress=hooks.progress, phases=phases, plain_seconds=plain_seconds,
    )  # fmt: skip
    search = _trials_and_rounds(search, space, runner, hooks)
    release_cached_memory(resolved.device)
    return search


def _trials_and_rounds(search: Search, space: SearchSpace, runner: TrialRunner, hooks: SearchHooks) -> Search:
    """The loop, the allowance's unit timed again (``_plain_again``) where the warm-up timed one, and the
    confirmation."""
    ledger, trials, sampler, phases = search.ledger, search.trials, search.sampler, search.phases
    retimed = search.plain_seconds is None

    def plain_again() -> None:
        nonlocal search, retimed
        retimed = True
        unit = _plain_again(runner, search.plain_seconds)
        search = replace(search, plain_seconds=unit, warm_steps=search.warm_steps + LATE_PLAIN_STEPS)

    with phases.timing("trials"):
        # Not in a compiled search: its compile alone spends the allowance (its cost is weighed against the user's
        # compile instead), and only its trials price the PT2 budgets, which the time model cannot predict.
        compiled = isinstance(runner, CompiledTrials)
        ran = run_trials(
            ledger, trials, sampler, search.candidates, space, search.stacks, progress=hooks.progress,
            rounds_first=None if compiled else (lambda: search.rounds_first()),
            plain_again=None if retimed else plain_again,
        )  # fmt: skip
    if not retimed:
        with phases.timing("warm_up"):
            plain_again()
    with phases.timing("confirmation"):
        confirmed = confirm(ledger, trials, sampler, hooks.progress, search.left)
    if ran.stopped is not None:
        confirmed = replace(confirmed, stopped=(ran.stopped, *confirmed.stopped))
    return replace(search, confirmed=confirmed, none_fits=ran.none_fits)


def _plain_again(runner: TrialRunner, seconds: float) -> float:
    """The search's plain step, timed again where the trials would stop for the rounds' floor (else after them): a
    process's first steps run slower than its later ones (1.3x on 10 ms steps, in ``tuning_cost.py --shapes``), and
    the allowance, counted in the first, overran 150 plain steps timed after the search by a fifth. Timed only after
    the trials, the smaller unit left the rounds none of the floor the trials had kept for them. The fastest of all
    counts: the allowance is a bound."""
    again = runner.retime(Plan(), LATE_PLAIN_STEPS, warmup=0)
    return min([seconds, *again.step_seconds]) if again.status == "ok" else seconds


def _distributions(space: SearchSpace, stacks: Sequence[Any], workloads: Sequence[Workload]) -> dict[str, Any]:
    """The space's Optuna distributions; in the joint search the micro-batch is one more dimension."""
    distributions = dict(space.distributions(stacks))
    sizes = sorted(w.micro_batch for w in workloads if w.micro_batch is not None)
    if sizes:
        import optuna

        distributions["micro_batch"] = optuna.distributions.CategoricalDistribution(sizes)
    return distributions


def conclude(
    search: Search,
    *,
    extra_steps: int,
    sections: Mapping[str, Any] | None = None,
    memory: Any = None,
    after_choice: Callable[[TrialRecord], TrialRecord] | None = None,
) -> TuneResult:
    """Choose by the confirmation's verdicts (never on predicted memory: ``Trials.verify``), hold the winner out, run
    ``after_choice`` on it (the plan it returns is kept), finish the Optuna record and build the result with the
    provenance ``sections`` (``memory``: the memory model whose table the result shows)."""
    ledger, trials = search.ledger, search.trials
    verdict, stopped = None, list(search.confirmed.stopped)
    try:
        best, fell_back, message = _choose(search)
        left = functools.partial(search.left, chosen=True)
        if not fell_back:
            with search.phases.timing("hold_out"):
                best, verdict, held = hold_out(best, ledger, trials, search.confirmed, search.progress, left)
            if held:
                stopped.append("the fresh rounds that hold the winner out, before its claim was within ±3%")
            if after_choice is not None:
                with search.phases.timing("whole_check"):
                    best = after_choice(best)
    except (InfeasibleBudgetError, TrialsFailedError):
        ledger.finish()  # the search is over: the record shows what was tried
        raise
    ledger.finish(best)
    if fell_back:
        warnings.warn(message, stacklevel=3)
    records = ledger.snapshot()
    if verdict is None:
        verdict = reported_verdict(search.confirmed.side, records, best, trials.config.tie_tolerance)
    facts = _facts(search, verdict, stopped)
    result = build_result(
        best,
        records,
        trials.budget,
        facts,
        fell_back=fell_back,
        fallback_message=message,
        tuning_seconds=facts.cost.total_seconds,
        tuning_steps=sum(t.steps for t in records) + extra_steps,
        sections=sections,
        memory=memory,
    )
    digest = trials.sync.broadcast(result.best.digest())
    if digest == result.best.digest():
        return result
    raise ApplyError(
        f"Ranks disagree on the tuned plan: rank 0 chose {digest}, this rank {result.best.digest()} "
        f"({result.best.describe()}). Trials must be combined identically on every rank; please report this."
    )


def _choose(search: Search) -> tuple[TrialRecord, bool, str]:
    """``choice.choose_plan`` by the confirmation's verdicts: a tuned plan beats the fastest fitting baseline only by
    its verdict; the fallback is measured where it was pruned."""
    ledger, trials, tol = search.ledger, search.trials, search.trials.config.tie_tolerance

    def remeasure(t: TrialRecord) -> TrialRecord:
        cand = Candidate(t.params, t.plan, t.label, t.baseline)
        return measure(ledger, trials, search.sampler, cand, progress=search.progress)

    return choose_plan(
        ledger.snapshot,
        trials.budget,
        tie_tolerance=tol,
        on_infeasible=trials.config.on_infeasible,
        nothing_fits=lambda records: _nothing_fits(trials.budget, records),
        verify=lambda t: ledger.put(trials.verify(t)),
        measure=remeasure,
        beats=beats_by(search.confirmed.side, tol),
    )


def _facts(search: Search, verdict: Verdict | None, stopped: Sequence[str]) -> SearchFacts:
    """What the search was and did beside its records, for the chosen plan's evidence."""
    ledger, config = search.ledger, search.trials.config
    return SearchFacts(
        n_trials=config.n_trials,
        exhaustive=len(search.candidates) <= config.n_trials,
        space_size=len(search.candidates),
        seed=config.seed,
        sampler=ledger.sampler_name,
        proposer=TimeModelSampler.name if isinstance(search.sampler, TimeModelSampler) else "sampler",
        study_name=ledger.study_name,
        tie_tolerance=config.tie_tolerance,
        speed_changes=search.confirmed.speed_changes,
        proposer_summary=sampler_summary(search.sampler),
        verdict=verdict,
        none_fits=search.none_fits,
        fingerprint=ledger.run_info.get("fingerprint"),
        storage=config.storage,
        cost=search.cost(),
        allowance={"plain_steps": config.search_steps, "stopped": list(stopped)},
    )


def _nothing_fits(budget: Budget, records: Sequence[TrialRecord]) -> str:
    summary = ", ".join(f"{t.label}={t.status}" for t in records[:8])
    return (
        f"No checkpointing plan fits the budget ({budget.description}). Tried {count(len(records), 'plan')} "
        f"({summary}). Raise max_memory/activation_budget, reduce the batch size, or widen the search space."
    )


def warm_up_process(
    harness: StepHarness, resolved: ModelView, config: TuneConfig, compiled: bool, *, plain: bool = False
) -> tuple[int, float | None]:
    """(steps run, the plain step's seconds): untimed steps before the first trial, as the first steps of a process
    are slow (thread pools, oneDNN/cuBLAS handles, allocator growth) and would handicap whichever plan is measured
    first. Run under the lowest-memory plan so they cannot run out of memory; with ``plain`` (``_plain_fits_host``)
    without checkpointing, timing the search's plain step (the unit of its allowance) even where the ``none`` plan
    will not run: predicted from plans that all recompute, it came out up to 40% too high."""
    plan = Plan() if plain and not compiled else uniform_plan(resolved.stacks, BlockPlan("full"))
    timed = PLAIN_TIMED_STEPS if plan.is_empty else 1
    with plan_applied(resolved, plan), eager_while_profiling(compiled):
        warm = harness.measure(warmup=config.process_warmup_steps, steps=timed, track_memory=False, count_flops=False)
    # The fastest, not the median: the allowance is a bound, and these are a process's first steps (still slower
    # than its later ones: 0.79-1.17x of a plain step timed after the search, in ``tuning_cost.py --shapes``).
    seconds = min(warm.step_seconds) if plan.is_empty and warm.step_seconds else None
    return warm.warmup_steps + len(warm.step_seconds), seconds or None


def _plain_fits_host(resolved: ModelView, workloads: Sequence[Workload], config: TuneConfig) -> bool:
    """Whether a step without checkpointing is safe to run for timing: on CPU (no card to refuse it), where the
    memory model predicts every workload's plain step within half the host's free memory (``TuneConfig.host_limit``)."""
    limit = config.host_limit() if resolved.device.type == "cpu" else None
    predicted = [w.memory.predict(Plan()) if w.memory is not None else None for w in workloads]
    return limit is not None and all(p is not None and p[0] <= limit for p in predicted)
