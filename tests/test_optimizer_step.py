"""Measuring the optimizer's part of a real step: exact against a real later step, and leaving no trace."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.memory.optimizer_measure import measure_optimizer_step
from lightning_ckpt.memory.optimizer_step import OptimizerStepMemory
from lightning_ckpt.testing import GPT, GPTConfig

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "adam_wd": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=48, block_size=16))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_measured_step_equals_a_real_later_step_and_leaves_no_trace(model, name):
    x = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = OPTIMIZERS[name](model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    rng = torch.get_rng_state()

    got = measure_optimizer_step(model, opt, device="cpu", extra=(x,))

    assert got.measured
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert torch.equal(torch.get_rng_state(), rng)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_param_state = {"adamw": 2, "adamw_loop": 2, "adam_wd": 2, "adam_amsgrad": 3, "sgd": 0, "sgd_momentum": 1,
                       "rmsprop": 1}[name]  # fmt: skip
    assert got.state_bytes_after == pytest.approx(per_param_state * params, rel=0.01, abs=4096)

    # A real second step, with the state the first one created: the same peak.
    model(x, x).backward()
    opt.step()
    model(x, x).backward()
    tracker = new_live_tracker("cpu")
    tracker.track_external(model, opt, x)
    tracker.total_peak = tracker.now()[0]
    with tracker:
        opt.step()
    assert got.step_peak_bytes == tracker.total_peak


def test_existing_state_is_restored_in_place(model):
    x = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x, x).backward()
    opt.step()
    state = {p: {k: v for k, v in s.items()} for p, s in opt.state.items()}
    values = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    grads = [p.grad.clone() for p in model.parameters()]
    got = measure_optimizer_step(model, opt, device="cpu")
    assert got.pending_state_bytes == 0 and got.state_bytes_before == got.state_bytes_after > 0
    for p, s in opt.state.items():
        for k, v in s.items():
            assert v is state[p][k] and torch.equal(v, values[p][k])
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


def test_an_optimizer_that_needs_a_closure_is_reported_not_measured(model):
    opt = torch.optim.LBFGS(model.parameters())
    got = measure_optimizer_step(model, opt, device="cpu")
    assert not got.measured and "closure" in got.note.lower()
    assert got.real_peak(1000) == 1000


def test_real_peak_is_the_larger_of_the_two_moments():
    mem = OptimizerStepMemory(state_bytes_before=0, state_bytes_after=200, step_peak_bytes=900)
    assert mem.real_peak(500) == 900  # the optimizer step peaks higher
    assert mem.real_peak(800) == 1000  # forward+backward with the state it will carry
    assert OptimizerStepMemory.from_dict(mem.to_dict()) == mem


class _OutOfMemoryAdamW(torch.optim.AdamW):
    """AdamW whose step creates its state, moves a weight, then runs out of memory (as a CUDA step would)."""

    def __init__(self, params, error: Exception) -> None:
        super().__init__(params, lr=1e-3)
        self.error = error

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ],
    ids=["allocator", "raw_cuda", "cublas"],
)
def test_an_out_of_memory_optimizer_step_stops_the_search_loudly_and_leaves_no_trace(model, error):
    from lightning_ckpt.errors import InfeasibleBudgetError

    opt = _OutOfMemoryAdamW(model.parameters(), error)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InfeasibleBudgetError, match=r"optimizer.step\(\) of _OutOfMemoryAdamW ran out of memory"):
        measure_optimizer_step(model, opt, device="cpu")
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_an_optimizer_that_needs_a_closure_is_recorded_as_unmeasured(model):
    got = measure_optimizer_step(model, torch.optim.LBFGS(model.parameters()), device="cpu")
    assert not got.measured and got.step_peak_bytes == 0 and "closure" in got.note.lower()
