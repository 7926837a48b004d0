"""The time model: what a plan adds to a step from the blocks' own timings, its fit to measured steps, the file
form, and the profile's timings of a real block (every mode timed, model state untouched)."""

from __future__ import annotations

import pytest
import torch
from linear_clock import LinearClock

from lightning_ckpt import discover_blocks
from lightning_ckpt.memory.profile import profile_memory, profile_step
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.testing import GPT, GPTConfig
from lightning_ckpt.timing.model import BlockTime, TimeModel

FQNS = tuple(f"h.{i}" for i in range(4))
SECONDS = {"none": 1.0, "full": 1.5, "selective:mlp": 1.2, "selective:attn": 1.1, "ops:save_matmuls": 1.3}


def _model(calibrated: bool = False) -> TimeModel:
    rows = tuple(BlockTime(f, SECONDS, "h.0" if f != "h.0" else None) for f in FQNS)
    model = TimeModel(rows, {"h": FQNS})
    return model.calibrated([(Plan(), "none", 10.0)]) if calibrated else model


def test_a_plan_adds_what_each_block_mode_adds_and_a_segment_pays_full_for_its_checkpointed_chunks():
    model = _model()
    assert model.added_seconds(Plan()) == 0.0
    full = Plan({f: BlockPlan("full") for f in FQNS})
    assert model.added_seconds(full) == pytest.approx(4 * 0.5)
    mixed = Plan({"h.0": BlockPlan("full"), "h.1": BlockPlan("selective", ("mlp",)), "h.3": BlockPlan("offload")})
    assert model.added_seconds(mixed) is None, "a mode no block was timed under cannot be predicted"
    mixed = Plan({"h.0": BlockPlan("full"), "h.1": BlockPlan("selective", ("mlp",))})
    assert model.added_seconds(mixed) == pytest.approx(0.5 + 0.2)
    # Children timed one by one add up when their set was not timed together.
    both = Plan({"h.2": BlockPlan("selective", ("attn", "mlp"))})
    assert model.added_seconds(both) == pytest.approx(0.1 + 0.2)
    # Two segments over 4 blocks: the first chunk (2 blocks) is checkpointed, the last runs as usual.
    assert model.added_seconds(Plan(segments={"h": 2})) == pytest.approx(2 * 0.5)
    assert model.added_seconds(Plan(segments={"h": 5})) is None


def test_the_fit_puts_the_plain_step_under_the_measured_plans_and_one_slow_step_does_not_move_it():
    model = _model()
    assert model.predict_seconds(Plan()) is None, "no prediction before a step was measured"
    one = model.calibrated([(Plan(), "none", 10.0)])
    full = Plan({f: BlockPlan("full") for f in FQNS})
    assert one.predict_seconds(full) == pytest.approx(12.0)
    # Measured with full checkpointing only: the plain step is what its blocks' modes did not add.
    assert model.calibrated([(full, "full", 12.5)]).predict_seconds(Plan()) == pytest.approx(10.5)
    sel = Plan({f: BlockPlan("selective", ("mlp",)) for f in FQNS})
    three = model.calibrated([(Plan(), "a", 10.0), (full, "b", 12.0), (sel, "c", 20.0)])
    assert three.calibration.base_seconds == pytest.approx(10.0), "one step timed in a slow moment is outvoted"
    assert [a[0] for a in three.calibration.anchors] == ["a", "b", "c"]


def test_a_plain_step_fitted_below_zero_is_taken_as_its_blocks_own_seconds():
    # The blocks were timed in a busy moment (full adds 0.5 s each), the step in a quiet one: 1.2 s under full on
    # four blocks would put the plain step at -0.8 s and every prediction at the 1e-9 s clamp. The plain step runs
    # at least its blocks' own forward and backward (4 x 1.0 s).
    model = _model()
    full = Plan({f: BlockPlan("full") for f in FQNS})
    fitted = model.calibrated([(full, "full", 1.2)])
    assert fitted.calibration.base_seconds == pytest.approx(-0.8), "the fit is kept as measured"
    assert fitted.predict_seconds(Plan()) == pytest.approx(4.0) == model.plain_block_seconds()
    assert fitted.predict_seconds(full) == pytest.approx(6.0), "plans keep what their modes add"
    assert TimeModel.from_dict(fitted.to_dict()).predict_seconds(Plan()) == pytest.approx(4.0), "a file's fit too"
    assert model.calibrated([(full, "full", 3.0)]).predict_seconds(Plan()) == pytest.approx(1.0), "a positive fit stays"


def test_the_time_model_survives_its_file_form_with_shared_rows_written_once():
    model = _model(calibrated=True)
    data = model.to_dict()
    assert [("seconds" in r) for r in data["blocks"]] == [True, False, False, False]
    back = TimeModel.from_dict(data)
    assert back == model
    plan = Plan({"h.1": BlockPlan("ops", save_list="save_matmuls")})
    assert back.predict_seconds(plan) == pytest.approx(model.predict_seconds(plan))


def test_the_profile_times_a_real_block_under_every_mode_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=64, vocab_size=64, block_size=64, dropout=0.1))
    x = torch.randint(0, 64, (8, 64))
    rng = torch.get_rng_state()
    with LinearClock().installed():  # the machine's speed set (its load made the bound below fail now and then)
        profile = profile_step(model, lambda: model(x, x))
    memory = profile.memory
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    timing = profile.time
    assert timing is not None and len(timing.blocks) == 3
    rep = timing.blocks[0].seconds
    assert set(rep) == {*memory.blocks[0].profiles, "forward"}, "every mode the memory profile ran is timed"
    # And the forward alone, the window offloaded copies hide behind: on the Linear clock a backward takes no time,
    # so it is the whole ``none`` call, four Linear calls.
    assert rep["forward"] == pytest.approx(rep["none"]) == pytest.approx(4e-3)
    assert all(v > 0 for v in rep.values())
    # Full checkpointing runs the block's forward twice: it costs time.
    assert rep["full"] > rep["none"] * 1.05
    assert [b.shared_with for b in timing.blocks] == [None, "transformer.h.0", "transformer.h.0"]
    assert timing.stacks == {s.fqn: s.block_fqns for s in discover_blocks(model)}
    # Side by side: the memory model holds no timing, and a profile taken without timing has no time model.
    assert "timing" not in memory.to_dict() and TimeModel.from_dict(timing.to_dict()) == timing
    assert profile_step(model, lambda: model(x, x), time_blocks=False).time is None
    assert profile_memory(model, lambda: model(x, x)) == memory


def test_a_mode_timed_below_the_plain_block_adds_nothing_rather_than_making_the_step_faster():
    # Issue #64: a busy machine timed recomputing attention 1.35 s below the block without checkpointing, and every
    # plan recomputing it was predicted faster than the plain step. Recompute and offload copies only add time.
    seconds = {**SECONDS, "selective:attn": 0.4, "selective:mlp": 0.9, "offload": 0.95}
    rows = tuple(BlockTime(f, seconds) for f in FQNS)
    model = TimeModel(rows, {"h": FQNS}).calibrated([(Plan(), "none", 10.0)])
    for mode in (BlockPlan("selective", ("attn",)), BlockPlan("selective", ("attn", "mlp")), BlockPlan("offload")):
        plan = Plan({f: mode for f in FQNS})
        assert model.added_seconds(plan) == 0.0, mode
        assert model.predict_seconds(plan) == pytest.approx(10.0), mode
    assert model.predict_seconds(Plan({"h.0": BlockPlan("full")})) == pytest.approx(10.5)


@pytest.mark.parametrize(("layers", "per_mode"), [(2, 4), (12, 6)])
def test_the_profiles_timing_rounds_are_sized_by_the_blocks_share_of_the_step(layers, per_mode, monkeypatch):
    # On a machine where a Linear call takes the time (``LinearClock``), a block's forward is 4 Linear calls, 8 with
    # ``full``'s recompute: a warm-up round of the two modes is 12. Two blocks (a step of about 8 of the block's
    # ``none`` figure) pay for 4 x 2 x 4 / 12 = 2 rounds of ``TIMING_STEPS`` = 4 steps: the floor, 3 (and the
    # warm-up); before, every block got 5 timed rounds, more than a shallow fast model's step per round. Twelve
    # blocks pay for 16: the full 5.
    from lightning_ckpt.memory import block_times

    runs: list[str] = []
    time_once = block_times._time_once
    monkeypatch.setattr(block_times, "_time_once", lambda *a, **k: runs.append(a[3].mode) or time_once(*a, **k))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.0))
    x = torch.randint(0, 32, (2, 8))
    with LinearClock().installed():
        profile = profile_step(model, lambda: model(x, x), time_blocks={"none", "full"})
    assert profile.time is not None
    assert runs.count("none") == per_mode and runs.count("full") == per_mode


def test_a_sharded_blocks_timing_rounds_do_not_follow_this_ranks_clock(monkeypatch):
    # CI, stop 73: FSDP2 blocks gather their parameters from every rank at each call. One rank sized its rounds at
    # 3, the other at more, and rank 0 waited in the all-gather while rank 1 had moved on to the table's broadcast.
    # A sharded block runs the fixed rounds, where the same clock sizes an unsharded one at the floor (the test above).
    from lightning_ckpt.memory import block_times, profile

    runs: list[str] = []
    time_once = block_times._time_once
    monkeypatch.setattr(block_times, "_time_once", lambda *a, **k: runs.append(a[3].mode) or time_once(*a, **k))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.0))
    sharded = {id(b) for b in model.transformer.h}
    monkeypatch.setattr(profile, "is_sharded", lambda m: id(m) in sharded)
    x = torch.randint(0, 32, (2, 8))
    with LinearClock().installed():
        step = profile_step(model, lambda: model(x, x), time_blocks={"none", "full"})
    assert step.time is not None
    rounds = 1 + block_times.TIMING_ROUNDS
    assert runs.count("none") == rounds and runs.count("full") == rounds


def test_the_profile_times_its_tracked_anchor_step_on_the_profile_clock():
    # The search prices the chosen plan's memory pass from it (``Trials.memory_pass_seconds``). On the Linear clock
    # the anchor step (every block ``full``) is each block's 4 Linear calls twice (the recompute) and the head's once.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.0))
    x = torch.randint(0, 32, (2, 8))
    clock = LinearClock()
    with clock.installed():
        step = profile_step(model, lambda: model(x, x), time_blocks=False)
    assert step.tracked_step_seconds == pytest.approx((2 * 2 * 4 + 1) * clock.cost)
