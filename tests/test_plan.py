from __future__ import annotations

import json
import os
import stat

import pytest

from lightning_ckpt import BlockPlan, Plan, PlanError, StalePlanError, apply_plan, baselines, model_fingerprint
from lightning_ckpt.plan import SCHEMA_VERSION
from lightning_ckpt.testing import GPT, GPTConfig


def test_round_trip_through_disk(tmp_path, gpt):
    plans = baselines(gpt)
    for name, plan in plans.items():
        plan = plan.with_metadata(measured={"samples_per_s": 12.5}, budget_bytes=1 << 20)
        path = plan.save(tmp_path / "plans" / f"{name}.json")
        loaded = Plan.load(path)
        assert loaded == plan
        assert loaded.name == name
        assert loaded.fingerprint == model_fingerprint(gpt)
        assert loaded.metadata["measured"] == {"samples_per_s": 12.5}
        # Written with the lowest schema that holds the plan: 1 unless it sets compile_memory_budget (2).
        assert json.loads(path.read_text())["schema_version"] == 1 <= SCHEMA_VERSION


def test_equality_ignores_name_and_metadata():
    a = Plan({"h.0": BlockPlan("full")}, name="a", metadata={"x": 1})
    b = Plan({"h.0": BlockPlan("full"), "h.1": BlockPlan("none")}, name="b")
    assert a == b and hash(a) == hash(b)
    assert a != Plan({"h.0": BlockPlan("ops", save_list="save_matmuls")})


def test_describe():
    plan = Plan({"h.0": BlockPlan("full"), "h.1": BlockPlan("full"), "h.2": BlockPlan("selective", ("mlp",))})
    assert plan.describe() == "full x2, selective(mlp) x1"
    assert Plan().describe() == "none"
    assert Plan(segments={"h": 2}).describe() == "segments(h=2)"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"blocks": {}}', "schema_version"),
        (json.dumps({"schema_version": SCHEMA_VERSION + 1}), f"schema version {SCHEMA_VERSION + 1} is not supported"),
        (
            json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "sometimes"}}}),
            "Unknown checkpointing mode 'sometimes'",
        ),
        (
            json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "ops", "save_list": "keep_it_all"}}}),
            "Unknown op save-list 'keep_it_all'",
        ),
        (json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "selective"}}}), "children"),
        (json.dumps({"schema_version": 1, "segments": {"h": 0}}), "positive chunk count"),
        (json.dumps({"schema_version": 1, "surprise": 1}), "unknown top-level fields"),
    ],
)
def test_malformed_plan_files_are_refused_with_reason(tmp_path, text, match):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=match) as info:
        Plan.load(path)
    assert str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load("/nonexistent/plan.json")


def test_fingerprint_mismatch_is_stale(gpt):
    other = GPT(GPTConfig(n_layer=5, n_head=2, n_embd=32, vocab_size=48, block_size=32))
    plan = baselines(other)["full"]
    with pytest.raises(StalePlanError, match="Re-tune for this model"):
        apply_plan(gpt, plan)
    # Fingerprints ignore devices and values but not shapes.
    assert model_fingerprint(gpt) != model_fingerprint(other)


def test_failed_save_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = Plan({"h.0": BlockPlan("full")}, name="old").save(tmp_path / "plan.json")
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        Plan({"h.1": BlockPlan("full")}, name="new").save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left behind


def test_unserialisable_metadata_fails_before_touching_disk(tmp_path):
    path = tmp_path / "plan.json"
    with pytest.raises(TypeError, match="not JSON serialisable"):
        Plan(metadata={"obj": object()}).save(path)
    assert not path.exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=oct)
def test_new_plan_file_gets_the_mode_open_would_give(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = Plan({"h.0": BlockPlan("full")}).save(tmp_path / "plan.json")
        with open(tmp_path / "reference.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "reference.txt").stat().st_mode)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o600, 0o664], ids=oct)
def test_replacing_a_plan_file_keeps_its_mode(tmp_path, mode):
    path = Plan({"h.0": BlockPlan("full")}).save(tmp_path / "plan.json")
    path.chmod(mode)
    Plan({"h.1": BlockPlan("full")}).save(path)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert Plan.load(path) == Plan({"h.1": BlockPlan("full")})


def test_saving_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path):
    target = Plan({"h.0": BlockPlan("full")}).save(tmp_path / "real.json")
    link = tmp_path / "plan.json"
    link.symlink_to(target.name)
    Plan({"h.1": BlockPlan("full")}).save(link)
    assert link.is_symlink() and Plan.load(target) == Plan({"h.1": BlockPlan("full")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "real.json"]
