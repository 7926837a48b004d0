"""Re-plan for a new budget from the profile a plan file keeps: no model, no step, zero trials.

Every plan of the saved space is scored from the saved models and the search's own rule (``choice.choose_best``)
picks among those predicted to fit; the budget guard checks the first real steps, as for any plan. A plan the search
measured keeps its measured time, but a figure timed alone is no evidence against a baseline's prediction: a tuned
plan beats a baseline only where the file's verdict says so, or predicted against predicted.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lightning_ckpt.budget import Budget, RequestedBudget, device_type
from lightning_ckpt.errors import InfeasibleBudgetError, LightningCkptError, PlanError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.memory.compiled import CompiledMemoryModel
from lightning_ckpt.memory.model import MemoryModel
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory, RealStepMemory
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.table import Bucket, PlanTable
from lightning_ckpt.search.choice import BeatsFn, choose_best
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus
from lightning_ckpt.search.space import SearchSpace, offered_candidates
from lightning_ckpt.search.verdict import Verdict
from lightning_ckpt.stacks import LayerStack
from lightning_ckpt.timing.model import WELL_PREDICTED_ERROR, TimeModel

if TYPE_CHECKING:
    import torch

    from lightning_ckpt.memory.profile import Profile

__all__ = ["Replanned", "SavedProfile", "profile_metadata", "replan", "table_bucket"]

# What a re-planned plan drops from the plan it came from: figures measured for that plan, not this one, and its
# plan table (its buckets' plans were chosen for the old budget; ``replanned_table`` re-plans them).
_MEASURED_KEYS = ("measured", "baselines", "real_steps", "search", "switched_from", "plan_table")


def profile_metadata(
    profile: Profile,
    optimizer: OptimizerStepMemory,
    stacks: Sequence[LayerStack],
    space: SearchSpace,
    *,
    batch_size: int,
    seq_len: int | None,
    tie_tolerance: float,
) -> dict[str, Any]:
    """What a plan file keeps to re-plan without the model (``provenance.profile``)."""
    return {
        "memory": profile.memory.to_dict(),
        "time": profile.time.to_dict() if profile.time is not None else None,
        "optimizer_step": optimizer.to_dict(),
        "stacks": [s.to_dict() for s in stacks],
        "search_space": space.to_config(),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tie_tolerance": tie_tolerance,
    }


@dataclass(frozen=True)
class SavedProfile:
    """A plan file's profile, read back (``of_plan``)."""

    memory: MemoryModel
    time: TimeModel
    optimizer: OptimizerStepMemory
    stacks: tuple[LayerStack, ...]
    space: SearchSpace
    batch_size: int
    seq_len: int | None
    tie_tolerance: float

    @classmethod
    def of_plan(cls, plan: Plan, *, source: str = "the plan", compiled: bool = False) -> SavedProfile:
        """The profile ``plan`` keeps (its compiled search's with ``compiled``: ``replan`` predicts eager steps, and
        only the plan table reads that one); ``PlanError`` saying what is missing when it cannot be re-planned from."""
        data = plan.provenance.compiled_profile if compiled else plan.provenance.profile
        if not data:
            raise PlanError(
                f"{source} keeps no profile (metadata['profile']), so it cannot be re-planned without a search. "
                "Plans written by lightning_ckpt 0.3 or later keep one; re-tune once with this version."
            )
        try:
            # Files of 0.3-0.4 kept the time model inside the memory model's ``timing``.
            time = data.get("time") or data["memory"].get("timing")
            profile = cls(
                memory=MemoryModel.from_dict(data["memory"]),
                time=TimeModel.from_dict(time) if time else None,  # type: ignore[arg-type]  # checked below
                optimizer=OptimizerStepMemory.from_dict(data["optimizer_step"]),
                stacks=tuple(LayerStack.from_dict(s) for s in data["stacks"]),
                space=SearchSpace.from_config(data["search_space"]),
                batch_size=int(data["batch_size"]),
                seq_len=data.get("seq_len"),
                tie_tolerance=float(data.get("tie_tolerance", 0.01)),
            )
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise PlanError(
                f"{source}'s profile (metadata['profile']) is malformed ({type(err).__name__}: {err}); re-tune to "
                "write a new one."
            ) from None
        if profile.time is None or profile.time.calibration is None:
            raise PlanError(
                f"{source}'s profile has no fitted time model (the search that wrote it measured no plan eagerly, "
                "e.g. a compiled model), so plans cannot be ranked by speed without running them. Re-tune instead."
            )
        with _reading_profile(source):
            _check_consistent(profile, source)
        return profile


@contextlib.contextmanager
def _reading_profile(source: str) -> Iterator[None]:
    """A failure predicting from a file's profile as a ``PlanError``: the schema checks types, not how parts refer to
    each other."""
    try:
        yield
    except LightningCkptError:
        raise
    except (ArithmeticError, IndexError, KeyError, TypeError, ValueError) as err:
        raise PlanError(
            f"{source}'s profile (metadata['profile']) is inconsistent: predicting from it failed "
            f"({type(err).__name__}: {err}). The file was edited by hand or corrupted; re-tune to write a new one."
        ) from None


def _check_consistent(profile: SavedProfile, source: str) -> None:
    """Refuse, naming the part, what no prediction can hold; then predict no checkpointing, which reads every part."""
    memory = profile.memory
    for i, phase in enumerate(memory.phases):
        needs_block = phase.kind not in ("pre", "bw_head")
        if phase.block is None and needs_block or phase.block is not None and phase.block >= len(memory.blocks):
            raise PlanError(
                f"{source}: field metadata.profile.memory.phases[{i}]: phase {phase.kind!r} names block {phase.block!r}, but "
                f"the memory model has {len(memory.blocks)} blocks (0-{len(memory.blocks) - 1}). Re-tune to write "
                "a new profile."
            )
    memory.predict(Plan())
    profile.time.predict_seconds(Plan())


@dataclass(frozen=True)
class Replanned:
    """The best plan predicted for a new budget, and the predictions it was chosen on."""

    plan: Plan
    budget: Budget
    predicted_seconds: float
    predicted_samples_per_second: float
    predicted_peak_bytes: int
    predicted_activation_bytes: int
    considered: int
    fitting: int
    batch_size: int
    # The chosen plan's step time is the one the file measured for it (scaled to ``batch_size``), not a prediction.
    time_measured: bool = False
    notes: tuple[str, ...] = ()  # what a user should know about the figures (a time model that predicted badly)

    def describe(self) -> str:
        speed = f"{self.predicted_samples_per_second:.2f} samples/s ({1000 * self.predicted_seconds:.1f} ms/step)"
        speed = f"measured {speed} when it was tuned" if self.time_measured else f"predicted {speed}"
        fit = f"{self.fitting} of {self.considered} plan{'s' * (self.considered != 1)} predicted to fit"
        return (
            f"re-planned (predicted, 0 trials) for {self.budget.description}: {self.plan.describe()}; {speed}, "
            f"predicted peak {format_bytes(self.predicted_peak_bytes)}, activations "
            f"{format_bytes(self.predicted_activation_bytes)}; {fit}"
        )


class _BatchScaled:
    """The memory model at another batch size: what is above the fixed state (parameters, gradients, optimizer
    state, buffers) scales with the batch."""

    def __init__(self, model: MemoryModel, ratio: float) -> None:
        self.model, self.ratio = model, ratio

    def predict_peak(self, plan: Plan) -> int:
        peak, fixed = self.model.predict_peak(plan), self.model.fixed_bytes
        return int(fixed + (peak - fixed) * self.ratio)

    def predict_activation(self, plan: Plan) -> int:
        return int(self.model.predict_activation(plan) * self.ratio)

    def can_run(self, plan: Plan) -> str | None:
        return self.model.can_run(plan)


def replan(
    plan: Plan,
    *,
    max_memory: int | float | str | None = None,
    activation_budget: float | None = None,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    source: str = "the plan",
) -> Replanned:
    """The best plan for a new budget, predicted from ``plan``'s saved profile (``SavedProfile``).

    ``device`` resolves a budget given as a share of device memory (default: the profile's device, whose capacity the
    plan records, so a GPU plan is re-planned on a machine without that GPU); ``batch_size`` re-plans for another
    batch. Raises ``PlanError`` when the plan keeps no usable profile, ``InfeasibleBudgetError`` when nothing fits.
    """
    profile = SavedProfile.of_plan(plan, source=source)
    requested = RequestedBudget.parse(max_memory, activation_budget)
    with _reading_profile(source):
        return _replan(plan, profile, requested, batch_size=batch_size, device=device)


def _replan(
    plan: Plan,
    profile: SavedProfile,
    requested: RequestedBudget,
    *,
    batch_size: int | None,
    device: torch.device | str | None,
) -> Replanned:
    batch = batch_size or profile.batch_size
    ratio = batch / profile.batch_size
    memory_model: Any = profile.memory if ratio == 1 else _BatchScaled(profile.memory, ratio)
    memory = RealStepMemory(memory_model, profile.optimizer)
    dev = device if device is not None else profile.memory.device  # a string: no torch needed for a CPU budget
    capacity = plan.provenance.conditions.get("device_capacity_bytes")
    capacity = capacity if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0 else None
    if device is not None and device_type(device) != device_type(profile.memory.device):
        capacity = None  # another device than the one tuned on: its own capacity, not the recorded one
    budget = requested.resolve(
        device=dev, none_activation_bytes=memory_model.predict_activation(Plan()), capacity_bytes=capacity
    )
    measured_seconds = _measured_seconds(plan, profile)
    records = predicted_records(
        profile, memory, profile.time, budget, device=dev, rows=batch, ratio=ratio, measured=measured_seconds
    )
    measured = {r.number for r in records if r.label in measured_seconds}
    beats = _beats(Verdict.recorded(plan.provenance.search), measured, profile.tie_tolerance)
    best = choose_best(records, budget, tie_tolerance=profile.tie_tolerance, beats=beats)
    if best is None:
        lowest = min(records, key=lambda r: r.memory(budget), default=None)
        found = f"; the lowest predicted is {lowest.label} at {format_bytes(lowest.memory(budget))}" if lowest else ""
        raise InfeasibleBudgetError(
            f"No plan of the searched space is predicted to fit {budget.description} ({len(records)} scored{found}). "
            "Raise the budget, or lower the batch size."
        )
    replanned = _replanned_plan(plan, best, budget, requested, profile, batch, len(records))
    table = replanned_table(plan, replanned, budget, profile) if ratio == 1 else None
    if table is not None:
        replanned = replanned.with_provenance(plan_table=table.to_dict())
    return Replanned(
        plan=replanned,
        budget=budget,
        predicted_seconds=best.median_seconds or 0.0,
        predicted_samples_per_second=best.samples_per_second or 0.0,
        predicted_peak_bytes=best.peak_bytes or 0,
        predicted_activation_bytes=best.activation_bytes or 0,
        considered=len(records),
        fitting=sum(r.feasible for r in records),
        batch_size=batch,
        time_measured=best.number in measured,
        notes=tuple(n for n in (_time_model_note(plan, profile, len(measured)),) if n),
    )


def _measured_seconds(plan: Plan, profile: SavedProfile) -> dict[str, float]:
    """Step seconds the file measured, by label: the time model's anchors (median of repeats), the chosen plan's own
    ``measured`` figure over its anchor."""
    timed: dict[str, list[float]] = {}
    for label, _, seconds in profile.time.calibration.anchors:  # ``of_plan`` refuses a time model without one
        if seconds > 0:
            timed.setdefault(label, []).append(seconds)
    out = {label: statistics.median(values) for label, values in timed.items()}
    chosen = plan.provenance.measured
    if isinstance(chosen.get("label"), str):
        seconds = chosen.get("median_seconds")
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
            out[chosen["label"]] = float(seconds)
    return out


def _beats(verdict: Verdict | None, measured: set[int], tie_tolerance: float) -> BeatsFn:
    """Whether a tuned record beats the reference baseline: the file's verdict for that pair; else, where one figure was
    measured and the other predicted, their predictions; else None, and their figures decide."""

    def beats(t: TrialRecord, reference: TrialRecord) -> bool | None:
        if verdict is not None and verdict.candidate == t.label and verdict.reference == reference.label:
            return verdict.wins
        if (t.number in measured) == (reference.number in measured):
            return None
        if t.predicted_seconds is None or reference.predicted_seconds is None:
            return False
        return reference.predicted_seconds > t.predicted_seconds * (1 + tie_tolerance)

    return beats


def _time_model_note(plan: Plan, profile: SavedProfile, n_measured: int) -> str | None:
    """A line when the saved time model predicted the measured steps badly (as the search recorded, else its fit)."""
    summary = plan.provenance.search.get("time_model")
    error = summary.get("median_abs_error") if isinstance(summary, Mapping) else None
    where = "of the plans the search predicted and then measured"
    if not isinstance(error, (int, float)) or isinstance(error, bool):
        calibration = profile.time.calibration  # ``of_plan`` refuses a time model without one
        residuals = [abs((calibration.base_seconds + a) / m - 1) for _, a, m in calibration.anchors if m > 0]
        if not residuals:
            return None
        error, where = statistics.median(residuals), "of the plans its fit rests on"
    if error <= WELL_PREDICTED_ERROR:
        return None
    return (
        f"the saved time model's predictions were off by {error:.0%} (median {where}; more than the "
        f"{WELL_PREDICTED_ERROR:.0%} it predicts within on a steady machine), so predicted speeds may rank plans wrongly: "
        f"the {n_measured} plan{'s' * (n_measured != 1)} the file measured keep{'s' * (n_measured == 1)} their "
        "measured step times. Re-tune on a quieter machine before trusting a predicted speed-up."
    )


def predicted_records(
    profile: SavedProfile,
    memory: RealStepMemory,
    time: TimeModel,
    budget: Budget,
    *,
    device: torch.device | str,
    rows: int,
    ratio: float = 1.0,
    model: MemoryModel | None = None,
    measured: Mapping[str, float] | None = None,
) -> list[TrialRecord]:
    """Every plan of ``profile``'s space scored by ``memory`` and ``time`` alone, as records for ``choose_best``.
    ``model``: what says which plans can run (default the profile's); ``measured``: step seconds by label."""
    model = model or profile.memory
    _, candidates = offered_candidates(
        profile.space.for_device(device_type(device)), profile.stacks, model.fingerprint, model
    )
    records = []
    for number, cand in enumerate(candidates):
        predicted = time.predict_seconds(cand.plan)
        if predicted is None:
            continue
        figures = memory.predict(cand.plan)
        if figures is None:  # a PT2 budget under compile: the partitioner's choice, never predicted
            continue
        peak, activation = figures
        seconds = (measured[cand.label] if measured and cand.label in measured else predicted) * ratio
        records.append(
            TrialRecord(
                number=number,
                plan=cand.plan,
                label=cand.label,
                params=dict(cand.params),
                baseline=cand.baseline,
                status=TrialStatus.OK if budget.fits(peak, activation) else TrialStatus.OVER_BUDGET,
                predicted_peak_bytes=peak,
                predicted_activation_bytes=activation,
                peak_bytes=peak,
                activation_bytes=activation,
                samples_per_second=rows / seconds,
                median_seconds=seconds,
                memory_measured=False,
                predicted_seconds=predicted * ratio,
            )
        )
    return records


def table_bucket(
    length: int,
    memory_model: MemoryModel,
    time: TimeModel,
    searched: SavedProfile,
    budget: Budget,
    rows: int,
    top: Plan,
    *,
    compiled: CompiledMemoryModel | None = None,
) -> Bucket:
    """The bucket at ``length``: the search's rule over every plan's predicted figures there, else the top plan (it
    fits at the longest length). ``compiled``: a compiled model's memory there; its bucket keeps no profile, as
    ``replan`` predicts eager steps."""
    memory = RealStepMemory(compiled or memory_model, searched.optimizer)
    records = predicted_records(
        searched, memory, time, budget, device=memory_model.device, rows=rows, model=memory_model
    )
    best = choose_best(records, budget, tie_tolerance=searched.tie_tolerance)
    profile = None if compiled is not None else {"memory": memory_model.to_dict(), "time": time.to_dict()}
    if best is None:
        return Bucket(length, top, "search", profile=profile)
    plan = replace(best.plan, name=f"bucket <= {length}", fingerprint=top.fingerprint, metadata={})
    return Bucket(length, plan, "predicted", best.peak_bytes, best.activation_bytes, best.median_seconds, profile)


def replanned_table(original: Plan, top: Plan, budget: Budget, profile: SavedProfile) -> PlanTable | None:
    """``original``'s plan table re-planned for ``budget`` (``top``: the longest bucket's plan) from the profiles its
    buckets keep; None when there is no table or a bucket keeps no profile."""
    table = PlanTable.of_plan(original)
    if table is None or any(b.profile is None for b in table.buckets[:-1]):
        return None
    buckets = []
    for b in table.buckets[:-1]:
        assert b.profile is not None
        try:
            memory = MemoryModel.from_dict(b.profile["memory"])
            time = TimeModel.from_dict(b.profile["time"])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise PlanError(
                f"the plan table's bucket <= {b.max_length} keeps a malformed profile ({type(err).__name__}: {err}); "
                "re-tune to write a new one."
            ) from None
        buckets.append(table_bucket(b.max_length, memory, time, profile, budget, table.rows, top))
    replanned = top.provenance.replanned
    figures = (replanned.get(f"predicted_{k}") for k in ("peak_bytes", "activation_bytes", "seconds"))
    return PlanTable((*buckets, Bucket(table.longest, top, "predicted", *figures)), table.rows)


def _replanned_plan(
    plan: Plan,
    best: TrialRecord,
    budget: Budget,
    requested: RequestedBudget,
    profile: SavedProfile,
    batch: int,
    considered: int,
) -> Plan:
    """``best``'s plan carrying what it was chosen on: marked predicted, the new budget, the same profile."""
    kept = replace(best.plan, name="replanned", fingerprint=profile.memory.fingerprint, metadata=plan.metadata)
    conditions = dict(plan.provenance.conditions)
    if batch != profile.batch_size and conditions:
        conditions["batch_size"] = batch
    return kept.with_provenance(
        **dict.fromkeys(_MEASURED_KEYS),
        budget={**budget.to_dict(), "requested": requested.requested_max_memory},
        conditions=conditions or None,
        replanned={
            "predicted": True,
            "from_plan": plan.describe(),
            "from_budget": plan.provenance.budget.get("description"),
            "batch_size": batch,
            "profiled_batch_size": profile.batch_size,
            "predicted_seconds": best.median_seconds,
            "predicted_samples_per_second": best.samples_per_second,
            "predicted_peak_bytes": best.peak_bytes,
            "predicted_activation_bytes": best.activation_bytes,
            "plans_scored": considered,
        },
    )
