"""The README's main command, in its fast mode: tune, train, write the plan, then reuse it."""

from __future__ import annotations

import importlib.util
import math
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


def test_train_gpt_fast_then_reuse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train_gpt = _load("train_gpt")
    first = train_gpt.main(["--fast"])
    assert (tmp_path / "plans" / "gpt.json").exists()
    assert first["trials"] > 0 and first["plan"] is not None and not first["plan"].is_empty
    assert list((tmp_path / "runs").rglob("pareto.png"))
    second = train_gpt.main(["--fast", "--reuse"])
    assert second["trials"] == 0 and second["plan"] == first["plan"]


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
