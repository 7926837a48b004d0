"""``lightning-ckpt show``: a plan file in words (or one JSON object), with the run, budget and search it came from. It
reads only what the file records: a plan written without the search counts shows the plan without them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from lightning_ckpt.cli.metadata import (
    JSON_FORMAT,
    budget_text,
    budget_values,
    bytes_text,
    kv_text,
    number,
    rate_text,
    ratio_text,
    versions_text,
)
from lightning_ckpt.cli.usage import EXIT_OK, load_plan
from lightning_ckpt.errors import PlanError
from lightning_ckpt.formatting import offload_phrase, table
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.plan.provenance import Provenance
from lightning_ckpt.plan.table import PlanTable
from lightning_ckpt.search.ledger import TrialStatus
from lightning_ckpt.search.verdict import Verdict

__all__ = ["SHOW_JSON_HELP", "format_plan", "plan_summary", "run_show"]


def _block_memory(plan: Plan) -> tuple[dict[str, int], dict[str, int]] | None:
    """Per block: predicted bytes kept for backward under this plan, and without checkpointing."""
    data = plan.provenance.memory_breakdown or plan.provenance.profile.get("memory")
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
    """How many candidate plans the search considered, and what became of them (``None``: not recorded)."""
    raw = search.get("status_counts")  # {"ok": 3, "pruned": 11, ...}; plans written without it show only the total
    by_status = (
        {str(k): v for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)}
        if isinstance(raw, Mapping)
        else None
    )

    def count(*statuses: TrialStatus) -> int | None:
        return None if by_status is None else sum(by_status.get(s.value, 0) for s in statuses)

    exhaustive = search.get("exhaustive")
    pruned = count(TrialStatus.PRUNED)
    time_model = search.get("time_model")
    by_time = number(time_model.get("pruned_by_time")) if isinstance(time_model, Mapping) else 0
    by_time = min(by_time, pruned) if by_time is not None and pruned is not None else None
    return {
        "considered": number(search.get("plans_considered", search.get("trials_run"))),  # trials_run: before 0.4
        "space_size": number(search.get("space_size")),
        "n_trials": number(search.get("n_trials")),
        "exhaustive": exhaustive if isinstance(exhaustive, bool) else None,
        "measured": count(*(s for s in TrialStatus if s != TrialStatus.PRUNED)),
        "pruned": pruned,
        "pruned_by_memory": pruned - by_time if pruned is not None and by_time is not None else None,
        "pruned_by_time": by_time,
        "within_budget": count(TrialStatus.OK),
        "over_budget": count(TrialStatus.OVER_BUDGET),
        "failed": count(*(s for s in TrialStatus if s.failed)),
        "conflict": count(TrialStatus.CONFLICT),
        "confirmed": number(search.get("confirmed")),
        "by_status": by_status,
    }


def _search_lines(search: Mapping[str, Any]) -> list[str]:
    """The search in words: what the totals include and what became of the plans, as far as the file says."""
    counts, pad = trial_counts(search), " " * 13
    settings = [str(search["sampler"])] if search.get("sampler") else []
    if search.get("proposer") == "time_model":  # files before 0.5 name the sampler behind the time model (TPE)
        behind = search.get("sampler") if search.get("sampler") not in (None, "TimeModelSampler") else "TPE"
        settings = [f"the time model proposed the plans it could predict, {behind} the rest"]
    if search.get("seed") is not None:
        settings.append(f"seed {search['seed']}")
    how = f" ({', '.join(settings)})" if settings else ""
    considered, space = "?" if counts["considered"] is None else counts["considered"], counts["space_size"]
    if counts["exhaustive"] and space is not None:
        head = f"all {space} candidate plans in the search space were considered{how}"
    elif space is not None:
        head = f"{considered} of the {space} candidate plans in the search space were considered{how}"
    else:
        head = f"{considered} candidate plans were considered{how}"
    cap = f"n_trials={counts['n_trials']}" if counts["n_trials"] is not None else "n_trials"
    if counts["by_status"] is None:
        return [
            f"  search     {head}",
            f"{pad}they include the baselines and the plans ruled out without running (pruned);",
            f"{pad}{cap} caps only the plans measured. This file does not record how many of each there were.",
            *_verdict_lines(search),
        ]
    by_status = counts["by_status"]
    outcomes = ", ".join(f"{n} {_STATUS_WORDS[s]}" for s in _STATUS_WORDS if (n := by_status.get(s.value, 0)))
    # The plans ruled out without running, and by what, as the search's result line says it.
    by_memory, by_time = counts["pruned_by_memory"], counts["pruned_by_time"]
    pruned = f"{pad}{counts['pruned']} ruled out without running (pruned)"
    if by_memory is not None and by_time is not None:
        pruned += f": {by_memory} by the memory model" + (f", {by_time} by the time model" if by_time else "")
    lines = [
        f"  search     {head}",
        f"{pad}{counts['measured']} measured (run for real)" + (f": {outcomes}" if outcomes else ""),
        pruned,
    ]
    if counts["confirmed"]:
        lines.append(f"{pad}{counts['confirmed']} of the measured re-timed side by side to confirm the choice")
    lines.append(f"{pad}{cap} caps the plans measured; pruned plans do not count towards it")
    return lines + _verdict_lines(search) + _cost_lines(search)


def _cost_lines(search: Mapping[str, Any]) -> list[str]:
    """Where the search's time went, by phase, in seconds and in plain training steps (``search.phases``)."""
    cost = search.get("cost")
    if not cost or not cost.get("seconds"):
        return []
    plain = cost.get("plain_step_seconds")
    total = f"{cost['total_seconds']:.1f} s" + (f" = {cost['plain_steps']:.0f} plain steps" if plain else "")
    lines = [f"  cost       {total}" + (f" (a plain step: {1000 * plain:.1f} ms)" if plain else "")]
    for phase, seconds in sorted(cost["seconds"].items(), key=lambda kv: -kv[1]):
        steps = f" = {seconds / plain:6.1f} plain steps" if plain else ""
        lines.append(f"{' ' * 13}{phase.replace('_', ' '):15s}{seconds:7.1f} s{steps}")
    if stopped := (search.get("allowance") or {}).get("stopped") or []:
        allowance = search["allowance"].get("plain_steps")
        lines.append(f"{' ' * 13}the allowance of {allowance:g} plain steps stopped {' and '.join(stopped)}")
    return lines


def _verdict_lines(search: Mapping[str, Any]) -> list[str]:
    verdict = Verdict.recorded(search)
    if verdict is None:
        return []
    tuned = f"{verdict.candidate}: " if verdict.candidate else ""  # the tuned plan the verdict is about
    return [f"  verdict    {tuned}{verdict.describe()}: {verdict.outcome} ({verdict.explain()})"]


def format_plan(plan: Plan, *, source: str = "") -> str:
    """The text ``lightning-ckpt show`` prints: identity, the run it was tuned for, blocks, evidence."""
    md, p = plan.metadata, plan.provenance
    lines = [
        f"file         {source or '-'}",
        f"name         {plan.name or '(unnamed)'}  [{plan.describe()}]  digest {plan.digest()}",
        f"fingerprint  {plan.fingerprint or '(not recorded: applies to any model with these block names)'}",
    ]
    if plan.compile_memory_budget is not None:
        lines.append(f"compile      torch.compile activation_memory_budget={plan.compile_memory_budget:g}")
    run, budget, versions, search = p.run, p.budget, p.versions, p.search
    if run or budget or versions or search:
        lines += ["", "tuned for", f"  run        {kv_text(run)}", f"  budget     {budget_text(budget)}"]
        lines.append(f"  versions   {versions_text(versions)}")
        if allocator := p.allocator:  # what the search ran under, verified on a segment (measure.allocator)
            state = "on" if allocator.get("expandable_segments") else "off"
            lines.append(f"  allocator  expandable segments {state} ({allocator.get('how')})")
        if search:
            lines += _search_lines(search)
        if search.get("fell_back"):
            lines.append("  WARNING    no plan fit the budget; this is the lowest-memory plan measured")

    lines += _block_lines(plan) + _evidence_lines(plan) + _table_lines(plan) + _profile_lines(p)
    # The sections shown above (a compiled plan table's profile is not re-planned from); the rest as written.
    shown = ("run", "budget", "versions", "search", "measured", "baselines", "memory_breakdown", "profile")
    shown += ("plan_table", "compiled_profile", "replanned", "allocator")
    if other := {k: v for k, v in md.items() if k not in shown}:
        lines += ["", "other metadata"]
        lines += [f"  {k}: {_cut(json.dumps(v, default=str))}" for k, v in other.items()]
    return "\n".join(lines)


def _table_lines(plan: Plan) -> list[str]:
    """The plan table, when the file keeps one; a malformed one is said, not shown."""
    try:
        found = PlanTable.of_plan(plan, source="this file")
    except PlanError as err:
        return ["", f"plan table   NOT USABLE: {err}"]
    if found is None:
        return []
    rows = [
        [
            f"<= {b.max_length}",
            b.plan.describe(),
            b.source,
            bytes_text(b.predicted_peak_bytes),
            bytes_text(b.predicted_activation_bytes),
            f"{1000 * b.predicted_seconds:.1f}" if b.predicted_seconds else "-",
        ]
        for b in found.buckets
    ]
    head = ["length", "plan", "chosen by", "peak", "activations", "ms/step"]
    return [
        "",
        f"plan table   {len(found.buckets)} buckets by batch length ({found.rows} rows), each batch runs its bucket's "
        "plan, switched before its forward",
        table(head, rows, right=(3, 4, 5), indent="  "),
        "  (search: measured by the search; predicted: chosen from a profile at the bucket's longest length, 0 "
        "trials; guard: moved there by the budget guard)",
    ]


def _cut(text: str, limit: int = 200) -> str:
    """``text`` up to ``limit`` characters, cut after a whole JSON item (never inside a number or a name)."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(", ", 0, limit), text.rfind("}", 0, limit) + 1, text.rfind("]", 0, limit) + 1)
    cut = cut if cut > limit // 2 else limit
    return f"{text[:cut]} ... ({len(text) - cut} more characters: lightning-ckpt show --json prints them all)"


def _profile_lines(provenance: Provenance) -> list[str]:
    """Whether the plan keeps a profile to re-plan from, and whether it was itself re-planned (predicted)."""
    lines = []
    if profile := provenance.profile:
        # Files of 0.3-0.4 kept the time model inside the memory model's ``timing``, as ``SavedProfile`` reads them.
        timing = profile.get("time") or (profile.get("memory") or {}).get("timing") or {}
        base = (timing.get("calibration") or {}).get("base_seconds")
        fitted = f"; plain step fitted at {1000 * base:.1f} ms" if base else ""
        lines += ["", f"profile      kept: {len(timing.get('blocks') or ())} block calls timed per mode{fitted}"]
        lines.append("             (lightning-ckpt replan FILE --max-memory ... predicts the plan for another budget)")
    if replanned := provenance.replanned:
        first = replanned.get("first_measured") or {}
        predicted = replanned.get("predicted_seconds")
        lines += [
            "",
            f"re-planned   PREDICTED, 0 trials, from {replanned.get('from_plan')} ({replanned.get('from_budget')})",
        ]
        lines.append(
            f"  predicted  {1000 * predicted:.1f} ms/step, peak {bytes_text(replanned.get('predicted_peak_bytes'))}, "
            f"activations {bytes_text(replanned.get('predicted_activation_bytes'))}"
            if predicted
            else "  predicted  -"
        )
        if first:
            seconds = first.get("seconds")
            lines.append(
                f"  measured   {f'{1000 * seconds:.1f} ms/step' if seconds else '-'}, peak "
                f"{bytes_text(first.get('peak_bytes'))}, activations {bytes_text(first.get('activation_bytes'))} "
                "(first real steps)"
            )
    return lines


def _block_lines(plan: Plan) -> list[str]:
    """The checkpointed blocks (with the memory model's figures when the file has them) and segments."""
    memory = _block_memory(plan)
    lines = [""]
    if memory is None:
        if plan.blocks:
            rows = [[fqn, bp.describe()] for fqn, bp in plan.blocks.items()]
            lines += [table(["block", "mode"], rows), "(blocks not listed are not checkpointed)"]
        elif not plan.segments:
            lines.append("no block is checkpointed (the no-checkpointing plan)")
    else:
        saved, unplanned = memory
        labels = plan.block_labels(list(saved))
        rows = [[fqn, labels[fqn], bytes_text(saved[fqn]), bytes_text(unplanned.get(fqn))] for fqn in saved]
        lines.append(table(["block", "mode", "kept for backward", "without ckpt"], rows, right=(2, 3)))
        lines.append("(memory: the memory model's prediction for the tuning batch)")
    if plan.segments:
        lines += [
            "",
            table(["stack", "segments"], [[fqn or "<root>", f"{n} chunks"] for fqn, n in plan.segments.items()]),
        ]
    return lines


# The memory figures of ``provenance.measured``, in the order ``show`` prints them and ``show --json`` lists them.
_MEMORY_FIGURES = ("peak_bytes", "activation_bytes", "predicted_peak_bytes")


def _evidence_lines(plan: Plan) -> list[str]:
    """The winner's and the baselines' figures measured while tuning, as one table."""
    measured, baselines = plan.provenance.measured, plan.provenance.baselines
    if not (measured or baselines):
        return []
    win = measured.get("samples_per_second")
    rows = []
    if measured:
        label = f"* {measured.get('label') or plan.describe()}"
        speedup = "1.00x" if isinstance(win, (int, float)) else "-"
        memory = [bytes_text(measured.get(k)) for k in _MEMORY_FIGURES]
        rows.append([label, str(measured.get("status", "-")), rate_text(win), speedup, *memory])
    for name, b in baselines.items():
        if measured and measured.get("label") == f"baseline:{name}":
            continue  # the winner is this baseline: its row is the starred one, not a second copy
        b = b if isinstance(b, Mapping) else {}
        rate = b.get("samples_per_second")
        memory = [bytes_text(b.get("peak_bytes")), bytes_text(b.get("activation_bytes")), ""]
        rows.append([f"  baseline:{name}", str(b.get("status", "-")), rate_text(rate), ratio_text(win, rate), *memory])
    lines = ["", "throughput and memory, measured on the first batch while tuning"]
    headers = ["plan", "status", "samples/s", "speed-up", "peak", "activation", "predicted peak"]
    lines.append(table(headers, rows, right=(2, 3, 4, 5, 6), indent="  "))
    lines.append("  (*) the winner; speed-up: the winner's samples/s over that plan's")
    if isinstance(measured.get("recompute_overhead"), (int, float)):
        lines.append(f"  the winner's recompute costs {measured['recompute_overhead']:+.1%} FLOPs per step")
    if isinstance(measured.get("offload"), Mapping):
        lines.append(f"  the winner {offload_phrase(measured['offload'])}")
    return lines


_WINNER_FIGURES = ("label", "status", "samples_per_second", *_MEMORY_FIGURES, "recompute_overhead")


def plan_summary(plan: Plan, *, source: str = "") -> dict[str, Any]:
    """The object ``lightning-ckpt show --json`` prints (its keys are listed in SHOW_JSON_HELP)."""
    by_mode: dict[str, list[str]] = {}
    for fqn, bp in plan.blocks.items():
        by_mode.setdefault(bp.describe(), []).append(fqn)
    measured, baselines, search = plan.provenance.measured, plan.provenance.baselines, plan.provenance.search
    win, winner = measured.get("samples_per_second"), None
    if measured:
        winner = {k: measured.get(k) for k in _WINNER_FIGURES}
        winner["speedup_over_baselines"] = {
            name: win / b["samples_per_second"]
            for name, b in baselines.items()
            if isinstance(b, Mapping) and number(win) and number(b.get("samples_per_second"))
        }
    kept, unplanned = _block_memory(plan) or (None, {})
    per_block = {fqn: {"kept_for_backward": n, "without_ckpt": unplanned.get(fqn)} for fqn, n in (kept or {}).items()}
    return {
        "json_format": JSON_FORMAT,
        "file": source or None,
        "name": plan.name,
        "description": plan.describe(),
        "digest": plan.digest(),
        "fingerprint": plan.fingerprint,
        "blocks_by_mode": by_mode,
        "segments": dict(plan.segments),
        "compile_memory_budget": plan.compile_memory_budget,
        "budget": budget_values(plan.provenance.budget),
        "winner": winner,
        "baselines": {name: dict(b) for name, b in baselines.items() if isinstance(b, Mapping)},
        "trials": trial_counts(search) if search else None,
        "fell_back": search.get("fell_back") if search else None,
        "verdict": verdict.to_dict() if search and (verdict := Verdict.recorded(search)) is not None else None,
        "predicted_block_memory": None if kept is None else per_block,
        "plan_table": _table_summary(plan),
        "plan": plan.to_dict(),
    }


def _table_summary(plan: Plan) -> list[dict[str, Any]] | None:
    try:
        found = PlanTable.of_plan(plan, source="this file")
    except PlanError:
        return None
    if found is None:
        return None
    keys = ("predicted_peak_bytes", "predicted_activation_bytes", "predicted_seconds")
    return [
        {"max_length": b.max_length, "plan": b.plan.describe(), "source": b.source, **{k: getattr(b, k) for k in keys}}
        for b in found.buckets
    ]


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
                          exhaustive, measured, pruned (ruled out without running), pruned_by_memory (predicted
                          over the budget), pruned_by_time (predicted unable to beat the best measured plan),
                          within_budget, over_budget, failed, conflict, confirmed, by_status: {status: count}}
  fell_back               true when no plan fit the budget and the lowest-memory plan was kept
  verdict                 {reference, candidate, ratio, low, high, rounds, threshold, confidence, outcome}: the best
                          tuned plan against the fastest fitting baseline from the paired side-by-side rounds
  predicted_block_memory  {block: {kept_for_backward, without_ckpt}} bytes, from the memory model
  plan_table              [{max_length, plan, source, predicted_peak_bytes, predicted_activation_bytes,
                          predicted_seconds}] per length bucket, shortest first (null without a table)
  plan                    the plan file's own content (Plan.to_dict()), metadata included
"""


def run_show(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.json:
        print(json.dumps(plan_summary(plan, source=args.plan), indent=2, default=str))
    else:
        print(format_plan(plan, source=args.plan))
    return EXIT_OK
