"""A PT2 budget chosen on blocks compiled alone, weighed before it is kept (``search.whole_check``): against the
fastest plan of ours on the blocks, where it must lead by a margin, or both compiled the user's way.

The decision rules run against a scripted runner (which plan is faster or over budget); the last tests run the real
thing: a compiled search of the 2-layer test GPT compiled whole, and the check compiling it whole (marked slow: three
compiles).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_ckpt import Plan
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.measure.measurement import Measurement
from lightning_ckpt.memory.compiled import CompiledBlockMemory, CompiledMemoryModel
from lightning_ckpt.plan.format import BlockPlan
from lightning_ckpt.search import whole_check
from lightning_ckpt.search.compile import CompiledTrials, compiled_search, release_kept_graphs, reset_compiled
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.distributed import LocalSync
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus
from lightning_ckpt.search.whole_check import (
    PARTITIONS,
    Partitioned,
    WholeCheck,
    check_whole_compile,
    holds_several_blocks,
    outside_blocks_bytes,
    partition_pt2_budgets,
    weigh_on_blocks,
)
from lightning_ckpt.testing import GPT, GPTConfig

BLOCKS = ("transformer.h.0", "transformer.h.1")
PT2 = Plan(compile_memory_budget=0.3)
OURS = Plan({b: BlockPlan("selective", children=("mlp",)) for b in BLOCKS})
FULL = Plan({b: BlockPlan("full") for b in BLOCKS})
CONFIG = TuneConfig(holdout_rounds=4, holdout_max_rounds=12, confirm_steps=1, check_whole_compile=True)
LIMIT = 1_000


def record(number: int, plan: Plan, label: str, seconds: float | None, **kw: Any) -> TrialRecord:
    figures = {"median_seconds": seconds, "samples_per_second": 1 / seconds} if seconds else {}
    return TrialRecord(number=number, plan=plan, label=label, **{**figures, **kw})


@dataclass
class ScriptedWhole:
    """The user's compile, scripted: each plan's step seconds (with 1% noise) and saved bytes compiled whole."""

    seconds: dict[str, float]
    saved: dict[str, int]
    seconds_default: float | None = None  # a plan not in ``seconds`` (``measure_partitioned``: the blocks' time)
    whole: dict[str, int] = field(default_factory=dict)  # saved bytes partitioned whole (``measure_partitioned``)
    measured: list[str] = field(default_factory=list)
    retimed: list[str] = field(default_factory=list)
    partitioned: list[str] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def measure_compiled(self, plan: Plan) -> Measurement:
        self.measured.append("plain")
        return Measurement("ok", median_seconds=0.01, extra={"compile": {"compile_seconds": 0.5}})

    def measure(self, plan: Plan, memory_limit: int | None) -> Measurement:
        self.measured.append(plan.key())
        seconds = self.seconds.get(plan.key(), self.seconds_default)
        assert seconds is not None, f"{plan.key()} was not scripted"
        return Measurement(
            "ok",
            median_seconds=seconds,
            samples_per_second=1 / seconds,
            peak_bytes=self.saved.get(plan.key(), 0),
            activation_bytes=self.saved.get(plan.key(), 0),
            extra={"compile": {"compile_seconds": 2.0}},
        )

    def measure_partitioned(self, plan: Plan) -> Measurement:
        self.partitioned.append(plan.key())
        m = self.measure(plan, None)
        self.measured.pop()
        return replace(m, peak_bytes=self.whole[plan.key()], activation_bytes=self.whole[plan.key()])

    def retime(self, plan: Plan, steps: int | None = None, *, warmup: int = 1) -> Measurement:
        self.retimed.append(plan.key())
        s = self.seconds[plan.key()] * (1 + self.rng.uniform(-0.01, 0.01))
        return Measurement("ok", median_seconds=s, samples_per_second=1 / s)


@dataclass
class ScriptedStudy:
    """What the check reads of a study: its records, settings, and a judge that holds a step to ``LIMIT`` bytes."""

    records: list[TrialRecord]
    config: TuneConfig = CONFIG
    sync: LocalSync = field(default_factory=LocalSync)
    budget: Any = field(default_factory=lambda: SimpleNamespace(limit_bytes=LIMIT, value_of=lambda peak, act: peak))

    def check_stop(self) -> None:
        return None

    def judge(self, trial: TrialRecord, out: Measurement) -> TrialRecord:
        fits = out.peak_bytes is not None and out.peak_bytes <= LIMIT
        return replace(trial, peak_bytes=out.peak_bytes, activation_bytes=out.activation_bytes,
                       status=TrialStatus.OK if fits else TrialStatus.OVER_BUDGET)  # fmt: skip

    def memory_limit(self, micro_batch: int | None) -> int | None:
        return None


def leader_and_rival() -> tuple[TrialRecord, TrialRecord, list[TrialRecord]]:
    leader = record(0, PT2, "baseline:pt2_budget_0.3", 0.010, baseline="pt2_budget_0.3")
    rival = record(1, OURS, "selective(mlp) h.0-1", 0.0104)
    slower = record(2, FULL, "baseline:full", 0.013, baseline="full")
    return leader, rival, [leader, rival, slower]


def test_holds_several_blocks_is_a_whole_or_partial_compile_not_one_block_each():
    assert holds_several_blocks(("",), BLOCKS)
    assert holds_several_blocks(("transformer",), BLOCKS)
    assert not holds_several_blocks(BLOCKS, BLOCKS)  # block by block: each graph holds one block
    assert not holds_several_blocks(("lm_head",), BLOCKS)


def test_the_plan_of_ours_is_kept_where_it_runs_faster_compiled_whole():
    leader, rival, records = leader_and_rival()
    whole = ScriptedWhole({PT2.key(): 0.0110, OURS.key(): 0.0100}, {PT2.key(): 500, OURS.key(): 600})
    kept, check = check_whole_compile(records, ScriptedStudy(records), leader, whole)
    assert kept is rival
    assert isinstance(check, WholeCheck)
    assert check.kept == rival.label and check.leader_fits and check.rival_fits
    assert check.ratio == pytest.approx(1.1, rel=0.03) and check.low > 1.0
    assert CONFIG.holdout_rounds <= check.rounds <= CONFIG.holdout_max_rounds
    # The plain model once (the reference for graph breaks), then each contender compiled the user's way once.
    assert whole.measured == ["plain", PT2.key(), OURS.key()]
    assert set(whole.retimed) == {PT2.key(), OURS.key()}
    assert check.graphs == 3 and check.compile_seconds == pytest.approx(4.5)
    assert check.to_dict()["compile_seconds_each"] == [0.5, 2.0, 2.0]


def test_the_pt2_budget_is_kept_where_it_is_faster_compiled_whole():
    leader, _, records = leader_and_rival()
    whole = ScriptedWhole({PT2.key(): 0.0090, OURS.key(): 0.0100}, {PT2.key(): 500, OURS.key(): 600})
    kept, check = check_whole_compile(records, ScriptedStudy(records), leader, whole)
    assert kept is leader
    assert check is not None and check.ratio < 1.0 and check.kept == leader.label


def test_a_pt2_budget_over_budget_compiled_whole_gives_way_to_the_plan_of_ours_without_rounds():
    """A whole graph's knapsack saves other tensors than the blocks' did: its memory is measured, not assumed."""
    leader, rival, records = leader_and_rival()
    whole = ScriptedWhole({PT2.key(): 0.0090, OURS.key(): 0.0100}, {PT2.key(): 2 * LIMIT, OURS.key(): 600})
    kept, check = check_whole_compile(records, ScriptedStudy(records), leader, whole)
    assert kept is rival
    assert check is not None and not check.leader_fits and check.ratio is None and whole.retimed == []
    assert "over budget" in check.describe()


def test_nothing_is_compiled_when_the_choice_sets_no_pt2_budget():
    _, rival, records = leader_and_rival()
    whole = ScriptedWhole({}, {})
    kept, check = check_whole_compile(records, ScriptedStudy(records), rival, whole)
    assert kept is rival and check is None and whole.measured == []


def test_the_rival_may_be_a_plan_the_time_model_pruned_against_the_budgets_flattering_figure():
    leader, rival, records = leader_and_rival()
    pruned = record(3, FULL, "full h.0-1", None, status=TrialStatus.PRUNED, pruned_by="time", predicted_seconds=0.0101)
    over = record(4, Plan({BLOCKS[0]: BlockPlan("full")}), "full h.0", None, status=TrialStatus.PRUNED,
                  pruned_by="memory", predicted_seconds=0.005)  # fmt: skip
    other_budget = record(5, Plan(compile_memory_budget=0.1), "baseline:pt2_budget_0.1", 0.0095, baseline="pt2")
    none = record(6, Plan(), "baseline:none", 0.008, baseline="none")
    whole = ScriptedWhole({PT2.key(): 0.0110, FULL.key(): 0.0100}, {PT2.key(): 500, FULL.key(): 600})
    study = ScriptedStudy([*records, pruned, over, other_budget, none])
    kept, check = check_whole_compile(study.records, study, leader, whole)
    assert check is not None and check.rival == "full h.0-1" and kept is pruned


def _searched_metadata() -> dict[str, Any]:
    return {"compiles": {"graphs": 11, "seconds": 20.0}}


def _runner(regions: tuple[str, ...]) -> Any:
    return SimpleNamespace(
        assembly=SimpleNamespace(blocks=BLOCKS), regions=regions, reserve_headroom_bytes=0, allow_graph_breaks=False
    )


def _harness() -> Any:
    return SimpleNamespace(
        root=torch.nn.Linear(1, 1), step_fn=lambda: None, device=torch.device("cpu"), optimizer=None, extra=(),
        warmup_steps=1, measure_steps=1, batch_size=1, seq_len=None, target=None,
    )  # fmt: skip


def test_the_search_records_the_check_and_counts_its_compiles(monkeypatch):
    leader, rival, _ = leader_and_rival()
    check = WholeCheck(leader.label, rival.label, True, True, 1.05, 1.01, 1.09, 8, rival.label, 3, 30.0, 41.0)
    monkeypatch.setattr(whole_check, "check_whole_compile", lambda records, trials, best, whole: (rival, check))
    monkeypatch.setattr(whole_check, "partition_pt2_budgets", lambda *a: (leader, ()))
    search, metadata = SimpleNamespace(records=(), trials=None), _searched_metadata()
    after_choice = whole_check.pt2_budget_check(search, _runner(("",)), _harness(), CONFIG, metadata)
    assert after_choice(leader) is rival
    assert metadata["whole_compile_check"]["kept"] == rival.label
    assert metadata["compiles"] == {
        "graphs": 14, "seconds": 50.0, "whole_graphs": 3, "whole_seconds": 30.0
    }  # fmt: skip


MIXED = Plan({BLOCKS[0]: BlockPlan("full"), BLOCKS[1]: BlockPlan("selective", children=("mlp",))})


def on_blocks(pt2: float, ours: float, **more: tuple[float, int]) -> ScriptedWhole:
    """The blocks compiled alone, scripted: the budget, ``OURS`` and ``FULL`` (1.3x the budget), and ``more``."""
    seconds = {PT2.key(): pt2, OURS.key(): ours, FULL.key(): 1.3 * pt2}
    saved = {PT2.key(): 500, OURS.key(): 600, FULL.key(): 400}
    for plan, (s, b) in more.items():
        seconds[plan], saved[plan] = s, b
    return ScriptedWhole(seconds, saved)


def test_on_the_blocks_a_budget_leading_by_less_than_the_margin_gives_way_to_the_plan_of_ours():
    """A 4% lead on the blocks is within what compiling whole took from the budget (up to 8%, measured)."""
    leader, rival, records = leader_and_rival()
    blocks = on_blocks(0.0100, 0.0104)
    kept, check = weigh_on_blocks(records, ScriptedStudy(records), leader, blocks, 0.08)
    assert kept is rival
    assert check is not None and not check.compiled_whole and check.margin == 0.08
    assert check.rivals == (rival.label, "baseline:full")  # every fitting plan of ours, fastest first
    assert check.rival == rival.label  # the rounds' fastest against the budget
    assert check.ratio == pytest.approx(1 / 1.04, rel=0.02) and check.ratio < 1.0  # slower, yet kept
    assert blocks.measured == [PT2.key(), OURS.key(), FULL.key()]  # no plain model: nothing compiled your way
    assert set(blocks.retimed) == {PT2.key(), OURS.key(), FULL.key()}
    assert check.graphs == 0 and check.compile_seconds == 0.0
    assert "on the blocks compiled alone" in check.describe() and "more than 8% faster" in check.describe()


def test_on_the_blocks_a_budget_leading_by_more_than_the_margin_is_kept():
    leader, _, records = leader_and_rival()
    kept, check = weigh_on_blocks(records, ScriptedStudy(records), leader, on_blocks(0.0100, 0.0120), 0.08)
    assert kept is leader and check is not None and check.high < 1 / 1.08


def test_with_no_margin_the_faster_on_the_blocks_is_kept_and_a_tie_keeps_the_budget():
    leader, rival, records = leader_and_rival()
    assert weigh_on_blocks(records, ScriptedStudy(records), leader, on_blocks(0.0100, 0.0104), 0.0)[0] is leader
    assert weigh_on_blocks(records, ScriptedStudy(records), leader, on_blocks(0.0104, 0.0100), 0.0)[0] is rival


def test_on_the_blocks_a_pruned_rival_is_measured_and_kept_with_its_measurement():
    """The trial record of a plan the time model pruned has no figures; the one kept carries the blocks' own."""
    leader, rival, records = leader_and_rival()
    pruned = record(3, MIXED, "full h.0, selective(mlp) h.1", None, status=TrialStatus.PRUNED, pruned_by="time",
                    predicted_seconds=0.0101)  # fmt: skip
    blocks = on_blocks(0.0100, 0.0104, **{MIXED.key(): (0.0098, 600)})
    kept, check = weigh_on_blocks([*records, pruned], ScriptedStudy([*records, pruned]), leader, blocks, 0.08)
    assert check is not None and check.rival == pruned.label and check.rivals[0] == pruned.label
    assert kept.number == pruned.number and kept.status == TrialStatus.OK and kept.peak_bytes == 600
    over = on_blocks(0.0100, 0.0104, **{MIXED.key(): (0.0098, 2 * LIMIT)})
    kept, check = weigh_on_blocks([*records, pruned], ScriptedStudy([*records, pruned]), leader, over, 0.08)
    assert kept is rival and check is not None and check.rival == rival.label
    assert MIXED.key() not in over.retimed  # over budget on the blocks: measured, never re-timed


def test_pruned_plans_are_ranked_with_the_predictions_brought_to_the_measured_scale():
    """The time model's base sits off the machine's figures: a plan measured at 10.4 ms was predicted at 14 ms, so a
    pruned plan predicted at 13 ms is ranked at about 9.7 ms, ahead of it."""
    leader, rival, records = leader_and_rival()
    measured = replace(rival, predicted_seconds=0.0140)
    pruned = record(3, MIXED, "full h.0, selective(mlp) h.1", None, status=TrialStatus.PRUNED, pruned_by="time",
                    predicted_seconds=0.0130)  # fmt: skip
    whole = ScriptedWhole({PT2.key(): 0.0110, MIXED.key(): 0.0100}, {PT2.key(): 500, MIXED.key(): 600})
    kept, check = check_whole_compile([leader, measured, records[2], pruned], ScriptedStudy([]), leader, whole)
    assert check is not None and check.rivals == (pruned.label,) and kept is pruned  # compiled whole: one rival
    unscaled = replace(measured, predicted_seconds=None)
    whole = ScriptedWhole({PT2.key(): 0.0110, OURS.key(): 0.0100}, {PT2.key(): 500, OURS.key(): 600})
    _, check = check_whole_compile([leader, unscaled, records[2], pruned], ScriptedStudy([]), leader, whole)
    assert check is not None and check.rivals == (rival.label,)  # no pair to scale by: as predicted


def test_without_the_check_a_pt2_choice_on_a_whole_compile_is_weighed_on_the_blocks(monkeypatch):
    leader, rival, _ = leader_and_rival()
    monkeypatch.setattr(whole_check, "check_whole_compile", lambda *a: pytest.fail("the check is off"))
    weighed = []
    check = WholeCheck(leader.label, rival.label, True, True, 0.97, 0.95, 0.99, 6, rival.label, 0, 0.0, 1.5,
                       compiled_whole=False, margin=0.05)  # fmt: skip

    def weigh(records, trials, best, runner, margin, leader_fits):
        weighed.append((runner, margin))
        return rival, check

    monkeypatch.setattr(whole_check, "partition_pt2_budgets", lambda records, trials, best, runner, outside: (None, ()))
    monkeypatch.setattr(whole_check, "weigh_on_blocks", weigh)
    monkeypatch.setattr(whole_check, "compiles_of", lambda runner, profiled: {"graphs": 12, "seconds": 21.0})
    search, metadata, runner = SimpleNamespace(records=(), trials=None), _searched_metadata(), _runner(("",))
    config = replace(CONFIG, check_whole_compile=False, whole_compile_margin=0.05)
    after_choice = whole_check.pt2_budget_check(search, runner, _harness(), config, metadata)
    assert after_choice(leader) is rival
    assert weighed == [(runner, 0.05)]  # the study's own runner: the blocks, no compile of the user's model
    assert after_choice(rival) is rival and len(weighed) == 1  # a plan of ours: nothing to weigh
    assert metadata["whole_compile_check"]["compiled_whole"] is False
    assert metadata["compiles"] == {"graphs": 12, "seconds": 21.0}  # counted again after the rounds


PT2_05, PT2_07, PT2_01 = (Plan(compile_memory_budget=b) for b in (0.5, 0.7, 0.1))


def budgets_over_on_the_blocks(
    leader_seconds: float = 0.010, leader_bytes: int = 500
) -> tuple[TrialRecord, list[TrialRecord]]:
    """A PT2 leader and, besides the plans of ours: ``pt2_budget(0.5)`` faster and a little over budget on the blocks,
    ``pt2_budget(0.7)`` faster and far over, ``pt2_budget(0.1)`` slower and within."""
    leader, rival, (_, _, slower) = leader_and_rival()
    leader = replace(leader, median_seconds=leader_seconds, peak_bytes=leader_bytes, status=TrialStatus.OK)
    near = record(3, PT2_05, "baseline:pt2_budget_0.5", 0.008, peak_bytes=LIMIT + 50, status=TrialStatus.OVER_BUDGET)
    far = record(4, PT2_07, "baseline:pt2_budget_0.7", 0.0075, peak_bytes=2 * LIMIT, status=TrialStatus.OVER_BUDGET)
    slow = record(5, PT2_01, "baseline:pt2_budget_0.1", 0.012, peak_bytes=200, status=TrialStatus.OK)
    return leader, [leader, rival, slower, near, far, slow]


def partitioned_whole(**whole: int) -> ScriptedWhole:
    keys = {"p03": PT2.key(), "p05": PT2_05.key(), "p07": PT2_07.key(), "p01": PT2_01.key()}
    return ScriptedWhole({}, {}, whole={keys[k]: v for k, v in whole.items()},
                         seconds_default=0.01)  # fmt: skip


def test_a_budget_a_little_over_on_the_blocks_is_partitioned_whole_and_kept_where_it_fits_there():
    """The 8-layer GPT compiled whole: ``pt2_budget(0.5)`` 1.8% over budget on the blocks, 0.9% under compiled whole."""
    leader, records = budgets_over_on_the_blocks()
    runner = partitioned_whole(p05=LIMIT - 50, p03=400, p07=1_900)
    contender, partitioned = partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=100)
    assert contender is not None and contender.label == "baseline:pt2_budget_0.5"
    assert contender.status == TrialStatus.OK and contender.peak_bytes == LIMIT - 50  # judged partitioned whole
    assert contender.median_seconds == 0.008  # its speed is the blocks'
    # Only the one a whole graph could bring within budget: 0.7 is over by more than the code outside the blocks
    # saves, 0.1 is slower than the leader, and the first that fits ends it.
    assert runner.partitioned == [PT2_05.key()]
    assert "within the budget" in partitioned[0].describe()
    assert [p.to_dict() for p in partitioned] == [
        {"plan": "baseline:pt2_budget_0.5", "on_blocks": LIMIT + 50, "whole": LIMIT - 50, "fits": True,
         "seconds": partitioned[0].seconds}
    ]  # fmt: skip


def test_the_leader_budget_is_partitioned_too_and_none_is_returned_where_no_budget_fits_whole():
    leader, records = budgets_over_on_the_blocks(leader_bytes=LIMIT - 50)  # within 100 bytes of the budget
    runner = partitioned_whole(p05=LIMIT + 20, p03=400)
    contender, partitioned = partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=100)
    assert runner.partitioned == [PT2_05.key(), PT2.key()]  # fastest first: each measured, none inferred
    assert contender is not None and contender.number == leader.number and contender.peak_bytes == 400
    assert [p.fits for p in partitioned] == [False, True]
    runner = partitioned_whole(p05=LIMIT + 20, p03=LIMIT + 1)  # the leader's own budget is over, compiled whole
    contender, partitioned = partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=100)
    assert contender is None and [p.fits for p in partitioned] == [False, False]


def test_a_leader_budget_with_room_for_the_code_outside_the_blocks_is_kept_without_a_partition():
    """The 32-layer GPT compiled whole: ``pt2_budget(0.3)`` 37% under budget on the blocks; its partition took 19.6 s."""
    leader, records = budgets_over_on_the_blocks()  # 500 bytes on the blocks: 100 outside them leave it far within
    runner = partitioned_whole(p05=LIMIT + 20, p03=LIMIT + 1)
    contender, partitioned = partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=100)
    assert runner.partitioned == [PT2_05.key()]  # the budget over on the blocks is still tried; the leader is not
    assert [p.fits for p in partitioned] == [False]
    assert contender is leader  # kept as the blocks judged it, not re-measured
    runner = partitioned_whole(p03=LIMIT + 1)
    records = [t for t in records if t.plan != PT2_05]
    assert partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=100) == (leader, ())
    assert runner.partitioned == []
    # Within the budget but without room for what the code outside the blocks saves: partitioned, and refused there.
    leader = replace(leader, peak_bytes=LIMIT - 99)
    records = [leader if t.number == leader.number else t for t in records]
    assert partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=100)[0] is None
    assert runner.partitioned == [PT2.key()]


def test_without_bytes_outside_the_blocks_only_the_leaders_budget_is_partitioned():
    leader, records = budgets_over_on_the_blocks()
    runner = partitioned_whole(p05=LIMIT - 50, p03=400)
    contender, _ = partition_pt2_budgets(records, ScriptedStudy(records), leader, runner, outside=0)
    assert runner.partitioned == [PT2.key()] and contender is not None and contender.number == leader.number


def test_a_plan_of_ours_leading_is_challenged_only_by_budgets_over_on_the_blocks_and_nothing_runs_without_one():
    _, records = budgets_over_on_the_blocks()
    ours = record(6, MIXED, "full h.0, selective(mlp) h.1", 0.009, peak_bytes=900, status=TrialStatus.OK)
    runner = partitioned_whole(p05=LIMIT - 50)
    contender, _ = partition_pt2_budgets([*records, ours], ScriptedStudy([*records, ours]), ours, runner, outside=100)
    assert contender is not None and contender.label == "baseline:pt2_budget_0.5"
    # 0.3 and 0.1 fit on the blocks and lost to the leader there: the search judged them; 0.7 is too far over.
    assert runner.partitioned == [PT2_05.key()]
    runner = partitioned_whole()
    assert partition_pt2_budgets([*records, ours], ScriptedStudy([*records, ours]), ours, runner, outside=10) == (
        None,
        (),
    )
    assert runner.partitioned == []  # 50 bytes over, 10 outside the blocks: no budget to partition, no cost


def test_the_largest_budgets_over_on_the_blocks_come_first_up_to_the_cap_then_the_leaders():
    """Not the fastest in the blocks' one pass: a larger budget recomputes less (this order held compiled whole)."""
    leader, records = budgets_over_on_the_blocks(leader_bytes=LIMIT - 50)
    extra = [record(10 + i, Plan(compile_memory_budget=b), f"pt2_budget({b})", 0.007, peak_bytes=LIMIT + 10,
                    status=TrialStatus.OVER_BUDGET) for i, b in enumerate((0.4, 0.6, 0.45))]  # fmt: skip
    order = sorted([*extra, records[3]], key=lambda t: -(t.plan.compile_memory_budget or 0))
    runner = ScriptedWhole({}, {}, whole={t.plan.key(): 2 * LIMIT for t in order} | {PT2.key(): 400},
                           seconds_default=0.01)  # fmt: skip
    contender, partitioned = partition_pt2_budgets(
        [*records, *extra], ScriptedStudy([*records, *extra]), leader, runner, outside=100
    )
    assert runner.partitioned == [t.plan.key() for t in order[:PARTITIONS]] + [PT2.key()]
    assert order[0].label == "pt2_budget(0.6)"
    assert contender is not None and contender.number == leader.number and len(partitioned) == PARTITIONS + 1


def test_a_leader_judged_elsewhere_is_not_measured_again_on_the_blocks():
    leader, rival, records = leader_and_rival()
    blocks = on_blocks(0.0100, 0.0104)
    kept, check = weigh_on_blocks(records, ScriptedStudy(records), leader, blocks, 0.08, leader_fits=False)
    assert kept is rival and check is not None and not check.leader_fits and check.ratio is None
    assert PT2.key() not in blocks.measured and blocks.retimed == []  # over budget whole: no rounds
    judged = replace(leader, peak_bytes=900)
    kept, check = weigh_on_blocks(
        records, ScriptedStudy(records), judged, on_blocks(0.0100, 0.0120), 0.08, leader_fits=True
    )
    assert kept is judged and check is not None and check.leader_fits  # kept with the memory it was judged by


def test_the_search_weighs_the_budget_that_fits_partitioned_whole_and_records_every_partition(monkeypatch):
    leader, rival, _ = leader_and_rival()
    contender = record(3, PT2_05, "baseline:pt2_budget_0.5", 0.008, status=TrialStatus.OK)
    tried = (Partitioned("baseline:pt2_budget_0.5", 1_050, 950, True, 4.0),)
    weighed = []

    def weigh(records, trials, best, runner, margin, leader_fits):
        weighed.append((best.label, leader_fits))
        return best, None

    monkeypatch.setattr(whole_check, "weigh_on_blocks", weigh)
    monkeypatch.setattr(whole_check, "compiles_of", lambda runner, profiled: {"graphs": 13, "seconds": 25.0})
    config = replace(CONFIG, check_whole_compile=False)
    for best, found, expected in (
        (rival, (contender, tried), [("baseline:pt2_budget_0.5", True)]),  # a plan of ours challenged and beaten
        (leader, (None, tried), [(leader.label, False)]),  # the budget chosen does not fit whole: ours must be kept
        (rival, (None, tried), []),  # no budget fits whole: the plan of ours stands, nothing weighed
    ):
        weighed.clear()
        monkeypatch.setattr(whole_check, "partition_pt2_budgets", lambda *a, found=found: found)
        search, metadata = SimpleNamespace(records=(), trials=None), _searched_metadata()
        after_choice = whole_check.pt2_budget_check(search, _runner(("",)), _harness(), config, metadata)
        kept = after_choice(best)
        assert weighed == expected and (kept is best if not expected else True)
        assert metadata["pt2_partitioned_whole"] == [tried[0].to_dict()]
        assert metadata["compiles"] == {"graphs": 13, "seconds": 25.0}  # the partitions counted


def test_the_bytes_outside_the_blocks_are_the_none_steps_less_every_blocks():
    rows = tuple(CompiledBlockMemory(b, {"none": 300, "full": 10}) for b in BLOCKS)
    model = CompiledMemoryModel(rows, {"transformer.h": BLOCKS}, none_activation_bytes=1_000)
    assert outside_blocks_bytes(model) == 400
    assert outside_blocks_bytes(replace(model, none_activation_bytes=None)) == 0  # not anchored: unknown
    assert outside_blocks_bytes(None) == 0


def test_the_margin_is_a_fraction():
    for bad in (-0.1, 1.0, "8%", True):
        with pytest.raises(Exception, match="whole_compile_margin must be in"):
            TuneConfig(whole_compile_margin=bad)


def test_a_model_compiled_block_by_block_gets_no_check():
    search = SimpleNamespace(records=(), trials=None)
    after_choice = whole_check.pt2_budget_check(search, _runner(BLOCKS), _harness(), CONFIG, _searched_metadata())
    assert after_choice is None


def compiled_gpt() -> tuple[GPT, torch.nn.Module, StepHarness]:
    """The 2-layer test GPT compiled whole, and the harness of its training step, from a fresh dynamo."""
    reset_compiled()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_head=2, n_embd=32, vocab_size=48, block_size=16, n_layer=2, dropout=0.0))
    x = torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model)
    harness = StepHarness(model, lambda: compiled(x, x), torch.device("cpu"), extra=(x,), batch_size=4, seq_len=16,
                          warmup_steps=1, measure_steps=2)  # fmt: skip
    return model, compiled, harness


class MeasuredStudy(ScriptedStudy):
    """A scripted study that judges by the real measurement: its status and saved bytes, no budget."""

    def judge(self, trial: TrialRecord, out: Measurement) -> TrialRecord:
        return replace(trial, status=TrialStatus(out.status), activation_bytes=out.activation_bytes)


@pytest.mark.slow
def test_the_check_compiles_both_plans_the_users_way_and_leaves_the_model_as_it_was():
    model, compiled, harness = compiled_gpt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    whole = CompiledTrials(harness, regions=("",), allow_graph_breaks=False)
    leader, rival, records = leader_and_rival()

    try:
        kept, check = check_whole_compile(records, MeasuredStudy(records), leader, whole)
    finally:
        release_kept_graphs()
    assert check is not None and check.leader_fits and check.rival_fits
    assert kept in (leader, rival) and check.kept == kept.label
    assert check.ratio is not None and check.rounds >= CONFIG.holdout_rounds
    assert check.compile_seconds > 0 and all(s > 0 for s in check.compile_seconds_each)
    # Nothing the check applied or compiled stays on the model: its parameters, and no instance forward.
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.slow
def test_weighing_on_the_blocks_runs_the_blocks_compiled_alone_and_compiles_nothing_the_users_way():
    model, compiled, harness = compiled_gpt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runner = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False, blocks=BLOCKS)
    assert runner is not None and runner.assembly is not None
    leader, rival, records = leader_and_rival()

    try:
        runner.measure(Plan(), None)  # the search's first trial: the blocks' reference
        kept, check = weigh_on_blocks(records, MeasuredStudy(records), leader, runner, 0.08)
        assert check is not None and check.leader_fits and check.rival_fits and not check.compiled_whole
        assert kept in records and check.kept == kept.label and check.rivals == (rival.label, "baseline:full")
        assert check.ratio is not None and check.rounds >= CONFIG.holdout_rounds
        # Three block graphs (the budget's, selective(mlp)'s, full's: the search had compiled none of them here),
        # each block compiled alone; none of the whole model.
        assert check.graphs == 3 and check.compile_seconds > 0
        graphs = runner.graphs
        weigh_on_blocks(records, MeasuredStudy(records), leader, runner, 0.08)
        assert runner.graphs == graphs  # again: the rounds swap graphs compiled already
    finally:
        release_kept_graphs()
        reset_compiled()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.slow
def test_a_budget_partitioned_whole_saves_what_the_users_compile_saves_and_leaves_nothing_behind():
    """The partition without kernels (``assembly.partition_only_backend``) against inductor's whole compile of the
    same budget: the bytes saved for backward are the same, and the blocks' own figure is not."""
    model, compiled, harness = compiled_gpt()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runner = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False, blocks=BLOCKS)
    assert runner is not None and runner.assembly is not None
    whole = CompiledTrials(harness, regions=("",), allow_graph_breaks=False)
    try:
        runner.measure(Plan(), None)
        on_blocks = runner.measure(PT2, None)
        graphs = runner.graphs
        partitioned = runner.measure_partitioned(PT2)
        assert runner.graphs > graphs and runner.compile_seconds > 0  # counted among the search's compiles
        assert partitioned.extra["partitioned"]["whole_bytes"] == partitioned.activation_bytes
        assert partitioned.median_seconds == on_blocks.median_seconds  # the time stays the blocks'
        assert (
            partitioned.peak_bytes - on_blocks.peak_bytes == partitioned.activation_bytes - on_blocks.activation_bytes
        )
        release_kept_graphs()
        reset_compiled()
        users_way = whole.measure(PT2, None)  # inductor, kernels and all
    finally:
        release_kept_graphs()
        reset_compiled()
    assert users_way.ok and partitioned.ok
    assert partitioned.activation_bytes == users_way.activation_bytes != on_blocks.activation_bytes
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in vars(m) or vars(m).get("_compiled_call_impl") is not None for m in model.modules())
