"""What a user sees in TensorBoard, asked of a real ``tensorboard`` server through its HTTP API.

The fit uses Lightning's default ``TensorBoardLogger`` (``hp_metric`` on) and a LightningModule that saves
hyperparameters, as most users' do; the server is started the way a user starts it and the requests are
the ones TensorBoard's browser tabs make (HParams, Time Series runs, Text, Images).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner
from lightning_ckpt.report import tags as report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADERS = {"X-XSRF-Protected": "1", "Content-Type": "application/json"}


class HParamsGPT(LitGPT):
    def __init__(self, lr: float = 1e-3, n_layer: int = 4) -> None:
        super().__init__(n_layer=n_layer, n_embd=32, vocab_size=48, block_size=16, dropout=0.0, lr=lr)
        self.save_hyperparameters()  # Lightning then writes its own HParams experiment (lr, n_layer, hp_metric)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb_server")
    space = {
        "modes": ["full", "selective:mlp"],
        "selections": ["all", "first:0.5"],
        "rest_modes": ["none"],
        "segments": True,
        "chunks": [2],
    }
    tuner = ActivationCheckpointTuner(
        activation_budget=0.6, search=dict(n_trials=30, measure_steps=1, warmup_steps=1, search_space=space)
    )
    trainer = quiet_trainer(root, [tuner], steps=2, logger=True)
    trainer.fit(HParamsGPT(), token_loader(32))
    assert type(trainer.logger).__name__ == "TensorBoardLogger"  # Lightning's default logger
    return root / "lightning_logs", tuner


@pytest.fixture(scope="module")
def server(fit):
    logdir, _ = fit
    yield from tensorboard_at(logdir)


def tensorboard_at(logdir: Path):
    """A ``tensorboard --logdir`` server on a free port, started as a user starts it; yields its URL."""
    exe = shutil.which("tensorboard") or str(Path(sys.executable).with_name("tensorboard"))
    proc = subprocess.Popen(
        [exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0", "--reload_interval", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url, lines, deadline = None, [], time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        found = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
        url = found.group(1) if found else None
    if url is None:
        proc.kill()
        pytest.fail("tensorboard did not start:\n" + "".join(lines))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def get(url: str, path: str, **params: str) -> bytes:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(url + path + query, timeout=30) as response:
        return response.read()


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=HEADERS, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def session_groups(url: str) -> list[dict]:
    """The HParams table's rows, as its Table View asks for them (every status, the first 100)."""
    query = {
        "experimentName": "",
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
        "colParams": [],
        "startIndex": 0,
        "sliceSize": 100,
    }
    return post(url, "/data/plugin/hparams/session_groups", query)["sessionGroups"]


def until(fetch, ready, timeout: float = 60.0):
    """TensorBoard loads the logs in the background: ask again until the answer is there."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if ready(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_hparams_tab_lists_the_tuner_trials_with_the_winner_marked(server, fit):
    _, tuner = fit
    experiment = until(
        lambda: post(server, "/data/plugin/hparams/experiment", {"experimentName": ""}),
        lambda e: bool(e.get("hparamInfos")),
    )
    names = [h["name"] for h in experiment["hparamInfos"]]
    displayed = {h["name"]: h.get("displayName", h["name"]) for h in experiment["hparamInfos"]}
    # The tuner's columns, in its order, not replaced by the experiment Lightning writes (lr, n_layer, hp_metric).
    ours = [report.hparam_name(k) for k, _, _ in report.HPARAM_COLUMNS]
    assert names[: len(ours)] == ours
    assert [displayed[n] for n in names[:3]] == ["winner", "plan", "status"]
    assert displayed[report.hparam_name("selection")] == "blocks"
    assert {"lr", "n_layer"} <= set(names[len(ours) :])  # the module's own hyperparameters stay visible
    metrics = {m["name"]["tag"]: m.get("displayName") for m in experiment["metricInfos"]}
    assert metrics == {tag: display for tag, display, _ in report.HPARAM_METRICS}
    assert "hp_metric" not in metrics

    groups = session_groups(server)
    col = report.hparam_name
    rows = [g for g in groups if col("plan") in g["hparams"]]
    result = tuner.result
    assert 2 <= len(rows) <= report.HPARAM_ROWS
    winners = [g for g in rows if g["hparams"].get(col("winner")) == report.WINNER_MARK]
    assert len(winners) == 1
    (winner,) = winners
    assert winner["hparams"][col("plan")] == result.best.describe()
    assert winner["hparams"][col("trial")] == str(result.best_trial.number) and winner["hparams"][col("status")] == "ok"
    assert "01_winner_trial" in winner["name"]
    values = {m["name"]["tag"]: m["value"] for m in winner["metricValues"]}
    assert values[report.HPARAM_SAMPLES_PER_SECOND] == pytest.approx(result.best_trial.samples_per_second, rel=1e-6)
    assert values[report.HPARAM_ACTIVATION_MIB] == pytest.approx(result.best_trial.activation_bytes / 2**20, rel=1e-6)
    by_trial = {t.number: t for t in result.trials}
    for g in rows:
        t = by_trial[int(g["hparams"][col("trial")])]
        assert g["hparams"][col("plan")] == t.plan.describe() and g["hparams"][col("status")] == t.status


def test_run_count_stays_small_whatever_the_trial_count(server, fit):
    _, tuner = fit
    runs = until(lambda: json.loads(get(server, "/data/runs")), lambda r: len(r) > 2)
    assert len(tuner.result.trials) > len(runs)  # more trials than runs: not one run per trial
    assert len(runs) <= report.HPARAM_ROWS + 2 < 40  # TensorBoard deselects every run above 40
    search_run = next(r for r in runs if r.endswith("lightning_ckpt"))
    best = json.loads(
        get(server, "/data/plugin/scalars/scalars", run=search_run, tag=report.TAG_BEST_SAMPLES_PER_SECOND)
    )
    steps, values = [s for _, s, _ in best], [v for _, _, v in best]
    assert steps == sorted(steps) and values == sorted(values)  # a best-so-far curve, by trial number
    # Each chart says whose figures it holds: measured alone as the search ran, or side by side.
    tags = json.loads(get(server, "/data/plugin/scalars/tags"))[search_run]
    for tag in (report.TAG_SAMPLES_PER_SECOND, report.TAG_BEST_SAMPLES_PER_SECOND):
        assert "measured alone" in tags[tag]["description"] and "side" in tags[tag]["description"]
    side = tags.get(report.TAG_SIDE_BY_SIDE_SAMPLES_PER_SECOND)
    assert side is None or "side by side" in side["description"]
    assert (side is not None) == any(t.confirmed for t in tuner.result.trials)


def test_text_and_images_tabs_show_the_plan_summary_and_pareto_figure(server, fit):
    _, tuner = fit
    runs = until(lambda: json.loads(get(server, "/data/plugin/text/tags")), lambda t: bool(t))
    (search_run,) = [r for r, tags in runs.items() if report.text_tag(report.TAG_PLAN) in tags]
    plan = json.loads(get(server, "/data/plugin/text/text", run=search_run, tag=report.text_tag(report.TAG_PLAN)))
    assert tuner.result.best.describe() in plan[0]["text"] and "<table>" in plan[0]["text"]
    summary = json.loads(get(server, "/data/plugin/text/text", run=search_run, tag=report.text_tag(report.TAG_SUMMARY)))
    first = summary[0]["text"].split("<li>")[1]
    assert "winner" in first  # the verdict comes first, not below every trial
    memory = json.loads(
        get(server, "/data/plugin/text/text", run=search_run, tag=report.text_tag(report.TAG_MEMORY_BREAKDOWN))
    )
    assert "<table>" in memory[0]["text"] and "<pre>" not in memory[0]["text"]  # a table that wraps, never cut off

    images = json.loads(get(server, "/data/plugin/images/images", run=search_run, tag=report.TAG_PARETO))
    assert len(images) == 1
    png = get(server, "/data/plugin/images/individualImage?" + images[0]["query"].lstrip("?"))
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


@pytest.fixture(scope="module")
def reused(tmp_path_factory):
    """The README's flow: a search writes the plan file, then a second fit reuses it (zero trials), both logging to
    one TensorBoard directory, which the user then opens."""
    root = tmp_path_factory.mktemp("tb_reuse")
    plan_path = root / "plan.json"
    space = {"modes": ["full"], "selections": ["all", "first:0.5"], "rest_modes": ["none"], "segments": False}
    tuner = ActivationCheckpointTuner(
        activation_budget=0.6,
        plan_path=plan_path,
        search=dict(n_trials=6, measure_steps=1, warmup_steps=1, search_space=space),
    )
    quiet_trainer(root, [tuner], steps=1, logger=True).fit(HParamsGPT(), token_loader(32))
    again = ActivationCheckpointTuner(plan=plan_path)
    quiet_trainer(root, [again], steps=1, logger=True).fit(HParamsGPT(), token_loader(32))
    assert again.trials_run == 0
    return root / "lightning_logs"


@pytest.fixture(scope="module")
def reused_server(reused):
    yield from tensorboard_at(reused)


def experiment_records(logdir: Path) -> dict[str, list[str]]:
    """Every run's HParams experiment record under ``logdir``: run -> its columns, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    records = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        try:
            content = acc.PluginTagToContent(metadata.PLUGIN_NAME).get(metadata.EXPERIMENT_TAG)
        except KeyError:  # a run with no HParams data at all (the tuner's trial runs)
            continue
        if content is not None:
            experiment = metadata.parse_experiment_plugin_data(content)
            records[str(events.parent.relative_to(logdir))] = [h.name for h in experiment.hparam_infos]
    return records


def test_the_hparams_table_keeps_the_tuners_columns_after_a_reuse_run(reused, reused_server):
    # The reuse run wrote Lightning's own experiment record (lr, n_layer, hp_metric), and TensorBoard shows one record
    # of a logdir, whichever it finds first (the order its directory walk finds runs in): every record must have ours.
    ours = [report.hparam_name(k) for k, _, _ in report.HPARAM_COLUMNS]
    records = experiment_records(reused)
    assert set(records) == {"version_0", "version_1"}, records
    assert all(columns[: len(ours)] == ours for columns in records.values()), records
    experiment = until(
        lambda: post(reused_server, "/data/plugin/hparams/experiment", {"experimentName": ""}),
        lambda e: bool(e.get("hparamInfos")),
    )
    assert [h["name"] for h in experiment["hparamInfos"]][: len(ours)] == ours
    metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
    assert metrics == {tag for tag, _, _ in report.HPARAM_METRICS}
    groups = session_groups(reused_server)
    winners = [g for g in groups if g["hparams"].get(report.hparam_name("winner")) == report.WINNER_MARK]
    assert len(winners) == 1, "the search's leaders and its winner are still listed"
