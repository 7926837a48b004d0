"""``lightning-ckpt diff``: what changed between two plan files, as text or as one JSON object.

Only checkpointing, fingerprint and budget make two plans differ (the ``--exit-code`` answer); the run, library versions
and measured figures change with every re-tune and are shown, never counted."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from lightning_ckpt.cli.metadata import (
    JSON_FORMAT,
    budget_key,
    budget_value_text,
    budget_values,
    bytes_text,
    kv_text,
    rate_text,
)
from lightning_ckpt.cli.usage import EXIT_DIFFERENT, EXIT_OK, load_plan
from lightning_ckpt.formatting import table
from lightning_ckpt.plan.format import BlockPlan, Plan

__all__ = ["DIFF_JSON_HELP", "compare_plans", "format_diff", "run_diff"]


def _change(in_a: bool, in_b: bool) -> str:
    return "changed" if in_a and in_b else "added" if in_b else "removed"


def _figures(plan: Plan) -> dict[str, str]:
    """The figures ``diff`` prints for ``plan``: measured while tuning, else a re-planned plan's predictions, marked."""
    measured = plan.provenance.measured
    figures, key, mark = (measured, "", "") if measured else (plan.provenance.replanned, "predicted_", " predicted")
    if not figures:
        return {}
    texts = {
        "samples/s": rate_text(figures.get(f"{key}samples_per_second")),
        "peak": bytes_text(figures.get(f"{key}peak_bytes")),
        "activation": bytes_text(figures.get(f"{key}activation_bytes")),
    }
    return {name: text + mark if text != "-" else text for name, text in texts.items()}


def compare_plans(a: Plan, b: Plan, *, a_name: str = "a", b_name: str = "b") -> dict[str, Any]:
    """What differs between two plans, as data: the object ``diff --json`` prints, which ``format_diff`` renders."""
    changes: list[dict[str, Any]] = []
    for fqn in sorted(set(a.blocks) | set(b.blocks)):
        before, after = a.mode_of(fqn).to_dict(), b.mode_of(fqn).to_dict()
        if before != after:
            change = _change(fqn in a.blocks, fqn in b.blocks)
            changes.append({"change": change, "what": "block", "name": fqn, "a": before, "b": after})
    for fqn in sorted(set(a.segments) | set(b.segments)):
        before, after = a.segments.get(fqn), b.segments.get(fqn)
        if before != after:
            change = _change(before is not None, after is not None)
            changes.append({"change": change, "what": "segments", "name": fqn, "a": before, "b": after})
    pt2_a, pt2_b = a.compile_memory_budget, b.compile_memory_budget
    if pt2_a != pt2_b:  # a setting, not something checkpointed: always "changed" (None is PT2's default)
        changes.append({"change": "changed", "what": "compile_memory_budget", "name": None, "a": pt2_a, "b": pt2_b})

    budget_a, budget_b = budget_values(a.provenance.budget), budget_values(b.provenance.budget)
    same = {
        "checkpointing": not changes,
        "fingerprint": a.fingerprint == b.fingerprint,
        "budget": budget_key(budget_a) == budget_key(budget_b),
    }
    differ_in = [what for what, is_same in same.items() if not is_same]

    def side(key: str) -> dict[str, Any]:
        before, after = dict(getattr(a.provenance, key)), dict(getattr(b.provenance, key))
        return {"same": before == after, "a": before or None, "b": after or None}

    return {
        "json_format": JSON_FORMAT,
        "a": {"file": a_name, "description": a.describe(), "digest": a.digest()},
        "b": {"file": b_name, "description": b.describe(), "digest": b.digest()},
        "differ": bool(differ_in),
        "differ_in": differ_in,
        "checkpointing": changes,
        "fingerprint": {"same": same["fingerprint"], "a": a.fingerprint, "b": b.fingerprint},
        "budget": {"same": same["budget"], "a": budget_a, "b": budget_b},
        "run": side("run"),
        "versions": side("versions"),
        "measured": {
            side: {k: p.provenance.measured.get(k) for k in ("samples_per_second", "peak_bytes", "activation_bytes")}
            for side, p in (("a", a), ("b", b))
        },
    }


DIFF_JSON_HELP = """\
--json prints one JSON object and nothing else (keys are stable; json_format changes if a key changes meaning):
  json_format        1
  a, b               {file, description, digest}
  differ, differ_in  whether the plans differ (the --exit-code answer) and in which of "checkpointing",
                     "fingerprint", "budget"; run, versions and measured figures do not count
  checkpointing      [{change: added|removed|changed, what: block|segments|compile_memory_budget, name, a, b}]
                     (a block's side is its mode, e.g. {"mode": "selective", "children": ["mlp"]})
  fingerprint        {same, a, b}
  budget             {same, a, b}, each side {kind, limit_bytes, fraction, requested, description} or null;
                     compared by value (kind, limit_bytes, fraction), never by text
  run, versions      {same, a, b}: the recorded metadata sections
  measured           {a, b}: {samples_per_second, peak_bytes, activation_bytes} measured while tuning
"""


def _change_row(change: Mapping[str, Any]) -> list[str]:
    """One ``compare_plans`` change as ``diff`` prints it: sign, what changed, a's side -> b's."""
    what, name = change["what"], change["name"]
    if what == "block":
        label, text = name, lambda v: BlockPlan(v["mode"], tuple(v.get("children", ())), v.get("save_list")).describe()
    elif what == "segments":
        label, text = f"{name or '<root>'} (segments)", lambda v: f"{v} chunks" if v else "none"
    else:
        label, text = "torch.compile activation_memory_budget", str
    sign = {"added": "+", "removed": "-", "changed": "~"}[change["change"]]
    return [sign, label, text(change["a"]), "->", text(change["b"])]


def format_diff(a: Plan, b: Plan, *, a_name: str = "a", b_name: str = "b") -> str:
    """What ``lightning-ckpt diff`` prints: blocks and segments that changed, then identity and evidence."""
    comparison = compare_plans(a, b, a_name=a_name, b_name=b_name)
    lines = [f"a: {a_name}  [{a.describe()}]", f"b: {b_name}  [{b.describe()}]", ""]
    rows = [_change_row(c) for c in comparison["checkpointing"]]
    if rows:
        lines.append(table(["", "block", "a", "", "b"], rows))
        lines.append("(+ checkpointed only in b, - only in a, ~ checkpointed differently)")
    else:
        lines.append("same checkpointing: every block and segment has the same mode in both plans")
    lines.append("")

    def pair(name: str, before: str, after: str, same: bool, note: str = "") -> None:
        lines.append(f"{name:<12} " + (f"same ({before})" if same else f"{before} -> {after}{note}"))

    recorded = (a.fingerprint or "not recorded", b.fingerprint or "not recorded", a.fingerprint == b.fingerprint)
    pair("fingerprint", *recorded, ": tuned for different models" if a.fingerprint and b.fingerprint else "")
    budget = comparison["budget"]
    if budget["a"] or budget["b"]:
        pair("budget", budget_value_text(budget["a"]), budget_value_text(budget["b"]), budget["same"])
    for key in ("run", "versions"):
        if getattr(a.provenance, key) or getattr(b.provenance, key):
            before, after = kv_text(getattr(a.provenance, key)), kv_text(getattr(b.provenance, key))
            pair(key, before, after, before == after)
    fa, fb = _figures(a), _figures(b)
    if fa or fb:
        fa, fb = (f or dict.fromkeys(("samples/s", "peak", "activation"), "-") for f in (fa, fb))
        lines.append(
            f"measured     samples/s {fa['samples/s']} -> {fb['samples/s']}, peak {fa['peak']} -> {fb['peak']}, "
            f"activation {fa['activation']} -> {fb['activation']}"
        )
        if any("predicted" in text for text in (*fa.values(), *fb.values())):
            lines.append("             (predicted: a re-planned plan's figures, from the profile; it ran no trial)")
    lines.append("")
    if comparison["differ"]:
        lines.append(f"the plans differ in: {', '.join(comparison['differ_in'])}")
    else:
        lines.append("the plans are the same: checkpointing, fingerprint and budget (run and figures aside)")
    return "\n".join(lines)


def run_diff(args: argparse.Namespace) -> int:
    a, b = load_plan(args.a), load_plan(args.b)
    comparison = compare_plans(a, b, a_name=args.a, b_name=args.b)
    if args.json:
        print(json.dumps(comparison, indent=2, default=str))
    else:
        print(format_diff(a, b, a_name=args.a, b_name=args.b))
    return EXIT_DIFFERENT if args.exit_code and comparison["differ"] else EXIT_OK
