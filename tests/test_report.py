from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from matplotlib.figure import Figure
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugin_util import markdown_to_safe_html
from tensorboard.plugins.hparams import metadata as hp_metadata
from torch.utils.tensorboard import SummaryWriter

from lightning_ckpt import report
from lightning_ckpt.budget import Budget
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.report.tags import (
    TAG_ACTIVATION_MIB,
    TAG_BEST_SAMPLES_PER_SECOND,
    TAG_MEMORY_BREAKDOWN,
    TAG_PARETO,
    TAG_PEAK_MIB,
    TAG_PLAN,
    TAG_PREFIX,
    TAG_SAMPLES_PER_SECOND,
    TAG_SUMMARY,
    TAG_TRIAL_SECONDS,
    TRIAL_SCALAR_TAGS,
)
from lightning_ckpt.search.ledger import TrialRecord
from lightning_ckpt.search.result import TuneResult

MiB = 2**20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCKS = ("transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3")
SIZE_GUIDANCE = {ea.SCALARS: 0, ea.TENSORS: 0, ea.IMAGES: 0}


def uniform(block_plan: BlockPlan, name: str = "") -> Plan:
    return Plan(dict.fromkeys(BLOCKS, block_plan), name=name)


WINNER_PLAN = Plan(
    {
        "transformer.h.0": BlockPlan("full"),
        "transformer.h.1": BlockPlan("full"),
        "transformer.h.2": BlockPlan("selective", ("mlp",)),
        "transformer.h.3": BlockPlan("ops", save_list="save_matmuls"),
    },
    name="tuned",
)


def trial(number, plan, label, status, *, params=None, peak=None, act=None, pred=None, sps=None, overhead=None, **kw):
    if label.startswith("baseline:"):  # what the study records for a baseline candidate (space.Candidate.baseline)
        kw.setdefault("baseline", label.removeprefix("baseline:"))
    return TrialRecord(
        number=number,
        plan=plan,
        label=label,
        params=params or {},
        status=status,
        predicted_peak_bytes=None if pred is None else pred * MiB,
        predicted_activation_bytes=None if pred is None else (pred - 300) * MiB,
        peak_bytes=None if peak is None else peak * MiB,
        activation_bytes=None if act is None else act * MiB,
        samples_per_second=sps,
        median_seconds=None if sps is None else 8 / sps,
        spread_seconds=None if sps is None else 0.001,
        recompute_overhead=overhead,
        seconds=1.5 + number,
        steps=6,
        **kw,
    )


@pytest.fixture
def result() -> TuneResult:
    trials = (
        trial(0, Plan(name="none"), "baseline:none", "over_budget", peak=900, act=600, pred=880, sps=100.0),
        trial(
            1,
            uniform(BlockPlan("full"), "full"),
            "baseline:full",
            "ok",
            peak=400,
            act=100,
            pred=410,
            sps=70.0,
            overhead=0.33,
        ),
        trial(
            2,
            uniform(BlockPlan("selective", ("mlp",)), "selective_mlp"),
            "baseline:selective_mlp",
            "ok",
            peak=550,
            act=250,
            pred=540,
            sps=85.0,
            overhead=0.12,
        ),
        trial(
            3,
            uniform(BlockPlan("offload"), "offload"),
            "baseline:offload",
            "oom",
            pred=500,
            error="CUDA out of memory.\nTried to allocate 2 GiB",
        ),
        trial(
            4,
            WINNER_PLAN,
            WINNER_PLAN.describe(),
            "ok",
            peak=480,
            act=180,
            pred=470,
            sps=90.0,
            overhead=0.2,
            params={"structure": "blocks", "selection": "first:0.5", "mode": "full", "rest_mode": "selective:mlp"},
        ),
        trial(
            5,
            uniform(BlockPlan("selective", ("attn",))),
            "selective(attn) h.0-3",
            "pruned",
            pred=950,
            params={"structure": "blocks", "selection": "all", "mode": "selective:attn"},
        ),
        trial(
            6,
            uniform(BlockPlan("ops", save_list="save_matmuls")),
            "ops(save_matmuls) h.0-3",
            "ok",
            peak=590,
            act=290,
            pred=600,
            sps=88.0,
            overhead=0.15,
            params={"structure": "blocks", "selection": "all", "mode": "ops:save_matmuls", "unknown_dim": 1},
        ),
        trial(7, Plan(segments={"transformer.h": 2}), "segments(transformer.h=2)", "error", error="RuntimeError: boom"),
    )
    return TuneResult(
        best=WINNER_PLAN,
        best_trial=trials[4],
        trials=trials,
        budget=Budget("peak", 600 * MiB, None, "600.0 MiB peak"),
        tuning_seconds=42.0,
        tuning_steps=48,
        memory_table="block              none     full\ntransformer.h.0   150 MiB  25 MiB",
    )


def read(logdir) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(logdir), size_guidance=SIZE_GUIDANCE)
    acc.Reload()
    return acc


def scalars(acc: ea.EventAccumulator, tag: str) -> dict[int, float]:
    """A scalar series by step: the report writes scalars as tensors with the scalars plugin's metadata."""
    return {e.step: float(e.tensor_proto.float_val[0]) for e in acc.Tensors(tag)}


def text_of(acc: ea.EventAccumulator, tag: str) -> str:
    (event,) = acc.Tensors(report.tags.text_tag(tag))
    return event.tensor_proto.string_val[0].decode()


def test_tags_live_under_the_prefix():
    tags = (
        *TRIAL_SCALAR_TAGS,
        TAG_BEST_SAMPLES_PER_SECOND,
        TAG_PLAN,
        TAG_SUMMARY,
        TAG_PARETO,
        *report.tags.HPARAM_METRIC_TAGS,
    )
    assert all(tag.startswith(f"{TAG_PREFIX}/") for tag in tags)
    assert len({name for name, _, _ in report.tags.HPARAM_COLUMNS}) == len(report.tags.HPARAM_COLUMNS)


def test_tensorboard_round_trip(tmp_path, result):
    logdir = report.write_tensorboard(tmp_path / "tb", result)
    assert logdir == tmp_path / "tb"
    acc = read(logdir)
    tags = acc.Tags()

    assert set(TRIAL_SCALAR_TAGS) <= set(tags["tensors"])  # scalars written as tensors (add_scalar new_style)
    sps = scalars(acc, TAG_SAMPLES_PER_SECOND)
    assert sps == pytest.approx({0: 100.0, 1: 70.0, 2: 85.0, 4: 90.0, 6: 88.0})  # never-run trials are skipped
    peak = scalars(acc, TAG_PEAK_MIB)
    assert peak[1] == pytest.approx(400.0) and 5 not in peak
    assert scalars(acc, TAG_ACTIVATION_MIB)[4] == pytest.approx(180.0)
    assert list(scalars(acc, TAG_TRIAL_SECONDS)) == list(range(8))
    # Best so far: only plans that fit count (trial 0, 100/s, is over the budget).
    best = scalars(acc, TAG_BEST_SAMPLES_PER_SECOND)
    assert best == pytest.approx({1: 70.0, 2: 85.0, 3: 85.0, 4: 90.0, 5: 90.0, 6: 90.0, 7: 90.0})

    plan_text = text_of(acc, TAG_PLAN)
    assert all(f"`{fqn}`" in plan_text for fqn in BLOCKS)
    assert "selective(mlp)" in plan_text and "ops(save_matmuls)" in plan_text and "90.0" in plan_text
    assert "<table>" in markdown_to_safe_html(plan_text)  # TensorBoard renders it as a table
    memory_text = text_of(acc, TAG_MEMORY_BREAKDOWN)
    assert memory_text.startswith("```\n") and result.memory_table in memory_text  # no structured breakdown
    summary = text_of(acc, TAG_SUMMARY)
    assert summary.splitlines()[0].startswith("- winner (bold)")  # the verdict first
    assert "<table>" in markdown_to_safe_html(summary)

    (image,) = acc.Images(TAG_PARETO)
    assert image.encoded_image_string.startswith(PNG_MAGIC) and image.width > 400 and image.height > 300
    png = (logdir / report.tags.PARETO_PNG).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    # The HParams table: the experiment in this run, one session run per leader under table/.
    content = acc.PluginTagToContent(hp_metadata.PLUGIN_NAME)
    experiment = hp_metadata.parse_experiment_plugin_data(content[hp_metadata.EXPERIMENT_TAG])
    assert [h.name for h in experiment.hparam_infos] == [
        report.tags.hparam_name(k) for k, _, _ in report.tags.HPARAM_COLUMNS
    ]
    rows = sorted(p.name for p in (logdir / report.tags.HPARAM_RUN_DIR).iterdir())
    assert rows == ["01_winner_trial_004", "02_trial_006", "03_trial_002", "04_trial_001", "05_trial_000"]
    winner = read(logdir / report.tags.HPARAM_RUN_DIR / rows[0]).PluginTagToContent(hp_metadata.PLUGIN_NAME)
    hp = hp_metadata.parse_session_start_info_plugin_data(winner[hp_metadata.SESSION_START_INFO_TAG]).hparams
    hp = {name.split("_", 1)[1]: value for name, value in hp.items()}  # "02_plan" -> "plan"
    assert hp["winner"].string_value == report.tags.WINNER_MARK and hp["trial"].string_value == "4"
    assert hp["plan"].string_value == WINNER_PLAN.describe() and hp["status"].string_value == "ok"
    assert hp["selection"].string_value == "first:0.5" and hp["rest_mode"].string_value == "selective:mlp"
    other = read(logdir / report.tags.HPARAM_RUN_DIR / rows[1]).PluginTagToContent(hp_metadata.PLUGIN_NAME)
    hp = hp_metadata.parse_session_start_info_plugin_data(other[hp_metadata.SESSION_START_INFO_TAG]).hparams
    assert hp[report.tags.hparam_name("winner")].string_value == "" and not any("unknown_dim" in k for k in hp)


def test_table_keeps_the_leaders_and_the_best_baseline(result):
    assert [t.number for t in report.tensorboard.table_trials(result)] == [4, 6, 2, 1, 0]
    # Two rows: the winner, then the best baseline that fits rather than the faster trial 6.
    assert [t.number for t in report.tensorboard.table_trials(result, limit=2)] == [4, 2]


def test_hparams_dashboard_shows_the_leaders_under_the_tuner_columns(tmp_path, result):
    """Ask TensorBoard's own HParams plugin, as the browser would; a Lightning-style experiment written later
    into the same run (hp_metric) must not replace the tuner's columns."""
    from tensorboard.backend import application
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import hparams_plugin
    from tensorboard.plugins.scalar import scalars_plugin
    from torch.utils.tensorboard.summary import hparams as torch_hparams
    from werkzeug.test import Client

    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        report.tensorboard.write_experiment(writer, {"lr": 0.001})
        exp, ssi, sei = torch_hparams({"lr": 0.001}, {"hp_metric": -1})  # what Lightning writes after on_fit_start
        for summary in (exp, ssi, sei):
            writer.file_writer.add_summary(summary)
        writer.add_scalar("hp_metric", -1, 0)
        logdir = str(report.write_tensorboard(writer, result, write_experiment_summary=False))
    mux = pem.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    context = base_plugin.TBContext(
        logdir=logdir, multiplexer=mux, data_provider=data_provider.MultiplexerDataProvider(mux, logdir)
    )
    plugins = [scalars_plugin.ScalarsPlugin(context)]
    context.plugin_name_to_instance = {"scalars": plugins[0]}
    plugins.append(hparams_plugin.HParamsPlugin(context))
    context.plugin_name_to_instance["hparams"] = plugins[1]
    client = Client(application.TensorBoardWSGI(plugins))
    headers = {"X-XSRF-Protected": "1"}

    experiment = client.post("/data/plugin/hparams/experiment", json={"experimentName": ""}, headers=headers).json
    columns = [h["name"] for h in experiment["hparamInfos"]]
    assert columns == [report.tags.hparam_name(k) for k, _, _ in report.tags.HPARAM_COLUMNS] + ["lr"]  # in our order
    assert {m["name"]["tag"] for m in experiment["metricInfos"]} == set(report.tags.HPARAM_METRIC_TAGS)
    query = {
        "experimentName": "",
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
        "colParams": [],
        "startIndex": 0,
        "sliceSize": 100,
    }
    groups = client.post("/data/plugin/hparams/session_groups", json=query, headers=headers).json["sessionGroups"]
    names = [g["name"] for g in groups]
    assert names == [".", *(f"{report.tags.HPARAM_RUN_DIR}/{n}" for n in ("01_winner_trial_004", "02_trial_006",
                     "03_trial_002", "04_trial_001", "05_trial_000"))]  # fmt: skip
    assert groups[0]["hparams"] == {"lr": 0.001}  # the training run's own row keeps its hyperparameters
    winner = {m["name"]["tag"]: m["value"] for m in groups[1]["metricValues"]}
    assert winner[report.tags.HPARAM_SAMPLES_PER_SECOND] == pytest.approx(90.0)
    assert winner[report.tags.HPARAM_RECOMPUTE_PERCENT] == pytest.approx(20.0)
    assert groups[1]["hparams"][report.tags.hparam_name("plan")] == WINNER_PLAN.describe()


def test_streamed_trials_are_not_logged_twice(tmp_path, result):
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        best = dict(report.tensorboard.best_so_far(result.trials))
        for t in result.trials:
            report.tensorboard.log_trial(writer, t, best_samples_per_second=best.get(t.number))
        logdir = report.write_tensorboard(writer, result, memory_breakdown_table="custom table", log_trials=False)
        # The caller's writer stays open: it belongs to the caller (e.g. Lightning's logger).
        writer.add_scalar("user/after", 1.0, 0)
    acc = read(logdir)
    assert list(scalars(acc, TAG_TRIAL_SECONDS)) == list(range(8))
    assert "custom table" in text_of(acc, TAG_MEMORY_BREAKDOWN)
    assert "user/after" in acc.Tags()["scalars"]


def test_memory_breakdown_is_a_markdown_table():
    breakdown = {
        "device": "cpu", "parameter_bytes": 4 * MiB, "gradient_bytes": 4 * MiB, "optimizer_state_bytes": 8 * MiB,
        "buffer_bytes": 0, "other_activation_bytes": MiB,
        "blocks": [{"fqn": fqn, "saved_bytes": {"none": 10 * MiB, "full": MiB, "selective:mlp": 4 * MiB},
                    "recompute_transient_bytes": 2 * MiB, "shared_with": None if i == 0 else BLOCKS[0]}
                   for i, fqn in enumerate(BLOCKS)],
    }  # fmt: skip
    text = report.text.memory_markdown(breakdown, WINNER_PLAN)
    html = markdown_to_safe_html(text)
    assert html.count("<table>") == 2 and "<pre>" not in html
    # Identical blocks share a column unless the plan treats them differently.
    assert "| mode | `h.0-1` | `h.2` | `h.3` |" in text
    assert "| none | 10.0 | 10.0 | 10.0 |" in text and "| sel:mlp |" not in text  # keys as the model names them
    assert "| selective:mlp | 4.0 | 4.0 | 4.0 |" in text
    assert "| **plan** | **full** | **selective(mlp)** | **ops(save_matmuls)** |" in text
    no_plan = report.text.memory_markdown(breakdown)
    assert "| mode | `h.0-3` |" in no_plan and "**plan**" not in no_plan


def test_summary_table_names_the_winner_and_the_margin(result):
    text = report.summary_table(result)
    lines = text.splitlines()
    assert lines[0].startswith("winner (*): [trial 4]") and WINNER_PLAN.describe() in lines[0]  # verdict first
    # Against the fastest baseline that *fits* (selective_mlp at 85/s), not 'none' (100/s, over budget).
    assert "vs best feasible baseline selective_mlp" in lines[1]
    assert "1.06x samples/s" in text and "0.87x peak memory" in text
    assert "600.0 MiB peak" in text
    assert "42.0 s, 48 steps over 8 trials (7 run, 1 pruned" in text
    assert "NOTHING FIT" not in text
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "label"])
    assert set(lines[header + 1]) == {"-"}
    rows = lines[header + 2 :]
    assert rows[0].startswith("*") and rows[0].split()[1] == "4"  # the winner's row first, marked
    assert [r.split()[0] for r in rows[1:]] == ["0", "6", "2", "1", "3", "5", "7"]  # then fastest first
    assert "CUDA out of memory" not in text  # errors go in trial lines, the table stays one row each


def test_result_line_and_timing_warning(result):
    line = report.result_line(result)
    assert line.startswith(f"lightning_ckpt: chose {WINNER_PLAN.describe()} | 90.0 samples/s, peak 480.0 MiB of 600.0")
    assert "1.06x the best baseline that fits (selective_mlp)" in line and "8 plans: 7 run, 1 ruled out" in line
    assert report.timing_warning(result) is None  # nothing was confirmed side by side
    close = [
        dataclasses.replace(t, confirmation_seconds=(0.100, 0.090, 0.110)) if t.number in (4, 6) else t
        for t in result.trials
    ]
    warning = report.timing_warning(dataclasses.replace(result, trials=tuple(close)))
    assert warning is not None and "timing spread too high" in warning and "ops(save_matmuls)" in warning
    tight = [
        dataclasses.replace(t, confirmation_seconds=(0.100, 0.0995, 0.1005)) if t.number in (4, 6) else t
        for t in result.trials
    ]
    assert report.timing_warning(dataclasses.replace(result, trials=tuple(tight))) is None  # as fast: a tie
    apart = [
        dataclasses.replace(t, confirmation_seconds=(0.100, 0.101, 0.099) if t.number == 4 else (0.2, 0.21, 0.19))
        if t.number in (4, 6) else t
        for t in result.trials
    ]  # fmt: skip
    assert report.timing_warning(dataclasses.replace(result, trials=tuple(apart))) is None


def test_the_result_line_says_what_a_compiled_search_compiled_and_what_the_whole_compile_check_kept(result):
    compiles = {"assembled": True, "graphs": 14, "seconds": 50.0, "plans_measured": 7}
    check = {"leader": "baseline:pt2_budget_0.3", "rival": "selective(mlp) h.0-3", "ratio": 1.043, "graphs": 3,
             "kept": "selective(mlp) h.0-3"}  # fmt: skip
    best = result.best.with_provenance(compiles=compiles)
    line = report.result_line(dataclasses.replace(result, best=best))
    assert "compiled 14 graphs in 50.0 s for 7 plans measured (blocks compiled alone;" in line
    assert "your way" not in line
    checked = report.result_line(dataclasses.replace(result, best=best.with_provenance(whole_compile_check=check)))
    assert (
        "3 of them your way, baseline:pt2_budget_0.3 beside selective(mlp) h.0-3, it ran 1.043x the budget's speed: "
        "kept selective(mlp) h.0-3" in checked
    )
    on_blocks = {**check, "graphs": 0, "compiled_whole": False, "margin": 0.08, "ratio": 0.97}
    weighed = report.result_line(dataclasses.replace(result, best=best.with_provenance(whole_compile_check=on_blocks)))
    assert (
        "on the blocks (the budget needed a 8% lead), baseline:pt2_budget_0.3 beside selective(mlp) h.0-3, it ran "
        "0.970x the budget's speed: kept selective(mlp) h.0-3" in weighed
    )
    assert "your way" not in weighed
    partitioned = [
        {"plan": "baseline:pt2_budget_0.5", "on_blocks": 17_502_724, "whole": 17_039_360, "fits": True, "seconds": 4.1},
        {"plan": "baseline:pt2_budget_0.7", "on_blocks": 21_828_100, "whole": None, "fits": False, "seconds": 0.2},
    ]
    line = report.result_line(dataclasses.replace(result, best=best.with_provenance(pt2_partitioned_whole=partitioned)))
    assert (
        "partitioned as you compile it (no kernels): baseline:pt2_budget_0.5 saves 16.2 MiB (fits), "
        "baseline:pt2_budget_0.7 failed to partition" in line
    )


def test_search_progress_streams_and_announces(tmp_path, result, capsys):
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        progress = report.SearchProgress(4, writer=writer, verbose=True, enabled=False)
        for t in result.trials:
            progress(t, result.budget)
        progress.confirming([result.trials[4], result.trials[6]])
        progress.close()
    out = capsys.readouterr().out
    assert out.count("[trial ") == len(result.trials)  # verbose: one line per trial
    assert "confirming 2 leading plans side by side" in out and "replace the figures streamed" in out
    best = scalars(read(tmp_path), TAG_BEST_SAMPLES_PER_SECOND)
    assert best[7] == pytest.approx(90.0)
    quiet = report.SearchProgress(4, verbose=False, enabled=False)
    quiet(result.trials[0], result.budget)
    assert capsys.readouterr().out == ""  # quiet: nothing but the bar


def test_the_progress_bar_shows_no_total_it_cannot_know_and_fills_when_measuring_ends(result):
    import io

    measured = [t for t in result.trials if t.status != "pruned"][:2]
    # The time model's search: how many plans it will measure is not known, so no "2/14" and no ETA.
    out = io.StringIO()
    open_ended = report.SearchProgress(None, enabled=True, file=out)
    for t in measured:
        open_ended(t, result.budget)
    open_ended.close()
    shown = out.getvalue().replace("\r", "\n").splitlines()[-2]
    assert "2plan" in shown.replace(" ", "") and "/" not in shown.split("[")[0], shown
    # A capped search that stopped before its cap: the bar reads as done, not 2/14, when the confirmation starts.
    out = io.StringIO()
    capped = report.SearchProgress(14, enabled=True, file=out)
    for t in measured:
        capped(t, result.budget)
    capped.confirming(measured)
    assert capped.bar.total == 2 and "2/2" in out.getvalue()
    capped.close()


def test_summary_table_says_when_nothing_fit(result):
    lowest = result.trials[1]
    trials = tuple(dataclasses.replace(t, status="over_budget") if t.status == "ok" else t for t in result.trials)
    fell = dataclasses.replace(
        result,
        trials=trials,
        best=lowest.plan,
        best_trial=trials[1],
        fell_back=True,
    )
    text = report.summary_table(fell)
    assert "NOTHING FIT THE BUDGET" in text and "baseline:full" in text
    assert "no baseline fit the budget" in text
    fig = report.pareto_figure(fell)
    assert "fell back" in fig.axes[0].get_title()


def test_trial_lines(result):
    budget = result.budget
    assert report.trial_line(result.trials[4], budget) == (
        f"[trial 4] {WINNER_PLAN.describe()} | 90.0 samples/s | peak 480.0 MiB (pred 470.0 MiB) | ok"
    )
    assert report.trial_line(result.trials[0], budget).endswith("over_budget (900.0 MiB > 600.0 MiB)")
    pruned = report.trial_line(result.trials[5], budget)
    assert "not run" in pruned and pruned.endswith("pruned (predicted 950.0 MiB > 600.0 MiB)")
    assert report.trial_line(result.trials[3], budget).endswith("oom: CUDA out of memory.")
    activation = Budget("activation", 200 * MiB, 0.5, "50% of no-checkpointing activation memory")
    line = report.trial_line(result.trials[4], activation)
    assert "activation 180.0 MiB (pred 170.0 MiB), peak 480.0 MiB" in line


def test_plan_markdown_edge_cases(result):
    assert "No checkpointing" in report.text.plan_markdown(Plan(name="none"))
    seg = report.text.plan_markdown(Plan(segments={"transformer.h": 2}), result.trials[7])
    assert "`transformer.h` (stack) | segments: 2 chunks" in seg and "error" in seg
    measured = Plan({"h.0": BlockPlan("full")}, metadata={"measured": {"samples_per_s": 12.5}})
    assert "| samples_per_s | 12.5 |" in report.text.plan_markdown(measured)


def test_pareto_figure_contents(result):
    fig = report.pareto_figure(result)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "measured peak memory (MiB)"
    legend = [" ".join(t.get_text().split()) for t in fig.legends[0].get_texts()]  # long entries wrap
    assert {"fits the budget", "over the budget", "Pareto front"} <= set(legend)
    assert f"winner: [trial 4] {WINNER_PLAN.describe()}" in legend
    assert any(s.startswith("budget: 600.0 MiB") for s in legend)
    assert any(s.startswith("out of memory") for s in legend) and any(s.startswith("pruned") for s in legend)
    annotations = {t.get_text() for t in ax.texts}
    assert {"none", "full", "selective_mlp"} <= annotations  # offload never ran: no label
    assert [t.number for t in report.figure.pareto_front(result)] == [1, 4, 0]

    no_budget = dataclasses.replace(result, budget=Budget("none", description="no budget"))
    assert "budget: no budget (no memory limit)" in report.summary_table(no_budget)
    fig = report.pareto_figure(no_budget)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "measured" in legend and not any(s.startswith("budget") for s in legend)

    act = dataclasses.replace(result, budget=Budget("activation", 200 * MiB, 0.5, "50%"))
    assert report.pareto_figure(act).axes[0].get_xlabel() == "measured activation memory (MiB)"
    assert [t.number for t in report.figure.pareto_front(act)] == [1, 4, 0]

    # A front of one point draws no line: the legend does not name it.
    one = dataclasses.replace(result, trials=tuple(t for t in result.trials if t.number == 4))
    assert len(report.figure.pareto_front(one)) == 1
    assert "Pareto front" not in [t.get_text() for t in report.pareto_figure(one).legends[0].get_texts()]


def test_report_imports_neither_lightning_nor_pyplot(tmp_path):
    code = (
        "import sys, lightning_ckpt.report.tensorboard as r\n"
        "assert 'lightning' not in sys.modules, 'report imported lightning'\n"
        "from lightning_ckpt.plan.format import Plan\n"
        "from lightning_ckpt.budget import Budget\n"
        "from lightning_ckpt.search.tune import TuneResult\n"
        f"r.write_tensorboard({str(tmp_path)!r}, TuneResult(Plan(), None, (), Budget('none'), 0.0, 0))\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'report imported pyplot'\n"
        "assert 'lightning' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / report.tags.PARETO_PNG).exists()


def _with_verdict(result, verdict):
    search = {**result.best.metadata.get("search", {}), "verdict": verdict.to_dict()}
    return dataclasses.replace(result, best=result.best.with_provenance(search=search))


def test_the_result_line_summary_and_warning_show_the_verdict_with_its_interval(result, tmp_path):
    from lightning_ckpt.search.verdict import Verdict

    ref = {r: 1.0 for r in range(6)}
    won = Verdict.of("baseline:selective_mlp", ref, "tuned", {0: 0.94, 1: 0.95, 2: 0.93, 3: 0.945, 4: 0.94, 5: 0.95},
                     tie_tolerance=0.01)  # fmt: skip
    line = report.result_line(_with_verdict(result, won))
    assert f"| {won.describe()} (90% interval) |" in line and won.describe().endswith("vs selective_mlp, 6 rounds")
    assert "the best baseline that fits" not in line, "only the verdict's ratio, against the fastest fitting baseline"
    summary = report.summary_table(_with_verdict(result, won))
    assert won.describe() in summary
    assert report.timing_warning(_with_verdict(result, won)) is None
    noisy = Verdict.of("baseline:selective_mlp", ref, "tuned", {0: 0.8, 1: 1.1, 2: 0.9, 3: 1.05}, tie_tolerance=0.01)
    assert noisy.outcome == "undecided"
    kept = report.result_line(_with_verdict(result, noisy))
    assert (
        "kept the baseline selective_mlp: best tuned plan" in kept
        and "4 rounds, the machine could not separate them" in kept
    )
    warning = report.timing_warning(_with_verdict(result, noisy))
    assert warning is not None and noisy.describe() in warning and "baseline was kept" in warning
    # TensorBoard: the ratio and its bounds as scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report.write_tensorboard(tmp_path, _with_verdict(result, won))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    values = {tag: scalars(acc, tag)[0] for tag in report.tags.VERDICT_SCALAR_TAGS}
    assert list(values.values()) == pytest.approx([won.ratio, won.low, won.high], rel=1e-6)


def test_time_series_keeps_the_alone_and_the_side_by_side_figures_apart_and_says_which_is_which(tmp_path, result):
    # The confirmation reversed the ranking: trial 2 measured fastest alone, trial 4 won side by side.
    reversed_ = {
        2: dict(first_samples_per_second=95.0, samples_per_second=80.0, confirmation_seconds=(0.1, 0.1)),
        4: dict(first_samples_per_second=90.0, samples_per_second=92.0, confirmation_seconds=(0.1, 0.1)),
    }
    trials = tuple(dataclasses.replace(t, **reversed_.get(t.number, {})) for t in result.trials)
    logdir = report.write_tensorboard(tmp_path / "tb", dataclasses.replace(result, trials=trials))
    acc = read(logdir)
    alone = scalars(acc, TAG_SAMPLES_PER_SECOND)
    assert alone[2] == pytest.approx(95.0) and alone[4] == pytest.approx(90.0)
    side = scalars(acc, report.tags.TAG_SIDE_BY_SIDE_SAMPLES_PER_SECOND)
    assert side == pytest.approx({2: 80.0, 4: 92.0})  # only the plans re-timed side by side
    assert max(scalars(acc, TAG_BEST_SAMPLES_PER_SECOND).values()) == pytest.approx(95.0)
    for tag in (TAG_SAMPLES_PER_SECOND, TAG_BEST_SAMPLES_PER_SECOND, report.tags.TAG_SIDE_BY_SIDE_SAMPLES_PER_SECOND):
        description = acc.SummaryMetadata(tag).summary_description
        assert description == report.tags.SCALAR_DESCRIPTIONS[tag] and "side" in description
    assert "alone" in TAG_SAMPLES_PER_SECOND and "alone" in TAG_BEST_SAMPLES_PER_SECOND


def test_the_report_package_exports_only_the_names_callers_use():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        report.nothing_here  # noqa: B018
    assert len(report.__all__) <= 15


def test_the_pareto_figure_tells_the_time_models_prunes_from_the_memory_models(result):
    # A plan the time model pruned is predicted to fit: drawn as a memory prune it sat inside the budget line.
    by_time = trial(8, uniform(BlockPlan("full")), "full h.0-3 (again)", "pruned", pred=500, pruned_by="time")
    fig = report.pareto_figure(dataclasses.replace(result, trials=(*result.trials, by_time)))
    legend = [" ".join(t.get_text().split()) for t in fig.legends[0].get_texts()]
    assert "pruned by the memory model (at predicted memory)" in legend
    assert "pruned by the time model (predicted slower; at predicted memory)" in legend
    markers = {" ".join(c.get_label().split()): c for c in fig.axes[0].collections}
    assert len(markers["pruned by the time model (predicted slower; at predicted memory)"].get_offsets()) == 1
    assert len(markers["pruned by the memory model (at predicted memory)"].get_offsets()) == 1


def test_the_memory_breakdown_merges_blocks_that_read_the_same_and_shows_the_optimizer_state_the_step_made():
    # Six blocks a few bytes apart printed six identical columns; AdamW's state, made by the first step, read 0.0.
    blocks = [{"fqn": f"h.{i}", "saved_bytes": {"none": 10 * MiB + 8 * i, "full": MiB - i},
               "recompute_transient_bytes": 2 * MiB + i} for i in range(6)]  # fmt: skip
    breakdown = {"device": "cpu", "parameter_bytes": 4 * MiB, "optimizer_state_bytes": 0, "blocks": blocks}
    plan = Plan(metadata={"optimizer_step": {"state_bytes_before": 0, "state_bytes_after": int(12.3 * MiB)}})
    text = report.text.memory_markdown(breakdown, plan)
    assert "| mode | `h.0-5` |" in text and "| none | 10.0 |" in text
    assert "| optimizer state (made by the first step) | 12.3 |" in text and "| optimizer state | 0.0 |" not in text
    assert "| optimizer state | 0.0 |" in report.text.memory_markdown(breakdown)  # no step recorded: the profile's


def _long_winner(result: TuneResult, *, confirmed: tuple[int, ...] = ()) -> TuneResult:
    """``result`` won by a plan whose label is as long as the main job's, every status drawn, ``confirmed`` re-timed."""
    fqns = [f"transformer.h.{i}" for i in range(12)]
    plan = Plan({f: BlockPlan("full") if i % 3 == 0 else BlockPlan("selective", ("mlp",)) for i, f in enumerate(fqns)})
    extra = (
        trial(8, uniform(BlockPlan("full")), "full h.0-3 (again)", "pruned", pred=500, pruned_by="time"),
        trial(9, plan, plan.describe(), "ok", peak=470, act=170, pred=470, sps=95.0),
    )
    # Re-timed beside the reference (selective_mlp): trial 1 at 70/85 of it, the winner 1.12x in its fresh rounds.
    ratios = {1: 70 / 85, 2: 1.0, 9: 1.12}
    trials = tuple(
        dataclasses.replace(
            t,
            confirmation_seconds=(0.1, 0.1),
            extra={"vs_reference": {"reference": "baseline:selective_mlp", "ratio": ratios.get(t.number, 1.0)}},
        )
        if t.number in confirmed
        else t
        for t in (*result.trials, *extra)
    )
    return dataclasses.replace(result, trials=trials, best_trial=next(t for t in trials if t.number == 9))


def test_the_whole_legend_is_inside_the_rendered_figure(result, tmp_path):
    # Issue #64: the legend below the axes ran past both edges of pareto.png ("e budget", "baseline:sqr").
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    fig = report.pareto_figure(_long_winner(result, confirmed=(1, 2, 9)))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    (legend,) = fig.legends
    texts = legend.get_texts()
    assert any("winner: [trial 9] full h.0,3,6,9" in t.get_text() for t in texts)
    for artist in (legend, *texts):
        box = artist.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (artist, box, width, height)
    # And in the file the run writes: the legend's frame is drawn on the image's rows, its edges inside the columns.
    path = tmp_path / "pareto.png"
    fig.savefig(path, dpi=110)
    image = Image.open(path)
    box = legend.get_window_extent(renderer)
    assert image.width == round(width * 110 / fig.dpi) and box.x1 * 110 / fig.dpi < image.width


def test_the_figure_and_the_table_mark_what_was_timed_one_plan_at_a_time(result, tmp_path):
    # Issue #64: a plan timed alone in a quiet moment sat above the winner, and its row read faster than the winner's.
    confirmed = _long_winner(result, confirmed=(1, 2, 9))
    fig = report.pareto_figure(confirmed)
    labels = [" ".join(t.get_text().split()) for t in fig.legends[0].get_texts()]
    assert any(label.startswith("hollow: timed one plan at a time") for label in labels), labels
    fits = [c for c in fig.axes[0].collections if c.get_label() == "fits the budget"]
    assert len(fits) == 1 and len(fits[0].get_offsets()) == 3, "the three plans re-timed side by side are filled"
    hollow = {tuple(p) for c in fig.axes[0].collections if len(c.get_facecolors()) == 0 for p in c.get_offsets()}
    alone = [t for t in confirmed.trials if t.samples_per_second is not None and not t.confirmed]
    assert alone and all((t.peak_bytes / MiB, t.samples_per_second) in hollow for t in alone), (alone, hollow)
    # Without a confirmation every figure was timed alone: nothing to tell apart, no hollow points.
    plain = report.pareto_figure(_long_winner(result))
    assert not any("hollow" in t.get_text() for t in plain.legends[0].get_texts())

    logdir = tmp_path / "tb"
    report.write_tensorboard(logdir, confirmed)
    rows = sorted((logdir / report.tags.HPARAM_RUN_DIR).iterdir())
    seen = {}
    for row in rows:
        acc = ea.EventAccumulator(str(row), size_guidance=SIZE_GUIDANCE)
        acc.Reload()
        content = acc.PluginTagToContent(hp_metadata.PLUGIN_NAME)
        hp = hp_metadata.parse_session_start_info_plugin_data(content[hp_metadata.SESSION_START_INFO_TAG]).hparams
        vs = report.tags.HPARAM_VS_REFERENCE
        ratio = acc.Tensors(vs)[0].tensor_proto.float_val[0] if vs in acc.Tags()["tensors"] else None
        seen[hp[report.tags.hparam_name("trial")].string_value] = (
            hp[report.tags.hparam_name("timing")].string_value,
            ratio,
        )
    assert seen["9"][0] == "side by side" and seen["9"][1] == pytest.approx(1.12)
    assert seen["2"] == ("side by side", pytest.approx(1.0))
    assert seen["6"] == ("one at a time", None), seen
    # The summary table says the same of each row's samples/s.
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in
            report.summary_table(confirmed).splitlines() if line.strip() and line.strip()[0] in "*0123456789"}  # fmt: skip
    assert " side " in rows["9"] and " 1.12x " in rows["9"] and " alone " in rows["6"], rows
    assert " 95.2 " in rows["9"], "a side-by-side row's samples/s: the reference's 85.0 x its 1.12"
    # Side-by-side points sit on one scale: the reference's figure times each plan's ratio to it.
    assert report.figure.comparable_speeds(confirmed) == pytest.approx({1: 70.0, 2: 85.0, 9: 85.0 * 1.12})
    assert fig.axes[0].get_ylabel().startswith("samples / s (filled: the reference's x its paired ratio")


def test_what_an_offloading_plan_did_is_in_its_trial_line_the_result_line_show_and_tensorboard(tmp_path, result):
    # The pool held 1 GiB in 1.5 GiB of chunks; backward was predicted to wait 200 ms for the link, and the step ran
    # 100 ms slower than predicted: 300 ms measured.
    from lightning_ckpt.cli.show import format_plan
    from lightning_ckpt.report.tags import TAG_OFFLOAD_EXPOSED_MEASURED_MS, TAG_OFFLOAD_POOL_MIB
    from lightning_ckpt.search.result import _measured_figures

    pool = {"offload_host_peak_bytes": 2**30, "offload_host_pool_bytes": 3 * 2**29, "offload_exposed_seconds": 0.2}
    plan = uniform(BlockPlan("offload"))
    winner = trial(8, plan, "offload h.0-3", "ok", peak=450, act=150, pred=460, sps=8 / 1.3, predicted_seconds=1.2,
                   extra=pool)  # fmt: skip
    said = "offloads 1.0 GiB to a 1.5 GiB pinned host pool, exposed transfer 200.0 ms predicted, 300.0 ms measured"
    assert said in report.trial_line(winner, result.budget)
    offloaded = dataclasses.replace(result, best=plan, best_trial=winner, trials=(*result.trials, winner))
    assert said in report.result_line(offloaded)
    saved = Plan.from_dict(dataclasses.replace(plan, metadata={"measured": _measured_figures(winner)}).to_dict())
    assert f"the winner {said}" in format_plan(saved), "the plan file keeps it (its schema takes it) and show says it"
    acc = read(report.write_tensorboard(tmp_path / "tb", offloaded))
    assert scalars(acc, TAG_OFFLOAD_POOL_MIB) == pytest.approx({8: 1536.0})
    assert scalars(acc, TAG_OFFLOAD_EXPOSED_MEASURED_MS) == pytest.approx({8: 300.0})
    assert "offloads" not in report.trial_line(result.trials[4], result.budget), "nothing said where nothing moved"
