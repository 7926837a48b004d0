"""What differs between the model a plan was tuned for and this one, in words a user can act on: two fingerprints
say *that* the model changed, the plan file's profile says *how*. Torch-free: it compares ``LayerStack.to_dict``s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["describe_model_change", "model_changes"]

MAX_LISTED = 3


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
    more = len(changes) - MAX_LISTED
    listed = "; ".join(changes[:MAX_LISTED])
    return listed + (f"; and {more} more" if more > 0 else "")
