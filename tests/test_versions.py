"""lightning_ckpt refuses, at import, a torch outside the range it is tested with."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_ckpt import LightningCkptError, UnsupportedVersionError
from lightning_ckpt._torch_version import ALLOW_ENV, TORCH_BELOW, TORCH_MIN, check_torch_version


@pytest.mark.parametrize("version", ["2.12.1", "2.14.0", "2.14.0a0+git1234", "3.0.0", "2.5.1+cu121", "nightly"])
def test_untested_torch_is_refused_with_the_version_found_and_the_fix(monkeypatch, version):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(UnsupportedVersionError) as info:
        check_torch_version()
    message = str(info.value)
    assert isinstance(info.value, LightningCkptError) and isinstance(info.value, ImportError)
    assert f"found torch {version}" in message
    assert "torch>=2.13,<2.14" in message and "pip install" in message and ALLOW_ENV in message


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.13.0a0+gitabc"])
def test_tested_torch_is_accepted(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    check_torch_version()


def test_the_escape_hatch_warns_instead(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="found torch 2.99.0"):
        check_torch_version("2.99.0")


def test_importing_the_package_under_an_untested_torch_fails_clearly():
    code = "import torch; torch.__version__ = '2.14.1'; import lightning_ckpt"
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 1
    assert "UnsupportedVersionError: lightning_ckpt needs torch>=2.13,<2.14" in out.stderr
    assert "found torch 2.14.1" in out.stderr


def test_pyproject_declares_the_range_that_is_checked():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    spec = re.search(r'"torch([^"]*)"', text).group(1)
    assert spec == f">={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"
    for dist in ("lightning", "optuna"):
        assert re.search(rf'"{dist}>=[\d.]+,<[\d.]+"', text), f"{dist} needs an upper bound too"
