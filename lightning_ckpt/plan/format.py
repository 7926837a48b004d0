"""Plans: what to checkpoint, per block FQN, as frozen data with a versioned JSON form.

A plan names modules by fully qualified name, never by position, so it survives compile wrappers
and can be checked against any model. Blocks not listed are left alone (mode ``none``), which keeps
plan files short and readable.

The file format is published as a JSON Schema (draft 2020-12), ``lightning_ckpt/plan/plan_schema.json``
(``plan_schema()`` returns it), so other tools can check a plan too, e.g.
``check-jsonschema --schemafile plan_schema.json plans/gpt.json``. ``Plan.load`` and ``Plan.from_dict``
validate against it with ``jsonschema`` before building anything, and refuse whatever does not fit
with one ``PlanError`` that names the file, the field, what was found and what is expected.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ckpt.errors import PlanError, PlanFileChangedError, StalePlanError
from lightning_ckpt.plan.policies import get_save_list

__all__ = [
    "MODES",
    "SCHEMA_VERSION",
    "BlockPlan",
    "Plan",
    "model_fingerprint",
    "library_versions",
    "plan_schema",
    "plan_file_version",
]

_ANY_VERSION = object()  # Plan.save without unchanged_since: write whatever the file holds

# Version 2 added ``compile_memory_budget``. A plan is written with the lowest version that can hold it
# (1 unless it sets a compile memory budget), so plans that do not use the new field stay readable by
# lightning_ckpt releases that only know version 1.
SCHEMA_VERSION = 2
MODES = ("none", "full", "selective", "ops", "offload")


@dataclass(frozen=True)
class BlockPlan:
    """How one block is checkpointed.

    mode: ``none`` | ``full`` (whole block) | ``selective`` (only ``children``) | ``ops`` (whole block
    with op save-list ``save_list``) | ``offload`` (saved activations kept in host memory).
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
            get_save_list(self.save_list)
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
        if self.mode == "ops":
            return f"ops({self.save_list})"
        return self.mode


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan for one model.

    blocks: block FQN -> BlockPlan (absent means ``none``).
    segments: stack FQN -> chunk count; each chunk stores only its input and is recomputed as one.
    fingerprint: ``model_fingerprint`` of the model the plan was made for (None: not checked).
    metadata: free-form JSON data: library versions, run description, budget, measured figures.
    compile_memory_budget: PT2's ``torch._functorch.config.activation_memory_budget`` (0..1) to compile
        the model with: the min-cut partitioner then chooses what to recompute so that saved
        activations stay under that fraction of its default choice. Only meaningful for a model run
        under ``torch.compile``; ``apply_plan`` sets it process-wide and ``remove()`` restores it.
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

    # -- identity -------------------------------------------------------------------------------
    def key(self) -> str:
        """A canonical string of what the plan *does* (not its name or metadata): equal plans, equal keys."""
        data: dict[str, Any] = {"blocks": {k: v.to_dict() for k, v in self.blocks.items()}, "segments": self.segments}
        if self.compile_memory_budget is not None:  # absent otherwise, so keys of older plans are unchanged
            data["compile_memory_budget"] = self.compile_memory_budget
        return json.dumps(data, sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.key().encode()).hexdigest()[:16]

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self.key() == other.key()

    def mode_of(self, block_fqn: str) -> BlockPlan:
        return self.blocks.get(block_fqn, BlockPlan())

    @property
    def is_empty(self) -> bool:
        return not self.blocks and not self.segments and self.compile_memory_budget is None

    def with_metadata(self, **updates: Any) -> Plan:
        return replace(self, metadata={**self.metadata, **updates})

    def describe(self) -> str:
        """A one-line human summary that names the blocks, e.g. ``full h.0-3, selective(mlp) h.4-7``.

        Blocks are grouped by mode, in FQN order (``h.2`` before ``h.10``). Each group lists its
        blocks as module paths without the dotted prefix that every block of the plan shares
        (``transformer.h.0`` reads ``h.0``; the container's own name always stays), with integer
        indices folded into ranges: ``h.0,2,4,6``, ``h.0-1,4-5``. Blocks of different containers are
        separated by a space: ``full decoder.block.0-1 encoder.block.0-1``. Blocks left at ``none``
        are not listed; the empty plan reads ``none``.

        Plans with different block assignments read differently, with one exception: the shared
        prefix is not shown, so a plan that touches only ``encoder.block`` reads like the same plan
        on ``decoder.block``. ``key()`` is the exact identity.
        """
        if self.is_empty:
            return "none"
        groups: dict[str, list[str]] = {}
        for fqn in sorted(self.blocks, key=_natural_key):
            groups.setdefault(self.blocks[fqn].describe(), []).append(fqn)
        drop = _shared_prefix_length(list(self.blocks))
        parts = [f"{mode} {_compact_fqns(fqns, drop)}" for mode, fqns in groups.items()]
        parts += [f"segments({fqn or '<root>'}={n})" for fqn, n in self.segments.items()]
        if self.compile_memory_budget is not None:
            parts.append(f"pt2_budget({self.compile_memory_budget:g})")
        return ", ".join(parts)

    # -- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema_version": 1 if self.compile_memory_budget is None else SCHEMA_VERSION,
            "name": self.name,
            "fingerprint": self.fingerprint,
            "blocks": {k: v.to_dict() for k, v in self.blocks.items()},
            "segments": dict(self.segments),
            "metadata": dict(self.metadata),
        }
        if self.compile_memory_budget is not None:
            d["compile_memory_budget"] = self.compile_memory_budget
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=_json_default)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """Build a plan from its JSON form, refusing anything that does not fit ``plan_schema()``.

        Schema versions 1 and 2 load; a newer one is refused with the advice to upgrade. Every
        refusal is a ``PlanError`` that starts with ``source`` and names the offending field.
        """
        _validate(data, source)
        blocks = {}
        for fqn, spec in data.get("blocks", {}).items():
            try:
                blocks[fqn] = BlockPlan(spec["mode"], tuple(spec.get("children", ())), spec.get("save_list"))
            except PlanError as err:
                field_ = "save_list" if spec.get("save_list") else "mode"
                raise PlanError(f"{source}: field {_field_path(('blocks', fqn, field_))}: {err}") from None
        try:
            return cls(
                blocks, data.get("segments", {}), data.get("name", ""), data.get("fingerprint"),
                data.get("metadata", {}), compile_memory_budget=data.get("compile_memory_budget"),
            )  # fmt: skip
        except PlanError as err:
            raise PlanError(f"{source}: {err}") from None

    def save(self, path: str | os.PathLike[str], *, unchanged_since: str | None | object = _ANY_VERSION) -> Path:
        """Write atomically: a crash or a full disk leaves any previous plan file intact.

        The text goes to a temporary file beside the target, which then replaces it. The file ends
        with the permissions it would have had if written in place: a new file gets what ``open()``
        gives (``0o666`` less the umask; ``tempfile``'s ``0o600`` would hide a shared plan from the
        team), a replaced file keeps its own mode, and a symlink keeps pointing at the file it names.

        ``unchanged_since``: the file's ``plan_file_version`` when the caller last read or wrote it (None: there
        was no file). If the file now holds anything else - another run saved its plan there meanwhile - nothing
        is written and ``PlanFileChangedError`` names the plan it holds. (A file deleted since holds no plan to
        lose, and is written.) The check and the replacement run under a lock on the file's directory, so of
        two processes saving at once one writes and the other finds the file changed.
        """
        path = Path(path)
        data = self.to_json().encode("utf-8")
        target = path.resolve() if path.is_symlink() else path
        target.parent.mkdir(parents=True, exist_ok=True)
        with _directory_lock(target.parent):
            if unchanged_since is not _ANY_VERSION:
                _refuse_if_changed(target, unchanged_since)
            try:
                keep_mode: int | None = stat.S_IMODE(target.stat().st_mode)
            except FileNotFoundError:
                keep_mode = None
            fd, tmp = _create_beside(target)
            try:
                with os.fdopen(fd, "wb") as f:
                    if keep_mode is not None:
                        os.fchmod(f.fileno(), keep_mode)
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return path

    def file_version(self) -> str:
        """The ``plan_file_version`` of a file this plan was just saved to."""
        return _version(self.to_json().encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file; anything unreadable or malformed raises ``PlanError`` naming the file (and field)."""
        path = Path(path)
        where = f"Plan file {str(path)!r}"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise PlanError(f"{where} does not exist. Check the path, or tune first to write it.") from None
        except IsADirectoryError:
            raise PlanError(f"{where} is a directory. Give the path of a plan JSON file inside it.") from None
        except PermissionError:
            raise PlanError(
                f"{where} cannot be read: permission denied. Make it readable (chmod u+r), or point to a copy."
            ) from None
        except OSError as err:
            raise PlanError(f"{where} cannot be read: {err.strerror or err}. Check the path and the disk.") from None
        try:
            text = raw.decode("utf-8-sig")  # tolerate the byte-order mark some editors add
        except UnicodeDecodeError as err:
            raise PlanError(
                f"{where} is not a UTF-8 text file (byte {raw[err.start]:#04x} at offset {err.start}), so it cannot be "
                "a JSON plan. Check that the path names the plan, not another file; re-tune to write it again."
            ) from None
        if not text.strip():
            raise PlanError(
                f"{where} is empty (a write that never finished, or a placeholder). Delete it and re-tune, or "
                "restore it from version control."
            )
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as err:
            raise PlanError(
                f"{where} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}). "
                "Delete it and re-tune, or restore it from version control."
            ) from None
        except _DuplicateKeyError as err:
            raise PlanError(
                f"{where}: field {err.args[0]!r} appears more than once in one object, so which value counts is "
                "ambiguous. Keep one of them."
            ) from None
        except RecursionError:
            raise PlanError(f"{where} is nested too deeply to be a plan. Delete it and re-tune.") from None
        return cls.from_dict(data, source=where)

    # -- checks against a model ---------------------------------------------------------------------
    def check_fingerprint(self, model: nn.Module) -> None:
        if self.fingerprint is None:
            return
        actual = model_fingerprint(model)
        if actual != self.fingerprint:
            raise StalePlanError(
                f"Plan {self.name or self.digest()!r} was made for a model with fingerprint {self.fingerprint}, "
                f"but this model's fingerprint is {actual} (module tree, parameter shapes or dtypes differ). "
                "Re-tune for this model, or pass check_fingerprint=False if you know the plan still fits."
            )


def plan_file_version(path: str | os.PathLike[str]) -> str | None:
    """A digest of the file's bytes, None when there is no file: what ``Plan.save(unchanged_since=...)`` compares.
    Read it before loading the plan, so a change in between shows up as a change."""
    try:
        return _version(Path(path).read_bytes())
    except FileNotFoundError:
        return None


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the directory itself, so no lock file is left beside the plan. Where there is no
    flock (Windows) or the file system refuses it (some network mounts) the save runs unlocked: the check in
    ``_refuse_if_changed`` still catches any save that is not simultaneous."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse_if_changed(target: Path, expected: str | None) -> None:
    found = plan_file_version(target)
    if found is None or found == expected:
        return
    try:
        current: Plan | None = Plan.load(target)
    except PlanError:
        current = None
    if current is None:
        held = "a file that is not a readable plan"
    else:
        named = f" {current.name!r}" if current.name else ""
        held = f"plan{named} {current.describe()} (digest {current.digest()})"
    raise PlanFileChangedError(
        f"Plan file {str(target)!r} changed since this process last read or wrote it (another run saved to it "
        f"meanwhile): it now holds {held}. Nothing was written, so that plan is kept. Give each run its own plan "
        "file, or load this one again before saving over it.",
        path=str(target), current=current, held=held,
    )  # fmt: skip


def _create_beside(target: Path) -> tuple[int, str]:
    """A new, empty temporary file in ``target``'s directory, created with mode 0o666 so the umask applies."""
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file beside {str(target)!r}: every name tried exists")


# ---------------------------------------------------------------------------------------------------
# Block lists for Plan.describe
# ---------------------------------------------------------------------------------------------------
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


def _compact_fqns(fqns: list[str], drop: int) -> str:
    """The blocks as short module paths, one entry per container: ``h.0-3``, ``encoder.block.0 lm_head``."""
    # Key: (path, is_container), so a planned ``h`` and the planned blocks inside it stay two entries.
    entries: dict[tuple[str, bool], list[int]] = {}
    for fqn in fqns:
        path = fqn.split(".")[drop:] if fqn else []
        if path and _is_index(path[-1]):
            entries.setdefault((".".join(path[:-1]), True), []).append(int(path[-1]))
        else:
            entries[(".".join(path) or "<root>", False)] = []
    return " ".join(
        (f"{name}.{_index_ranges(ix)}" if name else _index_ranges(ix)) if is_container else name
        for (name, is_container), ix in entries.items()
    )


def block_names(fqns: Sequence[str], among: Sequence[str] | None = None) -> str:
    """``fqns`` written as ``describe()`` writes a group of blocks (``h.0-3``), without the prefix that
    every FQN of ``among`` (default: ``fqns``) shares."""
    drop = _shared_prefix_length(list(among if among is not None else fqns))
    return _compact_fqns(sorted(fqns, key=_natural_key), drop)


# ---------------------------------------------------------------------------------------------------
# The schema and how its refusals are worded
# ---------------------------------------------------------------------------------------------------
SCHEMA_FILE = "plan_schema.json"


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    return resources.files("lightning_ckpt.plan").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


def plan_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of plan files, as shipped in ``lightning_ckpt/plan/plan_schema.json``."""
    return json.loads(_schema_text())


@functools.lru_cache(maxsize=1)
def _validator() -> Any:
    # Imported here: jsonschema (and its referencing/rpds stack) is only needed when a plan is read.
    import jsonschema

    schema = plan_schema()
    return jsonschema.Draft202012Validator(schema), schema


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _field_path(path: tuple[Any, ...] | list[Any]) -> str:
    """``blocks['h.0'].children[1]``: FQN keys in brackets (they contain dots), other keys dotted."""
    out = ""
    for i, part in enumerate(path):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i == 1 and path[0] in ("blocks", "segments") or not part.isidentifier():
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _subschema(schema: dict[str, Any], root: dict[str, Any], path: list[Any]) -> dict[str, Any] | None:
    """The schema that describes the value at ``path`` (following properties, additionalProperties, items)."""
    node: Any = schema
    for part in path:
        while isinstance(node, dict) and "$ref" in node:
            node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        if not isinstance(node, dict):
            return None
        if isinstance(part, int):
            node = node.get("items")
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        else:
            node = node.get("additionalProperties")
    while isinstance(node, dict) and "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node if isinstance(node, dict) else None


_TYPE_WORDS = {"object": "an object", "array": "an array", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "null"}  # fmt: skip


def _found(value: Any) -> str:
    kind = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )
    text = json.dumps(value, default=str)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} ({kind})"


def _describe_error(error: Any, root: dict[str, Any]) -> tuple[str, str]:
    """(field path, what is wrong with it) for one jsonschema ValidationError."""
    path = list(error.absolute_path)
    kind, value, instance = error.validator, error.validator_value, error.instance
    if kind == "required":
        missing = [p for p in value if isinstance(instance, dict) and p not in instance]
        path.append(missing[0] if missing else value[0])
        rule = error.schema.get("description", "")
        if rule and "needs" in rule:  # an if/then rule of the schema says why the field is needed
            return _field_path(path), f"missing: {rule}"
        expected = (_subschema(root, root, path) or {}).get("description") or rule
        return _field_path(path), f"missing; expected {expected}" if expected else "missing"
    if kind == "additionalProperties":
        allowed = set(error.schema.get("properties", {}))
        extra = sorted(k for k in instance if k not in allowed)
        field_ = _field_path([*path, extra[0]]) if extra else _field_path(path)
        where = "at the top level" if not path else f"in {_field_path(path)}"
        return field_, (
            f"not a known field {where} (unknown: {', '.join(map(repr, extra))}; known: "
            f"{', '.join(sorted(allowed))}). The file may be corrupted or from another tool"
            + ("; 'compile_memory_budget' needs schema_version 2" if "compile_memory_budget" in extra else "")
        )
    described = _subschema(root, root, path) or {}
    expected = described.get("description", "")
    if kind == "not":
        return _field_path(path), f"not allowed here: {error.schema.get('description', expected)}"
    if kind == "enum":
        title = described.get("title", "value")
        return _field_path(path), f"Unknown {title} {instance!r}. Known: {', '.join(map(str, value))}"
    if kind == "type":
        types = value if isinstance(value, list) else [value]
        wanted = " or ".join(_TYPE_WORDS.get(t, t) for t in types)
        return _field_path(path), f"must be {wanted}, but found {_found(instance)}; expected {expected}"
    if kind == "uniqueItems":
        return _field_path(path), f"names an item more than once: {_found(instance)}; expected {expected}"
    return _field_path(path), f"{error.message}; expected {expected}" if expected else error.message


def _validate(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise PlanError(
            f"{source}: field (top level): must be a JSON object, but found {_found(data)}. "
            "This is not a lightning_ckpt plan: check the path, or re-tune to write one."
        )
    version = data.get("schema_version")
    if version is None:
        raise PlanError(
            f"{source}: field schema_version: missing; this is not a lightning_ckpt plan file. "
            f'Add "schema_version": 1 if you wrote it by hand, or re-tune to write one.'
        )
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise PlanError(
            f"{source}: field schema_version: plan schema version {version!r} is not supported by this lightning_ckpt "
            f"(it reads schema versions 1..{SCHEMA_VERSION}). Upgrade lightning-ckpt, or re-tune to write a plan "
            "in the current schema."
        )
    validator, root = _validator()
    errors = list(validator.iter_errors(data))
    if errors:
        import jsonschema

        field_, problem = _describe_error(jsonschema.exceptions.best_match(errors), root)
        more = (
            f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in this plan)" if len(errors) > 1 else ""
        )
        raise PlanError(
            f"{source}: field {field_}: {problem}.{more} Fix the field (the format is lightning_ckpt/plan/{SCHEMA_FILE}), "
            "or delete the file and re-tune."
        )
    micro = data.get("metadata", {}).get("micro_batch")
    if micro is not None and micro["size"] * micro["accumulation"] != micro["global"]:
        raise PlanError(
            f"{source}: field metadata.micro_batch: size {micro['size']} x accumulation {micro['accumulation']} "
            f"must equal the global batch {micro['global']}, but does not. Fix one of the three numbers, or re-tune."
        )


def closest_names(name: str, candidates: list[str], n: int = 3) -> str:
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.4)
    return ", ".join(repr(c) for c in (close or candidates[:n]))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"Plan metadata value of type {type(obj).__name__} is not JSON serialisable: {obj!r}")


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the module tree (FQN, class) and parameter/buffer names, shapes and dtypes.

    Devices are deliberately excluded (a plan tuned on one GPU applies to the same model on another),
    and compile wrappers are seen through so compiled and eager models share a fingerprint.
    """
    from lightning_ckpt.discovery import canonical_fqn, is_compile_wrapper, unwrap_compiled

    root = unwrap_compiled(model)
    h = hashlib.sha256()
    for fqn, mod in root.named_modules():
        if not is_compile_wrapper(mod):  # a nested torch.compile(submodule) adds a wrapper and "_orig_mod"
            h.update(f"M {canonical_fqn(fqn)} {_class_name(mod)}\n".encode())
    for fqn, p in root.named_parameters():
        h.update(f"P {canonical_fqn(fqn)} {tuple(p.shape)} {p.dtype}\n".encode())
    for fqn, b in root.named_buffers():
        h.update(f"B {canonical_fqn(fqn)} {tuple(b.shape)} {b.dtype}\n".encode())
    return h.hexdigest()[:16]


def _class_name(module: nn.Module) -> str:
    """The module's class name, seen through FSDP2: ``fully_shard`` swaps a module's class for a generated
    ``FSDP<Name>`` subclass, which must not make a plan tuned before sharding stale after it."""
    cls = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return cls.__name__
    if isinstance(module, FSDPModule):
        for base in cls.__mro__[1:]:
            if issubclass(base, nn.Module) and not issubclass(base, FSDPModule):
                return base.__name__
    return cls.__name__


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("lightning-ckpt", "torch", "lightning", "optuna"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out
