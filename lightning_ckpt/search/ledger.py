"""The ledger of a search: one ``TrialRecord`` per candidate (every phase puts back what it re-measured), and their
Optuna record.

Two Optuna studies, on rank 0 only. The *record* (``study_name``, in ``storage`` when given) holds one trial per plan,
``RUNNING`` while later phases may still change its figures (a finished trial cannot change); ``finish`` closes each,
and a killed search's ``RUNNING`` trials the next run resumes. The sampler proposes from its own study in memory:
samplers learn only from finished trials.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.measure.status import TrialStatus
from lightning_ckpt.plan.format import Plan

if TYPE_CHECKING:  # both import the record type from here
    from lightning_ckpt.measure.measurement import Measurement
    from lightning_ckpt.search.config import TuneConfig
    from lightning_ckpt.search.distributed import Sync

__all__ = [
    "FAILED_CONSTRAINT",
    "METRIC_NAMES",
    "OVER_BUDGET_CONSTRAINT",
    "TRIAL_ATTRS",
    "VS_REFERENCE",
    "Ledger",
    "ProgressFn",
    "TrialRecord",
    "TrialStatus",
    "record_of",
    "storage_for_display",
    "trial_key",
    "vs_reference",
]

log = logging.getLogger(__name__)


def trial_key(plan: Plan, micro_batch: int | None) -> str:
    """What identifies a candidate: its plan, and in the joint search its micro-batch (one record per pair)."""
    return plan.key() if micro_batch is None else f"{plan.key()}@micro_batch={micro_batch}"


@dataclass(frozen=True)
class TrialRecord:
    """One candidate plan and what happened to it."""

    number: int
    plan: Plan
    label: str  # for people: "baseline:full", or the plan's one-line description
    params: Mapping[str, Any] = field(default_factory=dict)  # the search dimensions that produced the plan
    status: TrialStatus | str = TrialStatus.OK
    predicted_peak_bytes: int | None = None
    predicted_activation_bytes: int | None = None
    peak_bytes: int | None = None  # the real step's (optimizer state and step included, see optimizer_step.py)
    activation_bytes: int | None = None
    samples_per_second: float | None = None
    median_seconds: float | None = None
    spread_seconds: float | None = None
    recompute_flops: int | None = None
    recompute_overhead: float | None = None  # extra FLOPs as a fraction of the no-checkpointing step's
    seconds: float = 0.0  # wall time this trial cost (tuning cost)
    steps: int = 0  # training steps this trial ran (warm-up + timed + memory pass)
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # for display only: compile stats, per-rank figures
    traceback: str | None = None  # status ``error``: where the step failed (shown when nothing could run)
    forward_backward_peak_bytes: int | None = None  # the trial's own peak that peak_bytes was derived from
    baseline: str | None = None  # the baseline's name ("full", ...) when the candidate is one
    confirmation_seconds: tuple[float, ...] = ()  # step times re-measured side by side (confirmation.confirm)
    first_samples_per_second: float | None = None  # the figure before confirmation replaced it
    resumed: bool = False  # taken from a persisted study, not measured in this process
    memory_measured: bool = True  # False: peak/activation are the memory model's prediction (see Trials.verify)
    micro_batch: int | None = None  # joint micro-batch search: this trial's micro-batch and accumulation
    accumulation: int | None = None
    predicted_seconds: float | None = None  # the time model's, fitted to earlier plans only (out of sample)
    pruned_by: str | None = None  # "memory" (predicted over budget) or "time" (predicted no faster, by the margin)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", TrialStatus(self.status))
        object.__setattr__(self, "confirmation_seconds", tuple(self.confirmation_seconds))

    @property
    def feasible(self) -> bool:
        return self.status == TrialStatus.OK

    def key(self) -> str:
        return trial_key(self.plan, self.micro_batch)

    @property
    def confirmed(self) -> bool:
        return bool(self.confirmation_seconds)

    @property
    def searched_seconds(self) -> float | None:
        """The step seconds the search measured, before the rounds re-timed it: what the time model is fitted to."""
        if self.median_seconds and self.first_samples_per_second and self.samples_per_second:
            return self.median_seconds * self.samples_per_second / self.first_samples_per_second
        return self.median_seconds

    @property
    def prediction_error(self) -> float | None:
        """The time model's error on this plan: predicted / searched step seconds - 1 (None: either is unknown)."""
        if self.predicted_seconds is None or not self.median_seconds or self.status == TrialStatus.PRUNED:
            return None
        return self.predicted_seconds / self.searched_seconds - 1.0

    def with_measurement(
        self, out: Measurement, *, memory: bool = True, real_peak_bytes: int | None = None, timed: bool = True
    ) -> TrialRecord:
        """This record with ``out``'s figures (its status: ``Trials.judge``). ``memory=False`` keeps the predicted
        memory, else ``real_peak_bytes`` is the peak; ``timed=False``: a memory pass, which says nothing of speed."""
        figures: dict[str, Any] = {"steps": self.steps + out.steps, "error": out.error, "traceback": out.traceback}
        if timed and out.samples_per_second is not None:
            figures.update(samples_per_second=out.samples_per_second, median_seconds=out.median_seconds)
            figures.update(spread_seconds=out.spread_seconds)
        if memory:
            figures.update(
                peak_bytes=real_peak_bytes,
                activation_bytes=out.activation_bytes,
                forward_backward_peak_bytes=out.peak_bytes,
                memory_measured=True,
                recompute_flops=out.recompute_flops,
                recompute_overhead=out.recompute_overhead,
            )
        return replace(self, extra={**self.extra, **out.extra}, **figures)

    def memory(self, budget: Budget) -> float:
        """The figure ``budget`` constrains, measured (else peak); inf when nothing was measured."""
        value = budget.value_of(self.peak_bytes, self.activation_bytes)
        value = self.peak_bytes if value is None else value
        return float(value) if value is not None else float("inf")


ProgressFn = Callable[[TrialRecord, Budget], None]

# ``TrialRecord.extra`` key (``search.confirmation``): ``{"reference", "ratio", "low", "high", "rounds", "fresh"}``.
# A re-timed trial's samples/s is not comparable with another's timed in other rounds; this ratio is.
VS_REFERENCE = "vs_reference"


def vs_reference(trial: TrialRecord) -> float | None:
    """``trial``'s ``VS_REFERENCE`` ratio (1.0 for the reference itself), None where it was not re-timed beside it."""
    note = trial.extra.get(VS_REFERENCE)
    ratio = note.get("ratio") if isinstance(note, Mapping) else None
    return float(ratio) if isinstance(ratio, (int, float)) else None


@dataclass
class _StoredTrial:  # the record's Optuna trial of one plan
    number: int
    trial_id: int  # FrozenTrial._trial_id: Optuna has no public id, and ``optuna.trial.Trial`` needs it
    running: bool
    attrs: dict[str, Any]


class Ledger:
    """The search's records by plan key, in the order they were first put, and rank 0's Optuna studies (opened by
    ``open``; before that, and on other ranks, every Optuna write is a no-op, so every rank calls it alike)."""

    def __init__(
        self,
        *,
        config: TuneConfig,
        run_info: Mapping[str, Any],
        budget: Budget,
        distributions: Mapping[str, Any],
        sync: Sync,
    ) -> None:
        self.config, self.budget, self.distributions, self.sync = config, budget, distributions, sync
        self.run_info = dict(run_info)
        self.study_name = config.study_name or _default_study_name(self.run_info)
        self._records: dict[str, TrialRecord] = {}
        self.record: Any = None  # the record study, what ``optuna.load_study`` shows (None before ``open``, off rank 0)
        self.sampler_study: Any = None  # the sampler's working study, in memory (likewise)
        self._stored: dict[str, _StoredTrial] = {}  # the record's trial per plan key

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[TrialRecord]:
        return iter(tuple(self._records.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def get(self, key: str) -> TrialRecord | None:
        return self._records.get(key)

    def snapshot(self) -> tuple[TrialRecord, ...]:
        return tuple(self._records.values())

    def put(self, record: TrialRecord) -> TrialRecord:
        """``record`` as its plan's record: a new plan is numbered next, a known one keeps its number. Persisted."""
        earlier = self._records.get(record.key())
        record = replace(record, number=earlier.number if earlier is not None else len(self._records))
        self._records[record.key()] = record
        self._store(record)
        return record

    def fastest_fitting(self) -> list[TrialRecord]:
        timed = [t for t in self._records.values() if t.feasible and t.samples_per_second]
        return sorted(timed, key=lambda t: -(t.samples_per_second or 0.0))

    @property
    def measured(self) -> int:
        """Plans that ran (pruned ones are free)."""
        return sum(t.status != TrialStatus.PRUNED for t in self._records.values())

    @property
    def sampler_name(self) -> str | None:
        return type(self.sampler_study.sampler).__name__ if self.sampler_study is not None else None

    def open(
        self,
        sampler: Any,
        predicted_over_budget: Callable[[Plan, int | None], bool],
        accumulation: Mapping[int | None, int | None],
    ) -> None:
        """Open the studies (rank 0) and put, on every rank, the plans an earlier run stored for the micro-batches of
        ``accumulation`` (each one's gradient accumulation), judged against today's budget."""
        problem, stored = None, []
        if self.sync.is_leader:
            try:
                self._open(sampler)
                stored = self._stored_records(predicted_over_budget)
            except Exception as exc:  # the other ranks must not wait in the broadcast below for ever
                problem = exc
        failure, stored = self.sync.broadcast((repr(problem) if problem is not None else None, stored))
        if problem is not None:
            raise problem
        if failure is not None:
            raise ConfigurationError(f"Rank 0 could not open the Optuna study {self.study_name!r}: {failure}")
        resumed = [record for record in stored if record.micro_batch in accumulation]
        for record in resumed:
            self._learn(record)
            record = replace(record, number=len(self._records), accumulation=accumulation[record.micro_batch])
            self._records[record.key()] = record
        if resumed:
            log.info("lightning_ckpt: resumed %d trials from the Optuna study %r", len(resumed), self.study_name)

    def _open(self, sampler: Any) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.sampler_study = optuna.create_study(direction="maximize", sampler=sampler, study_name=self.study_name)
        # Nothing is ever sampled from the record; whoever loads it chooses their own sampler.
        self.record = optuna.create_study(
            direction="maximize",
            sampler=optuna.samplers.RandomSampler(seed=self.config.seed),
            storage=self.config.storage,
            study_name=self.study_name,
            load_if_exists=self.config.storage is not None,
        )
        # Refuse a stored study made for another run; mark a new one with this run.
        run = json.loads(json.dumps(self.run_info, default=str))  # as storage gives it back
        stored_run = self.record.user_attrs.get("run")
        if stored_run is not None and stored_run != run:
            differ = ", ".join(
                f"{k} {stored_run.get(k)!r} there, {v!r} now" for k, v in run.items() if stored_run.get(k) != v
            )
            raise ConfigurationError(
                f"The Optuna study {self.study_name!r} in {storage_for_display(self.config.storage)} was made for "
                f"another run ({differ}), so its measurements do not apply to this one. Pass a new study_name, or "
                "leave study_name unset to get one study per model and run."
            )
        if stored_run is None:
            self.record.set_user_attr("run", run)
        if self.record.metric_names != list(METRIC_NAMES):
            with warnings.catch_warnings():  # experimental since Optuna 3.2, and still the way to name a metric
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.record.set_metric_names(list(METRIC_NAMES))
        log.info("lightning_ckpt: Optuna study %r (%s)", self.study_name, storage_for_display(self.config.storage))

    def _stored_records(self, predicted_over_budget: Callable[[Plan, int | None], bool]) -> list[TrialRecord]:
        """Rank 0: the record study's plans (the first trial of each), judged against this run's budget; a plan
        pruned under another budget that now may fit is left out, to be measured."""
        import optuna

        out = []
        for t in self.record.get_trials(deepcopy=False):
            record = _record_from_attrs(t.user_attrs)
            if record is None or record.key() in self._stored:
                continue  # not ours (no record attributes), or a duplicate left by an older version
            running = t.state == optuna.trial.TrialState.RUNNING
            self._stored[record.key()] = _StoredTrial(t.number, t._trial_id, running, dict(t.user_attrs))
            if record.status == TrialStatus.PRUNED and not predicted_over_budget(record.plan, record.micro_batch):
                continue
            if record.status.ran:
                fits = self.budget.fits(record.peak_bytes, record.activation_bytes)
                record = replace(record, status=TrialStatus.OK if fits else TrialStatus.OVER_BUDGET)
            out.append(record)
        return out

    def _learn(self, trial: TrialRecord) -> None:
        """Add a resumed ``trial`` to the sampler's history, finished."""
        if self.sampler_study is None:
            return
        state, value, constraints = _outcome(trial, self.budget, for_sampler=True)
        intermediate = self._intermediate(trial)
        self.sampler_study.add_trial(
            self._created(trial, state=state, value=value, constraints=constraints, intermediate_values=intermediate)
        )

    def _created(self, trial: TrialRecord, **kwargs: Any) -> Any:
        import optuna

        params = _optuna_params(trial.params, self.distributions)
        distributions = {k: self.distributions[k] for k in params}
        return optuna.trial.create_trial(params=params, distributions=distributions, **kwargs)

    def _intermediate(self, trial: TrialRecord) -> dict[int, float]:
        """A pruned plan's predicted samples/s as its one intermediate value (Optuna's value of a pruned trial)."""
        if trial.status != TrialStatus.PRUNED or not trial.predicted_seconds:
            return {}
        samples = int(self.run_info.get("batch_size") or 1) * int(self.run_info.get("world_size") or 1)
        return {0: samples / trial.predicted_seconds}

    def ask(self, params: Mapping[str, Any] | None = None) -> Any:
        """A new trial of the sampler: its proposal, or one enqueued with ``params`` (a plan the loop takes itself)."""
        fixed = _optuna_params(params or {}, self.distributions)
        if fixed:
            self.sampler_study.enqueue_trial(fixed, skip_if_exists=False)
        asked = self.sampler_study.ask()
        for name in fixed:  # the enqueued values: a trial's params are those it suggested
            asked.suggest_categorical(name, self.distributions[name].choices)
        return asked

    def tell(self, asked: Any, trial: TrialRecord | None) -> None:
        """Finish the sampler's ``asked`` trial with ``trial``'s figures, or, for None (a known or unrunnable plan
        redrawn), as ``FAIL``: that keeps it out of the sampler's history, which already has the plan."""
        import optuna

        if trial is None:
            self.sampler_study.tell(asked, state=optuna.trial.TrialState.FAIL)
        else:
            self._tell(self.sampler_study, asked, trial, for_sampler=True)

    def _tell(self, study: Any, handle: Any, trial: TrialRecord, *, for_sampler: bool = False) -> None:
        state, value, constraints = _outcome(trial, self.budget, for_sampler=for_sampler)
        for name, violation in constraints.items():
            handle.set_constraint(name, violation)
        for step, predicted in self._intermediate(trial).items():
            handle.report(predicted, step)
        study.tell(handle, value, state=state)

    def _store(self, trial: TrialRecord) -> None:
        """Write ``trial`` to the record study: a new ``RUNNING`` trial for a new plan, else the attributes that
        changed (a trial an earlier run finished keeps its figures)."""
        if self.record is None:
            return
        import optuna

        key, attrs = trial.key(), _attrs(trial)
        stored = self._stored.get(key)
        if stored is None:
            running = optuna.trial.TrialState.RUNNING
            self.record.add_trial(self._created(trial, state=running, user_attrs=attrs))
            added = self.record.get_trials(deepcopy=False, states=(running,))[-1]
            self._stored[key] = _StoredTrial(added.number, added._trial_id, running=True, attrs=attrs)
            return
        changed = {k: v for k, v in attrs.items() if k not in stored.attrs or stored.attrs[k] != v}
        if stored.running and changed:
            handle = optuna.trial.Trial(self.record, stored.trial_id)
            for k, v in changed.items():
                handle.set_user_attr(k, v)
            stored.attrs.update(changed)

    def finish(self, chosen: TrialRecord | None = None) -> None:
        """Finish the record's ``RUNNING`` trials with their final figures, and name the ``chosen`` plan's trial."""
        if self.record is None:
            return
        import optuna

        for key, stored in self._stored.items():
            trial = (self._records.get(key) or _record_from_attrs(stored.attrs)) if stored.running else None
            if trial is None:
                continue
            self._store(trial)
            self._tell(self.record, optuna.trial.Trial(self.record, stored.trial_id), trial)
            stored.running = False
        if chosen is not None and chosen.key() in self._stored:
            self.record.set_user_attr("chosen_trial", self._stored[chosen.key()].number)


def record_of(records: Sequence[TrialRecord], plan_key: str) -> TrialRecord | None:
    """The record of the plan keyed ``plan_key`` (at any micro-batch), None where the search has none."""
    return next((t for t in records if t.plan.key() == plan_key), None)


# The stored study's vocabulary, read by tests and by users' scripts: the objective, the constraints (``_outcome``)
# and the user attributes. Study attributes: ``run`` (a stored study made for another run is refused), ``chosen_trial``.
METRIC_NAMES = ("samples_per_second",)
OVER_BUDGET_CONSTRAINT = "over_budget_bytes"
FAILED_CONSTRAINT = "failed"
# The record's fields a stored trial keeps, all a resumed search rebuilds it from: not those rebuilt apart (plan,
# params, micro-batch), kept for display only (extra, traceback) or known only in this process.
_NOT_STORED = ("number", "plan", "params", "extra", "traceback", "resumed", "micro_batch", "accumulation")
_RECORD_FIELDS = tuple(f.name for f in fields(TrialRecord) if f.name not in _NOT_STORED)
# Every stored trial's user attributes: ``params`` also for plans outside the distributions (no Optuna params).
TRIAL_ATTRS = (*_RECORD_FIELDS, "plan", "params")


def _outcome(
    trial: TrialRecord, budget: Budget, *, for_sampler: bool = False
) -> tuple[Any, float | None, dict[str, float]]:
    """(Optuna state, value, constraints) of ``trial``. Feasible in Optuna's sense (every constraint <= 0)
    exactly when the tuner's status is ``ok``. ``for_sampler``: a failure is a ``COMPLETE`` trial scoring 0
    with its constraints violated, so the sampler learns to avoid it (samplers ignore ``FAIL`` trials)."""
    from optuna.trial import TrialState

    failed = trial.status.failed or trial.status == TrialStatus.CONFLICT
    constraints = {OVER_BUDGET_CONSTRAINT: _over_budget_bytes(trial, budget), FAILED_CONSTRAINT: float(failed)}
    if trial.status == TrialStatus.PRUNED:
        return TrialState.PRUNED, None, constraints
    if trial.samples_per_second is not None and not trial.status.failed:
        return TrialState.COMPLETE, float(trial.samples_per_second), constraints
    return (TrialState.COMPLETE, 0.0, constraints) if for_sampler else (TrialState.FAIL, None, constraints)


def _over_budget_bytes(trial: TrialRecord, budget: Budget) -> float:
    """The figure ``budget`` limits (measured, else predicted) minus the limit; 0 without a limit or a figure."""
    if budget.kind == "none" or budget.limit_bytes is None:
        return 0.0
    value = budget.value_of(trial.peak_bytes, trial.activation_bytes)
    if value is None:
        value = budget.value_of(trial.predicted_peak_bytes, trial.predicted_activation_bytes)
    over = float(value - budget.limit_bytes) if value is not None else 0.0
    # Judged over budget on a figure not kept here (one rank's, or a figure missing): the status decides.
    return max(over, 1.0) if trial.status in (TrialStatus.OVER_BUDGET, TrialStatus.PRUNED) else over


def _attrs(trial: TrialRecord) -> dict[str, Any]:
    attrs = {k: getattr(trial, k) for k in _RECORD_FIELDS}
    attrs.update(status=trial.status.value, confirmation_seconds=list(trial.confirmation_seconds))
    return {**attrs, "plan": trial.plan.to_dict(), "params": dict(trial.params)}


def _record_from_attrs(attrs: Mapping[str, Any]) -> TrialRecord | None:
    if "plan" not in attrs or attrs.get("status") not in {s.value for s in TrialStatus}:
        return None
    plan = Plan.from_dict(attrs["plan"], source="stored Optuna trial")
    fields = {k: attrs.get(k) for k in _RECORD_FIELDS}
    fields["seconds"] = float(fields["seconds"] or 0.0)
    fields["steps"] = int(fields["steps"] or 0)
    fields["memory_measured"] = fields["memory_measured"] is not False  # older studies measured every trial
    fields["confirmation_seconds"] = tuple(fields["confirmation_seconds"] or ())
    params = dict(attrs.get("params", {}))
    m = params.get("micro_batch")  # the joint search's dimension: the record's micro-batch
    return TrialRecord(0, plan, params=params, resumed=True, micro_batch=int(m) if m is not None else None, **fields)


def _optuna_params(params: Mapping[str, Any], distributions: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` as Optuna params: empty outside the space's distributions (a baseline outside the user's restricted
    space), which keeps the trial out of the sampler's model."""
    inside = {k: v for k, v in params.items() if k in distributions}
    if len(inside) != len(params) or any(v not in distributions[k].choices for k, v in inside.items()):
        return {}
    return inside


def _default_study_name(run: Mapping[str, Any]) -> str:
    """``lightning_ckpt-<model fingerprint>-<digest of the rest of the run>``: one study per model and run, so
    that a search interrupted and started again resumes, and a different batch size or device never does."""
    rest = {k: v for k, v in run.items() if k != "fingerprint"}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return "-".join(str(p) for p in ("lightning_ckpt", run.get("fingerprint"), digest) if p is not None)


def storage_for_display(storage: str | None) -> str:
    """``storage`` for a log line: the password of a database URL hidden; ``"in memory"`` for None."""
    if storage is None:
        return "in memory"
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", storage)
