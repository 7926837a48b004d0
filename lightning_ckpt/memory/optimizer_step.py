"""What the optimizer adds to a real training step, as figures (kept in the plan file, read back without torch), and the
real step's memory they turn a trial's into."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["OptimizerStepMemory", "RealStepMemory"]


@dataclass(frozen=True)
class OptimizerStepMemory:
    """The optimizer's part of a real training step. ``measured`` is False when the step could not run alone (e.g.
    LBFGS needs a closure): only the guard checks real steps then."""

    state_bytes_before: int  # present when the trials ran (none before the first step)
    state_bytes_after: int  # present after one step: what every later forward and backward carries
    # The highest live bytes in ``optimizer.step()``: parameters, gradients, state, temporaries, the batch.
    step_peak_bytes: int
    measured: bool = True
    note: str = ""  # why it was not measured, or what was

    @classmethod
    def absent(cls) -> OptimizerStepMemory:
        return cls(0, 0, 0, measured=False, note="no optimizer given")

    @property
    def pending_state_bytes(self) -> int:
        """State the first real step will create: every later step carries it through forward and backward."""
        return max(0, self.state_bytes_after - self.state_bytes_before)

    def real_peak(self, forward_backward_peak: int | None) -> int | None:
        """A real step's peak from a trial's: that step with the optimizer's state present, or the update's peak."""
        if forward_backward_peak is None:
            return None
        return max(forward_backward_peak + self.pending_state_bytes, self.step_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerStepMemory:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class RealStepMemory:
    """What the budget sees of a plan: the memory model's forward+backward prediction turned into the real step's.
    ``model``: a ``MemoryModel`` or ``CompiledMemoryModel``."""

    model: Any
    optimizer: OptimizerStepMemory = field(default_factory=OptimizerStepMemory.absent)

    def predict(self, plan: Any) -> tuple[int, int] | None:
        """(real-step peak, activation bytes) for ``plan``; None where the model predicts nothing (PT2's choice)."""
        peak, activation = self.model.predict_peak(plan), self.model.predict_activation(plan)
        return None if peak is None or activation is None else (self.optimizer.real_peak(peak) or 0, activation)

    def can_run(self, plan: Any) -> str | None:
        return self.model.can_run(plan)

    def host_bytes(self, plan: Any) -> int:
        """The host memory ``plan``'s offloaded blocks pin (0 where the model has no ``host_bytes``)."""
        host = getattr(self.model, "host_bytes", None)
        return host(plan) if host is not None else 0

    def real_peak(self, forward_backward_peak: int | None) -> int | None:
        return self.optimizer.real_peak(forward_backward_peak)

    def trial_limit(self, limit_bytes: int | None) -> int | None:
        """The cap for a trial's forward+backward: the budget less the state the first real step creates."""
        return None if limit_bytes is None else max(1, limit_bytes - self.optimizer.pending_state_bytes)
