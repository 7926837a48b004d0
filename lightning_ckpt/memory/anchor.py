"""The memory profile's anchor step: one forward+backward with *every* block fully checkpointed, the maximum of live
bytes recorded per *phase* (``model.PhasePeak``), delimited by module hooks and gradient hooks. It catches what
per-block arithmetic gets wrong: gradients accumulating during backward, the logits and loss, the embedding backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_ckpt.measure.harness import loss_of
from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.chain import hidden_slot, in_slot
from lightning_ckpt.plan.format import BlockPlan, Plan

__all__ = ["Calls", "anchor_step", "cuda_allocator_anchor", "phase_rank"]


def phase_rank(label: tuple[Any, ...], n: int) -> int:
    """The phase's place in the step: the blocks' forwards in order, then their backwards in reverse."""
    i = label[1] if len(label) > 1 else 0
    back = 2 * n + 2 * (n - 1 - i)
    ranks = {"pre": 0, "fwd": 1 + 2 * i, "fwd_gap": 2 + 2 * i, "bw_head": 1 + 2 * n, "bw": 2 + back, "bw_gap": 3 + back}
    return ranks[label[0]]


@dataclass
class Calls:
    """How the anchor step called each block (one entry per call); checkpointing changes neither whether a tensor
    needs a gradient nor which outputs receive one."""

    input_grad: list[bool]  # the hidden input needed a gradient
    output_grad: list[bool]  # some output needed a gradient (False: no gradient flows through the call)
    grad_leaves: list[set[int]]  # positions (``tree_flatten``) of the output leaves that received one


class _AnchorPhases:
    """Hooks that move the tracker from phase to phase and record how each call was made."""

    def __init__(self, root: nn.Module, order: list[str], tracker: Any) -> None:
        self.n = n = len(order)
        self.tracker = tracker
        self.positions: dict[str, list[int]] = {}
        for i, fqn in enumerate(order):
            self.positions.setdefault(fqn, []).append(i)
        self.seen: dict[str, int] = {}
        self.running: dict[int, int] = {}  # id(module) -> the call index of its call in progress
        self.calls = Calls([False] * n, [False] * n, [set() for _ in range(n)])
        self.current: tuple[Any, ...] = ("pre",)
        self.fqn_of = {id(root.get_submodule(f)): f for f in order}

    def enter(self, label: tuple[Any, ...]) -> None:
        # Hooks can fire out of phase order (one tensor is both a block's output and the next block's
        # input); a phase never goes back, so the later one wins.
        if phase_rank(label, self.n) > phase_rank(self.current, self.n):
            self.current = label
            self.tracker.enter_phase(label)

    def leaf_reached(self, i: int, leaf: int, _grad: torch.Tensor) -> None:
        self.calls.grad_leaves[i].add(leaf)
        self.enter(("bw", i))

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fqn = self.fqn_of[id(module)]
        k = self.seen[fqn] = self.seen.get(fqn, -1) + 1
        calls_of = self.positions[fqn]
        i = self.running[id(module)] = calls_of[min(k, len(calls_of) - 1)]  # a shared block: its k-th call
        self.enter(("fwd", i))
        where = hidden_slot(args, kwargs, strict=True)
        if where is not None:
            t = in_slot(args, kwargs, where)
            self.calls.input_grad[i] = t.requires_grad
            if t.requires_grad:
                t.register_hook(lambda _grad, label=("bw_gap", i): self.enter(label))

    def post_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        i = self.running[id(module)]
        self.enter(("fwd_gap", i))
        # Every output that needs a gradient starts the block's backward: an auxiliary loss (an MoE router's) may
        # reach the block first, and under ``full`` recompute it right then.
        for leaf, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self.calls.output_grad[i] = True
                t.register_hook(functools.partial(self.leaf_reached, i, leaf))


def anchor_step(
    root: nn.Module, forward_fn: Callable[[], Any], order: list[str], externals: list[Any], device: torch.device
) -> tuple[Any, int, tuple[int, int], Calls]:
    """Forward+backward with every block ``full``, phase maxima recorded: the tracker, the resting level, the
    (total, activation) level when the forward returned, and how each block was called."""
    tracker = new_live_tracker(device, root)
    tracker.track_external(*externals)
    phases = _AnchorPhases(root, order, tracker)
    handle = apply_plan(root, Plan({f: BlockPlan("full") for f in order}))
    handles = []
    try:
        for f in phases.positions:
            m = root.get_submodule(f)
            handles.append(m.register_forward_pre_hook(phases.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(phases.post_hook, with_kwargs=True))
        resting = tracker.total_peak = tracker.now()[0]
        with tracker:
            tracker.enter_phase(("pre",))
            loss = loss_of(forward_fn())
            end_of_forward = tracker.now()
            phases.enter(("bw_head",))
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        handle.remove()
    return tracker, resting, end_of_forward, phases.calls


def cuda_allocator_anchor(
    root: nn.Module, forward_fn: Callable[[], Any], order: list[str], device: torch.device
) -> tuple[int, int, int]:
    """(max_memory_allocated, memory_allocated before, reserved-above-allocated peak) of the anchor step:
    the tracker-to-allocator offset, and the headroom a cap on reserved memory needs."""
    handle = apply_plan(root, Plan({f: BlockPlan("full") for f in order}))
    try:
        torch.cuda.synchronize(device)  # the cache is cold already (``run_pass``): the reserve this step itself needs
        resting = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = loss_of(forward_fn())
        loss.backward()
        del loss
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return peak, resting, torch.cuda.max_memory_reserved(device) - peak
    finally:
        handle.remove()
