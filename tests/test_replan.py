"""Re-planning for a new budget from the profile a plan file keeps: the same plan a full search picks when the time
model ranks plans correctly, zero trials in the callback with the first real steps beside the prediction, the
budget guard catching a profile that lies, and ``lightning-ckpt replan``."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from linear_clock import LinearClock
from lit import LitGPT, quiet_trainer, token_loader
from search_driver import Study

from lightning_ckpt import ActivationCheckpointTuner, Plan
from lightning_ckpt.budget import Budget
from lightning_ckpt.cli.main import main
from lightning_ckpt.discovery import discover_blocks
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError, PlanError
from lightning_ckpt.measure.measurement import Measurement
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory, RealStepMemory
from lightning_ckpt.memory.profile import profile_step
from lightning_ckpt.plan.format import BlockPlan
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.replan import SavedProfile, profile_metadata, replan
from lightning_ckpt.search.space import SearchSpace, offered_candidates
from lightning_ckpt.testing import GPT, GPTConfig

BATCH = 8


class PredictedRunner:
    """Measures every plan at exactly the profile's predictions: a time model that ranks plans correctly."""

    predicts_memory, memory_exact, predicts_time, collective_steps, reserve_headroom_bytes = True, True, False, False, 0

    def __init__(self, memory, time) -> None:
        self.memory, self.time = memory, time

    def _figures(self, plan: Plan) -> dict:
        seconds = self.time.predict_seconds(plan)
        peak, act = self.memory.predict_peak(plan), self.memory.predict_activation(plan)
        return dict(peak_bytes=peak, activation_bytes=act, median_seconds=seconds, samples_per_second=BATCH / seconds)

    def measure(self, plan: Plan, memory_limit, *, memory: bool = True) -> Measurement:
        return Measurement("ok", steps=4, spread_seconds=0.0, **self._figures(plan))

    def measure_memory(self, plan: Plan, memory_limit) -> Measurement:
        return Measurement("ok", steps=1, **self._figures(plan))

    def retime(self, plan: Plan, steps: int, *, warmup: int = 1) -> Measurement:
        f = self._figures(plan)
        return Measurement("ok", step_seconds=(f["median_seconds"],), spread_seconds=0.0, **f)


@pytest.mark.parametrize("share", [0.4, 0.6, 0.9])
def test_a_replanned_plan_is_the_plan_a_full_search_picks_on_the_same_profile_when_the_time_model_ranks_right(share):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.0))
    x = torch.randint(0, 48, (BATCH, 16))
    profiled = profile_step(model, lambda: model(x, x))
    profiled = profiled.with_time(profiled.time.calibrated([(Plan(), "none", 0.05)]))
    memory = profiled.memory
    stacks = discover_blocks(model)
    space = SearchSpace().for_device("cpu")
    stacks, candidates = offered_candidates(space, stacks, memory.fingerprint, memory)
    limit = int(share * memory.predict_activation(Plan()))
    budget = Budget("activation", limit, share, f"{share:.0%} of activations")
    # Every fitting plan confirmed: the search then chooses among all of them, as a re-plan does.
    config = TuneConfig(n_trials=len(candidates), predict_time=False, confirm_top=len(candidates))
    study = Study(candidates=candidates, space=space, stacks=stacks, runner=PredictedRunner(memory, profiled.time), budget=budget,
                  memory=RealStepMemory(memory, OptimizerStepMemory.absent()), config=config,
                  fingerprint=memory.fingerprint, device_type="cpu", samples_per_step=BATCH)  # fmt: skip
    study.run()
    assert all(t.status != "pruned" or t.pruned_by == "memory" for t in study.records), "every plan that fits ran"
    study.confirm()
    searched = study.result(extra_steps=0).best
    profile = profile_metadata(profiled, OptimizerStepMemory.absent(), stacks, space, batch_size=BATCH, seq_len=16,
                               tie_tolerance=config.tie_tolerance)  # fmt: skip
    saved = Plan(fingerprint=memory.fingerprint, metadata={"profile": json.loads(json.dumps(profile))})
    replanned = replan(saved, activation_budget=share)
    assert replanned.plan.key() == searched.key(), (replanned.plan.describe(), searched.describe())
    assert replanned.plan.metadata["replanned"]["predicted"] is True
    assert replanned.budget.limit_bytes == limit
    # The memory and the time model side by side; a file of 0.3-0.4 (time model inside the memory model's
    # "timing") re-plans the same.
    assert profile["time"] is not None and "timing" not in profile["memory"]
    older = json.loads(json.dumps(profile))
    older["memory"]["timing"] = older.pop("time")
    again = replan(Plan(fingerprint=memory.fingerprint, metadata={"profile": older}), activation_budget=share)
    assert again.plan.key() == replanned.plan.key()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A plan file written by a real search in the callback (activation budget 0.5), and the LightningModule.

    The search runs on the Linear clock: how many plans it measures (the time model's anchors) follows its step times,
    and on a busy machine the time model's errors once left it one measured plan. There every Linear call takes 1 ms
    and nothing else any time, so the search measures the same plans on any machine."""
    tmp = tmp_path_factory.mktemp("tuned")
    path = tmp / "plan.json"
    clock = LinearClock()
    tuner = ActivationCheckpointTuner(activation_budget=0.5, plan_path=path, search={"n_trials": 10, "clock": clock})
    with clock.installed():
        quiet_trainer(tmp, [tuner], steps=2).fit(LitGPT(dropout=0.0), token_loader(64))
    assert tuner.trials_run > 0
    return path


def test_the_plan_file_keeps_the_profile_the_search_fitted(tuned):
    saved = Plan.load(tuned)
    profile = SavedProfile.of_plan(saved)
    assert profile.batch_size == BATCH and profile.seq_len == 16
    anchors = profile.time.calibration.anchors
    assert len(anchors) >= 2, "the time model was fitted to the plans the search measured"
    assert saved.metadata["search"]["time_model"]["predicted_and_measured"] >= 1


def test_a_new_budget_re_plans_from_the_saved_profile_with_zero_trials_and_reports_the_first_real_steps(
    tuned, tmp_path, caplog
):
    out = tmp_path / "replanned.json"
    tuner = ActivationCheckpointTuner(plan=str(tuned), activation_budget=0.4, plan_path=out)
    with caplog.at_level(logging.INFO):
        quiet_trainer(tmp_path, [tuner], steps=4).fit(LitGPT(dropout=0.0), token_loader(64))
    assert tuner.result is None and tuner.trials_run == 0, "no search ran"
    expected = replan(Plan.load(tuned), activation_budget=0.4)
    assert tuner.plan.key() == expected.plan.key()
    written = Plan.load(out)
    replanned = written.metadata["replanned"]
    assert replanned["predicted"] is True and replanned["predicted_seconds"] > 0
    first = replanned["first_measured"]
    assert first["peak_bytes"] > 0 and first["activation_bytes"] > 0 and first["seconds"] > 0
    assert tuner.step_checks and all(c.within_budget for c in tuner.step_checks), "the guard read the first steps"
    line = next(r.getMessage() for r in caplog.records if "vs its first real steps" in r.getMessage())
    assert "predicted /" in line and "measured" in line and "ms predicted" in line
    # Applied again with the same budget it is reused as it is: no re-plan.
    again = ActivationCheckpointTuner(plan=str(out), activation_budget=0.4)
    quiet_trainer(tmp_path, [again], steps=1).fit(LitGPT(dropout=0.0), token_loader(64))
    assert again.trials_run == 0 and again.plan.metadata["replanned"]["first_measured"] == first


def _lying(plan: Plan) -> Plan:
    """``plan`` with a profile that says no-checkpointing saves no more than full checkpointing."""
    data = json.loads(json.dumps(plan.metadata["profile"]))
    for block in data["memory"]["blocks"]:
        block["profiles"]["none"] = block["profiles"]["full"]
        block["saved_bytes"]["none"] = block["saved_bytes"]["full"]
    return plan.with_provenance(profile=data)


def test_the_budget_guard_catches_a_plan_replanned_from_a_wrong_profile(tuned, tmp_path):
    honest = SavedProfile.of_plan(Plan.load(tuned))
    stacks = {s.fqn: s for s in honest.stacks}
    full = Plan({b.fqn: BlockPlan("full") for s in stacks.values() for b in s.blocks})
    full_peak = RealStepMemory(honest.memory, honest.optimizer).predict(full)[0]
    none_peak = RealStepMemory(honest.memory, honest.optimizer).predict(Plan())[0]
    budget = int(full_peak + 0.2 * (none_peak - full_peak))
    lying = tmp_path / "lying.json"
    _lying(Plan.load(tuned)).save(lying)
    assert replan(Plan.load(lying), max_memory=budget).plan.is_empty, "the wrong profile says no checkpointing fits"
    assert not replan(Plan.load(tuned), max_memory=budget).plan.is_empty
    tuner = ActivationCheckpointTuner(plan=str(lying), max_memory=budget, guard={"on_budget_exceeded": "warn"})
    with pytest.warns(UserWarning, match="over the budget"):
        quiet_trainer(tmp_path, [tuner], steps=3).fit(LitGPT(dropout=0.0), token_loader(64))
    assert tuner.trials_run == 0 and tuner.plan.is_empty
    assert tuner.step_checks and not tuner.step_checks[0].within_budget


def test_replan_scales_with_the_batch_and_refuses_what_it_cannot_do(tuned):
    saved = Plan.load(tuned)
    at_8 = replan(saved, activation_budget=0.5)
    at_16 = replan(saved, activation_budget=0.5, batch_size=16)
    assert at_16.predicted_seconds == pytest.approx(2 * at_8.predicted_seconds, rel=0.02) or at_16.plan != at_8.plan
    assert at_16.plan.metadata["conditions"]["batch_size"] == 16
    with pytest.raises(InfeasibleBudgetError, match="predicted to fit"):
        replan(saved, max_memory=1024)
    with pytest.raises(PlanError, match="keeps no profile"):
        replan(Plan({"model.transformer.h.0": BlockPlan("full")}), max_memory="1GiB")


def test_a_gpu_plan_is_replanned_for_a_share_of_its_recorded_gpu_on_a_machine_without_one(tuned):
    # On a CPU machine `replan --max-memory 0.8` of a GPU plan raised "Torch not compiled with CUDA enabled".
    data = Plan.load(tuned).to_dict()
    data["metadata"]["profile"]["memory"]["device"] = "cuda:0"
    data["metadata"]["conditions"] = {**(data["metadata"].get("conditions") or {}), "device_type": "cuda",
                                      "device_capacity_bytes": 80 * 2**30}  # fmt: skip
    gpu_plan = Plan.from_dict(data)
    got = replan(gpu_plan, max_memory=0.8)
    assert got.budget.limit_bytes == int(0.8 * 80 * 2**30) and "recorded 80.0 GiB" in got.budget.description
    del data["metadata"]["conditions"]["device_capacity_bytes"]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match=r"no CUDA device and no capacity was recorded.*Give bytes"):
            replan(Plan.from_dict(data), max_memory=0.8)


def test_the_replan_command_prints_the_predicted_plan_and_writes_it(tuned, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["replan", str(tuned), "--activation-budget", "0.4", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "re-planned (predicted, 0 trials)" in text and f"wrote {out}" in text
    assert Plan.load(out).key() == replan(Plan.load(tuned), activation_budget=0.4).plan.key()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "re-planned   PREDICTED, 0 trials" in shown and "profile      kept" in shown
    assert main(["replan", str(tuned), "--max-memory", "64MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["predicted"] is True and data["predicted_peak_bytes"] <= 64 * 2**20


def test_the_replan_command_refuses_a_plan_without_a_profile_and_a_missing_budget(tmp_path, capsys):
    bare = tmp_path / "bare.json"
    Plan({"model.transformer.h.0": BlockPlan("full")}).save(bare)
    assert main(["replan", str(bare), "--max-memory", "1GiB"]) == 2  # a file it cannot re-plan from: bad input
    assert "keeps no profile" in capsys.readouterr().err
    assert main(["replan", str(bare)]) == 2
    assert "give the new budget" in capsys.readouterr().err


# Run the command in a Python that cannot import torch, Lightning or Optuna: re-planning reads the profile alone.
_WITHOUT_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ("torch", "lightning", "pytorch_lightning", "optuna", "numpy"):
            raise ImportError(f"{name} is not importable here")

sys.meta_path.insert(0, NoTorch())
from lightning_ckpt.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_replan_show_and_diff_run_without_torch(tuned, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out.json"

    def cli(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True, text=True)
        assert done.returncode in (0, 1), done.stderr
        return done

    replanned = cli("replan", str(tuned), "--activation-budget", "0.4", "-o", str(out))
    assert replanned.returncode == 0 and "re-planned (predicted, 0 trials)" in replanned.stdout
    assert Plan.load(out).key() == replan(Plan.load(tuned), activation_budget=0.4).plan.key()
    assert "re-planned   PREDICTED, 0 trials" in cli("show", str(out)).stdout
    assert cli("diff", str(tuned), str(out)).returncode == 0
    assert json.loads(cli("replan", str(tuned), "--max-memory", "64MiB", "--json").stdout)["predicted"] is True


def _saved_gpt_profile(edit_seconds, anchors, *, metadata=None) -> tuple[Plan, dict]:
    """A plan file keeping a small GPT's real profile, its block timings edited by ``edit_seconds(row_seconds)`` and
    its time model fitted to ``anchors`` ((candidate label, measured step seconds)); and the candidates by label.

    The blocks are timed on the Linear clock (each Linear call 1 ms): the anchors are fixed, but blocks timed for real
    on a busy machine once made the re-plan below keep ``selective(mlp) h.0`` where the file measured no checkpointing
    faster; the tests here are of the re-plan's rules, not of this machine's timings."""
    from dataclasses import replace as replaced

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.0))
    x = torch.randint(0, 48, (BATCH, 16))
    with LinearClock().installed():
        profiled = profile_step(model, lambda: model(x, x))
    time = profiled.time
    time = replaced(time, blocks=tuple(replaced(b, seconds=edit_seconds(dict(b.seconds))) for b in time.blocks))
    stacks = discover_blocks(model)
    space = SearchSpace().for_device("cpu")
    stacks, candidates = offered_candidates(space, stacks, profiled.memory.fingerprint, profiled.memory)
    by_label = {c.label: c for c in candidates}
    time = time.calibrated([(by_label[label].plan, label, seconds) for label, seconds in anchors])
    profile = profile_metadata(profiled.with_time(time), OptimizerStepMemory.absent(), stacks, space, batch_size=BATCH,
                               seq_len=16, tie_tolerance=0.01)  # fmt: skip
    saved = Plan(
        fingerprint=profiled.memory.fingerprint,
        metadata={"profile": json.loads(json.dumps(profile)), **(metadata or {})},
    )
    return saved, by_label


def _attention_recompute_timed_faster(seconds: dict) -> dict:
    # The main job's file on a loaded machine: recomputing attention timed below the block without checkpointing.
    seconds["selective:attn"] = 0.3 * seconds["none"]
    return seconds


ATTN = "selective(attn) h.0-3"
SLOW_MODEL = {"search": {"time_model": {"median_abs_error": 0.50, "predicted_and_measured": 6}}}


def test_a_replan_where_every_plan_fits_keeps_no_checkpointing_and_predicts_nothing_below_the_plain_step():
    # Issue #64: `replan --max-memory 40GiB` chose `selective(attn)`, predicted 2.4x faster than the plain step,
    # because the saved timings gave recomputing attention a negative cost. Recompute never makes a step faster.
    saved, by_label = _saved_gpt_profile(_attention_recompute_timed_faster, [("baseline:full", 0.08), (ATTN, 0.06)])
    profile = SavedProfile.of_plan(saved)
    none_seconds = profile.time.predict_seconds(Plan())
    for label, cand in by_label.items():
        assert profile.time.predict_seconds(cand.plan) >= none_seconds, label
    got = replan(saved, max_memory="40GiB")
    assert got.plan.is_empty, got.describe()
    assert got.fitting == got.considered
    # The attention plan was measured one plan at a time at 60 ms, faster than the plain step is predicted (its fit
    # puts it at the median of the two): a figure timed alone is no evidence against a baseline's prediction.
    assert got.predicted_seconds == pytest.approx(none_seconds)


def test_a_plan_the_file_measured_keeps_its_measured_time_and_a_side_by_side_verdict_still_wins():
    saved, by_label = _saved_gpt_profile(lambda s: s, [("baseline:none", 0.050), ("baseline:full", 0.090)])
    got = replan(saved, max_memory="40GiB")
    assert got.plan.is_empty and got.time_measured
    assert got.predicted_seconds == pytest.approx(0.050), "the file measured the plain step: its figure, not the fit's"
    assert "measured 160.00 samples/s (50.0 ms/step) when it was tuned" in got.describe()
    # A tuned plan the file's side-by-side rounds found faster than no checkpointing stays chosen for a larger budget.
    mlp = "selective(attn,mlp) h.0-3"
    verdict = {"reference": "baseline:none", "candidate": mlp, "ratio": 1.08, "low": 1.04, "high": 1.12, "rounds": 8,
               "threshold": 1.01}  # fmt: skip
    saved, _ = _saved_gpt_profile(
        lambda s: s,
        [("baseline:none", 0.050), ("baseline:full", 0.090), (mlp, 0.046)],
        metadata={"search": {"verdict": verdict}},
    )
    got = replan(saved, max_memory="40GiB")
    assert got.plan.describe() == mlp and got.time_measured


def test_replan_says_when_the_saved_time_model_predicted_badly(tmp_path, capsys):
    saved, _ = _saved_gpt_profile(lambda s: s, [("baseline:none", 0.05), ("baseline:full", 0.09)], metadata=SLOW_MODEL)
    got = replan(saved, max_memory="40GiB")
    assert len(got.notes) == 1 and "predictions were off by 50%" in got.notes[0]
    path = tmp_path / "slow.json"
    saved.save(path)
    assert main(["replan", str(path), "--max-memory", "40GiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("re-planned (predicted, 0 trials) for 40.0 GiB")
    assert lines[1].startswith("note: the saved time model's predictions were off by 50% (median of the plans the "
                               "search predicted and then measured")  # fmt: skip
    quiet = {"search": {"time_model": {"median_abs_error": 0.03}}}
    saved, _ = _saved_gpt_profile(lambda s: s, [("baseline:none", 0.05), ("baseline:full", 0.09)], metadata=quiet)
    assert replan(saved, max_memory="40GiB").notes == ()
