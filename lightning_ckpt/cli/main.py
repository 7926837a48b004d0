"""The ``lightning-ckpt`` command: read, compare and check plan files from the shell.

    lightning-ckpt show plans/gpt.json                    the plan, the run it was tuned for, the evidence
    lightning-ckpt diff plans/old.json plans/new.json     what changed between two plans
    lightning-ckpt validate plans/gpt.json --model mypkg.models:build_model
                                                          does the plan fit this model? (for CI)
    lightning-ckpt bench --layers 8                       the seed trade-off table (benchmarks/seed_table.py)

Exit codes: 0 success; 1 a plan or model was refused (the message says why); 2 bad usage (an unknown
option, a file that does not exist, a --model that cannot be imported or that calls sys.exit()).
`diff` follows diff(1) and `git diff`: 0, or with --exit-code 0 same / 1 different; 2 on any error,
a plan file that does not load included (so 1 only ever means "the plans differ").
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import runpy
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_ckpt import __version__
from lightning_ckpt.budget import RequestedBudget, format_bytes
from lightning_ckpt.errors import LightningCkptError
from lightning_ckpt.plan.format import BlockPlan, Plan, closest_names, library_versions, model_fingerprint
from lightning_ckpt.search.records import TrialStatus

__all__ = ["build_parser", "main"]

# Where ``show`` looks for the memory model's per-block breakdown (``MemoryModel.to_dict()``, the same
# data as ``TuneResult.memory_breakdown``). Plans written without it simply show no memory columns.
MEMORY_BREAKDOWN_KEY = "memory_breakdown"
# Where ``show`` looks, inside ``metadata["search"]``, for how many trials ended in each ``TrialStatus``
# ({"ok": 3, "pruned": 11, ...}) and how many were re-timed side by side. Plans written without them
# show only the total, with what it includes.
STATUS_COUNTS_KEY, CONFIRMED_KEY = "status_counts", "confirmed"
# The version of the ``show --json`` / ``diff --json`` objects: bumped when a key changes meaning or goes.
JSON_FORMAT = 1

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2
EXIT_DIFFERENT = 1  # diff --exit-code, as diff(1) and `git diff --exit-code`


class UsageError(Exception):
    """The command line names something that is not there (exit code 2, like argparse's own errors)."""


# -------------------------------------------------------------------------------------------------
# Small formatting helpers. Plan metadata is free-form JSON, so every reader tolerates absent keys.
# -------------------------------------------------------------------------------------------------
def _section(metadata: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = metadata.get(key)
    return value if isinstance(value, Mapping) else {}


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[int] = (), indent: str = ""
) -> str:
    """Aligned columns; ``right`` lists the columns of numbers, right-aligned so digits line up."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def _rate(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "-"


def _bytes(x: Any) -> str:
    return format_bytes(x) if isinstance(x, (int, float)) else "-"


def _ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return f"{a / b:.2f}x" if ok else "-"


def _kv(mapping: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in mapping.items() if v is not None) or "-"


def _budget_text(budget: Mapping[str, Any]) -> str:
    if not budget:
        return "-"
    text = str(budget.get("description") or budget.get("kind") or "-")
    if budget.get("requested") is not None:
        text += f" (requested max_memory={budget['requested']!r})"
    return text


def _number(x: Any) -> int | float | None:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _requested_value(requested: Any) -> Any:
    """The user's max_memory as a value: "20GiB" and 21474836480 are the same request; 0.8 stays a fraction.
    Parsed as the callback parses it when it decides whether a plan may be reused (``RequestedBudget``)."""
    try:
        return RequestedBudget.parse(requested).value
    except LightningCkptError:
        return requested  # not a size: compared as written


def budget_values(budget: Mapping[str, Any]) -> dict[str, Any] | None:
    """``metadata["budget"]`` (``Budget.to_dict()``, plus the callback's ``requested``) with fixed keys."""
    if not budget:
        return None
    return {
        "kind": budget.get("kind"),
        "limit_bytes": _number(budget.get("limit_bytes")),
        "fraction": _number(budget.get("fraction")),
        "requested": _requested_value(budget.get("requested")),
        "description": budget.get("description"),
    }


def _budget_key(values: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    """What two budgets are compared by: their values, never their text. Only a budget recorded without a limit
    (hand-written) falls back to the request, then to the description."""
    if values is None:
        return None
    if values["limit_bytes"] is not None or values["kind"] == "none":
        fallback = None
    else:
        fallback = values["requested"] if values["requested"] is not None else values["description"]
    return values["kind"], values["limit_bytes"], values["fraction"], fallback


def _budget_value_text(values: Mapping[str, Any] | None) -> str:
    if values is None:
        return "-"
    kind = values["kind"] or "?"
    if kind == "none":
        return "none (no limit)"
    if values["limit_bytes"] is None:
        requested = values["requested"]
        if isinstance(requested, float) and requested <= 1:
            return f"{kind} (requested {requested:.0%} of device memory)"
        if isinstance(requested, int):
            return f"{kind} (requested {format_bytes(requested)})"
        return f"{kind} ({requested or values['description'] or 'no limit recorded'})"
    of = "of no-checkpointing activation memory" if kind == "activation" else "of device memory"
    share = f" ({values['fraction']:.0%} {of})" if values["fraction"] is not None else ""
    return f"{kind} <= {format_bytes(values['limit_bytes'])}{share}"


def _versions_text(versions: Mapping[str, Any]) -> str:
    """Library versions the plan was tuned with, flagging the ones that differ from what is installed."""
    installed = library_versions()
    parts = []
    for dist, version in versions.items():
        now = installed.get(dist)
        parts.append(f"{dist} {version}" + (f" (installed: {now})" if now is not None and now != version else ""))
    return ", ".join(parts) or "-"


def _pt2_budget(plan: Plan) -> float | None:
    # Plans from schema 2 on may carry PT2's activation_memory_budget for compiled models.
    return getattr(plan, "compile_memory_budget", None)


def _load_plan(path: str) -> Plan:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"plan file {path!r} does not exist. Check the path (tuning writes it to plan_path=...).")
    if p.is_dir():
        raise UsageError(f"{path!r} is a directory; give the path of a plan JSON file inside it.")
    return Plan.load(p)  # a binary, empty or malformed file is a PlanError naming the file and the field


# -------------------------------------------------------------------------------------------------
# show
# -------------------------------------------------------------------------------------------------
def _block_memory(plan: Plan) -> tuple[dict[str, int], dict[str, int]] | None:
    """Per block: predicted bytes kept for backward under this plan, and without checkpointing."""
    data = plan.metadata.get(MEMORY_BREAKDOWN_KEY)
    if not isinstance(data, Mapping):
        return None
    from lightning_ckpt.memory.model import MemoryModel

    try:
        model = MemoryModel.from_dict(data)
        return model.saved_bytes(plan), model.saved_bytes(Plan())
    except Exception:  # a breakdown from another version of the memory model: show the plan without it
        return None


# What a status means, for people; the measured ones in the order ``show`` lists them.
_STATUS_WORDS = {
    TrialStatus.OK: "within budget",
    TrialStatus.OVER_BUDGET: "over budget",
    TrialStatus.CONFLICT: "fought torch.compile",
    TrialStatus.OOM: "out of memory",
    TrialStatus.INVALID: "could not run on this model",
    TrialStatus.ERROR: "failed with an error",
}


def trial_counts(search: Mapping[str, Any]) -> dict[str, Any]:
    """How many candidate plans the search considered, and what became of them (``None``: not recorded).

    ``considered`` is every trial record: baselines, plans measured and plans pruned (rejected by the memory
    model without running). ``n_trials`` caps the measured ones only; pruned plans are free.
    """
    raw = search.get(STATUS_COUNTS_KEY)
    by_status = (
        {str(k): v for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)}
        if isinstance(raw, Mapping)
        else None
    )

    def count(*statuses: TrialStatus) -> int | None:
        return None if by_status is None else sum(by_status.get(s.value, 0) for s in statuses)

    exhaustive = search.get("exhaustive")
    return {
        "considered": _number(search.get("trials_run")),
        "space_size": _number(search.get("space_size")),
        "n_trials": _number(search.get("n_trials")),
        "exhaustive": exhaustive if isinstance(exhaustive, bool) else None,
        "measured": count(*(s for s in TrialStatus if s != TrialStatus.PRUNED)),
        "pruned": count(TrialStatus.PRUNED),
        "within_budget": count(TrialStatus.OK),
        "over_budget": count(TrialStatus.OVER_BUDGET),
        "failed": count(*(s for s in TrialStatus if s.failed)),
        "conflict": count(TrialStatus.CONFLICT),
        "confirmed": _number(search.get(CONFIRMED_KEY)),
        "by_status": by_status,
    }


def _search_lines(search: Mapping[str, Any]) -> list[str]:
    """The search in words: what the totals include and what became of the plans, as far as the file says."""
    counts, pad = trial_counts(search), " " * 13
    settings = [str(search["sampler"])] if search.get("sampler") else []
    if search.get("seed") is not None:
        settings.append(f"seed {search['seed']}")
    how = f" ({', '.join(settings)})" if settings else ""
    considered, space = counts["considered"], counts["space_size"]
    if counts["exhaustive"] and space is not None:
        head = f"all {space} candidate plans in the search space were considered{how}"
    elif space is not None:
        head = f"{_or_unknown(considered)} of the {space} candidate plans in the search space were considered{how}"
    else:
        head = f"{_or_unknown(considered)} candidate plans were considered{how}"
    cap = f"n_trials={counts['n_trials']}" if counts["n_trials"] is not None else "n_trials"
    if counts["by_status"] is None:
        return [
            f"  search     {head}",
            f"{pad}they include the baselines and the plans the memory model rejected without running (pruned);",
            f"{pad}{cap} caps only the plans measured. This file does not record how many of each there were.",
        ]
    by_status = counts["by_status"]
    outcomes = ", ".join(f"{n} {_STATUS_WORDS[s]}" for s in _STATUS_WORDS if (n := by_status.get(s.value, 0)))
    lines = [
        f"  search     {head}",
        f"{pad}{counts['measured']} measured (run for real)" + (f": {outcomes}" if outcomes else ""),
        f"{pad}{counts['pruned']} rejected by the memory model without running (pruned)",
    ]
    if counts["confirmed"]:
        lines.append(f"{pad}{counts['confirmed']} of the measured re-timed side by side to confirm the choice")
    lines.append(f"{pad}{cap} caps the plans measured; pruned plans do not count towards it")
    return lines


def _or_unknown(x: Any) -> str:
    return "?" if x is None else str(x)


def format_plan(plan: Plan, *, source: str = "") -> str:
    """The text ``lightning-ckpt show`` prints: identity, the run it was tuned for, blocks, evidence."""
    md = plan.metadata
    lines = [
        f"file         {source or '-'}",
        f"name         {plan.name or '(unnamed)'}  [{plan.describe()}]  digest {plan.digest()}",
        f"fingerprint  {plan.fingerprint or '(not recorded: applies to any model with these block names)'}",
    ]
    if _pt2_budget(plan) is not None:
        lines.append(f"compile      torch.compile activation_memory_budget={_pt2_budget(plan):g}")
    run, budget, versions, search = (_section(md, k) for k in ("run", "budget", "versions", "search"))
    if run or budget or versions or search:
        lines += ["", "tuned for"]
        lines.append(f"  run        {_kv(run)}")
        lines.append(f"  budget     {_budget_text(budget)}")
        lines.append(f"  versions   {_versions_text(versions)}")
        if search:
            lines += _search_lines(search)
        if search.get("fell_back"):
            lines.append("  WARNING    no plan fit the budget; this is the lowest-memory plan measured")

    memory = _block_memory(plan)
    lines.append("")
    if memory is None:
        if plan.blocks:
            rows = [[fqn, bp.describe()] for fqn, bp in plan.blocks.items()]
            lines += [_table(["block", "mode"], rows), "(blocks not listed are not checkpointed)"]
        elif not plan.segments:
            lines.append("no block is checkpointed (the no-checkpointing plan)")
    else:
        saved, unplanned = memory
        rows = [[fqn, plan.mode_of(fqn).describe(), _bytes(saved[fqn]), _bytes(unplanned.get(fqn))] for fqn in saved]
        lines.append(_table(["block", "mode", "kept for backward", "without ckpt"], rows, right=(2, 3)))
        lines.append("(memory: the memory model's prediction for the tuning batch)")
    if plan.segments:
        lines += [
            "",
            _table(["stack", "segments"], [[fqn or "<root>", f"{n} chunks"] for fqn, n in plan.segments.items()]),
        ]

    measured, baselines = _section(md, "measured"), _section(md, "baselines")
    if measured or baselines:
        lines += ["", "throughput and memory, measured on the first batch while tuning"]
        win = measured.get("samples_per_second")
        rows = []
        if measured:
            rows.append([
                f"* {measured.get('label') or plan.describe()}", str(measured.get("status", "-")),
                _rate(win), "1.00x" if isinstance(win, (int, float)) else "-",
                _bytes(measured.get("peak_bytes")), _bytes(measured.get("activation_bytes")),
                _bytes(measured.get("predicted_peak_bytes")),
            ])  # fmt: skip
        for name, b in baselines.items():
            b = b if isinstance(b, Mapping) else {}
            rows.append([
                f"  baseline:{name}", str(b.get("status", "-")), _rate(b.get("samples_per_second")),
                _ratio(win, b.get("samples_per_second")), _bytes(b.get("peak_bytes")),
                _bytes(b.get("activation_bytes")), "",
            ])  # fmt: skip
        headers = ["plan", "status", "samples/s", "speed-up", "peak", "activation", "predicted peak"]
        lines.append(_table(headers, rows, right=(2, 3, 4, 5, 6), indent="  "))
        lines.append("  (*) the winner; speed-up: the winner's samples/s over that plan's")
        if isinstance(measured.get("recompute_overhead"), (int, float)):
            lines.append(f"  the winner's recompute costs {measured['recompute_overhead']:+.1%} FLOPs per step")

    known = {"run", "budget", "versions", "search", "measured", "baselines", MEMORY_BREAKDOWN_KEY}
    other = {k: v for k, v in md.items() if k not in known}
    if other:
        lines += ["", "other metadata"]
        lines += [f"  {k}: {json.dumps(v, default=str)[:200]}" for k, v in other.items()]
    return "\n".join(lines)


_WINNER_FIGURES = (
    "label", "status", "samples_per_second", "peak_bytes", "activation_bytes", "predicted_peak_bytes",
    "recompute_overhead",
)  # fmt: skip


def plan_summary(plan: Plan, *, source: str = "") -> dict[str, Any]:
    """The object ``lightning-ckpt show --json`` prints: the plan's own dict under ``plan``, beside fields derived
    from it with fixed keys (``None`` where the file does not record them). The keys are listed in SHOW_JSON_HELP."""
    md = plan.metadata
    by_mode: dict[str, list[str]] = {}
    for fqn, bp in plan.blocks.items():
        by_mode.setdefault(bp.describe(), []).append(fqn)
    measured, baselines, search = (_section(md, k) for k in ("measured", "baselines", "search"))
    win = measured.get("samples_per_second")
    winner = None
    if measured:
        winner = {k: measured.get(k) for k in _WINNER_FIGURES}
        winner["speedup_over_baselines"] = {
            name: win / b["samples_per_second"]
            for name, b in baselines.items()
            if isinstance(b, Mapping) and _number(win) and _number(b.get("samples_per_second"))
        }
    memory = _block_memory(plan)
    block_memory = None
    if memory is not None:
        kept, unplanned = memory
        block_memory = {fqn: {"kept_for_backward": n, "without_ckpt": unplanned.get(fqn)} for fqn, n in kept.items()}
    return {
        "json_format": JSON_FORMAT,
        "file": source or None,
        "name": plan.name,
        "description": plan.describe(),
        "digest": plan.digest(),
        "fingerprint": plan.fingerprint,
        "blocks_by_mode": by_mode,
        "segments": dict(plan.segments),
        "compile_memory_budget": _pt2_budget(plan),
        "budget": budget_values(_section(md, "budget")),
        "winner": winner,
        "baselines": {name: dict(b) for name, b in baselines.items() if isinstance(b, Mapping)},
        "trials": trial_counts(search) if search else None,
        "fell_back": search.get("fell_back") if search else None,
        "predicted_block_memory": block_memory,
        "plan": plan.to_dict(),
    }


SHOW_JSON_HELP = """\
--json prints one JSON object and nothing else (keys are stable; a value is null where the plan file does
not record it; json_format changes if a key changes meaning):
  json_format             1
  file, name, description, digest, fingerprint
                          the file as given; the plan's name, one-line description, digest and fingerprint
  blocks_by_mode          {"full": [block, ...], "selective(mlp)": [...], ...}; unlisted blocks: not checkpointed
  segments                {stack: chunk count}
  compile_memory_budget   torch.compile activation_memory_budget, or null
  budget                  {kind, limit_bytes, fraction, requested, description}: what the plan was tuned for
  winner                  the chosen plan's figures measured while tuning: {label, status, samples_per_second,
                          peak_bytes, activation_bytes, predicted_peak_bytes, recompute_overhead,
                          speedup_over_baselines: {baseline: ratio}}
  baselines               {name: {status, samples_per_second, peak_bytes, activation_bytes}}
  trials                  {considered (baselines + measured + pruned), space_size, n_trials (caps measured only),
                          exhaustive, measured, pruned (rejected by the memory model without running),
                          within_budget, over_budget, failed, conflict, confirmed, by_status: {status: count}}
  fell_back               true when no plan fit the budget and the lowest-memory plan was kept
  predicted_block_memory  {block: {kept_for_backward, without_ckpt}} bytes, from the memory model
  plan                    the plan file's own content (Plan.to_dict()), metadata included
"""


def _show(args: argparse.Namespace) -> int:
    plan = _load_plan(args.plan)
    if args.json:
        print(json.dumps(plan_summary(plan, source=args.plan), indent=2, default=str))
    else:
        print(format_plan(plan, source=args.plan))
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# diff
# -------------------------------------------------------------------------------------------------
def _change(in_a: bool, in_b: bool) -> str:
    return "changed" if in_a and in_b else "added" if in_b else "removed"


def _measured_figures(plan: Plan) -> dict[str, Any]:
    measured = _section(plan.metadata, "measured")
    return {k: measured.get(k) for k in ("samples_per_second", "peak_bytes", "activation_bytes")}


def compare_plans(a: Plan, b: Plan, *, a_name: str = "a", b_name: str = "b") -> dict[str, Any]:
    """What differs between two plans, as data: the object ``diff --json`` prints, which ``format_diff`` renders.

    ``differ`` (what ``diff --exit-code`` answers) is true when the plans checkpoint differently, were tuned for
    different models (fingerprint) or for different budgets, compared by value: "20GiB" and 21474836480 are the
    same budget. The run, library versions and measured figures are reported but do not count: they change with
    every re-tune even when the plan does not.
    """
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
    pt2_a, pt2_b = _pt2_budget(a), _pt2_budget(b)
    if pt2_a != pt2_b:  # a setting, not something checkpointed: always "changed" (None is PT2's default)
        changes.append({"change": "changed", "what": "compile_memory_budget", "name": None, "a": pt2_a, "b": pt2_b})

    budget_a, budget_b = budget_values(_section(a.metadata, "budget")), budget_values(_section(b.metadata, "budget"))
    same = {
        "checkpointing": not changes,
        "fingerprint": a.fingerprint == b.fingerprint,
        "budget": _budget_key(budget_a) == _budget_key(budget_b),
    }
    differ_in = [what for what, is_same in same.items() if not is_same]

    def side(key: str) -> dict[str, Any]:
        before, after = dict(_section(a.metadata, key)), dict(_section(b.metadata, key))
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
        "measured": {"a": _measured_figures(a), "b": _measured_figures(b)},
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


def _change_label(change: Mapping[str, Any]) -> str:
    if change["what"] == "block":
        return change["name"]
    if change["what"] == "segments":
        return f"{change['name'] or '<root>'} (segments)"
    return "torch.compile activation_memory_budget"


def _side_text(change: Mapping[str, Any], side: str) -> str:
    value = change[side]
    if change["what"] == "block":
        return BlockPlan(value["mode"], tuple(value.get("children", ())), value.get("save_list")).describe()
    if change["what"] == "segments":
        return f"{value} chunks" if value else "none"
    return str(value)


def format_diff(a: Plan, b: Plan, *, a_name: str = "a", b_name: str = "b") -> str:
    """What ``lightning-ckpt diff`` prints: blocks and segments that changed, then identity and evidence."""
    comparison = compare_plans(a, b, a_name=a_name, b_name=b_name)
    lines = [f"a: {a_name}  [{a.describe()}]", f"b: {b_name}  [{b.describe()}]", ""]
    signs = {"added": "+", "removed": "-", "changed": "~"}
    rows = [
        [signs[c["change"]], _change_label(c), _side_text(c, "a"), "->", _side_text(c, "b")]
        for c in comparison["checkpointing"]
    ]
    if rows:
        lines.append(_table(["", "block", "a", "", "b"], rows))
        lines.append("(+ checkpointed only in b, - only in a, ~ checkpointed differently)")
    else:
        lines.append("same checkpointing: every block and segment has the same mode in both plans")

    lines.append("")
    if a.fingerprint == b.fingerprint:
        lines.append(f"fingerprint  same ({a.fingerprint or 'not recorded'})")
    elif a.fingerprint and b.fingerprint:
        lines.append(f"fingerprint  {a.fingerprint} -> {b.fingerprint}: tuned for different models")
    else:
        lines.append(f"fingerprint  {a.fingerprint or 'not recorded'} -> {b.fingerprint or 'not recorded'}")
    budget = comparison["budget"]
    if budget["a"] or budget["b"]:
        before, after = _budget_value_text(budget["a"]), _budget_value_text(budget["b"])
        lines.append("budget       " + (f"same ({before})" if budget["same"] else f"{before} -> {after}"))
    for key in ("run", "versions"):
        if not (_section(a.metadata, key) or _section(b.metadata, key)):
            continue
        before, after = _kv(_section(a.metadata, key)), _kv(_section(b.metadata, key))
        lines.append(f"{key:<12} " + (f"same ({before})" if before == after else f"{before} -> {after}"))
    ma, mb = _section(a.metadata, "measured"), _section(b.metadata, "measured")
    if ma or mb:
        lines.append(
            f"measured     samples/s {_rate(ma.get('samples_per_second'))} -> {_rate(mb.get('samples_per_second'))}, "
            f"peak {_bytes(ma.get('peak_bytes'))} -> {_bytes(mb.get('peak_bytes'))}, "
            f"activation {_bytes(ma.get('activation_bytes'))} -> {_bytes(mb.get('activation_bytes'))}"
        )
    lines.append("")
    if comparison["differ"]:
        lines.append(f"the plans differ in: {', '.join(comparison['differ_in'])}")
    else:
        lines.append("the plans are the same: checkpointing, fingerprint and budget (run and figures aside)")
    return "\n".join(lines)


def _diff(args: argparse.Namespace) -> int:
    a, b = _load_plan(args.a), _load_plan(args.b)
    comparison = compare_plans(a, b, a_name=args.a, b_name=args.b)
    if args.json:
        print(json.dumps(comparison, indent=2, default=str))
    else:
        print(format_diff(a, b, a_name=args.a, b_name=args.b))
    return EXIT_DIFFERENT if args.exit_code and comparison["differ"] else EXIT_OK


# -------------------------------------------------------------------------------------------------
# validate
# -------------------------------------------------------------------------------------------------
def load_factory(spec: str) -> Callable[[], Any]:
    """``pkg.module:factory`` or ``path/to/file.py:factory`` -> the object it names.

    The current directory is importable (as with ``python -m``) and a file's own directory is on the
    path while it loads (as with ``python file.py``), so project-local models need no installing.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(
            f"--model {spec!r} must be MODULE:CALLABLE or FILE.py:CALLABLE, e.g. mypkg.models:build_model or "
            "models.py:build_model, where the callable takes no arguments and returns the nn.Module."
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"--model {spec!r}: the file {target!r} does not exist.")
        module_name = f"_lightning_ckpt_model_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise UsageError(f"--model {spec!r}: {target!r} cannot be loaded as a Python file.")
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            loader_spec.loader.exec_module(module)
        except SystemExit as exit_:
            raise UsageError(_exit_message(spec, f"importing {target!r}", exit_)) from None
        except Exception as err:
            raise UsageError(f"--model {spec!r}: importing {target!r} failed: {type(err).__name__}: {err}") from None
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # console scripts do not put the current directory on the path
        try:
            module = importlib.import_module(target)
        except SystemExit as exit_:
            raise UsageError(_exit_message(spec, f"importing module {target!r}", exit_)) from None
        except Exception as err:
            raise UsageError(
                f"--model {spec!r}: cannot import module {target!r}: {type(err).__name__}: {err}"
            ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise UsageError(
                f"--model {spec!r}: {target!r} has no attribute {attr!r}. Closest names: {closest_names(part, names)}."
            )
        obj = getattr(obj, part)
    return obj


def _exit_message(spec: str, doing: str, exit_: SystemExit) -> str:
    """SystemExit is not an Exception: left alone it would end ``validate`` silently with the model's exit code
    (0 for a bare ``sys.exit()``, which a CI job would take for a pass)."""
    code = exit_.code
    call = "sys.exit()" if code is None else f"sys.exit({code!r})"
    return (
        f"--model {spec!r}: {doing} called {call} (SystemExit), so no model was built and the plan was not checked. "
        "The code that --model loads must only define the model: move the script part (argument parsing, training) "
        'under `if __name__ == "__main__":`, or point --model at a module that does not run a script when imported.'
    )


def build_model(spec: str) -> Any:
    """Call the factory that ``spec`` names and check it gave an ``nn.Module`` (an instance is used as is)."""
    from torch import nn

    obj = load_factory(spec)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise UsageError(f"--model {spec!r} names a {type(obj).__name__}, not a callable that returns an nn.Module.")
    try:
        model = obj()
    except SystemExit as exit_:
        raise UsageError(_exit_message(spec, "calling it", exit_)) from None
    except Exception as err:
        raise LightningCkptError(
            f"--model {spec!r}: calling it with no arguments raised {type(err).__name__}: {err}"
        ) from None
    if not isinstance(model, nn.Module):
        raise LightningCkptError(f"--model {spec!r} returned {type(model).__name__} {model!r:.60}, not an nn.Module.")
    return model


def _prefix_hint(missing: str, names: list[str]) -> str:
    """Spot the usual cause of missing names: the plan was tuned on a wrapper of this model, or vice versa."""
    longer = [n for n in names if n.endswith("." + missing)]
    if longer:
        prefix = longer[0][: -len(missing)]
        return (
            f"this model has {missing!r} as {longer[0]!r}: the plan was tuned on the inner model; have the factory return "
            f"the module at {prefix.rstrip('.')!r}, or re-tune on this model."
        )
    parts = missing.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[i:]) in names:
            prefix = ".".join(parts[:i])
            return (
                f"without the leading {prefix + '.'!r}, {missing!r} exists: the plan was tuned on a wrapper (such as the "
                f"LightningModule) whose {prefix!r} attribute holds this model; have the factory return that wrapper."
            )
    return ""


def _canonical(fqn: str) -> str:
    try:
        from lightning_ckpt.discovery import canonical_fqn
    except ImportError:  # a lightning_ckpt without nested-compile support: names are already canonical
        return fqn
    return canonical_fqn(fqn)


def check_plan(plan: Plan, model: Any) -> list[str]:
    """Every reason ``plan`` does not fit ``model`` (empty when it fits). The model is left as it was."""
    from lightning_ckpt.discovery import unwrap_compiled
    from lightning_ckpt.plan.apply import apply_plan

    root = unwrap_compiled(model)
    problems = []
    if plan.fingerprint is not None:
        actual = model_fingerprint(root)
        if actual != plan.fingerprint:
            problems.append(
                f"fingerprint: the plan was tuned for a model with fingerprint {plan.fingerprint}, but this "
                f"{type(root).__name__} has {actual} (module tree, parameter shapes or dtypes differ). Re-tune for it."
            )
    # Plans name modules without the "_orig_mod" steps a nested torch.compile wrapper adds.
    names = list(dict.fromkeys(_canonical(n) for n, _ in root.named_modules() if n))
    name_set = set(names)
    missing = [fqn for fqn in [*plan.blocks, *plan.segments] if fqn and fqn not in name_set]
    for fqn in missing:
        what = "stack" if fqn in plan.segments else "block"
        problems.append(
            f"{what} {fqn!r} does not exist in this {type(root).__name__}. Closest names: {closest_names(fqn, names)}."
        )
    if missing and (hint := _prefix_hint(missing[0], names)):
        problems.append(f"hint: {hint}")
    if not missing:
        # Names resolve: let apply_plan judge the rest (children, nesting, segment stacks), then undo it.
        try:
            apply_plan(root, plan, check_fingerprint=False).remove()
        except LightningCkptError as err:
            problems.append(f"apply: {err}")
    return problems


def _validate(args: argparse.Namespace) -> int:
    plan = _load_plan(args.plan)
    model = build_model(args.model)
    problems = check_plan(plan, model)
    if problems:
        print(f"REFUSED: {args.plan} does not fit {args.model} ({type(model).__name__}):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return EXIT_REFUSED
    checked = "fingerprint and block names" if plan.fingerprint else "block names (no fingerprint recorded)"
    print(f"OK: {args.plan} fits {args.model} ({type(model).__name__}; {plan.describe()}; checked {checked})")
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# bench
# -------------------------------------------------------------------------------------------------
def _find_benchmark(name: str) -> Path | None:
    # A source checkout: the current directory, else the checkout this package is installed from (-e).
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        candidate = root / "benchmarks" / name
        if candidate.is_file():
            return candidate
    return None


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    script = Path(args.script) if args.script else _find_benchmark("seed_table.py")
    if script is None or not script.is_file():
        where = repr(args.script) if args.script else "benchmarks/seed_table.py"
        raise UsageError(
            f"{where} not found. `lightning-ckpt bench` runs the repository's benchmark script, which is not part of "
            "an installed wheel: run it from a checkout of lightning-ckpt, or pass --script PATH."
        )
    # Run it as `python script.py ARGS` would: its own argv, its directory importable.
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *extra]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return EXIT_REFUSED
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return EXIT_OK


# -------------------------------------------------------------------------------------------------
# the command
# -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ckpt",
        description="Read, compare and check activation-checkpointing plan files.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lightning-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{show,diff,validate,bench}")

    show = sub.add_parser(
        "show",
        help="print a plan file: blocks, the run it was tuned for, measured figures",
        description="Print a plan file: its blocks, the run and budget it was tuned for, the search and the "
        "figures measured while tuning.",
        epilog=SHOW_JSON_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("plan", help="path to a plan JSON file")
    show.add_argument("--json", action="store_true", help="print one JSON object for scripts (keys below)")
    show.set_defaults(func=_show)

    diff = sub.add_parser(
        "diff",
        help="what changed between two plan files (--exit-code: 1 when they differ)",
        description="Compare two plan files: checkpointing (blocks, segments, torch.compile budget), fingerprint "
        "and budget (by value), then run, versions and measured figures. Exit codes as diff(1): 0, or with "
        "--exit-code 0 same / 1 different; 2 on any error (a missing or malformed plan file included).",
        epilog=DIFF_JSON_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("a", help="the older plan file")
    diff.add_argument("b", help="the newer plan file")
    diff.add_argument(
        "--exit-code",
        action="store_true",
        help="exit 1 when the plans differ in checkpointing, fingerprint or budget, 0 when not (as git diff)",
    )
    diff.add_argument("--json", action="store_true", help="print one JSON object for scripts (keys below)")
    # A plan that does not load is trouble (2), never "different" (1): a CI job must not read it as a change.
    diff.set_defaults(func=_diff, error_exit=EXIT_USAGE)

    validate = sub.add_parser(
        "validate",
        help="check a plan against a model: fingerprint and every block name (exit 0 OK, 1 refused)",
        description="Build the model with --model and check that the plan was tuned for it (fingerprint) and "
        "that every block it names exists and can be checkpointed. Nothing is trained.",
    )
    validate.add_argument("plan", help="path to a plan JSON file")
    validate.add_argument(
        "--model",
        required=True,
        help="MODULE:CALLABLE or FILE.py:CALLABLE; a callable taking no arguments that returns the model the plan "
        "was tuned on (with the Lightning callback: the LightningModule)",
    )
    validate.set_defaults(func=_validate)

    bench = sub.add_parser(
        "bench",
        help="run benchmarks/seed_table.py (memory saved and recompute cost per baseline plan)",
        description="Run benchmarks/seed_table.py from this checkout. Every other argument goes to the script "
        "(--layers, --embd, --seq, --batch, --dropout, --out; see `python benchmarks/seed_table.py --help`).",
        allow_abbrev=False,
    )
    bench.add_argument("--script", help="the benchmark script to run (default: benchmarks/seed_table.py)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if extra and args.func is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if args.func is _bench else args.func(args)
    except UsageError as err:
        print(f"lightning-ckpt {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except LightningCkptError as err:
        print(f"lightning-ckpt {args.command}: error: {err}", file=sys.stderr)
        return getattr(args, "error_exit", EXIT_REFUSED)


if __name__ == "__main__":
    sys.exit(main())
