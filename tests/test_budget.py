from __future__ import annotations

import pytest
import torch

from lightning_ckpt.budget import Budget, RequestedBudget, parse_bytes, resolve_budget, validate_budget_args
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.search.config import TuneConfig


@pytest.mark.parametrize(
    ("text", "expected"),
    [("20GiB", 20 * 2**30), ("512 MB", 512 * 10**6), ("1.5e9", 1_500_000_000), ("64k", 65536), (1024, 1024)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["20 gigs", "GiB", "", "-5GiB", 0, -1, True, "0.8", "0.5B"])
def test_unparseable_or_non_positive_budgets_are_refused(bad):
    with pytest.raises(ConfigurationError):
        parse_bytes(bad)


def test_budget_argument_rules():
    with pytest.raises(ConfigurationError, match="not both"):
        validate_budget_args("1GiB", 0.5)
    with pytest.raises(ConfigurationError, match=r"\(0, 1\]"):
        validate_budget_args(None, 1.5)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigurationError, match="fraction of device memory"):
        resolve_budget(0.8, None, device=cpu)
    assert resolve_budget(None, None, device=cpu).kind == "none"
    b = resolve_budget(None, 0.5, device=cpu, none_activation_bytes=1000)
    assert (b.kind, b.limit_bytes) == ("activation", 500)
    assert b.fits(peak_bytes=10**9, activation_bytes=500) and not b.fits(peak_bytes=0, activation_bytes=501)
    peak = resolve_budget("1KiB", None, device=cpu)
    assert peak.fits(1024, None) and not peak.fits(1025, 0)
    assert Budget("none").fits(None, None)


def test_default_cuda_budget_is_what_this_process_can_use(monkeypatch):
    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (30 * 2**30, total))  # others hold the rest
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 10 * 2**30)  # ours, reusable
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 1.0)
    budget = resolve_budget(None, None, device=torch.device("cuda", 0))
    assert budget.limit_bytes == pytest.approx(0.9 * 40 * 2**30, rel=1e-6)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 0.25)
    assert resolve_budget(None, None, device=torch.device("cuda", 0)).limit_bytes == pytest.approx(0.9 * 20 * 2**30)


def test_a_budget_is_parsed_once_and_resolved_from_its_value():
    # The text is read once (RequestedBudget.parse); resolving never reads it again, so "20GiB" and its bytes
    # resolve alike, and the same request resolves to the same limit wherever it is resolved.
    cpu = torch.device("cpu")
    text, raw = RequestedBudget.parse("20GiB"), RequestedBudget.parse(20 * 2**30)
    assert text == raw and text.resolve(device=cpu) == raw.resolve(device=cpu) == resolve_budget(
        "20GiB", None, device=cpu
    )
    share = RequestedBudget.parse(activation_budget=0.25)
    assert share.resolve(device=cpu, none_activation_bytes=4000).limit_bytes == 1000
    with pytest.raises(ConfigurationError, match="no-checkpointing activation memory"):
        share.resolve(device=cpu)
    with pytest.raises(ConfigurationError, match="not recorded"):
        RequestedBudget("peak").resolve(device=cpu)


def test_tune_refuses_a_bad_budget_before_running_any_step(gpt, tokens):
    from lightning_ckpt import tune

    calls = []

    def step():
        calls.append(1)
        return gpt(tokens, tokens)

    with pytest.raises(ConfigurationError, match="not a memory size"):
        tune(gpt, step, max_memory="20 gigs", config=TuneConfig(n_trials=2))
    assert calls == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"activation_budget": 50}, r"For 50% write activation_budget=0\.5"),
        ({"activation_budget": "0.5"}, r"got the string '0\.5'\. Write activation_budget=0\.5 without quotes"),
        ({"max_memory": "20 gigs"}, r"'20G', '20gb'"),
        # A unitless string above one: once silently a 1-byte budget (the float 1.5 and "0.8" were refused).
        ({"max_memory": "1.5"}, r"'1\.5' is a string without a unit, read as bytes, but is not a whole number"),
        ({"max_memory": "2.5 B"}, r"not a whole number of bytes"),
        # Issue #64: "2" was a budget of 2 bytes (a search ran and fell back), "20GB " was taken with its space.
        ({"max_memory": "2"}, r"'2' has no unit, so it reads as 2 bytes.*e\.g\. '2GiB' or '2GB'"),
        ({"max_memory": "20GB "}, r"'20GB ' has spaces around the size\. Write it without them, e\.g\. '20GB'"),
    ],
    ids=["percent", "string-fraction", "units", "string-above-one", "fractional-bytes", "no-unit", "trailing-space"],
)
def test_budget_mistakes_get_the_fix_in_the_message(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        RequestedBudget.parse(kwargs.get("max_memory"), kwargs.get("activation_budget"))


def test_an_activation_budget_line_names_the_budget_and_the_memory_it_is_a_share_of():
    # "50% of no-checkpointing activation memory (123.3 MiB)" read as if 123.3 MiB were the whole: say both.
    budget = RequestedBudget.parse(activation_budget=0.5).resolve(
        device=torch.device("cpu"), none_activation_bytes=int(246.5 * 2**20)
    )
    assert budget.limit_bytes == int(123.25 * 2**20)
    assert budget.description == "123.2 MiB of activation memory, 50% of the 246.5 MiB without checkpointing"


# A fit as a user runs it, its stdout and stderr in one pipe (as `python train.py 2>&1 | tee log`), so the test reads
# the lines in the order a user reads them.
_FIT = """
import sys
sys.path.insert(0, {tests!r})
import lightning as L
from lit import LitGPT, token_loader
from lightning_ckpt import ActivationCheckpointTuner

tuner = ActivationCheckpointTuner(max_memory={budget!r}, search={search!r})
trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[tuner], logger=False, enable_checkpointing=False,
                    enable_model_summary=False, default_root_dir={root!r})
trainer.fit(LitGPT(n_layer=2, dropout=0.0), token_loader(32))
print("TRIALS", tuner.trials_run, "PLAN", tuner.plan.describe())
"""


def _fit_lines(tmp_path, budget, search) -> list[str]:
    import subprocess
    import sys
    from pathlib import Path

    code = _FIT.format(tests=str(Path(__file__).parent), budget=budget, search=search, root=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    return [line for line in done.stdout.replace("\r", "\n").splitlines() if line.strip()]


def test_a_budget_above_the_hosts_memory_is_clamped_and_no_checkpointing_is_chosen_without_a_search(tmp_path):
    # Issue #64: max_memory="500GiB" on a 23 GB machine searched 5 plans for 63 s, chose none and said nothing.
    from lightning_ckpt.budget import host_memory
    from lightning_ckpt.formatting import format_bytes

    host, where = host_memory()
    lines = _fit_lines(tmp_path, "500GiB", {"n_trials": 6})
    ours = [
        line for line in lines if line.startswith("lightning_ckpt:") and not line.startswith("lightning_ckpt: tuning")
    ]
    clamp = f"lightning_ckpt: max_memory (500.0 GiB) is above {where} ({format_bytes(host)}), which no step on this CPU"
    assert ours[0].startswith(clamp), "\n".join(lines)
    assert ours[0].endswith(f"the budget is clamped to {format_bytes(host)}")
    assert ours[1].startswith("lightning_ckpt: chose none | ") and f"of {format_bytes(host)} |" in ours[1], ours[1]
    assert "| the memory model predicts no checkpointing fits the budget, so nothing else was searched" in ours[1]
    assert "search={'search_when_none_fits': True} searches anyway" in ours[1] and "(1 plan: 1 run" in ours[1]
    assert not any("confirming" in line for line in lines)
    assert lines[-1] == "TRIALS 1 PLAN none", lines[-1]


def test_a_search_runs_when_no_checkpointing_fits_if_asked_for(tmp_path):
    lines = _fit_lines(tmp_path, "20GiB", {"n_trials": 4, "search_when_none_fits": True})
    assert not any("predicts that no checkpointing fits" in line for line in lines)
    trials = int(lines[-1].split()[1])
    assert trials > 1, lines[-1]
    with pytest.raises(ConfigurationError, match="search_when_none_fits must be True or False"):
        from lightning_ckpt import TuneConfig

        TuneConfig(search_when_none_fits="yes")
