"""Time each distinct block alone under every mode, during the profile: what ``timing.model.TimeModel`` predicts from.

The memory profile has already captured one call of each distinct block (its inputs, its autocast, how
the step's gradient reaches it) and run it under every mode under the live-tensor tracker. Timing those
runs under the tracker would time the tracker, so the same call runs again here without it:
forward and backward of the block alone, under the step's autocast, its mode applied with
``apply_plan`` as a trial would. The modes are interleaved round by round (a machine that slows
part-way slows every mode alike) and each mode's median is kept. The incoming gradient is ones, as in
the memory profile; only differences between modes are used, so its cost cancels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.memory.capture import (
    _autocast_as,
    _backward_leaves,
    _called_with,
    _Captured,
    _hidden_index,
    _hidden_of,
)
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.format import BlockPlan, Plan

__all__ = ["TIMING_ROUNDS", "time_block_modes"]

# Rounds per mode after one untimed warm-up round: the median of 5 is steady to a few percent on a busy
# 2-core machine, and a round costs one block's forward+backward per mode (a small share of one step).
TIMING_ROUNDS = 5


def time_block_modes(
    root: nn.Module,
    cap: _Captured,
    modes: Mapping[str, BlockPlan],
    *,
    device: torch.device,
    rounds: int = TIMING_ROUNDS,
    restore: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds of ``cap``'s block alone, forward and backward, under each of ``modes`` (key -> block
    plan); a mode that fails here is left out. ``restore`` puts the model's state back (gradients, RNG)."""
    where = _hidden_index(cap.args, cap.kwargs)
    if where is None:
        return {}
    samples: dict[str, list[float]] = {k: [] for k in modes}
    failed: set[str] = set()
    try:
        for r in range(rounds + 1):
            order: Sequence[str] = list(modes) if r % 2 == 0 else list(reversed(modes))
            for key in order:
                if key in failed:
                    continue
                try:
                    seconds = _time_once(root, cap, where, modes[key], device)
                except torch.OutOfMemoryError:
                    raise
                except Exception:
                    failed.add(key)  # the memory profile records why a mode cannot run
                    continue
                if r > 0:
                    samples[key].append(seconds)
    finally:
        if restore is not None:
            restore()
    return {k: statistics.median(v) for k, v in samples.items() if v and k not in failed}


def _time_once(root: nn.Module, cap: _Captured, where: tuple[str, Any], bp: BlockPlan, device: torch.device) -> float:
    hidden = _hidden_of(cap, where)
    handle = apply_plan(root, Plan({cap.fqn: bp}) if bp.mode != "none" else Plan())
    try:
        _synchronize(device)
        t0 = time.perf_counter()
        # As the memory profile runs it: a fresh non-leaf input (a leaf would keep its gradient, and with it
        # whatever a checkpointed child's graph still refers to, until the garbage collector runs).
        seed = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=cap.input_grad)
        args, kwargs = _called_with(cap, where, hidden.detach() + seed)
        with _autocast_as(cap.autocast):
            out = cap.module(*args, **kwargs)
            leaves = _backward_leaves(out, cap.grad_leaves)
        if leaves:
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        _synchronize(device)
        return time.perf_counter() - t0
    finally:
        handle.remove()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
