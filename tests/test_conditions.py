"""Plans are reused only under the conditions they were tuned for; otherwise re-tuned (or refused) with the reason."""

from __future__ import annotations

import pytest
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner, Plan
from lightning_ckpt.errors import StalePlanError
from lightning_ckpt.lightning.reuse import RunConditions

SPACE = {"modes": ["full"], "selections": ["all"], "rest_modes": ["none"], "segments": False}


def net() -> LitGPT:
    return LitGPT(n_layer=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.1)


def fit(tmp_path, cb, *, batch: int = 8, precision: str = "32-true", accumulate: int = 1) -> None:
    trainer = quiet_trainer(tmp_path, [cb], steps=2, precision=precision, accumulate_grad_batches=accumulate)
    trainer.fit(net(), token_loader(32, batch_size=batch))


def tuner(path, **kwargs) -> ActivationCheckpointTuner:
    search = dict(n_trials=3, measure_steps=1, search_space=SPACE)
    return ActivationCheckpointTuner(activation_budget=0.5, plan_path=path, verbose=False, search=search, **kwargs)


# What the callback records for the run these tests fit (test_reuse writes plans with the same conditions).
CONDITIONS = {
    "batch_size": 8,
    "seq_len": 16,
    "precision": "32-true",
    "device_type": "cpu",
    "device_capacity_bytes": None,
    "world_size": 1,
    "accumulation": 1,
}


@pytest.fixture
def tuned(tmp_path):
    path = tmp_path / "plan.json"
    fit(tmp_path, tuner(path))
    saved = Plan.load(path)
    assert saved.metadata["conditions"] == CONDITIONS
    return path


def test_same_conditions_reuse_without_trials(tmp_path, tuned):
    cb = tuner(tuned)
    fit(tmp_path, cb)
    assert cb.trials_run == 0 and cb.result is None


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(batch=16), "micro-batch size: tuned for 8, this run has 16"),
        (dict(precision="bf16-mixed"), "precision: tuned for '32-true', this run has 'bf16-mixed'"),
        (dict(accumulate=2), "gradient accumulation: tuned for 1, this run has 2"),
    ],
)
def test_a_changed_condition_retunes_or_raises(tmp_path, tuned, change, match):
    with pytest.raises(StalePlanError, match=match):
        fit(tmp_path, tuner(tuned, guard={"on_stale_plan": "raise"}), **change)
    cb = tuner(tuned)
    with pytest.warns(UserWarning, match=match):
        fit(tmp_path, cb, **change)
    assert cb.trials_run > 0


def test_world_size_and_device_capacity_are_compared():
    here = RunConditions(8, 16, "bf16-mixed", "cuda", 80 * 2**30, 1, 1)
    saved = {**here.to_dict(), "world_size": 2, "device_capacity_bytes": 40 * 2**30}
    changes = here.changes_from(saved)
    assert changes == [
        "device capacity: tuned for 40.0 GiB, this run has 80.0 GiB",
        "world size: tuned for 2, this run has 1",
    ]
    assert here.changes_from({"precision": "bf16-mixed"}) == []  # older files: only what they record is compared
    assert here.changes_from(saved, include_batch=False) == changes
    assert (
        RunConditions(16, 16, "bf16-mixed", "cuda", 80 * 2**30, 1, 1).changes_from(here.to_dict(), include_batch=False)
        == []
    )
