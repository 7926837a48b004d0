"""Trial runners: how one candidate plan is measured (``measure``), re-timed side by side (``retime``), and whether
the memory model's predictions hold for it (``predicts_memory``). ``EagerRunner`` applies the plan and calls
``measure_step``; ``compile.CompiledTrials`` compiles each plan; a runner for sharded models plugs in the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

import torch

from lightning_ckpt.measure.device_memory import device_memory
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.measure.measurement import Measurement
from lightning_ckpt.measure.tracker import fsdp_root
from lightning_ckpt.plan.apply import plan_applied
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.ledger import TrialStatus

__all__ = ["EagerRunner", "TrialRunner", "release_cached_memory"]


class TrialRunner(Protocol):
    """What the study needs from whatever runs a plan."""

    predicts_memory: bool  # the memory model's predictions hold for this runner's steps
    memory_exact: bool  # and are exact (CPU, eager): a trial may be timed only, its memory pass left to the finalists
    predicts_time: bool  # the time model's block timings hold for this runner's steps
    collective_steps: bool  # a step runs collectives (FSDP2): a failure on one rank leaves the others waiting
    reserve_headroom_bytes: int  # added to the CUDA cap for the allocator's reserve (the profile measures it)
    harness: StepHarness  # the step it runs (the search's warm-up runs it too)

    def measure(self, plan: Plan, memory_limit: int | None, *, memory: bool = True) -> Measurement:
        """Run ``plan`` (warm-up, timed steps; the memory pass unless ``memory=False``) under the CUDA cap."""

    def measure_memory(self, plan: Plan, memory_limit: int | None) -> Measurement:
        """Only the memory pass (and the FLOP count) of ``plan``: for a trial timed with ``memory=False``."""

    def retime(self, plan: Plan, steps: int, *, warmup: int = 1) -> Measurement:
        """A confirmation round's figures: ``warmup`` untimed then ``steps`` timed steps, no memory pass."""


class EagerRunner:
    """Applies each plan to the uncompiled model and measures it with ``measure_step``."""

    predicts_memory = True
    memory_exact = True
    predicts_time = True

    def __init__(self, harness: StepHarness, *, count_flops: bool = True, reserve_headroom_bytes: int = 0) -> None:
        self.harness = harness
        self.count_flops = count_flops
        self.reserve_headroom_bytes = reserve_headroom_bytes
        # FSDP2 all-gathers and reduce-scatters inside the step: a trial is a collective of all ranks.
        self.collective_steps = fsdp_root(harness.root) is not None

    def measure(self, plan: Plan, memory_limit: int | None, *, memory: bool = True) -> Measurement:
        warmup, steps = self.harness.warmup_steps, self.harness.measure_steps
        return self._measure(
            plan, memory_limit, warmup=warmup, steps=steps, memory=memory, flops=memory and self.count_flops
        )

    def measure_memory(self, plan: Plan, memory_limit: int | None) -> Measurement:
        return self._measure(plan, memory_limit, warmup=0, steps=1, memory=True, flops=self.count_flops)

    def _measure(
        self, plan: Plan, memory_limit: int | None, *, warmup: int, steps: int, memory: bool, flops: bool
    ) -> Measurement:
        h = self.harness
        with plan_applied(h.target, plan) as handle, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"lightning_ckpt: segments\[")  # reported as the trial's error
            m = h.measure(
                warmup=warmup,
                steps=steps,
                track_memory=memory,
                count_flops=flops,
                memory_limit_bytes=memory_limit,
                reserve_headroom_bytes=self.reserve_headroom_bytes,
            )
            pool = handle.offload_pool.stats() if handle.offload_pool is not None else None
        if pool is not None and pool.offloaded_tensors:  # offload trades device memory for host memory: report it
            extra = {"offload_host_pool_bytes": pool.capacity_bytes, "offload_host_peak_bytes": pool.peak_bytes}
            m = replace(m, extra={**m.extra, **extra})
        return _with_deviations(m, handle.deviations)

    def retime(self, plan: Plan, steps: int, *, warmup: int = 1) -> Measurement:
        h = self.harness
        with plan_applied(h.target, plan):
            return h.measure(warmup=warmup, steps=steps, track_memory=False, count_flops=False)


def _with_deviations(outcome: Measurement, deviations: Mapping[str, str]) -> Measurement:
    """A trial whose segments left the chain in some step (LayerDrop) ran unsegmented there, so its figures are not
    the plan's: ``invalid``, and ``extra["unchained_stacks"]`` tells the study to offer no more segments over them."""
    if not deviations or outcome.trial_status.failed:
        return outcome
    why = "; ".join(f"segments[{stack!r}]: {reason}" for stack, reason in sorted(deviations.items()))
    error = (
        f"{why}. The parent does not run these stacks as a chain on every step, so segments cannot hold their "
        "memory there; per-block modes are searched instead."
    )
    extra = {**outcome.extra, "unchained_stacks": sorted(deviations)}
    return replace(outcome, status=TrialStatus.INVALID.value, error=error, extra=extra)


def release_cached_memory(device: torch.device) -> None:
    """Give back what trials left cached: device blocks, and the pinned host blocks of offload trials (a plan's
    offload pool goes back to torch's host caching allocator when the plan is removed, which keeps them). No
    collection: a failed step's memory was collected when it failed (``measure_step``), and a full collection cost
    more than ten plain steps of a 10 ms model, twice per search."""
    memory = device_memory(device)
    if memory is not None:
        memory.empty_cache()
    if device.type != "cuda":
        return
    # torch 2.13 added the accelerator-generic name; the CUDA one is older.
    host_empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()
