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

from lightning_ckpt import BlockPlan, Plan, __version__, model_fingerprint, tune
from lightning_ckpt.cli import main
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
    result = tune(model, lambda: model(tokens, tokens), activation_budget=0.6, n_trials=2, search_space=space,
                  measure_steps=1, warmup_steps=0, batch_size=2, seq_len=16)  # fmt: skip
    result.best.save(root / "tuned.json")
    result.best.with_metadata(memory_breakdown=result.memory_breakdown).save(root / "with_memory.json")
    # A hand-written rival for diff: other modes, segments, another budget, same model.
    blocks = {"transformer.h.0": BlockPlan("full"), "transformer.h.1": BlockPlan("selective", ("mlp",))}
    Plan(
        blocks, {}, "rival", model_fingerprint(model), {"budget": {"kind": "peak", "description": "1.0 MiB peak"}}
    ).save(root / "rival.json")
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
        ("{not json", 1, "is not valid JSON"),
        (json.dumps({"schema_version": 99}), 1, "schema version 99 is not supported"),
        (
            json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "fast"}}}),
            1,
            "Unknown checkpointing mode 'fast'",
        ),
        (
            json.dumps({"schema_version": 1, "blocks": {"h.0": {"mode": "selective", "children": "mlp"}}}),
            1,
            "field blocks['h.0'].children: must be an array",
        ),
        (b"\x89PNG\r\n\x1a\n\x00\xff", 1, "is not a UTF-8 text file"),
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
    assert "fingerprint  same" in out.stdout and "-> 1.0 MiB peak" in out.stdout

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
