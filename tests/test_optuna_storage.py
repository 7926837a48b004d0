"""The Optuna study a real tune() leaves in storage, read back through Optuna's own API: one trial per plan
with the tuner's final figures, a named objective, the budget as Optuna constraints, and a resume that adds
no trial for a plan it already holds."""

from __future__ import annotations

import optuna
import torch

from lightning_ckpt import Plan, tune
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.ledger import (
    FAILED_CONSTRAINT,
    METRIC_NAMES,
    OVER_BUDGET_CONSTRAINT,
    TRIAL_ATTRS,
    TrialStatus,
)
from lightning_ckpt.search.result import TuneResult

# Larger than n_trials, so the sampler proposes plans (and redraws known ones) after the baselines.
SPACE = {"modes": ["full", "selective:mlp", "ops:save_matmuls", "selective:attention"],
         "selections": ["all", "first:0.5"], "rest_modes": ["none"], "segments": False}  # fmt: skip


def _tune(gpt: torch.nn.Module, tokens: torch.Tensor, storage: str, n_trials: int) -> TuneResult:
    # 0.7 of the no-checkpointing activations: 3 of the 9 plans fit (full, full h.0-1, selective(attn)), so a
    # search of 2 leaves one for the resumed search of 3; the rest are pruned, which costs nothing. Measured as
    # proposed, n_trials at a time (predict_time=False); the time model's pruned trials: test_study.py. No allowance:
    # the confirmation round is part of what is stored, and a step of a few milliseconds may spend it first.
    return tune(gpt, lambda: gpt(tokens, tokens), activation_budget=0.7, config=TuneConfig(search_space=SPACE, storage=storage, n_trials=n_trials, measure_steps=1, warmup_steps=0, process_warmup_steps=0, count_flops=False, confirm_rounds=1, confirm_max_rounds=1, predict_time=False, search_steps=None))  # fmt: skip


def _by_plan(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    trials = {Plan.from_dict(t.user_attrs["plan"]).key(): t for t in study.trials}
    assert len(trials) == len(study.trials), "a plan stored twice"
    return trials


def _check_against(study: optuna.Study, result: TuneResult, *, resumed_unchanged: bool = False) -> None:
    stored = _by_plan(study)
    assert set(stored) == {t.plan.key() for t in result.trials}, "one stored trial per plan the tuner recorded"
    for record in result.trials:
        trial = stored[record.plan.key()]
        assert set(trial.user_attrs) == set(TRIAL_ATTRS)
        assert trial.user_attrs["status"] == record.status.value
        assert set(trial.constraints) == {OVER_BUDGET_CONSTRAINT, FAILED_CONSTRAINT}
        feasible = all(v <= 0 for v in trial.constraints.values())
        assert feasible == (record.status == TrialStatus.OK), (record.label, record.status, trial.constraints)
        if record.status == TrialStatus.PRUNED:
            assert trial.state == optuna.trial.TrialState.PRUNED and trial.constraints[OVER_BUDGET_CONSTRAINT] > 0
        elif record.samples_per_second is not None and not record.status.failed:
            assert trial.state == optuna.trial.TrialState.COMPLETE
            if not (record.resumed and resumed_unchanged):  # a resumed trial keeps the figures of the run before
                assert trial.value == record.samples_per_second, record.label
                assert trial.user_attrs["confirmation_seconds"] == list(record.confirmation_seconds)
        else:
            assert trial.state == optuna.trial.TrialState.FAIL


def test_the_stored_study_holds_each_plan_once_with_the_final_figures_and_resumes_without_duplicates(
    gpt, tokens, tmp_path
):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    first = _tune(gpt, tokens, storage, n_trials=2)
    assert first.storage == storage and first.study_name.startswith("lightning_ckpt-")
    assert first.best.metadata["search"]["study_name"] == first.study_name

    study = optuna.load_study(study_name=first.study_name, storage=storage)
    assert study.metric_names == list(METRIC_NAMES) and study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    _check_against(study, first)
    confirmed = [t for t in first.trials if t.confirmed]
    assert confirmed, "the confirmation round re-timed the leaders"
    assert any(t.samples_per_second != t.first_samples_per_second for t in confirmed)
    assert study.user_attrs["chosen_trial"] == _by_plan(study)[first.best.key()].number
    assert study.user_attrs["run"]["batch_size"] == 1
    # Optuna's own views agree: its best trial is feasible, and the feasible ones are the tuner's "ok" plans.
    assert all(v <= 0 for v in study.best_trial.constraints.values())

    second = _tune(gpt, tokens, storage, n_trials=3)
    assert second.study_name == first.study_name
    resumed = [t for t in second.trials if t.resumed]
    assert {t.plan.key() for t in resumed} == {t.plan.key() for t in first.trials}
    assert second.n_measured > first.n_measured, "the second run measured a new plan"
    study = optuna.load_study(study_name=second.study_name, storage=storage)
    _check_against(study, second, resumed_unchanged=True)
    assert len(study.trials) == len(second.trials)
