"""Predict a plan's peak and activation memory without running it, from one memory-safe profile.

How the profile is built (``profile_memory``), and why it never needs the no-checkpointing peak:

1. **Capture** (``torch.no_grad`` forward): forward pre-hooks record each block's call order and
   keep the inputs of one representative per group of identical blocks (same class, parameter
   shapes and input shapes). A no-grad forward holds one block's internals at a time.
2. **Anchor** (one forward+backward with *every* block fully checkpointed, the cheapest plan):
   a live-tensor tracker records the maximum of live bytes in each *phase* of the step (before
   the stack, each block's forward, the head's forward, the head's backward, each block's backward,
   after the stack), delimited by module hooks and gradient hooks on the blocks' hidden states.
   This captures exactly what per-block arithmetic gets wrong: gradients accumulating during
   backward, the logits and loss temporaries, the embedding backward.
3. **Per-block profiles**: each representative block runs alone (forward+backward, its captured
   inputs) under every mode (``none``, ``full``, ``offload``, each op save-list, selective children)
   via ``apply_plan`` on that one FQN, under the tracker. Per mode we keep what the block holds after
   its forward (its saved activations), its forward peak and its backward peak, relative to the same
   starting level. Constant offsets (the input, the incoming gradient) cancel in the differences.

A plan's prediction is, for every phase of the anchor, that phase's measured maximum plus the
difference the plan makes there (``mode - full``) for the blocks alive in it: the saved bytes of
blocks whose forward is done and whose backward is not, and the block's own forward or backward
peak in its own phases. The predicted peak is the maximum over phases. Segments are modelled as
torch runs them: a chunk stores its first block's input; in backward the whole chunk is recomputed
at once, so while its blocks run backward the earlier blocks of the chunk hold their ``none``-mode
activations.

All byte counts follow ``lightning_ckpt.measure.measurement``'s definitions, so ``predict_peak`` is comparable to
``Measurement.peak_bytes`` and ``predict_activation`` to ``Measurement.activation_bytes``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_ckpt.discovery import LayerStack, discover_blocks, unwrap_compiled
from lightning_ckpt.errors import ApplyError, LightningCkptError, PlanError, StalePlanError
from lightning_ckpt.measure.harness import loss_of
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.tracker import (
    is_fsdp_module,
    local_tensor,
    model_device,
    new_live_tracker,
    normalise_device,
    tensor_bytes,
)
from lightning_ckpt.plan.apply import apply_plan
from lightning_ckpt.plan.caches import CACHE_ARGS, forward_params
from lightning_ckpt.plan.chain import _rng_equal, _rng_states, _tensor_devices, segment_chunks
from lightning_ckpt.plan.format import BlockPlan, Plan, closest_names, model_fingerprint
from lightning_ckpt.plan.handle import applied_plan
from lightning_ckpt.plan.policies import SAVE_LISTS
from lightning_ckpt.plan.skipping import skipping_stacks

__all__ = ["BlockMemory", "MemoryModel", "ModeProfile", "PhasePeak", "Prediction", "mode_key", "profile_memory"]

_MB = 1024 * 1024


def mode_key(block_plan: BlockPlan) -> str:
    """The key of ``BlockMemory.saved_bytes`` for a block plan: ``none``, ``full``, ``offload``,
    ``ops:<save_list>`` or ``selective:<child>[,<child>...]`` (children sorted)."""
    if block_plan.mode == "ops":
        return f"ops:{block_plan.save_list}"
    if block_plan.mode == "selective":
        return "selective:" + ",".join(sorted(block_plan.children))
    return block_plan.mode


def _block_plan_of(key: str) -> BlockPlan:
    kind, _, rest = key.partition(":")
    if kind == "ops":
        return BlockPlan("ops", save_list=rest)
    if kind == "selective":
        return BlockPlan("selective", tuple(rest.split(",")))
    return BlockPlan(kind)


@dataclass(frozen=True)
class ModeProfile:
    """One block run alone under one mode. Bytes are relative to the level before its input existed,
    so they include constant offsets (input, output, incoming gradient) that cancel between modes.

    keep_bytes: held after the forward, the block's own output excluded: its saved activations
    (its input included when the block saves it). keep_with_input_bytes: the same while the caller
    still holds the input (the moment right after the block returns).
    forward_peak_bytes: peak during its forward. backward_peak_bytes / backward_peak_activation_bytes:
    peak during its backward, everything / without parameter gradients.
    autocast_cache_bytes: weight copies autocast cached during the forward that this mode does not
    save: they live on until the step's autocast region ends (the end of the forward), not longer.
    """

    keep_bytes: int
    keep_with_input_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    backward_peak_activation_bytes: int
    output_bytes: int
    autocast_cache_bytes: int = 0


@dataclass(frozen=True)
class BlockMemory:
    """Per-block table row: what this block keeps for backward under each mode.

    saved_bytes: mode key (see ``mode_key``) -> activation bytes the block keeps from its forward to
    its backward (its input included when saved, its output excluded). ``offload`` counts device
    bytes only (on CPU offloading is a no-op, so it equals ``none``).
    recompute_transient_bytes: extra memory while the block is recomputed and run backward under
    ``full`` (its recomputed internals plus backward temporaries, gradients excluded).
    shared_with: FQN of the identical block whose profile this row reuses (None: measured itself).
    """

    fqn: str
    saved_bytes: Mapping[str, int]
    recompute_transient_bytes: int
    input_bytes: int = 0
    shared_with: str | None = None
    profiles: Mapping[str, ModeProfile] = field(default_factory=dict, repr=False)
    failed: Mapping[str, str] = field(default_factory=dict, repr=False)  # mode key -> why it could not run


@dataclass(frozen=True)
class PhasePeak:
    """The anchor (all blocks ``full``) step's maximum of live bytes in one phase.

    kind: ``pre`` (before the first block) | ``fwd`` (block ``block``'s forward) | ``fwd_gap`` (after
    block ``block``'s forward, up to the next block; for the last block: the head and loss) |
    ``bw_head`` (backward before the last block) | ``bw`` (block ``block``'s backward) | ``bw_gap``
    (after block ``block``'s backward, up to the previous block's; for block 0: the embeddings).
    """

    kind: str
    block: int | None
    peak_bytes: int
    peak_activation_bytes: int


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted memory and where in the step its peak falls."""

    peak_bytes: int
    activation_bytes: int
    peak_phase: str  # e.g. "bw transformer.h.11", "bw_head"


@dataclass(frozen=True)
class MemoryModel:
    """Predicted memory of any plan for one model, batch and training state (see the module docstring).

    fixed_bytes: parameters + gradients (one per trainable parameter) + optimizer state + buffers.
    other_activation_bytes: activations held outside the blocks at the end of the forward
    (embeddings, head, loss), measured with every block fully checkpointed.
    blocks: one row per block call, in execution order. stacks: stack FQN -> its block FQNs in order.
    resting_bytes: live bytes before the step, as ``measure_step`` reports them (CUDA: allocated bytes).
    phases: the anchor step's timeline that predictions are built on (see ``PhasePeak``).
    device_overhead_bytes: CUDA only: allocator peak minus tracked peak of the anchor step (memory
    no tensor tracker sees: cuBLAS workspaces, other tensors in the process, block rounding), added to
    every peak prediction. reserve_overhead_bytes: CUDA only: the allocator's reserved peak above its
    allocated peak on the anchor step, the headroom a cap on reserved memory needs (see measure.py).
    fingerprint: ``model_fingerprint`` of the profiled model; a plan made for another model is refused.
    idle_blocks: discovered blocks the profiled forward never ran; plans may name them, to no effect.
    unchained_stacks: stacks whose blocks do not hand each other their outputs (T5's shared position
    bias, a block shared across depth), so segments cannot run on them; ``can_run`` refuses such plans
    before any step is spent.
    inert_blocks: blocks no gradient flows through (frozen, behind frozen embeddings or frozen blocks):
    they save nothing for backward, so no mode can save anything there and none is offered
    (``plannable_stacks``). Plans may still name them; their cost is predicted like any other's.

    A block called several times in one step (ALBERT's shared layer) has one row per call in ``blocks``:
    a plan's mode for its FQN applies to every call, and each call's memory is counted.
    """

    fixed_bytes: int
    other_activation_bytes: int
    blocks: tuple[BlockMemory, ...]
    stacks: Mapping[str, tuple[str, ...]]
    phases: tuple[PhasePeak, ...]
    resting_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    device: str
    device_overhead_bytes: int = 0
    anchor_peak_bytes: int = 0
    anchor_activation_bytes: int = 0
    fingerprint: str | None = None
    idle_blocks: tuple[str, ...] = ()
    unchained_stacks: tuple[str, ...] = ()
    reserve_overhead_bytes: int = 0
    inert_blocks: tuple[str, ...] = ()

    # -- prediction ---------------------------------------------------------------------------------
    def predict_peak(self, plan: Plan) -> int:
        """Predicted ``Measurement.peak_bytes`` of a forward+backward step under ``plan``."""
        return self.predict(plan).peak_bytes

    def predict_activation(self, plan: Plan) -> int:
        """Predicted ``Measurement.activation_bytes`` of a forward+backward step under ``plan``."""
        return self.predict(plan).activation_bytes

    def predict(self, plan: Plan) -> Prediction:
        """Peak, activation bytes and the phase where the peak falls, for ``plan``."""
        st = self._resolve(plan)
        n = len(self.blocks)
        best_total, best_phase, best_act = -1, "", -1
        keep_prefix = list(itertools.accumulate(st.keep_delta, initial=0))
        # While the forward runs, autocast's weight cache holds what a block does not save: the anchor
        # measured it, so the forward phases add only each block's difference in (saved + cached) bytes.
        fwd_prefix = list(itertools.accumulate(st.keep_fwd_delta, initial=0))
        chunk_adjust = st.chunk_adjust
        for ph in self.phases:
            i = ph.block
            if ph.kind == "pre":
                d_total = d_act = 0
            elif ph.kind == "fwd":
                d_total = d_act = fwd_prefix[i] + st.fw_delta[i]
            elif ph.kind == "fwd_gap":
                d_total = d_act = fwd_prefix[i + 1] + st.gap_delta[i]
            elif ph.kind == "bw_head":
                d_total = d_act = keep_prefix[n]
            else:  # bw / bw_gap: earlier blocks still hold their activations
                held = keep_prefix[i] + chunk_adjust[i]
                own = (st.bw_delta[i], st.bw_act_delta[i]) if ph.kind == "bw" else (0, 0)
                d_total, d_act = held + own[0], held + own[1]
            total = ph.peak_bytes + d_total
            if total > best_total:
                label = ph.kind if i is None else f"{ph.kind} {self.blocks[i].fqn}"
                best_total, best_phase = total, label
            best_act = max(best_act, ph.peak_activation_bytes + d_act)
        peak = best_total + self.device_overhead_bytes
        return Prediction(peak, max(0, best_act), best_phase)

    def can_run(self, plan: Plan) -> str | None:
        """Why ``plan`` cannot run on the profiled model (a mode a block failed under, segments over a stack
        that is not a chain, an unknown FQN), or None when it can."""
        try:
            self._resolve(plan)
        except PlanError as err:
            return str(err)
        return None

    def saved_bytes(self, plan: Plan) -> dict[str, int]:
        """Block FQN -> bytes it keeps from forward to backward under ``plan`` ("which layers hold the memory")."""
        st = self._resolve(plan)
        out: dict[str, int] = {}
        for i, b in enumerate(self.blocks):  # a block shared across depth: all its calls
            out[b.fqn] = out.get(b.fqn, 0) + b.saved_bytes["full"] + st.keep_delta[i]
        return out

    def plannable_stacks(self, stacks: Sequence[LayerStack]) -> list[LayerStack]:
        """``stacks`` without the blocks no mode can save anything on (``inert_blocks``), renumbered; stacks
        left empty are dropped. The search plans over these: checkpointing a frozen block recomputes it for
        nothing."""
        out = []
        for s in stacks:
            kept = [b for b in s.blocks if b.fqn not in self.inert_blocks]
            if kept:
                renumbered = tuple(dataclasses.replace(b, index=i) for i, b in enumerate(kept))
                out.append(dataclasses.replace(s, blocks=renumbered))
        return out

    # -- presentation -------------------------------------------------------------------------------
    def table(self, plan: Plan | None = None) -> str:
        """A printable per-block breakdown in MiB: saved activations under each mode (and under ``plan``).

        Columns are mode keys (``sel:`` = selective of one child); ``recompute`` is the transient of a
        fully checkpointed block's backward. With ``plan``, a last column and the predicted peak.
        """
        keys = self._mode_keys()
        saved_under = self.saved_bytes(plan) if plan is not None else None
        header = ["block", *(k.replace("selective:", "sel:") for k in keys), "recompute"]
        header += ["plan"] if saved_under is not None else []
        rows = []
        calls = collections.Counter(b.fqn for b in self.blocks)
        call_no: dict[str, int] = {}
        for b in self.blocks:
            call_no[b.fqn] = call_no.get(b.fqn, 0) + 1
            name = b.fqn + (f" (call {call_no[b.fqn]})" if calls[b.fqn] > 1 else "") + (" *" if b.shared_with else "")
            cells = [_mib(b.saved_bytes[k]) if k in b.saved_bytes else "-" for k in keys]
            row = [name, *cells, _mib(b.recompute_transient_bytes)]
            if saved_under is not None:  # a shared block's calls together, on its first row
                row.append(_mib(saved_under[b.fqn]) if call_no[b.fqn] == 1 else "")
            rows.append(row)
        widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
        fmt = "  ".join(f"{{:<{widths[0]}}}" if c == 0 else f"{{:>{widths[c]}}}" for c in range(len(header)))
        lines = [
            f"Memory profile on {self.device} (MiB; saved activations kept from forward to backward per block)",
            f"fixed {_mib(self.fixed_bytes)} = parameters {_mib(self.parameter_bytes)} + gradients "
            f"{_mib(self.gradient_bytes)} + optimizer state {_mib(self.optimizer_state_bytes)} + buffers "
            f"{_mib(self.buffer_bytes)}; activations outside the blocks {_mib(self.other_activation_bytes)}",
            fmt.format(*header),
            *(fmt.format(*r) for r in rows),
        ]
        if any(b.shared_with for b in self.blocks):
            lines.append("* profile shared with an identical block")
        if plan is not None:
            p = self.predict(plan)
            lines.append(
                f"plan {plan.describe()}: predicted peak {_mib(p.peak_bytes)}, activations "
                f"{_mib(p.activation_bytes)}, peak in phase '{p.peak_phase}'"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (``from_dict`` reads it back)."""
        return {
            "fixed_bytes": self.fixed_bytes,
            "other_activation_bytes": self.other_activation_bytes,
            "resting_bytes": self.resting_bytes,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "device": self.device,
            "device_overhead_bytes": self.device_overhead_bytes,
            "anchor_peak_bytes": self.anchor_peak_bytes,
            "anchor_activation_bytes": self.anchor_activation_bytes,
            "fingerprint": self.fingerprint,
            "idle_blocks": list(self.idle_blocks),
            "unchained_stacks": list(self.unchained_stacks),
            "reserve_overhead_bytes": self.reserve_overhead_bytes,
            "inert_blocks": list(self.inert_blocks),
            "stacks": {k: list(v) for k, v in self.stacks.items()},
            "phases": [[p.kind, p.block, p.peak_bytes, p.peak_activation_bytes] for p in self.phases],
            "blocks": [
                {
                    "fqn": b.fqn,
                    "saved_bytes": dict(b.saved_bytes),
                    "recompute_transient_bytes": b.recompute_transient_bytes,
                    "input_bytes": b.input_bytes,
                    "shared_with": b.shared_with,
                    "profiles": {k: list(_profile_tuple(p)) for k, p in b.profiles.items()},
                    "failed": dict(b.failed),
                }
                for b in self.blocks
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryModel:
        blocks = tuple(
            BlockMemory(
                fqn=b["fqn"],
                saved_bytes=dict(b["saved_bytes"]),
                recompute_transient_bytes=b["recompute_transient_bytes"],
                input_bytes=b.get("input_bytes", 0),
                shared_with=b.get("shared_with"),
                profiles={k: ModeProfile(*v) for k, v in b.get("profiles", {}).items()},
                failed=dict(b.get("failed", {})),
            )
            for b in data["blocks"]
        )
        return cls(
            fixed_bytes=data["fixed_bytes"],
            other_activation_bytes=data["other_activation_bytes"],
            blocks=blocks,
            stacks={k: tuple(v) for k, v in data["stacks"].items()},
            phases=tuple(PhasePeak(*p) for p in data["phases"]),
            resting_bytes=data["resting_bytes"],
            parameter_bytes=data["parameter_bytes"],
            gradient_bytes=data["gradient_bytes"],
            optimizer_state_bytes=data["optimizer_state_bytes"],
            buffer_bytes=data["buffer_bytes"],
            device=data["device"],
            device_overhead_bytes=data.get("device_overhead_bytes", 0),
            anchor_peak_bytes=data.get("anchor_peak_bytes", 0),
            anchor_activation_bytes=data.get("anchor_activation_bytes", 0),
            fingerprint=data.get("fingerprint"),
            idle_blocks=tuple(data.get("idle_blocks", ())),
            unchained_stacks=tuple(data.get("unchained_stacks", ())),
            reserve_overhead_bytes=data.get("reserve_overhead_bytes", 0),
            inert_blocks=tuple(data.get("inert_blocks", ())),
        )

    # -- internals ------------------------------------------------------------------------------------
    def _mode_keys(self) -> list[str]:
        # Child combinations stay in the data (``saved_bytes``) but would make the table unreadably wide.
        keys: list[str] = []
        for b in self.blocks:
            keys += [k for k in b.saved_bytes if k not in keys and "," not in k]
        return keys

    def _resolve(self, plan: Plan) -> _PlanState:
        if plan.fingerprint is not None and self.fingerprint is not None and plan.fingerprint != self.fingerprint:
            raise StalePlanError(
                f"Plan {plan.name or plan.digest()!r} was made for a model with fingerprint {plan.fingerprint}, but "
                f"this memory model profiled a model with fingerprint {self.fingerprint}. Profile the model the "
                "plan is for, or re-tune the plan for this model."
            )
        rows_of: dict[str, list[int]] = {}  # a block shared across depth has a row per call
        for i, b in enumerate(self.blocks):
            rows_of.setdefault(b.fqn, []).append(i)
        index = {fqn: rows[0] for fqn, rows in rows_of.items()}
        n = len(self.blocks)
        keys = ["none"] * n
        chunk_of: list[int | None] = [None] * n
        chunk_pos: list[tuple[int, int]] = [(0, 0)] * n  # (position in chunk, chunk length)
        for fqn, bp in plan.blocks.items():
            if fqn in self.idle_blocks:
                continue
            if fqn not in index:
                raise PlanError(
                    f"The memory model has no profile for block {fqn!r}. Closest profiled blocks: "
                    f"{closest_names(fqn, list(index))}. Fix the FQN in the plan, or profile the stack that holds it."
                )
            for i in rows_of[fqn]:
                keys[i] = mode_key(bp)
        chunk_id = 0
        for stack_fqn, n_chunks in plan.segments.items():
            if stack_fqn not in self.stacks:
                raise PlanError(
                    f"The memory model has no profiled stack {stack_fqn!r}; profiled stacks: "
                    f"{', '.join(repr(s) for s in self.stacks) or '(none)'}. Fix 'segments' in the plan."
                )
            fqns = self.stacks[stack_fqn]
            if stack_fqn in self.unchained_stacks:
                raise PlanError(
                    f"segments[{stack_fqn!r}]: one checkpoint cannot span several blocks of this stack: they do not "
                    "run as a chain (a block receives something other than the previous block's output and the same "
                    "other arguments, e.g. T5's position bias; or the parent skips blocks or draws random numbers "
                    "between them, e.g. LayerDrop), or each is sharded by FSDP2 (whose all-gathers run in each "
                    "block's own hooks). Use per-block modes there."
                )
            if n_chunks > len(fqns):
                raise PlanError(
                    f"segments[{stack_fqn!r}] = {n_chunks} but that stack has only {len(fqns)} blocks. "
                    f"Use a chunk count between 1 and {len(fqns)}."
                )
            overlapping = [f for f in fqns if f in plan.blocks]
            if overlapping:
                raise PlanError(
                    f"Stack {stack_fqn!r} has segments and also per-block modes for {overlapping[:3]}; a plan gives "
                    "a stack either segments or per-block modes. Remove one of them."
                )
            for start, end in segment_chunks(len(fqns), n_chunks)[:-1]:
                members = [index[f] for f in fqns[start:end] if f in index]
                for pos, i in enumerate(members):
                    chunk_of[i] = chunk_id
                    chunk_pos[i] = (pos, len(members))
                chunk_id += 1
        st = _PlanState(n, chunk_of)
        for i, b in enumerate(self.blocks):
            full = b.profiles.get("full")
            if full is None:  # a block that could not be profiled contributes nothing either way
                continue
            none = self._profile(b, "none")
            st.recompute_delta[i] = none.keep_bytes - full.keep_bytes
            # Right after a block returns, its caller still holds the block's input, saved or not.
            input_held_full = full.keep_with_input_bytes - full.keep_bytes
            if chunk_of[i] is not None:
                pos, length = chunk_pos[i]
                out = full.output_bytes
                if pos == 0:
                    # The head runs the whole chunk inside one checkpoint (which stores only the head's
                    # input) and keeps every block's output until the parent has consumed it.
                    fw = max(
                        self._profile(self.blocks[i + j], "full").forward_peak_bytes + j * out for j in range(length)
                    )
                    st.fw_delta[i] = fw - full.forward_peak_bytes
                    st.gap_delta[i] = (length - 1) * out
                else:
                    # A member only hands over its pending output: nothing is computed or stored.
                    st.keep_delta[i] = st.keep_fwd_delta[i] = -full.keep_bytes
                    st.fw_delta[i] = b.input_bytes + (length - pos) * out - full.forward_peak_bytes
                    st.gap_delta[i] = b.input_bytes + (length - 1 - pos) * out - input_held_full
                st.bw_delta[i] = none.backward_peak_bytes - full.backward_peak_bytes
                st.bw_act_delta[i] = none.backward_peak_activation_bytes - full.backward_peak_activation_bytes
                continue
            prof = self._profile(b, keys[i])
            st.keep_delta[i] = prof.keep_bytes - full.keep_bytes
            st.keep_fwd_delta[i] = st.keep_delta[i] + prof.autocast_cache_bytes - full.autocast_cache_bytes
            st.fw_delta[i] = prof.forward_peak_bytes - full.forward_peak_bytes
            st.gap_delta[i] = (prof.keep_with_input_bytes - prof.keep_bytes) - input_held_full
            st.bw_delta[i] = prof.backward_peak_bytes - full.backward_peak_bytes
            st.bw_act_delta[i] = prof.backward_peak_activation_bytes - full.backward_peak_activation_bytes
        return st

    def _profile(self, block: BlockMemory, key: str) -> ModeProfile:
        prof = block.profiles.get(key)
        if prof is not None:
            return prof
        if key in block.failed:
            raise PlanError(f"Block {block.fqn!r} cannot run under {key!r}: {block.failed[key]}")
        if key.startswith("selective:") and "," in key:
            return self._combined_selective(block, key)
        known = ", ".join(sorted(block.profiles))
        raise PlanError(
            f"The memory model has no profile of block {block.fqn!r} under {key!r}. Profiled modes: {known}. "
            "Use one of these, or pass the child set to profile_memory(selective_sets=...)."
        )

    def _combined_selective(self, block: BlockMemory, key: str) -> ModeProfile:
        # Children checkpointed together save what each saves alone: their differences from ``none``
        # add up. Peaks are approximated the same way (exact combinations: profile_memory(selective_sets=)).
        none = self._profile(block, "none")
        parts = [self._profile(block, f"selective:{c}") for c in key.partition(":")[2].split(",")]
        fields = (
            "keep_bytes",
            "keep_with_input_bytes",
            "forward_peak_bytes",
            "backward_peak_bytes",
            "backward_peak_activation_bytes",
            "autocast_cache_bytes",
        )
        values = {f: getattr(none, f) + sum(getattr(p, f) - getattr(none, f) for p in parts) for f in fields}
        return ModeProfile(**values, output_bytes=none.output_bytes)


class _PlanState:
    """Per-block differences from the anchor (all ``full``) that one plan makes, in execution order."""

    def __init__(self, n: int, chunk_of: list[int | None]) -> None:
        self.keep_delta = [0] * n  # saved bytes held from forward to backward, vs full
        self.keep_fwd_delta = [0] * n  # the same while the forward's autocast cache is alive
        self.fw_delta = [0] * n  # own forward peak, vs full
        self.gap_delta = [0] * n  # right after its forward: input still held, segment outputs pending
        self.bw_delta = [0] * n  # own backward peak, vs full
        self.bw_act_delta = [0] * n
        self.recompute_delta = [0] * n  # held once its chunk was recomputed (none-mode), vs full
        self.chunk_of = chunk_of

    @property
    def chunk_adjust(self) -> list[int]:
        """Per block: how much more the earlier blocks of its own chunk hold during its backward
        (recomputed, ``none``-mode) than during the forward (nothing)."""
        adjust, running, prev = [0] * len(self.chunk_of), 0, None
        for i, c in enumerate(self.chunk_of):
            running = running if c is not None and c == prev else 0
            adjust[i] = running
            if c is not None:
                running += self.recompute_delta[i] - self.keep_delta[i]
            prev = c
        return adjust


def _mib(n: int) -> str:
    return f"{n / _MB:.2f}"


def _profile_tuple(p: ModeProfile) -> tuple[int, ...]:
    return dataclasses.astuple(p)


# ---------------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------------
def _hidden_index(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, Any] | None:
    """Where the block's hidden state is: ('arg', i) or ('kw', name): the first floating tensor."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    for name in ("hidden_states", "x", "input", "inputs", "hidden"):
        v = kwargs.get(name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", name)
    for name, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return ("kw", name)
    return None


def _spec(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(("T", tuple(leaf.shape), str(leaf.dtype), str(leaf.device)))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            out.append(leaf)
        else:
            out.append(type(leaf).__qualname__)
    return (str(spec), tuple(out))


def _group_key(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers())
    return (type(module), params, buffers, _spec(args), _spec(dict(sorted(kwargs.items()))))


def _without_kv_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The block's arguments with any KV cache replaced by None.

    Running a block again with the captured cache would append to it a second time (attention over
    twice the sequence). A training step's backward never reads the cache, and ``apply_plan`` drops it
    under checkpointing for the same reason, so the profile runs every mode without it.
    """
    names = forward_params(type(module))
    args = tuple(None if i < len(names) and names[i] in CACHE_ARGS else a for i, a in enumerate(args))
    kwargs = {k: (None if k in CACHE_ARGS else v) for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


@dataclass
class _Captured:
    fqn: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: tuple[tuple[str, torch.dtype, bool], ...] = ()
    # How the step called it (read in the anchor, which checkpointing does not change): whether its hidden
    # input needed a gradient (not behind frozen embeddings or frozen blocks) and which of its output leaves
    # (``tree_flatten`` positions) received one (the hidden state, an auxiliary loss). None: not known.
    input_grad: bool = True
    grad_leaves: tuple[int, ...] | None = None


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """The autocast regions active right now, as (device type, dtype, cache enabled) triples.

    A block replayed alone must run in the context the step ran it in: under bf16/fp16 autocast
    it saves half-precision activations (and a GPU may dispatch another attention kernel), so a
    profile taken without it over-predicts every mode but ``full`` by a quarter or more.
    """
    state = []
    for dev in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(dev):
            # The weight-cast cache changes what a step holds: with it, fp32 weights' low-precision copies live
            # for the whole forward (Lightning's mixed precision turns it off).
            state.append((dev, torch.get_autocast_dtype(dev), torch.is_autocast_cache_enabled()))
    return tuple(state)


@contextlib.contextmanager
def _autocast_as(state: tuple[tuple[str, torch.dtype, bool], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for dev, dtype, cache in state:
            stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=cache))
        yield


class _ChainCheck:
    """Whether each stack's blocks run as a chain, which segments (one checkpoint over several blocks) need.

    A chain hands each block the previous block's output as its hidden state and the same other
    arguments (a mask, rotary tables). T5 is not one: block 0 computes a position bias that it
    returns and the parent passes to every later block, so a segment's recompute would lose it.
    Tensors are compared by identity (weak references: the check keeps nothing alive).
    A chain also runs its blocks in order, from the first, none skipped, and the parent draws no random
    numbers between them: LayerDrop (BART, Whisper, wav2vec2) draws a coin before every block and skips
    some, so a chunk run at once would hand blocks the wrong outputs and random state (``apply._Chunk``).
    """

    def __init__(self, stack_of: Mapping[str, str]) -> None:
        self.stack_of = stack_of
        self.unchained: set[str] = set()
        self._last: dict[str, tuple[Any, Any]] = {}  # stack -> (weakref to output, other arguments)
        self._index = {fqn: i for stack in set(stack_of.values()) for i, fqn in enumerate(
            f for f, s in stack_of.items() if s == stack)}  # fmt: skip
        self._ran: dict[str, int] = {}  # stack -> index of the block that ran last
        self._rng: dict[str, tuple[Any, ...]] = {}  # stack -> RNG state (and its devices) when that block ended

    @staticmethod
    def _others(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: tuple[str, Any] | None) -> tuple[str, list]:
        rest_args = [a for i, a in enumerate(args) if where != ("arg", i)]
        rest_kwargs = {k: v for k, v in sorted(kwargs.items()) if where != ("kw", k)}
        leaves, spec = tree_flatten((rest_args, rest_kwargs))
        return str(spec), [weakref.ref(x) if isinstance(x, torch.Tensor) else x for x in leaves]

    def before(self, fqn: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        stack = self.stack_of.get(fqn)
        if stack is None or stack in self.unchained:
            return
        where = _hidden_index(args, kwargs)
        others = self._others(args, kwargs, where)
        last = self._last.get(stack)
        index, ran, rng = self._index[fqn], self._ran.get(stack), self._rng.get(stack)
        skipped = index != (0 if ran is None else ran + 1)  # a block skipped, repeated or run out of order
        drew = rng is not None and not _rng_equal(_rng_states(rng[0]), rng[1])  # random numbers drawn in between
        if skipped or drew:
            self.unchained.add(stack)
            return
        if last is not None:
            hidden = None if where is None else (args[where[1]] if where[0] == "arg" else kwargs[where[1]])
            out_ref, (prev_spec, prev_leaves) = last
            chained = (
                hidden is not None
                and out_ref is not None
                and out_ref() is hidden
                and prev_spec == others[0]
                and all(_same_leaf(a, b) for a, b in zip(prev_leaves, others[1], strict=True))
            )
            if not chained:
                self.unchained.add(stack)
        self._last[stack] = (None, others)

    def after(self, fqn: str, out: Any) -> None:
        stack = self.stack_of.get(fqn)
        if stack is None or stack not in self._last:
            return
        first = out if isinstance(out, torch.Tensor) else next(
            (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None
        )  # fmt: skip
        self._last[stack] = (weakref.ref(first) if first is not None else None, self._last[stack][1])
        self._ran[stack] = self._index[fqn]
        devices = _tensor_devices((out,), {})
        self._rng[stack] = (devices, _rng_states(devices))


def _same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, weakref.ref) or isinstance(b, weakref.ref):
        return isinstance(a, weakref.ref) and isinstance(b, weakref.ref) and a() is not None and a() is b()
    try:
        return bool(a is b or a == b)
    except Exception:  # objects whose == is not a plain truth value
        return False


def _capture(
    root: nn.Module, forward_fn: Callable[[], Any], blocks: dict[int, str], share: bool,
    stack_of: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, _Captured], list[str], set[str]]:  # fmt: skip
    """No-grad forward: block execution order (a block shared across depth, like ALBERT's one layer, once
    per call), one captured input per group, each call's representative, and the stacks whose blocks do not
    run as a chain (see ``_ChainCheck``; a stack with a shared block is never one)."""
    order: list[str] = []
    reps: dict[Any, _Captured] = {}
    rep_of: list[str] = []
    chain = _ChainCheck(stack_of or {})

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fqn = blocks[id(module)]
        order.append(fqn)
        chain.before(fqn, args, kwargs)
        args, kwargs = _without_kv_cache(module, args, kwargs)
        key = _group_key(module, args, kwargs) if share else fqn
        if key not in reps:
            reps[key] = _Captured(fqn, module, tuple(args), dict(kwargs), _autocast_state())
        rep_of.append(reps[key].fqn)

    def post_hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        chain.after(blocks[id(module)], out)

    modules = {fqn: root.get_submodule(fqn) for fqn in blocks.values()}
    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules.values()]
    handles += [m.register_forward_hook(post_hook) for m in modules.values()]
    try:
        with torch.no_grad():
            out = forward_fn()
        del out
    finally:
        for h in handles:
            h.remove()
    # A block called several times (weights shared across depth) is one FQN in a plan: its mode applies to
    # every call, and each call is a row of its own in the model. One checkpoint cannot span several calls.
    shared = {f for f, calls in collections.Counter(order).items() if calls > 1}
    unchained = chain.unchained | {(stack_of or {})[f] for f in shared if f in (stack_of or {})}
    return order, {c.fqn: c for c in reps.values()}, rep_of, unchained


def _phase_rank(label: tuple[Any, ...], n: int) -> int:
    kind = label[0]
    if kind == "pre":
        return 0
    if kind == "fwd":
        return 1 + 2 * label[1]
    if kind == "fwd_gap":
        return 2 + 2 * label[1]
    if kind == "bw_head":
        return 1 + 2 * n
    if kind == "bw":
        return 2 + 2 * n + 2 * (n - 1 - label[1])
    return 3 + 2 * n + 2 * (n - 1 - label[1])  # bw_gap


def _hidden_tensor(obj: Any) -> torch.Tensor | None:
    """A block output's hidden state: the first floating-point tensor (needing a gradient or not)."""
    leaves, _ = tree_flatten(obj)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _backward_leaves(out: Any, positions: tuple[int, ...] | None) -> list[torch.Tensor]:
    """The output leaves a block's backward starts from: those that received a gradient in the step
    (``positions``), or the first that needs one when that is not known."""
    leaves, _ = tree_flatten(out)
    if positions is None:
        first = _first_grad_tensor(out)
        return [first] if first is not None else []
    return [t for i, t in enumerate(leaves) if i in positions and isinstance(t, torch.Tensor) and t.requires_grad]


def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad else None
    leaves, _ = tree_flatten(obj)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad), None)


@dataclass
class _Calls:
    """How the anchor step called each block (one entry per call), read with every block ``full``:
    checkpointing changes neither whether a tensor needs a gradient nor which outputs receive one."""

    input_grad: list[bool]  # the hidden input needed a gradient
    output_grad: list[bool]  # some output needed a gradient (False: no gradient flows through the call)
    grad_leaves: list[set[int]]  # positions (``tree_flatten``) of the output leaves that received one


def _anchor(
    root: nn.Module, forward_fn: Callable[[], Any], order: list[str], externals: list[Any], device: torch.device
) -> tuple[Any, int, tuple[int, int], _Calls]:
    """Forward+backward with every block ``full``, phase maxima recorded.

    Returns the tracker, the resting level, the (total, activation) level when the forward returned, and
    how each block was called (``_Calls``).
    """
    n = len(order)
    positions: dict[str, list[int]] = {}
    for i, fqn in enumerate(order):
        positions.setdefault(fqn, []).append(i)
    seen: dict[str, int] = {}
    running: dict[int, int] = {}  # id(module) -> the call index of its call in progress
    calls = _Calls([False] * n, [False] * n, [set() for _ in range(n)])
    tracker = new_live_tracker(device, root)
    tracker.track_external(*externals)
    current = [("pre",)]

    def enter(label: tuple[Any, ...]) -> None:
        # Hooks can fire out of phase order (one tensor is both a block's output and the next block's
        # input); a phase never goes back, so the later one wins.
        if _phase_rank(label, n) > _phase_rank(current[0], n):
            current[0] = label
            tracker.enter_phase(label)

    def grad_marker(label: tuple[Any, ...]) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            enter(label)

        return hook

    def leaf_marker(i: int, leaf: int) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            calls.grad_leaves[i].add(leaf)
            enter(("bw", i))

        return hook

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fqn = fqn_of[id(module)]
        k = seen[fqn] = seen.get(fqn, -1) + 1
        i = running[id(module)] = positions[fqn][min(k, len(positions[fqn]) - 1)]  # a shared block: its k-th call
        enter(("fwd", i))
        where = _hidden_index(args, kwargs)
        if where is not None:
            t = args[where[1]] if where[0] == "arg" else kwargs[where[1]]
            calls.input_grad[i] = t.requires_grad
            if t.requires_grad:
                t.register_hook(grad_marker(("bw_gap", i)))

    def post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        i = running[id(module)]
        enter(("fwd_gap", i))
        # Every output that needs a gradient starts the block's backward, not only the hidden state: an
        # auxiliary loss (an MoE router's) reaches the block first when it is computed from the block's output,
        # and under ``full`` its gradient recomputes the block right then.
        for leaf, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                calls.output_grad[i] = True
                t.register_hook(leaf_marker(i, leaf))

    fqn_of = {id(root.get_submodule(f)): f for f in order}
    plan = Plan({f: BlockPlan("full") for f in order})
    handle = apply_plan(root, plan, check_fingerprint=False)
    handles = []
    try:
        for f in positions:
            m = root.get_submodule(f)
            handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
        resting = tracker.now()[0]
        tracker.total_peak = resting
        with tracker:
            tracker.enter_phase(("pre",))
            loss = loss_of(forward_fn())
            end_of_forward = tracker.now()
            enter(("bw_head",))
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        handle.remove()
    return tracker, resting, end_of_forward, calls


def _run_block(
    root: nn.Module, cap: _Captured, bp: BlockPlan, externals: list[Any], device: torch.device
) -> tuple[ModeProfile, int]:
    """Run one block alone under ``bp``; returns its profile and its input's bytes."""
    where = _hidden_index(cap.args, cap.kwargs)
    if where is None:
        raise LightningCkptError(
            f"Block {cap.fqn!r} takes no floating-point tensor input, so there is no hidden state to run it "
            "on alone. Name blocks whose first argument is the hidden state via block_types."
        )
    hidden = cap.args[where[1]] if where[0] == "arg" else cap.kwargs[where[1]]
    tracker = new_live_tracker(device, root)
    captured = [t for t in tree_flatten((cap.args, cap.kwargs))[0] if isinstance(t, torch.Tensor)]
    tracker.track_external(*externals, *captured)
    plan = Plan({cap.fqn: bp}) if bp.mode != "none" else Plan()
    handle = apply_plan(root, plan, check_fingerprint=False)
    try:
        with tracker:
            # A fresh non-leaf input, as in the chain: a leaf would be kept alive by its AccumulateGrad
            # node, hiding whether the block itself saves its input. When the step's input needed no
            # gradient (frozen embeddings or frozen blocks before it) a plain copy: a frozen block then
            # saves nothing, and a LoRA block only what its adapters need.
            seed = torch.zeros((), dtype=hidden.dtype, device=hidden.device, requires_grad=cap.input_grad)
            base, base_act = tracker.now()
            x = hidden.detach() + seed
            in_bytes = tracker.now()[0] - base
            args, kwargs = list(cap.args), dict(cap.kwargs)
            if where[0] == "arg":
                args[where[1]] = x
            else:
                kwargs[where[1]] = x
            tracker.enter_phase("fwd")
            with _autocast_as(cap.autocast):
                out = cap.module(*args, **kwargs)
                out_t = _hidden_tensor(out)
                out_bytes = tensor_bytes([out_t]) if out_t is not None else 0
                backward_from = _backward_leaves(out, cap.grad_leaves)
                in_context = tracker.now()[0]
            keep_with_input = tracker.enter_phase("after_fwd")[0] - base - out_bytes
            # Autocast caches the low-precision copies of the weights until the step's autocast region
            # ends: a mode that saves them keeps them anyway, one that does not frees them only then.
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


def _default_selective_sets(stacks: Sequence[LayerStack]) -> dict[str, list[tuple[str, ...]]]:
    sets: dict[str, list[tuple[str, ...]]] = {}
    for s in stacks:
        for b in s.blocks:
            mine: list[tuple[str, ...]] = [(c.name,) for c in b.children]
            kinds = [b.children_of_kind(k) for k in ("attention", "mlp", "norm", "other")]
            for combo in (*kinds, kinds[0] + kinds[1]):
                if len(combo) > 1 and tuple(sorted(combo)) not in mine:
                    mine.append(tuple(sorted(combo)))
            sets[b.fqn] = mine
    return sets


def _state_bytes(root: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int, int, int]:
    params = {id(p): p for p in root.parameters()}.values()
    param_bytes = tensor_bytes(params)
    grad_bytes = sum(local_tensor(p).numel() * p.element_size() for p in params if p.requires_grad)
    buffer_bytes = tensor_bytes(root.buffers())
    opt_bytes = 0
    if optimizer is not None:
        opt_bytes = tensor_bytes(v for state in optimizer.state.values() for v in state.values())
    return param_bytes, grad_bytes, opt_bytes, buffer_bytes


def profile_memory(
    model: nn.Module,
    forward_fn: Callable[[], Any],
    *,
    stacks: Sequence[LayerStack] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: tuple[Any, ...] = (),
    device: torch.device | str | None = None,
    selective_sets: Mapping[str, Iterable[Iterable[str]]] | Iterable[Iterable[str]] | None = None,
    share_identical_blocks: bool = True,
    block_types: Iterable[type | str] | None = None,
) -> MemoryModel:
    """Profile ``model`` on one batch and return a ``MemoryModel`` that predicts any plan's memory.

    ``forward_fn`` takes no arguments, runs the forward on the batch and returns the loss (a scalar
    tensor, a dict with ``"loss"``, or an object with ``.loss``); the profile calls ``backward`` on it,
    as the measured step will. Profile in the state you will measure in: same batch, same gradients
    (``None`` or not), same optimizer state; ``extra`` are tensors created outside the step (e.g. the
    batch) to count as resting memory, as in ``measure_step``. HF models should run with
    ``use_cache=False`` (a KV cache filled during a training forward is memory no plan can remove).

    Memory-safe: the most memory any pass needs is one step with every block fully checkpointed
    (the lowest-memory plan) or one block's forward+backward without checkpointing. Model state
    (gradients, buffers, RNG) is left as it was. The model must not have a plan applied.

    ``selective_sets``: child sets to profile exactly for ``selective`` mode (every single child and
    each block's attention, MLP and attention+MLP children are profiled by default); a mapping from
    block FQN, or one list for all blocks. Other sets are predicted by adding single-child effects.
    ``share_identical_blocks``: blocks with the same class, parameter shapes and input shapes share
    one profile (run once instead of once per block).
    """
    root = unwrap_compiled(model)
    if applied_plan(root) is not None:
        raise ApplyError(
            f"profile_memory needs the model without checkpointing, but plan {applied_plan(root).describe()!r} "
            "is applied. Call handle.remove() first; the profile covers every plan, the applied one included."
        )
    stacks = list(stacks) if stacks is not None else discover_blocks(root, block_types=block_types)
    dev = normalise_device(torch.device(device) if device is not None else model_device(root))
    blocks = {id(root.get_submodule(b.fqn)): b.fqn for s in stacks for b in s.blocks}
    sets = _default_selective_sets(stacks)
    if selective_sets is not None:
        extra_sets = selective_sets if isinstance(selective_sets, Mapping) else {f: selective_sets for f in sets}
        for fqn, combos in extra_sets.items():
            for combo in combos:
                c = tuple(sorted(combo))
                if c not in sets.setdefault(fqn, []):
                    sets[fqn].append(c)
    externals: list[Any] = [root, *extra] + ([optimizer] if optimizer is not None else [])

    snapshot = StateSnapshot.capture(root)
    try:
        stack_of = {b.fqn: s.fqn for s in stacks for b in s.blocks}
        order, reps, rep_of, unchained = _capture(root, forward_fn, blocks, share_identical_blocks, stack_of)
        # FSDP2 all-gathers a sharded block's parameters in its own forward hooks, which a segment's recompute
        # of several blocks as one function does not run: no segments over sharded blocks.
        unchained |= {s.fqn for s in stacks if any(is_fsdp_module(root.get_submodule(b.fqn)) for b in s.blocks)}
        unchained |= set(skipping_stacks(root, stacks))  # LayerDrop skips blocks on steps the capture may not see
        snapshot.restore()
        tracker, resting, end_of_forward, calls = _anchor(root, forward_fn, order, externals, dev)
        snapshot.restore()
        # One profile per representative and way of being called: a frozen block behind frozen embeddings
        # saves nothing, its trainable twin later in the stack does; an MoE block's router loss adds a gradient.
        call_rep, profiled = [], {}
        for i, rep in enumerate(rep_of):
            grad_leaves = tuple(sorted(calls.grad_leaves[i]))
            key = rep + ("" if calls.input_grad[i] else " (input without gradient)")
            key += "" if grad_leaves == (0,) else f" (gradient into outputs {list(grad_leaves)})"
            if key not in profiled:
                profiled[key] = dataclasses.replace(reps[rep], input_grad=calls.input_grad[i], grad_leaves=grad_leaves)
            call_rep.append(key)
        overhead = reserve = 0
        if dev.type == "cuda":
            allocator_peak, resting, reserve = _cuda_allocator_anchor(root, forward_fn, order, dev)
            overhead = allocator_peak - tracker.total_peak
            snapshot.restore()

        profiles, failed, in_bytes = _profile_blocks(root, profiled, sets, externals, dev, snapshot)
    finally:
        snapshot.restore()

    rows = []
    for fqn, key in zip(order, call_rep, strict=True):
        rep = profiled[key].fqn
        prof = profiles[key]
        full = prof["full"]
        transient = max(0, full.backward_peak_activation_bytes - full.keep_bytes - 2 * full.output_bytes)
        rows.append(
            BlockMemory(
                fqn=fqn,
                saved_bytes={k: p.keep_bytes for k, p in prof.items()},
                recompute_transient_bytes=transient,
                input_bytes=in_bytes[key],
                shared_with=rep if rep != fqn else None,
                profiles=dict(prof),
                failed=dict(failed[key]),
            )
        )
    n = len(order)
    phases = []
    for label, (total, act) in tracker.phase_peaks.items():
        phases.append(PhasePeak(label[0], label[1] if len(label) > 1 else None, total, act))
    phases.sort(key=lambda p: _phase_rank((p.kind,) if p.block is None else (p.kind, p.block), n))
    # Blocks' saved bytes include their inputs, so what is left at the end of the forward is the
    # embeddings', head's and loss's (the last block's output included).
    other = max(0, end_of_forward[1] - sum(r.saved_bytes["full"] for r in rows))
    param_b, grad_b, opt_b, buf_b = _state_bytes(root, optimizer)
    gradient_flows: dict[str, bool] = {}
    for fqn, flows in zip(order, calls.output_grad, strict=True):
        gradient_flows[fqn] = gradient_flows.get(fqn, False) or flows
    # All of each stack's blocks, run or not: apply_plan cuts segments over all of them.
    stack_map = {s.fqn: s.block_fqns for s in stacks}
    return MemoryModel(
        fixed_bytes=param_b + grad_b + opt_b + buf_b,
        other_activation_bytes=other,
        blocks=tuple(rows),
        stacks=stack_map,
        phases=tuple(phases),
        resting_bytes=resting,
        parameter_bytes=param_b,
        gradient_bytes=grad_b,
        optimizer_state_bytes=opt_b,
        buffer_bytes=buf_b,
        device=str(dev),
        device_overhead_bytes=overhead,
        anchor_peak_bytes=tracker.total_peak,
        anchor_activation_bytes=tracker.activation_peak,
        fingerprint=model_fingerprint(root),
        idle_blocks=tuple(f for f in blocks.values() if f not in order),
        inert_blocks=tuple(f for f, flows in gradient_flows.items() if not flows),
        unchained_stacks=tuple(sorted(unchained)),
        reserve_overhead_bytes=max(0, reserve),
    )


def _profile_blocks(
    root: nn.Module, reps: Mapping[str, _Captured], sets: Mapping[str, list[tuple[str, ...]]], externals: list[Any],
    dev: torch.device, snapshot: StateSnapshot,
) -> tuple[dict[str, dict[str, ModeProfile]], dict[str, dict[str, str]], dict[str, int]]:  # fmt: skip
    """Each representative block alone under every mode: (profiles, modes it failed under, input bytes)."""
    profiles: dict[str, dict[str, ModeProfile]] = {}
    failed: dict[str, dict[str, str]] = {}
    in_bytes: dict[str, int] = {}
    for fqn, cap in reps.items():
        keys = ["none", "full", "offload", *(f"ops:{name}" for name in SAVE_LISTS)]
        keys += ["selective:" + ",".join(c) for c in sets.get(cap.fqn, [])]
        profiles[fqn], failed[fqn] = {}, {}
        for key in keys:
            try:
                profiles[fqn][key], in_bytes[fqn] = _run_block(root, cap, _block_plan_of(key), externals, dev)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:
                # A mode this block cannot run under (e.g. an op save-list that does not apply) is
                # recorded; predicting a plan that uses it raises PlanError with this reason.
                if key in ("none", "full"):
                    raise
                failed[fqn][key] = f"{type(err).__name__}: {err}"
            finally:
                snapshot.restore()
    return profiles, failed, in_bytes


def _cuda_allocator_anchor(
    root: nn.Module, forward_fn: Callable[[], Any], order: list[str], device: torch.device
) -> tuple[int, int, int]:
    """(max_memory_allocated, memory_allocated before, reserved-above-allocated peak) of the anchor step:
    the tracker-to-allocator offset, and the headroom a cap on reserved memory needs."""
    plan = Plan({f: BlockPlan("full") for f in order})
    handle = apply_plan(root, plan, check_fingerprint=False)
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # a cold cache, as under a trial's cap: the reserve this step itself needs
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
