"""Offload through one host pool (``lightning_ckpt.plan.offload``), on the lab's card: saved tensors leave the card's
memory for the pool and come back a block ahead, exactly; the pool is sized by the first step and reused; a step that
fails gives everything back. (The copy and fetch streams run on CUDA only; the stream-free path here is the same pool
and the same accounting.)"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from lightning_ckpt import BlockPlan, Plan, plan_applied
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.plan.offload import SMALLEST_OFFLOADED, OffloadPool
from lightning_ckpt.testing import GPT, GPTConfig, SimulatedCard

MIB = 2**20


def _gpt(dropout: float = 0.1) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=64, vocab_size=128, dropout=dropout))
    return model, torch.randint(0, 128, (8, 64))


def _offload(model: GPT) -> Plan:
    return uniform_plan(ModelView.of(model).stacks, BlockPlan("offload"))


def _pool(model: GPT) -> OffloadPool:
    pools = {
        id(p): p
        for m in model.modules()
        for p in getattr(getattr(m, "forward", None), "args", ())
        if isinstance(p, OffloadPool)
    }
    assert len(pools) == 1, "one pool per plan"
    return next(iter(pools.values()))


def _step(model: GPT, tokens: torch.Tensor, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model(tokens, tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_offloaded_gradients_equal_the_plain_ones_bit_for_bit_with_dropout() -> None:
    model, tokens = _gpt()
    plain = _step(model, tokens)
    with SimulatedCard(2**40, resident=(model,)), plan_applied(model, _offload(model)):
        offloaded = _step(model, tokens)
        again = _step(model, tokens)  # the pool reused: the second step is exact too
        pool = _pool(model)
    for name, grad in plain.items():
        assert torch.equal(grad, offloaded[name]) and torch.equal(grad, again[name]), name
    assert pool.stats().offloaded_tensors > 0, "the card's saved tensors went to the pool"


def test_the_card_counts_offloaded_tensors_apart_and_the_pool_is_sized_once() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=64, block_size=64, vocab_size=128, dropout=0.0))
    tokens = torch.randint(0, 128, (8, 64))
    peaks = {}
    for name, plan in (("none", Plan()), ("offload", _offload(model))):
        card = SimulatedCard(2**40, resident=(model,))
        with card, plan_applied(model, plan):
            _step(model, tokens)
            card.reset_peak()
            _step(model, tokens)
            peaks[name] = card.max_allocated() - card.allocated()
            if name == "offload":
                pool = _pool(model)
                stats = pool.stats()
                _step(model, tokens)
                assert pool.stats().chunks == stats.chunks and pool.capacity_bytes == stats.capacity_bytes, (
                    "no allocation after the first step"
                )
                assert pool._in_use == 0, "rewound once the step's tensors were dropped"
    saved = stats.peak_bytes
    assert saved > MIB and stats.capacity_bytes >= saved
    assert all(c & (c - 1) == 0 for c in (ch.numel() for ch in pool._chunks)), "chunks of a power of two"
    # What stays on the card is the block backward is in and the one fetched ahead of it (2 of 8): the step's memory
    # above rest falls by more than half; the pool holds at least what left.
    assert peaks["offload"] < peaks["none"] / 2 and saved >= peaks["none"] - peaks["offload"]
    assert stats.prefetched_tensors > 0, "each block's tensors were fetched before backward reached it"


@pytest.mark.parametrize("mode", ["offload", "offload_input"])
def test_a_step_that_fails_gives_the_pool_and_the_card_back(mode: str) -> None:
    model, tokens = _gpt(dropout=0.0)

    def fail(*_):
        raise torch.OutOfMemoryError("Tried to allocate 1.00 GiB (injected in the third block's forward)")

    card = SimulatedCard(2**40, resident=(model,))
    with card, plan_applied(model, uniform_plan(ModelView.of(model).stacks, BlockPlan(mode))):
        _step(model, tokens)
        pool = _pool(model)
        capacity, start = pool.capacity_bytes, card.allocated()
        hook = model.transformer.h[2].register_forward_pre_hook(fail)
        with pytest.raises(torch.OutOfMemoryError):
            model(tokens, tokens)
        hook.remove()
        gc.collect()  # what measure_step does after a failed step: the failed graph's frames are gone
        assert pool._in_use == 0 and not pool._groups and pool._live == 0, "abandoned: nothing packed is kept"
        assert card.allocated() == start, "the failed step's device tensors are gone"
        grads = _step(model, tokens)
        assert pool.capacity_bytes == capacity, "the next step reuses the pool; nothing leaked into it"
    plain = _step(model, tokens)
    assert all(torch.equal(g, plain[n]) for n, g in grads.items())


def test_small_tensors_and_parameters_stay_and_a_large_tensor_gets_a_chunk_of_its_own() -> None:
    pool = OffloadPool(chunk_bytes=MIB)
    weight = torch.nn.Parameter(torch.randn(512, 512))
    x = torch.randn(4, 512, requires_grad=True)
    big = torch.randn(3 * MIB // 4, requires_grad=True)  # 3 MiB of float32: a 4 MiB chunk
    with SimulatedCard(2**40), pool.offloading(torch.device("cpu")):
        y = (x @ weight).relu().sum() + (big * big).sum()
    assert x.nbytes < SMALLEST_OFFLOADED
    assert sorted(c.numel() for c in pool._chunks) == [4 * MIB], "only the large tensor left; one chunk, exact"
    y.backward()
    assert torch.equal(big.grad, 2 * big) and x.grad is not None
    with pytest.raises(ValueError, match="power of two"):
        OffloadPool(chunk_bytes=3 * MIB)


def test_an_offload_trial_reports_its_host_pool_and_gives_it_back() -> None:
    from lightning_ckpt.measure.harness import StepHarness
    from lightning_ckpt.search.runners import EagerRunner

    model, tokens = _gpt(dropout=0.0)
    plan = _offload(model)
    harness = StepHarness(model, lambda: model(tokens, tokens), torch.device("cpu"), warmup_steps=0, measure_steps=1)
    with SimulatedCard(2**40, resident=(model,)):
        m = EagerRunner(harness).measure(plan, None)
    assert m.ok and m.extra["offload_host_peak_bytes"] > MIB
    assert m.extra["offload_host_pool_bytes"] >= m.extra["offload_host_peak_bytes"]
    with plan_applied(model, plan) as handle:
        pool = handle.offload_pool
        _step(model, tokens)  # plain CPU: activations already live in host memory, nothing is copied
    assert pool.stats().offloaded_tensors == 0 and pool.capacity_bytes == 0


def test_the_memory_model_predicts_an_offload_plan_with_the_block_fetched_ahead() -> None:
    # The block-alone profile sees a block's own tensors come back; during its backward the previous offloaded
    # block's are back too (fetched ahead): without them, the all-offload plan was predicted 26% low.
    from lightning_ckpt.measure.step import StepSettings, measure_step
    from lightning_ckpt.memory.profile import profile_memory

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=64, block_size=64, vocab_size=128, dropout=0.0))
    tokens = torch.randint(0, 128, (8, 64))
    half = Plan({f"transformer.h.{i}": BlockPlan("offload") for i in range(4)})
    with SimulatedCard(2**40, resident=(model,)):
        memory = profile_memory(model, lambda: model(tokens, tokens))
        for plan in (_offload(model), half):
            with plan_applied(model, plan):
                measured = measure_step(
                    lambda: model(tokens, tokens).backward(), StepSettings(warmup=1, steps=1), model=model
                )
            assert abs(memory.predict_peak(plan) / measured.peak_bytes - 1) < 0.05, plan.describe()


def test_a_channels_last_tensor_comes_back_in_its_layout_and_the_convolutions_gradients_are_exact() -> None:
    # A contiguous copy (what save_on_cpu made) changed ConvNeXt's depthwise-convolution gradients in the zoo:
    # backward computes in the layout it is given.
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 7, padding=3, groups=64)
    x = torch.randn(4, 64, 32, 32).to(memory_format=torch.channels_last).requires_grad_()

    def grads(pool: OffloadPool | None) -> list[torch.Tensor]:
        conv.zero_grad(set_to_none=True)
        x.grad = None
        with pool.offloading(torch.device("cpu")) if pool is not None else contextlib.nullcontext():
            y = conv(x * 1.0)
        y.square().sum().backward()
        return [conv.weight.grad.clone(), conv.bias.grad.clone(), x.grad.clone()]

    plain = grads(None)
    pool = OffloadPool(chunk_bytes=MIB)
    with SimulatedCard(2**40):
        offloaded = grads(pool)
    assert pool.stats().offloaded_tensors >= 1
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))


def test_offload_input_keeps_only_each_blocks_input_in_the_pool_and_its_gradients_are_exact() -> None:
    # ``offload_input``: the block is checkpointed whole and the one input its checkpoint keeps goes to the pool.
    model, tokens = _gpt()
    plain = _step(model, tokens)
    plan = uniform_plan(ModelView.of(model).stacks, BlockPlan("offload_input"))
    held = {}
    for name, p in (("full", uniform_plan(ModelView.of(model).stacks, BlockPlan("full"))), ("offload_input", plan)):
        card = SimulatedCard(2**40, resident=(model,))
        with card, plan_applied(model, p) as handle:
            grads = [_step(model, tokens), _step(model, tokens)]
            start = card.allocated()
            loss = model(tokens, tokens)
            held[name] = card.allocated() - start
            loss.backward()
            model.zero_grad(set_to_none=True)
            pool = handle.offload_pool
        assert all(torch.equal(g[n], plain[n]) for g in grads for n in plain), name
    inputs = 4 * tokens.numel() * 64 * 4  # four blocks' float32 hidden states (8 x 64 x 64)
    assert pool.stats().peak_bytes == inputs, "the pool holds the blocks' inputs and nothing else"
    assert held["full"] - held["offload_input"] == inputs, "the card no longer holds them"


def test_every_offloaded_block_is_fetched_ahead_of_backward() -> None:
    # Backward reaching a block fetches the block before it; a block whose tensors had come ahead used to fetch
    # nothing, so only every other block was fetched ahead (and the rest waited on the link).
    model, tokens = _gpt(dropout=0.0)
    with SimulatedCard(2**40, resident=(model,)), plan_applied(model, _offload(model)) as handle:
        _step(model, tokens)
        stats = handle.offload_pool.stats()
    per_block = stats.offloaded_tensors // 4
    assert stats.prefetched_tensors == stats.offloaded_tensors - per_block, "all but the last block came ahead"


def test_the_memory_model_predicts_offload_input_and_mixed_plans_and_the_host_memory_they_pin() -> None:
    from lightning_ckpt.measure.step import StepSettings, measure_step
    from lightning_ckpt.memory.profile import profile_memory

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=2, n_embd=64, block_size=64, vocab_size=128, dropout=0.0))
    tokens = torch.randint(0, 128, (8, 64))
    stacks = ModelView.of(model).stacks
    mixed = Plan({f"transformer.h.{i}": BlockPlan("offload" if i % 2 else "offload_input") for i in range(8)})
    with SimulatedCard(2**40, resident=(model,)):
        memory = profile_memory(model, lambda: model(tokens, tokens))
        for plan in (uniform_plan(stacks, BlockPlan("offload_input")), mixed, _offload(model)):
            with plan_applied(model, plan) as handle:
                measured = measure_step(
                    lambda: model(tokens, tokens).backward(), StepSettings(warmup=1, steps=1), model=model
                )
                pinned = handle.offload_pool.stats().peak_bytes
            assert abs(memory.predict_peak(plan) / measured.peak_bytes - 1) < 0.05, plan.describe()
            # What leaves the card; the pool can hold a little more (a storage saved twice is copied twice).
            assert memory.host_bytes(plan) <= pinned <= 1.2 * memory.host_bytes(plan), plan.describe()
    assert memory.host_bytes(uniform_plan(stacks, BlockPlan("offload_input"))) == 8 * tokens.numel() * 64 * 4
    assert memory.host_bytes(uniform_plan(stacks, BlockPlan("full"))) == 0


def _timed(link: float | None, *, n: int = 4, moved: float = 1e9):
    """A time model of ``n`` blocks of 0.1 s forward and 0.1 s backward (recompute 0.075 s), each offloaded block
    moving ``moved`` bytes (``offload``) or a hundredth of it (``offload_input``) over a link of ``link`` bytes/s;
    timed alone, ``offload`` added a whole second (the copies, unhidden)."""
    from lightning_ckpt.timing.model import BlockTime, Calibration, TimeModel

    seconds = {"none": 0.2, "forward": 0.1, "full": 0.275, "offload": 1.2, "offload_input": 1.2}
    fqns = tuple(f"transformer.h.{i}" for i in range(n))
    rows = tuple(BlockTime(f, seconds, None, {"offload": int(moved), "offload_input": int(moved / 100)}) for f in fqns)
    at = {"link": {"to_host": link, "to_device": link}} if link is not None else {}
    return TimeModel(rows, {"transformer.h": fqns}, at, Calibration(1.0))


def test_the_time_model_predicts_the_transfer_compute_hides_and_the_part_it_exposes() -> None:
    from lightning_ckpt.timing.model import TimeModel

    fqns = [f"transformer.h.{i}" for i in range(4)]
    offload = Plan(dict.fromkeys(fqns, BlockPlan("offload")))
    # 0.1 s each way per block: every copy out hides behind the next block's forward but the last one's, which
    # backward waits for, then for its copy back (0.2 s); each earlier block comes back during the later one's
    # backward. Less than the 4 x 0.075 s of recompute that checkpointing them would cost.
    fast = _timed(1e10).transfer(offload)
    assert fast.exposed_seconds == pytest.approx(0.2) and fast.recompute_seconds == pytest.approx(0.3)
    assert fast.bytes == 4 * 10**9 and fast.link_seconds == pytest.approx(0.8)
    assert _timed(1e10).predict_seconds(offload) == pytest.approx(1.2), "the plain step and what backward waits"
    # At 0.2 s a copy the copies out queue (done at 0.9 s, forward ends at 0.4 s): backward waits 0.7 s for the last
    # block, then 0.1 s for each earlier one, whose copy back (0.2 s) outlasts the later block's backward (0.1 s).
    assert _timed(5e9).transfer(offload).exposed_seconds == pytest.approx(0.7 + 3 * 0.1)
    assert _timed(1e18).transfer(offload).exposed_seconds == pytest.approx(0.0, abs=1e-6)
    # offload_input recomputes as full does, and moves its input (0.001 s a copy, the last one's exposed).
    inputs = Plan(dict.fromkeys(fqns, BlockPlan("offload_input")))
    assert _timed(1e10).predict_seconds(inputs) == pytest.approx(1.0 + 4 * 0.075 + 0.002)
    # Mixed with other modes: the last offloaded block (2) comes back when backward reaches it (0.1 s), block 1's
    # backward (full, with its recompute) hides block 0's copy back.
    half = Plan({fqns[0]: BlockPlan("offload"), fqns[1]: BlockPlan("full"), fqns[2]: BlockPlan("offload")})
    assert _timed(1e10).added_seconds(half) == pytest.approx(0.075 + 0.1)
    # Without a measured link (a CPU, an older plan file): what the blocks added timed alone, as before.
    assert _timed(None).transfer(offload) is None
    assert _timed(None).added_seconds(offload) == pytest.approx(4 * 1.0)
    again = TimeModel.from_dict(_timed(1e10).to_dict())
    assert again.transfer(offload) == fast, "the plan file keeps the bytes each block moves and the link"
