"""Measuring what the optimizer adds to a real training step: its state, and the peak of ``optimizer.step()``. Trials
run forward and backward only, before the optimizer has stepped; so one step of whatever optimizer is given is measured
(no table of known ones) and put back exactly from host copies."""

from __future__ import annotations

import copy
import gc
from typing import Any

import torch
from torch import nn

from lightning_ckpt.errors import InfeasibleBudgetError
from lightning_ckpt.measure.device_memory import device_memory
from lightning_ckpt.measure.measurement import PassOutOfMemory, is_out_of_memory, release_memory, run_pass, synchronize
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.step import track_step_memory
from lightning_ckpt.measure.tracker import tensor_bytes
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory

__all__ = ["measure_optimizer_step", "optimizer_state_bytes"]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
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
                for original, saved in entries.values():
                    if isinstance(original, torch.Tensor):
                        original.copy_(saved)
                self.optimizer.state[p] = {k: o if isinstance(o, torch.Tensor) else s for k, (o, s) in entries.items()}
        for group, saved in zip(self.optimizer.param_groups, self.groups, strict=True):
            group.update(saved)


def measure_optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device | str, extra: tuple[Any, ...] = ()
) -> OptimizerStepMemory:
    """Run ``optimizer.step()`` once on ``model`` and read what it adds to a real step; leave no trace. Missing
    gradients are zeros for the step: a real one sees every trainable parameter's. A refusal that stays (``run_pass``
    retries once) means every real step would run out of memory whatever the plan: ``InfeasibleBudgetError``."""
    device = torch.device(device)
    try:
        return run_pass("the optimizer-step measurement", device, lambda: _step_once(model, optimizer, device, extra))
    except PassOutOfMemory as failed:
        failure = failed.with_traceback(None)
    raise InfeasibleBudgetError(
        f"optimizer.step() of {type(optimizer).__name__} ran out of memory on its own, with no activation held "
        f"({failure.message[:300]}){failure.allocator_note()}, so every training step would too, whatever the "
        "checkpointing plan. Make room for the optimizer: shard it (FSDP2), use a lighter optimizer (e.g. 8-bit or "
        "SGD), or keep its state off the device.",
        allocator=failure.figures,
    )


def _step_once(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, extra: tuple[Any, ...]
) -> OptimizerStepMemory:
    """One ``optimizer.step()``, read and undone; out of memory, ``torch.OutOfMemoryError`` once all is restored."""
    before = optimizer_state_bytes(optimizer)
    snapshot = StateSnapshot.capture(model)
    saved = _OptimizerSnapshot(optimizer)
    filled = []
    try:
        for p in saved.params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                filled.append(p)
        memory = device_memory(device)
        if memory is not None:  # CUDA, or a simulated card: the allocator's peak
            synchronize(device)
            gc.collect()
            memory.reset_peak()
            optimizer.step()
            synchronize(device)
            peak = memory.max_allocated()
        else:
            peak = track_step_memory(
                optimizer.step, model=model, optimizer=optimizer, device=device, extra=extra
            ).peak_bytes
        after = optimizer_state_bytes(optimizer)
        refused = None
    except Exception as err:
        if not is_out_of_memory(err):  # e.g. LBFGS: step() needs a closure. Nothing to predict; the guard checks.
            return OptimizerStepMemory(before, before, 0, measured=False, note=f"{type(err).__name__}: {err}")
        refused = f"{type(err).__name__}: {err}"
    finally:
        for p in filled:
            p.grad = None
        saved.restore()
        snapshot.restore()
    if refused is not None:
        # Raised here, after the ``except`` (the failed step's tensors are free by now), for ``run_pass``.
        release_memory(device)
        raise torch.OutOfMemoryError(refused)
    return OptimizerStepMemory(before, after, peak, note=f"{type(optimizer).__name__} step measured")
