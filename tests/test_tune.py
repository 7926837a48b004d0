"""The study driver outside Lightning: tune(model, loss_fn, ...)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from linear_clock import LinearClock

from lightning_ckpt import Plan, tune
from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import ConfigurationError, InfeasibleBudgetError
from lightning_ckpt.plan.format import BlockPlan
from lightning_ckpt.search import pipeline
from lightning_ckpt.search.choice import choose_best
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.confirmation import Confirmed
from lightning_ckpt.search.ledger import TrialRecord
from lightning_ckpt.search.phases import Phases
from lightning_ckpt.search.pipeline import TAIL_STEPS, UNIT_SPREAD, Search, SearchHooks

SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all"], "rest_modes": [], "segments": False}


def _loss_fn(gpt, tokens):
    return lambda: gpt(tokens, tokens)


def _rec(n, sps, act, status="ok"):
    return TrialRecord(number=n, plan=Plan({f"h.{n}": BlockPlan("full")}), label=f"t{n}", params={}, status=status,
                       samples_per_second=sps, activation_bytes=act, peak_bytes=act)  # fmt: skip


def test_choose_best_prefers_speed_then_memory_within_tolerance():
    budget = Budget("activation", 100)
    trials = [_rec(0, 100.0, 90), _rec(1, 99.5, 50), _rec(2, 120.0, 95, status="over_budget"), _rec(3, 90.0, 10)]
    assert choose_best(trials, budget, tie_tolerance=0.01).number == 1  # within 1% of the fastest, less memory
    assert choose_best(trials, budget, tie_tolerance=0.0).number == 0
    assert choose_best([_rec(0, 5.0, 1, status="oom")], budget, tie_tolerance=0.0) is None


def test_choose_best_among_re_timed_trials_only():
    budget = Budget("activation", 100)
    # The confirmation re-timed 0 and 1 in a slow moment; 2's faster figure is from another moment.
    trials = [_rec(0, 80.0, 50), _rec(1, 70.0, 40), _rec(2, 95.0, 60)]
    trials[0], trials[1] = (replace(t, confirmation_seconds=(0.2, 0.2)) for t in trials[:2])
    assert choose_best(trials, budget, tie_tolerance=0.0, confirmed_only=True).number == 0
    assert choose_best(trials, budget, tie_tolerance=0.0).number == 2
    # A re-timed trial over budget does not count: the others compete as before.
    over = [replace(trials[0], status="over_budget"), trials[2]]
    assert choose_best(over, budget, tie_tolerance=0.0, confirmed_only=True).number == 2


def test_tune_returns_model_untouched_and_a_plan_within_budget(gpt, tokens):
    before = {k: v.clone() for k, v in gpt.state_dict().items()}
    rng = torch.get_rng_state()
    result = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.6, config=TuneConfig(n_trials=10, search_space=SPACE, measure_steps=1, seed=0))  # fmt: skip
    assert all(torch.equal(v, before[k]) for k, v in gpt.state_dict().items())
    assert all(p.grad is None for p in gpt.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any("forward" in vars(m) for m in gpt.modules()), "no plan left applied"
    assert result.best_trial.activation_bytes <= result.budget.limit_bytes
    assert result.best.metadata["measured"]["samples_per_second"] == result.best_trial.samples_per_second
    assert result.tuning_steps > 0 and result.tuning_seconds > 0
    assert "none" in result.baselines


def test_infeasible_budget_raises_or_falls_back(gpt, tokens):
    with pytest.raises(InfeasibleBudgetError, match="No checkpointing plan fits the budget"):
        tune(gpt, _loss_fn(gpt, tokens), max_memory=1024, config=TuneConfig(n_trials=4, search_space=SPACE, measure_steps=1, on_infeasible="raise"))  # fmt: skip
    with pytest.warns(UserWarning, match="Falling back to the lowest-memory plan"):
        result = tune(
            gpt,
            _loss_fn(gpt, tokens),
            max_memory=1024,
            config=TuneConfig(n_trials=4, search_space=SPACE, measure_steps=1),
        )
    assert result.fell_back and [bp.mode for bp in result.best.blocks.values()] == ["full"] * 4


def test_persisted_study_resumes_without_measuring_again(gpt, tokens, tmp_path):
    storage = f"sqlite:///{tmp_path / 'tuning.db'}"
    space = {"modes": ["full", "selective:mlp", "ops:save_matmuls", "selective:attention"],
             "selections": ["all", "first:0.5"], "rest_modes": ["none"], "segments": False}  # fmt: skip
    # confirm_top=0: the confirmation re-times; predict_time=False: measured as proposed, n_trials at a time.
    common = dict(search_space=space, storage=storage, measure_steps=1, confirm_top=0, predict_time=False)
    first = tune(gpt, _loss_fn(gpt, tokens), config=TuneConfig(n_trials=3, **common))
    second = tune(gpt, _loss_fn(gpt, tokens), config=TuneConfig(n_trials=5, **common))
    resumed = [t for t in second.trials if t.resumed]
    assert [t.plan for t in resumed] == [t.plan for t in first.trials]
    assert [t.samples_per_second for t in resumed] == [t.samples_per_second for t in first.trials]
    assert sum(t.status != "pruned" for t in second.trials) == 5


def test_a_time_model_search_resumes_its_measured_plans_as_anchors_without_measuring_them_again(gpt, tokens, tmp_path):
    # Which plans the time model prunes follows the step times: on a busy machine its errors widen the margin and it
    # may prune none. On the Linear clock (each Linear call 1 ms, nothing else) the times, and so the pruning, are
    # the same on any machine.
    clock = LinearClock()
    storage = f"sqlite:///{tmp_path / 'tuning.db'}"
    space = {"modes": ["full", "selective:mlp", "ops:save_matmuls", "selective:attention"],
             "selections": ["all", "first:0.5"], "rest_modes": ["none"], "segments": False}  # fmt: skip
    common = dict(search_space=space, storage=storage, measure_steps=1, confirm_top=0, clock=clock)
    with clock.installed():
        first = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.9, config=TuneConfig(**common))
        assert any(t.pruned_by == "time" for t in first.trials)
        second = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.9, config=TuneConfig(**common))
    ran = {t.plan.key(): t for t in first.trials if t.status != "pruned"}
    resumed = {t.plan.key(): t for t in second.trials if t.resumed and t.status != "pruned"}
    assert resumed.keys() == ran.keys()
    assert all(resumed[k].samples_per_second == ran[k].samples_per_second for k in ran), "taken as measured"
    # A plan the first search pruned by time is scored again by this one (its profile, its anchors), not resumed.
    assert not any(t.resumed and t.pruned_by == "time" for t in second.trials)


def test_bad_tune_arguments(gpt, tokens):
    with pytest.raises(ConfigurationError, match="n_trials"):
        tune(gpt, _loss_fn(gpt, tokens), config=TuneConfig(n_trials=0))
    with pytest.raises(ConfigurationError, match="must return the loss"):
        tune(gpt, lambda: None, config=TuneConfig(n_trials=2, search_space=SPACE))


@pytest.mark.parametrize("predict_time, budget", [(False, None), (True, 0.9)], ids=["sampler", "time-model"])
def test_a_real_search_whose_machine_slows_down_part_way_chooses_on_side_by_side_figures(
    gpt, tokens, predict_time, budget
):
    # Another job starts part-way: once the search has measured two plans, every step takes ~5x as long as the
    # faster of them (4 such steps more). Started by the search's own progress, not by a count of steps taken
    # in a quiet run: a count can fall before every baseline is timed, and a search timed slow throughout sees no
    # change. Sized by the search's own figures, not a quiet run's: on a machine another job already loads, steps
    # take several times a quiet step, and a slowdown sized by a quiet step would be a 1.5x change within the noise.
    # The slower machine is the search's clock running ahead by that much during each step (TuneConfig.clock):
    # what the search sees is what a sleep would show it, without the test waiting for it.
    import time

    from lightning_ckpt.report.text import result_line

    loss = _loss_fn(gpt, tokens)
    slow = {"extra": 0.0, "timed": [], "ahead": 0.0}

    def clock():
        return time.perf_counter() + slow["ahead"]

    def step():
        slow["ahead"] += slow["extra"]
        return loss()

    def progress(trial, budget):
        if trial.status != "pruned" and trial.median_seconds:  # measured plans: pruned ones cost no step
            slow["timed"].append(trial.median_seconds)
        if not slow["extra"] and len(slow["timed"]) >= 2:
            slow["extra"] = 4 * min(slow["timed"])

    # With the time model and no budget only `none` would run (nothing can beat it): a budget and a space that
    # make plans compete, so that the slowdown falls between the search and its confirmation.
    space = SPACE if not predict_time else {**SPACE, "selections": ["all", "first:0.5"], "rest_modes": ["none"]}
    # No allowance: it counts plain steps at the search's speed, which a 5x slowdown spends before the rounds this test
    # is about (the allowance's own tests: test_study.py, test_confirm.py).
    settings = dict(n_trials=6, search_space=space, measure_steps=2, seed=0, predict_time=predict_time, clock=clock,
                    search_steps=None)  # fmt: skip
    result = tune(gpt, step, batch_size=tokens.shape[0], activation_budget=budget, config=TuneConfig(**settings),
                  hooks=SearchHooks(progress=progress))  # fmt: skip
    assert result.best.metadata["search"]["speed_changes"], "the slowdown is seen"
    fitting = [t for t in result.trials if t.feasible]
    baselines = [t for t in fitting if t.baseline is not None]
    reference = max(baselines, key=lambda t: t.first_samples_per_second or t.samples_per_second)
    assert reference.confirmed, "the fastest fitting baseline is re-timed beside the leaders"
    assert result.best_trial.confirmed
    # The choice rests on paired rounds (the verdict), not on medians taken over different rounds.
    verdict = result.best.metadata["search"]["verdict"]
    if result.best_trial.baseline is not None:  # a kept baseline is the fastest by the figures shown
        assert result.best_trial.samples_per_second >= max(t.samples_per_second for t in baselines)
        if verdict is not None:
            assert verdict["reference"] == result.best_trial.label and verdict["outcome"] != "tuned"
    line = result_line(result)
    assert "speed changed during the search" in line
    if result.best_trial.baseline is None:
        # the ratio shown is the fresh rounds' (held out), after the rounds whose interval chose it
        assert verdict["outcome"] == "tuned" and verdict["chosen_after"] >= 1 and verdict["ratio"] > 1.0
        assert f"{verdict['ratio']:.2f}x [" in line and "fresh rounds after the" in line


def test_a_stop_request_during_the_confirmation_stops_the_search_as_between_trials(gpt, tokens):
    # It used to be polled only between trials: a SIGTERM in the last passes let the search finish, write its plan
    # and run a real step. Now the confirmation's rounds poll it too.
    from lightning_ckpt.search.trials import SearchInterrupted

    stop = []

    class Progress:
        def __call__(self, trial, budget) -> None:
            pass

        def confirming(self, trials) -> None:
            stop.append(True)  # the request arrives as the confirmation starts

    before = {k: v.clone() for k, v in gpt.state_dict().items()}
    with pytest.raises(SearchInterrupted, match="asked to stop"):
        space = {**SPACE, "rest_modes": ["none"], "selections": ["all", "first:0.5"]}  # several plans fit: confirmed
        # At 100% of the activations no checkpointing fits: searched anyway, so there is a confirmation to stop.
        tune(gpt, _loss_fn(gpt, tokens), activation_budget=1.0, config=TuneConfig(n_trials=6, search_space=space, measure_steps=1, search_when_none_fits=True), hooks=SearchHooks(progress=Progress(), should_stop=lambda: bool(stop)))  # fmt: skip
    assert stop, "the confirmation was reached"
    assert all(torch.equal(before[k], v) for k, v in gpt.state_dict().items())
    assert not any("forward" in vars(m) for m in gpt.modules()), "no plan left applied"


def test_the_allowance_counts_in_the_plain_step_timed_in_the_warm_up_not_the_time_models_guess(gpt, tokens):
    # Plans that all recompute put the time model's plain step too high where a block's recompute costs more in a
    # step than alone (up to 40% on CPU, tuning_cost --shapes): here the model is told each mode adds half what it
    # does. On CPU the warm-up times the plain step itself, so the allowance's unit is the step, not the guess.
    from unittest import mock

    from lightning_ckpt.timing.model import TimeModel

    clock = LinearClock()
    added = TimeModel.added_seconds
    with clock.installed():
        start = clock()
        gpt(tokens, tokens).backward()
        plain = clock() - start
        gpt.zero_grad(set_to_none=True)
        halved = lambda self, plan: (lambda s: None if s is None else s / 2)(added(self, plan))  # noqa: E731
        with mock.patch.object(TimeModel, "added_seconds", halved):
            result = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.5,
                          config=TuneConfig(search_space=SPACE, measure_steps=1, clock=clock))  # fmt: skip
    none = next(t for t in result.trials if t.baseline == "none")
    assert none.status == "pruned" and none.pruned_by == "memory", "over the budget: never run as a trial"
    assert result.cost.plain_step_seconds == pytest.approx(plain)


def test_the_trials_stop_where_the_allowance_could_no_longer_pay_for_the_rounds_floor(gpt, tokens):
    # A tuned plan is chosen only by its verdict from the side-by-side rounds. On a fast step the trials spent the
    # allowance and left the rounds two (the mixer then kept a baseline 6% slower than another, repeatability.py):
    # now the loop stops measuring tuned plans where the confirmation's floor (six rounds) would no longer fit.
    # On the Linear clock this search costs 119 plain steps unbounded, its trials measure four plans.
    def search(steps: float | None):
        clock = LinearClock()
        with clock.installed():
            return tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.5,
                        config=TuneConfig(measure_steps=1, clock=clock, search_steps=steps))  # fmt: skip

    free, bounded = search(None), search(100.0 / (1 - UNIT_SPREAD))  # the search plans to 100
    stopped = bounded.best.metadata["search"]["allowance"]["stopped"]
    assert free.n_measured > bounded.n_measured >= 2, "every baseline and at least one tuned plan, not all"
    assert any(s.startswith(f"the trials after {bounded.n_measured} plans measured") for s in stopped)
    assert not any("the confirmation" in s for s in stopped), "the rounds reached their floor"
    confirmed = [t for t in bounded.trials if t.confirmed]
    assert len(confirmed) >= 2 and bounded.cost.plain_steps <= 100.0


class _SpeedingClock(LinearClock):
    """A Linear clock whose machine speeds up when told (``cost`` changes what the next calls take, not the past)."""

    def _tick(self, module, args) -> None:
        if isinstance(module, torch.nn.Linear):
            self.linear_calls += 1
            self.now += self.cost


def test_the_allowance_counts_in_the_plain_step_as_fast_as_the_process_became_after_its_first_steps(gpt, tokens):
    # A fresh process's first steps run slower than its later ones (1.3x on 10 ms steps, tuning_cost --shapes): an
    # allowance counted in them overran 150 plain steps timed after the search. Here the machine runs twice as fast
    # from the first trial on; the plain step timed again after the trials is the unit.
    clock = _SpeedingClock()

    def faster(trial, budget) -> None:
        clock.cost = 0.5e-3

    with clock.installed():
        start = clock()
        gpt(tokens, tokens).backward()
        plain = clock() - start
        gpt.zero_grad(set_to_none=True)
        result = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.5,
                      config=TuneConfig(search_space=SPACE, measure_steps=1, clock=clock),
                      hooks=SearchHooks(progress=faster))  # fmt: skip
    assert result.cost.plain_step_seconds == pytest.approx(plain / 2)


def test_the_rounds_before_the_choice_keep_the_winners_memory_pass_for_after_them():
    # The winner's memory pass runs between the choosing rounds and the fresh ones: until a plan is chosen the
    # allowance keeps it (``Trials.memory_pass_seconds``) beside the tail (TAIL_STEPS), after it only the tail.
    now = [0.0]
    phases = Phases(clock=lambda: now[0])
    config = TuneConfig(search_steps=100.0 / (1 - UNIT_SPREAD))  # planned: 100
    trials = SimpleNamespace(config=config, memory_pass_seconds=lambda: 7.0)
    search = Search(SimpleNamespace(snapshot=lambda: ()), trials, None, (), (), Confirmed(), False, 0,
                    phases=phases, plain_seconds=0.5)  # fmt: skip
    now[0] = 20.0
    assert search.left(chosen=True) == pytest.approx((100 - TAIL_STEPS) * 0.5 - 20.0)
    assert search.left() == pytest.approx(search.left(chosen=True) - 7.0)


def test_the_fresh_rounds_keep_their_floor_where_the_winners_memory_pass_costs_many_plain_steps(
    gpt, tokens, monkeypatch
):
    # The tracker's cost is per op, so on a fast step the winner's memory pass costs many plain steps (14-18 on 30 ms
    # steps): a fixed ten-step tail paid for it out of the fresh rounds' floor of six, and one ran. Here a memory pass
    # costs 18 plain steps more than its steps, and the profile's tracked step 9 (its FLOP count is a second pass).
    from lightning_ckpt.memory import profile
    from lightning_ckpt.search import runners

    clock = LinearClock()
    linears = sum(isinstance(m, torch.nn.Linear) for m in gpt.modules())

    def costing(run, plain_steps):
        def costly(*args, **kwargs):
            out = run(*args, **kwargs)
            clock.linear_calls += plain_steps * linears
            clock.now = clock.linear_calls * clock.cost
            return out

        return costly

    monkeypatch.setattr(runners.EagerRunner, "measure_memory", costing(runners.EagerRunner.measure_memory, 18))
    monkeypatch.setattr(profile, "anchor_step", costing(profile.anchor_step, 9))
    config = TuneConfig(clock=clock)
    with clock.installed():
        result = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.5, config=config)
    search = result.best.metadata["search"]
    assert result.best_trial.baseline is None and search["verdict"]["outcome"] == "tuned", "held out"
    assert search["verdict"]["rounds"] >= config.holdout_rounds
    assert not any("fresh rounds" in s for s in search["allowance"]["stopped"])
    assert result.cost.plain_steps <= config.search_steps


def test_the_unit_is_timed_again_where_the_trials_would_stop_for_the_rounds_floor(gpt, tokens, monkeypatch):
    # Timed again only after the trials, a smaller unit left the rounds none of the floor the trials had kept for them
    # (a 10 ms step: the confirmation after 0 rounds in two of four searches). The trials, where they would stop for
    # the floor, have every rank time it first, and ask again.
    events: list[str] = []
    timed_again, looped = pipeline._plain_again, pipeline.run_trials

    def plain_again(runner, seconds):
        events.append("plain again")
        return timed_again(runner, seconds)

    def run_trials(*args, **kwargs):
        ran = looped(*args, **kwargs)
        events.append("trials over")
        return ran

    monkeypatch.setattr(pipeline, "_plain_again", plain_again)
    monkeypatch.setattr(pipeline, "run_trials", run_trials)
    clock = LinearClock()
    with clock.installed():
        result = tune(gpt, _loss_fn(gpt, tokens), activation_budget=0.5,
                      config=TuneConfig(measure_steps=1, clock=clock, search_steps=100.0))  # fmt: skip
    stopped = result.best.metadata["search"]["allowance"]["stopped"]
    assert any(s.startswith("the trials after") for s in stopped)
    assert events == ["plain again", "trials over"]
