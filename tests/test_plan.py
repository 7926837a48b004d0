from __future__ import annotations

import itertools
import json
import os
import stat
from dataclasses import replace

import pytest

from lightning_ckpt import BlockPlan, Plan, PlanError, StalePlanError, apply_plan, baselines
from lightning_ckpt.model import model_fingerprint
from lightning_ckpt.plan.schema import SCHEMA_VERSION
from lightning_ckpt.testing import GPT, GPTConfig


def test_round_trip_through_disk(tmp_path, gpt):
    plans = baselines(gpt)
    for name, plan in plans.items():
        plan = replace(plan, metadata={"measured": {"samples_per_s": 12.5}, "budget_bytes": 1 << 20})
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
    assert plan.describe() == "full h.0-1, selective(mlp) h.2"
    assert Plan().describe() == "none"
    assert Plan(segments={"h": 2}).describe() == "segments(h=2)"
    assert Plan({"h.1": BlockPlan("full"), "h.2": BlockPlan("none")}).describe() == "full h.1"


FULL, MLP = BlockPlan("full"), BlockPlan("selective", ("mlp",))
MATMULS = BlockPlan("ops", save_list="save_matmuls")


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        ({i: FULL if i < 4 else MLP for i in range(8)}, "full h.0-3, selective(mlp) h.4-7"),
        ({i: FULL if i % 2 == 0 else MLP for i in range(8)}, "full h.0,2,4,6, selective(mlp) h.1,3,5,7"),
        ({i: FULL for i in (0, 1, 4, 5)}, "full h.0-1,4-5"),
        # Natural order: h.2 before h.10, and ranges run across the decimal boundary.
        ({i: MATMULS if i in (9, 10, 11) else FULL for i in range(2, 12)}, "full h.2-8, ops(save_matmuls) h.9-11"),
        ({3: MLP}, "selective(mlp) h.3"),
    ],
)
def test_describe_names_the_blocks_of_a_nested_stack(blocks, expected):
    # As on a real model: the stack is ``transformer.h`` inside a LightningModule's ``model``.
    plan = Plan({f"model.transformer.h.{i}": bp for i, bp in blocks.items()})
    assert plan.describe() == expected


def test_describe_keeps_two_stacks_apart_and_the_other_parts():
    enc_dec = {f"model.{part}.layers.{i}": FULL if part == "encoder" else MLP
               for part in ("encoder", "decoder") for i in range(3)}  # fmt: skip
    assert Plan(enc_dec).describe() == "selective(mlp) decoder.layers.0-2, full encoder.layers.0-2"
    same_mode = Plan({"encoder.block.0": FULL, "encoder.block.1": FULL, "decoder.block.0": FULL})
    assert same_mode.describe() == "full decoder.block.0 encoder.block.0-1"
    plan = Plan({"transformer.h.0": FULL, "transformer.h.1": FULL}, segments={"transformer.h": 2},
                compile_memory_budget=0.5)  # fmt: skip
    assert plan.describe() == "full h.0-1, segments(transformer.h=2), pt2_budget(0.5)"
    # Names that are not positions (ModuleDict keys, ``01``) are listed as they are, never folded.
    named = Plan({"layers.attn_0": FULL, "layers.attn_1": FULL, "layers.01": FULL, "lm_head": MLP})
    assert named.describe() == "full layers.01 layers.attn_0 layers.attn_1, selective(mlp) lm_head"
    assert Plan({"0": FULL, "1": FULL, "3": MLP}).describe() == "full 0-1, selective(mlp) 3"  # an nn.Sequential


@pytest.mark.parametrize("n_blocks", [4, 5, 8])
def test_describe_tells_every_block_assignment_apart(n_blocks):
    modes = [BlockPlan(), FULL, MLP, MATMULS]
    fqns = [f"model.transformer.h.{i}" for i in range(n_blocks)]
    plans = {Plan(dict(zip(fqns, assignment, strict=True))) for assignment in itertools.product(modes, repeat=n_blocks)}
    assert len(plans) == len(modes) ** n_blocks
    descriptions = {plan.describe() for plan in plans}
    assert len(descriptions) == len(plans)


def test_describe_tells_assignments_over_two_stacks_apart():
    # Every block planned, so the shared prefix (``model.``) is the same for all: see Plan.describe.
    modes = [FULL, MLP, MATMULS]
    fqns = [f"model.{part}.layers.{i}" for part in ("encoder", "decoder") for i in range(3)]
    plans = [Plan(dict(zip(fqns, assignment, strict=True))) for assignment in itertools.product(modes, repeat=6)]
    assert len({plan.describe() for plan in plans}) == len(plans) == len(modes) ** 6


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
        (json.dumps({"schema_version": 1, "segments": {"h": 0}}), "an integer >= 1"),
        (json.dumps({"schema_version": 1, "surprise": 1}), "not a known field at the top level"),
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


# ---------------------------------------------------------------------------------------------------
# Malformed plan files: one error class, naming the file and the field, whatever the input.
# ---------------------------------------------------------------------------------------------------
def _plan(**fields):
    return json.dumps({"schema_version": 1, **fields})


def _block(**spec):
    return _plan(blocks={"h.0": spec})


MALFORMED = {
    # wrong types and values, field by field
    "version-string": (json.dumps({"schema_version": "1"}), "schema_version"),
    "version-bool": (json.dumps({"schema_version": True}), "schema_version"),
    "version-zero": (json.dumps({"schema_version": 0}), "schema_version"),
    "version-newer": (json.dumps({"schema_version": SCHEMA_VERSION + 1}), "schema_version"),
    "version-missing": (json.dumps({"blocks": {}}), "schema_version"),
    "name-int": (_plan(name=5), "name"),
    "fingerprint-int": (_plan(fingerprint=5), "fingerprint"),
    "blocks-list": (_plan(blocks=["h.0"]), "blocks"),
    "block-string": (_plan(blocks={"h.0": "full"}), "blocks['h.0']"),
    "block-no-mode": (_block(children=["mlp"]), "blocks['h.0'].mode"),
    "mode-int": (_block(mode=5), "blocks['h.0'].mode"),
    "mode-unknown": (_block(mode="fast"), "blocks['h.0'].mode"),
    "children-string": (_block(mode="selective", children="mlp"), "blocks['h.0'].children"),
    "children-int": (_block(mode="selective", children=5), "blocks['h.0'].children"),
    "children-empty": (_block(mode="selective", children=[]), "blocks['h.0'].children"),
    "children-item-int": (_block(mode="selective", children=["mlp", 1]), "blocks['h.0'].children[1]"),
    "children-item-empty": (_block(mode="selective", children=[""]), "blocks['h.0'].children[0]"),
    "children-repeated": (_block(mode="selective", children=["mlp", "mlp"]), "blocks['h.0'].children"),
    "children-missing": (_block(mode="selective"), "blocks['h.0'].children"),
    "children-on-full": (_block(mode="full", children=["mlp"]), "blocks['h.0'].children"),
    "save-list-int": (_block(mode="ops", save_list=5), "blocks['h.0'].save_list"),
    "save-list-missing": (_block(mode="ops"), "blocks['h.0'].save_list"),
    "save-list-unknown": (_block(mode="ops", save_list="keep_it_all"), "blocks['h.0'].save_list"),
    "save-list-on-full": (_block(mode="full", save_list="save_matmuls"), "blocks['h.0'].save_list"),
    "block-unknown-field": (_block(mode="full", speed="fast"), "blocks['h.0'].speed"),
    "segments-list": (_plan(segments=[2]), "segments"),
    "segments-string": (_plan(segments={"h": "2"}), "segments['h']"),
    "segments-float": (_plan(segments={"h": 2.5}), "segments['h']"),
    "segments-bool": (_plan(segments={"h": True}), "segments['h']"),
    "segments-zero": (_plan(segments={"h": 0}), "segments['h']"),
    "metadata-list": (_plan(metadata=[1]), "metadata"),
    "micro-batch-no-accumulation": (
        _plan(metadata={"micro_batch": {"size": 4, "global": 16}}),
        "metadata.micro_batch.accumulation",
    ),
    "micro-batch-string-size": (
        _plan(metadata={"micro_batch": {"size": "4", "accumulation": 4, "global": 16}}),
        "metadata.micro_batch.size",
    ),
    "micro-batch-not-object": (_plan(metadata={"micro_batch": 4}), "metadata.micro_batch"),
    "micro-batch-inconsistent": (
        _plan(metadata={"micro_batch": {"size": 4, "accumulation": 2, "global": 16}}),
        "metadata.micro_batch",
    ),
    "budget-in-version-1": (_plan(compile_memory_budget=0.5), "compile_memory_budget"),
    "budget-too-big": (json.dumps({"schema_version": 2, "compile_memory_budget": 2.0}), "compile_memory_budget"),
    "budget-string": (json.dumps({"schema_version": 2, "compile_memory_budget": "0.5"}), "compile_memory_budget"),
    "unknown-top-level": (_plan(surprise=1), "surprise"),
    "duplicate-key": ('{"schema_version": 1, "blocks": {}, "blocks": {"h.0": {"mode": "full"}}}', "'blocks'"),
    "not-an-object": ("[]", "(top level)"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_field_is_refused_naming_file_and_field(tmp_path, case):
    text, field = MALFORMED[case]
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    message = str(info.value)
    assert str(path) in message, message
    assert f"field {field}" in message, message
    if case == "duplicate-key":  # only a file can repeat a key; a dict cannot
        return
    with pytest.raises(PlanError) as info:  # the same judgement for data that never was a file
        Plan.from_dict(json.loads(text), source="broadcast plan")
    assert field in str(info.value) and "broadcast plan" in str(info.value)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), "not a UTF-8 text file"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text(""), "is empty"),
        (lambda p: p.write_text('{"schema_version": 1,'), "not valid JSON"),
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    ],
    ids=["binary", "directory", "missing", "empty", "truncated", "deep"],
)
def test_unreadable_plan_files_are_refused_naming_the_file(tmp_path, make, match):
    path = tmp_path / "plan.json"
    make(path)
    with pytest.raises(PlanError, match=match) as info:
        Plan.load(path)
    assert str(path) in str(info.value)


def test_both_schema_versions_still_load(tmp_path):
    v1 = {"schema_version": 1, "name": "a", "fingerprint": None, "blocks": {"h.0": {"mode": "selective", "children": ["mlp"]}},
          "segments": {"s": 2}, "metadata": {"micro_batch": {"size": 4, "accumulation": 4, "global": 16, "original_size": 16}}}  # fmt: skip
    v2 = {
        "schema_version": 2,
        "blocks": {"h.1": {"mode": "ops", "save_list": "save_matmuls"}},
        "compile_memory_budget": 0.5,
    }
    for data in (v1, v2):
        (tmp_path / "p.json").write_text(json.dumps(data))
        assert Plan.load(tmp_path / "p.json").to_dict()["schema_version"] == data["schema_version"]
    assert Plan.load(tmp_path / "p.json").compile_memory_budget == 0.5


def test_the_published_schema_is_valid_and_matches_the_code():
    import jsonschema

    from lightning_ckpt.plan.format import MODES
    from lightning_ckpt.plan.schema import plan_schema

    schema = plan_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema_version"]["maximum"] == SCHEMA_VERSION
    assert tuple(schema["$defs"]["block"]["properties"]["mode"]["enum"]) == MODES
    for plan in [Plan({"h.0": BlockPlan("full")}, segments={"s": 2}), Plan(compile_memory_budget=0.3)]:
        jsonschema.validate(json.loads(plan.to_json()), schema)


def test_block_plan_refuses_a_string_of_children():
    with pytest.raises(PlanError, match="children.*list of child module names.*'mlp'"):
        BlockPlan("selective", "mlp")


def test_the_schema_ships_with_the_package():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    import lightning_ckpt

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "plan_schema.json" in pyproject["tool"]["setuptools"]["package-data"]["lightning_ckpt.plan"]
    assert any(d.startswith("jsonschema") for d in pyproject["project"]["dependencies"])
    assert (Path(lightning_ckpt.__file__).parent / "plan" / "plan_schema.json").is_file()


def test_the_save_list_names_a_plan_file_is_read_against_are_the_save_lists_policies_defines():
    from lightning_ckpt.plan.policies import SAVE_LISTS
    from lightning_ckpt.plan.save_list_names import SAVE_LIST_NAMES

    assert tuple(SAVE_LISTS) == SAVE_LIST_NAMES  # read without torch (show/replan), applied with it
    for name in SAVE_LIST_NAMES:
        assert BlockPlan("ops", save_list=name).save_list == name


def test_a_segments_plan_says_which_segment_each_block_is_in_not_none():
    blocks = [f"h.{i}" for i in range(5)] + ["head.0"]
    plan = Plan({"head.0": BlockPlan("full")}, segments={"h": 2})
    assert plan.block_labels(blocks) == {
        "h.0": "segment 1 of 2 (input kept)",
        "h.1": "segment 1 of 2 (recomputed)",
        "h.2": "segment 1 of 2 (recomputed)",
        "h.3": "segment 2 of 2 (last: not checkpointed)",  # as checkpoint_sequential: it keeps what it keeps
        "h.4": "segment 2 of 2 (last: not checkpointed)",
        "head.0": "full",
    }
    assert Plan().block_labels(blocks) == dict.fromkeys(blocks, "none")


def test_a_plan_file_is_refused_before_parsing_when_it_is_not_a_regular_file_or_too_large(tmp_path, monkeypatch):
    with pytest.raises(PlanError, match="not a regular file"):
        Plan.load("/dev/zero")  # `show /dev/zero` never ended
    big = tmp_path / "big.json"
    Plan({"h.0": BlockPlan("full")}, name="x" * 5000).save(big)
    assert Plan.load(big).name == "x" * 5000  # under the default bound
    monkeypatch.setenv("LIGHTNING_CKPT_MAX_PLAN_BYTES", "1000")
    with pytest.raises(
        PlanError, match=r"larger than the 1,000 bytes a plan file may be.*LIGHTNING_CKPT_MAX_PLAN_BYTES"
    ):
        Plan.load(big)
    monkeypatch.delenv("LIGHTNING_CKPT_MAX_PLAN_BYTES")
    huge_int = tmp_path / "int.json"
    data = Plan({"h.0": BlockPlan("full")}).to_dict()
    huge_int.write_text(json.dumps(data)[:-1] + ', "extra": ' + "9" * 5000 + "}")
    with pytest.raises(PlanError, match="field extra: holds an integer of 5000 digits"):
        Plan.load(huge_int)
