"""The memory model: predictions against the live-tensor tracker, memory safety, the breakdown, errors."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch
from torch import nn

from lightning_ckpt import BlockPlan, Plan, applied_plan, apply_plan, baselines, plan_applied
from lightning_ckpt.errors import ApplyError, ConfigurationError, PlanError, StalePlanError
from lightning_ckpt.measure.step import StepSettings, measure_step, track_step_memory
from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.memory.model import MemoryModel
from lightning_ckpt.memory.profile import profile_memory
from lightning_ckpt.plan.format import mode_key
from lightning_ckpt.testing import GPT, GPTConfig

# The issue asks for 10% on every baseline; the model is exact up to known effects in apply.py
# (see benchmarks/memory_model.py), so a tighter bound catches a regression before it matters.
TOLERANCE = 0.05


def measured(model: nn.Module, forward, plan: Plan, extra: tuple) -> tuple[int, int]:
    with plan_applied(model, plan, check_fingerprint=False):
        reading = track_step_memory(lambda: forward().backward(), model=model, extra=extra)
    model.zero_grad(set_to_none=True)
    return reading.peak_bytes, reading.activation_bytes


def assert_close(model: nn.Module, forward, mm: MemoryModel, plan: Plan, extra: tuple, tol: float = TOLERANCE) -> None:
    peak, act = measured(model, forward, plan, extra)
    pred = mm.predict(plan)
    assert pred.peak_bytes == pytest.approx(peak, rel=tol), f"{plan.describe()}: peak {pred.peak_bytes} vs {peak}"
    assert pred.activation_bytes == pytest.approx(act, rel=tol), (
        f"{plan.describe()}: act {pred.activation_bytes} vs {act}"
    )


@pytest.fixture
def gpt_case() -> tuple[GPT, object, tuple]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_head=2, n_embd=32, vocab_size=96, block_size=32, dropout=0.1))
    x = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    return model, (lambda: model(x, x)), (x,)


@pytest.fixture
def gpt_model(gpt_case: tuple) -> tuple[GPT, object, tuple, MemoryModel]:
    model, forward, extra = gpt_case
    return model, forward, extra, profile_memory(model, forward, extra=extra)


def test_gpt_baselines_within_tolerance(gpt_model: tuple) -> None:
    model, forward, extra, mm = gpt_model
    plans = baselines(model)
    assert {"none", "full", "sqrt_segments", "selective_mlp", "ops_save_matmuls", "offload"} <= set(plans)
    for plan in plans.values():
        assert_close(model, forward, mm, plan, extra)


def test_gpt_mixed_plans_within_tolerance(gpt_model: tuple) -> None:
    """Plans no baseline covers: a different mode per block, child sets profiled only one by one."""
    model, forward, extra, mm = gpt_model
    fqns = [b.fqn for b in mm.blocks]
    modes = [
        BlockPlan("none"), BlockPlan("full"), BlockPlan("offload"),
        BlockPlan("ops", save_list="save_attention"), BlockPlan("ops", save_list="save_matmuls_alternate"),
        BlockPlan("selective", ("mlp",)), BlockPlan("selective", ("attn", "mlp")), BlockPlan("selective", ("ln_1", "mlp")),
    ]  # fmt: skip
    rng = random.Random(0)
    for _ in range(4):
        assert_close(model, forward, mm, Plan({f: rng.choice(modes) for f in fqns}), extra)
    assert_close(model, forward, mm, Plan(segments={"transformer.h": 3}), extra)


@pytest.fixture
def llama_case() -> tuple[nn.Module, object, tuple]:
    pytest.importorskip("transformers")
    from lightning_ckpt.testing.hf import lm_batch, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(layers=4, hidden=64, vocab=128).train()
    batch = lm_batch(vocab=128, batch=2, seq=32)
    return model, (lambda: model(**batch, use_cache=False).loss), tuple(batch.values())


def test_hf_llama_baselines_within_tolerance(llama_case: tuple) -> None:
    model, forward, extra = llama_case
    mm = profile_memory(model, forward, extra=extra)
    assert [b.fqn for b in mm.blocks] == [f"model.layers.{i}" for i in range(4)]
    for plan in baselines(model).values():
        assert_close(model, forward, mm, plan, extra)


def test_hf_vit_baselines_within_tolerance() -> None:
    pytest.importorskip("transformers")
    from lightning_ckpt.testing.hf import image_batch, tiny_vit

    torch.manual_seed(0)
    model = tiny_vit(layers=4, hidden=32).train()
    batch = image_batch(batch=4)
    extra = tuple(batch.values())

    def forward() -> torch.Tensor:
        return model(**batch).loss

    mm = profile_memory(model, forward, extra=extra)
    for plan in baselines(model).values():
        assert_close(model, forward, mm, plan, extra)


def test_profile_is_memory_safe(gpt_case: tuple) -> None:
    """Profiling never holds what the no-checkpointing step holds: its peak stays near full checkpointing's."""
    model, forward, extra = gpt_case
    none_peak, _ = measured(model, forward, Plan(), extra)
    full_peak, _ = measured(model, forward, baselines(model)["full"], extra)
    outer = new_live_tracker("cpu")
    outer.track_external(model, *extra)
    with outer:
        profile_memory(model, forward, extra=extra)
    # The profile's own bookkeeping (captured block inputs) comes on top of the full-checkpointing step.
    assert outer.total_peak < full_peak + 0.25 * (none_peak - full_peak)


def test_profile_leaves_the_model_untouched(gpt_case: tuple) -> None:
    model, forward, extra = gpt_case
    forward().backward()  # gradients exist, as in gradient accumulation
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    profile_memory(model, forward, extra=extra)
    assert applied_plan(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_with_existing_grads_predicts_a_step_with_existing_grads(gpt_case: tuple) -> None:
    model, forward, extra = gpt_case
    forward().backward()
    mm = profile_memory(model, forward, extra=extra)
    for name in ("none", "full"):
        plan = baselines(model)[name]
        with plan_applied(model, plan):
            m = measure_step(lambda: forward().backward(), StepSettings(warmup=0, steps=1), model=model, extra=extra)
        assert mm.predict_peak(plan) == pytest.approx(m.peak_bytes, rel=TOLERANCE)
        assert mm.predict_activation(plan) == pytest.approx(m.activation_bytes, rel=TOLERANCE)


def test_breakdown_table_and_serialisation(gpt_model: tuple) -> None:
    model, _, _, mm = gpt_model
    assert mm.fixed_bytes == mm.parameter_bytes + mm.gradient_bytes + mm.optimizer_state_bytes + mm.buffer_bytes
    assert mm.parameter_bytes == sum(p.numel() * 4 for p in model.parameters())  # tied weights counted once
    assert mm.other_activation_bytes > 0
    row = mm.blocks[0]
    assert row.saved_bytes["full"] < row.saved_bytes["ops:save_matmuls"] < row.saved_bytes["none"]
    assert row.saved_bytes["selective:mlp"] < row.saved_bytes["none"]
    assert row.saved_bytes["offload"] == row.saved_bytes["none"]  # offloading is a no-op on CPU
    assert row.recompute_transient_bytes > 0
    assert all(b.shared_with == "transformer.h.0" for b in mm.blocks[1:])
    text = mm.table(baselines(model)["full"])
    assert all(b.fqn in text for b in mm.blocks) and "sel:mlp" in text and "predicted peak" in text
    data = json.loads(json.dumps(mm.to_dict()))
    again = MemoryModel.from_dict(data)
    for plan in baselines(model).values():
        assert again.predict(plan) == mm.predict(plan)
    saved = mm.saved_bytes(baselines(model)["sqrt_segments"])
    assert saved["transformer.h.1"] == 0 and saved["transformer.h.0"] == row.saved_bytes["full"]


def test_identical_blocks_share_one_profile(gpt_case: tuple) -> None:
    model, forward, extra = gpt_case
    shared = profile_memory(model, forward, extra=extra)
    separate = profile_memory(model, forward, extra=extra, share_identical_blocks=False)
    assert all(b.shared_with is None for b in separate.blocks)
    for plan in baselines(model).values():
        assert shared.predict(plan) == separate.predict(plan)


def test_mode_keys() -> None:
    assert mode_key(BlockPlan("full")) == "full"
    assert mode_key(BlockPlan("ops", save_list="save_matmuls")) == "ops:save_matmuls"
    assert mode_key(BlockPlan("selective", ("mlp", "attn"))) == "selective:attn,mlp"


def test_errors_name_the_problem(gpt_model: tuple) -> None:
    model, forward, extra, mm = gpt_model
    with pytest.raises(PlanError, match="no profile for block 'transformer.h.60'"):
        mm.predict(Plan({"transformer.h.60": BlockPlan("full")}))
    with pytest.raises(PlanError, match="no profiled stack"):
        mm.predict(Plan(segments={"transformer.blocks": 2}))
    with pytest.raises(PlanError, match="only 6 blocks"):
        mm.predict(Plan(segments={"transformer.h": 7}))
    with pytest.raises(PlanError, match="no profile of block 'transformer.h.0' under 'selective:nope'"):
        mm.predict(Plan({"transformer.h.0": BlockPlan("selective", ("nope",))}))
    with pytest.raises(StalePlanError, match="fingerprint"):
        mm.predict(Plan({"transformer.h.0": BlockPlan("full")}, fingerprint="0123456789abcdef"))
    with plan_applied(model, baselines(model)["full"]), pytest.raises(ApplyError, match="handle.remove"):
        profile_memory(model, forward, extra=extra)
    with pytest.raises(ConfigurationError, match="must return the loss"):
        profile_memory(model, lambda: model(extra[0]), extra=extra)  # logits, not a loss
    assert applied_plan(model) is None


def test_forward_fn_may_return_a_dict_or_an_output_object(gpt_case: tuple) -> None:
    model, forward, extra = gpt_case

    class Output:
        def __init__(self, loss: torch.Tensor) -> None:
            self.loss = loss

    a = profile_memory(model, lambda: {"loss": forward()}, extra=extra)
    b = profile_memory(model, lambda: Output(forward()), extra=extra)
    full = baselines(model)["full"]
    assert a.predict(full) == b.predict(full)


def test_profile_with_kv_cache_does_not_grow_the_cache(llama_case: tuple) -> None:
    """With use_cache=True the captured cache must not be appended to by the per-block runs."""
    model, _, extra = llama_case
    ids = extra[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = profile_memory(model, lambda: model(input_ids=ids, labels=ids, use_cache=True).loss, extra=extra)
        with_cache = mm.predict(Plan())
        no_cache = profile_memory(model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss, extra=extra)
    assert with_cache.peak_bytes == pytest.approx(no_cache.predict(Plan()).peak_bytes, rel=0.02)


@pytest.mark.gpu
def test_cuda_prediction_matches_max_memory_allocated() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_head=4, n_embd=256, vocab_size=1024, block_size=256)).cuda()
    x = torch.randint(0, 1024, (8, 256), device="cuda")
    mm = profile_memory(model, lambda: model(x, x), extra=(x,))
    for name, plan in baselines(model).items():
        handle = apply_plan(model, plan)
        try:
            m = measure_step(lambda: model(x, x).backward(), StepSettings(warmup=1, steps=1), model=model)
        finally:
            handle.remove()
        assert m.ok, name
        assert mm.predict_peak(plan) == pytest.approx(m.peak_bytes, rel=0.10), name


# -- mixed precision, HF defaults, encoder-decoders (issue: the budget must hold on the real run) ------
def _autocast(forward):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward()

    return run


def _bf16_cases():
    from lightning_ckpt.testing.hf import image_batch, lm_batch, tiny_llama, tiny_vit

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=96, block_size=64, dropout=0.1))
    x = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1))
    yield "nanogpt", gpt, (lambda: gpt(x, x)), (x,)
    llama = tiny_llama(layers=3, hidden=64, vocab=128).train()
    batch = lm_batch(vocab=128, batch=2, seq=32)
    yield "llama", llama, (lambda: llama(**batch, use_cache=False).loss), tuple(batch.values())
    vit = tiny_vit(layers=3, hidden=64, image_size=32, patch=8).train()
    images = image_batch(batch=4, image_size=32)
    yield "vit", vit, (lambda: vit(**images).loss), tuple(images.values())


@pytest.mark.parametrize("case", ["nanogpt", "llama", "vit"])
def test_every_baseline_within_tolerance_under_bf16_autocast(case: str) -> None:
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        name, model, forward, extra = next(c for c in _bf16_cases() if c[0] == case)
        forward = _autocast(forward)
        mm = profile_memory(model, forward, extra=extra)
        for plan in baselines(model, memory_model=mm).values():
            assert_close(model, forward, mm, plan, extra)


def test_hf_gpt2_default_config_keeps_no_kv_cache_while_tuning() -> None:
    pytest.importorskip("transformers")
    from lightning_ckpt.plan.caches import kv_cache_disabled
    from lightning_ckpt.testing.hf import lm_batch, tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2(layers=3, hidden=64, vocab=128).train()
    assert model.config.use_cache, "users leave HF's default on"
    batch = lm_batch(vocab=128, batch=2, seq=32)
    forward, extra = (lambda: model(**batch).loss), tuple(batch.values())
    with warnings.catch_warnings(), kv_cache_disabled(model):
        warnings.simplefilter("ignore")
        assert not model.config.use_cache
        mm = profile_memory(model, forward, extra=extra)
        for plan in baselines(model, memory_model=mm).values():
            assert_close(model, forward, mm, plan, extra)
    assert model.config.use_cache, "the user's setting comes back"


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = T5ForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, 128, (2, 32), generator=g),
        "labels": torch.randint(1, 128, (2, 16), generator=g),
    }
    return model, (lambda: model(**batch).loss), tuple(batch.values())


def test_t5_selective_children_segments_refused_and_predictions_within_tolerance() -> None:
    pytest.importorskip("transformers")
    from lightning_ckpt import discover_blocks

    model, forward, extra = _t5()
    stacks = {s.fqn: s for s in discover_blocks(model)}
    assert set(stacks) == {"encoder.block", "decoder.block"}
    assert stacks["decoder.block"].blocks[0].children_of_kind("mlp") == ("layer.2",), "found inside the ModuleList"
    assert stacks["decoder.block"].blocks[0].children_of_kind("attention") == ("layer.0", "layer.1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = profile_memory(model, forward, extra=extra)
        assert set(mm.unchained_stacks) == {"encoder.block", "decoder.block"}, "block 0's position bias is shared"
        plans = baselines(model, memory_model=mm)
        assert "sqrt_segments" in baselines(model) and "sqrt_segments" not in plans
        assert "selective_mlp" in plans
        for precision in ("fp32", "bf16"):
            fwd = forward if precision == "fp32" else _autocast(forward)
            mm = profile_memory(model, fwd, extra=extra)
            for plan in plans.values():
                assert_close(model, fwd, mm, plan, extra)
    with pytest.raises(PlanError, match="do not run as a chain"):
        mm.predict(baselines(model)["sqrt_segments"])


def test_blocks_replayed_alone_keep_the_steps_autocast_cache_setting() -> None:
    # Lightning's mixed precision runs autocast with cache_enabled=False; a block replayed with the cache on
    # would hold low-precision weight copies the real step never holds.
    from lightning_ckpt.memory.capture import _autocast_state, autocast_as

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        state = _autocast_state()
    assert state == (("cpu", torch.bfloat16, False),)
    with autocast_as(state):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
