"""The names a reader of the tuner's TensorBoard output looks up: tags, HParams columns and metrics, files.

Defined here only, so the writer and whatever reads the logs back cannot drift apart (``docs/monitoring.md`` shows where
each appears). Plain strings: nothing here imports TensorBoard. Every name here is public (read as ``tags.NAME``), so
the module lists no ``__all__``."""

from __future__ import annotations

TAG_PREFIX = "lightning_ckpt"

# The search run: one point per trial, global_step = trial number. "_alone": the plan was chosen on the
# side-by-side figures under confirm/, which can rank plans the other way when the machine's speed drifts.
TAG_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/trial/samples_per_second_alone"
TAG_PEAK_MIB = f"{TAG_PREFIX}/trial/peak_memory_mib"
TAG_PREDICTED_PEAK_MIB = f"{TAG_PREFIX}/trial/predicted_peak_memory_mib"
TAG_ACTIVATION_MIB = f"{TAG_PREFIX}/trial/activation_memory_mib"
TAG_PREDICTED_ACTIVATION_MIB = f"{TAG_PREFIX}/trial/predicted_activation_memory_mib"
TAG_RECOMPUTE_OVERHEAD = f"{TAG_PREFIX}/trial/recompute_overhead"
TAG_TRIAL_SECONDS = f"{TAG_PREFIX}/trial/seconds"
TAG_BEST_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/search/best_samples_per_second_alone"
TAG_SIDE_BY_SIDE_SAMPLES_PER_SECOND = f"{TAG_PREFIX}/confirm/samples_per_second"
# One point each, at step 0: the verdict (``search/verdict.py``), the compiles, where the search's time went.
TAG_VERDICT_RATIO = f"{TAG_PREFIX}/search/verdict_ratio"
TAG_VERDICT_LOW = f"{TAG_PREFIX}/search/verdict_low"
TAG_VERDICT_HIGH = f"{TAG_PREFIX}/search/verdict_high"
VERDICT_SCALAR_TAGS = (TAG_VERDICT_RATIO, TAG_VERDICT_LOW, TAG_VERDICT_HIGH)
TAG_SEARCH_COMPILES = f"{TAG_PREFIX}/search/compiled_graphs"
TAG_SEARCH_COMPILE_SECONDS = f"{TAG_PREFIX}/search/compile_seconds"
TAG_SEARCH_PLAIN_STEPS = f"{TAG_PREFIX}/search/plain_steps"
TAG_SEARCH_PHASE_SECONDS = f"{TAG_PREFIX}/search/phase_seconds"
# Each chart's description (its info tooltip), for the series whose figures could be mistaken for one another.
SCALAR_DESCRIPTIONS = {
    TAG_SAMPLES_PER_SECOND: (
        "Each trial's throughput measured alone, as the search ran (x = trial number). The plan was chosen on "
        "the side-by-side figures in confirm/samples_per_second; these can rank plans differently."
    ),
    TAG_BEST_SAMPLES_PER_SECOND: (
        "The fastest fitting trial so far, measured alone. Not the winner's figure: the winner was chosen on "
        "confirm/samples_per_second (side by side)."
    ),
    TAG_SIDE_BY_SIDE_SAMPLES_PER_SECOND: (
        "The leaders and every fitting baseline re-timed side by side in interleaved rounds (x = trial number): "
        "the figures the plan was chosen on, also in the HParams table and the summary text."
    ),
    TAG_VERDICT_RATIO: "The winner's speed over the fastest fitting baseline, from the paired side-by-side rounds.",
}
# Logged only for trials that compiled, that the time model predicted, or that offloaded.
TAG_COMPILE_SECONDS = f"{TAG_PREFIX}/trial/compile_seconds"
TAG_GRAPH_BREAKS = f"{TAG_PREFIX}/trial/graph_breaks"
TAG_RECOMPILES = f"{TAG_PREFIX}/trial/recompiles"
TAG_PREDICTED_STEP_MS = f"{TAG_PREFIX}/trial/predicted_step_ms"
TAG_TIME_PREDICTION_ERROR = f"{TAG_PREFIX}/trial/time_prediction_error"
TAG_OFFLOAD_POOL_MIB = f"{TAG_PREFIX}/trial/offload_host_pool_mib"
TAG_OFFLOAD_EXPOSED_PREDICTED_MS = f"{TAG_PREFIX}/trial/offload_exposed_predicted_ms"
TAG_OFFLOAD_EXPOSED_MEASURED_MS = f"{TAG_PREFIX}/trial/offload_exposed_measured_ms"
TRIAL_SCALAR_TAGS = (
    TAG_SAMPLES_PER_SECOND,
    TAG_PEAK_MIB,
    TAG_PREDICTED_PEAK_MIB,
    TAG_ACTIVATION_MIB,
    TAG_PREDICTED_ACTIVATION_MIB,
    TAG_RECOMPUTE_OVERHEAD,
    TAG_TRIAL_SECONDS,
)

# The HParams table: TensorBoard's Scalars/Time Series views deselect every run once there are more than 40,
# so the table holds the leaders only (one run each, winner first).
HPARAM_RUN_DIR = "table"  # rows: <search run>/table/01_winner_trial_012, 02_trial_005, ...
HPARAM_ROWS = 10
# (key, display name, description); TensorBoard orders columns by name, so ``hparam_name`` numbers them.
HPARAM_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("winner", "winner", "\u2605 marks the plan that was locked in"),
    ("plan", "plan", "which blocks are checkpointed, and how"),
    ("status", "status", "ok = measured within the budget"),
    (
        "timing",
        "timed",
        "side by side = re-timed with the winner in the confirmation's interleaved rounds (comparable with its "
        "figure); one at a time = measured alone while the search ran, at another moment (not comparable: a quiet "
        "moment made such a plan look faster than the winner)",
    ),
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
HPARAM_VS_REFERENCE = f"{TAG_PREFIX}/table/vs_reference"
HPARAM_METRICS: tuple[tuple[str, str, str], ...] = (
    (
        HPARAM_SAMPLES_PER_SECOND,
        "samples/s",
        "median-step throughput; rows timed side by side: the reference's figure x the row's paired ratio to it (one "
        "scale with the winner's), rows timed one at a time: as measured alone",
    ),
    (
        HPARAM_VS_REFERENCE,
        "vs reference",
        "speed over the fastest fitting baseline, both from the same side-by-side rounds (empty for plans timed one "
        "at a time): what the choice compared",
    ),
    (HPARAM_PEAK_MIB, "peak MiB", "peak memory of the training step"),
    (HPARAM_ACTIVATION_MIB, "activation MiB", "activation memory (peak above the resting state)"),
    (HPARAM_PREDICTED_PEAK_MIB, "predicted peak MiB", "the memory model's prediction"),
    (HPARAM_RECOMPUTE_PERCENT, "recompute %", "extra forward FLOPs recomputed in backward"),
)
HPARAM_METRIC_TAGS = tuple(tag for tag, _, _ in HPARAM_METRICS)

# Text tags as passed to add_text (``text_tag`` gives the stored name). Numbered because TensorBoard's Text tab
# lists tags alphabetically: the verdict first.
TAG_SUMMARY = f"{TAG_PREFIX}/1_summary"
TAG_PLAN = f"{TAG_PREFIX}/2_plan"
TAG_MEMORY_BREAKDOWN = f"{TAG_PREFIX}/3_memory_breakdown"
TAG_PARETO = f"{TAG_PREFIX}/pareto"
TAG_CONFLICTS = f"{TAG_PREFIX}/4_compile_conflicts"

PARETO_PNG = "pareto.png"
WINNER_MARK = "\u2605"


def text_tag(tag: str) -> str:
    """The name under which ``SummaryWriter.add_text(tag, ...)`` stores a text (what readers look up)."""
    return tag + "/text_summary"
