"""Profile a model's memory on one batch (``profile_memory``), memory-safely: the data ``MemoryModel`` predicts from. It
never needs the no-checkpointing peak: a no-grad **capture** forward (``memory.capture``) keeps one input per group of
identical blocks; the **anchor** step (``memory.anchor``) runs every block fully checkpointed, its maximum recorded per
phase; then each representative runs **alone** under every mode, under the tracker, keeping what it holds after its
forward and its forward and backward peaks, relative to one starting level (constant offsets cancel)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ckpt.discovery import discover_blocks, unwrap_compiled
from lightning_ckpt.errors import ApplyError, LightningCkptError
from lightning_ckpt.measure.link import measure_link
from lightning_ckpt.measure.measurement import PassOutOfMemory, run_pass
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.tracker import local_tensor, new_live_tracker, normalise_device, tensor_bytes
from lightning_ckpt.memory.anchor import Calls, anchor_step, cuda_allocator_anchor, phase_rank
from lightning_ckpt.memory.block_times import CompiledBlockRuns, compiled_block_modes, profile_clock, time_block_modes
from lightning_ckpt.memory.capture import (
    Captured,
    autocast_as,
    backward_leaves,
    capture_calls,
    captured_tensors,
    hidden_tensor,
)
from lightning_ckpt.memory.compiled import CompiledBlockMemory, CompiledMemoryModel
from lightning_ckpt.memory.model import BlockMemory, MemoryModel, ModeProfile, PhasePeak
from lightning_ckpt.memory.optimizer_measure import optimizer_state_bytes
from lightning_ckpt.model import ModelView, is_sharded, model_device, model_fingerprint
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.chain import hidden_slot, in_slot, with_hidden
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.plan.handle import applied_plan
from lightning_ckpt.plan.policies import SAVE_LISTS
from lightning_ckpt.plan.skipping import skipping_stacks
from lightning_ckpt.stacks import LayerStack
from lightning_ckpt.timing.model import BlockTime, TimeModel

__all__ = ["Profile", "profile_memory", "profile_step"]


def _block_plan_of(key: str) -> BlockPlan:
    kind, _, rest = key.partition(":")
    if kind == "ops":
        return BlockPlan("ops", save_list=rest)
    return BlockPlan("selective", tuple(rest.split(","))) if kind == "selective" else BlockPlan(kind)


def _run_block(
    root: nn.Module, cap: Captured, bp: BlockPlan, externals: list[Any], device: torch.device
) -> tuple[ModeProfile, int]:
    """Run one block alone under ``bp``; returns its profile and its input's bytes."""
    where = hidden_slot(cap.args, cap.kwargs, strict=True)
    if where is None:
        raise LightningCkptError(
            f"Block {cap.fqn!r} takes no floating-point tensor input, so there is no hidden state to run it "
            "on alone. Name blocks whose first argument is the hidden state via block_types."
        )
    hidden = in_slot(cap.args, cap.kwargs, where)
    tracker = new_live_tracker(device, root)
    tracker.track_external(*externals, *captured_tensors(cap))
    plan = Plan({cap.fqn: bp}) if bp.mode != "none" else Plan()
    handle = apply_plan(root, plan)
    try:
        with tracker:
            # A fresh non-leaf input, as in the chain: a leaf would be kept alive by its AccumulateGrad
            # node, hiding whether the block itself saves its input. Where the step's input needed no
            # gradient (frozen layers before it) a plain copy: a frozen block then saves nothing.
            seed = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=cap.input_grad)
            base, base_act = tracker.now()
            x = hidden.detach() + seed
            in_bytes = tracker.now()[0] - base
            args, kwargs = with_hidden(cap.args, cap.kwargs, where, x)
            tracker.enter_phase("fwd")
            with autocast_as(cap.autocast):
                out = cap.module(*args, **kwargs)
                out_t = hidden_tensor(out)
                out_bytes = tensor_bytes([out_t]) if out_t is not None else 0
                backward_from = backward_leaves(out, cap.grad_leaves)
                in_context = tracker.now()[0]
            keep_with_input = tracker.enter_phase("after_fwd")[0] - base - out_bytes
            # Autocast caches low-precision weight copies until the step's autocast region ends.
            cache = max(0, in_context - base - out_bytes - keep_with_input)
            del args, kwargs, x
            keep = tracker.now()[0] - base - out_bytes
            if backward_from:
                grads = [torch.ones_like(t) for t in backward_from]
                tracker.enter_phase("bw")
                torch.autograd.backward(backward_from, grads)
                del grads
            bw_total, bw_act = tracker.phase_peaks.get("bw", tracker.phase_peaks["after_fwd"])
            del out, out_t, backward_from, seed
        fw_total = tracker.phase_peaks["fwd"][0]
    finally:
        handle.remove()
    profile = ModeProfile(keep, keep_with_input, fw_total - base, bw_total - base, bw_act - base_act, out_bytes, cache)
    return profile, in_bytes


def _selective_sets(
    stacks: Sequence[LayerStack], selective_sets: Mapping[str, Iterable[Iterable[str]]] | Iterable[Iterable[str]] | None
) -> dict[str, list[tuple[str, ...]]]:
    """Per block, every single child, each kind's children, attention+MLP, and the caller's ``selective_sets``."""
    sets: dict[str, list[tuple[str, ...]]] = {}
    for b in (b for s in stacks for b in s.blocks):
        kinds = [b.children_of_kind(k) for k in ("attention", "mlp", "norm", "other")]
        combos = [tuple(sorted(c)) for c in (*kinds, kinds[0] + kinds[1]) if len(c) > 1]
        sets[b.fqn] = list(dict.fromkeys([*((c.name,) for c in b.children), *combos]))
    if selective_sets is not None:
        extra = selective_sets if isinstance(selective_sets, Mapping) else dict.fromkeys(sets, selective_sets)
        for fqn, combos in extra.items():
            sets[fqn] = list(dict.fromkeys([*sets.get(fqn, []), *(tuple(sorted(c)) for c in combos)]))
    return sets


@dataclass(frozen=True)
class Profile:
    """What one profiling pass measured, side by side: the memory model and, where the blocks were timed, the time
    model, which the search refits to the plans it measures (``with_time``)."""

    memory: MemoryModel
    time: TimeModel | None = None
    compiled: CompiledMemoryModel | None = None  # blocks compiled alone (``compiled_blocks``): saved bytes per mode
    # The anchor step's seconds, tracked: what the search's memory pass of a chosen plan is priced from.
    tracked_step_seconds: float | None = None

    def with_time(self, time: TimeModel | None) -> Profile:
        return dataclasses.replace(self, time=time)


def profile_step(
    model: nn.Module | ModelView,
    forward_fn: Callable[[], Any],
    *,
    stacks: Sequence[LayerStack] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: tuple[Any, ...] = (),
    device: torch.device | str | None = None,
    selective_sets: Mapping[str, Iterable[Iterable[str]]] | Iterable[Iterable[str]] | None = None,
    share_identical_blocks: bool = True,
    time_blocks: bool | Collection[str] = True,
    compiled_blocks: bool = False,
) -> Profile:
    """Profile ``model`` on one batch: a ``Profile`` whose memory model predicts any plan's memory and whose time model
    (``time_blocks``) its step time. ``forward_fn()`` runs the forward and returns the loss (``loss_of``). Profile in
    the state you will measure in (batch, gradients, optimizer state); ``extra``: tensors made outside the step (the
    batch), resting memory. No plan may be applied; model state is left as it was. ``selective_sets``: child sets to
    profile exactly (default: every single child, each block's attention, MLP and both), per block FQN or one list for
    all; other sets add single-child effects. ``share_identical_blocks``: identical blocks share one profile.
    ``time_blocks``: time each representative under every mode (or the given mode keys; False: no time model).
    ``compiled_blocks``: time them *compiled alone*; ``Profile.compiled`` holds what each mode's graph saves."""
    view = model if isinstance(model, ModelView) else None  # resolved once by the caller: stacks, fingerprint
    root = view.root if view is not None else unwrap_compiled(model)
    current = applied_plan(root)
    if current is not None:
        raise ApplyError(
            f"profiling needs the model without checkpointing, but plan {current.describe()!r} "
            "is applied. Call handle.remove() first; the profile covers every plan, the applied one included."
        )
    if stacks is None:
        stacks = view.stacks if view is not None else discover_blocks(root)
    stacks = list(stacks)
    dev = normalise_device(torch.device(device) if device is not None else model_device(root))
    blocks = {id(root.get_submodule(b.fqn)): b.fqn for s in stacks for b in s.blocks}
    sets = _selective_sets(stacks, selective_sets)
    externals: list[Any] = [root, *extra] + ([optimizer] if optimizer is not None else [])
    runs = _run_profile(
        root, forward_fn, stacks, blocks, sets, externals, dev, share_identical_blocks, time_blocks, compiled_blocks
    )
    fingerprint = view.fingerprint if view is not None else model_fingerprint(root)
    memory = _memory_model(root, optimizer, stacks, blocks, dev, runs, fingerprint)
    time_model = _time_model(runs, memory, dev) if runs.timings else None
    if not (compiled_blocks and runs.timings):
        return Profile(memory, time_model, tracked_step_seconds=runs.anchor_seconds)
    # One row per block call, as the memory model's, not yet anchored on a compiled step.
    rows = tuple(CompiledBlockMemory(f, dict(runs.compiled[k].saved_bytes), r) for f, k, r in runs.rows())
    done = runs.compiled.values()
    seconds, compiles = sum(r.compile_seconds for r in done), sum(r.compiles for r in done)
    compiled = CompiledMemoryModel(rows, memory.stacks, memory, compile_seconds=seconds, compiles=compiles)
    return Profile(memory, time_model, compiled, runs.anchor_seconds)


def profile_memory(model: nn.Module | ModelView, forward_fn: Callable[[], Any], **options: Any) -> MemoryModel:
    """The memory model alone: ``profile_step`` (same ``options``) without timing the blocks."""
    return profile_step(model, forward_fn, **options, time_blocks=False).memory


@dataclass
class _Runs:
    """What the profile's passes read: the capture, the anchor step and each representative's runs alone."""

    order: list[str]  # block FQNs in call order (a shared block once per call)
    unchained: set[str]
    tracker: Any  # the anchor step's
    resting: int
    end_of_forward: tuple[int, int]
    calls: Calls
    call_rep: list[str]  # per call: its key in ``profiled``
    profiled: dict[str, Captured]
    alone: dict[str, BlockMemory] = dataclasses.field(default_factory=dict)  # per key: its runs alone, every mode
    # per representative key: median seconds per mode (memory.block_times)
    timings: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    compiled: dict[str, CompiledBlockRuns] = dataclasses.field(default_factory=dict)  # ``compiled_blocks``
    overhead: int = 0  # CUDA: allocator peak minus tracked peak of the anchor step
    reserve: int = 0  # CUDA: reserved above allocated on the anchor step
    anchor_seconds: float | None = None  # the anchor step's, tracked (``profile_clock``)

    def rows(self) -> list[tuple[str, str, str | None]]:
        """Per block call: its FQN, its key in ``profiled``, and the block whose profile it shares (None: itself)."""
        reps = [self.profiled[key].fqn for key in self.call_rep]
        return [(f, k, r if r != f else None) for f, k, r in zip(self.order, self.call_rep, reps, strict=True)]


def _run_profile(
    root: nn.Module,
    forward_fn: Callable[[], Any],
    stacks: Sequence[LayerStack],
    blocks: dict[int, str],
    sets: Mapping[str, list[tuple[str, ...]]],
    externals: list[Any],
    dev: torch.device,
    share: bool,
    timed: bool | Collection[str],
    compiled: bool = False,
) -> _Runs:
    """The capture, the anchor step (timed: ``Profile.tracked_step_seconds``; on CUDA with its allocator twin) and the
    per-block runs, each from the state the model was in and from a cold cache (``run_pass``): the capture's forward
    left blocks cached that the anchor step split, and on an H200 capped near the budget the anchor's logits then found
    no room."""
    snapshot = StateSnapshot.capture(root)
    try:
        stack_of = {b.fqn: s.fqn for s in stacks for b in s.blocks}
        capture = functools.partial(capture_calls, root, forward_fn, blocks, share, stack_of)
        order, reps, rep_of, unchained = _pass("capture (a forward without gradients)", dev, snapshot, capture)
        # FSDP2 all-gathers in each block's own hooks, which a segment's recompute does not run.
        unchained |= {s.fqn for s in stacks if any(is_sharded(root.get_submodule(b.fqn)) for b in s.blocks)}
        unchained |= set(skipping_stacks(root, stacks))  # LayerDrop skips blocks on steps the capture may not see
        anchor = functools.partial(anchor_step, root, forward_fn, order, externals, dev)
        what = "anchor step (every block fully checkpointed)"
        t0 = profile_clock()
        tracker, resting, end_of_forward, calls = _pass(what, dev, snapshot, anchor)
        runs = _Runs(order, unchained, tracker, resting, end_of_forward, calls, *_calls_to_profile(rep_of, reps, calls))
        runs.anchor_seconds = profile_clock() - t0
        if dev.type == "cuda":
            twin = functools.partial(cuda_allocator_anchor, root, forward_fn, order, dev)
            what = "allocator reading of the anchor step"
            allocator_peak, runs.resting, runs.reserve = _pass(what, dev, snapshot, twin)
            runs.overhead = allocator_peak - tracker.total_peak
        _profile_blocks(root, runs, sets, externals, dev, snapshot)
        if timed:
            _time_blocks(root, runs, dev, snapshot, timed, compiled)
    finally:
        snapshot.restore()
    return runs


def _time_blocks(
    root: nn.Module,
    runs: _Runs,
    dev: torch.device,
    snapshot: StateSnapshot,
    timed: bool | Collection[str],
    compiled: bool,
) -> None:
    """``memory.block_times`` on each representative alone under every mode its memory profile ran, or only ``timed``
    and ``none``, which the others are measured against."""
    wanted = None if isinstance(timed, bool) else {"none", *timed}
    for key, cap in runs.profiled.items():
        modes = {k: _block_plan_of(k) for k in runs.alone[key].profiles if wanted is None or k in wanted}
        if compiled:
            run = functools.partial(compiled_block_modes, root, cap, modes, device=dev)
        else:
            # Its block calls size its rounds, but a block FSDP2 sharded gathers from every rank at each call, so it
            # runs the fixed rounds: sized by each rank's clock, they differed by one and a rank hung in the all-gather.
            sharded = any(is_sharded(m) for m in cap.module.modules())
            calls = None if sharded else runs.call_rep.count(key)
            run = functools.partial(time_block_modes, root, cap, modes, device=dev, calls=calls)
        # One block's buffers, not a step's: no sync and emptied cache per block.
        result = _pass(f"timing of {cap.fqn} alone", dev, snapshot, run, cold=False)
        runs.timings[key] = result.seconds if compiled else result
        if compiled:
            runs.compiled[key] = result


def _pass(what: str, dev: torch.device, snapshot: StateSnapshot, run: Callable[[], Any], **options: Any) -> Any:
    """``run_pass`` (with its ``options``) of one of the profile's passes, the model put back as captured after it."""
    try:
        return run_pass(f"the memory profile's {what}", dev, run, snapshot.restore, **options)
    finally:
        snapshot.restore()


def _calls_to_profile(
    rep_of: list[str], reps: Mapping[str, Captured], calls: Calls
) -> tuple[list[str], dict[str, Captured]]:
    """Per call, the key of the run that profiles it; and per key, the captured call to run. One profile per
    representative and way of being called: a frozen block behind frozen embeddings saves nothing, its trainable
    twin later in the stack does; an MoE block's router loss adds a gradient."""
    call_rep, profiled = [], {}
    for i, rep in enumerate(rep_of):
        grad_leaves = tuple(sorted(calls.grad_leaves[i]))
        key = rep + ("" if calls.input_grad[i] else " (input without gradient)")
        key += "" if grad_leaves == (0,) else f" (gradient into outputs {list(grad_leaves)})"
        if key not in profiled:
            profiled[key] = dataclasses.replace(reps[rep], input_grad=calls.input_grad[i], grad_leaves=grad_leaves)
        call_rep.append(key)
    return call_rep, profiled


def _memory_model(
    root: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stacks: Sequence[LayerStack],
    blocks: dict[int, str],
    dev: torch.device,
    runs: _Runs,
    fingerprint: str,
) -> MemoryModel:
    rows = [dataclasses.replace(runs.alone[key], fqn=fqn, shared_with=shared) for fqn, key, shared in runs.rows()]
    order, tracker = runs.order, runs.tracker
    labels = sorted(tracker.phase_peaks, key=lambda label: phase_rank(label, len(order)))
    phases = [PhasePeak(lb[0], lb[1] if len(lb) > 1 else None, *tracker.phase_peaks[lb]) for lb in labels]
    # Blocks' saved bytes include their inputs, so what is left at the end of the forward is the
    # embeddings', head's and loss's (the last block's output included).
    other = max(0, runs.end_of_forward[1] - sum(r.saved_bytes["full"] for r in rows))
    params = {id(p): p for p in root.parameters()}.values()
    param_b, buf_b = tensor_bytes(params), tensor_bytes(root.buffers())
    grad_b = sum(local_tensor(p).numel() * p.element_size() for p in params if p.requires_grad)
    opt_b = optimizer_state_bytes(optimizer) if optimizer is not None else 0
    flowing = {fqn for fqn, flows in zip(order, runs.calls.output_grad, strict=True) if flows}
    # All of each stack's blocks, run or not: apply_plan cuts segments over all of them.
    stack_map = {s.fqn: s.block_fqns for s in stacks}
    return MemoryModel(
        fixed_bytes=param_b + grad_b + opt_b + buf_b,
        other_activation_bytes=other,
        blocks=tuple(rows),
        stacks=stack_map,
        phases=tuple(phases),
        resting_bytes=runs.resting,
        parameter_bytes=param_b,
        gradient_bytes=grad_b,
        optimizer_state_bytes=opt_b,
        buffer_bytes=buf_b,
        device=str(dev),
        device_overhead_bytes=runs.overhead,
        anchor_peak_bytes=tracker.total_peak,
        anchor_activation_bytes=tracker.activation_peak,
        fingerprint=fingerprint,
        idle_blocks=tuple(f for f in blocks.values() if f not in order),
        inert_blocks=tuple(f for f in dict.fromkeys(order) if f not in flowing),
        unchained_stacks=tuple(sorted(runs.unchained)),
        reserve_overhead_bytes=max(0, runs.reserve),
    )


def _time_model(runs: _Runs, memory: MemoryModel, dev: torch.device) -> TimeModel:
    """One row per block call, as the memory model's, with the bytes each offloading mode moves."""
    rows = []
    for (fqn, key, shared), mem in zip(runs.rows(), memory.blocks, strict=True):
        moved = {k: n for k in ("offload", "offload_input") if (n := mem.offloaded_bytes(k))}
        rows.append(BlockTime(fqn, dict(runs.timings.get(key, {})), shared, moved))
    autocast = [[d, str(t).removeprefix("torch."), c] for d, t, c in next(iter(runs.profiled.values())).autocast]
    measured_at = {
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__.split("+")[0],
        "autocast": autocast,
    }
    link = measure_link(dev, nbytes=64 * 2**20) if any(r.offloaded_bytes for r in rows) else None
    if link is not None:
        measured_at["link"] = {"to_host": link.to_host, "to_device": link.to_device}
    return TimeModel(blocks=tuple(rows), stacks=memory.stacks, measured_at=measured_at)


def _profile_blocks(
    root: nn.Module,
    runs: _Runs,
    sets: Mapping[str, list[tuple[str, ...]]],
    externals: list[Any],
    dev: torch.device,
    snapshot: StateSnapshot,
) -> None:
    """Each representative alone under every mode: its profiles, the modes it failed under, its input's bytes."""
    for rep, cap in runs.profiled.items():
        keys = ["none", "full", "offload", "offload_input", *(f"ops:{name}" for name in SAVE_LISTS)]
        keys += ["selective:" + ",".join(c) for c in sets.get(cap.fqn, [])]
        profiles: dict[str, ModeProfile] = {}
        failed: dict[str, str] = {}
        for key in keys:
            try:
                profiles[key], in_bytes = _pass(
                    f"run of {cap.fqn} alone under {key}",
                    dev,
                    snapshot,
                    lambda cap=cap, key=key: _run_block(root, cap, _block_plan_of(key), externals, dev),
                    cold=False,
                )
            except (torch.OutOfMemoryError, PassOutOfMemory):
                raise
            except Exception as err:
                # Predicting a plan that uses this mode raises PlanError with this reason.
                if key in ("none", "full"):
                    raise
                failed[key] = f"{type(err).__name__}: {err}"
        full = profiles["full"]
        transient = max(0, full.backward_peak_activation_bytes - full.keep_bytes - 2 * full.output_bytes)
        saved = {k: p.keep_bytes for k, p in profiles.items()}
        runs.alone[rep] = BlockMemory(cap.fqn, saved, transient, in_bytes, profiles=profiles, failed=failed)
