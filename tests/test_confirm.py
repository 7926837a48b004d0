"""The side-by-side confirmation's test of a changed machine speed (``speed_change``): what counts as a change
and what as the noise of the first figure."""

from __future__ import annotations

import pytest

from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.rounds import speed_change


def test_a_change_beyond_15_percent_is_a_speed_change_and_same_moment_noise_is_not():
    assert speed_change(1.0, 1.06) is None  # 6% step-time noise
    assert speed_change(1.0, 1.25) == pytest.approx(0.8)
    assert speed_change(1.0, 0.8) == pytest.approx(1.25)
    assert speed_change(None, 1.0) is None and speed_change(1.0, None) is None


@pytest.mark.parametrize("factor", [5.0, 0.2], ids=["5x slower", "5x faster"])
def test_a_5x_change_is_seen_even_when_the_first_figure_was_noisy(factor):
    # Two steps timed on a loaded machine: 1.0 s and 1.8 s, median 1.4 s, spread 0.4 s (29%): three spreads are
    # a factor of 1.86 either way. A 5x change in either direction is beyond it (as a difference of speeds a 5x
    # slowdown is only 80%, within 86%).
    ratio = speed_change(1.4, 1.4 * factor, spread=0.4)
    assert ratio == pytest.approx(1 / factor)


@pytest.mark.parametrize("factor", [1.6, 1 / 1.6], ids=["1.6x slower", "1.6x faster"])
def test_a_change_within_three_spreads_of_a_noisy_first_figure_is_noise_either_way(factor):
    assert speed_change(1.4, 1.4 * factor, spread=0.4) is None


def _entries(seconds: dict[str, list[float]], baselines: set[str], log: list[str]):
    """Entries whose r-th round takes ``seconds[name][r]`` (per sample); ``log`` records the order they ran."""
    from lightning_ckpt.search.ledger import TrialRecord
    from lightning_ckpt.search.rounds import ConfirmEntry

    out = []
    for number, (name, times) in enumerate(seconds.items()):
        calls = iter(times)

        def step(name=name, calls=calls):
            log.append(name)
            return next(calls)

        trial = TrialRecord(number, Plan(), name, baseline=name if name in baselines else None)
        out.append(ConfirmEntry(trial, step, 1))
    return out


def test_a_plan_that_can_win_is_timed_for_every_round_and_settled_plans_stop_being_timed():
    from lightning_ckpt.search.rounds import confirm_interleaved

    log: list[str] = []
    rng = __import__("random").Random(1)
    noise = [1 + rng.uniform(-0.03, 0.03) for _ in range(8)]
    seconds = {
        "full": [1.0 * n for n in noise],  # the reference
        "slow_baseline": [1.5] * 8,  # clearly slower than the reference: dropped after the minimum rounds
        "tuned": [1 / 1.03 * n * (1 + rng.uniform(-0.03, 0.03)) for n in noise],  # 3% faster, noisy: needs rounds
        "hopeless": [1.2] * 8,  # cannot win: dropped after the minimum rounds
    }
    side = confirm_interleaved(
        _entries(seconds, {"full", "slow_baseline"}, log), min_rounds=3, max_rounds=8, tie_tolerance=0.01
    )
    assert side.reference == 0
    assert len(side.per_sample[1]) == 3 and len(side.per_sample[3]) == 3, "settled entries stop after 3 rounds"
    assert len(side.per_sample[2]) == 8 and len(side.per_sample[0]) == 8, "a plan that can win runs every round"
    # Two baselines that a few rounds cannot tell apart get every round: the one kept must be the faster.
    log.clear()
    close = {
        "full": [1.0, 0.9, 1.1, 1.0, 0.95, 1.05, 1.0, 1.0],
        "segments": [1.0, 1.1, 0.9, 0.98, 1.02, 1.0, 1.0, 0.97],
    }
    side = confirm_interleaved(_entries(close, {"full", "segments"}, log), min_rounds=3, max_rounds=8)
    assert len(side.per_sample[0]) == 8 and len(side.per_sample[1]) == 8
    # When nothing can win any more, the rounds end after the minimum.
    log.clear()
    losing = {"full": [1.0] * 8, "hopeless": [1.2] * 8}
    side = confirm_interleaved(_entries(losing, {"full"}, log), min_rounds=3, max_rounds=8, tie_tolerance=0.01)
    assert len(side.per_sample[0]) == 3


def test_round_order_rotates_and_alternates():
    from lightning_ckpt.search.rounds import confirm_interleaved

    log: list[str] = []
    seconds = {name: [1.0] * 3 for name in "abc"}
    confirm_interleaved(_entries(seconds, {"a"}, log), min_rounds=3, max_rounds=3)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # Two entries: each runs first as often as the other (an alternation of direction on top of the rotation
    # would cancel it: always the same one first).
    log.clear()
    confirm_interleaved(_entries({"a": [1.0] * 4, "b": [1.0] * 4}, {"a"}, log), min_rounds=4, max_rounds=4)
    assert log == ["a", "b", "b", "a", "b", "a", "a", "b"]


def test_rank_0s_clock_decides_when_the_allowance_ends_the_rounds():
    # Each rank reads its own wall clock: rank 0 may find the allowance spent while this rank does not, and ranks
    # that stopped at different rounds would pair mismatched collectives. The rounds follow rank 0's answer.
    from lightning_ckpt.search.distributed import LocalSync
    from lightning_ckpt.search.rounds import confirm_interleaved

    class Rank1(LocalSync):  # rank 0 broadcast that the allowance is spent before the third round
        asked = 0

        def broadcast(self, obj):
            if isinstance(obj, bool):
                self.asked += 1
                return self.asked > 2
            return obj

    log: list[str] = []
    seconds = {"full": [1.0, 1.2] * 10, "tuned": [0.99, 1.21] * 10}  # a noisy tie: undecided for many rounds
    entries = _entries(seconds, {"full"}, log)
    # This rank's own clock finds plenty left.
    side = confirm_interleaved(entries, min_rounds=2, max_rounds=20, tie_tolerance=0.01, sync=Rank1(), left=lambda: 1e9)
    assert side.stopped_by_allowance and len(side.rounds) == 2
    alone = confirm_interleaved(_entries(seconds, {"full"}, []), min_rounds=2, max_rounds=20, tie_tolerance=0.01,
                                sync=LocalSync(), left=lambda: 1e9)  # fmt: skip
    assert not alone.stopped_by_allowance and len(alone.rounds) > 2


@pytest.mark.parametrize(("reserve", "rounds"), [(0, 5), (4, 3)])
def test_the_allowance_bounds_the_rounds_before_their_floor_too(reserve, rounds):
    # A machine where a step takes 1 s and the allowance has 10 s left: rounds of two plans (2 s) fit five times.
    # Before, the floor (6 rounds) ran whatever the allowance (12 s); now no round starts that the allowance, less the
    # ``reserve`` steps kept for what follows (the fresh rounds' floor), cannot pay for.
    from lightning_ckpt.search.ledger import TrialRecord
    from lightning_ckpt.search.rounds import ConfirmEntry, confirm_interleaved

    clock = [0.0]

    def noisy(times: list[float]):  # a noisy tie, undecided for many rounds; each step takes 1 s of the clock
        calls = iter(times * 10)

        def step() -> float:
            clock[0] += 1.0
            return next(calls)

        return step

    entries = [ConfirmEntry(TrialRecord(n, Plan(), name, baseline=name if n == 0 else None, median_seconds=1.0),
                            noisy(times), 1) for n, (name, times) in enumerate([("full", [1.0, 1.2]),
                                                                                 ("tuned", [0.99, 1.21])])]  # fmt: skip
    side = confirm_interleaved(entries, min_rounds=6, max_rounds=20, tie_tolerance=0.01, left=lambda: 10.0 - clock[0],
                               reserve_steps=reserve)  # fmt: skip
    assert side.stopped_by_allowance and len(side.rounds) == rounds
    assert clock[0] <= 10.0 - reserve


def test_where_the_allowance_cannot_pay_for_the_floor_a_decided_choice_ends_the_rounds_before_it():
    # A tuned plan clearly slower than the reference: two rounds decide that it cannot win. With the floor's six rounds
    # out of the allowance's reach, the rounds end there, decided, instead of running until the allowance cuts them.
    from lightning_ckpt.search.ledger import TrialRecord
    from lightning_ckpt.search.rounds import ConfirmEntry, confirm_interleaved

    clock = [0.0]

    def step(seconds: float):
        def run() -> float:
            clock[0] += seconds
            return seconds

        return run

    def entries():
        return [ConfirmEntry(TrialRecord(0, Plan(), "full", baseline="full", median_seconds=1.0), step(1.0), 1),
                ConfirmEntry(TrialRecord(1, Plan(), "tuned", median_seconds=1.5), step(1.5), 1)]  # fmt: skip

    side = confirm_interleaved(entries(), min_rounds=6, max_rounds=20, tie_tolerance=0.01, left=lambda: 8.0 - clock[0])
    assert len(side.rounds) == 2 and not side.stopped_by_allowance and side.decided(0.01)
    roomy = confirm_interleaved(entries(), min_rounds=6, max_rounds=20, tie_tolerance=0.01, left=lambda: 1e9)
    assert len(roomy.rounds) == 6, "with room for the floor, the floor holds"


def test_rank_0s_clock_decides_when_the_floor_gives_way_to_a_decided_choice():
    # The rounds before the floor end early where the allowance cannot pay for the floor and the choice is decided.
    # That was each rank's own clock: rank 0 stopped and went on to verify the chosen plan while rank 1 waited in
    # the next round's broadcast for ever (the FSDP2 test hung). Rank 0's answer now decides for every rank.
    from lightning_ckpt.search.distributed import LocalSync
    from lightning_ckpt.search.ledger import TrialRecord
    from lightning_ckpt.search.rounds import ConfirmEntry, confirm_interleaved

    class Rank1(LocalSync):  # rank 0's answers: no round start refused; the floor out of reach after round 2
        answers = iter([False, False, True])

        def broadcast(self, obj):
            return next(self.answers) if isinstance(obj, bool) else obj

    def entries():
        return [ConfirmEntry(TrialRecord(0, Plan(), "full", baseline="full", median_seconds=1.0), lambda: 1.0, 1),
                ConfirmEntry(TrialRecord(1, Plan(), "tuned", median_seconds=1.5), lambda: 1.5, 1)]  # fmt: skip

    # This rank's own clock finds plenty left: alone, it would run the floor's six rounds.
    side = confirm_interleaved(
        entries(), min_rounds=6, max_rounds=20, tie_tolerance=0.01, sync=Rank1(), left=lambda: 1e9
    )
    assert len(side.rounds) == 2 and side.decided(0.01) and not side.stopped_by_allowance
    alone = confirm_interleaved(entries(), min_rounds=6, max_rounds=20, tie_tolerance=0.01, left=lambda: 1e9)
    assert len(alone.rounds) == 6
