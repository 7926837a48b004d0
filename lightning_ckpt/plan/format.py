"""Plans: what to checkpoint, per block FQN (never by position, so a plan survives compile wrappers), as frozen data
with a versioned JSON form; blocks not listed are left alone. ``schema.py`` validates files, ``file.py`` owns bytes."""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_ckpt.errors import PlanError, PlanFileChangedError, StalePlanError
from lightning_ckpt.plan.file import bytes_version, directory_lock, plan_file_version, read_json, replace_atomically
from lightning_ckpt.plan.provenance import Provenance
from lightning_ckpt.plan.save_list_names import check_save_list_name
from lightning_ckpt.plan.schema import SCHEMA_VERSION, field_path, validate

if TYPE_CHECKING:
    from torch import nn

    from lightning_ckpt.model import ModelView

# No torch at import: a plan file is read, shown and re-planned without it (``lightning-ckpt show``/``replan``).

__all__ = ["MODES", "BlockPlan", "Plan", "block_names", "closest_names", "library_versions", "mode_key"]

_ANY_VERSION = object()  # Plan.save without unchanged_since: write whatever the file holds

MODES = ("none", "full", "selective", "ops", "offload", "offload_input")


@dataclass(frozen=True)
class BlockPlan:
    """How one block is checkpointed.

    mode: ``none`` | ``full`` | ``selective`` (only ``children``) | ``ops`` (whole block, op save-list
    ``save_list``) | ``offload`` (saved activations in host memory) | ``offload_input`` (``full``, its input in host
    memory).
    """

    mode: str = "none"
    children: tuple[str, ...] = ()
    save_list: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PlanError(
                f"Unknown checkpointing mode {self.mode!r}. Known modes: {', '.join(MODES)}. "
                "Fix the 'mode' field of the block in the plan."
            )
        if isinstance(self.children, (str, bytes)) or not all(isinstance(c, str) and c for c in self.children):
            raise PlanError(
                f"'children' must be a list of child module names, e.g. ('mlp',), but got {self.children!r}. "
                "Wrap a single name in a tuple or list."
            )
        object.__setattr__(self, "children", tuple(self.children))
        if self.mode == "selective" and not self.children:
            raise PlanError(
                "Mode 'selective' needs the names of the children to checkpoint, but got none. "
                "Give e.g. BlockPlan('selective', children=('mlp',))."
            )
        if self.mode != "selective" and self.children:
            raise PlanError(f"'children' only applies to mode 'selective', but mode is {self.mode!r}.")
        if self.mode == "ops":
            if not self.save_list:
                raise PlanError("Mode 'ops' needs a save_list name, e.g. BlockPlan('ops', save_list='save_matmuls').")
            check_save_list_name(self.save_list)
        elif self.save_list is not None:
            raise PlanError(f"'save_list' only applies to mode 'ops', but mode is {self.mode!r}.")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode}
        if self.children:
            d["children"] = list(self.children)
        if self.save_list:
            d["save_list"] = self.save_list
        return d

    def describe(self) -> str:
        if self.mode == "selective":
            return f"selective({','.join(self.children)})"
        return f"ops({self.save_list})" if self.mode == "ops" else self.mode


def mode_key(block_plan: BlockPlan) -> str:
    """A block plan as the profile keys its runs: the mode, ``ops:<save_list>`` or ``selective:<sorted children>``."""
    if block_plan.mode == "ops":
        return f"ops:{block_plan.save_list}"
    return "selective:" + ",".join(sorted(block_plan.children)) if block_plan.mode == "selective" else block_plan.mode


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for one model.

    blocks: block FQN -> BlockPlan (absent means ``none``).
    segments: stack FQN -> chunk count; each chunk stores only its input and is recomputed as one.
    fingerprint: ``model_fingerprint`` of the model the plan was made for (None: not checked).
    metadata: the plan file's record beyond the plan, as JSON; read it as ``provenance`` (typed sections).
    compile_memory_budget: PT2's ``activation_memory_budget`` (0..1) for a model under ``torch.compile``: the
        partitioner recomputes so saved activations stay under that fraction of its default choice.
    """

    blocks: Mapping[str, BlockPlan] = field(default_factory=dict)
    segments: Mapping[str, int] = field(default_factory=dict)
    name: str = ""
    fingerprint: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    compile_memory_budget: float | None = None

    def __post_init__(self) -> None:
        for fqn, bp in self.blocks.items():
            if not isinstance(bp, BlockPlan):
                raise PlanError(
                    f"Plan.blocks[{fqn!r}] must be a BlockPlan, but got {type(bp).__name__} {bp!r:.60}. "
                    "Use e.g. BlockPlan('full')."
                )
        blocks = {str(k): v for k, v in self.blocks.items() if v.mode != "none"}
        segments = {}
        for fqn, n in self.segments.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise PlanError(f"segments[{fqn!r}] must be a positive chunk count, but got {n!r}.")
            segments[str(fqn)] = n
        object.__setattr__(self, "blocks", dict(sorted(blocks.items())))
        object.__setattr__(self, "segments", dict(sorted(segments.items())))
        object.__setattr__(self, "metadata", dict(self.metadata))
        budget = self.compile_memory_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= budget <= 1.0:
                raise PlanError(
                    f"compile_memory_budget must be a number in [0, 1] (a fraction of the saved activations "
                    f"torch.compile keeps by default), but got {budget!r}. Use e.g. 0.5, or None for the default."
                )
            object.__setattr__(self, "compile_memory_budget", float(budget))

    def key(self) -> str:
        """What the plan *does* (not its name or metadata), canonically; made once: a search asks thousands of times."""
        key = self.__dict__.get("_key")
        if key is None:
            d = self.to_dict()
            key = json.dumps(
                {k: d[k] for k in ("blocks", "segments", "compile_memory_budget") if k in d}, sort_keys=True
            )
            object.__setattr__(self, "_key", key)
        return key

    def digest(self) -> str:
        return hashlib.sha256(self.key().encode()).hexdigest()[:16]

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.key() == other.key()

    def block_labels(self, block_fqns: Sequence[str]) -> dict[str, str]:
        """What this plan does to each of ``block_fqns`` (in stack order), in words, segments included: without
        this a segments plan reads as ``none`` on every block."""
        from lightning_ckpt.plan.chunks import segment_chunks

        labels = {fqn: self.mode_of(fqn).describe() for fqn in block_fqns}
        for stack, chunks in self.segments.items():
            members = [f for f in block_fqns if f.rpartition(".")[0] == stack]
            if not members:
                continue
            ranges = segment_chunks(len(members), min(chunks, len(members)))
            for i, (start, end) in enumerate(ranges):
                for j in range(start, end):
                    if i == len(ranges) - 1:
                        where = "last: not checkpointed"
                    else:
                        where = "input kept" if j == start else "recomputed"
                    labels[members[j]] = f"segment {i + 1} of {chunks} ({where})"
        return labels

    def mode_of(self, block_fqn: str) -> BlockPlan:
        return self.blocks.get(block_fqn, BlockPlan())

    @property
    def is_empty(self) -> bool:
        return not self.blocks and not self.segments and self.compile_memory_budget is None

    @functools.cached_property
    def provenance(self) -> Provenance:
        """``metadata`` read as typed sections: what every stage reads of a plan beyond the plan itself."""
        return Provenance.of(self.metadata)

    def with_provenance(self, **sections: Any) -> Plan:
        """This plan with ``sections`` of its provenance written (``None`` drops one); an unknown name is refused."""
        metadata = {**self.metadata, **Provenance.sections(**sections)}
        return replace(self, metadata={k: v for k, v in metadata.items() if v is not None})

    def describe(self) -> str:
        """A one-line human summary that names the blocks, e.g. ``full h.0-3, selective(mlp) h.4-7``, without the
        prefix every block shares (``key()`` is the exact identity)."""
        if self.is_empty:
            return "none"
        groups: dict[str, list[str]] = {}
        for fqn in sorted(self.blocks, key=_natural_key):
            groups.setdefault(self.blocks[fqn].describe(), []).append(fqn)
        parts = [f"{mode} {block_names(fqns, among=list(self.blocks))}" for mode, fqns in groups.items()]
        parts += [f"segments({fqn or '<root>'}={n})" for fqn, n in self.segments.items()]
        if self.compile_memory_budget is not None:
            parts.append(f"pt2_budget({self.compile_memory_budget:g})")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema_version": 1 if self.compile_memory_budget is None else SCHEMA_VERSION,
            "name": self.name,
            "fingerprint": self.fingerprint,
            "blocks": {k: v.to_dict() for k, v in self.blocks.items()},
            "segments": dict(self.segments),
            "metadata": dict(self.metadata),
        }
        if self.compile_memory_budget is not None:  # absent otherwise, so older plans' files and keys are unchanged
            d["compile_memory_budget"] = self.compile_memory_budget
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """Build a plan from its JSON form; anything that does not fit ``plan_schema()`` raises a ``PlanError`` that
        starts with ``source`` and names the field."""
        validate(data, source)
        blocks = {}
        for fqn, spec in data.get("blocks", {}).items():
            try:
                blocks[fqn] = BlockPlan(spec["mode"], tuple(spec.get("children", ())), spec.get("save_list"))
            except PlanError as err:
                field_ = "save_list" if spec.get("save_list") else "mode"
                raise PlanError(f"{source}: field {field_path(('blocks', fqn, field_))}: {err}") from None
        try:
            fields = (data.get("segments", {}), data.get("name", ""), data.get("fingerprint"), data.get("metadata", {}))
            plan = cls(blocks, *fields, compile_memory_budget=data.get("compile_memory_budget"))
        except PlanError as err:
            raise PlanError(f"{source}: {err}") from None
        _check_against_own_profile(plan, source)
        return plan

    def save(self, path: str | os.PathLike[str], *, unchanged_since: str | None | object = _ANY_VERSION) -> Path:
        """Write atomically: a crash or a full disk leaves any previous plan file intact. ``unchanged_since``: the
        file's ``plan_file_version`` when the caller last read or wrote it (None: no file). If another run saved to it
        since (checked under a directory lock), nothing is written: ``PlanFileChangedError``."""
        path = Path(path)
        data = self.to_json().encode("utf-8")
        target = path.resolve() if path.is_symlink() else path
        target.parent.mkdir(parents=True, exist_ok=True)
        with directory_lock(target.parent):
            if unchanged_since is not _ANY_VERSION:
                _refuse_if_changed(target, unchanged_since)
            replace_atomically(target, data)
        return path

    def file_version(self) -> str:
        """The ``plan_file_version`` of a file this plan was just saved to."""
        return bytes_version(self.to_json().encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file; anything unreadable or malformed raises ``PlanError`` naming the file (and field)."""
        where = f"Plan file {str(path)!r}"
        return cls.from_dict(read_json(Path(path), where), source=where)

    def check_fingerprint(self, model: nn.Module | ModelView) -> None:
        """Refuse a plan made for another model. A ``ModelView`` carries its fingerprint, computed once."""
        if self.fingerprint is None:
            return
        from lightning_ckpt.model import ModelView, model_fingerprint  # torch, imported by the caller already

        actual = model.fingerprint if isinstance(model, ModelView) else model_fingerprint(model)
        if actual != self.fingerprint:
            raise StalePlanError(
                f"Plan {self.name or self.digest()!r} was made for another model: "
                f"{self.model_change(ModelView.of(model))} "
                f"(fingerprint {self.fingerprint} in the plan, {actual} for this model). "
                "Re-tune for this model, or pass check_fingerprint=False if you know the plan still fits."
            )

    def model_change(self, model: ModelView) -> str:
        """How ``model`` differs from the one this plan was tuned for, read from the plan's saved profile."""
        root = model.root
        changes = model_changes(
            self.provenance.profile,
            [s.to_dict() for s in model.stacks],
            parameter_bytes=sum(p.numel() * p.element_size() for p in root.parameters()),
            plan_blocks=tuple(self.blocks),
            module_names=frozenset(name for name, _ in root.named_modules()),
        )
        return describe_model_change(changes)


# What differs between the model a plan was tuned for and this one, in words a user can act on: two fingerprints say
# *that* the model changed, the plan file's profile says *how*. Torch-free: it compares ``LayerStack.to_dict``s.
_MAX_LISTED = 3


def _stacks_of(profile: Any) -> list[Mapping[str, Any]] | None:
    """The saved stacks, or None where the file holds none in a readable form (an old or hand-made plan)."""
    stacks = profile.get("stacks") if isinstance(profile, Mapping) else None
    readable = (
        isinstance(s, Mapping) and isinstance(s.get("fqn"), str) and isinstance(s.get("blocks"), list)
        for s in stacks or ()
    )
    return stacks if isinstance(stacks, list) and all(readable) else None


def _block_words(stack: Mapping[str, Any]) -> str:
    blocks = [b for b in stack["blocks"] if isinstance(b, Mapping)]
    classes = sorted({str(b.get("class_name")) for b in blocks})
    return f"{len(stack['blocks'])} x {'/'.join(classes) or 'block'}"


def _compare_blocks(saved: list[Any], now: list[Mapping[str, Any]]) -> list[str]:
    """The first block that differs, in words: identical blocks differ alike."""
    for old, new in zip(saved, now, strict=False):
        if not isinstance(old, Mapping):
            continue
        if old.get("class_name") != new["class_name"]:
            return [f"{new['fqn']} is a {old.get('class_name')} in the plan and a {new['class_name']} in this model"]
        if old.get("num_params") != new["num_params"]:
            return [
                f"{new['fqn']} ({new['class_name']}) has {old.get('num_params'):,} parameters in the plan and "
                f"{new['num_params']:,} in this model"
                if isinstance(old.get("num_params"), int)
                else f"{new['fqn']} has another parameter count in this model ({new['num_params']:,})"
            ]
        names = [c[0] for c in old.get("children") or [] if isinstance(c, list) and c]
        if names != [c[0] for c in new["children"]]:
            return [
                f"{new['fqn']}'s children are {', '.join(map(str, names)) or 'none'} in the plan and "
                f"{', '.join(c[0] for c in new['children']) or 'none'} in this model"
            ]
    return []


def model_changes(
    profile: Any,
    stacks: Sequence[Mapping[str, Any]],
    *,
    parameter_bytes: int | None = None,
    plan_blocks: Sequence[str] = (),
    module_names: frozenset[str] = frozenset(),
) -> list[str]:
    """What differs, most telling first: stacks added, removed, resized or changed, then parameter bytes, between
    the plan file's ``metadata.profile`` and this model's ``stacks`` (``LayerStack.to_dict()``s). Without a saved
    profile only the plan's block FQNs (``plan_blocks``) can be checked against this model's ``module_names``."""
    saved = _stacks_of(profile)
    if saved is None:
        missing = [f for f in plan_blocks if f not in module_names]
        if missing:
            return [
                f"{len(missing)} of the plan's {len(plan_blocks)} blocks are not in this model (e.g. {missing[0]!r})"
            ]
        return []
    out: list[str] = []
    now = {s["fqn"]: s for s in stacks}
    before = {s["fqn"]: s for s in saved}
    for fqn, old in before.items():
        new = now.get(fqn)
        if new is None:
            out.append(f"the plan's stack {fqn} ({_block_words(old)}) is not in this model")
        elif len(old["blocks"]) != len(new["blocks"]):
            out.append(f"{fqn} has {len(old['blocks'])} blocks in the plan and {len(new['blocks'])} in this model")
        else:
            out.extend(_compare_blocks(old["blocks"], list(new["blocks"])))
    out.extend(
        f"this model has a stack {fqn} ({_block_words(s)}) the plan does not"
        for fqn, s in now.items()
        if fqn not in before
    )
    memory = profile.get("memory")
    saved_bytes = memory.get("parameter_bytes") if isinstance(memory, Mapping) else None
    if not out and isinstance(saved_bytes, int) and parameter_bytes is not None and saved_bytes != parameter_bytes:
        out.append(
            f"the parameters take {saved_bytes:,} bytes in the plan's profile and {parameter_bytes:,} in this model "
            "(another dtype, or parameters outside the layer stacks)"
        )
    return out


def describe_model_change(changes: list[str]) -> str:
    """The differences as one clause, at most three of them, or what is left to suspect when none was found."""
    if not changes:
        return "its layer stacks match the plan's; the module tree, parameter shapes or dtypes differ elsewhere"
    more = len(changes) - _MAX_LISTED
    listed = "; ".join(changes[:_MAX_LISTED])
    return listed + (f"; and {more} more" if more > 0 else "")


def _refuse_if_changed(target: Path, expected: str | None) -> None:
    found = plan_file_version(target)
    if found is None or found == expected:
        return
    current: Plan | None = None
    held = "a file that is not a readable plan"
    with contextlib.suppress(PlanError):
        current = Plan.load(target)
        named = f" {current.name!r}" if current.name else ""
        held = f"plan{named} {current.describe()} (digest {current.digest()})"
    message = (
        f"Plan file {str(target)!r} changed since this process last read or wrote it (another run saved to it "
        f"meanwhile): it now holds {held}. Nothing was written, so that plan is kept. Give each run its own plan "
        "file, or load this one again before saving over it."
    )
    raise PlanFileChangedError(message, path=str(target), current=current, held=held)


def _is_index(name: str) -> bool:
    """A position as ModuleList/Sequential names it; ``01`` is a name, not an index, so it is never folded."""
    return name.isdecimal() and str(int(name)) == name


def _natural_key(fqn: str) -> tuple[tuple[int, int | str], ...]:
    """Sorts ``h.2`` before ``h.10``."""
    return tuple((0, int(part)) if _is_index(part) else (1, part) for part in fqn.split("."))


def _shared_prefix_length(fqns: list[str]) -> int:
    """How many leading dotted names every FQN shares, short of each block's container and own name."""
    paths = [fqn.split(".") if fqn else [] for fqn in fqns]
    shortest = min((len(p) for p in paths), default=0)
    shared = 0
    while shared < shortest and len({p[shared] for p in paths}) == 1:
        shared += 1
    return max(0, min(shared, shortest - 2))


def _index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``0-3,6``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def block_names(fqns: Sequence[str], among: Sequence[str]) -> str:
    """``fqns`` written as ``describe()`` writes a group of blocks, one entry per container (``h.0-3``,
    ``encoder.block.0 lm_head``), without the prefix that every FQN of ``among`` shares."""
    drop = _shared_prefix_length(list(among))
    # Key: (path, is_container), so a planned ``h`` and the planned blocks inside it stay two entries.
    entries: dict[tuple[str, bool], list[int]] = {}
    for fqn in sorted(fqns, key=_natural_key):
        path = fqn.split(".")[drop:] if fqn else []
        if path and _is_index(path[-1]):
            entries.setdefault((".".join(path[:-1]), True), []).append(int(path[-1]))
        else:
            entries[(".".join(path) or "<root>", False)] = []
    return " ".join(
        (f"{name}.{_index_ranges(ix)}" if name else _index_ranges(ix)) if is_container else name
        for (name, is_container), ix in entries.items()
    )


def _check_against_own_profile(plan: Plan, source: str) -> None:
    """Refuse a plan naming a block (or a segmented stack) the profile it keeps never saw (a hand edit, or two runs
    pieced together): without a model (``show``, ``replan``) its figures would be quoted for a plan they do not fit.
    ``from_dict`` validated the profile, so its stacks and blocks have the schema's shape."""
    profile = plan.provenance.profile
    if not profile:
        return
    stack_names = [s["fqn"] for s in profile["stacks"]]
    blocks = [b for s in profile["stacks"] for b in s["blocks"]] + list(profile["memory"]["blocks"])
    known = sorted({b["fqn"] for b in blocks})
    if not known:
        return
    for fqn in plan.blocks:
        if fqn not in known:
            raise StalePlanError(
                f"{source}: block {fqn!r} is not in the profile the file keeps (metadata['profile'] records "
                f"{len(known)} blocks, e.g. {closest_names(fqn, known)}), so the file was edited by hand or mixes two "
                "models. Remove the block from 'blocks', or re-tune to write a new plan."
            )
    for fqn in plan.segments:
        if fqn not in stack_names:
            raise StalePlanError(
                f"{source}: segments name the stack {fqn!r}, which is not in the profile the file keeps (its stacks: "
                f"{closest_names(fqn, stack_names)}). Remove it from 'segments', or re-tune to write a new plan."
            )


def closest_names(name: str, candidates: list[str], n: int = 3) -> str:
    """The ``n`` names closest to ``name`` (else the first ``n``), in natural order (difflib's is by similarity)."""
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.4)
    return ", ".join(repr(c) for c in sorted(close or sorted(candidates, key=natural_order)[:n], key=natural_order))


def natural_order(name: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that orders the numbers inside names by value: ``h.2`` before ``h.10``."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    torch = sys.modules.get("torch")  # a torch value exists only once torch is imported
    if torch is not None and isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"Plan metadata value of type {type(obj).__name__} is not JSON serialisable: {obj!r}")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("lightning-ckpt", "torch", "lightning", "optuna"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out
