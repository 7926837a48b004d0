"""The ``lightning-ckpt`` command, driven as a user would: a subprocess, its output and its exit code.

The plan under test is written by a real ``tune`` run, so ``show`` and ``diff`` are checked against
the metadata the tuner actually writes, not a hand-made imitation of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_ckpt import BlockPlan, Plan, __version__, tune
from lightning_ckpt.cli.main import main
from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.model import model_fingerprint
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.testing import GPT, GPTConfig

MODELS_PY = """
import torch
from lightning_ckpt.testing import GPT, GPTConfig

def gpt(n_layer=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.1))

def gpt3():
    return gpt(3)

class Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = gpt()

def broken():
    raise RuntimeError("needs a GPU")
"""


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_ckpt.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A directory with models.py and plans written by a real tuning run of its ``gpt`` model."""
    root = tmp_path_factory.mktemp("cli")
    (root / "models.py").write_text(MODELS_PY)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.1))
    tokens = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(1))
    space = {"modes": ["full"], "selections": ["all"], "rest_modes": [], "segments": False}
    result = tune(model, lambda: model(tokens, tokens), activation_budget=0.6, batch_size=2, seq_len=16, config=TuneConfig(n_trials=2, search_space=space, measure_steps=1, warmup_steps=0))  # fmt: skip
    result.best.save(root / "tuned.json")
    result.best.with_provenance(memory_breakdown=result.memory_breakdown).save(root / "with_memory.json")
    # A hand-written rival for diff: other modes, segments, another budget, same model.
    blocks = {"transformer.h.0": BlockPlan("full"), "transformer.h.1": BlockPlan("selective", ("mlp",))}
    budget = {"kind": "peak", "limit_bytes": 2**20, "fraction": None, "description": "1.0 MiB peak"}
    Plan(blocks, {}, "rival", model_fingerprint(model), {"budget": budget}).save(root / "rival.json")
    Plan({}, {"transformer.h": 2}, "segmented", None).save(root / "segmented.json")
    return root


def test_version_and_usage(capsys):
    assert cli("--version").stdout.strip() == f"lightning-ckpt {__version__}"
    # argparse's own paths, in-process (each subprocess costs an interpreter and a torch import):
    assert main([]) == 2 and "validate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["show", "plan.json", "--colour"])
    assert exit_.value.code == 2 and "unrecognized arguments: --colour" in capsys.readouterr().err


def test_show_prints_blocks_run_budget_and_evidence(work):
    plan = Plan.load(work / "with_memory.json")
    out = cli("show", work / "with_memory.json")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for fqn, bp in plan.blocks.items():
        assert any(fqn in line and bp.describe() in line for line in text.splitlines())
    assert "transformer.h.3" in text, "with the memory breakdown every block is listed, checkpointed or not"
    assert "kept for backward" in text and "MiB" in text or "KiB" in text
    assert plan.fingerprint in text and plan.metadata["budget"]["description"] in text
    assert f"torch {plan.metadata['versions']['torch']}" in text and "batch_size 2" in text
    assert "baseline:none" in text and "baseline:full" in text
    assert f"{plan.metadata['measured']['samples_per_second']:.1f}" in text


def test_show_without_metadata_and_with_segments(capsys, work):
    # In-process: the plain formatting paths need no interpreter start-up of their own.
    assert main(["show", str(work / "segmented.json")]) == 0
    text = capsys.readouterr().out
    assert "transformer.h" in text and "2 chunks" in text and "not recorded" in text
    assert "tuned for" not in text and "throughput" not in text


@pytest.mark.parametrize(
    ("content", "code", "message"),
    [
        (None, 2, "does not exist"),
        # A file that is not a well-formed plan is bad input, as a missing one is: 2, never 1 ("refused").
        ("{not json", 2, "is not valid JSON"),
        (json.dumps({"schema_version": 99}), 2, "schema version 99 is not supported"),
        (
            json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "fast"}}}),
            2,
            "Unknown checkpointing mode 'fast'",
        ),
        (
            json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "selective", "children": "mlp"}}}),
            2,
            "field blocks['h.0'].children: must be an array",
        ),
        (b"\x89PNG\r\n\x1a\n\x00\xff", 2, "is not a UTF-8 text file"),
    ],
    ids=["missing", "not-json", "newer-schema", "bad-mode", "children-string", "binary"],
)
def test_show_refuses_bad_plan_files(tmp_path, capsys, content, code, message):
    path = tmp_path / "plan.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main(["show", str(path)]) == code
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_show_missing_file_exits_2_from_the_shell(tmp_path):
    out = cli("show", tmp_path / "nope.json")
    assert out.returncode == 2 and "does not exist" in out.stderr and out.stdout == ""


def test_diff_lists_changed_blocks_segments_and_budget(work, capsys):
    out = cli("diff", work / "tuned.json", work / "rival.json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    a, b = Plan.load(work / "tuned.json"), Plan.load(work / "rival.json")
    for fqn in set(a.blocks) | set(b.blocks):
        before, after = a.mode_of(fqn).describe(), b.mode_of(fqn).describe()
        changed = [ln.split() for ln in lines if f" {fqn} " in ln]
        assert changed == ([] if before == after else [[changed[0][0], fqn, before, "->", after]])
    assert "fingerprint  same" in out.stdout
    # Budgets are shown by value, both sides in bytes formatted alike.
    [budget_line] = [ln for ln in lines if ln.startswith("budget ")]
    assert format_bytes(a.metadata["budget"]["limit_bytes"]) in budget_line
    assert budget_line.endswith("-> peak <= 1.0 MiB")

    assert main(["diff", str(work / "rival.json"), str(work / "segmented.json")]) == 0
    text = capsys.readouterr().out
    rows = [ln.split() for ln in text.splitlines()]
    assert ["+", "transformer.h", "(segments)", "none", "->", "2", "chunks"] in rows
    assert ["-", "transformer.h.0", "full", "->", "none"] in rows
    assert ["fingerprint", Plan.load(work / "rival.json").fingerprint, "->", "not", "recorded"] in rows

    assert main(["diff", str(work / "tuned.json"), str(work / "with_memory.json")]) == 0
    assert "same checkpointing" in capsys.readouterr().out


def test_validate_accepts_the_model_the_plan_was_tuned_for(work):
    out = cli("validate", "tuned.json", "--model", "models:gpt", cwd=work)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr


def test_validate_without_a_model_checks_the_file_alone(work, tmp_path, capsys):
    # It was a usage error; a CI job that has the plan file but not the model can still check it.
    assert main(["validate", str(work / "tuned.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {work / 'tuned.json'} is a well-formed plan file") and "--model MODULE:CALLABLE" in out
    bad = tmp_path / "bad.json"
    data = json.loads((work / "tuned.json").read_text())
    data["metadata"]["profile"] = {"memory": "not a memory model"}
    bad.write_text(json.dumps(data))
    assert main(["validate", str(bad)]) == 2
    assert "field metadata.profile" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["validate", str(tmp_path / "broken.json")]) == 2
    assert "broken.json" in capsys.readouterr().err


def test_validate_refuses_another_model_with_reasons(work, capsys):
    out = cli("validate", work / "tuned.json", "--model", f"{work / 'models.py'}:gpt3")
    assert out.returncode == 1 and out.stderr.startswith("REFUSED")
    assert "fingerprint" in out.stderr
    assert (
        "block 'transformer.h.3' does not exist" in out.stderr
        or "transformer.h.3" not in Plan.load(work / "tuned.json").blocks
    )

    # The usual mistake: the factory returns the LightningModule-like wrapper, the plan names the inner model.
    assert main(["validate", str(work / "rival.json"), "--model", f"{work / 'models.py'}:Wrapper"]) == 1
    err = capsys.readouterr().err
    assert "Closest names: 'model.transformer.h.0'" in err and "the plan was tuned on the inner model" in err


@pytest.mark.parametrize(
    ("spec", "code", "message"),
    [
        ("models", 2, "must be MODULE:CALLABLE"),
        ("no_such_module:gpt", 2, "cannot import module 'no_such_module'"),
        ("models.py:gtp", 2, "has no attribute 'gtp'. Closest names: 'gpt'"),
        ("missing.py:gpt", 2, "does not exist"),
        ("models.py:broken", 1, "raised RuntimeError: needs a GPU"),
    ],
    ids=["no-colon", "no-module", "typo", "no-file", "factory-raises"],
)
def test_validate_model_errors(work, capsys, monkeypatch, spec, code, message):
    monkeypatch.chdir(work)
    assert main(["validate", "tuned.json", "--model", spec]) == code
    assert message in capsys.readouterr().err


def test_bench_runs_the_script_with_its_arguments(tmp_path, capsys):
    script = tmp_path / "stub.py"
    script.write_text(
        textwrap.dedent("""
        import sys, pathlib
        pathlib.Path(sys.argv[-1]).write_text(" ".join(sys.argv[1:]))
        print("stub ran")
        sys.exit(3 if "--fail" in sys.argv else 0)
        """)
    )
    out = cli("bench", "--script", script, "--layers", "4", "--out", tmp_path / "args.txt")
    assert out.returncode == 0 and "stub ran" in out.stdout, out.stderr
    assert (tmp_path / "args.txt").read_text() == f"--layers 4 --out {tmp_path / 'args.txt'}"
    assert main(["bench", "--script", str(script), "--fail", str(tmp_path / "x")]) == 3
    assert main(["bench", "--script", str(tmp_path / "nope.py")]) == 2
    assert "not found" in capsys.readouterr().err


def test_bench_never_runs_another_checkouts_script_from_the_working_directory(tmp_path, monkeypatch):
    # Inside any other repository, ./benchmarks/seed_table.py is that repository's code.
    other = tmp_path / "other-checkout"
    (other / "benchmarks").mkdir(parents=True)
    (other / "benchmarks" / "seed_table.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    monkeypatch.chdir(other)
    from lightning_ckpt.cli import bench

    found = bench._find_benchmark("seed_table.py")
    assert found is None or found.resolve() == (
        Path(bench.__file__).resolve().parents[2] / "benchmarks" / "seed_table.py"
    )
    assert found is None or other not in found.resolve().parents
    assert not (tmp_path / "ran").exists()


def test_show_and_diff_report_the_compile_memory_budget(tmp_path, capsys):
    if "compile_memory_budget" not in Plan.__dataclass_fields__:
        pytest.skip("plans without torch.compile memory budgets")
    eager = Plan({"h.0": BlockPlan("full")})
    compiled = Plan({"h.0": BlockPlan("full")}, compile_memory_budget=0.5)
    eager.save(tmp_path / "eager.json")
    compiled.save(tmp_path / "compiled.json")
    assert main(["show", str(tmp_path / "compiled.json")]) == 0
    assert "activation_memory_budget=0.5" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "eager.json"), str(tmp_path / "compiled.json")]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert ["~", "torch.compile", "activation_memory_budget", "None", "->", "0.5"] in rows


@pytest.mark.parametrize(
    ("source", "spec", "shown"),
    [
        ("import sys\nsys.exit(3)\n", "exits.py:gpt", "sys.exit(3)"),
        ("import sys\nsys.exit()\n", "exits.py:gpt", "sys.exit()"),  # code 0: the worst case, CI would pass
        ("import sys\nsys.exit('no GPU found')\n", "exits:gpt", "sys.exit('no GPU found')"),
        ("import sys\ndef gpt():\n    sys.exit(4)\n", "exits.py:gpt", "sys.exit(4)"),
    ],
    ids=["file-code-3", "file-code-none", "module-message", "factory-exits"],
)
def test_validate_model_that_exits_is_an_error_not_a_silent_exit(work, source, spec, shown):
    (work / "exits.py").write_text(source)
    out = cli("validate", "tuned.json", "--model", spec, cwd=work)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "SystemExit" in out.stderr and shown in out.stderr, out.stderr
    assert 'if __name__ == "__main__":' in out.stderr, out.stderr


# -------------------------------------------------------------------------------------------------
# show --json, the search in words, diff --exit-code / --json
# -------------------------------------------------------------------------------------------------
SHOW_KEYS = {
    "json_format", "file", "name", "description", "digest", "fingerprint", "blocks_by_mode", "segments",
    "compile_memory_budget", "budget", "winner", "baselines", "trials", "fell_back", "predicted_block_memory", "plan",
    "verdict", "plan_table",
}  # fmt: skip
TRIAL_KEYS = {
    "considered", "space_size", "n_trials", "exhaustive", "measured", "pruned", "pruned_by_memory", "pruned_by_time",
    "within_budget", "over_budget", "failed", "conflict", "confirmed", "by_status",
}  # fmt: skip


def test_show_json_from_the_shell_is_one_object_with_the_documented_keys(work):
    plan = Plan.load(work / "with_memory.json")
    out = cli("show", work / "with_memory.json", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)  # the whole of stdout: nothing else is printed
    assert set(data) == SHOW_KEYS and data["json_format"] == 1
    assert data["verdict"] == plan.metadata.get("search", {}).get("verdict")
    assert data["description"] == plan.describe() and data["digest"] == plan.digest()
    assert data["fingerprint"] == plan.fingerprint and data["file"] == str(work / "with_memory.json")
    assert Plan.from_dict(data["plan"]) == plan and data["plan"]["metadata"] == json.loads(plan.to_json())["metadata"]
    by_mode = {fqn: mode for mode, fqns in data["blocks_by_mode"].items() for fqn in fqns}
    assert by_mode == {fqn: bp.describe() for fqn, bp in plan.blocks.items()}
    md = plan.metadata
    assert {k: data["budget"][k] for k in ("kind", "limit_bytes", "fraction")} == {
        k: md["budget"][k] for k in ("kind", "limit_bytes", "fraction")
    }
    assert data["winner"]["samples_per_second"] == md["measured"]["samples_per_second"]
    assert data["winner"]["peak_bytes"] == md["measured"]["peak_bytes"]
    full = md["baselines"]["full"]
    if full.get("samples_per_second"):
        ratio = md["measured"]["samples_per_second"] / full["samples_per_second"]
        assert data["winner"]["speedup_over_baselines"]["full"] == pytest.approx(ratio)
    assert set(data["trials"]) == TRIAL_KEYS
    assert data["trials"]["considered"] == md["search"]["plans_considered"]
    assert data["trials"]["n_trials"] == md["search"]["n_trials"] == 2
    assert "transformer.h.3" in data["predicted_block_memory"], "every block, checkpointed or not"
    assert data["fell_back"] is False


def test_show_json_of_a_plan_without_metadata(work, capsys):
    assert main(["show", str(work / "segmented.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == SHOW_KEYS and data["segments"] == {"transformer.h": 2} and data["blocks_by_mode"] == {}
    assert data["budget"] is data["winner"] is data["trials"] is data["predicted_block_memory"] is None
    assert data["description"] == Plan.load(work / "segmented.json").describe()


def _search_plan(path: Path, **search) -> Plan:
    base = {"n_trials": 6, "trials_run": 17, "exhaustive": False, "space_size": 88, "seed": 0, "sampler": "TPESampler"}
    plan = Plan({"h.0": BlockPlan("full")}, metadata={"search": {**base, **search}})
    plan.save(path)
    return plan


def test_show_says_which_model_ruled_each_plan_out_as_the_result_line_did(tmp_path, capsys):
    # The search's line said "67 ruled out by the memory model, 21 by the time model"; show said "88 rejected by
    # the memory model".
    counts = {"ok": 2, "pruned": 88}
    _search_plan(tmp_path / "p.json", status_counts=counts, time_model={"pruned_by_time": 21})
    assert main(["show", str(tmp_path / "p.json")]) == 0
    assert (
        "88 ruled out without running (pruned): 67 by the memory model, 21 by the time model" in capsys.readouterr().out
    )
    assert main(["show", str(tmp_path / "p.json"), "--json"]) == 0
    trials = json.loads(capsys.readouterr().out)["trials"]
    assert (trials["pruned"], trials["pruned_by_memory"], trials["pruned_by_time"]) == (88, 67, 21)


def test_show_lists_a_winning_baseline_once(tmp_path, capsys):
    measured = {"label": "baseline:full", "status": "ok", "samples_per_second": 10.0, "peak_bytes": 100}
    baselines = {
        "full": {"status": "ok", "samples_per_second": 10.0},
        "none": {"status": "ok", "samples_per_second": 12.0},
    }
    Plan({"h.0": BlockPlan("full")}, metadata={"measured": measured, "baselines": baselines}).save(tmp_path / "p.json")
    assert main(["show", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    assert text.count("baseline:full") == 1 and "* baseline:full" in text and "baseline:none" in text


def test_show_cuts_long_metadata_after_a_whole_item_and_says_so(tmp_path, capsys):
    steps = [{"step": i, "peak_bytes": 124454816 + i} for i in range(8)]
    Plan({"h.0": BlockPlan("full")}, metadata={"real_steps": steps}).save(tmp_path / "p.json")
    assert main(["show", str(tmp_path / "p.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("real_steps:"))
    shown, _, rest = line.partition(" ... (")
    assert rest.endswith("more characters: lightning-ckpt show --json prints them all)")
    assert shown.rstrip().endswith("}"), shown[-30:]  # never "peak_bytes": 1244 of 124454816
    assert all(f"{124454816 + i}" in shown for i in range(2))


def test_show_says_what_the_trial_counts_mean(tmp_path, capsys):
    counts = {"ok": 3, "over_budget": 1, "oom": 1, "error": 1, "pruned": 11}
    _search_plan(tmp_path / "counted.json", status_counts=counts, confirmed=2)
    assert main(["show", str(tmp_path / "counted.json")]) == 0
    text = capsys.readouterr().out
    assert "17 of the 88 candidate plans in the search space were considered (TPESampler, seed 0)" in text
    assert "6 measured (run for real): 3 within budget, 1 over budget, 1 out of memory, 1 failed with an error" in text
    assert "11 ruled out without running (pruned): 11 by the memory model" in text
    assert "2 of the measured re-timed side by side" in text
    assert "n_trials=6 caps the plans measured; pruned plans do not count towards it" in text
    assert "n_trials=6)" not in text, "the old 'N trials (n_trials=M)' wording is gone"

    assert main(["show", str(tmp_path / "counted.json"), "--json"]) == 0
    trials = json.loads(capsys.readouterr().out)["trials"]
    assert trials["by_status"] == counts and trials["confirmed"] == 2
    assert (trials["measured"], trials["pruned"], trials["within_budget"]) == (6, 11, 3)
    assert (trials["over_budget"], trials["failed"], trials["conflict"]) == (1, 2, 0)

    # What the tuner writes today has only the total: say what it includes and that the split is unknown.
    _search_plan(tmp_path / "total.json", exhaustive=True, space_size=17)
    assert main(["show", str(tmp_path / "total.json")]) == 0
    text = capsys.readouterr().out
    assert "all 17 candidate plans in the search space were considered" in text
    assert "ruled out without running (pruned)" in text and "n_trials=6 caps only the plans measured" in text
    assert "does not record how many" in text


def _budget_plan(path: Path, budget: dict, blocks: tuple[str, ...] = ("h.0",)) -> Path:
    Plan({fqn: BlockPlan("full") for fqn in blocks}, fingerprint="f00d", metadata={"budget": budget}).save(path)
    return path


GIB20 = {"kind": "peak", "limit_bytes": 20 * 2**30, "fraction": None, "description": "20.0 GiB peak"}


@pytest.mark.parametrize(
    ("a", "b", "code"),
    [
        ({**GIB20, "requested": "20GiB"}, {**GIB20, "requested": 21474836480}, 0),
        ({"kind": "peak", "requested": "20GiB"}, {"kind": "peak", "requested": 21474836480}, 0),  # no limit recorded
        ({**GIB20, "description": "20GiB"}, {**GIB20, "description": "21474836480 B"}, 0),  # text is not the value
        ({**GIB20, "requested": "20GiB"}, {**GIB20, "limit_bytes": 24 * 2**30, "requested": "24GiB"}, 1),
        ({**GIB20, "kind": "activation", "fraction": 0.5}, {**GIB20, "kind": "activation", "fraction": 0.6}, 1),
    ],
    ids=["requested-text-vs-bytes", "requested-only", "description-differs", "other-limit", "other-fraction"],
)
def test_diff_compares_budgets_by_value(tmp_path, capsys, a, b, code):
    pa, pb = _budget_plan(tmp_path / "a.json", a), _budget_plan(tmp_path / "b.json", b)
    assert main(["diff", "--exit-code", str(pa), str(pb)]) == code
    text = capsys.readouterr().out
    [line] = [ln for ln in text.splitlines() if ln.startswith("budget ")]
    if code == 0:
        assert line.startswith("budget       same (") and "the plans are the same" in text
    else:
        assert " -> " in line and "the plans differ in: budget" in text
    if a.get("limit_bytes") != b.get("limit_bytes"):
        assert line == "budget       peak <= 20.0 GiB -> peak <= 24.0 GiB"


def test_diff_exit_code_follows_git_diff(work, tmp_path, capsys):
    tuned, rival, with_memory = (str(work / f"{n}.json") for n in ("tuned", "rival", "with_memory"))
    copy = tmp_path / "copy.json"
    copy.write_text(Path(tuned).read_text())
    assert main(["diff", "--exit-code", tuned, str(copy)]) == 0
    assert main(["diff", "--exit-code", tuned, rival]) == 1
    assert main(["diff", tuned, rival]) == 0, "without --exit-code a difference is not an error"
    # Same checkpointing, model and budget; only the memory breakdown in the metadata differs.
    assert main(["diff", "--exit-code", tuned, with_memory]) == 0
    capsys.readouterr()
    # Another model with the same checkpointing differs too.
    moved = Plan.load(tuned)
    Plan(moved.blocks, moved.segments, moved.name, "0123456789abcdef", moved.metadata).save(tmp_path / "other.json")
    assert main(["diff", "--exit-code", tuned, str(tmp_path / "other.json")]) == 1
    assert "the plans differ in: fingerprint" in capsys.readouterr().out


def test_diff_json(work, capsys):
    tuned, rival = (str(work / f"{n}.json") for n in ("tuned", "rival"))
    assert main(["diff", "--json", "--exit-code", tuned, rival]) == 1
    data = json.loads(capsys.readouterr().out)
    a, b = Plan.load(tuned), Plan.load(rival)
    assert data["differ"] is True and set(data["differ_in"]) == {"checkpointing", "budget"}
    assert data["a"] == {"file": tuned, "description": a.describe(), "digest": a.digest()}
    assert data["b"]["description"] == b.describe()
    changed = {c["name"]: (c["a"], c["b"]) for c in data["checkpointing"] if c["what"] == "block"}
    expected = {
        fqn: (a.mode_of(fqn).to_dict(), b.mode_of(fqn).to_dict())
        for fqn in set(a.blocks) | set(b.blocks)
        if a.mode_of(fqn) != b.mode_of(fqn)
    }
    assert changed == expected
    assert data["fingerprint"]["same"] is True
    assert data["budget"]["same"] is False and data["budget"]["b"]["limit_bytes"] == 2**20

    assert main(["diff", "--json", tuned, tuned]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["differ"] is False and data["differ_in"] == [] and data["checkpointing"] == []


def test_diff_errors_exit_2_with_one_message(work, tmp_path, capsys):
    out = cli("diff", "--exit-code", work / "tuned.json", tmp_path / "nope.json")
    assert out.returncode == 2 and out.stdout == ""
    [message] = out.stderr.strip().splitlines()
    assert message.startswith("lightning-ckpt diff: error:") and "nope.json" in message and "does not exist" in message
    # A malformed plan is trouble too (2), never "the plans differ" (1), with or without --exit-code.
    (tmp_path / "bad.json").write_text("{not json")
    for flags in ([], ["--exit-code"]):
        assert main(["diff", *flags, str(work / "tuned.json"), str(tmp_path / "bad.json")]) == 2
        captured = capsys.readouterr()
        assert "is not valid JSON" in captured.err and captured.out == ""


def test_show_names_the_proposer_that_chose_what_ran_and_the_plan_the_verdict_is_about(tmp_path, capsys):
    verdict = {"reference": "baseline:full", "candidate": "selective(mlp) h.0-3", "ratio": 0.99, "low": 0.95,
               "high": 1.03, "rounds": 24, "threshold": 1.01, "confidence": 0.9, "chosen_after": 0,
               "outcome": "undecided"}  # fmt: skip
    _search_plan(tmp_path / "p.json", proposer="time_model", verdict=verdict)
    assert main(["show", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    assert "(TPESampler, seed 0)" not in text  # the file's proposer was the time model, TPE only behind it
    assert "the time model proposed the plans it could predict, TPESampler the rest, seed 0" in text
    assert "verdict    selective(mlp) h.0-3: 0.99x [0.95, 1.03] vs full" in text


def test_diff_against_a_re_planned_plan_shows_its_predicted_figures(tmp_path, capsys):
    measured = {"samples_per_second": 24.0, "peak_bytes": 100 * 2**20, "activation_bytes": 60 * 2**20}
    Plan({"h.0": BlockPlan("full")}, metadata={"measured": measured}).save(tmp_path / "a.json")
    replanned = {"predicted": True, "predicted_samples_per_second": 21.5, "predicted_peak_bytes": 80 * 2**20,
                 "predicted_activation_bytes": 40 * 2**20}  # fmt: skip
    Plan({"h.0": BlockPlan("full"), "h.1": BlockPlan("full")}, metadata={"replanned": replanned}).save(
        tmp_path / "b.json"
    )
    main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    text = capsys.readouterr().out
    assert "samples/s 24.0 -> 21.5 predicted" in text and "24.0 -> -" not in text
    assert "peak 100.0 MiB -> 80.0 MiB predicted" in text and "it ran no trial" in text
