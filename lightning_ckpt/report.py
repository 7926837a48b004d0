"""Reporting: progress lines, the summary table, the Pareto figure and everything written to TensorBoard.

This is the only module that formats results for people or writes TensorBoard, so the tag names,
units and status codes live here and nowhere else. It takes plain data (``TrialRecord``,
``TuneResult``) and a ``torch.utils.tensorboard.SummaryWriter`` (or a log directory), never a
Trainer: the Lightning callback and a plain script call it the same way.

TensorBoard layout (``logdir`` is the writer's directory)::

    logdir/                        one scalar series per quantity, global_step = trial number
        lightning_ckpt/trial/...   see TRIAL_SCALAR_TAGS
        lightning_ckpt/plan        text*: the chosen plan as a markdown table
        lightning_ckpt/memory_breakdown   text*: the memory model's per-block table
        lightning_ckpt/summary     text*: the summary table
        lightning_ckpt/pareto      image: the Pareto figure (also saved as logdir/pareto.png)
    logdir/trial_003/              one run per trial for the HParams dashboard: the trial's search
                                   dimensions, label and status as hparams, HPARAM_METRIC_TAGS as metrics

    * torch's ``add_text`` stores text under ``<tag>/text_summary``; ``text_tag(TAG_PLAN)`` gives that name.

Status codes (the ``lightning_ckpt/trial/status_code`` scalar, see ``STATUS_CODES``):
0 ok, 1 over_budget, 2 pruned, 3 oom, 4 invalid, 5 error, 6 conflict, -1 anything else.

Compiled trials (``torch.compile``, see ``lightning_ckpt.compile``) add ``COMPILE_SCALAR_TAGS`` per
trial (compile seconds, graph breaks, recompiles) and a ``lightning_ckpt/compile_conflicts`` text
listing every plan that conflicted with the compiler and why.

Memory is logged in MiB (2**20 bytes) so the scalar charts read naturally; the text uses
``format_bytes``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from lightning_ckpt.budget import Budget, format_bytes
from lightning_ckpt.plan import Plan
from lightning_ckpt.records import TrialRecord, TrialStatus, TuneResult

__all__ = [
    "HPARAM_METRIC_TAGS",
    "PARETO_PNG",
    "COMPILE_SCALAR_TAGS",
    "STATUS_CODES",
    "TAG_PREFIX",
    "TAG_MEMORY_BREAKDOWN",
    "TAG_PARETO",
    "TAG_CONFLICTS",
    "TAG_PLAN",
    "TAG_SUMMARY",
    "TEXT_TAG_SUFFIX",
    "TRIAL_RUN_FORMAT",
    "TRIAL_SCALAR_TAGS",
    "conflicts_markdown",
    "log_trial",
    "pareto_figure",
    "pareto_front",
    "plan_markdown",
    "summary_table",
    "text_tag",
    "trial_line",
    "write_tensorboard",
]

# -- TensorBoard names: the one place they are defined -------------------------------------------
TAG_PREFIX = "lightning_ckpt"

TAG_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/trial/samples_per_second"
TAG_PEAK_MIB = f"{TAG_PREFIX}/trial/peak_memory_mib"
TAG_PREDICTED_PEAK_MIB = f"{TAG_PREFIX}/trial/predicted_peak_memory_mib"
TAG_ACTIVATION_MIB = f"{TAG_PREFIX}/trial/activation_memory_mib"
TAG_PREDICTED_ACTIVATION_MIB = f"{TAG_PREFIX}/trial/predicted_activation_memory_mib"
TAG_RECOMPUTE_OVERHEAD = f"{TAG_PREFIX}/trial/recompute_overhead"
TAG_STATUS_CODE = f"{TAG_PREFIX}/trial/status_code"
TAG_TRIAL_SECONDS = f"{TAG_PREFIX}/trial/seconds"
# Compiled trials only: logged when a trial carries compile statistics (TrialRecord.extra["compile"]).
TAG_COMPILE_SECONDS = f"{TAG_PREFIX}/trial/compile_seconds"
TAG_GRAPH_BREAKS = f"{TAG_PREFIX}/trial/graph_breaks"
TAG_RECOMPILES = f"{TAG_PREFIX}/trial/recompiles"
COMPILE_SCALAR_TAGS = (TAG_COMPILE_SECONDS, TAG_GRAPH_BREAKS, TAG_RECOMPILES)
TRIAL_SCALAR_TAGS = (
    TAG_SAMPLES_PER_SECOND,
    TAG_PEAK_MIB,
    TAG_PREDICTED_PEAK_MIB,
    TAG_ACTIVATION_MIB,
    TAG_PREDICTED_ACTIVATION_MIB,
    TAG_RECOMPUTE_OVERHEAD,
    TAG_STATUS_CODE,
    TAG_TRIAL_SECONDS,
)

# Metrics of the HParams dashboard. They are scalars in each trial's own run; distinct from the
# per-trial series above so the two never mix in one chart.
HPARAM_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/hparams/samples_per_second"
HPARAM_PEAK_MIB = f"{TAG_PREFIX}/hparams/peak_memory_mib"
HPARAM_ACTIVATION_MIB = f"{TAG_PREFIX}/hparams/activation_memory_mib"
HPARAM_PREDICTED_PEAK_MIB = f"{TAG_PREFIX}/hparams/predicted_peak_memory_mib"
HPARAM_RECOMPUTE_OVERHEAD = f"{TAG_PREFIX}/hparams/recompute_overhead"
HPARAM_METRIC_TAGS = (
    HPARAM_SAMPLES_PER_SECOND,
    HPARAM_PEAK_MIB,
    HPARAM_ACTIVATION_MIB,
    HPARAM_PREDICTED_PEAK_MIB,
    HPARAM_RECOMPUTE_OVERHEAD,
)

# Text tags as passed to add_text; torch stores each as f"{tag}{TEXT_TAG_SUFFIX}" (see text_tag).
TAG_PLAN = f"{TAG_PREFIX}/plan"
TAG_MEMORY_BREAKDOWN = f"{TAG_PREFIX}/memory_breakdown"
TAG_SUMMARY = f"{TAG_PREFIX}/summary"
TAG_PARETO = f"{TAG_PREFIX}/pareto"
TAG_CONFLICTS = f"{TAG_PREFIX}/compile_conflicts"
TEXT_TAG_SUFFIX = "/text_summary"

TRIAL_RUN_FORMAT = "trial_{:03d}"  # sub-directory (TensorBoard run) of one trial's HParams session
PARETO_PNG = "pareto.png"

# The number each status is logged as. Explicit rather than derived from TrialStatus' order, so a
# reordering there cannot silently change the meaning of logged numbers (a test checks they agree).
STATUS_CODES: dict[str, int] = {
    TrialStatus.OK: 0,
    TrialStatus.OVER_BUDGET: 1,
    TrialStatus.PRUNED: 2,
    TrialStatus.OOM: 3,
    TrialStatus.INVALID: 4,
    TrialStatus.ERROR: 5,
    TrialStatus.CONFLICT: 6,
}
UNKNOWN_STATUS_CODE = -1

_MIB = float(2**20)

# Figure style per status: (colour, marker, legend text).
_STATUS_STYLE: dict[str, tuple[str, str, str]] = {
    "ok": ("tab:green", "o", "fits the budget"),
    "over_budget": ("tab:orange", "s", "over the budget"),
    "pruned": ("tab:gray", "x", "pruned (at predicted memory)"),
    "oom": ("tab:red", "X", "out of memory (at predicted memory)"),
    "invalid": ("tab:purple", "D", "invalid (at predicted memory)"),
    "error": ("tab:brown", "P", "error (at predicted memory)"),
    "conflict": ("tab:pink", "v", "conflicts with torch.compile"),
}


# -- text -------------------------------------------------------------------------------------------
def _memory_name(budget: Budget) -> str:
    """The memory quantity that decides feasibility: what users compare plans by."""
    return "activation" if budget.kind == "activation" else "peak"


def _constrained(trial: TrialRecord, budget: Budget) -> int | None:
    return budget.value_of(trial.peak_bytes, trial.activation_bytes)


def _constrained_predicted(trial: TrialRecord, budget: Budget) -> int | None:
    return budget.value_of(trial.predicted_peak_bytes, trial.predicted_activation_bytes)


def _short_error(error: str | None, limit: int = 80) -> str:
    line = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _memory_cell(trial: TrialRecord, value: int | None) -> str:
    """A memory figure for the summary table: '~' marks a prediction (the trial was timed only)."""
    return format_bytes(value) if trial.memory_measured or value is None else "~" + format_bytes(value)


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _fmt_overhead(x: float | None) -> str:
    return "-" if x is None else f"+{x:.1%}"


def trial_line(trial: TrialRecord, budget: Budget) -> str:
    """One line per finished trial, so a user watching the log sees what each candidate cost.

    ``[trial 3] selective(mlp) x8 | 123.4 samples/s | peak 1.2 GiB (pred 1.1 GiB) | ok``. Under an
    activation budget the activation figure comes first, because that is what decides the trial.
    """
    parts = [f"[trial {trial.number}] {trial.label}"]
    if trial.samples_per_second is not None:
        parts.append(f"{trial.samples_per_second:.1f} samples/s")
    else:
        parts.append("not run" if trial.status == "pruned" else "no measurement")
    memory = []
    if not trial.memory_measured:  # timed only; its memory is the model's prediction (study.Study.verify)
        if budget.kind == "activation":
            memory.append(f"activation {format_bytes(trial.activation_bytes)} predicted")
        memory.append(f"peak {format_bytes(trial.peak_bytes)} predicted")
    else:
        if budget.kind == "activation":
            memory.append(
                f"activation {format_bytes(trial.activation_bytes)} (pred {format_bytes(trial.predicted_activation_bytes)})"
            )
        memory.append(f"peak {format_bytes(trial.peak_bytes)} (pred {format_bytes(trial.predicted_peak_bytes)})")
    parts.append(", ".join(memory))
    stats = _compile_stats(trial)
    if stats is not None:
        parts.append(f"compile {stats.get('compile_seconds', 0.0):.1f} s, {stats.get('graph_breaks', 0)} graph breaks")
    limit = format_bytes(budget.limit_bytes)
    conflict = trial.extra.get("conflict")
    if trial.status == "over_budget":
        parts.append(f"over_budget ({format_bytes(_constrained(trial, budget))} > {limit})")
    elif trial.status == "pruned":
        parts.append(f"pruned (predicted {format_bytes(_constrained_predicted(trial, budget))} > {limit})")
    elif trial.status in ("oom", "invalid", "error", "conflict") and (trial.error or conflict):
        parts.append(f"{trial.status}: {_short_error(conflict or trial.error, limit=160)}")
    elif conflict:
        parts.append(f"{trial.status} (conflict allowed: {_short_error(conflict, limit=120)})")
    else:
        parts.append(trial.status)
    return " | ".join(parts)


def _compile_stats(trial: TrialRecord) -> Mapping[str, Any] | None:
    stats = trial.extra.get("compile") if trial.extra else None
    return stats if isinstance(stats, Mapping) else None


def conflicts_markdown(result: TuneResult) -> str:
    """Every compiled trial whose plan conflicted with torch.compile, and why (markdown for TensorBoard)."""
    rows = [t for t in result.trials if t.extra.get("conflict")]
    if not rows:
        return "No plan conflicted with torch.compile (no added graph breaks, no recompile limit reached)."
    lines = ["| trial | plan | status | graph breaks | reason |", "|---|---|---|---|---|"]
    for t in rows:
        stats = _compile_stats(t) or {}
        reason = str(t.extra["conflict"]).replace("|", "\\|")
        lines.append(f"| {t.number} | {t.label} | {t.status} | {stats.get('graph_breaks', '-')} | {reason} |")
    return "\n".join(lines)


def _best_feasible_baseline(result: TuneResult) -> tuple[str, TrialRecord] | None:
    best: tuple[str, TrialRecord] | None = None
    for name, t in result.baselines.items():
        faster = best is None or (t.samples_per_second or 0.0) > (best[1].samples_per_second or 0.0)
        if t.feasible and t.samples_per_second is not None and faster:
            best = (name, t)
    return best


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def summary_table(result: TuneResult) -> str:
    """All trials as a fixed-width table, then the verdict: what won, by how much, at what cost.

    The comparison is against the best baseline that *fits*: beating a baseline that would not run
    under the budget proves nothing.
    """
    budget = result.budget
    winner = result.best_trial
    header = (
        "",
        "#",
        "label",
        "status",
        "pred peak",
        "peak",
        "activation",
        "samples/s",
        "recompute",
        "seconds",
    )
    compiled = any(_compile_stats(t) is not None for t in result.trials)
    if compiled:
        header += ("compile s",)
    rows = [header]
    for t in result.trials:
        is_winner = winner is not None and t.number == winner.number
        stats = _compile_stats(t)
        compile_cell = (f"{stats.get('compile_seconds', 0.0):.1f}" if stats else "-",) if compiled else ()
        rows.append(
            (
                "*" if is_winner else "",
                str(t.number),
                t.label,
                t.status,
                format_bytes(t.predicted_peak_bytes),
                _memory_cell(t, t.peak_bytes),
                _memory_cell(t, t.activation_bytes),
                _fmt_rate(t.samples_per_second),
                _fmt_overhead(t.recompute_overhead),
                f"{t.seconds:.1f}",
                *compile_cell,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    left = {2, 3}  # text columns; numbers align right
    lines = [
        "  ".join(
            c.ljust(w) if i in left or i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "-" * len(max(lines, key=len)))

    mem = _memory_name(budget)
    lines.append("")
    if winner is None:
        lines.append(f"winner: {result.best.describe()} (not measured)")
    else:
        plan = result.best.describe()
        lines.append(
            f"winner (*): [trial {winner.number}] {winner.label}{'' if plan == winner.label else f' = {plan}'}: "
            f"{_fmt_rate(winner.samples_per_second)} samples/s, peak {format_bytes(winner.peak_bytes)}, "
            f"activation {format_bytes(winner.activation_bytes)}, recompute {_fmt_overhead(winner.recompute_overhead)}"
        )
        best_base = _best_feasible_baseline(result)
        if best_base is None:
            lines.append("vs baselines: no baseline fit the budget, so there is none to compare against.")
        else:
            name, base = best_base
            if base.number == winner.number:
                lines.append(f"vs baselines: the winner is the best feasible baseline itself ({name}).")
            else:
                lines.append(
                    f"vs best feasible baseline {name} ({_fmt_rate(base.samples_per_second)} samples/s, "
                    f"{mem} {format_bytes(_constrained(base, budget))}): "
                    f"{_ratio(winner.samples_per_second, base.samples_per_second)} samples/s, "
                    f"{_ratio(_constrained(winner, budget), _constrained(base, budget))} {mem} memory"
                )
    description = budget.description or budget.kind
    if budget.kind == "none" or budget.limit_bytes is None:
        lines.append(f"budget: {description} (no memory limit)")
    else:
        lines.append(f"budget: {description} (constrains {mem} memory, limit {format_bytes(budget.limit_bytes)})")
    n_pruned = sum(t.status == "pruned" for t in result.trials)
    lines.append(
        f"tuning cost: {result.tuning_seconds:.1f} s, {result.tuning_steps} steps over {len(result.trials)} trials "
        f"({result.n_measured} run, {n_pruned} pruned by the memory model)"
    )
    if compiled:
        compiling = [s for t in result.trials if (s := _compile_stats(t)) is not None]
        n_conflicts = sum(bool(t.extra.get("conflict")) for t in result.trials)
        lines.append(
            f"torch.compile: {sum(s.get('compile_seconds', 0.0) for s in compiling):.1f} s compiling {len(compiling)} "
            f"plans (in the tuning cost, not in samples/s); {n_conflicts} plan(s) conflicted with the compiler"
            f"{'' if not n_conflicts else ' (status conflict, or allowed: see compile_conflicts)'}; memory of a "
            "compiled step on CPU = saved-for-backward bytes (see lightning_ckpt.compile)"
        )
    if result.fell_back:
        chosen = f" ({winner.label}, {mem} {format_bytes(_constrained(winner, budget))})" if winner else ""
        lines.append(
            f"NOTHING FIT THE BUDGET: no plan measured within {description}; fell back to the lowest-memory "
            f"plan{chosen}. Raise the budget or reduce the batch size."
        )
    return "\n".join(lines)


def plan_markdown(plan: Plan, trial: TrialRecord | None = None) -> str:
    """The plan as a markdown table (one row per checkpointed block) plus the figures that chose it.

    Markdown because TensorBoard's text dashboard renders tables; block names go in backticks so
    their dots and underscores are not read as emphasis.
    """
    title = f"**Checkpointing plan** `{plan.name}`" if plan.name else "**Checkpointing plan**"
    lines = [f"{title}: {plan.describe()} (digest `{plan.digest()}`)", ""]
    if plan.is_empty:
        lines.append("No checkpointing: every block runs as usual.")
    else:
        lines += ["| block | mode |", "|---|---|"]
        lines += [f"| `{fqn}` | {bp.describe()} |" for fqn, bp in plan.blocks.items()]
        lines += [f"| `{fqn or '<root>'}` (stack) | segments: {n} chunks |" for fqn, n in plan.segments.items()]
        lines += ["", "Blocks not listed are not checkpointed."]
    if trial is not None:
        lines += [
            "",
            f"**Measured** (trial {trial.number}, {trial.status}):",
            "",
            "| quantity | value |",
            "|---|---|",
            f"| samples/s | {_fmt_rate(trial.samples_per_second)} |",
            f"| peak memory | {format_bytes(trial.peak_bytes)} (predicted {format_bytes(trial.predicted_peak_bytes)}) |",
            f"| activation memory | {format_bytes(trial.activation_bytes)} "
            f"(predicted {format_bytes(trial.predicted_activation_bytes)}) |",
            f"| recompute overhead | {_fmt_overhead(trial.recompute_overhead)} |",
        ]
        if trial.median_seconds is not None:
            spread = f" ± {trial.spread_seconds:.4f}" if trial.spread_seconds is not None else ""
            lines.append(f"| step time (median) | {trial.median_seconds:.4f} s{spread} |")
    else:
        measured = plan.metadata.get("measured")
        if isinstance(measured, Mapping) and measured:
            lines += ["", "**Measured:**", "", "| quantity | value |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in measured.items()]
    return "\n".join(lines)


def _code_block(text: str) -> str:
    # Fenced so TensorBoard's markdown keeps the columns aligned (it renders fenced_code).
    return f"```\n{text}\n```"


# -- figure -----------------------------------------------------------------------------------------
def _measured(result: TuneResult) -> list[tuple[TrialRecord, int, float]]:
    out = []
    for t in result.trials:
        x = _constrained(t, result.budget)
        if x is not None and t.samples_per_second is not None:
            out.append((t, x, t.samples_per_second))
    return out


def pareto_front(result: TuneResult) -> list[TrialRecord]:
    """Measured trials that no other is better than on both memory and samples/s, by memory ascending.

    Memory is the budget's constrained quantity (peak when there is no budget). A trial is on the
    front when it is strictly faster than every trial using no more memory.
    """
    points = sorted(_measured(result), key=lambda p: (p[1], -p[2]))
    front: list[TrialRecord] = []
    best = -math.inf
    for t, _, y in points:
        if y > best:
            front.append(t)
            best = y
    return front


def _unit_for(max_bytes: float) -> tuple[str, float]:
    for name, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if max_bytes >= size:
            return name, size
    return "B", 1.0


def pareto_figure(result: TuneResult) -> Figure:
    """Throughput against the budget's memory quantity for every measured trial.

    The step line is the Pareto front (best samples/s achievable at each memory level), the dashed
    line the budget, and the ringed point the winner: at a glance it shows whether the winner sits
    on the front just inside the budget, and what more memory would buy. Trials that never ran
    (pruned, oom, errors) sit on the x axis at their *predicted* memory.

    Built on ``matplotlib.figure.Figure`` with an Agg canvas, never pyplot, so it touches no global
    backend state and works headless.
    """
    budget = result.budget
    mem = _memory_name(budget)
    measured = _measured(result)
    unmeasured = [
        (t, x)
        for t in result.trials
        if t.samples_per_second is None and (x := _constrained_predicted(t, budget)) is not None
    ]
    xs_all = [x for _, x, _ in measured] + [x for _, x in unmeasured]
    if budget.kind != "none" and budget.limit_bytes is not None:
        xs_all.append(budget.limit_bytes)
    unit, scale = _unit_for(max(xs_all, default=1.0))

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    for status, (colour, marker, text) in _STATUS_STYLE.items():
        px = [x / scale for t, x, _ in measured if t.status == status]
        py = [y for t, _, y in measured if t.status == status]
        if px:
            if status == "ok" and budget.kind == "none":
                text = "measured"
            ax.scatter(px, py, c=colour, marker=marker, s=50, label=text, zorder=3, edgecolors="black", linewidths=0.5)
    # Never-run trials: x in data coordinates, y pinned just above the axis.
    rug = blended_transform_factory(ax.transData, ax.transAxes)
    for status, (colour, marker, text) in _STATUS_STYLE.items():
        px = [x / scale for t, x in unmeasured if t.status == status]
        if px:
            ax.scatter(px, [0.03] * len(px), c=colour, marker=marker, s=45, label=text, transform=rug, zorder=3)
    other = [x / scale for t, x in unmeasured if t.status not in _STATUS_STYLE]
    if other:
        ax.scatter(other, [0.03] * len(other), c="black", marker="*", s=45, label="other (at predicted memory)")

    front = pareto_front(result)
    if front:
        fx = [_constrained(t, budget) / scale for t in front]  # type: ignore[operator]
        fy = [t.samples_per_second for t in front]
        ax.step(fx, fy, where="post", color="tab:blue", lw=1.5, alpha=0.7, label="Pareto front", zorder=2)

    for t, x, y in measured:
        if t.baseline is not None:
            # Under the markers (lower zorder) on a faint box: readable, yet never hides a point.
            ax.annotate(
                t.baseline,
                (x / scale, y),
                xytext=(7, 5),
                textcoords="offset points",
                fontsize=8,
                color="dimgray",
                zorder=2.5,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7},
            )

    winner = result.best_trial
    if winner is not None and _constrained(winner, budget) is not None and winner.samples_per_second is not None:
        wx, wy = _constrained(winner, budget) / scale, winner.samples_per_second  # type: ignore[operator]
        # Named in the legend, not next to the point: plan labels are long and points crowd the front.
        ax.scatter(
            [wx],
            [wy],
            s=320,
            facecolors="none",
            edgecolors="black",
            linewidths=2,
            label=f"winner: [trial {winner.number}] {winner.label}",
            zorder=4,
        )

    x_max = max(xs_all, default=1.0) / scale * 1.1
    if budget.kind != "none" and budget.limit_bytes is not None:
        lim = budget.limit_bytes / scale
        ax.axvline(lim, color="tab:red", ls="--", lw=1.5, label=f"budget: {format_bytes(budget.limit_bytes)} {mem}")
        ax.axvspan(lim, x_max, color="tab:red", alpha=0.06, lw=0)
    ax.set_xlim(0, x_max)
    y_max = max((y for _, _, y in measured), default=1.0)
    ax.set_ylim(0, y_max * 1.15)
    ax.set_xlabel(f"measured {mem} memory ({unit})")
    ax.set_ylabel("samples / s (median step)")
    title = f"Activation checkpointing trials: throughput vs {mem} memory"
    if result.fell_back:
        title += " (nothing fit: fell back to the lowest-memory plan)"
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    return fig


def text_tag(tag: str) -> str:
    """The name under which ``SummaryWriter.add_text(tag, ...)`` stores a text (what readers look up)."""
    return tag + TEXT_TAG_SUFFIX


def _figure_to_hwc(fig: Figure) -> np.ndarray:
    # SummaryWriter.add_figure does this too, but imports pyplot to close the figure; the
    # Agg canvas alone gives the same image without touching pyplot's global state.
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()


# -- TensorBoard --------------------------------------------------------------------------------------
def _hparam_value(v: Any) -> str | int | float:
    """A TensorBoard hparam value: numbers stay numbers, everything else becomes a readable string.

    Bools become "True"/"False" because ``summary.hparams`` would store them as 1.0/0.0; ``None``
    becomes "None" because it would be dropped, leaving a blank that reads like a missing value.
    """
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, (int, float, str)):
        return v
    if hasattr(v, "item"):  # numpy / torch scalars
        return _hparam_value(v.item())
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=str) if isinstance(v, (set, frozenset)) else v
        return ",".join(str(x) for x in items)
    return str(v)


def log_trial(writer: SummaryWriter, trial: TrialRecord) -> None:
    """Log one finished trial: its scalars (global_step = trial number) and its HParams row.

    Called as each trial finishes, so TensorBoard shows the search while it runs. Quantities a
    trial did not produce (a pruned trial has no throughput) are skipped, not logged as NaN, so the
    charts and the HParams table only show real measurements. The HParams row is a separate run
    ``trial_NNN`` under the writer's directory: the plugin shows one row per run that holds a
    session. No experiment summary is written on purpose: TensorBoard then derives the columns
    from the union of all trials' hparams, whereas an experiment summary (one per run, as
    ``add_hparams`` writes) is taken from an arbitrary run and hides dimensions other trials have.
    For the same reason, any other experiment summary under the directory TensorBoard is pointed
    at (Lightning's ``TensorBoardLogger`` writes one for ``hp_metric`` unless
    ``default_hp_metric=False``) replaces these columns; point TensorBoard at this writer's
    directory to see them.
    """
    n = trial.number
    scalars = {
        TAG_SAMPLES_PER_SECOND: trial.samples_per_second,
        TAG_PEAK_MIB: None if trial.peak_bytes is None else trial.peak_bytes / _MIB,
        TAG_PREDICTED_PEAK_MIB: None if trial.predicted_peak_bytes is None else trial.predicted_peak_bytes / _MIB,
        TAG_ACTIVATION_MIB: None if trial.activation_bytes is None else trial.activation_bytes / _MIB,
        TAG_PREDICTED_ACTIVATION_MIB: (
            None if trial.predicted_activation_bytes is None else trial.predicted_activation_bytes / _MIB
        ),
        TAG_RECOMPUTE_OVERHEAD: trial.recompute_overhead,
        TAG_STATUS_CODE: STATUS_CODES.get(trial.status, UNKNOWN_STATUS_CODE),
        TAG_TRIAL_SECONDS: trial.seconds,
    }
    stats = _compile_stats(trial)
    if stats is not None:
        scalars.update(
            {
                TAG_COMPILE_SECONDS: stats.get("compile_seconds"),
                TAG_GRAPH_BREAKS: stats.get("graph_breaks"),
                TAG_RECOMPILES: stats.get("recompiles"),
            }
        )
    for tag, value in scalars.items():
        if value is not None:
            writer.add_scalar(tag, float(value), global_step=n)

    hparams = {str(k): _hparam_value(v) for k, v in trial.params.items()}
    hparams.update(label=trial.label, status=trial.status)  # ours win over a same-named dimension
    metrics = {
        HPARAM_SAMPLES_PER_SECOND: scalars[TAG_SAMPLES_PER_SECOND],
        HPARAM_PEAK_MIB: scalars[TAG_PEAK_MIB],
        HPARAM_ACTIVATION_MIB: scalars[TAG_ACTIVATION_MIB],
        HPARAM_PREDICTED_PEAK_MIB: scalars[TAG_PREDICTED_PEAK_MIB],
        HPARAM_RECOMPUTE_OVERHEAD: scalars[TAG_RECOMPUTE_OVERHEAD],
    }
    metrics = {k: float(v) for k, v in metrics.items() if v is not None}
    _experiment, session_start, session_end = hparams_summaries(hparams, metrics)
    with SummaryWriter(log_dir=os.path.join(writer.get_logdir(), TRIAL_RUN_FORMAT.format(n))) as run:
        run.file_writer.add_summary(session_start, n)
        run.file_writer.add_summary(session_end, n)
        for tag, value in metrics.items():
            run.add_scalar(tag, value, global_step=n)
    writer.flush()


def write_tensorboard(
    writer_or_logdir: SummaryWriter | str | os.PathLike[str],
    result: TuneResult,
    *,
    memory_breakdown_table: str | None = None,
    log_trials: bool = True,
) -> Path:
    """Write the whole tuning report to TensorBoard and ``pareto.png``; return the log directory.

    ``writer_or_logdir``: a ``SummaryWriter`` (e.g. a Lightning ``TensorBoardLogger.experiment``),
    which is flushed but left open for its owner; or a directory, for which a writer is opened and
    closed here. ``memory_breakdown_table`` overrides ``result.memory_table``. Pass
    ``log_trials=False`` when ``log_trial`` already logged every trial to this writer, or their
    scalars and HParams sessions would be written twice.
    """
    if isinstance(writer_or_logdir, SummaryWriter):
        writer, owned = writer_or_logdir, False
    else:
        writer, owned = SummaryWriter(log_dir=os.fspath(writer_or_logdir)), True
    try:
        logdir = Path(writer.get_logdir())
        if log_trials:
            for trial in result.trials:
                log_trial(writer, trial)
        writer.add_text(TAG_PLAN, plan_markdown(result.best, result.best_trial), global_step=0)
        memory_table = memory_breakdown_table if memory_breakdown_table is not None else result.memory_table
        if memory_table:
            writer.add_text(TAG_MEMORY_BREAKDOWN, _code_block(memory_table), global_step=0)
        writer.add_text(TAG_SUMMARY, _code_block(summary_table(result)), global_step=0)
        if any(_compile_stats(t) is not None for t in result.trials):
            writer.add_text(TAG_CONFLICTS, conflicts_markdown(result), global_step=0)
        fig = pareto_figure(result)
        logdir.mkdir(parents=True, exist_ok=True)
        fig.savefig(logdir / PARETO_PNG, dpi=110)
        writer.add_image(TAG_PARETO, _figure_to_hwc(fig), global_step=0, dataformats="HWC")
        writer.flush()
    finally:
        if owned:
            writer.close()
    return logdir
