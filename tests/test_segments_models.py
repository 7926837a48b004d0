"""Segments on models whose parent does not run a plain chain, and copies of planned models.

Every exactness check here compares a planned model with the same model unplanned, seeded alike, with
dropout on: bit-equal losses, every gradient on every step, buffers, and weights after optimizer steps.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt import BlockPlan, Plan, applied_plan, apply_plan, baselines, plan_applied, plan_handle, tune
from lightning_ckpt.measure.step import StepSettings, measure_step
from lightning_ckpt.memory.profile import profile_memory
from lightning_ckpt.search.config import TuneConfig

transformers = pytest.importorskip("transformers")

# ---------------------------------------------------------------------------------------------------
# Helpers: train a model a few steps, with or without a plan, and compare everything.
# ---------------------------------------------------------------------------------------------------
Snapshot = tuple[torch.Tensor, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]


def _train(
    model: nn.Module, loss_fn: Callable[[int], torch.Tensor], plan: Plan | None, steps: int = 3
) -> tuple[list[Snapshot], dict[str, str]]:
    """Per step: the loss, every gradient and the state after the optimizer step; and the plan's deviations."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1234)
    handle = apply_plan(model, plan, check_fingerprint=False) if plan is not None else None
    out = []
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(step)
            loss.backward()
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            out.append((loss.detach(), grads, state))
    finally:
        deviations = handle.deviations if handle is not None else {}
        if handle is not None:
            handle.remove()
    return out, deviations


def _assert_bit_exact(ref: list[Snapshot], got: list[Snapshot]) -> None:
    for step, ((l0, g0, s0), (l1, g1, s1)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(l0, l1), f"step {step}: loss {l0.item()} != {l1.item()}"
        wrong = [
            n for n in g0 if (g0[n] is None) != (g1[n] is None) or (g0[n] is not None and not torch.equal(g0[n], g1[n]))
        ]
        assert not wrong, f"step {step}: gradients differ for {wrong[:6]} ({len(wrong)} tensors)"
        wrong = [k for k in s0 if not torch.equal(s0[k], s1[k])]
        assert not wrong, f"step {step}: state (weights, buffers) differs for {wrong[:6]} ({len(wrong)} tensors)"


def _ran_blocks(model: nn.Module, stack: nn.ModuleList, loss_fn: Callable[[int], torch.Tensor], steps: int):
    """Which blocks of ``stack`` the unplanned model's parent called, per step (seeded like ``_train``)."""
    calls: list[list[int]] = []
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: calls[-1].append(i)) for i, b in enumerate(stack)]
    torch.manual_seed(1234)
    try:
        for step in range(steps):
            calls.append([])
            with torch.no_grad():
                loss_fn(step)
    finally:
        for h in hooks:
            h.remove()
    return calls


# ---------------------------------------------------------------------------------------------------
# Item 1: a parent that skips blocks (LayerDrop) — a real BART.
# ---------------------------------------------------------------------------------------------------
def _tiny_bart(layerdrop: float = 0.5, layers: int = 6) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=64, d_model=16, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BartForConditionalGeneration(config)
    model.train()
    return model


def _bart_loss(model: nn.Module) -> Callable[[int], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 8), generator=g)
    labels = torch.randint(3, 64, (2, 6), generator=g)
    return lambda step: model(input_ids=ids, labels=labels, use_cache=False).loss


STEPS = 3
BART_SEGMENTS = Plan(segments={"model.encoder.layers": 2, "model.decoder.layers": 2})  # chunks of 3 checkpointed


def test_bart_with_layerdrop_trains_exactly_under_segments():
    model = _tiny_bart()
    loss_fn = _bart_loss(model)
    # The seed makes the steps skip different blocks of the checkpointed chunk (layers 0-2): its head, a
    # middle member and its last member, each on some step while the blocks around it ran.
    ran = _ran_blocks(model, model.model.encoder.layers, loss_fn, STEPS)
    ran += _ran_blocks(model, model.model.decoder.layers, loss_fn, STEPS)
    chunk_runs = {tuple(i in r for i in range(3)) for r in ran}
    assert (False, True, True) in chunk_runs, chunk_runs  # the head skipped, the members called
    assert (True, False, True) in chunk_runs, chunk_runs  # a middle member skipped
    assert (True, True, False) in chunk_runs, chunk_runs  # the last member skipped

    ref, _ = _train(model, loss_fn, None, steps=STEPS)
    planned = _tiny_bart()
    with pytest.warns(UserWarning, match=r"segments\['model\.(en|de)coder\.layers'\] could not run as planned"):
        got, deviations = _train(planned, _bart_loss(planned), BART_SEGMENTS, steps=STEPS)
    _assert_bit_exact(ref, got)
    assert set(deviations) == {"model.encoder.layers", "model.decoder.layers"}


def test_bart_without_layerdrop_runs_its_segments_as_planned():
    model = _tiny_bart(layerdrop=0.0)
    ref, _ = _train(model, _bart_loss(model), None, steps=2)
    planned = _tiny_bart(layerdrop=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no step leaves the chain
        got, deviations = _train(planned, _bart_loss(planned), BART_SEGMENTS, steps=2)
    _assert_bit_exact(ref, got)
    assert deviations == {}


def test_bart_with_layerdrop_is_not_offered_segments():
    model = _tiny_bart()
    assert "sqrt_segments" not in baselines(model)  # the configuration says the parent skips blocks
    assert "sqrt_segments" in baselines(_tiny_bart(layerdrop=0.0))
    loss_fn = _bart_loss(model)
    memory = profile_memory(model, lambda: loss_fn(0))
    assert set(memory.unchained_stacks) == {"model.encoder.layers", "model.decoder.layers"}
    why = memory.can_run(BART_SEGMENTS)
    assert why is not None and "LayerDrop" in why
    assert "sqrt_segments" not in baselines(model, memory_model=memory)


# ---------------------------------------------------------------------------------------------------
# Item 1: synthetic parents — a seeded coin, a fixed schedule, reordering, repeats, early exit.
# ---------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Dropout (RNG) and BatchNorm (buffers updated in forward): both must come out as without a plan."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.norm = nn.BatchNorm1d(4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.dropout(torch.tanh(self.norm(self.fc1(x))), 0.2, self.training))


class ScheduledParent(nn.Module):
    """Calls its blocks in the order ``schedule(step)`` gives: skips, reorders, repeats, exits early.
    The schedule draws no random numbers from torch's generators, so only the block order is off-chain."""

    def __init__(self, schedule: Callable[[int], Iterable[int]], n: int = 6, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))
        self.schedule = schedule

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for i in self.schedule(step):
            x = self.layers[i](x)
        return x.square().mean()


def _scheduled(schedule: Callable[[int], Iterable[int]]) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    torch.manual_seed(0)
    model = ScheduledParent(schedule)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    return model, lambda step: model(x, step)


def _coin(step: int) -> list[int]:
    """LayerDrop with its own generator: block i is skipped when a seeded coin says so."""
    coins = torch.rand(6, generator=torch.Generator().manual_seed(step))
    return [i for i in range(6) if coins[i] >= 0.4]


SCHEDULES: dict[str, Callable[[int], Iterable[int]]] = {
    # step 0 runs the chain (segments run as planned); later steps leave it in one way each
    "skip_head": lambda s: [0, 1, 2, 3, 4, 5] if s == 0 else [1, 2, 3, 4, 5],
    "skip_middle": lambda s: [0, 1, 2, 3, 4, 5] if s == 0 else [0, 2, 3, 4, 5],
    "skip_last_member": lambda s: [0, 1, 2, 3, 4, 5] if s == 0 else [0, 1, 3, 4, 5],
    "reorder": lambda s: [0, 1, 2, 3, 4, 5] if s == 0 else [0, 2, 1, 3, 4, 5],
    "repeat": lambda s: [0, 1, 2, 3, 4, 5] if s == 0 else [0, 1, 1, 2, 3, 4, 5],
    "early_exit": lambda s: [0, 1, 2, 3, 4, 5] if s == 0 else [0, 1],
    "seeded_coin": _coin,
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_parent_that_leaves_the_chain_trains_exactly(name):
    plan = Plan(segments={"layers": 2})  # layers 0-2 form the checkpointed chunk
    model, loss_fn = _scheduled(SCHEDULES[name])
    ref, _ = _train(model, loss_fn, None, steps=4)
    model, loss_fn = _scheduled(SCHEDULES[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, deviations = _train(model, loss_fn, plan, steps=4)
    _assert_bit_exact(ref, got)
    assert set(deviations) == {"layers"}
    ours = [str(w.message) for w in caught if "could not run as planned" in str(w.message)]
    assert len(ours) == 1 and "segments['layers']" in ours[0], ours  # once per stack, naming it


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def test_a_step_that_leaves_the_chain_keeps_no_outputs_after_it():
    model, loss_fn = _scheduled(SCHEDULES["early_exit"])  # exits after block 1: block 2's output is never asked for
    with plan_applied(model, Plan(segments={"layers": 2})) as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chunk = vars(model.layers[0])["forward"].args[1]  # the segment's run-time state
        for step in range(3):
            loss_fn(step).backward()
            held = {name: len(_tensors_in(v)) for name, v in vars(chunk).items() if _tensors_in(v)}
            assert not held, f"step {step}: the chunk still holds tensors after backward: {held}"
    assert "never ran" in handle.deviations["layers"]


def test_the_chain_check_sees_skips_and_random_draws_between_blocks():
    # The first batch skips a middle block: the old check compared the hidden state with the output of the block
    # that ran last, so a skip looked like a chain.
    model, loss_fn = _scheduled(SCHEDULES["skip_middle"])
    model.schedule = lambda s: [0, 2, 3, 4, 5]
    assert profile_memory(model, lambda: loss_fn(0)).unchained_stacks == ("layers",)

    # No skip in the first batch, but the parent draws a LayerDrop coin from torch's generator between blocks.
    class Drawing(ScheduledParent):
        def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
            for layer in self.layers:
                if torch.rand([]) < 2.0:  # always runs, but the draw moves the generator like LayerDrop does
                    x = layer(x)
            return x.square().mean()

    torch.manual_seed(0)
    drawing = Drawing(lambda s: range(6))
    x = torch.randn(16, 8)
    memory = profile_memory(drawing, lambda: drawing(x, 0))
    assert memory.unchained_stacks == ("layers",)
    assert "sqrt_segments" not in baselines(drawing, memory_model=memory)
    # and a parent that runs the chain keeps its segments
    plain, plain_loss = _scheduled(lambda s: range(6))
    assert profile_memory(plain, lambda: plain_loss(0)).unchained_stacks == ()


def test_the_tuner_drops_segments_over_a_stack_seen_skipping_during_trials():
    # The profile reads the chain in a no-grad capture forward, where this parent runs every block; it skips
    # one in every step that trains, as LayerDrop with a lucky first batch would on later ones: only the
    # trials can see it.
    def schedule(step: int) -> list[int]:
        return [0, 2, 3, 4, 5] if torch.is_grad_enabled() else [0, 1, 2, 3, 4, 5]

    model, loss_fn = _scheduled(schedule)
    space = {"modes": ["full"], "selections": ["all"], "rest_modes": [], "segments": True, "chunks": [2, 3],
             "baselines": False}  # fmt: skip
    # predict_time=False: the segments must run to be seen skipping (the time model would measure `none` only).
    result = tune(model, lambda: loss_fn(0), config=TuneConfig(n_trials=6, search_space=space, measure_steps=1, warmup_steps=0, confirm_top=0, seed=0, predict_time=False))  # fmt: skip
    segment_trials = [t for t in result.trials if t.plan.segments]
    assert len(segment_trials) == 1, [t.label for t in result.trials]  # the first one shows it; no more are offered
    assert segment_trials[0].status == "invalid"
    assert "segments['layers']" in segment_trials[0].error and "per-block modes" in segment_trials[0].error
    assert not result.best.segments
    assert not any("forward" in vars(m) for m in model.modules())


# ---------------------------------------------------------------------------------------------------
# Item 4: blocks called with keyword arguments only.
# ---------------------------------------------------------------------------------------------------
class KwBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 8 * dim)
        self.fc2 = nn.Linear(8 * dim, dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, scale: float = 1.0):
        h = self.fc2(nn.functional.dropout(torch.relu(self.fc1(hidden_states)), 0.1, self.training))
        return hidden_states + h * attention_mask * scale


class KwParent(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(KwBlock() for _ in range(n))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(hidden_states=x, attention_mask=mask, scale=0.5)
        return x.square().mean()


def _kw_model() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = KwParent()
    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(8, 32, 16, generator=g), (torch.rand(8, 32, 1, generator=g) > 0.2).float()
    return model, lambda: model(x, mask)


def test_keyword_only_blocks_are_segmented_exactly():
    model, loss = _kw_model()
    ref, _ = _train(model, lambda step: loss(), None)
    model, loss = _kw_model()
    got, deviations = _train(model, lambda step: loss(), Plan(segments={"layers": 2}))
    _assert_bit_exact(ref, got)
    assert deviations == {}

    def flops() -> int:
        with FlopCounterMode(display=False) as counter:
            loss().backward()
        model.zero_grad(set_to_none=True)
        return counter.get_total_flops()

    plain = flops()
    with plan_applied(model, Plan(segments={"layers": 2})):
        assert flops() > plain  # the first chunk really is recomputed (it ran unsegmented before)


def test_keyword_only_segments_are_offered_and_save_the_memory_predicted():
    model, loss = _kw_model()
    memory = profile_memory(model, loss)
    assert memory.unchained_stacks == ()
    offered = baselines(model, memory_model=memory)
    assert "sqrt_segments" in offered

    def measured(plan: Plan) -> int:
        with plan_applied(model, plan):
            m = measure_step(loss, StepSettings(warmup=0, steps=1, track_memory=True, count_flops=False), model=model)
        return m.activation_bytes

    none, segments = measured(Plan()), measured(offered["sqrt_segments"])
    assert segments < 0.75 * none  # the saving is real, as the model predicts it
    predicted_saving = memory.predict_activation(Plan()) - memory.predict_activation(offered["sqrt_segments"])
    assert none - segments == pytest.approx(predicted_saving, rel=0.1)


# ---------------------------------------------------------------------------------------------------
# Item 7: copies of a planned model.
# ---------------------------------------------------------------------------------------------------
def _loaded(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES: dict[str, Callable[[nn.Module], Any]] = {"deepcopy": copy.deepcopy, "torch_save_load": _loaded}


COPIED_PLANS = {
    "segments": Plan(segments={"layers": 2}),
    "blocks": Plan({"layers.0": BlockPlan("full"), "layers.1": BlockPlan("ops", save_list="save_matmuls")}),
}


@pytest.mark.parametrize("plan_name", list(COPIED_PLANS))
@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_of_a_planned_model_carries_a_plan_it_can_remove(how, plan_name):
    plan = COPIED_PLANS[plan_name]
    model, _ = _kw_model()
    plain_vars = {name: set(vars(m)) for name, m in model.named_modules()}
    handle = apply_plan(model, plan)
    clone = COPIES[how](model)
    assert applied_plan(clone) == plan and plan_handle(clone) is not handle

    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(8, 32, 16, generator=g), (torch.rand(8, 32, 1, generator=g) > 0.2).float()
    # The copy trains exactly like its (planned) original, on its own parameters.
    torch.manual_seed(5)
    model(x, mask).backward()
    torch.manual_seed(5)
    clone(x, mask).backward()
    for (n, p), q in zip(model.named_parameters(), clone.parameters(), strict=True):
        assert p is not q and torch.equal(p.grad, q.grad), n

    plan_handle(clone).remove()
    assert applied_plan(clone) is None
    assert {name: set(vars(m)) for name, m in clone.named_modules()} == plain_vars  # exactly plain again
    assert applied_plan(model) == plan  # the original keeps its plan
    with plan_applied(clone, Plan(segments={"layers": 3})):  # and the copy takes a new one (tuning needs that)
        pass
    profile_memory(clone, lambda: clone(x, mask))  # refused while a plan was applied; fine once removed
    handle.remove()
    assert {name: set(vars(m)) for name, m in model.named_modules()} == plain_vars
