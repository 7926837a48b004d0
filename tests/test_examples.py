"""The README's main command, in its fast mode: tune, train, write the plan, then reuse it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
