"""Joint (plan, micro-batch) search at a fixed global batch."""

from __future__ import annotations

import os

import pytest
import torch
from faults import assert_model_intact, sigterm_on_call, snapshot_model
from linear_clock import LinearClock
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner, Plan, apply_plan, baselines, plan_applied
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.measure.step import track_step_memory
from lightning_ckpt.memory.profile import profile_memory
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.microbatch import ScaledMemoryModel, divisors, resize_batch, tune_micro_batch
from lightning_ckpt.search.pipeline import SearchHooks
from lightning_ckpt.testing import GPT, GPTConfig

SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all"], "rest_modes": [], "segments": False}


def test_divisors_and_resize():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    batch = {"x": torch.arange(8).view(4, 2), "n": 3, "scalar": torch.tensor(1.0)}
    assert resize_batch(batch, 4, 2)["x"].tolist() == [[0, 1], [2, 3]]
    big = resize_batch(batch, 4, 6)["x"]
    assert big.shape == (6, 2) and big[4].tolist() == [0, 1]
    assert resize_batch(batch, 4, 6)["n"] == 3


def test_scaled_memory_model_predicts_other_micro_batches(gpt):
    tokens = torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(0))

    def loss_for(m):
        x = resize_batch(tokens, 4, m)
        return lambda: gpt(x, x)

    small, large = (profile_memory(gpt, loss_for(m), extra=(resize_batch(tokens, 4, m),)) for m in (2, 4))
    scaled = ScaledMemoryModel(small, large, 2, 4, 4)
    for name in ("none", "full", "selective_mlp"):
        plan = baselines(gpt)[name]
        x = resize_batch(tokens, 4, 8)
        with plan_applied(gpt, plan):
            measured = track_step_memory(lambda x=x: gpt(x, x).backward(), model=gpt, extra=(x,))
        gpt.zero_grad(set_to_none=True)
        predicted = scaled.at(8).predict_activation(plan)
        assert abs(predicted - measured.activation_bytes) <= 0.1 * measured.activation_bytes, name


class BatchedGPT(LitGPT):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(
            n_layer=4, n_embd=32, vocab_size=48, block_size=16, dropout=0.0, optimizer=torch.optim.SGD, lr=0.1
        )
        self.batch_size = batch_size
        self.losses: list[float] = []
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def calls_after(self, fault) -> int:
        return self.calls - fault.fired_at[0]

    def train_dataloader(self):
        return token_loader(64, batch_size=self.batch_size)


def _fit(tmp_path, callbacks, module, *, steps=2, accumulate=1):
    quiet_trainer(tmp_path, callbacks, steps=steps, accumulate_grad_batches=accumulate).fit(module)
    return module


def test_joint_search_keeps_the_global_batch_and_the_optimisation(tmp_path):
    tuner = ActivationCheckpointTuner(
        tune_micro_batch=True,
        activation_budget=0.6,
        plan_path=tmp_path / "plan.json",
        verbose=False,
        # The user's confirmation settings hold in the joint search too (it once replaced confirm_rounds by 3,
        # so these failed at fit start).
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE, confirm_rounds=2, confirm_max_rounds=2),
    )
    tuned = _fit(tmp_path, [tuner], BatchedGPT(8))
    assert all(len(t.confirmation_seconds) <= 2 for t in tuner.result.trials)
    # The plan records the joint confirmation's verdict (across micro-batches), not one micro-batch's own.
    verdict = tuner.result.best.metadata["search"].get("verdict")
    assert verdict is None or "[micro-batch" in verdict["reference"]
    spec = tuner.micro_batch
    assert spec["size"] * spec["accumulation"] == spec["global"] == 8
    result = tuner.result
    # Pruning: nothing predicted over budget was run, and the winner's measured memory is within it.
    limit = result.budget.limit_bytes
    assert all(t.predicted_activation_bytes <= limit for t in result.trials if t.status != "pruned")
    assert result.best_trial.activation_bytes <= limit
    assert any(t.status == "pruned" for t in result.trials)
    # Same plan, original micro-batch: the same weights after the same optimizer steps.
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.metadata["micro_batch"]["size"] == spec["size"]
    by_hand = BatchedGPT(8)
    apply_plan(by_hand, plan)
    _fit(tmp_path, [], by_hand)
    for (k, a), b in zip(tuned.state_dict().items(), by_hand.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    # Reuse applies the micro-batch too, without trials.
    reuse = ActivationCheckpointTuner(plan=tmp_path / "plan.json", verbose=False)
    _fit(tmp_path, [reuse], BatchedGPT(8))
    assert reuse.trials_run == 0 and reuse.micro_batch == spec


def test_micro_batch_needs_a_batch_size_attribute(tmp_path):
    class NoAttr(BatchedGPT):
        def __init__(self):
            super().__init__()
            del self.batch_size

        def train_dataloader(self):
            return token_loader(16, batch_size=4, seed=None)

    with pytest.raises(ConfigurationError, match="batch_size"):
        _fit(tmp_path, [ActivationCheckpointTuner(tune_micro_batch=True, verbose=False)], NoAttr())


def _tiny_gpt():
    """A seeded 4-layer GPT, its batch of 4, and ``loss_for(m)``: the loss on that batch resized to ``m``."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.0))
    tokens = torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(0))

    def loss_for(m):
        x = resize_batch(tokens, 4, m)
        return lambda: model(x, x)

    return model, tokens, loss_for


def test_micro_batches_are_chosen_from_an_interleaved_confirmation_round():
    model, tokens, loss_for = _tiny_gpt()

    common = dict(
        base_micro_batch=4,
        global_batch=8,
        activation_budget=1.0,
        extra_for=lambda m: (resize_batch(tokens, 4, m),),
    )
    # No allowance: the joint search of a step of a few milliseconds spends 150 plain steps before the rounds this
    # test is about (the allowance's own tests: test_confirm.py, test_study.py).
    search = dict(micro_batches=[2, 4], n_trials=4, search_space=SPACE, measure_steps=1, search_steps=None)
    found = tune_micro_batch(
        model, loss_for, config=TuneConfig(confirm_top=2, confirm_rounds=2, confirm_max_rounds=2, **search), **common
    )
    trials = found.result.trials
    # One engine: one numbering, one record per (plan, micro-batch), every micro-batch's baselines measured first.
    assert [t.number for t in trials] == list(range(len(trials)))
    assert len({(t.plan.key(), t.micro_batch) for t in trials}) == len(trials)
    assert {t.micro_batch for t in trials if t.baseline} == {2, 4}
    assert all(t.accumulation == 8 // t.micro_batch for t in trials)
    confirmed = [t for t in trials if t.confirmed]
    assert len(confirmed) >= 2 and all(2 <= len(t.confirmation_seconds) <= 2 + 3 for t in confirmed)
    # Every fitting baseline (at most the 6 fastest, across micro-batches) is re-timed beside the leaders.
    fitting = sorted(
        (t for t in trials if t.feasible and t.baseline),
        key=lambda t: -(t.first_samples_per_second or t.samples_per_second),
    )
    assert sum(t.confirmed for t in fitting) == min(6, len(fitting))
    if not found.result.best.metadata["search"].get("speed_changes"):
        assert all(t.confirmed for t in fitting[:6])
    # (after a speed change the six are the fastest of a side-by-side re-ranking round, not of the search figures)
    # The winner is re-timed and chosen by the verdict against the fastest fitting baseline; its figure is per sample.
    best = found.result.best_trial
    assert best in confirmed
    verdict = found.result.best.metadata["search"].get("verdict")
    if best.baseline is None:
        assert verdict["outcome"] == "tuned" and verdict["ratio"] > 1.0
    assert best.samples_per_second == pytest.approx(best.micro_batch / best.median_seconds)
    assert found.micro_batch == best.micro_batch and found.micro_batch * found.accumulation == 8
    # The plan file's figures have the shape a single-shape search's have.
    metadata = found.result.best.metadata
    assert set(metadata["measured"]) >= {"label", "samples_per_second", "peak_bytes", "activation_bytes", "status"}
    assert metadata["micro_batch"]["size"] == found.micro_batch and metadata["micro_batch"]["original_size"] == 4
    # Without confirmation, the search figures decide and nothing is re-timed.
    plain = tune_micro_batch(model, loss_for, config=TuneConfig(confirm_top=0, **search), **common)
    assert not any(t.confirmed for t in plain.result.trials)


def test_the_sampler_proposes_the_micro_batch_as_one_more_dimension():
    # A space larger than n_trials: Optuna's sampler proposes (plan, micro-batch) pairs through the study, each
    # once, and the budget bounds what is measured.
    model, tokens, loss_for = _tiny_gpt()

    space = {"modes": ["full", "selective:mlp"], "selections": ["all", "first:0.5", "every:2"], "rest_modes": ["none"]}
    found = tune_micro_batch(model, loss_for, base_micro_batch=4, global_batch=8, activation_budget=0.8, extra_for=lambda m: (resize_batch(tokens, 4, m),), config=TuneConfig(micro_batches=[2, 4], n_trials=14, search_space=space, measure_steps=1, confirm_top=0, predict_time=False))  # fmt: skip
    trials = found.result.trials
    assert not found.result.best.metadata["search"]["exhaustive"], "the sampler's path, not the whole space"
    measured = [t for t in trials if t.status != "pruned"]
    baselines = [t for t in measured if t.baseline is not None]
    tuned = [t for t in measured if t.baseline is None]
    assert len(baselines) < 14 and len(tuned) >= 1 and len(measured) <= 14  # baselines first, then the sampler's
    assert all(t.params["micro_batch"] in (2, 4) for t in tuned)
    assert all(t.label.endswith(f"[micro-batch {t.micro_batch} x{8 // t.micro_batch}]") for t in trials)
    assert len({(t.plan.key(), t.micro_batch) for t in trials}) == len(trials)


def test_the_joint_search_predicts_each_micro_batch_with_its_own_time_model():
    """The time model measures only the (plan, micro-batch) pairs that can still win per sample, each predicted by its
    micro-batch's model (two profiles' block timings, affine in the micro-batch, fitted to that micro-batch's steps),
    and chooses what measuring every pair chooses. On the Linear clock a step's time is its Linear calls, whatever the
    micro-batch: the predictions are exact, and a larger micro-batch is faster per sample."""
    model, tokens, loss_for = _tiny_gpt()
    space = {"modes": ["full", "selective:mlp"], "selections": ["all", "first:0.5", "every:2"], "rest_modes": ["none"]}
    common = dict(base_micro_batch=4, global_batch=8, activation_budget=0.8, extra_for=lambda m: (resize_batch(tokens, 4, m),))  # fmt: skip
    clock = LinearClock()
    settings = dict(
        micro_batches=[2, 4], search_space=space, measure_steps=1, warmup_steps=0, confirm_top=0, clock=clock
    )
    with clock.installed():
        found = tune_micro_batch(model, loss_for, config=TuneConfig(n_trials=14, **settings), **common)
        everything = tune_micro_batch(model, loss_for, config=TuneConfig(n_trials=99, predict_time=False, **settings), **common)  # fmt: skip
    trials = found.result.trials
    summary = found.result.best.metadata["search"]["time_model"]
    assert set(summary["calibration_by_micro_batch"]) == {"2", "4"}
    predicted = [t for t in trials if t.status == "ok" and t.predicted_seconds is not None]
    assert predicted and all(t.predicted_seconds == pytest.approx(t.median_seconds) for t in predicted)
    assert any(t.pruned_by == "time" for t in trials), "pairs that cannot win are not measured"
    assert len([t for t in trials if t.status == "ok"]) < len([t for t in everything.result.trials if t.status == "ok"])
    # What measuring every pair chooses, or a plan tied with it (the same Linear calls and memory: either is kept).
    ours, theirs = found.result.best_trial, everything.result.best_trial
    assert found.micro_batch == everything.micro_batch
    assert (ours.median_seconds, ours.activation_bytes) == pytest.approx(
        (theirs.median_seconds, theirs.activation_bytes)
    )


@pytest.mark.skipif(os.name == "nt", reason="SIGTERM")
def test_sigterm_stops_the_joint_search_as_it_stops_the_plan_search(tmp_path):
    # The joint search was a second pipeline without the plan search's should_stop: SIGTERM ran it to the end.
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    net = BatchedGPT(8)
    before = snapshot_model(net)
    path = tmp_path / "plan.json"
    tuner = ActivationCheckpointTuner(
        tune_micro_batch=True, activation_budget=0.6, plan_path=path, verbose=False,
        search=dict(n_trials=20, measure_steps=1, search_space=SPACE),
    )  # fmt: skip
    with sigterm_on_call(net, "training_step", at=12) as fault, pytest.raises((SIGTERMException, SystemExit)):
        _fit(tmp_path, [tuner], net)
    assert fault.fired
    assert net.calls_after(fault) <= 6, "the search stopped within a trial or two of the signal"
    assert tuner.plan is None and not path.exists()
    assert_model_intact(net, before)


def test_the_joint_search_polls_should_stop_and_leaves_the_model_as_it_was():
    from lightning_ckpt.search.trials import SearchInterrupted

    model, tokens, loss_for = _tiny_gpt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    polls: list[int] = []

    def stop() -> bool:
        polls.append(1)
        return len(polls) > 2

    with pytest.raises(SearchInterrupted):
        tune_micro_batch(model, loss_for, base_micro_batch=4, global_batch=8, activation_budget=0.8, extra_for=lambda m: (resize_batch(tokens, 4, m),), config=TuneConfig(micro_batches=[2, 4], n_trials=14, search_space=SPACE, measure_steps=1), hooks=SearchHooks(should_stop=stop))  # fmt: skip
    assert len(polls) == 3, "polled between trials, stopped at the first True"
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_the_joint_search_resolves_an_activation_budget_on_the_largest_ranks_step_as_tune_does():
    # The joint search resolved its budget on each rank's own profile and took rank 0's: a share of a shorter batch
    # than another rank's, where ``tune`` takes the largest rank's (tests/test_distributed.py).
    class TwoRanks:
        is_leader, world_size = True, 2

        def broadcast(self, obj):
            return obj

        def all_gather(self, obj):  # rank 1's batch is longer: its no-checkpointing activations are 3x
            return [obj, 3 * obj] if isinstance(obj, int) and not isinstance(obj, bool) else [obj, obj]

    model, tokens, loss_for = _tiny_gpt()
    config = TuneConfig(micro_batches=[2, 4], n_trials=2, search_space=SPACE, measure_steps=1, confirm_top=0,
                        search_steps=None)  # fmt: skip
    common = dict(base_micro_batch=4, global_batch=8, activation_budget=0.5, extra_for=lambda m: (resize_batch(tokens, 4, m),), config=config)  # fmt: skip
    alone = tune_micro_batch(model, loss_for, **common).result.budget
    ranks = tune_micro_batch(model, loss_for, hooks=SearchHooks(sync=TwoRanks()), **common).result.budget
    assert ranks.limit_bytes == pytest.approx(3 * alone.limit_bytes, rel=1e-6)
