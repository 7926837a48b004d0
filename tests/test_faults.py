"""The fault-injection helpers in tests/faults.py do what they say, and undo themselves."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch
from faults import (
    InjectedFault,
    assert_model_intact,
    fail_on_call,
    fail_plan_save,
    sigterm_handler,
    sigterm_on_call,
    snapshot_model,
)
from torch import nn

from lightning_ckpt import BlockPlan, Plan, apply_plan


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()

    def step(self, x):
        return self(x)


def test_fail_on_call_raises_at_the_kth_call_only_and_restores_the_method():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 4)
    with fail_on_call(model, "step", at=3) as fault:
        model.step(x), model.step(x)
        with pytest.raises(InjectedFault, match="step call 3"):
            model.step(x)
        model.step(x)
    assert fault.fired and fault.fired_at == [3] and fault.calls == 4
    assert "step" not in vars(model)

    own = model.step
    model.step = own  # an instance attribute the test had before is put back, not deleted
    with fail_on_call(model, "step", at=1, exc=KeyError("boom")), pytest.raises(KeyError):
        model.step(x)
    assert vars(model)["step"] is own


@pytest.mark.parametrize("stage", ["write", "replace"])
def test_fail_plan_save_fails_the_kth_save_and_only_the_plans_files(tmp_path, stage):
    path = tmp_path / "plan.json"
    real = (os.replace, os.fsync)
    with fail_plan_save(stage, at=2) as fault:
        Plan({"h.0": BlockPlan("full")}, name="first").save(path)
        with pytest.raises(OSError) as info:
            Plan({"h.1": BlockPlan("full")}, name="second").save(path)
        assert info.value.errno == errno.ENOSPC
        other = tmp_path / "other.txt"
        other.write_text("x")
        os.replace(other, tmp_path / "renamed.txt")  # not a plan's temp file: unaffected
        with open(tmp_path / "renamed.txt") as f:
            os.fsync(f.fileno())
    assert fault.fired and fault.calls >= 2
    assert Plan.load(path).name == "first"  # the failed save left the previous plan intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "renamed.txt"]
    assert (os.replace, os.fsync) == real


def test_sigterm_on_call_delivers_the_signal_at_the_kth_call():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(3, 4)
    seen = []
    with sigterm_handler() as received, sigterm_on_call(model, "step", at=2) as fault:
        model.step(x)
        seen.append(list(received))
        model.step(x)
        seen.append(list(received))
    assert seen == [[], [signal.SIGTERM]] and fault.fired_at == [2]
    assert signal.getsignal(signal.SIGTERM) is not None and "step" not in vars(model)


def test_assert_model_intact_catches_what_a_fault_can_leave_behind():
    torch.manual_seed(0)
    model = Tiny()
    before = snapshot_model(model)
    assert_model_intact(model, before)

    handle = apply_plan(model, Plan({"layers.0": BlockPlan("full")}))
    with pytest.raises(AssertionError, match=r"'layers\.0'.*forward"):
        assert_model_intact(model, before)
    handle.remove()
    assert_model_intact(model, before)

    model(torch.randn(3, 4))  # a training forward moves the BatchNorm statistics
    with pytest.raises(AssertionError, match=r"layers\.0\.1\.running_mean"):
        assert_model_intact(model, before)
    assert_model_intact(model, before, weights=False)

    model.load_state_dict(before.state)
    assert_model_intact(model, before)
    model.eval()
    with pytest.raises(AssertionError, match="train/eval mode changed"):
        assert_model_intact(model, before)
    model.train()
    model.layers[1][0].weight = nn.Parameter(model.layers[1][0].weight.detach().clone())
    with pytest.raises(AssertionError, match=r"parameter objects replaced: \['layers\.1\.0\.weight'\]"):
        assert_model_intact(model, before)


def test_with_a_trainer_the_step_fault_and_sigterm_stop_fit():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Tiny()

        def training_step(self, batch, batch_idx):
            return self.net(batch)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer():
        return pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)  # fmt: skip

    torch.manual_seed(0)
    module = Module()
    before = snapshot_model(module)
    with fail_on_call(module, "training_step", at=3) as fault, pytest.raises(InjectedFault):
        trainer().fit(module)
    assert fault.fired_at == [3] and fault.calls == 3
    assert_model_intact(module, before, weights=False)  # two real optimizer steps ran

    with sigterm_on_call(module, "training_step", at=2) as fault, pytest.raises(SIGTERMException):
        trainer().fit(module)
    assert fault.fired_at == [2]
    assert_model_intact(module, before, weights=False)
