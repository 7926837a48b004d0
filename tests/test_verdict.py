"""The verdict of a confirmation (``search/verdict.py``): paired per-round ratios, their 90% t interval, and what
it decides. Checked against figures worked by hand and against coverage on simulated rounds."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from lightning_ckpt.search.verdict import Verdict, paired_interval, t_quantile


def test_the_interval_is_the_t_interval_of_the_log_ratios_worked_by_hand():
    reference = {0: 1.10, 1: 1.00, 2: 1.21}
    candidate = {0: 1.00, 1: 1.00, 2: 1.00}
    logs = [math.log(1.10), 0.0, math.log(1.21)]
    half = 2.920 * statistics.stdev(logs) / math.sqrt(3)
    ratio, low, high, n = paired_interval(reference, candidate)
    assert n == 3
    assert ratio == pytest.approx(math.exp(statistics.fmean(logs)))
    assert low == pytest.approx(math.exp(statistics.fmean(logs) - half))
    assert high == pytest.approx(math.exp(statistics.fmean(logs) + half))


def test_only_rounds_both_plans_ran_in_are_paired():
    # Round 1's reference figure is a slow moment the candidate never saw: pairing it would claim 2x.
    ratio, low, high, n = paired_interval({0: 1.0, 1: 2.0, 2: 1.0}, {0: 1.0, 2: 1.0, 3: 0.5})
    assert (ratio, low, high, n) == (1.0, 1.0, 1.0, 2)
    assert paired_interval({0: 1.0}, {0: 0.5})[1:3] == (None, None), "one round has no spread to judge by"
    assert paired_interval({0: 1.0}, {1: 0.5}) == (None, None, None, 0)


def test_a_plan_wins_only_when_the_lower_bound_clears_the_tie_tolerance():
    rounds = {i: 1.0 for i in range(4)}
    clear = Verdict.of("baseline:full", rounds, "tuned", {i: 1 / 1.06 for i in range(4)}, tie_tolerance=0.01)
    assert clear.wins and clear.outcome == "tuned" and clear.decided
    inside = Verdict.of("baseline:full", rounds, "tuned", {i: 1 / 1.005 for i in range(4)}, tie_tolerance=0.01)
    assert inside.cannot_win and inside.outcome == "baseline"
    # 1.05x on average but noisy: the interval straddles 1.01, so it is undecided and the baseline is kept.
    noisy = {0: 1 / 1.20, 1: 1 / 0.92, 2: 1 / 1.10, 3: 1 / 0.99}
    undecided = Verdict.of("baseline:full", rounds, "tuned", noisy, tie_tolerance=0.01)
    assert not undecided.decided and undecided.outcome == "undecided" and not undecided.wins
    assert undecided.low < 1.01 < undecided.high


def test_describe_reads_ratio_interval_reference_and_rounds_and_round_trips():
    v = Verdict.of("baseline:sqrt_segments", {0: 1.06, 1: 1.09, 2: 1.03}, "t", {0: 1.0, 1: 1.0, 2: 1.0},
                   tie_tolerance=0.01)  # fmt: skip
    assert v.describe() == f"{v.ratio:.2f}x [{v.low:.2f}, {v.high:.2f}] vs sqrt_segments, 3 rounds"
    assert Verdict.from_dict(v.to_dict()) == v and v.to_dict()["outcome"] == v.outcome
    alone = Verdict.of("baseline:full", {}, None, None, tie_tolerance=0.01)
    assert alone.decided and alone.outcome == "baseline" and "no tuned plan" in alone.describe()


def test_the_interval_covers_the_true_ratio_about_90_percent_of_the_time():
    # Simulated confirmations: a plan truly 1.04x the baseline, 4% step noise on each, 4 rounds each time.
    rng = random.Random(0)
    covered = 0
    for _ in range(2000):
        ref = {r: 1.04 * (1 + rng.gauss(0, 0.04)) for r in range(4)}
        cand = {r: 1.0 * (1 + rng.gauss(0, 0.04)) for r in range(4)}
        _, low, high, _ = paired_interval(ref, cand)
        covered += low <= 1.04 <= high
    assert 0.86 <= covered / 2000 <= 0.94


def test_t_quantiles():
    assert t_quantile(1) == pytest.approx(6.314) and t_quantile(5) == pytest.approx(2.015)
    assert t_quantile(100) == pytest.approx(1.645)
    with pytest.raises(ValueError):
        t_quantile(0)


def test_a_holdout_verdict_needs_only_the_direction_and_says_which_rounds_it_comes_from():
    import dataclasses

    # Fresh rounds after the 6 that chose the plan: 1.03x with an interval below the threshold still keeps it
    # (the choosing rounds cleared the threshold); a ratio below 1 does not.
    fresh = Verdict.of("baseline:full", {0: 1.05, 1: 1.0, 2: 1.04}, "t", {0: 1.0, 1: 1.0, 2: 1.0}, tie_tolerance=0.01)
    assert not fresh.wins and fresh.low < 1.01  # as a choosing verdict, undecided
    held = dataclasses.replace(fresh, chosen_after=6)
    assert held.wins and held.outcome == "tuned" and held.decided
    assert held.describe().endswith("vs full, 3 fresh rounds after the 6 that chose it")
    assert "6 rounds that chose it" in held.explain() and Verdict.from_dict(held.to_dict()) == held
    slower = dataclasses.replace(
        Verdict.of("baseline:full", {0: 1.0, 1: 0.97, 2: 0.99}, "t", {0: 1.0, 1: 1.0, 2: 1.0}, tie_tolerance=0.01),
        chosen_after=6,
    )
    assert slower.ratio < 1 and not slower.wins and slower.outcome == "baseline" and "fresh rounds" in slower.explain()


def test_an_interval_wider_than_the_files_range_is_written_at_its_bound_and_the_file_reads_back(tmp_path):
    """Two rounds far apart: a t interval with one degree of freedom passes 10**6, which the plan file refused."""
    from lightning_ckpt import Plan

    wide = Verdict("baseline:full", "full h.0", 3.0, 0.5, 2.2e6, 2, 1.01, 0.9)
    data = wide.to_dict()
    assert data["high"] == 1e6 and data["low"] == 0.5 and data["ratio"] == 3.0
    path = Plan(metadata={"search": {"verdict": data}}).save(tmp_path / "plan.json")
    assert Verdict.recorded(Plan.load(path).provenance.search).high == 1e6
