"""measure_step: timing logic on a fake clock, OOM/error capture, and leaving no trace in training state."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt import BlockPlan, Plan, plan_applied
from lightning_ckpt.errors import ApplyError, ConfigurationError, PlanError
from lightning_ckpt.measure.measurement import Measurement, median_and_spread
from lightning_ckpt.measure.snapshot import StateSnapshot
from lightning_ckpt.measure.step import StepSettings, measure_step, track_step_memory
from lightning_ckpt.testing import GPT


class FakeClock:
    """A clock that only moves when a step says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


def timed_steps(clock: FakeClock, durations: list[float]) -> Callable[[], None]:
    it = iter(durations)

    def step() -> None:
        clock.now += next(it)

    return step


def test_warmup_is_excluded_and_median_taken() -> None:
    clock = FakeClock()
    model = nn.Linear(2, 2)
    # Two warm-up steps that are slow (compile, allocator warm-up), then three timed steps.
    step = timed_steps(clock, [100.0, 50.0, 0.3, 0.1, 0.2])
    m = measure_step(
        step, StepSettings(warmup=2, steps=3, track_memory=False, clock=clock), model=model, batch_size=8, seq_len=16
    )
    assert m.status == "ok"
    assert m.warmup_steps == 2
    assert m.step_seconds == pytest.approx((0.3, 0.1, 0.2))
    assert m.median_seconds == pytest.approx(0.2)
    assert m.spread_seconds == pytest.approx(0.1)  # MAD of (0.3, 0.1, 0.2) around 0.2
    assert m.samples_per_second == pytest.approx(8 / 0.2)
    assert m.tokens_per_second == pytest.approx(8 * 16 / 0.2)
    assert clock.calls == 6  # two clock reads per timed step, none for warm-up


def test_median_is_robust_to_one_slow_step() -> None:
    clock = FakeClock()
    step = timed_steps(clock, [1.0, 1.0, 9.0, 1.0, 1.0])
    m = measure_step(step, StepSettings(warmup=0, steps=5, track_memory=False, clock=clock), model=nn.Linear(2, 2))
    assert m.median_seconds == pytest.approx(1.0)
    assert m.spread_seconds == pytest.approx(0.0)
    assert m.samples_per_second is None and m.tokens_per_second is None


def test_adaptive_steps_stop_when_spread_is_small() -> None:
    clock = FakeClock()
    # Noisy at first, then stable: timing continues until MAD/median <= 5%.
    step = timed_steps(clock, [1.0, 2.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0] + [2.0] * 20)
    m = measure_step(
        step,
        StepSettings(warmup=0, steps=3, track_memory=False, max_steps=20, target_rel_spread=0.05, clock=clock),
        model=nn.Linear(2, 2),
    )
    assert 3 < len(m.step_seconds) < 20
    med, spread = median_and_spread(m.step_seconds)
    assert spread / med <= 0.05
    assert m.relative_spread == pytest.approx(spread / med)


def test_adaptive_steps_respect_max_steps() -> None:
    clock = FakeClock()
    step = timed_steps(clock, [1.0, 2.0, 3.0] * 10)  # MAD/median stays >= 1/3
    m = measure_step(
        step,
        StepSettings(warmup=0, steps=2, track_memory=False, max_steps=6, target_rel_spread=0.01, clock=clock),
        model=nn.Linear(2, 2),
    )
    assert len(m.step_seconds) == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps >= 1"),
        ({"warmup": -1}, "warmup >= 0"),
        ({"steps": 3, "max_steps": 2}, "max_steps >= steps"),
        ({"seq_len": 16}, "batch_size together with seq_len"),
        ({"target_rel_spread": 0.0}, "target_rel_spread > 0"),
        ({"memory_limit_bytes": 0}, "memory_limit_bytes >= 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        shape = {k: kwargs.pop(k) for k in ("batch_size", "seq_len") if k in kwargs}
        measure_step(lambda: None, StepSettings(**kwargs), model=nn.Linear(2, 2), **shape)


def test_measurement_refuses_unknown_status() -> None:
    with pytest.raises(ConfigurationError, match="status"):
        Measurement("fine")


# ---------------------------------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make_error",
    [
        lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        lambda: RuntimeError(
            "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"
        ),  # fmt: skip
    ],
    ids=["cuda_oom", "cpu_allocator"],
)
@pytest.mark.parametrize("fail_on", [1, 3])
def test_oom_on_nth_step_is_captured_and_frees_the_step(
    gpt: GPT, tokens: torch.Tensor, make_error, fail_on: int
) -> None:
    alive: list[weakref.ref] = []
    calls = [0]

    def record(_module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        alive.append(weakref.ref(out))

    handles = [b.register_forward_hook(record) for b in gpt.transformer.h]

    def step() -> None:
        calls[0] += 1
        loss = gpt(tokens, tokens)
        if calls[0] == fail_on:
            # Fail mid-step with the whole autograd graph (every block's activations) still alive.
            raise make_error()
        loss.backward()

    try:
        m = measure_step(step, StepSettings(warmup=1, steps=3, track_memory=False), model=gpt)
    finally:
        for h in handles:
            h.remove()
    assert m.status == "oom"
    assert m.error is not None and ("out of memory" in m.error or "can't allocate memory" in m.error)
    assert m.step_seconds == () and m.median_seconds is None and m.peak_bytes is None
    assert alive, "the hooks should have seen the step's activations"
    assert all(ref() is None for ref in alive), "tensors of the failed step are still alive"
    assert all(p.grad is None for p in gpt.parameters())


def test_plain_runtime_error_is_reported_not_treated_as_oom(gpt: GPT) -> None:
    def step() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")

    m = measure_step(step, model=gpt)
    assert m.status == "error"
    assert m.error == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("torch.utils.checkpoint: Recomputed values for the following tensors have different metadata"),
        PlanError("Block 'h.9' does not exist"),
        ApplyError("segments on stack 'h' are unsafe for this model"),
    ],
    ids=["checkpoint", "plan", "apply"],
)
def test_invalid_plan_errors_are_reported_as_invalid(gpt: GPT, error: Exception) -> None:
    def step() -> None:
        raise error

    m = measure_step(step, model=gpt)
    assert m.status == "invalid"
    assert m.error is not None and type(error).__name__ in m.error and str(error) in m.error


def test_keyboard_interrupt_propagates_after_restoring_state(gpt: GPT, tokens: torch.Tensor) -> None:
    calls = [0]

    def step() -> None:
        calls[0] += 1
        gpt(tokens, tokens).backward()
        if calls[0] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_step(step, StepSettings(track_memory=False), model=gpt)
    assert all(p.grad is None for p in gpt.parameters())


def test_budget_on_cpu_is_enforced_from_the_tracked_peak(gpt: GPT, tokens: torch.Tensor) -> None:
    def step() -> None:
        gpt(tokens, tokens).backward()

    ran = measure_step(step, StepSettings(warmup=0, steps=1), model=gpt, extra=(tokens,))
    assert ran.ok and ran.peak_bytes is not None
    over = measure_step(
        step, StepSettings(warmup=0, steps=1, memory_limit_bytes=ran.peak_bytes - 1), model=gpt, extra=(tokens,)
    )
    # A step that completes above the limit is a measured verdict, not an OOM: over_budget, with its figures.
    assert over.status == "over_budget" and "memory_limit_bytes" in (over.error or "")
    assert over.peak_bytes == ran.peak_bytes and over.activation_bytes == ran.activation_bytes
    fits = measure_step(
        step, StepSettings(warmup=0, steps=1, memory_limit_bytes=ran.peak_bytes), model=gpt, extra=(tokens,)
    )
    assert fits.ok


def test_optimizer_step_inside_step_fn_is_refused(gpt: GPT, tokens: torch.Tensor) -> None:
    opt = torch.optim.SGD(gpt.parameters(), lr=0.1)

    def step() -> None:
        gpt(tokens, tokens).backward()
        opt.step()

    with pytest.raises(ConfigurationError, match="optimizer.step"):
        measure_step(step, StepSettings(warmup=0, steps=1, track_memory=False), model=gpt)


# ---------------------------------------------------------------------------------------------------
# Memory and FLOPs
# ---------------------------------------------------------------------------------------------------
def test_cpu_memory_matches_the_tracker_and_full_checkpointing_saves(gpt: GPT, tokens: torch.Tensor) -> None:
    def step() -> None:
        gpt(tokens, tokens).backward()

    none = measure_step(step, StepSettings(warmup=0, steps=1), model=gpt, extra=(tokens,))
    reading = track_step_memory(step, model=gpt, extra=(tokens,))
    gpt.zero_grad(set_to_none=True)
    assert (none.peak_bytes, none.activation_bytes, none.resting_bytes) == (
        reading.peak_bytes, reading.activation_bytes, reading.resting_bytes,
    )  # fmt: skip
    full_plan = Plan({f"transformer.h.{i}": BlockPlan("full") for i in range(4)})
    with plan_applied(gpt, full_plan):
        full = measure_step(step, StepSettings(warmup=0, steps=1), model=gpt, extra=(tokens,))
    assert full.activation_bytes < none.activation_bytes
    assert full.resting_bytes == none.resting_bytes


def test_recompute_flops_are_exactly_the_extra_flops(gpt: GPT, tokens: torch.Tensor) -> None:
    def step() -> None:
        gpt(tokens, tokens).backward()

    none = measure_step(step, StepSettings(warmup=0, steps=1, track_memory=False, count_flops=True), model=gpt)
    assert none.recompute_flops == 0 and none.step_flops and none.step_flops > 0
    full_plan = Plan({f"transformer.h.{i}": BlockPlan("full") for i in range(4)})
    with plan_applied(gpt, full_plan):
        full = measure_step(step, StepSettings(warmup=0, steps=1, track_memory=False, count_flops=True), model=gpt)
    assert full.recompute_flops and full.recompute_flops > 0
    # Full checkpointing adds exactly one forward of every block, and the counter sees exactly that.
    assert full.step_flops - none.step_flops == full.recompute_flops
    half = Plan({f"transformer.h.{i}": BlockPlan("full") for i in range(2)})
    with plan_applied(gpt, half):
        m = measure_step(step, StepSettings(warmup=0, steps=1, track_memory=False, count_flops=True), model=gpt)
    assert m.recompute_flops * 2 == full.recompute_flops


# ---------------------------------------------------------------------------------------------------
# Leaving no trace
# ---------------------------------------------------------------------------------------------------
class BNNet(nn.Module):
    """Dropout consumes the RNG, BatchNorm updates buffers: everything a measurement could disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 1)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))).pow(2).mean() + self.frozen(x).sum() * 0


def _state(model: nn.Module) -> dict[str, object]:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "grads": {k: (None if v.grad is None else v.grad.clone()) for k, v in model.named_parameters()},
        "grad_ids": {k: id(v.grad) for k, v in model.named_parameters()},
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "np_rng": np.random.get_state()[1].copy(),
    }


def _assert_same(before: dict, after: dict) -> None:
    for kind in ("params", "buffers"):
        assert before[kind].keys() == after[kind].keys()
        for k in before[kind]:
            assert torch.equal(before[kind][k], after[kind][k]), f"{kind} {k} changed"
    for k, g in before["grads"].items():
        if g is None:
            assert after["grads"][k] is None, f"grad of {k} appeared"
        else:
            assert torch.equal(g, after["grads"][k]), f"grad of {k} changed"
    assert before["grad_ids"] == after["grad_ids"]
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert before["py_rng"] == after["py_rng"]
    assert np.array_equal(before["np_rng"], after["np_rng"])


@pytest.mark.parametrize("existing_grads", [False, True])
def test_measuring_leaves_parameters_buffers_grads_and_rng_untouched(existing_grads: bool) -> None:
    torch.manual_seed(0)
    model = BNNet().train()
    x = torch.randn(16, 8)
    if existing_grads:
        model(x).backward()  # gradient accumulation in progress: fc1/fc2/bn have grads, frozen has none
    random.random()
    np.random.rand()
    before = _state(model)

    def step() -> None:
        random.random()  # user code touching other RNGs
        np.random.rand()
        model(x).backward()

    m = measure_step(step, StepSettings(warmup=1, steps=2, count_flops=True), model=model, extra=(x,))
    assert m.ok and m.peak_bytes and m.recompute_flops == 0
    _assert_same(before, _state(model))


def test_measuring_a_plan_leaves_the_model_untouched(gpt: GPT, tokens: torch.Tensor) -> None:
    before = _state(gpt)
    plan = Plan({"transformer.h.0": BlockPlan("full"), "transformer.h.2": BlockPlan("ops", save_list="save_matmuls")})
    with plan_applied(gpt, plan):
        m = measure_step(
            lambda: gpt(tokens, tokens).backward(), StepSettings(count_flops=True), model=gpt, extra=(tokens,)
        )
    assert m.ok
    _assert_same(before, _state(gpt))


def test_state_snapshot_resets_grads_between_steps(gpt: GPT, tokens: torch.Tensor) -> None:
    snap = StateSnapshot.capture(gpt)
    gpt(tokens, tokens).backward()
    assert any(p.grad is not None for p in gpt.parameters())
    snap.reset_grads()
    assert all(p.grad is None for p in gpt.parameters())
    assert snap.changed_parameters() == []
    with torch.no_grad():
        gpt.lm_head.weight.add_(1.0)
    assert snap.changed_parameters() == ["transformer.wte.weight"]  # tied to lm_head: first name wins
    gc.collect()


# ---------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_budget_is_enforced_for_real_and_the_cap_restored() -> None:
    from lightning_ckpt.testing import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=512, block_size=256)).cuda()
    x = torch.randint(0, 512, (8, 256), device="cuda")
    fraction_before = torch.cuda.get_per_process_memory_fraction()

    def step() -> None:
        model(x, x).backward()

    ok = measure_step(step, StepSettings(warmup=1, steps=2), model=model)
    assert ok.ok and ok.peak_bytes and ok.median_seconds
    limit = torch.cuda.memory_allocated() + 1024 * 1024  # far below the step's peak
    over = measure_step(step, StepSettings(warmup=0, steps=1, memory_limit_bytes=limit), model=model)
    assert over.status == "oom", over
    assert torch.cuda.get_per_process_memory_fraction() == fraction_before
    again = measure_step(step, StepSettings(warmup=0, steps=1), model=model)  # the process carries on
    assert again.ok and again.peak_bytes == pytest.approx(ok.peak_bytes, rel=0.05)


def test_cuda_cap_keeps_a_smaller_user_cap_and_adds_the_reserve_headroom(monkeypatch) -> None:
    """By reading the calls (CPU): budgets are allocated bytes, the cap counts reserved memory."""
    from types import SimpleNamespace

    from lightning_ckpt.measure.device_memory import CudaMemory
    from lightning_ckpt.measure.step import _enforced_memory_limit

    total = 100 * 2**30
    calls: list[float] = []
    state = {"fraction": 1.0}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)

    def set_fraction(f: float, d=None) -> None:
        calls.append(f)
        state["fraction"] = f

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    dev = CudaMemory(torch.device("cuda", 0))
    with _enforced_memory_limit(dev, 50 * 2**30, reserve_headroom=2**30):
        assert state["fraction"] == pytest.approx(0.51)
    assert state["fraction"] == 1.0
    state["fraction"] = 0.3  # the user's own cap
    with _enforced_memory_limit(dev, 50 * 2**30, reserve_headroom=2**30):
        assert state["fraction"] == 0.3, "a cap the user set is never raised"
    assert state["fraction"] == 0.3


def _raised_from(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:
        return e


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory."),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        torch.AcceleratorError("CUDA error: out of memory") if hasattr(torch, "AcceleratorError") else MemoryError(),
        RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        _raised_from(RuntimeError("backend compiler failed"), torch.OutOfMemoryError("CUDA out of memory.")),
        _raised_from(ValueError("wrapped"), RuntimeError("CUDA error: out of memory")),
    ],
    ids=["allocator", "raw_cuda", "accelerator_error", "cublas", "cudnn", "dynamo_wrapped", "chained"],
)
def test_out_of_memory_outside_the_caching_allocator_is_classified_oom(exc):
    from lightning_ckpt.measure.measurement import classify_failure

    assert classify_failure(exc)[0] == "oom"


def test_an_unrelated_error_stays_an_error():
    from lightning_ckpt.measure.measurement import classify_failure

    assert classify_failure(RuntimeError("shape mismatch"))[0] == "error"


def test_gradients_marked_zero_are_restored_without_a_host_copy():
    from lightning_ckpt.measure.snapshot import _ZERO, StateSnapshot, mark_zero_grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    w, b = model[0].weight, model[0].bias
    w.grad = torch.zeros_like(w)
    mark_zero_grad(w.grad)
    b.grad = torch.zeros_like(b)
    mark_zero_grad(b.grad)
    b.grad.add_(1.0)  # changed since it was marked: copied like any gradient
    snap = StateSnapshot.capture(model)
    copies = {id(p): copy for p, _, copy in snap._grads}
    assert copies[id(w)] is _ZERO and copies[id(b)] is not _ZERO and copies[id(model[1].weight)] is None
    model(torch.randn(2, 4)).sum().backward()  # accumulates into every gradient
    snap.reset_grads()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.ones_like(b))
    assert model[1].weight.grad is None
    again = StateSnapshot.capture(model)  # still known to be zeros after the reset
    assert next(c for p, _, c in again._grads if p is w) is _ZERO


def test_a_step_that_ran_is_not_collected_on_a_card_and_a_failed_one_is(gpt: GPT, tokens: torch.Tensor, monkeypatch):
    # A full collection costs ~0.2 s; on a card it ran before the tracked step, under the cap and before the timed
    # steps: three times per trial, against a GPU step of milliseconds. A step that ran freed all it allocated by
    # reference counting, so only a failed step (whose frames may hold its tensors in cycles) is collected.
    from lightning_ckpt.testing import SimulatedCard

    collected: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(1) or collect(*args))
    settings = StepSettings(warmup=1, steps=2, memory_limit_bytes=2**30)
    with SimulatedCard(2**32, resident=(gpt, tokens)):
        ok = measure_step(lambda: gpt(tokens, tokens).backward(), settings, model=gpt, extra=(tokens,))
        assert ok.status == "ok" and ok.peak_bytes and not collected

        def failing() -> None:
            gpt(tokens, tokens)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

        failed = measure_step(failing, settings, model=gpt, extra=(tokens,))
    assert failed.status == "oom" and collected
