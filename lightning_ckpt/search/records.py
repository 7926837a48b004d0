"""What a search produces: one ``TrialRecord`` per candidate, the status vocabulary, and the choice.

The vocabulary lives here once: ``TrialStatus`` (with the severity that combines ranks), typed
fields instead of parsed labels (``baseline``, ``confirmation_seconds``, ``micro_batch``) and the two
rules that pick a plan from records: ``choose_best`` (``CHOICE_RULE``) and ``lowest_memory`` (the
fallback, only among plans that ran), which ``choose_plan`` combines into the one choice that both the
``Study`` and the joint micro-batch search make.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import InfeasibleBudgetError, TrialsFailedError
from lightning_ckpt.measure.status import TrialStatus
from lightning_ckpt.plan.format import Plan

if TYPE_CHECKING:
    from lightning_ckpt.measure.measurement import Measurement

__all__ = [
    "CHOICE_RULE",
    "ProgressFn",
    "announce_confirmation",
    "TrialRecord",
    "TrialStatus",
    "TuneResult",
    "choose_best",
    "choose_plan",
    "failures_message",
    "judge_status",
    "lowest_memory",
    "trial_key",
    "VS_REFERENCE",
    "vs_reference",
]


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
    confirmation_seconds: tuple[float, ...] = ()  # step times re-measured side by side (study.confirm)
    first_samples_per_second: float | None = None  # the figure before confirmation replaced it
    resumed: bool = False  # taken from a persisted study, not measured in this process
    memory_measured: bool = True  # False: peak/activation are the memory model's prediction (see Study.verify)
    micro_batch: int | None = None  # joint micro-batch search: this trial's micro-batch and accumulation
    accumulation: int | None = None
    # The time model's step seconds for this plan when the search proposed it (fitted to the plans measured
    # before it, so the error it shows is out of sample), and what pruned it: "memory" (predicted over
    # budget) or "time" (predicted no faster than the best measured plan by the noise margin).
    predicted_seconds: float | None = None
    pruned_by: str | None = None

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
    def prediction_error(self) -> float | None:
        """The time model's error on this plan: predicted / measured step seconds - 1, against the trial's own
        measurement (taken right after the prediction; the side-by-side rounds later re-time it at whatever
        speed the machine then has). None when either is unknown."""
        if self.predicted_seconds is None or not self.median_seconds or self.status == TrialStatus.PRUNED:
            return None
        measured = self.median_seconds
        if self.first_samples_per_second and self.samples_per_second:
            measured *= self.samples_per_second / self.first_samples_per_second
        return self.predicted_seconds / measured - 1.0

    def with_measurement(
        self, out: Measurement, *, memory: bool = True, real_peak_bytes: int | None = None, timed: bool = True
    ) -> TrialRecord:
        """This record with what running its plan gave (``out``, the runner's ``Measurement``): the one place a
        trial's figures enter a record, so a new figure is copied here only. The status is left to the study
        to judge against the budget.

        ``memory``: ``out`` read the memory, and ``real_peak_bytes`` is the real step's peak derived from its
        forward+backward peak (``memory=False``: the record keeps its predicted memory). ``timed``: ``out``'s
        timing replaces the record's (False for a memory pass, whose one step says nothing about speed).
        """
        figures: dict[str, Any] = {}
        if timed and out.samples_per_second is not None:
            figures.update(
                samples_per_second=out.samples_per_second,
                median_seconds=out.median_seconds,
                spread_seconds=out.spread_seconds,
            )
        if memory:
            figures.update(
                peak_bytes=real_peak_bytes,
                activation_bytes=out.activation_bytes,
                forward_backward_peak_bytes=out.peak_bytes,
                memory_measured=True,
                recompute_flops=out.recompute_flops,
                recompute_overhead=out.recompute_overhead,
            )
        return replace(
            self,
            steps=self.steps + out.steps,
            error=out.error,
            traceback=out.traceback,
            extra={**self.extra, **out.extra},
            **figures,
        )

    def memory(self, budget: Budget) -> float:
        """The figure ``budget`` constrains, measured (else peak); inf when nothing was measured."""
        value = budget.value_of(self.peak_bytes, self.activation_bytes)
        if value is None:
            value = self.peak_bytes
        return float(value) if value is not None else float("inf")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("plan", "params", "extra")}
        d["status"] = self.status.value
        d["confirmation_seconds"] = list(self.confirmation_seconds)
        d["plan"] = self.plan.describe()
        d["params"] = dict(self.params)
        d["extra"] = dict(self.extra)
        return d


ProgressFn = Callable[[TrialRecord, Budget], None]

# ``TrialRecord.extra`` key: a re-timed trial's speed over the reference baseline, from the rounds both ran in
# (``search.confirmation``): ``{"reference", "ratio", "low", "high", "rounds", "fresh"}``. Its samples/s is not
# comparable with another trial's timed in other rounds; this ratio is.
VS_REFERENCE = "vs_reference"


def vs_reference(trial: TrialRecord) -> float | None:
    """``trial``'s speed over the reference baseline from the side-by-side rounds both ran in (1.0 for the reference
    itself), None where it was not re-timed beside it."""
    note = trial.extra.get(VS_REFERENCE)
    ratio = note.get("ratio") if isinstance(note, Mapping) else None
    return float(ratio) if isinstance(ratio, (int, float)) else None


def announce_confirmation(progress: ProgressFn | None, trials: Sequence[TrialRecord]) -> None:
    """Tell ``progress`` that ``trials`` are about to be re-timed side by side, if it listens (a reporter with a
    ``confirming`` method, e.g. ``report.SearchProgress``): their figures are about to change, and why."""
    confirming = getattr(progress, "confirming", None)
    if confirming is not None:
        confirming(trials)


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
    # The Optuna study holding one trial per plan (``optuna.load_study(study_name=..., storage=...)`` when
    # ``storage`` is set; in memory, and gone with the process, when it is None). See ``study.py``.
    study_name: str | None = None
    storage: str | None = None

    @property
    def baselines(self) -> dict[str, TrialRecord]:
        return {t.baseline: t for t in self.trials if t.baseline is not None}

    @property
    def n_measured(self) -> int:
        return sum(t.status != TrialStatus.PRUNED for t in self.trials)


def judge_status(
    measured: TrialStatus | str, conflict: str | None, *, allow_graph_breaks: bool, fits: bool
) -> TrialStatus:
    """A trial's status from its measurement: a failure stays what it is; a plan that fights torch.compile is
    a ``conflict`` (unless graph breaks are allowed); otherwise ``ok`` or ``over_budget``."""
    measured = TrialStatus(measured)
    if measured != TrialStatus.OK:
        return measured
    if conflict and not allow_graph_breaks:
        return TrialStatus.CONFLICT
    return TrialStatus.OK if fits else TrialStatus.OVER_BUDGET


CHOICE_RULE = (
    "among the plans that fit, re-timed side by side in interleaved rounds: the fastest baseline is kept unless a "
    "tuned plan is faster than it by more than the tie tolerance with 90% confidence (the lower bound of its paired "
    "per-round speed ratio's interval clears 1 + tie tolerance); among the tuned plans that are, the fastest wins, "
    "and one within the tie tolerance of it that uses less memory wins the tie"
)

# ``beats(trial, reference)``: whether a tuned trial's verdict against the reference baseline says it wins (True
# or False), or None where no verdict exists (either was not re-timed side by side): the point figures decide.
BeatsFn = Callable[["TrialRecord", "TrialRecord"], "bool | None"]


def choose_best(
    trials: Sequence[TrialRecord],
    budget: Budget,
    *,
    tie_tolerance: float,
    confirmed_only: bool = False,
    beats: BeatsFn | None = None,
) -> TrialRecord | None:
    """The plan ``CHOICE_RULE`` picks (the README and the result line state the same rule).

    The fastest fitting baseline is the reference a tuned plan must beat by more than ``tie_tolerance``
    (what the measurement resolves): a "win" inside the noise is none, and no plan is chosen that the
    figures show slower than a fitting baseline. Without a fitting baseline, the fastest plan, ties to
    lower memory.

    ``confirmed_only``: trials re-timed side by side (``confirmed``) compare with each other but not
    with figures taken at other moments (a slow moment, or a machine whose load changed, would otherwise
    hand the win to an unconfirmed trial), so when any exist only they compete.

    ``beats`` (the confirmation's verdicts, ``verdict.py``): a tuned plan beats the reference only when its
    interval's lower bound clears ``1 + tie_tolerance``, not by its median alone; without a verdict for a pair,
    the figures decide as above (predicted figures in ``replan``, a search with ``confirm_top=0``).
    """
    feasible = [t for t in trials if t.feasible and t.samples_per_second]
    if not feasible:
        return None
    if confirmed_only:
        feasible = [t for t in feasible if t.confirmed] or feasible

    def speed(t: TrialRecord) -> float:
        return t.samples_per_second or 0.0

    reference = max((t for t in feasible if t.baseline is not None), key=speed, default=None)
    contenders = [t for t in feasible if t.baseline is None]
    if reference is not None:

        def wins(t: TrialRecord) -> bool:
            verdict = beats(t, reference) if beats is not None else None
            return speed(t) > speed(reference) * (1 + tie_tolerance) if verdict is None else verdict

        contenders = [t for t in contenders if wins(t)]
        if not contenders:
            return reference
    fastest = max(speed(t) for t in contenders)
    close = [t for t in contenders if speed(t) >= fastest * (1 - tie_tolerance)]
    return min(close, key=lambda t: (t.memory(budget), -speed(t)))


def lowest_memory(trials: Sequence[TrialRecord], budget: Budget) -> TrialRecord | None:
    """The measured plan using least memory. Only plans that ran a step without failing qualify: a pruned
    plan never ran, and falling back to it would hand real training a plan nobody has seen work."""
    ran = [t for t in trials if t.status.ran]
    return min(ran, key=lambda t: t.memory(budget)) if ran else None


def choose_plan(
    trials: Callable[[], Sequence[TrialRecord]],
    budget: Budget,
    *,
    tie_tolerance: float,
    on_infeasible: str,
    nothing_fits: Callable[[Sequence[TrialRecord]], str],
    verify: Callable[[TrialRecord], None] | None = None,
    measure: Callable[[TrialRecord], None] | None = None,
    beats: BeatsFn | None = None,
) -> tuple[TrialRecord, bool, str]:
    """The one choice every search makes: ``choose_best`` (``CHOICE_RULE``, confirmed trials first), else the
    fallback, ``lowest_memory`` among the plans that ran; (chosen, fell back, the fallback's warning).

    ``trials`` reads the records as they are now, since ``verify`` and ``measure`` change them. ``verify(t)``
    gives a trial timed only its measured memory: a plan is then never chosen, nor fallen back to, on a
    prediction (without it, records are taken as they are). ``measure(t)`` runs a pruned plan: with
    ``on_infeasible="fallback"``, when everything was pruned (or failed) the plan predicted to use least memory
    is measured first, so there is one to fall back to. ``beats``: the confirmation's verdicts (``choose_best``). ``nothing_fits(trials)`` starts the message when none
    fits: the fallback's warning, or the error when ``on_infeasible="raise"`` or nothing ran.
    """
    while True:
        best = choose_best(trials(), budget, tie_tolerance=tie_tolerance, confirmed_only=True, beats=beats)
        if best is None or best.memory_measured or verify is None:
            break
        verify(best)  # never choose on a prediction alone
    if best is not None:
        return best, False, ""
    if on_infeasible == "fallback" and measure is not None and lowest_memory(trials(), budget) is None:
        pruned = [t for t in trials() if t.status == TrialStatus.PRUNED]
        if pruned:
            measure(
                min(pruned, key=lambda t: budget.value_of(t.predicted_peak_bytes, t.predicted_activation_bytes) or 0)
            )
    lowest = lowest_memory(trials(), budget)
    while lowest is not None and not lowest.memory_measured and verify is not None:  # a fallback is measured too
        verify(lowest)
        lowest = lowest_memory(trials(), budget)
    records = trials()
    message = nothing_fits(records)
    if lowest is None and any(t.status == TrialStatus.ERROR for t in records):
        raise TrialsFailedError(
            "No checkpointing plan could be measured: every trial that ran failed, so there is nothing to apply."
            + failures_message(records)
            + "\nFix the error above (it comes from the training step, not from the budget) and run again."
        )
    if on_infeasible == "raise" or lowest is None:
        raise InfeasibleBudgetError(message + failures_message(records))
    return lowest, True, message + f" Falling back to the lowest-memory plan: {lowest.label}."


def failures_message(trials: Sequence[TrialRecord]) -> str:
    """The trials' errors, the first with its traceback: what a user needs when no plan could run at all."""
    failed = [t for t in trials if t.status.failed]
    if not failed:
        return ""
    counts = {s: sum(t.status == s for t in failed) for s in (TrialStatus.ERROR, TrialStatus.INVALID, TrialStatus.OOM)}
    kinds = ", ".join(f"{n} {s.value}" for s, n in counts.items() if n)
    first = next((t for t in failed if t.status == TrialStatus.ERROR), failed[0])
    text = f" Every plan that ran failed ({kinds}). First failure ({first.label}): {first.error}"
    if first.traceback:
        text += f"\n{first.traceback}"
    return text
