"""Predict a plan's peak and activation memory without running it, from one memory-safe profile. A plan's prediction is,
for every phase of the anchor step (every block ``full``), that phase's measured maximum plus the difference the plan
makes there (``mode - full``): the saved bytes of blocks whose forward is done and whose backward is not, and the
block's own forward or backward peak in its own phases. The predicted peak is the maximum over phases. Segments are
modelled as torch runs them: a chunk stores its first block's input; in backward the whole chunk is recomputed at once,
so the earlier blocks of the chunk hold their ``none``-mode activations. Byte counts follow ``measure.measurement``'s
definitions, so predictions compare with a ``Measurement``'s."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_ckpt.errors import PlanError, StalePlanError
from lightning_ckpt.formatting import format_bytes, table
from lightning_ckpt.plan.chunks import refuse_segment_misfit, segment_chunks
from lightning_ckpt.plan.format import Plan, closest_names, mode_key
from lightning_ckpt.stacks import LayerStack

__all__ = ["BlockMemory", "MemoryModel", "ModeProfile", "PhasePeak", "Prediction"]

# What an offloading mode would keep on the card without the pool: its bytes moved are that less what it keeps.
_KEPT_ON_CARD = {"offload": "none", "offload_input": "full"}
_STRUCTURED = ("blocks", "stacks", "phases")  # MemoryModel's fields ``to_dict`` writes apart


@dataclass(frozen=True)
class ModeProfile:
    """One block run alone under one mode. Bytes are relative to the level before its input existed, so they include
    constant offsets (input, output, incoming gradient) that cancel between modes. keep_bytes: held after the forward,
    its own output excluded (its input included when saved). keep_with_input_bytes: the same while the caller still
    holds the input, right after the block returns. autocast_cache_bytes: weight copies autocast cached that this mode
    does not save: they live until the end of the forward."""

    keep_bytes: int
    keep_with_input_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    backward_peak_activation_bytes: int
    output_bytes: int
    autocast_cache_bytes: int = 0


@dataclass(frozen=True)
class BlockMemory:
    """Per-block table row: what this block keeps for backward under each mode. saved_bytes: mode key -> activation
    bytes kept from forward to backward (``offload``: device bytes only). recompute_transient_bytes: extra memory while
    the block is recomputed and run backward under ``full``. shared_with: FQN of the identical block whose profile this
    row reuses (None: measured itself)."""

    fqn: str
    saved_bytes: Mapping[str, int]
    recompute_transient_bytes: int
    input_bytes: int = 0
    shared_with: str | None = None
    profiles: Mapping[str, ModeProfile] = field(default_factory=dict, repr=False)
    failed: Mapping[str, str] = field(default_factory=dict, repr=False)  # mode key -> why it could not run

    def offloaded_bytes(self, key: str) -> int:
        """Under offloading mode ``key``: the bytes its saved tensors put in host memory (else 0)."""
        kept = _KEPT_ON_CARD.get(key)
        if kept not in self.saved_bytes or key not in self.saved_bytes:
            return 0
        return max(0, self.saved_bytes[kept] - self.saved_bytes[key])


@dataclass(frozen=True)
class PhasePeak:
    """The anchor step's maximum of live bytes in one phase. kind: ``pre`` | ``fwd`` (block ``block``'s forward) |
    ``fwd_gap`` (after it, up to the next block; after the last: head and loss) | ``bw_head`` | ``bw`` | ``bw_gap``
    (after block ``block``'s backward; after block 0's: the embeddings')."""

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
    other_activation_bytes: activations held outside the blocks at the end of the anchor's forward. blocks: one row per
    block call (a block shared across depth has several), in execution order. device_overhead_bytes: CUDA: allocator
    peak minus tracked peak of the anchor step (memory no tensor tracker sees: cuBLAS workspaces, block rounding), added
    to every peak. reserve_overhead_bytes: CUDA: reserved above allocated on the anchor step, the headroom a cap on
    reserved memory needs. idle_blocks: blocks the profiled forward never ran. unchained_stacks: stacks segments cannot
    run on. inert_blocks: blocks no gradient flows through: no mode saves anything there (``plannable_stacks``)."""

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
        # While the forward runs, autocast's weight cache holds what a block does not save.
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
                d_total = d_act = keep_prefix[i] + chunk_adjust[i]
                if ph.kind == "bw":
                    d_total += st.bw_delta[i] + st.prefetch[i]
                    d_act += st.bw_act_delta[i] + st.prefetch[i]
            total = ph.peak_bytes + d_total
            if total > best_total:
                label = ph.kind if i is None else f"{ph.kind} {self.blocks[i].fqn}"
                best_total, best_phase = total, label
            best_act = max(best_act, ph.peak_activation_bytes + d_act)
        peak = best_total + self.device_overhead_bytes
        return Prediction(peak, max(0, best_act), best_phase)

    def can_run(self, plan: Plan) -> str | None:
        """Why ``plan`` cannot run on the profiled model (the ``PlanError``'s message), or None when it can."""
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
        """``stacks`` without the blocks no mode can save anything on (``inert_blocks``), renumbered; stacks left empty
        are dropped. The search plans over these: checkpointing a frozen block recomputes it for nothing."""
        out = []
        for s in stacks:
            kept = [b for b in s.blocks if b.fqn not in self.inert_blocks]
            if kept:
                renumbered = tuple(dataclasses.replace(b, index=i) for i, b in enumerate(kept))
                out.append(dataclasses.replace(s, blocks=renumbered))
        return out

    def table(self, plan: Plan | None = None) -> str:
        """A printable per-block breakdown in MiB: saved activations under each mode (and under ``plan``)."""
        # Child combinations stay in ``saved_bytes``: they would make the table unreadably wide.
        keys = list(dict.fromkeys(k for b in self.blocks for k in b.saved_bytes if "," not in k))
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
        lines = [
            f"Memory profile on {self.device} (MiB; saved activations kept from forward to backward per block)",
            f"fixed {_mib(self.fixed_bytes)} = parameters {_mib(self.parameter_bytes)} + gradients "
            f"{_mib(self.gradient_bytes)} + optimizer state {_mib(self.optimizer_state_bytes)} + buffers "
            f"{_mib(self.buffer_bytes)}; activations outside the blocks {_mib(self.other_activation_bytes)}",
            table(header, rows, right=range(1, len(header))),
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
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _STRUCTURED}
        return {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in data.items()},
            "stacks": {k: list(v) for k, v in self.stacks.items()},
            "phases": [[p.kind, p.block, p.peak_bytes, p.peak_activation_bytes] for p in self.phases],
            "blocks": [
                {**dataclasses.asdict(b), "profiles": {k: list(dataclasses.astuple(p)) for k, p in b.profiles.items()}}
                for b in self.blocks
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryModel:
        """The model ``to_dict`` wrote; fields a file from an older version lacks take their defaults."""
        blocks = tuple(
            BlockMemory(**{**b, "profiles": {k: ModeProfile(*v) for k, v in b.get("profiles", {}).items()}})
            for b in data["blocks"]
        )
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in _STRUCTURED and f.name in data}
        values = {k: tuple(data[k]) if f.type.startswith("tuple") else data[k] for k, f in fields.items()}
        stacks = {k: tuple(v) for k, v in data["stacks"].items()}
        return cls(**values, blocks=blocks, stacks=stacks, phases=tuple(PhasePeak(*p) for p in data["phases"]))

    def _resolve(self, plan: Plan) -> _PlanState:
        """Check ``plan`` against the profile and work out the differences it makes to the anchor, per block."""
        if plan.fingerprint is not None and self.fingerprint is not None and plan.fingerprint != self.fingerprint:
            raise StalePlanError(
                f"Plan {plan.name or plan.digest()!r} was made for a model with fingerprint {plan.fingerprint}, but "
                f"this memory model profiled a model with fingerprint {self.fingerprint}. Profile the model the "
                "plan is for, or re-tune the plan for this model."
            )
        rows_of: dict[str, list[int]] = {}  # a block shared across depth has a row per call
        for i, b in enumerate(self.blocks):
            rows_of.setdefault(b.fqn, []).append(i)
        keys = ["none"] * len(self.blocks)  # each row's mode key under ``plan``'s per-block modes
        for fqn, bp in plan.blocks.items():
            if fqn in self.idle_blocks:
                continue
            if fqn not in rows_of:
                raise PlanError(
                    f"The memory model has no profile for block {fqn!r}. Closest profiled blocks: "
                    f"{closest_names(fqn, list(rows_of))}. Fix the FQN in the plan, or profile the stack that holds it."
                )
            for i in rows_of[fqn]:
                keys[i] = mode_key(bp)
        chunk_of, chunk_pos = self._chunks_of(plan, rows_of)
        st = _PlanState(len(self.blocks), chunk_of)
        for i, b in enumerate(self.blocks):
            full = b.profiles.get("full")
            if full is None:  # a block that could not be profiled contributes nothing either way
                continue
            none = self._profile(b, "none")
            st.recompute_delta[i] = none.keep_bytes - full.keep_bytes
            own = none if chunk_of[i] is not None else self._profile(b, keys[i])  # a chunk's backward runs ``none``
            st.bw_delta[i] = own.backward_peak_bytes - full.backward_peak_bytes
            st.bw_act_delta[i] = own.backward_peak_activation_bytes - full.backward_peak_activation_bytes
            if chunk_of[i] is not None:
                self._chunk_member_deltas(st, i, chunk_pos[i], full)
            else:
                self._mode_deltas(st, i, own, full)
        self._prefetch_deltas(st, keys)
        return st

    def _prefetch_deltas(self, st: _PlanState, keys: Sequence[str]) -> None:
        """Offloaded blocks come back one ahead of backward: from the first backward use of an offloaded block's
        tensors until the previous offloaded block's own backward, that block's bytes are on the device again."""
        previous = None
        for i, key in enumerate(keys):
            if not key.startswith("offload") or self.blocks[i].profiles.get("full") is None:
                continue
            if previous is not None:
                for k in range(previous + 1, i + 1):
                    st.prefetch[k] += st.moved[previous]
            st.moved[i] = self.blocks[i].offloaded_bytes(key)
            previous = i

    def host_bytes(self, plan: Plan) -> int:
        """The host memory ``plan``'s offloaded blocks hold at once (the pool's peak)."""
        return sum(self._resolve(plan).moved)

    def _chunks_of(self, plan: Plan, rows: Mapping[str, list[int]]) -> tuple[list[int | None], list[tuple[int, int]]]:
        """Per row: its segment chunk (None: none) and (position, chunk length); refuses segments that cannot run."""
        n = len(self.blocks)
        chunk_of: list[int | None] = [None] * n
        chunk_pos: list[tuple[int, int]] = [(0, 0)] * n
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
            refuse_segment_misfit(stack_fqn, n_chunks, len(fqns), [f for f in fqns if f in plan.blocks])
            for start, end in segment_chunks(len(fqns), n_chunks)[:-1]:
                members = [rows[f][0] for f in fqns[start:end] if f in rows]
                for pos, i in enumerate(members):
                    chunk_of[i] = chunk_id
                    chunk_pos[i] = (pos, len(members))
                chunk_id += 1
        return chunk_of, chunk_pos

    def _chunk_member_deltas(self, st: _PlanState, i: int, chunk_pos: tuple[int, int], full: ModeProfile) -> None:
        """Row ``i``'s differences from ``full`` as a member of a segment chunk."""
        b = self.blocks[i]
        pos, length = chunk_pos
        out = full.output_bytes
        # Right after a block returns, its caller still holds the block's input, saved or not.
        input_held_full = full.keep_with_input_bytes - full.keep_bytes
        if pos == 0:
            # The head runs the whole chunk inside one checkpoint (which stores only the head's
            # input) and keeps every block's output until the parent has consumed it.
            fw = max(self._profile(self.blocks[i + j], "full").forward_peak_bytes + j * out for j in range(length))
            st.fw_delta[i] = fw - full.forward_peak_bytes
            st.gap_delta[i] = (length - 1) * out
        else:
            # A member only hands over its pending output: nothing is computed or stored.
            st.keep_delta[i] = st.keep_fwd_delta[i] = -full.keep_bytes
            st.fw_delta[i] = b.input_bytes + (length - pos) * out - full.forward_peak_bytes
            st.gap_delta[i] = b.input_bytes + (length - 1 - pos) * out - input_held_full

    @staticmethod
    def _mode_deltas(st: _PlanState, i: int, prof: ModeProfile, full: ModeProfile) -> None:
        """Row ``i``'s differences from ``full`` under its own mode's profile ``prof``."""
        input_held_full = full.keep_with_input_bytes - full.keep_bytes  # the caller still holds the input
        st.keep_delta[i] = prof.keep_bytes - full.keep_bytes
        st.keep_fwd_delta[i] = st.keep_delta[i] + prof.autocast_cache_bytes - full.autocast_cache_bytes
        st.fw_delta[i] = prof.forward_peak_bytes - full.forward_peak_bytes
        st.gap_delta[i] = (prof.keep_with_input_bytes - prof.keep_bytes) - input_held_full

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
        # Children checkpointed together save what each saves alone: their differences from ``none`` add up.
        none = self._profile(block, "none")
        parts = [self._profile(block, f"selective:{c}") for c in key.partition(":")[2].split(",")]
        fields = [f.name for f in dataclasses.fields(ModeProfile) if f.name != "output_bytes"]
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
        self.prefetch = [0] * n  # during its backward: an earlier offloaded block's tensors, fetched ahead
        self.moved = [0] * n  # offloaded: the bytes its saved tensors put in host memory
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
    return format_bytes(n, unit="MiB", digits=2, suffix=False)
