"""Time each distinct block alone under every mode, during the profile: what ``timing.model.TimeModel`` predicts from.
The memory profile's captured call runs again here without the tracker (whose cost would be timed too), its mode applied
with ``apply_plan`` as a trial would. Modes are interleaved round by round (a machine that slows part-way slows every
mode alike) and each mode's median is kept. A compiled model's blocks run *compiled alone* (``compiled_block_modes``),
the modes applied inside ``plan.apply.reused_forwards`` so a later round runs the graph the first compiled. One untimed
round compiles, one reads what each mode's graph saves for backward (no tracker can), then the timed ones."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt.discovery import is_compile_wrapper, unwrap_compiled
from lightning_ckpt.measure.measurement import synchronize
from lightning_ckpt.measure.saved_for_backward import SavedForBackward
from lightning_ckpt.memory.capture import Captured, autocast_as, backward_leaves, captured_tensors
from lightning_ckpt.plan.apply import apply_plan, reused_forwards
from lightning_ckpt.plan.chain import hidden_slot, in_slot, with_hidden
from lightning_ckpt.plan.format import BlockPlan, Plan

__all__ = ["CompiledBlockRuns", "compiled_block_modes", "profile_clock", "time_block_modes"]

# Rounds per mode after one untimed warm-up round: the median of 5 is steady to a few percent on a busy 2-core
# machine. A round is more than a whole step of a shallow fast model: as many rounds as ``TIMING_STEPS`` of the
# block's share of the step pay for, at least 3.
TIMING_ROUNDS = 5
MIN_TIMING_ROUNDS = 3
TIMING_STEPS = 4


def profile_clock() -> float:
    """The profile's seconds: the blocks' rounds and the anchor step are timed by it (a test's clock replaces it)."""
    return time.perf_counter()


def time_block_modes(
    root: nn.Module, cap: Captured, modes: Mapping[str, BlockPlan], *, device: torch.device, calls: int | None = None
) -> dict[str, float]:
    """Median seconds of ``cap``'s block alone, forward and backward, under each of ``modes`` (a mode that fails is left
    out). ``calls``: the step's calls of this block, which size the rounds; None runs the fixed ``TIMING_ROUNDS``."""
    where = hidden_slot(cap.args, cap.kwargs, strict=True)
    forwards: list[float] = []  # ``none``'s forward alone: the window an offloaded block's copies hide behind

    def once(key: str, r: int) -> float:
        return _time_once(
            root, cap, where, modes[key], device, cap.module, forwards=forwards if key == "none" else None
        )

    rounds = TIMING_ROUNDS
    t0 = profile_clock()
    warm = _interleaved(modes, 1, once)
    if calls is not None and warm.get("none") and (took := profile_clock() - t0) > 0:
        rounds = max(MIN_TIMING_ROUNDS, min(rounds, int(TIMING_STEPS * calls * warm["none"] / took)))
    seconds = _interleaved({k: modes[k] for k in warm}, rounds, once)
    return {**seconds, "forward": statistics.median(forwards[1:] or forwards)} if "none" in seconds else seconds


@dataclass
class CompiledBlockRuns:
    """One distinct block compiled alone, per mode key: median seconds and bytes saved for backward; and what
    compiling cost (tuning cost, never a block's time)."""

    seconds: dict[str, float] = field(default_factory=dict)
    saved_bytes: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0
    compiles: int = 0


def compiled_block_modes(
    root: nn.Module, cap: Captured, modes: Mapping[str, BlockPlan], *, device: torch.device
) -> CompiledBlockRuns:
    """``cap``'s block compiled alone under each of ``modes`` (see the module docstring), as ``time_block_modes``."""
    runs = CompiledBlockRuns()
    where = hidden_slot(cap.args, cap.kwargs, strict=True)
    region = _compiled_region(cap.module)
    memo: dict[tuple[Any, ...], Any] = {}

    def once(key: str, r: int) -> float:
        if r == 1:  # the graph compiled in round 0, run under the saved-tensor hooks
            with SavedForBackward(root, extra=captured_tensors(cap)) as saved:
                seconds = _time_once(root, cap, where, modes[key], device, region, memo)
            runs.saved_bytes[key] = saved.saved_bytes
            return seconds
        seconds = _time_once(root, cap, where, modes[key], device, region, memo)
        if r == 0:
            runs.compile_seconds += seconds
            runs.compiles += 1
        return seconds

    with _compiling(len(modes)):
        runs.seconds = _interleaved(modes, TIMING_ROUNDS + 2, once, timed_from=2)
    runs.saved_bytes = {k: v for k, v in runs.saved_bytes.items() if k in runs.seconds}
    return runs


def _interleaved(
    modes: Mapping[str, BlockPlan], rounds: int, once: Callable[[str, int], float], *, timed_from: int = 0
) -> dict[str, float]:
    """Median of ``once(key, round)`` per mode over the rounds from ``timed_from`` on, the order reversed every other
    round; a mode that raises (but for running out of memory) is left out."""
    samples: dict[str, list[float]] = {k: [] for k in modes}
    failed: set[str] = set()
    for r in range(rounds):
        for key in list(modes) if r % 2 == 0 else list(reversed(modes)):
            if key in failed:
                continue
            try:
                seconds = once(key, r)
            except torch.OutOfMemoryError:
                raise
            except Exception:
                failed.add(key)  # the memory profile records why a mode cannot run
                continue
            if r >= timed_from:
                samples[key].append(seconds)
    return {k: statistics.median(v) for k, v in samples.items() if v and k not in failed}


def _compiled_region(block: nn.Module) -> Callable[..., Any]:
    """The block as its compiled region runs it: itself where the user compiled it alone (their options), else its
    ``_call_impl`` compiled with the defaults, as the search's trials run it (``search.assembly``)."""
    if is_compile_wrapper(block) or getattr(block, "_compiled_call_impl", None) is not None:
        return block
    return torch.compile(unwrap_compiled(block)._call_impl)


@contextlib.contextmanager
def _compiling(n_modes: int) -> Iterator[None]:
    """Compile despite the profile's eager stance, with room in dynamo's recompile limit for one graph per mode."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # before torch 2.7
    limit = max(int(getattr(config, name)), n_modes + 8)
    with torch.compiler.set_stance("default"), config.patch(**{name: limit}):
        yield


def _time_once(
    root: nn.Module,
    cap: Captured,
    where: tuple[str, Any],
    bp: BlockPlan,
    device: torch.device,
    call: Callable[..., Any],
    memo: dict[tuple[Any, ...], Any] | None = None,
    *,
    forwards: list[float] | None = None,
) -> float:
    """One forward+backward of the block under ``bp`` through ``call`` (the block or its compiled region)."""
    hidden = in_slot(cap.args, cap.kwargs, where)
    reuse = reused_forwards(memo) if memo is not None else contextlib.nullcontext()
    with reuse:
        handle = apply_plan(root, Plan({cap.fqn: bp}) if bp.mode != "none" else Plan())
    try:
        synchronize(device)
        t0 = profile_clock()
        # A fresh non-leaf input, as the memory profile runs it (``memory.profile._run_block`` says why).
        seed = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=cap.input_grad)
        args, kwargs = with_hidden(cap.args, cap.kwargs, where, hidden.detach() + seed)
        with autocast_as(cap.autocast):
            out = call(*args, **kwargs)
            leaves = backward_leaves(out, cap.grad_leaves)
        if forwards is not None:
            synchronize(device)
            forwards.append(profile_clock() - t0)
        if leaves:
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
        synchronize(device)
        return profile_clock() - t0
    finally:
        handle.remove()
