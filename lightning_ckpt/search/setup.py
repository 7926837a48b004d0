"""What every search sets up before its first step and undoes after its last, the budget it resolves on the device,
and the passes that need no more memory than the lowest-memory plan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_ckpt.budget import Budget, RequestedBudget, within_host
from lightning_ckpt.errors import InfeasibleBudgetError
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.measure.allocator import AllocatorRegime, search_allocator
from lightning_ckpt.measure.device_memory import device_memory
from lightning_ckpt.measure.measurement import PassOutOfMemory, run_pass
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.measure.snapshot import find_parameters_written_in_forward, forget_parameters_written_in_forward
from lightning_ckpt.memory.optimizer_step import RealStepMemory
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.skipping import full_depth
from lightning_ckpt.search.compile import CompiledTrials, release_kept_graphs
from lightning_ckpt.search.distributed import Sync
from lightning_ckpt.search.phases import Phases
from lightning_ckpt.search.runners import TrialRunner, release_cached_memory

__all__ = ["SearchSession", "lowest_memory_pass", "resolve_budget", "resolve_on_device", "search_session"]

log = logging.getLogger(__name__)


class SearchSession:
    """A search's set-up, undone however it ends: every block runs (LayerDrop at full depth: the budget must hold for
    the deepest step), each step starts from the modules' Python attributes, expandable segments on CUDA where they
    can be verified (kept for training)."""

    def __init__(self, resolved: ModelView, allocator: AllocatorRegime | None, clock: Callable[[], float]) -> None:
        self.resolved = resolved
        self.allocator = allocator  # what the search runs under, recorded in the plan file
        memory = device_memory(resolved.device)
        self.began = memory.allocated() if memory is not None else None  # held before the search: named if none fits
        # Each step starts from the Python attributes as they were (a counter-driven curriculum sees call 1 each
        # time, and so does the first real step): ``python_state.restoring(step_fn)``.
        self.python_state = PythonState.capture(resolved.root)
        self.phases = Phases(clock)  # where the search's time goes (``result.cost``)

    def check_parameter_writes(self, step_fn: Callable[[], Any]) -> None:
        """Find the parameters the forward itself writes (``Embedding(max_norm=...)``), to put back after each step."""
        with self.phases.timing("write_check"):
            lowest_memory_pass(
                "the parameter-write check",
                self.began,
                self.resolved,
                lambda: find_parameters_written_in_forward(self.resolved.root, step_fn),
            )


@contextlib.contextmanager
def search_session(resolved: ModelView, clock: Callable[[], float]) -> Iterator[SearchSession]:
    # Full depth is entered before the Python attributes are captured, which would put LayerDrop's rates back.
    with full_depth(resolved.root, resolved.stacks) as deepened, search_allocator(resolved.device) as allocator:
        if deepened:
            log.info("lightning_ckpt: searching at full depth (every block runs): %s", deepened)
        session = SearchSession(resolved, allocator, clock)
        try:
            yield session
        finally:
            release_cached_memory(resolved.device)
            release_kept_graphs()  # a compiled model's re-timing rounds keep graphs (search.compile): none outlive it
            forget_parameters_written_in_forward(resolved.root)
            session.python_state.restore()
            session.python_state.warn_unrestorable()


def resolve_budget(
    requested: RequestedBudget, memory: RealStepMemory, runner: TrialRunner | None, resolved: ModelView, sync: Sync
) -> Budget:
    """The requested budget, an activation share of the largest rank's no-checkpointing step (``memory``'s, or under
    a compiled ``runner`` the compiled step's), the same on every rank. ``runner`` None: the eager step's."""
    none_activation = memory.model.predict_activation(Plan())
    if isinstance(runner, CompiledTrials):  # an activation budget is a fraction of the *compiled* step's activations
        none_activation = runner.none_activation_bytes(Plan(fingerprint=resolved.fingerprint)) or none_activation
    if sync.world_size > 1:
        # The largest rank's: trials are judged by the most any rank used, so the share must be of the step that
        # needs the most (the ranks' first batches can differ in length), not rank 0's own.
        none_activation = max((n for n in sync.all_gather(none_activation) if n is not None), default=None)
    budget = resolve_on_device(requested, resolved.device, none_activation)
    predicted = format_bytes(none_activation)
    log.info(
        "lightning_ckpt: budget %s; no-checkpointing activation memory predicted %s", budget.description, predicted
    )
    step_peak = memory.optimizer.step_peak_bytes
    if budget.kind == "peak" and budget.limit_bytes is not None and step_peak > budget.limit_bytes:
        log.warning(
            "lightning_ckpt: the optimizer step alone peaks at %s (%s), over the budget (%s): no plan can fit",
            format_bytes(step_peak),
            memory.optimizer.note,
            budget.description,
        )
    return budget


def resolve_on_device(requested: RequestedBudget, device: torch.device, none_activation: int | None) -> Budget:
    """The requested budget on ``device``, its peak clamped (with one line that says so) to what the device's
    allocator lets this process have: the card, or the user's own ``set_per_process_memory_fraction`` of it; on the
    CPU, to the host's memory (``budget.within_host``)."""
    budget = requested.resolve(device=device, none_activation_bytes=none_activation)
    memory, clamped = device_memory(device), None
    if memory is not None and budget.kind in ("peak", "none"):
        budget, clamped = budget.within(memory.cap_bytes(), str(device))
    elif memory is None and device.type == "cpu":
        budget, clamped = within_host(budget)  # the host's memory (or the container's limit)
    if clamped is not None:
        log.warning(clamped)
    return budget


def lowest_memory_pass(what: str, started: int | None, resolved: ModelView, run: Callable[[], Any]) -> Any:
    """``run()``, a pass that needs no more memory than the lowest-memory plan (``measurement.run_pass``): an OOM that
    survives it means no plan fits, ``InfeasibleBudgetError``, not chained to the OOM (whose traceback would keep the
    pass's tensors alive)."""
    try:
        return run_pass(what, resolved.device, run)
    except PassOutOfMemory as failed:
        failure = failed.with_traceback(None)  # its frames hold the profile's captured inputs
    memory = device_memory(resolved.device)
    facts = [f"{format_bytes(started)} was already allocated when the search began"] if started is not None else []
    if memory is not None:
        facts.append(f"this process may allocate {format_bytes(memory.cap_bytes())} there")
    raise InfeasibleBudgetError(
        f"{failure.what} ran out of memory on {resolved.device} ({failure.message}){failure.allocator_note()}. It "
        "needs no more memory than the lowest-memory plan (every block fully checkpointed), so no plan fits"
        f"{': ' + '; '.join(facts) if facts else ''}. Free memory before the fit (other models, cached tensors), use a "
        "smaller batch or micro-batch, shard the model (FSDP2), or give the process more of the device.",
        allocator=failure.figures,
    ) from None
