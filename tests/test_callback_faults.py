"""Faults, interrupts and odd-but-legal use: the model, the files and the user's training stay intact."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from faults import InjectedFault, assert_model_intact, fail_plan_save, sigterm_on_call, snapshot_model
from lit import LitGPT, quiet_trainer, token_loader
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, Plan, applied_plan
from lightning_ckpt.errors import ConfigurationError, StalePlanError, TrialsFailedError

SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all"], "rest_modes": ["none"], "segments": False}


class _Calls:
    """Every call to training_step, the search's included: an object without a ``__dict__``, which the search
    leaves alone (it restores the module's plain attributes, such as an int counter, after every step)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class Net(LitGPT):
    def __init__(
        self, *, raise_at_step: int | None = None, fail_from_call: int | None = None, skip_first: bool = False
    ):
        super().__init__(n_layer=3, n_embd=32, vocab_size=48, block_size=16, dropout=0.1)
        self.raise_at_step, self.fail_from_call, self.skip_first = raise_at_step, fail_from_call, skip_first
        self.all_calls = _Calls()
        self.batches_seen: list[int] = []

    @property
    def calls(self) -> int:
        return self.all_calls.n

    def training_step(self, batch, batch_idx):
        self.all_calls.n += 1
        if self.fail_from_call is not None and self.calls >= self.fail_from_call:
            raise ValueError("boom: a bug in the user's training_step")
        if self.raise_at_step is not None and self.trainer.global_step == self.raise_at_step:
            raise InjectedFault(f"step {self.raise_at_step}")
        if self.skip_first and batch_idx == 0:
            return None
        self.batches_seen.append(batch_idx)
        return super().training_step(batch, batch_idx)


def trainer(tmp_path, cb, *, steps: int = 3, **kwargs) -> L.Trainer:
    return quiet_trainer(tmp_path, [cb], steps=steps, **kwargs)


def tuner(search=None, **kwargs) -> ActivationCheckpointTuner:
    searching = {**dict(n_trials=4, measure_steps=1, search_space=SPACE), **(search or {})}
    return ActivationCheckpointTuner(**{"activation_budget": 0.5, "verbose": False, **kwargs}, search=searching)


def test_exception_after_lock_in_leaves_the_model_as_given_and_a_new_fit_works(tmp_path):
    net = Net(raise_at_step=1)
    before = snapshot_model(net)
    cb = tuner()
    with pytest.raises(InjectedFault):
        trainer(tmp_path, cb).fit(net, token_loader(32))
    assert cb.plan is not None and applied_plan(net) is None
    assert_model_intact(net, before, weights=False)  # one real step ran before the fault
    net.raise_at_step = None
    trainer(tmp_path, tuner()).fit(net, token_loader(32))  # profiling needs the model without checkpointing


def test_a_failed_plan_save_keeps_training_and_the_old_file_and_a_later_save_writes_it(tmp_path):
    # The plan file is a by-product: a full disk at the search's save must not kill the run.
    path = tmp_path / "plan.json"
    old = Plan({"model.transformer.h.0": BlockPlan("full")}, name="old", metadata={"budget": {"kind": "peak"}})
    old.save(path)
    old_bytes = path.read_bytes()
    net = Net()
    cb = tuner(plan_path=path)
    t = trainer(tmp_path, cb, steps=4)
    with fail_plan_save("replace") as fault, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(net, token_loader(32))
        final = path.read_bytes()
    assert fault.fired and fault.fired_at == [1]
    assert t.global_step == 4, "every step trained"
    said = [str(w.message) for w in caught if "could not be written" in str(w.message)]
    assert len(said) == 1 and str(path) in said[0] and "No space left on device" in said[0]
    assert "Training goes on with plan" in said[0] and cb.plan.digest() in said[0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".plan.json")], "no temp file left"
    # The guard's save after the first real steps worked: the file holds this run's plan, and it was said.
    assert final != old_bytes and Plan.load(path) == cb.plan
    assert any("was written after all" in str(w.message) for w in caught)


def test_a_plan_file_that_can_never_be_written_leaves_the_plan_in_memory_and_in_checkpoints(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"

    def read_only(self, *args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Plan, "save", read_only)
    net = Net()
    cb = tuner(plan_path=path)
    t = trainer(tmp_path, cb, steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(net, token_loader(32))
    assert t.global_step == 4 and not path.exists()
    said = [str(w.message) for w in caught if "could not be written" in str(w.message)]
    assert len(said) == 1 and "Read-only file system" in said[0], "said once per fit, not at every save"
    assert cb.state_dict()["plan"] == cb.plan.to_dict() and not cb.plan.is_empty
    assert cb._plan_file.failed == "OSError: Read-only file system"


def test_second_fit_with_the_same_callback_reapplies_without_searching(tmp_path):
    cb = tuner()
    net = Net()
    trainer(tmp_path, cb).fit(net, token_loader(32))
    first = cb.plan
    calls = net.calls
    cb.result = None
    trainer(tmp_path, cb, steps=2).fit(net, token_loader(32))
    assert cb.result is None and cb.plan == first
    assert net.calls - calls == 2, "only the two real steps ran training_step: no trials"


def test_when_every_trial_errors_the_error_is_surfaced_and_nothing_is_written_or_applied(tmp_path):
    path = tmp_path / "plan.json"
    net = Net(fail_from_call=4)  # the write check's and the profile's two forwards succeed; every trial after fails
    before = snapshot_model(net)
    with pytest.raises(TrialsFailedError) as info:
        trainer(tmp_path, tuner(plan_path=path)).fit(net, token_loader(32))
    message = str(info.value)
    assert "boom: a bug in the user's training_step" in message
    assert "Traceback" in message and "in training_step" in message
    assert not path.exists()
    assert_model_intact(net, before)


def test_without_a_logger_nothing_is_written_into_the_working_directory(tmp_path, monkeypatch, caplog):
    # Issue #64: with logger=False the search still wrote TensorBoard files under lightning_logs/lightning_ckpt in
    # the working directory. Only what was asked for is written: the plan file.
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO"):
        trainer(tmp_path, tuner(plan_path="plan.json"), default_root_dir=None).fit(Net(), token_loader(32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"], sorted(tmp_path.rglob("*"))
    assert "no TensorBoard files (Trainer(logger=False); the tuner's log_dir=... writes them)" in caplog.text
    assert "view it: tensorboard" not in caplog.text
    # The tuner's own log_dir still asks for them, logger or not; never <cwd>/lightning_ckpt (it would shadow the
    # package on the next import).
    trainer(tmp_path, tuner(log_dir="tb"), default_root_dir=None).fit(Net(), token_loader(32))
    assert any((tmp_path / "tb").rglob("events.out.tfevents.*")) and (tmp_path / "tb" / "pareto.png").exists()
    assert not (tmp_path / "lightning_ckpt").exists() and not (tmp_path / "lightning_logs").exists()


@pytest.mark.skipif(os.name == "nt", reason="SIGTERM")
def test_sigterm_during_the_search_stops_it_promptly_and_leaves_everything_intact(tmp_path):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    path = tmp_path / "plan.json"
    net = Net()
    before = snapshot_model(net)
    cb = tuner(plan_path=path, activation_budget=None, search=dict(n_trials=40))
    t = trainer(tmp_path, cb)
    with sigterm_on_call(net, "training_step", at=8) as fault, pytest.raises((SIGTERMException, SystemExit)):
        t.fit(net, token_loader(32))
    assert fault.fired
    assert all(not state for state in t.optimizers[0].state.values()), "no optimizer step ran, no state moved"
    assert net.calls <= 8 + 4, "the search stopped within a trial of the signal"
    assert cb.plan is None and not path.exists()
    assert_model_intact(net, before)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_memory=float("nan")), "max_memory must be a finite number"),
        (dict(max_memory=float("inf")), "max_memory must be a finite number"),
        (dict(max_memory=1.5), "neither a fraction of device memory"),
        (dict(search=dict(timeout="10")), "timeout must be a .*number of seconds"),
        (dict(plan=123), "plan must be a plan file path or a Plan"),
        (dict(plan_path=123), "plan_path must be a file path"),
        (dict(search=dict(seed="x")), "seed must be an integer"),
        (dict(search=dict(measure_steps=True)), "measure_steps must be an integer"),
        (dict(search=dict(search_space={"chunks": [0]})), "chunks must be segment counts"),
        (dict(search=dict(search_space={"selections": ["first:1.5"]})), r"takes a fraction of the blocks in \(0, 1\]"),
        (dict(guard=dict(steps=-1)), "guard steps must be an integer >= 0"),
        (dict(guard=dict(on_budget_exceeded="ignore")), "on_budget_exceeded must be"),
    ],
)
def test_bad_arguments_are_refused_at_construction_with_an_example(kwargs, match):
    with pytest.raises(ConfigurationError, match=match) as info:
        ActivationCheckpointTuner(**kwargs)
    assert "e.g." in str(info.value) or "must be" in str(info.value)


def test_stale_plan_message_speaks_the_callbacks_language(tmp_path):
    path = tmp_path / "plan.json"
    Plan({"model.transformer.h.0": BlockPlan("full")}, fingerprint="0000000000000000").save(path)
    with pytest.raises(StalePlanError) as info:
        cb = ActivationCheckpointTuner(plan=path, guard={"on_stale_plan": "raise"}, verbose=False)
        trainer(tmp_path, cb).fit(Net(), token_loader(32))
    assert "check_fingerprint" not in str(info.value) and "guard={'on_stale_plan': 'retune'}" in str(info.value)


def test_fallback_is_warned_on_every_fit_and_when_the_fallen_back_plan_is_reused(tmp_path):
    path = tmp_path / "plan.json"
    for _ in range(2):
        with pytest.warns(UserWarning, match="No checkpointing plan fits the budget"):
            trainer(tmp_path, tuner(max_memory=1024, activation_budget=None)).fit(Net(), token_loader(32))
    trainer(tmp_path, tuner(max_memory=1024, activation_budget=None, plan_path=path)).fit(Net(), token_loader(32))
    with pytest.warns(UserWarning, match="was a fallback"):
        trainer(tmp_path, tuner(max_memory=1024, activation_budget=None, plan_path=path)).fit(Net(), token_loader(32))


def test_a_first_batch_that_training_step_skips_is_not_tuned_on(tmp_path):
    net = Net(skip_first=True)
    cb = tuner()
    trainer(tmp_path, cb).fit(net, token_loader(32))
    assert cb.result is not None and cb.plan is not None
    assert net.batches_seen[0] == 1


def test_a_model_that_already_checkpoints_is_refused_with_the_fix(tmp_path):
    pytest.importorskip("transformers")
    from lightning_ckpt.testing.hf import lm_batch, tiny_gpt2

    class HF(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(layers=2, hidden=32, vocab=48)
            self.model.gradient_checkpointing_enable()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    batch = lm_batch(vocab=48, batch=2, seq=8)
    data = DataLoader([batch], batch_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigurationError, match="already checkpoints activations.*gradient_checkpointing_disable"):
            trainer(tmp_path, tuner()).fit(HF(), data)
