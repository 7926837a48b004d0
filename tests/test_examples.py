"""The README's main command, in its fast mode: tune, train, write the plan, then reuse it."""

from __future__ import annotations

import importlib.util
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from lightning_ckpt import Plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


README = EXAMPLES.parent / "README.md"


def _template(line: str) -> str:
    """A printed line with its figures, units, plan and study name taken out: what must match the README's sample.
    The result line keeps its first word and the start of its last part (the search's cost and plans run); the
    parts between (the plan's figures and the verdict) change with what the search found."""
    line = re.sub(r"^(INFO|WARNING): ", "", line.strip())  # the logging format under pytest's capture
    line = re.sub(r"'lightning_ckpt-[0-9a-f-]+'", "'<study>'", line)
    line = re.sub(r"\d+(\.\d+)?", "#", line)
    line = re.sub(r"# (B|KiB|MiB|GiB)\b", "# <unit>", line)
    if line.startswith("lightning_ckpt: chose "):
        last = line.split(" | ")[-1]  # "tuned in # s (# plans: # run, ...)": what follows depends on what was pruned
        return f"lightning_ckpt: chose ... | {last.split(' run', 1)[0]} run"
    return line


def _readme_sample() -> list[str]:
    text = README.read_text()
    block = text.split("## What the main job prints", 1)[1].split("```", 2)[1]
    return [ln for ln in block.splitlines() if ln.startswith(("lightning_ckpt: ", "final train loss", "`Trainer"))]


class _Lines(logging.Handler):
    """Lightning's and the tuner's lines are records of the ``lightning.pytorch`` logger, which prints them itself
    (its own stream handler, no propagation to the root logger that caplog reads): collected here."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_train_gpt_fast_then_reuse(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    train_gpt = _load("train_gpt")
    logged, logger = _Lines(), logging.getLogger("lightning.pytorch")
    logger.addHandler(logged)
    try:
        first = train_gpt.main(["--fast"])
    finally:
        logger.removeHandler(logged)
    # What it printed has the README sample's lines, apart from figures (the progress bar aside: it redraws).
    text = "".join(capfd.readouterr()) + "\n" + "\n".join(logged.lines)
    printed = {_template(ln) for ln in re.split(r"[\r\n]", text)}
    # The bar redraws, and the confirmation is announced only when there are plans to confirm.
    sample = [
        ln for ln in _readme_sample() if not ln.startswith(("lightning_ckpt: tuning:", "lightning_ckpt: confirm"))
    ]
    assert len(sample) >= 4
    missing = [ln for ln in sample if _template(ln) not in printed]
    assert not missing, f"README lines the main job no longer prints: {missing}; printed: {sorted(printed)}"
    assert (tmp_path / "plans" / "gpt.json").exists()
    assert first["trials"] > 0 and first["plan"] is not None and not first["plan"].is_empty
    assert list((tmp_path / "runs").rglob("pareto.png"))
    second = train_gpt.main(["--fast", "--reuse"])
    assert second["trials"] == 0 and second["plan"] == first["plan"]
    # The docstring's re-plan: another budget from the saved profile, written with its first measured steps.
    third = train_gpt.main(["--fast", "--reuse", "--activation-budget", "0.4"])
    assert third["trials"] == 0
    first_measured = Plan.load(tmp_path / "plans" / "gpt-0.4.json").metadata["replanned"]["first_measured"]
    assert first_measured["seconds"] > 0 and first_measured["peak_bytes"] > 0
    assert Plan.load(tmp_path / "plans" / "gpt.json") == first["plan"]  # the searched plan's file is left as it was


@pytest.mark.slow
def test_hf_llama_fast_then_reuse(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    hf_llama = _load("hf_llama")
    first = hf_llama.main(["--fast"])
    assert first["trials"] > 0 and first["plan"] is not None and not first["plan"].is_empty
    assert all(fqn.startswith("model.model.layers.") for fqn in first["plan"].blocks), "found the HF decoder layers"
    assert Plan.load(tmp_path / "plans" / "llama.json") == first["plan"]
    assert list((tmp_path / "runs" / "llama").rglob("events.out.tfevents.*"))
    assert math.isfinite(first["loss"])
    second = hf_llama.main(["--fast", "--reuse"])
    assert second["trials"] == 0 and second["plan"] == first["plan"]


@pytest.mark.slow
def test_vit_fast(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    vit = _load("vit")
    result = vit.main(["--fast"])
    assert result["trials"] > 0 and result["plan"] is not None and not result["plan"].is_empty
    assert all(fqn.startswith("model.vit.") for fqn in result["plan"].blocks | result["plan"].segments)
    assert Plan.load(tmp_path / "plans" / "vit.json") == result["plan"]
    assert list((tmp_path / "runs" / "vit").rglob("events.out.tfevents.*"))
    assert math.isfinite(result["loss"])


def test_quadrant_images_are_deterministic_and_labelled_by_the_bright_square():
    pytest.importorskip("transformers")
    vit = _load("vit")
    images, labels = vit.quadrant_images(64, image_size=32, seed=3).tensors
    again, _ = vit.quadrant_images(64, image_size=32, seed=3).tensors
    assert torch.equal(images, again)
    brightness = images.mean(1)  # (n, 32, 32)
    quadrants = torch.stack(
        [brightness[:, :16, :16], brightness[:, :16, 16:], brightness[:, 16:, :16], brightness[:, 16:, 16:]], 1
    ).mean((2, 3))
    assert torch.equal(quadrants.argmax(1), labels)


def test_train_gpt_takes_the_free_cores_says_so_and_refuses_a_gpu_it_does_not_have(monkeypatch, capsys):
    # Issue #64: on a 2-core machine with one core taken the example kept torch's two threads, and its 3-minute run
    # took 18; `--accelerator gpu` without CUDA ended in Lightning's MisconfigurationException.
    train_gpt = _load("train_gpt")
    assert (
        train_gpt.free_cores(2, 1.02) == 1 and train_gpt.free_cores(2, 0.1) == 2 and train_gpt.free_cores(2, 3.5) == 1
    )
    monkeypatch.setattr("os.getloadavg", lambda: (1.0, 1.0, 1.0))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    threads, line = train_gpt.cpu_threads(None)
    assert (
        threads == 1
        and line == "torch runs on 1 of 2 CPU cores: the load average says 1.0 are busy (--threads N to choose)"
    )
    assert train_gpt.cpu_threads(2)[0] == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        train_gpt.main(["--accelerator", "gpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--accelerator gpu needs a CUDA GPU" in err and "--index-url https://download.pytorch.org/whl/cu" in err
    assert "--accelerator cpu" in err


def test_train_gpt_names_its_one_epoch_so_richs_bar_reads_epoch_0_of_0(tmp_path):
    from lightning.pytorch.callbacks import RichProgressBar

    train_gpt = _load("train_gpt")
    bar = RichProgressBar()
    trainer = train_gpt.make_trainer("cpu", 3, [bar], tmp_path)
    bar._trainer = trainer  # what Lightning's setup sets
    assert bar._get_train_description(0).strip() == "Epoch 0/0", "Lightning's default for max_steps drew Epoch 0/-2"
    assert trainer.limit_train_batches == 3, "the bar counts the run's steps, not the corpus's 20600 batches"
