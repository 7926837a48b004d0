"""The choice of a plan from the ledger's records: one rule (``CHOICE_RULE``, ``choose_best``), its fallback
(``lowest_memory``), combined in ``choose_plan``; and the status a measurement earns against the budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import InfeasibleBudgetError, TrialsFailedError
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus

__all__ = ["BeatsFn", "CHOICE_RULE", "choose_best", "choose_plan", "judge_status"]


def judge_status(
    measured: TrialStatus | str, conflict: str | None, *, allow_graph_breaks: bool, fits: bool
) -> TrialStatus:
    """A failure stays what it is; a plan that fights torch.compile is a ``conflict`` (unless graph breaks are
    allowed); otherwise ``ok`` or ``over_budget``."""
    if (measured := TrialStatus(measured)) != TrialStatus.OK:
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

# ``beats(trial, reference)``: whether a tuned trial's verdict against the reference baseline says it wins, or None
# where no verdict exists: the point figures decide.
BeatsFn = Callable[["TrialRecord", "TrialRecord"], "bool | None"]


def choose_best(
    trials: Sequence[TrialRecord],
    budget: Budget,
    *,
    tie_tolerance: float,
    confirmed_only: bool = False,
    beats: BeatsFn | None = None,
) -> TrialRecord | None:
    """The plan ``CHOICE_RULE`` picks; without a fitting baseline, the fastest plan, ties to lower memory.

    ``confirmed_only``: trials re-timed side by side do not compare with figures taken at other moments (a slow moment
    would hand the win to an unconfirmed trial), so when any exist only they compete. ``beats``: the verdicts.
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
    """The measured plan using least memory, among those that ran a step without failing: falling back to a pruned
    plan would hand real training a plan nobody has seen work."""
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
    """(chosen, fell back, the fallback's warning): ``choose_best`` (confirmed trials first), else ``lowest_memory``.

    ``trials`` reads the records as they are now, since ``verify`` (a timed-only trial's memory measured) and
    ``measure`` (a pruned plan run, when all were pruned or failed, to have one to fall back to) change them.
    ``nothing_fits(trials)`` starts the warning, or the error when ``on_infeasible="raise"`` or nothing ran.
    """

    def verified(pick: Callable[[Sequence[TrialRecord]], TrialRecord | None]) -> TrialRecord | None:
        chosen = pick(trials())
        while chosen is not None and not chosen.memory_measured and verify is not None:
            verify(chosen)  # never choose, nor fall back, on a prediction alone
            chosen = pick(trials())
        return chosen

    best = verified(lambda ts: choose_best(ts, budget, tie_tolerance=tie_tolerance, confirmed_only=True, beats=beats))
    if best is not None:
        return best, False, ""
    if on_infeasible == "fallback" and measure is not None and lowest_memory(trials(), budget) is None:
        pruned = [t for t in trials() if t.status == TrialStatus.PRUNED]
        if pruned:
            measure(
                min(pruned, key=lambda t: budget.value_of(t.predicted_peak_bytes, t.predicted_activation_bytes) or 0)
            )
    lowest = verified(lambda ts: lowest_memory(ts, budget))
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
