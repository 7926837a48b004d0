"""The study driver: propose plans, prune by the memory model, measure, keep the fastest that fits.

Optuna's ask/tell interface lets this module own the loop, so the same engine runs inside the
Lightning callback or from a plain script (``tune(model, step_fn, ...)``).
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_ckpt.budget import Budget, format_bytes
from lightning_ckpt.caches import without_kv_cache
from lightning_ckpt.errors import (
    ApplyError,
    ConfigurationError,
    InfeasibleBudgetError,
    LightningCkptError,
    TrialsFailedError,
)
from lightning_ckpt.optimizer_step import OptimizerStepMemory, measure_optimizer_step
from lightning_ckpt.plan import Plan
from lightning_ckpt.space import SearchSpace

__all__ = ["TrialRecord", "TuneResult", "choose_best", "tune"]

log = logging.getLogger(__name__)

# Trial statuses. "ok" and "over_budget" were measured; "pruned" was predicted over budget and not
# run; "oom", "invalid" and "error" failed while running (see Measurement.status).
# "conflict": a compiled trial whose plan fights torch.compile (graph breaks, recompile limit; see compile.py).
STATUSES = ("ok", "over_budget", "pruned", "oom", "invalid", "error", "conflict")


@dataclass(frozen=True)
class TrialRecord:
    """One candidate plan and what happened to it."""

    number: int
    plan: Plan
    label: str  # "baseline:full", or the plan's one-line description
    params: Mapping[str, Any]  # the search dimensions that produced the plan (HParams)
    status: str
    predicted_peak_bytes: int | None = None
    predicted_activation_bytes: int | None = None
    peak_bytes: int | None = None
    activation_bytes: int | None = None
    samples_per_second: float | None = None
    median_seconds: float | None = None
    spread_seconds: float | None = None
    recompute_flops: int | None = None
    recompute_overhead: float | None = None  # extra FLOPs as a fraction of the no-checkpointing step's
    # peak_bytes is the real step's (optimizer state and step included, see optimizer_step.py); this is the
    # trial's own forward+backward peak it was derived from.
    forward_backward_peak_bytes: int | None = None
    seconds: float = 0.0  # wall time this trial cost (tuning cost)
    steps: int = 0  # training steps this trial ran (warm-up + timed + memory pass)
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    traceback: str | None = None  # status ``error``: where the step failed (shown when nothing could run)

    @property
    def feasible(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("plan", "params", "extra")}
        d["plan"] = self.plan.describe()
        d["params"] = dict(self.params)
        d["extra"] = dict(self.extra)
        return d


@dataclass(frozen=True)
class TuneResult:
    """The outcome of a search: the plan to use and the evidence for it."""

    best: Plan  # the chosen plan, with metadata (budget, measured figures, baselines, settings)
    best_trial: TrialRecord | None
    trials: tuple[TrialRecord, ...]
    budget: Budget
    tuning_seconds: float
    tuning_steps: int
    fell_back: bool = False  # nothing fit the budget; the lowest-memory plan was chosen
    fallback_message: str = ""  # the warning that said so (the callback repeats it on every fit)
    memory_table: str = ""  # the memory model's per-block breakdown, printable
    memory_breakdown: Mapping[str, Any] = field(default_factory=dict)  # the same as data

    @property
    def baselines(self) -> dict[str, TrialRecord]:
        return {t.label.split(":", 1)[1]: t for t in self.trials if t.label.startswith("baseline:")}

    @property
    def n_measured(self) -> int:
        return sum(t.status not in ("pruned",) for t in self.trials)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------
ProgressFn = Callable[[TrialRecord, Budget], None]


def _status_value(trial: TrialRecord) -> float:
    # Optuna maximises this; anything that did not run within budget scores 0 so the sampler learns
    # to avoid it, while the record keeps the real reason.
    return float(trial.samples_per_second or 0.0) if trial.feasible else 0.0


def _sort_key(trial: TrialRecord, budget: Budget) -> tuple[float, float]:
    mem = budget.value_of(trial.peak_bytes, trial.activation_bytes)
    if mem is None:
        mem = trial.peak_bytes or 0
    return (-(trial.samples_per_second or 0.0), float(mem))


def choose_best(
    trials: Sequence[TrialRecord], budget: Budget, *, tie_tolerance: float, confirmed_key: str | None = None
) -> TrialRecord | None:
    """Fastest feasible trial; among those within ``tie_tolerance`` of it, the one using least memory.

    ``confirmed_key``: trials re-timed side by side carry it in ``extra``. Their figures compare with
    each other but not with figures taken at other moments (a slow moment during the re-timing
    would otherwise hand the win to an unconfirmed trial), so when any exist only they compete.
    """
    feasible = [t for t in trials if t.feasible and t.samples_per_second]
    if not feasible:
        return None
    if confirmed_key is not None:
        feasible = [t for t in feasible if confirmed_key in t.extra] or feasible
    fastest = max(t.samples_per_second or 0.0 for t in feasible)
    close = [t for t in feasible if (t.samples_per_second or 0.0) >= fastest * (1 - tie_tolerance)]

    def memory(t: TrialRecord) -> float:
        value = budget.value_of(t.peak_bytes, t.activation_bytes)
        return float(value if value is not None else (t.peak_bytes or 0))

    return min(close, key=lambda t: (memory(t), -(t.samples_per_second or 0.0)))


def _lowest_memory(trials: Sequence[TrialRecord], budget: Budget) -> TrialRecord | None:
    """The measured plan using least memory. Only plans that ran a step without failing qualify: a pruned
    plan never ran, and falling back to it would hand real training a plan nobody has seen work."""

    def memory(t: TrialRecord) -> float:
        measured = budget.value_of(t.peak_bytes, t.activation_bytes)
        return float(measured) if measured is not None else float("inf")

    ran = [t for t in trials if t.status in ("ok", "over_budget")]
    return min(ran, key=memory) if ran else None


class SearchInterrupted(LightningCkptError):
    """``should_stop`` asked the search to end (e.g. SIGTERM): no plan was chosen, the model is as it was."""


def _failures_message(trials: Sequence[TrialRecord]) -> str:
    """The trials' errors, the first with its traceback: what a user needs when no plan could run at all."""
    failed = [t for t in trials if t.status in ("oom", "invalid", "error")]
    if not failed:
        return ""
    kinds = ", ".join(f"{n} {s}" for s in ("error", "invalid", "oom") if (n := sum(t.status == s for t in failed)))
    first = next((t for t in failed if t.status == "error"), failed[0])
    text = f" Every plan that ran failed ({kinds}). First failure ({first.label}): {first.error}"
    if first.traceback:
        text += f"\n{first.traceback}"
    return text


@without_kv_cache
def tune(
    model: nn.Module,
    step_fn: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    max_memory: int | float | str | None = None,
    activation_budget: float | None = None,
    n_trials: int = 40,
    timeout: float | None = None,
    search_space: SearchSpace | Mapping[str, Any] | None = None,
    sampler: Any = None,
    storage: str | None = None,
    study_name: str | None = None,
    seed: int = 0,
    warmup_steps: int = 1,
    measure_steps: int = 3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    block_types: Any = None,
    on_infeasible: str = "fallback",
    tie_tolerance: float = 0.01,
    count_flops: bool = True,
    enforce_budget: bool = True,
    progress: ProgressFn | None = None,
    extra_tensors: tuple[Any, ...] = (),
    process_warmup_steps: int = 2,
    sync: Any = None,
    confirm_top: int = 3,
    confirm_rounds: int = 2,
    memory_model: Any = None,
    budget: Budget | None = None,
    compiled: bool | None = None,
    allow_graph_breaks: bool = False,
    optimizer_step: OptimizerStepMemory | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TuneResult:
    """Search checkpointing plans for the highest measured throughput within a memory budget.

    ``step_fn`` runs the forward of one training step on a fixed batch and returns the loss; tune
    calls ``backward`` on it (and never steps an optimizer), both for the memory-safe profile and for
    every measured trial. The model is left exactly as it was: the caller applies ``result.best``.

    ``sync`` (a ``lightning_ckpt.distributed.Sync``) runs the search on several ranks in lockstep:
    rank 0 proposes, every rank measures, results are combined identically everywhere.
    ``memory_model`` and ``budget`` replace the profile and the budget resolution when the caller
    already has them (the joint micro-batch search profiles once and scales).
    ``compiled`` (default: detected, see ``lightning_ckpt.compile``) makes every trial compile its plan;
    plans that add graph breaks or hit the recompile limit are recorded as ``conflict`` and not chosen
    unless ``allow_graph_breaks=True``.

    The budget covers the training step as it will run after lock-in, not just the trial: with an
    ``optimizer``, one ``optimizer.step()`` is measured (and undone, see ``optimizer_step.py``) and every
    trial's peak becomes ``max(forward+backward peak + the state the first step creates, the optimizer
    step's peak)``. ``optimizer_step`` passes that measurement in when the caller already has it.
    ``should_stop`` is polled between trials (the callback passes Lightning's SIGTERM flag); when it
    returns True the search ends with ``SearchInterrupted`` and the model is left as it was.
    HF KV caches are turned off for the search (``caches.py``).
    """
    import optuna

    from lightning_ckpt.apply import apply_plan, plan_applied
    from lightning_ckpt.baselines import uniform_plan
    from lightning_ckpt.budget import resolve_budget
    from lightning_ckpt.compile import compiled_search, eager_while_profiling
    from lightning_ckpt.discovery import discover_blocks, unwrap_compiled
    from lightning_ckpt.distributed import combine_trials
    from lightning_ckpt.measure import measure_step
    from lightning_ckpt.memory_model import profile_memory
    from lightning_ckpt.plan import BlockPlan, library_versions, model_fingerprint

    def baseline_full(stacks: Sequence[Any]) -> Plan:
        return uniform_plan(stacks, BlockPlan("full"))

    # Without a batch size the throughput is steps/s (a batch counts as one sample); ranking is the same.
    batch_size = batch_size or 1
    validate_tune_args(n_trials=n_trials, timeout=timeout, on_infeasible=on_infeasible, tie_tolerance=tie_tolerance)
    started = time.perf_counter()
    root = unwrap_compiled(model)
    stacks = discover_blocks(root, block_types=block_types)
    device = _model_device(root)
    space = SearchSpace.from_config(search_space).for_device(device.type)
    fingerprint = model_fingerprint(root)
    compiled_trials = compiled_search(
        model, step_fn, compiled=compiled, device=device, optimizer=optimizer, extra=extra_tensors,
        warmup_steps=warmup_steps, measure_steps=measure_steps, batch_size=batch_size, seq_len=seq_len,
        allow_graph_breaks=allow_graph_breaks,
    )  # fmt: skip
    if compiled_trials is not None:
        space = compiled_trials.adapt(space)

    if memory_model is None:
        with eager_while_profiling(compiled_trials is not None):
            memory_model = profile_memory(root, step_fn, stacks=stacks, optimizer=optimizer, extra=extra_tensors)
    if optimizer_step is None and optimizer is not None:
        optimizer_step = measure_optimizer_step(root, optimizer, device=device, extra=extra_tensors)
    opt_mem = optimizer_step or OptimizerStepMemory(0, 0, 0, measured=False, note="no optimizer given")

    def train_step() -> None:
        _loss_of(step_fn()).backward()

    none_activation = memory_model.predict_activation(Plan())
    if compiled_trials is not None:  # an activation budget is a fraction of the *compiled* step's activations
        none_activation = compiled_trials.none_activation_bytes(Plan(fingerprint=fingerprint)) or none_activation
    if budget is None:
        budget = resolve_budget(max_memory, activation_budget, device=device, none_activation_bytes=none_activation)
    if budget.kind == "peak" and budget.limit_bytes is not None and opt_mem.step_peak_bytes > budget.limit_bytes:
        log.warning("lightning_ckpt: the optimizer step alone peaks at %s (%s), over the budget (%s): no plan can fit",
                    format_bytes(opt_mem.step_peak_bytes), opt_mem.note, budget.description)  # fmt: skip
    leader = sync is None or sync.is_leader
    if sync is not None:
        budget = sync.broadcast(budget)  # one budget for all ranks: rank 0's
    log.info("lightning_ckpt: budget %s; no-checkpointing activation memory predicted %s",
             budget.description, format_bytes(none_activation))  # fmt: skip

    # Process warm-up, untimed: the first steps of a process are slow (thread pools, oneDNN/cuBLAS
    # handles, allocator growth) and would handicap whichever plan is measured first. Run it under
    # the lowest-memory plan so it cannot run out of memory; measure_step restores all state.
    with (
        plan_applied(root, baseline_full(stacks), check_fingerprint=False),
        eager_while_profiling(compiled_trials is not None),
    ):
        warm = measure_step(train_step, model=root, optimizer=optimizer, warmup=process_warmup_steps, steps=1,
                            device=device, track_memory=False, count_flops=False, extra=extra_tensors)  # fmt: skip
    warm_steps = warm.warmup_steps + len(warm.step_seconds)

    candidates = []
    for cand in space.enumerate(stacks, fingerprint=fingerprint):
        why = memory_model.can_run(cand.plan)
        if why is None:
            candidates.append(cand)
        else:  # e.g. segments over T5's stacks, or a save-list a block failed under while profiling
            log.info("lightning_ckpt: not offering %s: %s", cand.label, why)
    baseline_cands = [c for c in candidates if c.label.startswith("baseline:")]
    exhaustive = len(candidates) <= n_trials  # every distinct plan can be measured: no sampling needed
    if sampler is None:
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(1, n_trials // 3)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is not None and study_name is None:
        study_name = f"lightning_ckpt-{fingerprint}"  # same model, same study: an interrupted search resumes
    study = (
        optuna.create_study(
            direction="maximize", sampler=sampler, storage=storage, study_name=study_name,
            load_if_exists=storage is not None,
        )
        if leader
        else None
    )  # fmt: skip

    records: list[TrialRecord] = []
    by_key: dict[str, TrialRecord] = {}
    # A persisted study (storage=...) resumes: trials measured by an earlier, interrupted run are
    # taken as they are instead of being measured again.
    stored = [dict(t.user_attrs) for t in study.trials] if study is not None else []
    if sync is not None:
        stored = sync.broadcast(stored)
    for attrs in stored:
        resumed = _record_from_attrs(len(records), attrs)
        if resumed is not None and resumed.plan.key() not in by_key:
            records.append(resumed)
            by_key[resumed.plan.key()] = resumed
    if records:
        log.info("lightning_ckpt: resumed %d trials from a stored study", len(records))
    limit = budget.limit_bytes if (enforce_budget and budget.kind == "peak" and device.type == "cuda") else None
    if limit is not None:  # the trial's forward+backward must leave room for the state the first real step creates
        limit = max(1, limit - opt_mem.pending_state_bytes)

    def predicted_peak(plan: Plan) -> int:
        return opt_mem.real_peak(memory_model.predict_peak(plan)) or 0

    def predicted_over_budget(plan: Plan) -> bool:
        return not budget.fits(predicted_peak(plan), memory_model.predict_activation(plan))

    def as_real_step(trial: TrialRecord) -> TrialRecord:
        """The trial's measured forward+backward peak, turned into the real step's (optimizer included)."""
        if trial.peak_bytes is None or trial.forward_backward_peak_bytes is not None:
            return trial
        peak = opt_mem.real_peak(trial.peak_bytes)
        status = trial.status
        if status == "ok" and not budget.fits(peak, trial.activation_bytes):
            status = "over_budget"
        return replace(trial, peak_bytes=peak, forward_backward_peak_bytes=trial.peak_bytes, status=status)

    def run(params: Mapping[str, Any], plan: Plan, label: str, prune: bool | None = None) -> TrialRecord:
        number = len(records)
        t0 = time.perf_counter()
        pred_peak = predicted_peak(plan)
        pred_act = memory_model.predict_activation(plan)
        common: dict[str, Any] = dict(
            number=number, plan=plan, label=label, params=dict(params),
            predicted_peak_bytes=pred_peak, predicted_activation_bytes=pred_act,
        )  # fmt: skip
        if compiled_trials is not None:
            return as_real_step(compiled_trials.run(plan, common, budget, t0, limit))
        if prune if prune is not None else not budget.fits(pred_peak, pred_act):
            return TrialRecord(status="pruned", seconds=time.perf_counter() - t0, **common)
        offload = device.type == "cuda" and any(bp.mode == "offload" for bp in plan.blocks.values())
        if offload:
            _reset_pinned_peak()
        handle = apply_plan(root, plan, check_fingerprint=False)
        try:
            m = measure_step(
                train_step, model=root, optimizer=optimizer, warmup=warmup_steps, steps=measure_steps, device=device,
                batch_size=batch_size, seq_len=seq_len, track_memory=True, count_flops=count_flops,
                memory_limit_bytes=limit, extra=extra_tensors,
                reserve_headroom_bytes=getattr(memory_model, "reserve_overhead_bytes", 0),
            )  # fmt: skip
        finally:
            handle.remove()
        status = m.status
        if status == "ok" and not budget.fits(m.peak_bytes, m.activation_bytes):
            status = "over_budget"
        overhead = None
        if m.recompute_flops is not None and m.step_flops:
            overhead = m.recompute_flops / max(1, m.step_flops - m.recompute_flops)
        steps = m.warmup_steps + len(m.step_seconds) + (1 if m.peak_bytes is not None else 0)
        if offload:  # offload trades device memory for pinned host memory: report it
            common["extra"] = {"pinned_host_peak_bytes": _pinned_peak()}
        return as_real_step(TrialRecord(traceback=m.traceback,
            status=status, peak_bytes=m.peak_bytes, activation_bytes=m.activation_bytes,
            samples_per_second=m.samples_per_second, median_seconds=m.median_seconds,
            spread_seconds=m.spread_seconds, recompute_flops=m.recompute_flops, recompute_overhead=overhead,
            seconds=time.perf_counter() - t0, steps=steps, error=m.error, **common,
        ))  # fmt: skip

    def record(trial: TrialRecord) -> TrialRecord:
        records.append(trial)
        by_key[trial.plan.key()] = trial
        if progress is not None:
            progress(trial, budget)
        return trial

    def out_of_time() -> bool:
        if should_stop is not None and should_stop():
            raise SearchInterrupted(f"The search was asked to stop after {len(records)} trials; no plan was chosen.")
        return timeout is not None and time.perf_counter() - started > timeout

    distributions = _distributions(space, stacks)
    # Baselines first: they anchor the comparison and give the sampler good starting points.
    queue = baseline_cands + ([c for c in candidates if not c.label.startswith("baseline:")] if exhaustive else [])

    def measured() -> int:
        # Pruned candidates cost no step, so they do not use up n_trials; proposals are still
        # bounded because the loop ends once every distinct plan of the space has been seen.
        return sum(t.status != "pruned" for t in records)

    def propose() -> Iterator[tuple[Mapping[str, Any], Plan, str]]:
        """Rank 0's candidates, one at a time; after each yield the trial's record is ``records[-1]``."""
        for cand in queue:
            if measured() >= n_trials or out_of_time():
                return
            if cand.plan.key() in by_key:
                continue
            yield cand.params, cand.plan, cand.label
            _add_to_study(study, records[-1], distributions, optuna)
        misses = 0
        while not exhaustive and measured() < n_trials and not out_of_time() and len(by_key) < len(candidates):
            ot = study.ask()
            params = space.suggest(ot, stacks)
            plan = space.plan_for(params, stacks, fingerprint=fingerprint)
            previous = by_key.get(plan.key())
            if previous is None and memory_model.can_run(plan) is not None:
                study.tell(ot, state=optuna.trial.TrialState.PRUNED)  # cannot run on this model: never measured
                misses += 1
                if misses > 4 * len(candidates):
                    return
                continue
            if previous is not None:
                # Already measured: tell the sampler the known result without spending a step on it.
                study.tell(ot, _status_value(previous) if previous.status != "pruned" else None,
                           state=None if previous.status != "pruned" else optuna.trial.TrialState.PRUNED)  # fmt: skip
                misses += 1
                if misses > 4 * len(candidates):
                    return
                continue
            misses = 0
            yield params, plan, plan.describe()
            trial = records[-1]
            for key, value in _attrs(trial).items():
                ot.set_user_attr(key, value)
            if trial.status == "pruned":
                study.tell(ot, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(ot, _status_value(trial))

    proposals = propose() if leader else None
    while True:
        proposal = next(proposals, None) if proposals is not None else None
        if sync is None:
            if proposal is None:
                break
            record(run(*proposal))
            continue
        # Lockstep: rank 0 decides the candidate and the pruning; every rank measures; all combine.
        message = None
        if proposal is not None:
            params, plan, label = proposal
            message = (dict(params), plan.to_dict(), label, predicted_over_budget(plan))
        message = sync.broadcast(message)
        if message is None:
            break
        params, plan_dict, label, prune = message
        plan = proposal[1] if proposal is not None else Plan.from_dict(plan_dict, source="broadcast candidate")
        local = run(params, plan, label, prune=prune)
        record(combine_trials(sync.all_gather(local), budget))

    out_of_time()  # a stop request (SIGTERM) ends the search before the confirmation round, too
    if confirm_top > 0:
        # Confirmation: re-time the leading plans and the best baseline side by side, interleaved
        # over rounds, so the choice does not rest on one trial measured in a slow moment (the
        # first trials of a process, a noisy neighbour). Memory was measured already and is kept.
        records = _confirm(records, budget, confirm_top, confirm_rounds, train_step, root, optimizer, device,
                           batch_size, seq_len, measure_steps, extra_tensors, sync,
                           retime=compiled_trials.retime if compiled_trials is not None else None)  # fmt: skip

    if device.type == "cuda":
        _release_cached_memory()
    best = choose_best(records, budget, tie_tolerance=tie_tolerance, confirmed_key="confirmation_seconds")
    fell_back, fallback_message = False, ""
    if best is None and on_infeasible == "fallback" and _lowest_memory(records, budget) is None:
        # Everything was pruned (or failed): measure the plan predicted to use least memory before falling
        # back to it. A plan nobody has seen run is never handed to real training.
        pruned = [t for t in records if t.status == "pruned"]
        if pruned:
            cand = min(pruned, key=lambda t: budget.value_of(t.predicted_peak_bytes, t.predicted_activation_bytes) or 0)
            local = run(dict(cand.params), cand.plan, cand.label, prune=False)
            record(combine_trials(sync.all_gather(local), budget) if sync is not None else local)
    if best is None:
        lowest = _lowest_memory(records, budget)
        summary = ", ".join(f"{t.label}={t.status}" for t in records[:8])
        message = (
            f"No checkpointing plan fits the budget ({budget.description}). Tried {len(records)} plans ({summary}). "
            "Raise max_memory/activation_budget, reduce the batch size, or widen the search space."
        )
        if lowest is None and any(t.status == "error" for t in records):
            raise TrialsFailedError(
                "No checkpointing plan could be measured: every trial that ran failed, so there is nothing to apply."
                + _failures_message(records)
                + "\nFix the error above (it comes from the training step, not from the budget) and run again."
            )
        if on_infeasible == "raise" or lowest is None:
            raise InfeasibleBudgetError(message + _failures_message(records))
        fallback_message = message + f" Falling back to the lowest-memory plan: {lowest.label}."
        warnings.warn(fallback_message, stacklevel=2)
        best, fell_back = lowest, True

    baselines_measured = {
        t.label.split(":", 1)[1]: {
            "status": t.status, "samples_per_second": t.samples_per_second,
            "peak_bytes": t.peak_bytes, "activation_bytes": t.activation_bytes,
        }
        for t in records if t.label.startswith("baseline:")
    }  # fmt: skip
    chosen = replace(
        best.plan,
        name=best.plan.name or "tuned",
        fingerprint=fingerprint,
        metadata={
            **best.plan.metadata,
            "versions": library_versions(),
            "budget": budget.to_dict(),
            "optimizer_step": opt_mem.to_dict(),
            "measured": {
                "label": best.label, "status": best.status, "samples_per_second": best.samples_per_second,
                "median_seconds": best.median_seconds, "peak_bytes": best.peak_bytes,
                "activation_bytes": best.activation_bytes, "predicted_peak_bytes": best.predicted_peak_bytes,
                "recompute_overhead": best.recompute_overhead,
            },
            "baselines": baselines_measured,
            "search": {
                "n_trials": n_trials, "trials_run": len(records), "exhaustive": exhaustive,
                "space_size": len(candidates), "seed": seed, "sampler": type(sampler).__name__,
                "tie_tolerance": tie_tolerance, "fell_back": fell_back,
            },
            "run": {"device": str(device), "batch_size": batch_size, "seq_len": seq_len,
                    "compiled": list(compiled_trials.regions) if compiled_trials is not None else None},
        },
    )  # fmt: skip
    if sync is not None:
        leader_digest = sync.broadcast(chosen.digest())
        if leader_digest != chosen.digest():
            raise ApplyError(
                f"Ranks disagree on the tuned plan: rank 0 chose {leader_digest}, this rank {chosen.digest()} "
                f"({chosen.describe()}). Trials must be combined identically on every rank; please report this."
            )
    return TuneResult(
        best=chosen,
        best_trial=best,
        trials=tuple(records),
        budget=budget,
        tuning_seconds=time.perf_counter() - started,
        tuning_steps=sum(t.steps for t in records) + _PROFILE_STEPS + warm_steps,
        fell_back=fell_back,
        fallback_message=fallback_message,
        memory_table=memory_model.table(),
        memory_breakdown=memory_model.to_dict(),
    )


def _confirm(
    records: list[TrialRecord], budget: Budget, top: int, rounds: int, train_step: Callable[[], None],
    root: nn.Module, optimizer: Any, device: torch.device, batch_size: int | None, seq_len: int | None,
    steps: int, extra: tuple[Any, ...], sync: Any, retime: Callable[[Plan], Any] | None = None,
) -> list[TrialRecord]:  # fmt: skip
    """Re-time the ``top`` fastest feasible trials and the fastest feasible baseline, interleaved."""
    from lightning_ckpt.apply import plan_applied
    from lightning_ckpt.measure import measure_step

    feasible = sorted((t for t in records if t.feasible and t.samples_per_second),
                      key=lambda t: -(t.samples_per_second or 0.0))  # fmt: skip
    chosen = feasible[:top]
    baseline = next((t for t in feasible if t.label.startswith("baseline:")), None)
    if baseline is not None and baseline not in chosen:
        chosen.append(baseline)
    if len(chosen) < 2:
        return records
    times: dict[int, list[float]] = {t.number: [] for t in chosen}
    for _ in range(rounds):
        for t in chosen:
            if retime is not None:  # compiled: each plan is compiled afresh, compile untimed (compile.py)
                m = retime(t.plan)
            else:
                with plan_applied(root, t.plan, check_fingerprint=False):
                    m = measure_step(train_step, model=root, optimizer=optimizer, warmup=1, steps=steps,
                                     device=device, batch_size=batch_size, seq_len=seq_len, track_memory=False,
                                     count_flops=False, extra=extra)  # fmt: skip
            seconds = m.median_seconds if m.status == "ok" else None
            if sync is not None:
                # Ranks step together: a round takes as long as the slowest rank's step.
                gathered = sync.all_gather(seconds)
                seconds = None if any(g is None for g in gathered) else max(gathered)
            if seconds is not None:
                times[t.number].append(seconds)
    samples = (batch_size or 1) * (sync.world_size if sync is not None else 1)
    out = list(records)
    for t in chosen:
        if not times[t.number]:
            continue
        median = statistics.median([t.median_seconds or times[t.number][0], *times[t.number]])
        out[out.index(t)] = replace(
            t, samples_per_second=samples / median, median_seconds=median,
            steps=t.steps + rounds * (steps + 1),
            extra={**t.extra, "first_samples_per_second": t.samples_per_second,
                   "confirmation_seconds": times[t.number]},
        )  # fmt: skip
    return out


# The memory profile runs one no-grad capture forward and one anchor step (plus per-block passes
# that are each a fraction of a step); we count it as two steps of tuning cost.
_PROFILE_STEPS = 2


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, Mapping):
        out = out["loss"]
    elif not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
        out = out.loss
    if not isinstance(out, torch.Tensor):
        raise ConfigurationError(
            f"step_fn must return the loss (a tensor, a dict with 'loss' or an object with .loss), but returned "
            f"{type(out).__name__}."
        )
    return out


def _reset_pinned_peak() -> None:
    reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if reset is not None:
        reset()


def _pinned_peak() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return int(stats().get("allocated_bytes.peak", 0)) if stats is not None else None


def _release_cached_memory() -> None:
    """Give back what trials left cached: device blocks, and the pinned host blocks of offload trials
    (torch's host caching allocator keeps them after ``save_on_cpu(pin_memory=True)`` is done)."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()


def validate_tune_args(*, n_trials: int, timeout: float | None, on_infeasible: str, tie_tolerance: float) -> None:
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigurationError(f"n_trials must be an integer >= 1, but got {n_trials!r}.")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf")
    ):
        raise ConfigurationError(f"timeout must be a positive number of seconds or None, but got {timeout!r}.")
    if on_infeasible not in ("fallback", "raise"):
        raise ConfigurationError(f"on_infeasible must be 'fallback' or 'raise', but got {on_infeasible!r}.")
    if not 0 <= tie_tolerance < 1:
        raise ConfigurationError(f"tie_tolerance must be in [0, 1), but got {tie_tolerance!r}.")


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _distributions(space: SearchSpace, stacks: Sequence[Any]) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution

    dists = {"structure": CategoricalDistribution(space.structures(stacks))}
    if space.modes:
        dists["selection"] = CategoricalDistribution(space.selections or ("all",))
        dists["mode"] = CategoricalDistribution(space.modes)
        if space.rest_modes:
            dists["rest_mode"] = CategoricalDistribution(space.rest_modes)
    if space.chunk_choices(stacks):
        dists["chunks"] = CategoricalDistribution(space.chunk_choices(stacks))
    if space.budget_choices:
        dists["compile_budget"] = CategoricalDistribution(space.budget_choices)
    return dists


_RECORD_FIELDS = (
    "label", "status", "predicted_peak_bytes", "predicted_activation_bytes", "peak_bytes", "activation_bytes",
    "samples_per_second", "median_seconds", "spread_seconds", "recompute_flops", "recompute_overhead",
    "seconds", "steps", "error", "forward_backward_peak_bytes",
)  # fmt: skip


def _attrs(trial: TrialRecord) -> dict[str, Any]:
    """Everything needed to rebuild the record from a persisted study (``storage=``)."""
    attrs = {k: getattr(trial, k) for k in _RECORD_FIELDS}
    attrs["plan"] = trial.plan.to_dict()
    attrs["params"] = dict(trial.params)
    attrs["describe"] = trial.plan.describe()
    return attrs


def _record_from_attrs(number: int, attrs: Mapping[str, Any]) -> TrialRecord | None:
    if "plan" not in attrs or attrs.get("status") not in STATUSES:
        return None
    plan = Plan.from_dict(attrs["plan"], source="stored Optuna trial")
    fields = {k: attrs.get(k) for k in _RECORD_FIELDS}
    fields["seconds"] = float(fields["seconds"] or 0.0)
    fields["steps"] = int(fields["steps"] or 0)
    return TrialRecord(
        number=number, plan=plan, params=dict(attrs.get("params", {})), extra={"resumed": True}, **fields
    )


def _add_to_study(study: Any, trial: TrialRecord, distributions: Mapping[str, Any], optuna: Any) -> None:
    """Record a trial we ran outside ask/tell (a baseline) so the sampler learns from it too."""
    params = {k: v for k, v in trial.params.items() if k in distributions}
    if any(v not in distributions[k].choices for k, v in params.items()) or len(params) != len(trial.params):
        # The baseline lies outside the user's restricted space: store it (so a resumed study does not
        # measure it again) without parameters, which keeps it out of the sampler's model.
        params = {}
    state = optuna.trial.TrialState.PRUNED if trial.status == "pruned" else optuna.trial.TrialState.COMPLETE
    frozen = optuna.trial.create_trial(
        params=params,
        distributions={k: distributions[k] for k in params},
        value=None if state == optuna.trial.TrialState.PRUNED else _status_value(trial),
        state=state,
        user_attrs=_attrs(trial),
    )
    study.add_trial(frozen)
