"""lightning_ckpt imports under any torch; it warns once outside the tested range and refuses a feature only
where it is used, on a torch where that feature is known to be wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_ckpt import LightningCkptError, versions
from lightning_ckpt.errors import UnsupportedVersionError
from lightning_ckpt.versions import (
    QUIET_ENV,
    TORCH_NEWEST_TESTED,
    TORCH_NEXT_MAJOR,
    TORCH_OLDEST,
    require_torch,
    warn_if_untested,
)

ROOT = Path(__file__).parents[1]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.delenv(QUIET_ENV, raising=False)
    monkeypatch.setattr(versions, "_warned", False)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.11.0", "2.13.0+cpu", "2.14.1", "2.15.0a0+git1"])
def test_tested_torch_imports_silently(fresh, recwarn, version):
    assert warn_if_untested(version) is False
    assert not [w for w in recwarn if "lightning_ckpt" in str(w.message)]


@pytest.mark.parametrize(
    ("version", "says"),
    [("2.99.0", "newer than the newest"), ("3.1.0", "newer than the newest"), ("2.5.1+cu121", "older than the oldest")],
)
def test_untested_torch_warns_once_naming_the_version_and_never_raises(fresh, version, says):
    with pytest.warns(UserWarning, match=re.escape(f"found torch {version}")) as record:
        assert warn_if_untested(version) is True
    assert says in str(record[0].message) and QUIET_ENV in str(record[0].message)
    assert warn_if_untested(version) is False  # once per process


def test_the_quiet_variable_silences_the_warning(fresh, monkeypatch, recwarn):
    monkeypatch.setenv(QUIET_ENV, "1")
    assert warn_if_untested("2.99.0") is False
    assert not recwarn.list


# The package root imports nothing until a name is used; a module that works on a model warns when imported directly.
@pytest.mark.parametrize(
    "use",
    [
        "import lightning_ckpt; print(lightning_ckpt.Plan.__name__)",
        "from lightning_ckpt.plan.apply import apply_plan; print('Plan')",
        "from lightning_ckpt import ActivationCheckpointTuner; print('Plan')",
    ],
    ids=["root", "apply", "callback"],
)
def test_importing_under_a_newer_torch_warns_and_works(use):
    code = "import torch; torch.__version__ = '2.99.0'; " + use
    env = {k: v for k, v in os.environ.items() if k != QUIET_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Plan"
    assert out.stderr.count("found torch 2.99.0") == 1


def test_a_feature_on_an_old_torch_is_refused_where_it_is_used_with_the_version_and_the_fix(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    with pytest.raises(UnsupportedVersionError) as info:
        require_torch((2, 9), "Tuning a compiled model", "BatchNorm statistics update twice.", "tune it uncompiled")
    message = str(info.value)
    assert isinstance(info.value, LightningCkptError)
    assert "Tuning a compiled model needs torch>=2.9, but found torch 2.7.1+cu126" in message
    assert "pip install 'torch>=2.9'" in message and "tune it uncompiled" in message
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    require_torch((2, 9), "Tuning a compiled model", "why", "fix")  # no error at the minimum


def test_pyproject_declares_the_range_that_is_tested():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch([^"]*)"', text).group(1) == f">={TORCH_OLDEST[0]}.{TORCH_OLDEST[1]},<{TORCH_NEXT_MAJOR}"
    assert re.search(r'"lightning>=2\.5,<3"', text) and re.search(r'"optuna>=5\.0,<6"', text)


def test_ci_runs_a_leg_on_the_oldest_and_on_the_newest_tested_torch():
    ci = (ROOT / ".ci" / "run").read_text()
    oldest = f"{TORCH_OLDEST[0]}.{TORCH_OLDEST[1]}."
    newest = f"{TORCH_NEWEST_TESTED[0]}.{TORCH_NEWEST_TESTED[1]}."
    assert re.search(rf"torch=={re.escape(oldest)}\d+", ci), "no CI leg on the oldest declared torch"
    assert re.search(rf"torch=={re.escape(newest)}\d+", ci), "no CI leg on the newest tested torch"


def test_tuning_under_fsdp2_on_an_unverified_torch_is_refused_before_any_trial(monkeypatch):
    import dataclasses
    import importlib

    from lightning_ckpt.model import ModelView
    from lightning_ckpt.search.config import TuneConfig
    from lightning_ckpt.testing.nanogpt import GPT, GPTConfig

    tune_module = importlib.import_module("lightning_ckpt.search.tune")  # the package exports a function of that name
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32))
    resolved = dataclasses.replace(ModelView.of(model), sharded=True)  # as if fully_shard had sharded it
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    with pytest.raises(UnsupportedVersionError, match=r"FSDP2 .* needs torch>=2\.9, but found torch 2\.8\.0\+cu128"):
        tune_module.build_runner(resolved, harness=None, config=TuneConfig(), compiled=False)
