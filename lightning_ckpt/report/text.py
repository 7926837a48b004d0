"""What a search says in words: the trial lines, the result line, the summary, and their markdown for TensorBoard.

Plain data in (``TrialRecord``, ``TuneResult``, ``Plan``), never a Trainer or a writer, so the callback, a script and
the TensorBoard writer print the same words."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from lightning_ckpt.budget import Budget
from lightning_ckpt.formatting import count, format_bytes, markdown_table, offload_phrase, table
from lightning_ckpt.measure.measurement import median_and_spread
from lightning_ckpt.plan.format import Plan, block_names
from lightning_ckpt.report.quantities import (
    best_feasible_baseline,
    comparable_speeds,
    compile_stats,
    constrained_bytes,
    fastest_first,
    memory_name,
    predicted_constrained_bytes,
)
from lightning_ckpt.search.choice import CHOICE_RULE
from lightning_ckpt.search.ledger import TrialRecord, vs_reference
from lightning_ckpt.search.result import TuneResult, offload_figures
from lightning_ckpt.search.verdict import Verdict

__all__ = [
    "conflicts_markdown",
    "memory_markdown",
    "plan_markdown",
    "result_line",
    "summary_markdown",
    "summary_table",
    "time_model_line",
    "timing_warning",
    "trial_line",
]

# Relative step-time spread (MAD / median) above which two overlapping leaders are a noise problem, not a tie.
NOISY_SPREAD = 0.02


def _short_error(error: str | None, limit: int) -> str:
    line = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _memory_cell(trial: TrialRecord, value: int | None) -> str:
    # '~' marks a prediction: the trial was timed only.
    return format_bytes(value) if trial.memory_measured or value is None else "~" + format_bytes(value)


def _fmt(x: float | None, spec: str = "{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def pruned_counts(result: TuneResult, verb: str = "ruled out") -> str:
    """``"12 run, 30 ruled out by the memory model, 48 by the time model"``: what the search did with its plans."""
    by_memory = sum(t.status == "pruned" and t.pruned_by != "time" for t in result.trials)
    by_time = sum(t.status == "pruned" and t.pruned_by == "time" for t in result.trials)
    text = f"{result.n_measured} run, {by_memory} {verb} by the memory model"
    return text + (f", {by_time} by the time model" if by_time else "")


def time_model_line(result: TuneResult) -> str | None:
    """How well the time model predicted the plans it let run (each prediction made before the plan ran)."""
    summary = result.best.provenance.search.get("time_model")
    if not summary:
        return None
    n, median, worst = (summary.get(k) for k in ("predicted_and_measured", "median_abs_error", "max_abs_error"))
    errors = (
        f"median error {median:.1%} (max {worst:.1%}) over {count(n, 'plan')} predicted, then measured"
        if n
        else "no plan"
    )
    return (
        f"time model: {errors}; noise margin {summary.get('noise_margin', 0.0):.1%}; "
        f"{count(summary.get('pruned_by_time', 0), 'plan')} pruned as unable to beat the best measured one"
    )


def trial_line(trial: TrialRecord, budget: Budget) -> str:
    """One line per finished trial: ``[trial 3] selective(mlp) h.0-7 | 123.4 samples/s | peak 1.2 GiB (pred 1.1 GiB)
    | ok``. Under an activation budget the activation figure comes first: it decides the trial."""
    parts = [f"[trial {trial.number}] {trial.label}"]
    if trial.samples_per_second is not None:
        error = trial.prediction_error
        predicted = f" (time predicted {error:+.1%})" if error is not None else ""
        parts.append(f"{trial.samples_per_second:.1f} samples/s{predicted}")
    else:
        parts.append("not run" if trial.status == "pruned" else "no measurement")

    def memory(name: str, value: int | None, predicted: int | None) -> str:
        # Timed only: its memory is the model's prediction (trials.Trials.verify).
        if not trial.memory_measured:
            return f"{name} {format_bytes(value)} predicted"
        return f"{name} {format_bytes(value)} (pred {format_bytes(predicted)})"

    peak = memory("peak", trial.peak_bytes, trial.predicted_peak_bytes)
    if budget.kind == "activation":
        peak = f"{memory('activation', trial.activation_bytes, trial.predicted_activation_bytes)}, {peak}"
    parts.append(peak)
    if (offload := offload_figures(trial)) is not None:
        parts.append(offload_phrase(offload))
    if (stats := compile_stats(trial)) is not None:
        parts.append(f"compile {stats.get('compile_seconds', 0.0):.1f} s, {stats.get('graph_breaks', 0)} graph breaks")
    limit = format_bytes(budget.limit_bytes)
    conflict = trial.extra.get("conflict")
    if trial.status == "over_budget":
        parts.append(f"over_budget ({format_bytes(constrained_bytes(trial, budget))} > {limit})")
    elif trial.status == "pruned" and trial.pruned_by == "time":
        parts.append(f"pruned (predicted {_fmt_ms(trial.predicted_seconds)}/step: cannot beat the best measured plan)")
    elif trial.status == "pruned":
        parts.append(f"pruned (predicted {format_bytes(predicted_constrained_bytes(trial, budget))} > {limit})")
    elif trial.status in ("oom", "invalid", "error", "conflict") and (trial.error or conflict):
        parts.append(f"{trial.status}: {_short_error(conflict or trial.error, limit=160)}")
    elif conflict:
        parts.append(f"{trial.status} (conflict allowed: {_short_error(conflict, limit=120)})")
    else:
        parts.append(trial.status)
    return " | ".join(parts)


def _verdict_phrase(verdict: Verdict) -> str:
    """The verdict as the result line and the summary say it: the ratio with its interval, and what it decided."""
    name = verdict.reference.removeprefix("baseline:")
    if verdict.outcome == "tuned":
        return f"{verdict.describe()} ({verdict.confidence:.0%} interval)"
    if verdict.candidate is None:
        return f"the baseline {name}: no tuned plan was re-timed beside it"
    return f"kept the baseline {name}: best tuned plan {verdict.describe()}, {verdict.explain()}"


def timing_warning(result: TuneResult) -> str | None:
    """A warning when the side-by-side rounds could not decide: the verdict's interval still straddles the
    threshold after the most rounds, or, without a verdict, the two fastest plans that fit overlap within spreads
    wider than ``NOISY_SPREAD`` (two plans overlapping within tight spreads are simply as fast)."""
    verdict = Verdict.recorded(result.best.provenance.search)
    if verdict is not None:
        if verdict.outcome != "undecided":
            return None
        return (
            f"lightning_ckpt: the machine could not separate the best tuned plan from the fastest fitting baseline: "
            f"{verdict.describe()} ({verdict.confidence:.0%} interval straddles {verdict.threshold:.2f}x), so the "
            "baseline was kept. Something else was loading the machine, or they are as fast; tune on an idle machine "
            "or raise confirm_max_rounds for a speed verdict."
        )
    confirmed = sorted(
        (t for t in result.trials if t.feasible and len(t.confirmation_seconds) >= 2),
        key=lambda t: -(t.samples_per_second or 0.0),
    )
    if len(confirmed) < 2:
        return None
    (a, ma, da), (b, mb, db) = ((t, *median_and_spread(t.confirmation_seconds)) for t in confirmed[:2])
    if abs(mb - ma) > da + db or max(da / ma, db / mb) <= NOISY_SPREAD:
        return None
    return (
        f"lightning_ckpt: timing spread too high to separate the leaders: [{a.label}] "
        f"({_fmt(a.samples_per_second)} samples/s, \u00b1{da / ma:.1%}) and [{b.label}] "
        f"({_fmt(b.samples_per_second)} samples/s, \u00b1{db / mb:.1%}) overlap after "
        f"{min(len(a.confirmation_seconds), len(b.confirmation_seconds))} side-by-side rounds: they could not be "
        "separated, so the tie rule chose between them (a baseline is kept; between tuned plans, lower memory), not "
        "speed. Something else was loading the machine; tune on an idle machine or raise measure_steps for a speed "
        "verdict."
    )


def result_line(result: TuneResult) -> str:
    """The one line a quiet search ends with (like Lightning's BatchSizeFinder)."""
    winner, budget, search = result.best_trial, result.budget, result.best.provenance.search
    parts = [f"lightning_ckpt: chose {result.best.describe()}"]
    if winner is not None:
        used = constrained_bytes(winner, budget)
        limit = f" of {format_bytes(budget.limit_bytes)}" if budget.limit_bytes is not None else ""
        parts.append(f"{_fmt(winner.samples_per_second)} samples/s, {memory_name(budget)} {format_bytes(used)}{limit}")
        if (offload := offload_figures(winner)) is not None:
            parts.append(offload_phrase(offload))
        base, verdict = best_feasible_baseline(result), Verdict.recorded(search)
        if search.get("none_fits"):
            parts.append(
                "the memory model predicts no checkpointing fits the budget, so nothing else was searched (it could "
                "only add recompute; search={'search_when_none_fits': True} searches anyway)"
            )
        elif verdict is not None:
            parts.append(_verdict_phrase(verdict))
        elif base is not None and base[1].number != winner.number:
            parts.append(
                f"{_ratio(winner.samples_per_second, base[1].samples_per_second)} the best baseline that fits ({base[0]})"
            )
        elif base is not None:
            parts.append(f"the baseline {base[0]}: no tuned plan beat it")
    if result.fell_back:
        parts.append("NOTHING FIT THE BUDGET (fell back to the lowest-memory plan)")
    if search.get("speed_changes"):
        parts.append("the machine's speed changed during the search: chosen on side-by-side figures only")
    if stopped := (search.get("allowance") or {}).get("stopped") or []:
        parts.append(
            f"the allowance of {search['allowance'].get('plain_steps'):g} plain steps stopped {' and '.join(stopped)}"
        )
    steps = (search.get("cost") or {}).get("plain_steps")
    in_steps = f" = {steps:.0f} plain steps" if steps else ""  # ``lightning-ckpt show`` has every phase
    parts.append(
        f"tuned in {result.tuning_seconds:.1f} s{in_steps} ({count(len(result.trials), 'plan')}: {pruned_counts(result)})"
    )
    if (compiles := compiles_phrase(result)) is not None:
        parts.append(compiles)
    return " | ".join(parts)


def compiles_phrase(result: TuneResult) -> str | None:
    """What a compiled search compiled (``search.tune.compiles_of``), or None for an eager one."""
    c = result.best.provenance.compiles
    if not c:
        return None
    how = "blocks compiled alone" if c.get("assembled") else "each plan compiled whole"
    phrase = (
        f"compiled {count(c['graphs'], 'graph')} in {c['seconds']:.1f} s for {count(c.get('plans_measured', 0), 'plan')} measured "
        f"({how}; the chosen plan compiles as you compile it at its first step)"
    )
    check = result.best.provenance.whole_compile_check  # ``search.whole_check``: a PT2 budget checked
    if check:
        ratio = check.get("ratio")
        speed = f", it ran {ratio:.3f}x the budget's speed" if ratio is not None else ""
        if check.get("compiled_whole", True):
            where = f"{check['graphs']} of them your way, "
        else:  # weighed on the blocks, where the budget must lead by the margin (``whole_compile_margin``)
            where = f"on the blocks (the budget needed a {check.get('margin', 0.0):.0%} lead), "
        phrase += f"; {where}{check['leader']} beside {check['rival']}{speed}: kept {check['kept']}"
    partitioned = result.best.provenance.pt2_partitioned_whole  # ``search.whole_check.Partitioned``
    if partitioned:
        said = ", ".join(
            f"{p['plan']} saves {format_bytes(p['whole'])} ({'fits' if p['fits'] else 'over budget'})"
            if p.get("whole") is not None
            else f"{p['plan']} failed to partition"
            for p in partitioned
        )
        phrase += f"; partitioned as you compile it (no kernels): {said}"
    return phrase


def conflicts_markdown(result: TuneResult) -> str:
    """Every compiled trial whose plan conflicted with torch.compile, and why (markdown for TensorBoard)."""
    cells = [
        [t.number, t.label, t.status, (compile_stats(t) or {}).get("graph_breaks", "-"), _escape(str(conflict), "|")]
        for t in result.trials
        if (conflict := t.extra.get("conflict"))
    ]
    if not cells:
        return "No plan conflicted with torch.compile (no added graph breaks, no recompile limit reached)."
    return markdown_table(["trial", "plan", "status", "graph breaks", "reason"], cells)


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def _against_baselines(result: TuneResult, winner: TrialRecord) -> list[str]:
    """The verdict, and the winner against the fastest baseline that fits: speed and memory."""
    budget, mem = result.budget, memory_name(result.budget)
    verdict = Verdict.recorded(result.best.provenance.search)
    lines = [] if verdict is None else [f"verdict vs the fastest fitting baseline: {_verdict_phrase(verdict)}"]
    best_base = best_feasible_baseline(result)
    if best_base is None:
        return [*lines, "vs baselines: no baseline fit the budget, so there is none to compare against."]
    name, base = best_base
    if base.number == winner.number:
        return [*lines, f"vs baselines: the winner is the best feasible baseline itself ({name})."]
    paired = verdict is not None and verdict.ratio is not None
    speed = verdict.describe() if paired else _ratio(winner.samples_per_second, base.samples_per_second)
    return [
        *lines,
        f"vs best feasible baseline {name} ({_fmt(base.samples_per_second)} samples/s, "
        f"{mem} {format_bytes(constrained_bytes(base, budget))}): {speed} samples/s, "
        f"{_ratio(constrained_bytes(winner, budget), constrained_bytes(base, budget))} {mem} memory",
    ]


def verdict_lines(result: TuneResult) -> list[str]:
    """What won, by how much against the best baseline that *fits* (beating one that would not run under the budget
    proves nothing), under which budget, at what tuning cost."""
    winner, budget, search = result.best_trial, result.budget, result.best.provenance.search
    mem = memory_name(budget)
    plan = result.best.describe()
    if winner is None:
        lines = [f"winner: {plan} (not measured)"]
    else:
        lines = [
            f"winner (*): [trial {winner.number}] {winner.label}{'' if plan == winner.label else f' = {plan}'}: "
            f"{_fmt(winner.samples_per_second)} samples/s, peak {format_bytes(winner.peak_bytes)}, "
            f"activation {format_bytes(winner.activation_bytes)}, "
            f"recompute {_fmt(winner.recompute_overhead, '+{:.1%}')}",
            *_against_baselines(result, winner),
        ]
    if result.fell_back:
        chosen = f" ({winner.label}, {mem} {format_bytes(constrained_bytes(winner, budget))})" if winner else ""
        lines.append(
            f"NOTHING FIT THE BUDGET: no plan measured within {budget.description or budget.kind}; fell back to the "
            f"lowest-memory plan{chosen}. Raise the budget or reduce the batch size."
        )
    if search.get("tie_tolerance") is not None:
        lines.append(f"rule: {CHOICE_RULE} (tie tolerance {search['tie_tolerance']:.1%})")
    lines += [f"machine speed changed {change}" for change in search.get("speed_changes") or ()]
    description = budget.description or budget.kind
    if budget.kind == "none" or budget.limit_bytes is None:
        lines.append(f"budget: {description} (no memory limit)")
    else:
        lines.append(f"budget: {description} (constrains {mem} memory, limit {format_bytes(budget.limit_bytes)})")
    lines.append(
        f"tuning cost: {result.tuning_seconds:.1f} s, {result.tuning_steps} steps over {len(result.trials)} trials "
        f"({pruned_counts(result, 'pruned')})"
    )
    if (time_line := time_model_line(result)) is not None:
        lines.append(time_line)
    compiling = [s for t in result.trials if (s := compile_stats(t)) is not None]
    if compiling:
        n_conflicts = sum(bool(t.extra.get("conflict")) for t in result.trials)
        compiles = compiles_phrase(result) or (
            f"{sum(s.get('compile_seconds', 0.0) for s in compiling):.1f} s compiling {count(len(compiling), 'plan')}"
        )
        lines.append(
            f"torch.compile: {compiles} (in the tuning cost, not in samples/s); {n_conflicts} plan(s) conflicted "
            "with the compiler"
            f"{'' if not n_conflicts else ' (status conflict, or allowed: see compile_conflicts)'}; memory of a "
            "compiled step on CPU = saved-for-backward bytes (see lightning_ckpt.search.compile)"
        )
    return lines


# The summary table's columns; compiled searches add "compile s".
_SUMMARY_COLUMNS = ("", "#", "label", "status", "pred peak", "peak", "activation", "samples/s", "timed", "vs ref")
_SUMMARY_COLUMNS += ("pred step", "time err", "recompute", "seconds")


def _summary_rows(result: TuneResult) -> list[tuple[str, ...]]:
    winner = result.best_trial
    compiled = any(compile_stats(t) is not None for t in result.trials)
    rows = [_SUMMARY_COLUMNS + (("compile s",) if compiled else ())]
    side_by_side = any(t.confirmed for t in result.trials)
    speeds = comparable_speeds(result)  # a side-by-side row on one scale with the winner's
    leaders = fastest_first(result)  # then the unmeasured, in trial order
    for t in leaders + [t for t in result.trials if t.samples_per_second is None and t not in leaders]:
        stats = compile_stats(t)
        compile_cell = (f"{stats.get('compile_seconds', 0.0):.1f}" if stats else "-",) if compiled else ()
        rows.append(
            (
                "*" if winner is not None and t.number == winner.number else "",
                str(t.number),
                t.label,
                str(t.status),
                format_bytes(t.predicted_peak_bytes),
                _memory_cell(t, t.peak_bytes),
                _memory_cell(t, t.activation_bytes),
                _fmt(speeds.get(t.number, t.samples_per_second)),
                # side: re-timed beside the winner (comparable); alone: timed at another moment (a quiet one can
                # put it above the winner).
                "-" if t.samples_per_second is None else "side" if t.confirmed and side_by_side else "alone",
                f"{ratio:.2f}x" if (ratio := vs_reference(t)) is not None else "-",
                _fmt_ms(t.predicted_seconds),
                _fmt(t.prediction_error, "{:+.1%}"),
                _fmt(t.recompute_overhead, "+{:.1%}"),
                f"{t.seconds:.1f}",
                *compile_cell,
            )
        )
    return rows


def summary_table(result: TuneResult) -> str:
    """The verdict first, then every trial as a fixed-width table, fastest first (the winner marked '*')."""
    header, *rows = _summary_rows(result)
    numbers = [i for i in range(len(header)) if i not in (0, 2, 3)]  # text columns: mark, label, status
    return "\n".join([*verdict_lines(result), "", table(header, rows, right=numbers, rule=True)])


def summary_markdown(result: TuneResult) -> str:
    """The summary for TensorBoard's Text tab: the verdict, then the trials as a table, fastest first."""
    (_, *header), *rows = _summary_rows(result)
    out = [f"- {_escape(line.replace('winner (*)', 'winner (bold)', 1))}" for line in verdict_lines(result)]
    # Labels escaped; the winner's row (marked '*') in bold.
    cells = [
        [f"**{c}**" if mark == "*" and c else c for c in (n, _escape(label), *rest)] for mark, n, label, *rest in rows
    ]
    out += [
        "",
        markdown_table(header, cells),
        "",
        "Bold: the winner. `~`: memory predicted by the memory model (the trial was timed only). timed: `side` = "
        "re-timed side by side in the confirmation's rounds, `alone` = timed one plan at a time while the search ran "
        "(a quiet moment can put it above the winner). vs ref: the speed over the fastest fitting baseline from the "
        "rounds both ran in, what the choice compared (samples/s of rounds minutes apart are not comparable).",
    ]
    return "\n".join(out)


def _escape(text: str, chars: str = "|*_") -> str:
    # Markdown would read '|' as a column break and '*' / '_' as emphasis.
    for c in chars:
        text = text.replace(c, "\\" + c)
    return text


def memory_markdown(breakdown: Mapping[str, Any], plan: Plan | None = None) -> str:
    """The memory model's breakdown (``MemoryModel.to_dict``) as markdown tables in MiB: TensorBoard wraps table
    cells, but cuts a wide code block off. Blocks with the same figures (and mode in ``plan``) share one column."""

    mib = partial(format_bytes, unit="MiB", suffix=False)
    parts = [
        ("parameters", breakdown.get("parameter_bytes")),
        ("gradients", breakdown.get("gradient_bytes")),
        _optimizer_state(breakdown, plan),
        ("buffers", breakdown.get("buffer_bytes")),
        ("activations outside the blocks", breakdown.get("other_activation_bytes")),
    ]
    lines = [
        f"**Memory profile** on {breakdown.get('device', '?')} (MiB)",
        "",
        markdown_table(["part", "MiB"], [[name, mib(n)] for name, n in parts]),
    ]
    blocks = list(breakdown.get("blocks") or [])
    if not blocks:
        return "\n".join(lines)
    in_plan = plan is not None and not plan.is_empty
    all_fqns = [b["fqn"] for b in blocks]
    labels = plan.block_labels(all_fqns) if plan is not None else {}
    keys = list(dict.fromkeys(k for b in blocks for k in b.get("saved_bytes", {})))
    groups: dict[tuple[Any, ...], list[str]] = {}
    for b in blocks:
        saved = b.get("saved_bytes", {})
        # By the figures as printed: blocks a few bytes apart (the first and last of a stack) read the same.
        figures = tuple(mib(saved.get(k)) for k in keys)
        signature = (figures, mib(b.get("recompute_transient_bytes")), labels.get(b["fqn"], "none"))
        groups.setdefault(signature, []).append(b["fqn"])
    headers = [block_names(fqns, among=all_fqns) for fqns in groups.values()]
    lines += [
        "",
        "Saved activations one block keeps from forward to backward under each mode (blocks whose figures "
        "read the same and that run the same mode share a column); *recompute*: the transient of a fully checkpointed block's backward."
        + (" Last row: the chosen plan." if in_plan else ""),
        "",
    ]
    rows = [[k, *(sig[0][i] for sig in groups)] for i, k in enumerate(keys)]
    rows.append(["*recompute*", *(sig[1] for sig in groups)])
    if in_plan:
        rows.append(["**plan**", *(f"**{sig[2]}**" for sig in groups)])
    lines.append(markdown_table(["mode", *(f"`{h}`" for h in headers)], rows))
    return "\n".join(lines)


def _optimizer_state(breakdown: Mapping[str, Any], plan: Plan | None) -> tuple[str, Any]:
    """The optimizer state's row: the profile's, or, when the first step had yet to create it (AdamW's state is
    made by its first ``step()``), what the measured optimizer step left, which the budget counts."""
    profiled = breakdown.get("optimizer_state_bytes")
    after = plan.provenance.optimizer_step.get("state_bytes_after") if plan is not None else None
    if isinstance(after, (int, float)) and after > (profiled or 0):
        return "optimizer state (made by the first step)", after
    return "optimizer state", profiled


def plan_markdown(plan: Plan, trial: TrialRecord | None = None) -> str:
    """The plan as a markdown table (one row per checkpointed block) plus the figures that chose it; block names
    go in backticks so their dots and underscores are not read as emphasis."""
    title = f"**Checkpointing plan** `{plan.name}`" if plan.name else "**Checkpointing plan**"
    lines = [f"{title}: {plan.describe()} (digest `{plan.digest()}`)", ""]
    if plan.is_empty:
        lines.append("No checkpointing: every block runs as usual.")
    else:
        rows = [[f"`{fqn}`", bp.describe()] for fqn, bp in plan.blocks.items()]
        rows += [[f"`{fqn or '<root>'}` (stack)", f"segments: {n} chunks"] for fqn, n in plan.segments.items()]
        lines.append(markdown_table(["block", "mode"], rows))
        lines += ["", "Blocks not listed are not checkpointed."]
    if trial is not None:
        lines += ["", f"**Measured** (trial {trial.number}, {trial.status}):", ""]
        rows = [
            ["samples/s", _fmt(trial.samples_per_second)],
            ["peak memory", f"{format_bytes(trial.peak_bytes)} (predicted {format_bytes(trial.predicted_peak_bytes)})"],
            [
                "activation memory",
                f"{format_bytes(trial.activation_bytes)} (predicted {format_bytes(trial.predicted_activation_bytes)})",
            ],
            ["recompute overhead", _fmt(trial.recompute_overhead, "+{:.1%}")],
        ]
        if trial.median_seconds is not None:
            spread = f" ± {trial.spread_seconds:.4f}" if trial.spread_seconds is not None else ""
            rows.append(["step time (median)", f"{trial.median_seconds:.4f} s{spread}"])
        lines.append(markdown_table(["quantity", "value"], rows))
    elif measured := plan.provenance.measured:
        lines += ["", "**Measured:**", "", markdown_table(["quantity", "value"], list(measured.items()))]
    return "\n".join(lines)
