"""The Pareto figure: throughput against the budget's memory quantity for every trial, and its front.

matplotlib is imported here only (and only its object API, never pyplot), so drawing the figure touches no global
backend state and works headless."""

from __future__ import annotations

import math
import textwrap

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from lightning_ckpt.budget import Budget
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.report.quantities import (
    comparable_speeds,
    constrained_bytes,
    memory_name,
    predicted_constrained_bytes,
)
from lightning_ckpt.search.ledger import TrialRecord
from lightning_ckpt.search.result import TuneResult

__all__ = ["figure_to_hwc", "pareto_figure", "pareto_front"]

# Figure style per status: (colour, marker, legend text).
_STATUS_STYLE: dict[str, tuple[str, str, str]] = {
    "ok": ("tab:green", "o", "fits the budget"),
    "over_budget": ("tab:orange", "s", "over the budget"),
    "pruned": ("tab:gray", "x", "pruned by the memory model (at predicted memory)"),
    # Predicted to fit but not to be faster: inside the budget line, so it must not read as a memory prune.
    "pruned_by_time": ("tab:cyan", "|", "pruned by the time model (predicted slower; at predicted memory)"),
    "oom": ("tab:red", "X", "out of memory (at predicted memory)"),
    "invalid": ("tab:purple", "D", "invalid (at predicted memory)"),
    "error": ("tab:brown", "P", "error (at predicted memory)"),
    "conflict": ("tab:pink", "v", "conflicts with torch.compile"),
}


def _style(t: TrialRecord) -> str:
    """The ``_STATUS_STYLE`` key of ``t``: its status, with the time model's prunes told from the memory model's."""
    return "pruned_by_time" if t.status == "pruned" and t.pruned_by == "time" else str(t.status)


def _measured(result: TuneResult) -> list[tuple[TrialRecord, int, float]]:
    speeds = comparable_speeds(result)
    return [
        (t, x, speeds.get(t.number, t.samples_per_second))
        for t in result.trials
        if t.samples_per_second is not None and (x := constrained_bytes(t, result.budget)) is not None
    ]


def pareto_front(result: TuneResult) -> list[TrialRecord]:
    """Measured trials strictly faster than every trial using no more memory (the budget's constrained quantity:
    peak without a budget), by memory ascending."""
    front: list[TrialRecord] = []
    best = -math.inf
    for t, _, y in sorted(_measured(result), key=lambda p: (p[1], -p[2])):
        if y > best:
            front.append(t)
            best = y
    return front


def _unit_for(max_bytes: float) -> tuple[str, float]:
    units = (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))
    return next(((name, size) for name, size in units if max_bytes >= size), ("B", 1.0))


def pareto_figure(result: TuneResult) -> Figure:
    """Throughput against the budget's memory quantity for every measured trial: the step line is the Pareto front,
    the dashed line the budget, the ringed point the winner, so it shows whether the winner sits on the front just
    inside the budget, and what more memory would buy. Trials that never ran sit on the x axis at predicted memory."""
    budget, measured = result.budget, _measured(result)
    unmeasured = [
        (t, x)
        for t in result.trials
        if t.samples_per_second is None and (x := predicted_constrained_bytes(t, budget)) is not None
    ]
    xs_all = [x for _, x, _ in measured] + [x for _, x in unmeasured]
    if budget.kind != "none" and budget.limit_bytes is not None:
        xs_all.append(budget.limit_bytes)
    unit, scale = _unit_for(max(xs_all, default=1.0))

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # The legend lists artists in the order they are added: trials, the front, the winner, the budget.
    _plot_trials(ax, measured, unmeasured, scale, budget)
    points = {t.number: (x / scale, y) for t, x, y in measured}
    front = pareto_front(result)
    if len(front) >= 2:  # one point draws no line, and the legend would name a front that is not there
        fx, fy = zip(*(points[t.number] for t in front), strict=True)
        ax.step(fx, fy, where="post", color="tab:blue", lw=1.5, alpha=0.7, label="Pareto front", zorder=2)

    winner = result.best_trial
    wxy = points.get(winner.number) if winner is not None else None
    x_span = max(xs_all, default=1.0) / scale * 1.1
    y_span = max((y for _, _, y in measured), default=1.0) * 1.15
    _label_baselines(ax, measured, winner, wxy, scale, (x_span, y_span))
    if wxy is not None and winner is not None:
        _mark_winner(ax, winner, wxy)
    _frame(ax, result, unit, scale, (x_span, y_span))
    fig.legend(loc="outside lower center", ncols=_LEGEND_COLUMNS, fontsize=8)
    return fig


def _plot_trials(
    ax: Axes,
    measured: list[tuple[TrialRecord, int, float]],
    unmeasured: list[tuple[TrialRecord, int]],
    scale: float,
    budget: Budget,
) -> None:
    """Every trial by status: measured ones at their figures, never-run ones on a rug at predicted memory. Where a
    confirmation ran, plans re-timed beside the winner are filled, those timed one at a time hollow: a hollow point
    above the winner was timed in a quieter moment, not chosen wrongly."""
    side_by_side = any(t.confirmed for t, _, _ in measured)
    for status, (colour, marker, text) in _STATUS_STYLE.items():
        if status == "ok" and budget.kind == "none":
            text = "measured"
        group = [(t, x, y) for t, x, y in measured if _style(t) == status]
        filled = [(x / scale, y) for t, x, y in group if t.confirmed or not side_by_side]
        hollow = [(x / scale, y) for t, x, y in group if side_by_side and not t.confirmed]
        if filled:
            ax.scatter(*zip(*filled, strict=True), c=colour, marker=marker, s=50, label=_wrapped(text), zorder=3,
                       edgecolors="black", linewidths=0.5)  # fmt: skip
        if hollow:
            ax.scatter(*zip(*hollow, strict=True), marker=marker, s=50, label=None if filled else _wrapped(text),
                       zorder=3, facecolors="none", edgecolors=colour, linewidths=1.2)  # fmt: skip
    if side_by_side and any(not t.confirmed for t, _, _ in measured):
        ax.scatter([], [], marker="o", s=50, facecolors="none", edgecolors="black", linewidths=1.2, label=_HOLLOW)
    # Never-run trials: x in data coordinates, y pinned just above the axis.
    rug = blended_transform_factory(ax.transData, ax.transAxes)
    for status, (colour, marker, text) in _STATUS_STYLE.items():
        if px := [x / scale for t, x in unmeasured if _style(t) == status]:
            ax.scatter(
                px, [0.03] * len(px), c=colour, marker=marker, s=45, label=_wrapped(text), transform=rug, zorder=3
            )
    if other := [x / scale for t, x in unmeasured if _style(t) not in _STATUS_STYLE]:
        ax.scatter(other, [0.03] * len(other), c="black", marker="*", s=45, label="other (at predicted memory)")


# The legend's note on hollow points (``_plot_trials``).
_HOLLOW = "hollow: timed one plan at a time, not beside the winner (filled: side by side with it)"
# Legend entries wrap at this many characters: in ``_LEGEND_COLUMNS`` columns below the axes, a winner's label (its
# plan, block range after block range) ran past both edges of the image.
_LEGEND_WIDTH = 52
_LEGEND_COLUMNS = 2


def _wrapped(text: str) -> str:
    return "\n".join(textwrap.wrap(text, _LEGEND_WIDTH, break_long_words=True, subsequent_indent="  "))


def _label_baselines(
    ax: Axes,
    measured: list[tuple[TrialRecord, int, float]],
    winner: TrialRecord | None,
    wxy: tuple[float, float] | None,
    scale: float,
    span: tuple[float, float],
) -> None:
    """Name each measured baseline beside its point, clear of the winner's ring."""
    x_span, y_span = span
    for t, x, y in measured:
        if t.baseline is not None and (winner is None or t.number != winner.number):
            # Under the markers on a faint box; below the point when above it would sit on the winner's ring.
            wx, wy = wxy or (math.inf, math.inf)
            below = abs(x / scale - wx) < 0.08 * x_span and abs(y - wy) < 0.08 * y_span and y <= wy
            box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7}
            at = {"xytext": (7, -13 if below else 5), "textcoords": "offset points", "bbox": box}
            ax.annotate(t.baseline, (x / scale, y), fontsize=8, color="dimgray", zorder=2.5, **at)


def _mark_winner(ax: Axes, winner: TrialRecord, wxy: tuple[float, float]) -> None:
    wx, wy = wxy
    label = _wrapped(f"winner: [trial {winner.number}] {winner.label}")
    ax.scatter([wx], [wy], s=320, facecolors="none", edgecolors="black", linewidths=2, label=label, zorder=4)
    # Named on the plot too, with an arrow from the side away from the crowded front (up and to the left).
    name = f"winner (trial {winner.number})" + (f" = {winner.baseline}" if winner.baseline else "")
    arrow = {"arrowstyle": "->", "color": "black", "lw": 1.2, "shrinkB": 10}
    box = {"boxstyle": "round,pad=0.25", "fc": "lightyellow", "ec": "black", "lw": 0.8}
    at = {"xytext": (-30, 22), "textcoords": "offset points", "ha": "right", "fontsize": 9, "fontweight": "bold"}
    ax.annotate(name, (wx, wy), zorder=5, arrowprops=arrow, bbox=box, **at)


def _frame(ax: Axes, result: TuneResult, unit: str, scale: float, span: tuple[float, float]) -> None:
    budget, mem = result.budget, memory_name(result.budget)
    x_max, y_span = span
    if budget.kind != "none" and budget.limit_bytes is not None:
        lim = budget.limit_bytes / scale
        label = _wrapped(f"budget: {format_bytes(budget.limit_bytes)} {mem}")
        ax.axvline(lim, color="tab:red", ls="--", lw=1.5, label=label)
        ax.axvspan(lim, x_max, color="tab:red", alpha=0.06, lw=0)
    ax.set(xlim=(0, x_max), ylim=(0, y_span), xlabel=f"measured {mem} memory ({unit})")
    scaled = bool(comparable_speeds(result))
    ax.set_ylabel("samples / s (filled: the reference's x its paired ratio)" if scaled else "samples / s (median step)")
    title = f"Activation checkpointing trials: throughput vs {mem} memory"
    if result.fell_back:
        title += " (nothing fit: fell back to the lowest-memory plan)"
    ax.set_title(title, fontsize=11)
    ax.grid(True, alpha=0.3)


def figure_to_hwc(fig: Figure) -> np.ndarray:
    # SummaryWriter.add_figure imports pyplot to close the figure; the Agg canvas alone leaves pyplot's state alone.
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()
