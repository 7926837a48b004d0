"""What the optimizer adds to a real training step: its state, and the peak of ``optimizer.step()``.

Trials run forward and backward only, on the first batch, before the optimizer has ever stepped. The
real steps after lock-in carry the optimizer's state through every forward and backward (AdamW: two
copies of the trainable parameters), and ``optimizer.step()`` itself peaks with every gradient live
plus its temporaries (``foreach`` implementations allocate a parameter-sized buffer per group, e.g.
AdamW's ``sqrt(exp_avg_sq)``). A budget checked on trials alone is broken by both.

So we measure one optimizer step, whatever the optimizer is (no table of known optimizers to keep up
to date): gradients are filled in where missing, ``optimizer.step()`` runs under the same memory
reading as a trial (CPU: the live-tensor tracker; CUDA: the allocator's peak), and afterwards the
parameters, the optimizer's state and hyper-parameters, the gradients and the RNG are put back
exactly. Copies are kept in host memory, so they do not count against the device being measured.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt.errors import InfeasibleBudgetError
from lightning_ckpt.measure.measurement import is_out_of_memory, release_memory
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.tracker import new_live_tracker, tensor_bytes

__all__ = ["OptimizerStepMemory", "RealStepMemory", "measure_optimizer_step"]


@dataclass(frozen=True)
class OptimizerStepMemory:
    """The optimizer's part of a real training step.

    state_bytes_before: optimizer state present when the trials ran (none before the first step).
    state_bytes_after: state present after one step: what every later forward and backward carries.
    step_peak_bytes: the highest live bytes while ``optimizer.step()`` ran: parameters, every gradient,
    the state, the step's temporaries and the batch (in ``measure_step``'s currency).
    measured: False when the step could not be run alone (an optimizer that needs a closure, e.g.
    LBFGS); the figures are then zero and only the guard after lock-in checks the real steps.
    note: why it was not measured, or what was measured.
    """

    state_bytes_before: int
    state_bytes_after: int
    step_peak_bytes: int
    measured: bool = True
    note: str = ""

    @classmethod
    def absent(cls) -> OptimizerStepMemory:
        """No optimizer given: nothing is added to a trial's figures."""
        return cls(0, 0, 0, measured=False, note="no optimizer given")

    @property
    def pending_state_bytes(self) -> int:
        """State the first real step will create: every later step carries it through forward and backward."""
        return max(0, self.state_bytes_after - self.state_bytes_before)

    def real_peak(self, forward_backward_peak: int | None) -> int | None:
        """A real step's peak from a trial's forward+backward peak: the larger of that step with the
        optimizer's state present and the optimizer step itself."""
        if forward_backward_peak is None:
            return None
        return max(forward_backward_peak + self.pending_state_bytes, self.step_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerStepMemory:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values())


def _host_copy(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class _OptimizerSnapshot:
    """Parameters, optimizer state and hyper-parameters, copied to host memory and put back in place."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.param_copies = [p.detach().to("cpu", copy=True) for p in self.params]
        self.groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        # The state's own tensor objects are kept (code may hold references to them) and refilled in place.
        self.state = {p: {k: (v, _host_copy(v)) for k, v in s.items()} for p, s in optimizer.state.items()}

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, self.param_copies, strict=True):
                p.copy_(saved)
            for p in list(self.optimizer.state):
                if p not in self.state:
                    del self.optimizer.state[p]
            for p, entries in self.state.items():
                restored = {}
                for k, (original, saved) in entries.items():
                    if isinstance(original, torch.Tensor):
                        original.copy_(saved)
                        restored[k] = original
                    else:
                        restored[k] = saved
                self.optimizer.state[p] = restored
        for group, saved in zip(self.optimizer.param_groups, self.groups, strict=True):
            group.update(saved)


def measure_optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device | str,
    extra: tuple[Any, ...] = (),
) -> OptimizerStepMemory:
    """Run ``optimizer.step()`` once on ``model`` and read what it adds to a real step; leave no trace.

    Gradients missing at this point (none exist before the first backward) are filled with zeros for
    the step: a real optimizer step sees every trainable parameter's gradient. Parameters, gradients,
    optimizer state, hyper-parameters and RNG are restored afterwards, exactly.
    """
    device = torch.device(device)
    before = _state_bytes(optimizer)
    snapshot = StateSnapshot.capture(model)
    saved = _OptimizerSnapshot(optimizer)
    filled = []
    try:
        for p in saved.params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                filled.append(p)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.reset_peak_memory_stats(device)
            optimizer.step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            tracker = new_live_tracker(device, model, optimizer)
            tracker.track_external(model, optimizer, *extra)
            tracker.total_peak = tracker.now()[0]
            with tracker:
                optimizer.step()
            peak = tracker.total_peak
        after = _state_bytes(optimizer)
        oom = None
    except Exception as err:
        if is_out_of_memory(err):
            # Not "unmeasured": the step alone, with no activation held, does not fit. Every real step would
            # run out of memory whatever the plan, so no plan may be chosen (and none is: tune() stops here).
            oom = InfeasibleBudgetError(
                f"optimizer.step() of {type(optimizer).__name__} ran out of memory on its own, with no activation "
                f"held ({type(err).__name__}: {str(err)[:300]}), so every training step would too, whatever the "
                "checkpointing plan. Make room for the optimizer: shard it (FSDP2), use a lighter optimizer "
                "(e.g. 8-bit or SGD), or keep its state off the device."
            )
        else:  # e.g. LBFGS: step() needs a closure. Nothing to predict; the guard checks real steps.
            return OptimizerStepMemory(before, before, 0, measured=False, note=f"{type(err).__name__}: {err}")
    finally:
        for p in filled:
            p.grad = None
        saved.restore()
        snapshot.restore()
    if oom is not None:  # raised here, after the ``except``: the failed step's tensors are free by now
        release_memory(device)
        raise oom
    return OptimizerStepMemory(before, after, peak, note=f"{type(optimizer).__name__} step measured")


@dataclass(frozen=True)
class RealStepMemory:
    """What the budget sees of a plan: the memory model's prediction of a forward+backward, turned into
    the real step's (``OptimizerStepMemory.real_peak``). ``model`` is a ``MemoryModel`` or anything with
    ``predict_peak``/``predict_activation``/``can_run`` (the joint search's scaled model)."""

    model: Any
    optimizer: OptimizerStepMemory = field(default_factory=lambda: OptimizerStepMemory.absent())

    def predict(self, plan: Any) -> tuple[int, int]:
        """(real-step peak, activation bytes) predicted for ``plan``."""
        return self.optimizer.real_peak(self.model.predict_peak(plan)) or 0, self.model.predict_activation(plan)

    def can_run(self, plan: Any) -> str | None:
        return self.model.can_run(plan)

    def real_peak(self, forward_backward_peak: int | None) -> int | None:
        return self.optimizer.real_peak(forward_backward_peak)

    def trial_limit(self, limit_bytes: int | None) -> int | None:
        """The cap for a trial's forward+backward: the budget less the state the first real step creates."""
        return None if limit_bytes is None else max(1, limit_bytes - self.optimizer.pending_state_bytes)
