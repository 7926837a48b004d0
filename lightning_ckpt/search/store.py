"""The search's Optuna studies: what the search writes, resumes from, and shows ``optuna.load_study``.

The study decides (``study.py``); this module only keeps the record, so the choice never depends on how
Optuna stores it. Two Optuna studies, on rank 0 only. The *sampler's* study lives in memory: it proposes
plans, and a sampler that redraws a plan already measured leaves a ``FAIL`` trial there (Optuna stores
every ``ask``). The *record* (``study_name``, in ``storage`` when given) holds exactly one trial per
distinct plan, added when the plan is first measured or pruned and ``RUNNING`` while the search goes on:
a trial cannot change once finished, and confirmation, the memory pass of a finalist and the fallback
still change figures. When the search ends every trial is finished with its final figures, so
``optuna.load_study`` shows what the tuner chose from. A killed search leaves its trials ``RUNNING``
with their figures in user attributes; the next run resumes them and finishes them.

The record, for ``optuna.load_study`` and Optuna's plots:

* one objective, maximised, named ``samples_per_second`` (memory is the budget's constraint, not a
  second objective to trade against speed);
* state: ``COMPLETE`` for a plan that ran a step (``value`` = its samples/s, the confirmed figure when
  the confirmation round re-timed it), ``PRUNED`` for one predicted over budget or, by the time model,
  unable to beat the best measured plan (``value`` = its predicted samples/s, reported as its one
  intermediate value, which Optuna takes as a pruned trial's value), ``FAIL`` for one that
  failed (out of memory, error, invalid); ``params`` as the search space suggests them (empty for a
  baseline outside a restricted space);
* constraints (``trial.constraints``; feasible when all are <= 0, exactly the tuner's status ``ok``):
  ``over_budget_bytes`` = the figure the budget limits (peak or activation bytes; measured, else
  predicted) minus the limit, and ``failed`` = 1.0 for a trial that failed or fought ``torch.compile``;
* user attributes, the same names on every trial (None where unknown), named after ``TrialRecord``'s
  fields: see ``TRIAL_ATTRS``;
* study user attributes: ``run`` (what the figures depend on: model fingerprint, batch size, world
  size, device, compiled; a stored study made for another run is refused) and, once chosen,
  ``chosen_trial`` (the trial number of the plan the tuner chose: ties go to lower memory and a win
  inside the noise to the baseline, so it can differ from ``best_trial``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.distributed import Sync
from lightning_ckpt.search.records import TrialRecord, TrialStatus

__all__ = [
    "FAILED_CONSTRAINT",
    "METRIC_NAMES",
    "OVER_BUDGET_CONSTRAINT",
    "TRIAL_ATTRS",
    "TrialStore",
    "storage_for_display",
]

log = logging.getLogger(__name__)

# The stored study's vocabulary (see the module docstring): one place, read by tests and by users' scripts.
METRIC_NAMES = ("samples_per_second",)
OVER_BUDGET_CONSTRAINT = "over_budget_bytes"
FAILED_CONSTRAINT = "failed"
_RECORD_FIELDS = (
    "label",
    "status",
    "predicted_peak_bytes",
    "predicted_activation_bytes",
    "peak_bytes",
    "activation_bytes",
    "samples_per_second",
    "median_seconds",
    "spread_seconds",
    "recompute_flops",
    "recompute_overhead",
    "seconds",
    "steps",
    "error",
    "forward_backward_peak_bytes",
    "baseline",
    "memory_measured",
    "first_samples_per_second",
    "confirmation_seconds",
    "predicted_seconds",
    "pruned_by",
)
# Every stored trial's user attributes: the record's fields above (status as its string, e.g. "ok"), plus
# ``plan`` (the plan as ``Plan.to_dict``, what a resumed search rebuilds) and ``params`` (the search
# dimensions, also for plans outside the Optuna distributions, which store no Optuna params).
TRIAL_ATTRS = (*_RECORD_FIELDS, "plan", "params")


@dataclass
class _StoredTrial:
    """The record study's trial of one plan: its number and id, whether it is still open, the attributes written."""

    number: int
    trial_id: int  # FrozenTrial._trial_id: Optuna has no public id, and ``optuna.trial.Trial`` needs it
    running: bool
    attrs: dict[str, Any]


_UNSET = object()


class TrialStore:
    """Rank 0's two Optuna studies (see the module docstring), opened by ``resume``; on other ranks, and
    before ``resume``, every write is a no-op, so the study calls it the same way on every rank."""

    def __init__(
        self,
        *,
        config: TuneConfig,
        run_info: Mapping[str, Any],
        budget: Budget,
        distributions: Mapping[str, Any],
        sampler: Any,
    ) -> None:
        """``sampler``: the Optuna sampler that proposes plans (the proposer's, ``proposers.py``)."""
        self.config, self.budget, self.distributions = config, budget, distributions
        self._proposing = sampler
        self.run_info = dict(run_info)
        self.study_name = config.study_name or _default_study_name(self.run_info)
        self.record: Any = None  # the record study
        self.sampler: Any = None  # the sampler's study
        self._stored: dict[str, _StoredTrial] = {}  # the record's trial per plan key

    @property
    def sampler_name(self) -> str | None:
        return type(self.sampler.sampler).__name__ if self.sampler is not None else None

    # -- opening and resuming ------------------------------------------------------------------------
    def resume(
        self,
        sync: Sync,
        predicted_over_budget: Callable[[Plan, int | None], bool],
        *,
        known: Collection[str],
        first_number: int,
    ) -> list[TrialRecord]:
        """Open the studies (rank 0) and return, on every rank, the plans an earlier run stored (``storage=``)
        that are not ``known`` yet, numbered from ``first_number`` and judged against today's budget; the
        trials it left ``RUNNING`` (it was killed) this run finishes."""
        problem, stored = None, []
        if sync.is_leader:
            try:
                self._open()
                stored = self._stored_records(predicted_over_budget)
            except Exception as exc:  # the other ranks must not wait in the broadcast below for ever
                problem = exc
        message = sync.broadcast((repr(problem) if problem is not None else None, stored))
        if problem is not None:
            raise problem
        if message[0] is not None:
            raise ConfigurationError(f"Rank 0 could not open the Optuna study {self.study_name!r}: {message[0]}")
        resumed: dict[str, TrialRecord] = {}
        for attrs in message[1]:
            record = _record_from_attrs(first_number + len(resumed), attrs)
            if record is not None and record.key() not in known and record.key() not in resumed:
                resumed[record.key()] = record
                self.learn(record)
        return list(resumed.values())

    def _open(self) -> None:
        """The sampler's study (in memory) and the record (``storage`` or in memory), named ``study_name``."""
        import optuna

        config = self.config
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.sampler = optuna.create_study(direction="maximize", sampler=self._proposing, study_name=self.study_name)
        # Nothing is ever sampled from the record; whoever loads it chooses their own sampler.
        self.record = optuna.create_study(
            direction="maximize",
            sampler=optuna.samplers.RandomSampler(seed=config.seed),
            storage=config.storage,
            study_name=self.study_name,
            load_if_exists=config.storage is not None,
        )
        self._check_run()
        self._name_metric()
        log.info("lightning_ckpt: Optuna study %r (%s)", self.study_name, storage_for_display(config.storage))

    def _check_run(self) -> None:
        """Refuse a stored study made for another run; mark a new one with this run."""
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

    def _name_metric(self) -> None:
        import warnings

        import optuna

        if self.record.metric_names != list(METRIC_NAMES):
            with warnings.catch_warnings():  # experimental since Optuna 3.2, and still the way to name a metric
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.record.set_metric_names(list(METRIC_NAMES))

    def _stored_records(self, predicted_over_budget: Callable[[Plan, int | None], bool]) -> list[dict[str, Any]]:
        """Rank 0: the record study's plans (the first trial of each), as attributes of records judged against
        this run's budget; a plan pruned under another budget that now may fit is left out, to be measured."""
        import optuna

        out = []
        for t in self.record.get_trials(deepcopy=False):
            record = _record_from_attrs(0, t.user_attrs)
            if record is None or record.key() in self._stored:
                continue  # not ours (no record attributes), or a duplicate left by an older version
            running = t.state == optuna.trial.TrialState.RUNNING
            self._stored[record.key()] = _StoredTrial(t.number, t._trial_id, running, dict(t.user_attrs))
            if record.status == TrialStatus.PRUNED and not predicted_over_budget(record.plan, record.micro_batch):
                continue
            if record.status.ran:
                fits = self.budget.fits(record.peak_bytes, record.activation_bytes)
                record = replace(record, status=TrialStatus.OK if fits else TrialStatus.OVER_BUDGET)
            out.append(_attrs(record))
        return out

    # -- the sampler's study -------------------------------------------------------------------------
    def learn(self, trial: TrialRecord) -> None:
        """Add ``trial`` to the sampler's study as a finished trial (failures count as infeasible)."""
        if self.sampler is None:
            return
        import optuna

        state, value, constraints = _outcome(trial, self.budget, for_sampler=True)
        params = _optuna_params(trial.params, self.distributions)
        distributions = {k: self.distributions[k] for k in params}
        predicted = self._predicted_value(trial)
        frozen = optuna.trial.create_trial(
            state=state,
            value=value,
            params=params,
            distributions=distributions,
            constraints=constraints,
            intermediate_values={0: predicted} if predicted is not None else None,
        )
        self.sampler.add_trial(frozen)

    def _predicted_value(self, trial: TrialRecord) -> float | None:
        """The samples/s the time model predicted for a plan it pruned: Optuna's value of a pruned trial is its last
        intermediate value, so this is reported as one (``finish``); None for any other trial."""
        if trial.status != TrialStatus.PRUNED or not trial.predicted_seconds:
            return None
        samples = int(self.run_info.get("batch_size") or 1) * int(self.run_info.get("world_size") or 1)
        return samples / trial.predicted_seconds

    def ask(self, params: Mapping[str, Any] | None = None) -> Any:
        """A new trial of the sampler's study: the sampler's proposal, for ``SearchSpace.suggest``; or, with
        ``params``, a trial enqueued with them and given them (a baseline, a plan the study takes itself). A
        baseline outside the space's distributions gets no Optuna params (``_optuna_params``)."""
        if params is None:
            return self.sampler.ask()
        fixed = _optuna_params(params, self.distributions)
        if fixed:
            self.sampler.enqueue_trial(fixed, skip_if_exists=False)
        asked = self.sampler.ask()
        for name in fixed:  # the enqueued values: a trial's params are those it suggested
            asked.suggest_categorical(name, self.distributions[name].choices)
        return asked

    def tell(self, asked: Any, trial: TrialRecord | None) -> None:
        """Finish the sampler's ``asked`` trial with ``trial``'s figures, or, for None (a known or unrunnable
        plan), as ``FAIL``: that keeps it out of the sampler's history, which already has the plan. Only the
        in-memory sampler's study holds these trials, never the record."""
        import optuna

        if trial is None:
            self.sampler.tell(asked, state=optuna.trial.TrialState.FAIL)
            return
        state, value, constraints = _outcome(trial, self.budget, for_sampler=True)
        for name, violation in constraints.items():
            asked.set_constraint(name, violation)
        predicted = self._predicted_value(trial)
        if predicted is not None:
            asked.report(predicted, 0)  # a pruned trial's value: its predicted samples/s
        self.sampler.tell(asked, value, state=state)

    # -- the record ----------------------------------------------------------------------------------
    def store(self, trial: TrialRecord) -> None:
        """Write ``trial``, the plan's record now, to the record study: a new ``RUNNING`` trial for a new plan,
        else the attributes that changed. A trial finished by an earlier run keeps that run's figures (Optuna
        never changes a finished trial, and adding another would store the plan twice)."""
        if self.record is None:
            return
        import optuna

        key, attrs = trial.key(), _attrs(trial)
        stored = self._stored.get(key)
        if stored is None:
            params = _optuna_params(trial.params, self.distributions)
            distributions = {k: self.distributions[k] for k in params}
            running = optuna.trial.TrialState.RUNNING
            self.record.add_trial(
                optuna.trial.create_trial(state=running, params=params, distributions=distributions, user_attrs=attrs)
            )
            added = self.record.get_trials(deepcopy=False, states=(running,))[-1]
            self._stored[key] = _StoredTrial(added.number, added._trial_id, running=True, attrs=attrs)
            return
        changed = {k: v for k, v in attrs.items() if stored.attrs.get(k, _UNSET) != v}
        if stored.running and changed:
            handle = optuna.trial.Trial(self.record, stored.trial_id)
            for k, v in changed.items():
                handle.set_user_attr(k, v)
            stored.attrs.update(changed)

    def finish(self, by_key: Mapping[str, TrialRecord]) -> None:
        """Finish every trial of the record this run holds ``RUNNING`` with its final figures and constraints
        (``by_key``: the search's records by plan key)."""
        if self.record is None:
            return
        import optuna

        for key, stored in self._stored.items():
            if not stored.running:
                continue
            trial = by_key.get(key) or _record_from_attrs(0, stored.attrs)
            if trial is None:
                continue
            self.store(trial)
            state, value, constraints = _outcome(trial, self.budget)
            handle = optuna.trial.Trial(self.record, stored.trial_id)
            for name, violation in constraints.items():
                handle.set_constraint(name, violation)
            predicted = self._predicted_value(trial)
            if predicted is not None:
                handle.report(predicted, 0)  # a pruned trial's value: its predicted samples/s
            self.record.tell(stored.number, value, state=state)
            stored.running = False

    def mark_chosen(self, trial: TrialRecord) -> None:
        """Name the chosen plan's trial in the record (``chosen_trial``)."""
        if self.record is not None and trial.key() in self._stored:
            self.record.set_user_attr("chosen_trial", self._stored[trial.key()].number)


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
    if trial.status in (TrialStatus.OVER_BUDGET, TrialStatus.PRUNED):
        # Judged over budget on a figure not kept here (one rank's, or a figure missing): the status decides.
        over = max(over, 1.0)
    return over


def _attrs(trial: TrialRecord) -> dict[str, Any]:
    """The user attributes of ``trial``'s stored Optuna trial (``TRIAL_ATTRS``): all a resumed search rebuilds
    the record from (``storage=``), plain JSON."""
    attrs = {k: getattr(trial, k) for k in _RECORD_FIELDS}
    attrs["status"] = trial.status.value
    attrs["confirmation_seconds"] = list(trial.confirmation_seconds)
    attrs["plan"] = trial.plan.to_dict()
    attrs["params"] = dict(trial.params)
    return attrs


def _record_from_attrs(number: int, attrs: Mapping[str, Any]) -> TrialRecord | None:
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
    joint = {"micro_batch": int(m)} if m is not None else {}
    return TrialRecord(number=number, plan=plan, params=params, resumed=True, **fields, **joint)


def _optuna_params(params: Mapping[str, Any], distributions: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` as Optuna params: empty when outside the space's distributions (a baseline outside the user's
    restricted space), which keeps the trial out of the sampler's model; the ``params`` attribute keeps them."""
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
