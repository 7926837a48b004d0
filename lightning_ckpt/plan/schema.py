"""The plan file's JSON Schema (``plan_schema.json``), and refusals that name the field and what would fit."""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from typing import Any

from lightning_ckpt.errors import PlanError

__all__ = [
    "MAX_INT_DIGITS",
    "SCHEMA_VERSION",
    "Unreadable",
    "field_path",
    "plan_schema",
    "refuse_unreadable",
    "validate",
]

# Version 2 added ``compile_memory_budget``; a plan is written with the lowest version that can hold it.
SCHEMA_VERSION = 2
SCHEMA_FILE = "plan_schema.json"


# JSON Schema cannot say "finite" (NaN passes every bound): ``file.read_json`` parses NaN, Infinity and endless
# integers into ``Unreadable``, and ``refuse_unreadable`` names their field.
MAX_INT_DIGITS = 20  # every count, byte figure and seed a plan keeps fits (2**64 has 20 digits)
MAX_PLAN_DEPTH = 32  # a real plan file nests 11 levels (a plan table's bucket profile); more is not a plan


class Unreadable:
    """A JSON value no plan holds (NaN, Infinity, an integer too long), kept as written until its field is named."""

    __slots__ = ("digits", "text")

    def __init__(self, text: str, digits: int | None = None) -> None:
        self.text = text
        stripped = text.lstrip("-")
        self.digits = digits if digits is not None else len(stripped) if stripped.isdigit() else None

    def describe(self) -> str:
        if self.digits is not None:
            return f"an integer of {self.digits} digits ({self.text[:12]}...)"
        return self.text if len(self.text) <= 40 else f"{self.text[:20]}... ({len(self.text)} characters)"


def _unreadable(value: Any) -> Unreadable | None:
    if isinstance(value, Unreadable):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return Unreadable(repr(value))
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**MAX_INT_DIGITS:
        # str() refuses integers past 4,300 digits: the count from the bit length (exact below that).
        digits = len(str(abs(value))) if value.bit_length() < 14_000 else int(value.bit_length() * math.log10(2)) + 1
        return Unreadable(hex(value)[:12] if digits > 4300 else str(value), digits)
    return None


def refuse_unreadable(data: Any, source: str) -> None:
    """``PlanError`` naming the first field holding an ``Unreadable`` or nesting deeper than ``MAX_PLAN_DEPTH``. A
    stack, not recursion: the data may nest as deeply as the parser allowed."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        bad = _unreadable(value)
        if bad is not None:
            raise PlanError(
                f"{source}: field {field_path(path)}: holds {bad.describe()}, which no plan holds (numbers in a plan "
                f"are finite, and integers have at most {MAX_INT_DIGITS} digits). The file was corrupted or edited by "
                "hand: fix the field, or delete the file and re-tune."
            )
        if isinstance(value, (dict, list)) and len(path) >= MAX_PLAN_DEPTH:
            raise PlanError(
                f"{source}: field {field_path(path[:4])}...: nested more than {MAX_PLAN_DEPTH} levels deep, deeper than "
                "any plan. The file was corrupted or edited by hand: delete it and re-tune."
            )
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend(((*path, key), item) for key, item in reversed(list(items)))


def plan_schema() -> dict[str, Any]:
    return json.loads(resources.files("lightning_ckpt.plan").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1)
def _validator() -> Any:
    # Imported here: jsonschema (and its referencing/rpds stack) is only needed when a plan is read.
    import jsonschema

    schema = plan_schema()
    return jsonschema.Draft202012Validator(schema), schema


def field_path(path: tuple[Any, ...] | list[Any]) -> str:
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


def _subschema(root: dict[str, Any], path: list[Any]) -> dict[str, Any] | None:
    """The schema that describes the value at ``path`` (following properties, additionalProperties, items)."""
    node: Any = root
    for part in [*path, None]:
        while isinstance(node, dict) and "$ref" in node:
            node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        if not isinstance(node, dict) or part is None:
            break
        if isinstance(part, int):
            node = node.get("items")
        else:
            node = node.get("properties", {}).get(part, node.get("additionalProperties"))
    return node if isinstance(node, dict) else None


_TYPE_WORDS = {"object": "an object", "array": "an array", "string": "a string", "integer": "an integer"}
_TYPE_WORDS |= {"number": "a number", "boolean": "true or false", "null": "null"}


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
            return field_path(path), f"missing: {rule}"
        expected = (_subschema(root, path) or {}).get("description") or rule
        return field_path(path), f"missing; expected {expected}" if expected else "missing"
    if kind == "additionalProperties":
        allowed = set(error.schema.get("properties", {}))
        extra = sorted(k for k in instance if k not in allowed)
        field_ = field_path([*path, extra[0]]) if extra else field_path(path)
        where = "at the top level" if not path else f"in {field_path(path)}"
        return field_, (
            f"not a known field {where} (unknown: {', '.join(map(repr, extra))}; known: "
            f"{', '.join(sorted(allowed))}). The file may be corrupted or from another tool"
            + ("; 'compile_memory_budget' needs schema_version 2" if "compile_memory_budget" in extra else "")
        )
    described = _subschema(root, path) or {}
    expected = described.get("description", "")
    if kind == "not":
        return field_path(path), f"not allowed here: {error.schema.get('description', expected)}"
    if kind == "enum":
        title = described.get("title", "value")
        return field_path(path), f"Unknown {title} {_cut(repr(instance))}. Known: {', '.join(map(str, value))}"
    if kind == "type":
        types = value if isinstance(value, list) else [value]
        wanted = " or ".join(_TYPE_WORDS.get(t, t) for t in types)
        return field_path(path), f"must be {wanted}, but found {_found(instance)}; expected {expected}"
    if kind == "uniqueItems":
        return field_path(path), f"names an item more than once: {_found(instance)}; expected {expected}"
    if kind in _BOUNDS:
        problem = f"must {_BOUNDS[kind].format(value)}, but found {_found(instance)}"
        return field_path(path), f"{problem}; expected {expected}" if expected else problem
    # jsonschema's own message quotes the whole value, which may be megabytes long.
    message = _cut(error.message)
    return field_path(path), f"{message}; expected {expected}" if expected else message


_BOUNDS = {
    "minimum": "be at least {}",
    "maximum": "be at most {}",
    "exclusiveMinimum": "be more than {}",
    "exclusiveMaximum": "be less than {}",
    "minItems": "have at least {} items",
    "maxItems": "have at most {} items",
    "minLength": "be at least {} characters long",
}


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def validate(data: Any, source: str) -> None:
    """Refuse ``data`` unless this release reads it as a plan: one ``PlanError`` naming ``source``, the field, what was
    found and what is expected."""
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
    refuse_unreadable(data, source)
    validator, root = _validator()
    errors = list(validator.iter_errors(data))
    if errors:
        import jsonschema

        field_, problem = _describe_error(jsonschema.exceptions.best_match(errors), root)
        extra = len(errors) - 1
        more = f" ({extra} more problem{'s' if extra > 1 else ''} in this plan)" if extra else ""
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
