"""Writing a search to TensorBoard under the names in ``report.tags``: per-trial scalars, the HParams table of the
leaders, the texts and the Pareto image. It takes a ``SummaryWriter`` (or a log directory), never a Trainer. The HParams
summaries are built from the protos, because ``tensorboard.plugins.hparams.summary`` would import TensorFlow."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.scalar.plugin_data_pb2 import ScalarPluginData
from torch.utils.tensorboard import SummaryWriter

from lightning_ckpt.formatting import MIB
from lightning_ckpt.report import tags
from lightning_ckpt.report.figure import figure_to_hwc, pareto_figure
from lightning_ckpt.report.quantities import best_feasible_baseline, comparable_speeds, compile_stats, fastest_first
from lightning_ckpt.report.text import conflicts_markdown, memory_markdown, plan_markdown, summary_markdown
from lightning_ckpt.search.ledger import TrialRecord, vs_reference
from lightning_ckpt.search.result import TuneResult, offload_figures
from lightning_ckpt.search.verdict import Verdict

__all__ = ["best_so_far", "log_trial", "open_writer", "table_trials", "write_experiment", "write_tensorboard"]


def _hparams_summary(tag: str, **data: Any) -> Summary:
    content = plugin_data_pb2.HParamsPluginData(version=hparams_metadata.PLUGIN_DATA_VERSION, **data)
    plugin = SummaryMetadata.PluginData(plugin_name=hparams_metadata.PLUGIN_NAME, content=content.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def _hparam_type(value: Any) -> int:
    if isinstance(value, bool):
        return api_pb2.DATA_TYPE_BOOL
    if isinstance(value, (int, float)):
        return api_pb2.DATA_TYPE_FLOAT64
    return api_pb2.DATA_TYPE_STRING


_COLUMN_KEYS = frozenset(key for key, _, _ in tags.HPARAM_COLUMNS)
_NUMERIC_COLUMNS = frozenset({"compile_budget"})  # TensorBoard shows numbers as 41.000: counts read better as text


def write_experiment(writer: SummaryWriter, other_hparams: Mapping[str, Any] | None = None) -> None:
    """Declare the HParams table (its columns and metrics) in ``writer``'s run, before anyone else does: TensorBoard
    takes the *first* one it reads in a run (Lightning's logger writes one when the fit starts). ``other_hparams``:
    further columns (name -> an example value, for its type) to keep visible: the LightningModule's own ones."""
    infos = [
        api_pb2.HParamInfo(
            name=tags.hparam_name(name),
            display_name=display,
            description=description,
            differs=True,  # TensorBoard lists columns that differ first: the tuner's before the module's own
            type=api_pb2.DATA_TYPE_FLOAT64 if name in _NUMERIC_COLUMNS else api_pb2.DATA_TYPE_STRING,
        )
        for name, display, description in tags.HPARAM_COLUMNS
    ]
    ours = {tags.hparam_name(name) for name, _, _ in tags.HPARAM_COLUMNS}
    infos += [
        api_pb2.HParamInfo(name=name, type=_hparam_type(value))
        for name, value in (other_hparams or {}).items()
        if name not in ours
    ]
    metrics = [
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=display, description=description)
        for tag, display, description in tags.HPARAM_METRICS
    ]
    description = "Activation checkpointing trials (lightning_ckpt): the leaders, winner first."
    experiment = api_pb2.Experiment(
        description=description, time_created_secs=time.time(), hparam_infos=infos, metric_infos=metrics
    )
    writer.file_writer.add_summary(_hparams_summary(hparams_metadata.EXPERIMENT_TAG, experiment=experiment))
    writer.flush()


def open_writer(log_dir: str | os.PathLike[str]) -> SummaryWriter:
    """A TensorBoard writer for the search's run in ``log_dir`` (TensorBoard is imported only in this package)."""
    return SummaryWriter(log_dir=str(log_dir))


def _trial_scalars(trial: TrialRecord) -> dict[str, float]:
    def scaled(value: float | None, scale: float) -> float | None:
        return None if value is None else scale * value

    offload, stats = offload_figures(trial) or {}, compile_stats(trial) or {}
    scalars = {
        # Measured alone, also after the confirmation replaced ``samples_per_second``.
        tags.TAG_SAMPLES_PER_SECOND: trial.first_samples_per_second or trial.samples_per_second,
        tags.TAG_PEAK_MIB: scaled(trial.peak_bytes, 1 / MIB),
        tags.TAG_PREDICTED_PEAK_MIB: scaled(trial.predicted_peak_bytes, 1 / MIB),
        tags.TAG_ACTIVATION_MIB: scaled(trial.activation_bytes, 1 / MIB),
        tags.TAG_PREDICTED_ACTIVATION_MIB: scaled(trial.predicted_activation_bytes, 1 / MIB),
        tags.TAG_RECOMPUTE_OVERHEAD: trial.recompute_overhead,
        tags.TAG_TRIAL_SECONDS: trial.seconds,
        tags.TAG_PREDICTED_STEP_MS: scaled(trial.predicted_seconds, 1000),
        tags.TAG_TIME_PREDICTION_ERROR: trial.prediction_error,
        tags.TAG_OFFLOAD_POOL_MIB: scaled(offload.get("host_pool_bytes"), 1 / MIB),
        tags.TAG_OFFLOAD_EXPOSED_PREDICTED_MS: scaled(offload.get("exposed_predicted_seconds"), 1000),
        tags.TAG_OFFLOAD_EXPOSED_MEASURED_MS: scaled(offload.get("exposed_measured_seconds"), 1000),
        tags.TAG_COMPILE_SECONDS: stats.get("compile_seconds"),
        tags.TAG_GRAPH_BREAKS: stats.get("graph_breaks"),
        tags.TAG_RECOMPILES: stats.get("recompiles"),
    }
    return {tag: float(v) for tag, v in scalars.items() if v is not None}


def add_scalar(writer: SummaryWriter, tag: str, value: float, step: int) -> None:
    """``writer.add_scalar(..., new_style=True)`` with the description from ``SCALAR_DESCRIPTIONS``, for every scalar
    (TensorBoard's Rust data server drops a legacy ``simple_value``'s description)."""
    plugin = SummaryMetadata.PluginData(plugin_name="scalars", content=ScalarPluginData(version=0).SerializeToString())
    description = tags.SCALAR_DESCRIPTIONS.get(tag, "")
    metadata = SummaryMetadata(display_name=tag, summary_description=description, plugin_data=plugin)
    tensor = TensorProto(dtype="DT_FLOAT", float_val=[float(value)], tensor_shape=TensorShapeProto())
    writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, tensor=tensor, metadata=metadata)]), step)


def log_trial(writer: SummaryWriter, trial: TrialRecord, *, best_samples_per_second: float | None = None) -> None:
    """Log one finished trial's scalars at step = trial number, and the best-so-far point; nothing as NaN."""
    for tag, value in _trial_scalars(trial).items():
        add_scalar(writer, tag, value, trial.number)
    if best_samples_per_second is not None:
        add_scalar(writer, tags.TAG_BEST_SAMPLES_PER_SECOND, float(best_samples_per_second), trial.number)
    writer.flush()


def best_so_far(trials: Iterable[TrialRecord]) -> list[tuple[int, float]]:
    """(trial number, fastest feasible samples/s measured alone up to it): the curve the search streamed."""
    out, best = [], None
    for t in sorted(trials, key=lambda t: t.number):
        alone = t.first_samples_per_second or t.samples_per_second
        if t.feasible and alone is not None:
            best = alone if best is None else max(best, alone)
        if best is not None:
            out.append((t.number, best))
    return out


def table_trials(result: TuneResult, limit: int = tags.HPARAM_ROWS) -> list[TrialRecord]:
    """The HParams table's rows: the winner, then measured trials fastest first (those that fit before
    those that do not), with the best feasible baseline kept in for comparison; at most ``limit``."""
    chosen = fastest_first(result, fitting_first=True)[:limit]
    base = best_feasible_baseline(result)
    if base is not None and limit > 1 and all(t.number != base[1].number for t in chosen):
        chosen[-1] = base[1]
    return chosen


def write_hparams_table(writer: SummaryWriter, result: TuneResult) -> None:
    """One HParams session (a run under ``writer``'s directory) per leader."""
    winner = result.best_trial
    speeds = comparable_speeds(result)  # side-by-side rows on one scale with the winner's
    for rank, t in enumerate(table_trials(result), start=1):
        is_winner = winner is not None and t.number == winner.number
        values: dict[str, Any] = {
            "winner": tags.WINNER_MARK if is_winner else "",
            "plan": t.plan.describe(),
            "status": str(t.status),
            "timing": "side by side" if t.confirmed else "one at a time",
            "trial": str(t.number),
            "baseline": t.baseline or "",
        }
        values.update({k: v for k, v in t.params.items() if k in _COLUMN_KEYS and k not in values})
        scalars = _trial_scalars(t)  # the same figures as the trial's own series, under the table's names
        metrics = {
            tags.HPARAM_SAMPLES_PER_SECOND: speeds.get(t.number, t.samples_per_second),
            tags.HPARAM_PEAK_MIB: scalars.get(tags.TAG_PEAK_MIB),
            tags.HPARAM_ACTIVATION_MIB: scalars.get(tags.TAG_ACTIVATION_MIB),
            tags.HPARAM_PREDICTED_PEAK_MIB: scalars.get(tags.TAG_PREDICTED_PEAK_MIB),
            tags.HPARAM_RECOMPUTE_PERCENT: None if t.recompute_overhead is None else 100.0 * t.recompute_overhead,
            tags.HPARAM_VS_REFERENCE: vs_reference(t),
        }
        name = f"{tags.HPARAM_RUN_DIR}/{rank:02d}_{'winner_' if is_winner else ''}trial_{t.number:03d}"
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for k, v in values.items():  # optuna's values; bools as "True" (not 1.0), None as "None" (not a blank)
            if k in _NUMERIC_COLUMNS and isinstance(v, (int, float)) and not isinstance(v, bool):
                start.hparams[tags.hparam_name(k)].number_value = v
            else:
                start.hparams[tags.hparam_name(k)].string_value = str(v)
        with SummaryWriter(log_dir=os.path.join(writer.get_logdir(), name)) as run:
            run.file_writer.add_summary(
                _hparams_summary(hparams_metadata.SESSION_START_INFO_TAG, session_start_info=start)
            )
            for tag, value in metrics.items():
                if value is not None:
                    add_scalar(run, tag, float(value), t.number)
            end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())
            run.file_writer.add_summary(_hparams_summary(hparams_metadata.SESSION_END_INFO_TAG, session_end_info=end))


def _search_scalars(result: TuneResult) -> dict[str, float]:
    """The search's own figures at step 0: the verdict, the compiles, and where its time went."""
    verdict = Verdict.recorded(result.best.provenance.search)
    compiles, cost = result.best.provenance.compiles, result.cost
    scalars: dict[str, Any] = {}
    if verdict is not None and verdict.ratio is not None:
        scalars.update(zip(tags.VERDICT_SCALAR_TAGS, (verdict.ratio, verdict.low, verdict.high), strict=True))
    if compiles:
        scalars[tags.TAG_SEARCH_COMPILES] = compiles["graphs"]
        scalars[tags.TAG_SEARCH_COMPILE_SECONDS] = compiles["seconds"]
    if cost is not None:
        scalars.update({f"{tags.TAG_SEARCH_PHASE_SECONDS}/{phase}": sec for phase, sec in cost.seconds.items()})
        scalars[tags.TAG_SEARCH_PLAIN_STEPS] = cost.plain_steps
    return {tag: float(v) for tag, v in scalars.items() if v is not None}


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

    ``writer_or_logdir``: a ``SummaryWriter`` (flushed, left open) or a directory (a writer opened and closed here).
    ``memory_breakdown_table`` (markdown) overrides the one built from ``result.memory_breakdown``. ``log_trials=False``
    when ``log_trial`` already streamed every trial to this writer; ``write_experiment_summary=False`` when the caller
    already declared the HParams table in a parent run."""
    owned = not isinstance(writer_or_logdir, SummaryWriter)
    writer = SummaryWriter(log_dir=os.fspath(writer_or_logdir)) if owned else writer_or_logdir
    with writer if owned else contextlib.nullcontext():
        logdir = Path(writer.get_logdir())
        if write_experiment_summary:
            write_experiment(writer, other_hparams)
        if log_trials:
            best = dict(best_so_far(result.trials))
            for t in result.trials:
                log_trial(writer, t, best_samples_per_second=best.get(t.number))
        write_hparams_table(writer, result)
        for tag, value in _search_scalars(result).items():
            add_scalar(writer, tag, value, 0)
        for t in result.trials:
            if t.confirmed and t.samples_per_second is not None:
                add_scalar(writer, tags.TAG_SIDE_BY_SIDE_SAMPLES_PER_SECOND, t.samples_per_second, t.number)
        writer.add_text(tags.TAG_SUMMARY, summary_markdown(result), global_step=0)
        writer.add_text(tags.TAG_PLAN, plan_markdown(result.best, result.best_trial), global_step=0)
        memory = memory_breakdown_table
        if memory is None:
            memory = memory_markdown(result.memory_breakdown, result.best) if result.memory_breakdown else ""
        if not memory and result.memory_table:  # fenced: TensorBoard's markdown keeps the columns aligned
            memory = f"```\n{result.memory_table}\n```"
        if memory:
            writer.add_text(tags.TAG_MEMORY_BREAKDOWN, memory, global_step=0)
        if any(compile_stats(t) is not None for t in result.trials):
            writer.add_text(tags.TAG_CONFLICTS, conflicts_markdown(result), global_step=0)
        fig = pareto_figure(result)
        logdir.mkdir(parents=True, exist_ok=True)
        fig.savefig(logdir / tags.PARETO_PNG, dpi=110)
        writer.add_image(tags.TAG_PARETO, figure_to_hwc(fig), global_step=0, dataformats="HWC")
        writer.flush()
    return logdir
