"""Reporting: progress lines, the summary table, the Pareto figure and everything written to TensorBoard.

This is the only module that formats results for people or writes TensorBoard, so the tag names,
units and status codes live here and nowhere else. It takes plain data (``TrialRecord``,
``TuneResult``) and a ``torch.utils.tensorboard.SummaryWriter`` (or a log directory), never a
Trainer: the Lightning callback and a plain script call it the same way.

TensorBoard layout, under a Lightning ``TensorBoardLogger`` (``version_N`` is the Trainer's run)::

    version_N/                       the HParams experiment (the table's columns, see experiment_summary),
                                     written before Lightning's own so the tuner's columns win
    version_N/lightning_ckpt/        the search run: one point per trial (global_step = trial number)
        lightning_ckpt/trial/...           TRIAL_SCALAR_TAGS, only what each trial produced
        lightning_ckpt/search/best_samples_per_second   the best-so-far curve
        lightning_ckpt/1_summary           text*: the verdict, then every trial, fastest first
        lightning_ckpt/2_plan              text*: the chosen plan as a markdown table
        lightning_ckpt/3_memory_breakdown  text*: the memory model's per-block table (markdown)
        lightning_ckpt/pareto              image: the Pareto figure (also saved as pareto.png)
    version_N/lightning_ckpt/table/01_winner_trial_012, 02_trial_005, ...
                                     the HParams rows: at most HPARAM_ROWS leaders, one run each, so the
                                     run count stays small whatever the number of trials

    * torch's ``add_text`` stores text under ``<tag>/text_summary``; ``text_tag(TAG_PLAN)`` gives that name.

Compiled trials (``torch.compile``, see ``lightning_ckpt.search.compile``) add ``COMPILE_SCALAR_TAGS`` per
trial (compile seconds, graph breaks, recompiles) and a ``lightning_ckpt/4_compile_conflicts`` text
listing every plan that conflicted with the compiler and why.

Memory is logged in MiB (2**20 bytes) so the scalar charts read naturally; the text uses
``format_bytes``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from torch.utils.tensorboard import SummaryWriter

from lightning_ckpt.budget import Budget, format_bytes
from lightning_ckpt.plan.format import Plan, block_names
from lightning_ckpt.search.records import CHOICE_RULE, TrialRecord, TuneResult

__all__ = [
    "COMPILE_SCALAR_TAGS",
    "HPARAM_COLUMNS",
    "HPARAM_METRICS",
    "HPARAM_METRIC_TAGS",
    "HPARAM_ROWS",
    "HPARAM_RUN_DIR",
    "WINNER_MARK",
    "hparam_name",
    "NOISY_SPREAD",
    "PARETO_PNG",
    "TAG_BEST_SAMPLES_PER_SECOND",
    "TAG_CONFLICTS",
    "TAG_MEMORY_BREAKDOWN",
    "TAG_PARETO",
    "TAG_PLAN",
    "TAG_PREFIX",
    "TAG_SUMMARY",
    "TEXT_TAG_SUFFIX",
    "TRIAL_SCALAR_TAGS",
    "best_so_far",
    "conflicts_markdown",
    "experiment_summary",
    "log_trial",
    "memory_markdown",
    "pareto_figure",
    "pareto_front",
    "result_line",
    "SearchProgress",
    "timing_warning",
    "plan_markdown",
    "summary_markdown",
    "summary_table",
    "table_trials",
    "text_tag",
    "trial_line",
    "verdict_lines",
    "write_experiment",
    "write_hparams_table",
    "write_tensorboard",
]

# -- TensorBoard names: the one place they are defined -------------------------------------------
TAG_PREFIX = "lightning_ckpt"

# The search run: one point per trial, global_step = trial number. Only quantities a trial produced
# are logged (a pruned trial has no throughput), so every point is a real figure; plans differ from
# one step to the next, so read these at smoothing 0. The best-so-far series is a true curve.
TAG_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/trial/samples_per_second"
TAG_PEAK_MIB = f"{TAG_PREFIX}/trial/peak_memory_mib"
TAG_PREDICTED_PEAK_MIB = f"{TAG_PREFIX}/trial/predicted_peak_memory_mib"
TAG_ACTIVATION_MIB = f"{TAG_PREFIX}/trial/activation_memory_mib"
TAG_PREDICTED_ACTIVATION_MIB = f"{TAG_PREFIX}/trial/predicted_activation_memory_mib"
TAG_RECOMPUTE_OVERHEAD = f"{TAG_PREFIX}/trial/recompute_overhead"
TAG_TRIAL_SECONDS = f"{TAG_PREFIX}/trial/seconds"
TAG_BEST_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/search/best_samples_per_second"
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
    TAG_TRIAL_SECONDS,
)

# The HParams table. TensorBoard shows one row per run holding a session, and its Scalars/Time
# Series views deselect every run once there are more than 40, so the table holds the leaders only
# (HPARAM_ROWS runs, winner first) and the search's other trials live in the search run and the
# summary text. The columns are declared once (``experiment_summary``) so every row shows the same
# ones; the metrics are scalars in each row's run, named apart from the per-trial series.
HPARAM_RUN_DIR = "table"  # rows: <search run>/table/01_winner_trial_012, 02_trial_005, ...
HPARAM_ROWS = 10
# (key, display name, description), in the order the table shows them; plan dimensions are the search
# space's (space.SearchSpace.suggest). TensorBoard orders columns by name and shows the first few by
# default, so each is stored under ``hparam_name(key)``, which numbers them in this order.
HPARAM_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("winner", "winner", "\u2605 marks the plan that was locked in"),
    ("plan", "plan", "which blocks are checkpointed, and how"),
    ("status", "status", "ok = measured within the budget"),
    ("trial", "trial", "trial number (the x axis of the per-trial scalars)"),
    ("mode", "mode", "search dimension: how the selected blocks are checkpointed"),
    ("selection", "blocks", "search dimension: which blocks the mode applies to"),
    ("rest_mode", "other blocks", "search dimension: the mode of the blocks not selected"),
    ("structure", "structure", "search dimension: blocks, segments or pt2_budget"),
    ("chunks", "chunks", "search dimension: segment count (sqrt(N)-style)"),
    ("compile_budget", "pt2 budget", "search dimension: torch.compile activation_memory_budget"),
    ("baseline", "baseline", "the fixed recipe this trial is, if any"),
)
_COLUMN_ORDER = {key: i for i, (key, _, _) in enumerate(HPARAM_COLUMNS, start=1)}


def hparam_name(key: str) -> str:
    """The stored name of the table column ``key`` (e.g. ``"02_plan"``): numbered, so TensorBoard keeps our order."""
    return f"{_COLUMN_ORDER[key]:02d}_{key}"


HPARAM_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/table/samples_per_second"
HPARAM_PEAK_MIB = f"{TAG_PREFIX}/table/peak_memory_mib"
HPARAM_ACTIVATION_MIB = f"{TAG_PREFIX}/table/activation_memory_mib"
HPARAM_PREDICTED_PEAK_MIB = f"{TAG_PREFIX}/table/predicted_peak_memory_mib"
HPARAM_RECOMPUTE_PERCENT = f"{TAG_PREFIX}/table/recompute_percent"
HPARAM_METRICS: tuple[tuple[str, str, str], ...] = (
    (HPARAM_SAMPLES_PER_SECOND, "samples/s", "median-step throughput (confirmed side by side for the leaders)"),
    (HPARAM_PEAK_MIB, "peak MiB", "peak memory of the training step"),
    (HPARAM_ACTIVATION_MIB, "activation MiB", "activation memory (peak above the resting state)"),
    (HPARAM_PREDICTED_PEAK_MIB, "predicted peak MiB", "the memory model's prediction"),
    (HPARAM_RECOMPUTE_PERCENT, "recompute %", "extra forward FLOPs recomputed in backward"),
)
HPARAM_METRIC_TAGS = tuple(tag for tag, _, _ in HPARAM_METRICS)

# Text tags as passed to add_text; torch stores each as f"{tag}{TEXT_TAG_SUFFIX}" (see text_tag).
# Numbered because TensorBoard's Text tab lists tags alphabetically: the verdict first.
TAG_SUMMARY = f"{TAG_PREFIX}/1_summary"
TAG_PLAN = f"{TAG_PREFIX}/2_plan"
TAG_MEMORY_BREAKDOWN = f"{TAG_PREFIX}/3_memory_breakdown"
TAG_PARETO = f"{TAG_PREFIX}/pareto"
TAG_CONFLICTS = f"{TAG_PREFIX}/4_compile_conflicts"
TEXT_TAG_SUFFIX = "/text_summary"

PARETO_PNG = "pareto.png"
# Relative step-time spread (MAD / median) above which two overlapping leaders are a noise problem, not a tie.
NOISY_SPREAD = 0.02
WINNER_MARK = "\u2605"

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

    ``[trial 3] selective(mlp) h.0-7 | 123.4 samples/s | peak 1.2 GiB (pred 1.1 GiB) | ok``. Under an
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


def timing_warning(result: TuneResult, noisy: float = NOISY_SPREAD) -> str | None:
    """A warning when the two fastest plans that fit were timed side by side and still overlap within spreads
    wider than ``noisy`` (relative): the machine was too noisy to tell them apart, so the choice between them
    is not a speed verdict. Two plans overlapping within tight spreads are simply as fast: no warning."""
    confirmed = sorted(
        (t for t in result.trials if t.feasible and len(t.confirmation_seconds) >= 2),
        key=lambda t: -(t.samples_per_second or 0.0),
    )
    if len(confirmed) < 2:
        return None
    stats = []
    for t in confirmed[:2]:
        med = statistics.median(t.confirmation_seconds)
        stats.append((t, med, statistics.median(abs(x - med) for x in t.confirmation_seconds)))
    (a, ma, da), (b, mb, db) = stats
    if abs(mb - ma) > da + db or max(da / ma, db / mb) <= noisy:
        return None
    return (
        f"lightning_ckpt: timing spread too high to separate the leaders: [{a.label}] "
        f"({_fmt_rate(a.samples_per_second)} samples/s, \u00b1{da / ma:.1%}) and [{b.label}] "
        f"({_fmt_rate(b.samples_per_second)} samples/s, \u00b1{db / mb:.1%}) overlap after "
        f"{min(len(a.confirmation_seconds), len(b.confirmation_seconds))} side-by-side rounds: they could not be "
        "separated, so the tie rule chose between them (a baseline is kept; between tuned plans, lower memory), not "
        "speed. Something else was loading the machine; tune on an idle machine or raise measure_steps for a speed "
        "verdict."
    )


def result_line(result: TuneResult) -> str:
    """The one line a quiet search ends with (like Lightning's BatchSizeFinder): what was chosen, how fast, how
    much memory against the budget, against the best baseline that fits, and what the search cost."""
    winner, budget = result.best_trial, result.budget
    mem = _memory_name(budget)
    parts = [f"lightning_ckpt: chose {result.best.describe()}"]
    if winner is not None:
        used = _constrained(winner, budget)
        limit = f" of {format_bytes(budget.limit_bytes)}" if budget.limit_bytes is not None else ""
        parts.append(f"{_fmt_rate(winner.samples_per_second)} samples/s, {mem} {format_bytes(used)}{limit}")
        base = _best_feasible_baseline(result)
        if base is not None and base[1].number != winner.number:
            parts.append(
                f"{_ratio(winner.samples_per_second, base[1].samples_per_second)} the best baseline that fits ({base[0]})"
            )
        elif base is not None:
            parts.append(f"the baseline {base[0]}: no tuned plan beat it")
    if result.fell_back:
        parts.append("NOTHING FIT THE BUDGET (fell back to the lowest-memory plan)")
    if (result.best.metadata.get("search") or {}).get("speed_changes"):
        parts.append("the machine's speed changed during the search: chosen on side-by-side figures only")
    n_pruned = sum(t.status == "pruned" for t in result.trials)
    parts.append(
        f"tuned in {result.tuning_seconds:.1f} s ({len(result.trials)} plans: {result.n_measured} run, "
        f"{n_pruned} ruled out by the memory model)"
    )
    return " | ".join(parts)


class SearchProgress:
    """What a user watches during the search: one progress bar, nothing else unless ``verbose``.

    Called with each finished trial (a ``ProgressFn``): advances the bar (best plan so far in its postfix),
    streams the trial's scalars and the best-so-far curve to ``writer``, and with ``verbose`` writes the
    trial's line above the bar. ``confirming`` announces the side-by-side round, whose figures replace the
    streamed ones. A plain object, no Lightning: the callback pauses Lightning's own bar around it.
    """

    def __init__(
        self, total: int, *, writer: SummaryWriter | None = None, verbose: bool = False, enabled: bool = True,
        file: Any = None,
    ) -> None:  # fmt: skip
        from tqdm.auto import tqdm

        self.writer, self.verbose, self.enabled = writer, verbose, enabled
        self.best: float | None = None
        self.pruned = 0
        self.bar = tqdm(
            total=total, desc="lightning_ckpt: tuning", unit="plan", disable=not enabled, leave=False, file=file,
            dynamic_ncols=True,
        )  # fmt: skip

    def __call__(self, trial: TrialRecord, budget: Budget) -> None:
        if trial.feasible and trial.samples_per_second is not None:
            self.best = max(self.best or 0.0, trial.samples_per_second)
        if self.writer is not None:
            log_trial(self.writer, trial, best_samples_per_second=self.best)
        if self.verbose:
            self.write(trial_line(trial, budget))
        if trial.status == "pruned":
            self.pruned += 1  # costs no step and does not count towards n_trials: not a step of the bar
        else:
            if self.bar.total is not None and self.bar.n >= self.bar.total:
                self.bar.total = self.bar.n + 1
            self.bar.update(1)
        postfix = [f"best {self.best:.1f} samples/s"] if self.best is not None else []
        postfix += [f"{self.pruned} ruled out by the memory model"] if self.pruned else []
        self.bar.set_postfix_str(", ".join(postfix))

    def confirming(self, trials: Sequence[TrialRecord]) -> None:
        self.bar.set_description_str("lightning_ckpt: confirming")
        self.write(
            f"lightning_ckpt: confirming the {len(trials)} fastest plans side by side in interleaved rounds; their "
            "samples/s will replace the figures streamed so far, which were timed one plan at a time."
        )

    def write(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text, file=self.bar.fp)
        else:
            print(text)

    def close(self) -> None:
        self.bar.close()


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
    """The fastest fitting baseline; beside a winner re-timed side by side, only baselines re-timed with it
    (a ratio of figures taken at different moments, on a machine whose load changed, means nothing)."""
    best: tuple[str, TrialRecord] | None = None
    same_moment = result.best_trial is not None and result.best_trial.confirmed
    for name, t in result.baselines.items():
        if same_moment and not t.confirmed:
            continue
        faster = best is None or (t.samples_per_second or 0.0) > (best[1].samples_per_second or 0.0)
        if t.feasible and t.samples_per_second is not None and faster:
            best = (name, t)
    return best


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def _by_throughput(result: TuneResult) -> list[TrialRecord]:
    """The winner, then measured trials fastest first, then the rest in trial order: the order people read in."""
    winner = result.best_trial
    others = [t for t in result.trials if winner is None or t.number != winner.number]
    measured = sorted((t for t in others if t.samples_per_second is not None), key=lambda t: -t.samples_per_second)
    rest = [t for t in others if t.samples_per_second is None]
    return ([winner] if winner is not None else []) + measured + rest


def verdict_lines(result: TuneResult) -> list[str]:
    """What won, by how much against the best baseline that fits, under which budget, at what tuning cost.

    Against the best baseline that *fits*: beating one that would not run under the budget proves nothing.
    """
    budget = result.budget
    winner = result.best_trial
    mem = _memory_name(budget)
    lines = []
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
    if result.fell_back:
        chosen = f" ({winner.label}, {mem} {format_bytes(_constrained(winner, budget))})" if winner else ""
        lines.append(
            f"NOTHING FIT THE BUDGET: no plan measured within {budget.description or budget.kind}; fell back to the "
            f"lowest-memory plan{chosen}. Raise the budget or reduce the batch size."
        )
    search = result.best.metadata.get("search") or {}
    if search.get("tie_tolerance") is not None:
        lines.append(f"rule: {CHOICE_RULE} (tie tolerance {search['tie_tolerance']:.1%})")
    lines += [f"machine speed changed {change}" for change in search.get("speed_changes") or ()]
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
    compiling = [s for t in result.trials if (s := _compile_stats(t)) is not None]
    if compiling:
        n_conflicts = sum(bool(t.extra.get("conflict")) for t in result.trials)
        lines.append(
            f"torch.compile: {sum(s.get('compile_seconds', 0.0) for s in compiling):.1f} s compiling {len(compiling)} "
            f"plans (in the tuning cost, not in samples/s); {n_conflicts} plan(s) conflicted with the compiler"
            f"{'' if not n_conflicts else ' (status conflict, or allowed: see compile_conflicts)'}; memory of a "
            "compiled step on CPU = saved-for-backward bytes (see lightning_ckpt.search.compile)"
        )
    return lines


def _summary_rows(result: TuneResult) -> list[tuple[str, ...]]:
    winner = result.best_trial
    header: tuple[str, ...] = (
        "", "#", "label", "status", "pred peak", "peak", "activation", "samples/s", "recompute", "seconds",
    )  # fmt: skip
    compiled = any(_compile_stats(t) is not None for t in result.trials)
    if compiled:
        header += ("compile s",)
    rows = [header]
    for t in _by_throughput(result):
        stats = _compile_stats(t)
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
                _fmt_rate(t.samples_per_second),
                _fmt_overhead(t.recompute_overhead),
                f"{t.seconds:.1f}",
                *compile_cell,
            )
        )
    return rows


def summary_table(result: TuneResult) -> str:
    """The verdict first, then every trial as a fixed-width table, fastest first (the winner marked '*')."""
    rows = _summary_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    left = {0, 2, 3}  # text columns; numbers align right
    lines = [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "-" * len(max(lines, key=len)))
    return "\n".join([*verdict_lines(result), "", *lines])


def summary_markdown(result: TuneResult) -> str:
    """The summary for TensorBoard's Text tab: the verdict, then the trials as a table, fastest first."""
    rows = _summary_rows(result)
    verdict = [line.replace("winner (*)", "winner (bold)", 1) for line in verdict_lines(result)]
    out = [f"- {_escape(line)}" for line in verdict]
    out += ["", "| " + " | ".join(rows[0][1:]) + " |", "|" + "---|" * (len(rows[0]) - 1)]
    for r in rows[1:]:
        cells = [_escape(c) if i == 1 else c for i, c in enumerate(r[1:])]
        cells = [f"**{c}**" if r[0] == "*" and c else c for c in cells]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Bold: the winner. `~`: memory predicted by the memory model (the trial was timed only)."]
    return "\n".join(out)


def _escape(text: str) -> str:
    # Markdown would read '|' as a column break and '*' / '_' as emphasis.
    return text.replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")


def memory_markdown(breakdown: Mapping[str, Any], plan: Plan | None = None) -> str:
    """The memory model's breakdown (``MemoryModel.to_dict``) as markdown tables in MiB.

    Tables, not fixed-width text: TensorBoard wraps table cells to the page, while a wide code block is
    cut off on the right. Modes are rows and blocks columns, and blocks with the same figures (and the
    same mode in ``plan``) share one column (``h.0-7``), so a 48-layer model still reads at a glance.
    """

    def mib(n: Any) -> str:
        return "-" if n is None else f"{n / _MIB:.1f}"

    lines = [
        f"**Memory profile** on {breakdown.get('device', '?')} (MiB)",
        "",
        "| part | MiB |",
        "|---|---|",
        f"| parameters | {mib(breakdown.get('parameter_bytes'))} |",
        f"| gradients | {mib(breakdown.get('gradient_bytes'))} |",
        f"| optimizer state | {mib(breakdown.get('optimizer_state_bytes'))} |",
        f"| buffers | {mib(breakdown.get('buffer_bytes'))} |",
        f"| activations outside the blocks | {mib(breakdown.get('other_activation_bytes'))} |",
    ]
    blocks = list(breakdown.get("blocks") or [])
    if not blocks:
        return "\n".join(lines)
    in_plan = plan is not None and not plan.is_empty

    def mode_of(fqn: str) -> str:
        bp = plan.blocks.get(fqn) if plan is not None else None
        return bp.describe() if bp is not None else "none"

    keys = list(dict.fromkeys(k for b in blocks for k in b.get("saved_bytes", {})))
    groups: dict[tuple[Any, ...], list[str]] = {}
    for b in blocks:
        saved = b.get("saved_bytes", {})
        signature = (tuple(saved.get(k) for k in keys), b.get("recompute_transient_bytes"), mode_of(b["fqn"]))
        groups.setdefault(signature, []).append(b["fqn"])
    all_fqns = [b["fqn"] for b in blocks]
    headers = [block_names(fqns, among=all_fqns) for fqns in groups.values()]
    lines += [
        "",
        "Saved activations one block keeps from forward to backward under each mode (blocks with the same "
        "figures share a column); *recompute*: the transient of a fully checkpointed block's backward."
        + (" Last row: the chosen plan." if in_plan else ""),
        "",
        "| mode | " + " | ".join(f"`{h}`" for h in headers) + " |",
        "|---|" + "---|" * len(headers),
    ]
    for i, k in enumerate(keys):
        lines.append(f"| {k} | " + " | ".join(mib(sig[0][i]) for sig in groups) + " |")
    lines.append("| *recompute* | " + " | ".join(mib(sig[1]) for sig in groups) + " |")
    if in_plan:
        lines.append("| **plan** | " + " | ".join(f"**{sig[2]}**" for sig in groups) + " |")
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

    winner = result.best_trial
    wxy = None
    if winner is not None and _constrained(winner, budget) is not None and winner.samples_per_second is not None:
        wxy = (_constrained(winner, budget) / scale, winner.samples_per_second)  # type: ignore[operator]
    x_span = max(xs_all, default=1.0) / scale * 1.1
    y_span = max((y for _, _, y in measured), default=1.0) * 1.15

    def near_winner(x: float, y: float) -> bool:
        return wxy is not None and abs(x - wxy[0]) < 0.08 * x_span and abs(y - wxy[1]) < 0.08 * y_span

    for t, x, y in measured:
        if t.baseline is not None and (winner is None or t.number != winner.number):
            # Under the markers on a faint box; below the point when above it would sit on the winner's ring.
            below = near_winner(x / scale, y) and y <= (wxy[1] if wxy else y)  # type: ignore[index]
            ax.annotate(
                t.baseline,
                (x / scale, y),
                xytext=(7, -13 if below else 5),
                textcoords="offset points",
                fontsize=8,
                color="dimgray",
                zorder=2.5,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7},
            )

    if wxy is not None and winner is not None:
        wx, wy = wxy
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
        # Named on the plot too, with an arrow from the side away from the crowded front (up and to the left).
        name = f"winner (trial {winner.number})" + (f" = {winner.baseline}" if winner.baseline else "")
        ax.annotate(
            name,
            (wx, wy),
            xytext=(-30, 22),
            textcoords="offset points",
            ha="right",
            fontsize=9,
            fontweight="bold",
            zorder=5,
            arrowprops={"arrowstyle": "->", "color": "black", "lw": 1.2, "shrinkB": 10},
            bbox={"boxstyle": "round,pad=0.25", "fc": "lightyellow", "ec": "black", "lw": 0.8},
        )

    x_max = x_span
    if budget.kind != "none" and budget.limit_bytes is not None:
        lim = budget.limit_bytes / scale
        ax.axvline(lim, color="tab:red", ls="--", lw=1.5, label=f"budget: {format_bytes(budget.limit_bytes)} {mem}")
        ax.axvspan(lim, x_max, color="tab:red", alpha=0.06, lw=0)
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, y_span)
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


def _hparams_summary(tag: str, **data: Any) -> Summary:
    # What tensorboard.plugins.hparams.summary builds, without its TensorFlow import.
    content = plugin_data_pb2.HParamsPluginData(version=hparams_metadata.PLUGIN_DATA_VERSION, **data)
    plugin = SummaryMetadata.PluginData(plugin_name=hparams_metadata.PLUGIN_NAME, content=content.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def _hparam_type(value: Any) -> int:
    if isinstance(value, bool):
        return api_pb2.DATA_TYPE_BOOL
    if isinstance(value, (int, float)):
        return api_pb2.DATA_TYPE_FLOAT64
    return api_pb2.DATA_TYPE_STRING


_NUMERIC_COLUMNS = frozenset({"compile_budget"})  # TensorBoard shows numbers as 41.000: counts read better as text


def experiment_summary(other_hparams: Mapping[str, Any] | None = None) -> Summary:
    """The HParams experiment: the table's columns and metrics, with short display names.

    TensorBoard takes the *first* experiment summary it reads in a run and ignores later ones, and
    Lightning's ``TensorBoardLogger`` writes one (the LightningModule's hyperparameters and
    ``hp_metric``) when the fit starts. Written before it, into the same run, this one wins, so the
    tuner's columns are the table's. ``other_hparams``: further columns (name -> an example value, for
    its type) to keep visible: the LightningModule's own hyperparameters, shown in the training run's row.
    """
    infos = [
        api_pb2.HParamInfo(
            name=hparam_name(name),
            display_name=display,
            description=description,
            differs=True,  # TensorBoard lists columns that differ first: the tuner's before the module's own
            type=api_pb2.DATA_TYPE_FLOAT64 if name in _NUMERIC_COLUMNS else api_pb2.DATA_TYPE_STRING,
        )
        for name, display, description in HPARAM_COLUMNS
    ]
    ours = {hparam_name(name) for name, _, _ in HPARAM_COLUMNS}
    infos += [
        api_pb2.HParamInfo(name=name, type=_hparam_type(value))
        for name, value in (other_hparams or {}).items()
        if name not in ours
    ]
    metrics = [
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=display, description=description)
        for tag, display, description in HPARAM_METRICS
    ]
    experiment = api_pb2.Experiment(
        description="Activation checkpointing trials (lightning_ckpt): the leaders, winner first.",
        time_created_secs=time.time(), hparam_infos=infos, metric_infos=metrics,
    )  # fmt: skip
    return _hparams_summary(hparams_metadata.EXPERIMENT_TAG, experiment=experiment)


def _session_start(hparams: Mapping[str, Any]) -> Summary:
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[name].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[name].number_value = value
        else:
            info.hparams[name].string_value = str(value)
    return _hparams_summary(hparams_metadata.SESSION_START_INFO_TAG, session_start_info=info)


def _session_end() -> Summary:
    info = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
    return _hparams_summary(hparams_metadata.SESSION_END_INFO_TAG, session_end_info=info)


def open_writer(log_dir: str | os.PathLike[str]) -> SummaryWriter:
    """A TensorBoard writer for the search's run in ``log_dir`` (TensorBoard is imported only in this package)."""
    return SummaryWriter(log_dir=str(log_dir))


def write_experiment(writer: SummaryWriter, other_hparams: Mapping[str, Any] | None = None) -> None:
    """Declare the HParams table in ``writer``'s run (see ``experiment_summary``); call before anyone else does."""
    writer.file_writer.add_summary(experiment_summary(other_hparams))
    writer.flush()


def _trial_scalars(trial: TrialRecord) -> dict[str, float]:
    scalars = {
        TAG_SAMPLES_PER_SECOND: trial.samples_per_second,
        TAG_PEAK_MIB: None if trial.peak_bytes is None else trial.peak_bytes / _MIB,
        TAG_PREDICTED_PEAK_MIB: None if trial.predicted_peak_bytes is None else trial.predicted_peak_bytes / _MIB,
        TAG_ACTIVATION_MIB: None if trial.activation_bytes is None else trial.activation_bytes / _MIB,
        TAG_PREDICTED_ACTIVATION_MIB: (
            None if trial.predicted_activation_bytes is None else trial.predicted_activation_bytes / _MIB
        ),
        TAG_RECOMPUTE_OVERHEAD: trial.recompute_overhead,
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
    return {tag: float(v) for tag, v in scalars.items() if v is not None}


def log_trial(writer: SummaryWriter, trial: TrialRecord, *, best_samples_per_second: float | None = None) -> None:
    """Log one finished trial's scalars at global_step = trial number, as it finishes.

    ``best_samples_per_second``: the fastest feasible throughput so far (this trial included), logged
    as the best-so-far curve. Nothing is logged as NaN: a quantity a trial did not produce is skipped.
    """
    for tag, value in _trial_scalars(trial).items():
        writer.add_scalar(tag, value, global_step=trial.number)
    if best_samples_per_second is not None:
        writer.add_scalar(TAG_BEST_SAMPLES_PER_SECOND, float(best_samples_per_second), global_step=trial.number)
    writer.flush()


def best_so_far(trials: Iterable[TrialRecord]) -> list[tuple[int, float]]:
    """(trial number, fastest feasible samples/s up to it) for each trial once a feasible one exists."""
    out, best = [], None
    for t in sorted(trials, key=lambda t: t.number):
        if t.feasible and t.samples_per_second is not None:
            best = t.samples_per_second if best is None else max(best, t.samples_per_second)
        if best is not None:
            out.append((t.number, best))
    return out


def table_trials(result: TuneResult, limit: int = HPARAM_ROWS) -> list[TrialRecord]:
    """The HParams table's rows: the winner, then measured trials fastest first (those that fit before
    those that do not), with the best feasible baseline kept in for comparison; at most ``limit``."""
    winner = result.best_trial
    rest = sorted(
        (
            t
            for t in result.trials
            if t.samples_per_second is not None and (winner is None or t.number != winner.number)
        ),
        key=lambda t: (not t.feasible, -(t.samples_per_second or 0.0), t.number),
    )
    rows = ([winner] if winner is not None else []) + rest
    chosen = rows[:limit]
    base = _best_feasible_baseline(result)
    if base is not None and limit > 1 and all(t.number != base[1].number for t in chosen):
        chosen[-1] = base[1]
    return chosen


def _row_run_name(rank: int, trial: TrialRecord, winner: TrialRecord | None) -> str:
    tag = "winner_" if winner is not None and trial.number == winner.number else ""
    return f"{HPARAM_RUN_DIR}/{rank:02d}_{tag}trial_{trial.number:03d}"


def write_hparams_table(writer: SummaryWriter, result: TuneResult, limit: int = HPARAM_ROWS) -> list[str]:
    """One HParams session (a run under ``writer``'s directory) per leader; returns their run names."""
    winner = result.best_trial
    names = []
    for rank, t in enumerate(table_trials(result, limit), start=1):
        is_winner = winner is not None and t.number == winner.number
        values: dict[str, Any] = {
            "winner": WINNER_MARK if is_winner else "",
            "plan": t.plan.describe(),
            "status": str(t.status),
            "trial": str(t.number),
            "baseline": t.baseline or "",
        }
        values.update({k: _hparam_value(v) for k, v in t.params.items() if k in _COLUMN_ORDER and k not in values})
        hparams = {hparam_name(k): v if k in _NUMERIC_COLUMNS else str(v) for k, v in values.items()}
        scalars = _trial_scalars(t)  # the same figures as the trial's own series, under the table's names
        metrics = {
            HPARAM_SAMPLES_PER_SECOND: scalars.get(TAG_SAMPLES_PER_SECOND),
            HPARAM_PEAK_MIB: scalars.get(TAG_PEAK_MIB),
            HPARAM_ACTIVATION_MIB: scalars.get(TAG_ACTIVATION_MIB),
            HPARAM_PREDICTED_PEAK_MIB: scalars.get(TAG_PREDICTED_PEAK_MIB),
            HPARAM_RECOMPUTE_PERCENT: None if t.recompute_overhead is None else 100.0 * t.recompute_overhead,
        }
        name = _row_run_name(rank, t, winner)
        with SummaryWriter(log_dir=os.path.join(writer.get_logdir(), name)) as run:
            run.file_writer.add_summary(_session_start(hparams))
            for tag, value in metrics.items():
                if value is not None:
                    run.add_scalar(tag, float(value), global_step=t.number)
            run.file_writer.add_summary(_session_end())
        names.append(name)
    return names


def write_tensorboard(
    writer_or_logdir: SummaryWriter | str | os.PathLike[str],
    result: TuneResult,
    *,
    memory_breakdown_table: str | None = None,
    log_trials: bool = True,
    write_experiment_summary: bool = True,
    other_hparams: Mapping[str, Any] | None = None,
) -> Path:
    """Write the whole tuning report to TensorBoard and ``pareto.png``; return the log directory.

    ``writer_or_logdir``: a ``SummaryWriter``, flushed but left open for its owner; or a directory,
    for which a writer is opened and closed here. ``memory_breakdown_table`` (markdown) overrides the
    table built from ``result.memory_breakdown``. ``log_trials=False`` when ``log_trial`` already
    streamed every trial to this writer. ``write_experiment_summary=False`` when the caller already
    declared the HParams table in a parent run (the Lightning callback writes it into the Trainer's
    run before Lightning's own; see ``experiment_summary``).
    """
    if isinstance(writer_or_logdir, SummaryWriter):
        writer, owned = writer_or_logdir, False
    else:
        writer, owned = SummaryWriter(log_dir=os.fspath(writer_or_logdir)), True
    try:
        logdir = Path(writer.get_logdir())
        if write_experiment_summary:
            write_experiment(writer, other_hparams)
        if log_trials:
            best = dict(best_so_far(result.trials))
            for t in result.trials:
                log_trial(writer, t, best_samples_per_second=best.get(t.number))
        write_hparams_table(writer, result)
        writer.add_text(TAG_SUMMARY, summary_markdown(result), global_step=0)
        writer.add_text(TAG_PLAN, plan_markdown(result.best, result.best_trial), global_step=0)
        memory = memory_breakdown_table
        if memory is None:
            memory = memory_markdown(result.memory_breakdown, result.best) if result.memory_breakdown else ""
        if not memory and result.memory_table:
            memory = _code_block(result.memory_table)
        if memory:
            writer.add_text(TAG_MEMORY_BREAKDOWN, memory, global_step=0)
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
