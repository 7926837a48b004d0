"""The card the tool exists for, simulated on CPU (``lightning_ckpt.testing.SimulatedCard``): a step that runs out of
memory frees what it allocated, no pass lets an OOM escape the search, the budget is judged on allocated bytes, and
the search, a fit, the joint micro-batch search, a plan table and a reused plan all finish on a card the model does
not fit on without checkpointing, with a plan that fits it."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import torch
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, Plan, TuneConfig, plan_applied, tune
from lightning_ckpt.errors import InfeasibleBudgetError
from lightning_ckpt.measure.step import StepSettings, measure_step
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.baselines import uniform_plan
from lightning_ckpt.search.microbatch import resize_batch, tune_micro_batch
from lightning_ckpt.search.pipeline import SearchHooks
from lightning_ckpt.testing import GPT, GPTConfig, SimulatedCard

# Small, so the searches under the card's dispatch mode (a Python call per op) stay a few seconds each.
SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all", "first:0.5"], "rest_modes": ["none"]}
SEARCH = dict(
    n_trials=6,
    measure_steps=1,
    process_warmup_steps=1,
    count_flops=False,
    search_space=SPACE,
    confirm_top=1,
    confirm_rounds=1,
    confirm_max_rounds=1,
    holdout_rounds=0,
)


def _gpt(layers: int = 4) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_head=2, n_embd=32, block_size=32, dropout=0.0))
    return model, torch.randint(0, 96, (8, 32))


def _full(model: torch.nn.Module) -> Plan:
    return uniform_plan(ModelView.of(model).stacks, BlockPlan("full"))


def _peak_on_card(model: GPT, tokens: torch.Tensor, plan: Plan) -> int:
    card = SimulatedCard(2**40, resident=(model,))
    with card, plan_applied(model, plan):
        assert measure_step(lambda: model(tokens, tokens).backward(), StepSettings(warmup=0, steps=1), model=model).ok
    return card.max_allocated()


@pytest.fixture(scope="module")
def small_card() -> tuple[int, int, int]:
    """(full, none, card): the peaks of one step without and with full checkpointing, and a card halfway between."""
    model, tokens = _gpt()
    full, none = _peak_on_card(model, tokens, _full(model)), _peak_on_card(model, tokens, Plan())
    assert full < none
    return full, none, (full + none) // 2


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- one step ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("track", [True, False])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_runs_out_of_memory_frees_everything_it_allocated(track, where, small_card) -> None:
    # torch's module tracker (under the live-tensor tracker) registers multi-grad hooks and drops their handles: the
    # hook and the graph's nodes hold each other, so a step that failed before its backward finished kept every
    # activation it saved alive (215.9 MiB on a 6-layer GPT at 8 x 256 before the fix).
    model, tokens = _gpt()
    if where == "backward":

        def fail(*_):
            raise torch.OutOfMemoryError("Tried to allocate 1.00 GiB (injected in backward)")

        model.transformer.h[0].register_full_backward_pre_hook(fail)

    def step() -> None:
        loss = model(tokens, tokens)
        if where == "forward":
            raise torch.OutOfMemoryError("Tried to allocate 1.00 GiB (injected after the forward)")
        loss.backward()

    card = SimulatedCard(2**40, resident=(model,))
    with card:
        start = card.allocated()
        m = measure_step(step, StepSettings(warmup=0, steps=1, track_memory=track, count_flops=True), model=model)
        assert m.status == "oom"
        assert card.allocated() == start, f"{(card.allocated() - start) / 2**20:.1f} MiB left alive"
        assert "leaked_bytes" not in m.extra
        # Nothing left behind: the next step has the whole card again.
        model.transformer.h[0]._backward_pre_hooks.clear()
        assert measure_step(lambda: model(tokens, tokens).backward(), StepSettings(warmup=0, steps=1), model=model).ok


@pytest.mark.parametrize("card", [True, False], ids=["allocator", "tracker"])
def test_a_failed_step_that_leaves_tensors_alive_is_reported(card, caplog) -> None:
    model, tokens = _gpt(layers=2)
    kept: list[torch.Tensor] = []

    def step() -> None:
        loss = model(tokens, tokens)
        kept.append(loss)  # a user's step that logs the loss tensor keeps the whole graph
        raise torch.OutOfMemoryError("Tried to allocate 1.00 GiB")

    simulated = SimulatedCard(2**40, resident=(model,))
    with caplog.at_level(logging.WARNING), simulated if card else contextlib.nullcontext():
        m = measure_step(step, StepSettings(warmup=0, steps=1, track_memory=True), model=model)
    assert m.status == "oom" and m.extra["leaked_bytes"] > 2**20
    assert "left" in caplog.text and "MiB allocated above where it started" in caplog.text


def test_counting_flops_keeps_no_recomputed_activation(small_card) -> None:
    # FlopCounterMode's module tracker hooked every recomputed module too, keeping each recomputed graph alive: the
    # counted pass of a fully checkpointed step peaked as high as no checkpointing and failed on a card it fits.
    full, _, card_bytes = small_card
    model, tokens = _gpt()
    card = SimulatedCard(card_bytes, resident=(model,))
    with card, plan_applied(model, _full(model)):
        m = measure_step(
            lambda: model(tokens, tokens).backward(), StepSettings(warmup=0, steps=1, count_flops=True), model=model
        )
    assert m.ok and m.recompute_flops and m.recompute_flops > 0
    assert card.max_allocated() == full


def test_a_step_the_cap_refuses_although_its_allocated_bytes_fit_is_run_again_and_judged_on_them(small_card) -> None:
    # The cap counts reserved bytes (here 1.5x allocated): a plan whose allocated peak fits the budget must not be
    # recorded oom because the allocator's reserve grew (segments(h=2) on the H200: 21.35 of 21.8 GiB allocated,
    # 30.56 reserved).
    full, none, _ = small_card
    model, tokens = _gpt()
    limit = full * 11 // 10
    card = SimulatedCard(10 * none, resident=(model,), reserve_factor=1.5)
    step = lambda: model(tokens, tokens).backward()  # noqa: E731
    with card:
        with plan_applied(model, _full(model)):
            fits = measure_step(step, StepSettings(warmup=0, steps=1, memory_limit_bytes=limit), model=model)
        over = measure_step(step, StepSettings(warmup=0, steps=1, memory_limit_bytes=limit), model=model)
    assert card.refusals, "the cap did refuse"
    assert fits.ok and fits.peak_bytes <= limit and "cap_refused" in fits.extra
    assert over.status in ("oom", "over_budget"), "a plan over the budget in allocated bytes still fails"
    assert card.get_fraction() == 1.0, "the previous cap is back"


# --- the search ----------------------------------------------------------------------------------------------------
def test_tune_on_a_small_card_after_an_oom_step_records_the_ooms_and_chooses_a_plan_that_fits(small_card, caplog):
    full, none, card_bytes = small_card
    model, tokens = _gpt()
    before = _state(model)
    card = SimulatedCard(card_bytes, resident=(model,))
    with card, caplog.at_level(logging.WARNING):
        start = card.allocated()
        plain = measure_step(lambda: model(tokens, tokens).backward(), StepSettings(warmup=0, steps=1), model=model)
        assert plain.status == "oom", "the model does not fit this card without checkpointing"
        result = tune(
            model, lambda: model(tokens, tokens), max_memory=4 * none, config=TuneConfig(memory_pass="every", **SEARCH)
        )
        assert card.allocated() == start, "the search left nothing on the card"
        with plan_applied(model, result.best):
            again = measure_step(lambda: model(tokens, tokens).backward(), StepSettings(warmup=0, steps=1), model=model)
    assert result.budget.limit_bytes == card_bytes, "max_memory above the card is clamped to it"
    assert "clamped" in caplog.text
    assert not result.best.is_empty and result.best_trial.peak_bytes <= card_bytes
    assert again.ok and again.peak_bytes <= card_bytes
    statuses = {t.status.value for t in result.trials}
    assert "ok" in statuses
    for k, v in _state(model).items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_a_card_smaller_than_the_lowest_memory_plan_ends_in_infeasible_budget_error(small_card) -> None:
    full, _, _ = small_card
    model, tokens = _gpt()
    before = _state(model)
    card = SimulatedCard(full * 7 // 10, resident=(model,))
    with card, pytest.raises(InfeasibleBudgetError, match="was already allocated when the search began") as err:
        tune(model, lambda: model(tokens, tokens), config=TuneConfig(memory_pass="every", **SEARCH))
    assert not isinstance(err.value.__context__, torch.OutOfMemoryError), "the OOM's frames are not kept"
    assert card.allocated() == card.max_allocated() or card.allocated() <= sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    for k, v in _state(model).items():
        assert torch.equal(v, before[k]), k


def test_the_joint_micro_batch_search_on_a_small_card(small_card) -> None:
    full, none, card_bytes = small_card
    model, tokens = _gpt()
    card = SimulatedCard(card_bytes, resident=(model,))

    def loss_for(m: int):
        batch = resize_batch(tokens, 8, m)
        return lambda: model(batch, batch)

    with card:
        assert (
            measure_step(lambda: model(tokens, tokens).backward(), StepSettings(warmup=0, steps=1), model=model).status
            == "oom"
        )
        found = tune_micro_batch(
            model,
            loss_for,
            base_micro_batch=8,
            global_batch=8,
            max_memory=4 * none,
            extra_for=lambda m: (resize_batch(tokens, 8, m),),
            config=TuneConfig(micro_batches=[4, 8], memory_pass="every", **SEARCH),
        )
    assert found.result.budget.limit_bytes == card_bytes
    assert found.result.best_trial.peak_bytes <= card_bytes
    assert found.result.best.metadata["allocator"]["how"], "what the allocator ran the joint search under"


class _Lit(LitGPT):
    def __init__(self) -> None:
        super().__init__(n_layer=3, n_embd=32, vocab_size=64, block_size=16, dropout=0.0)


def _fit_peak(tmp_path, callbacks, *, data, card_bytes: int = 2**40, steps: int = 3) -> tuple[int, Any]:
    torch.manual_seed(0)
    net = _Lit()
    card = SimulatedCard(card_bytes, resident=(net,))
    trainer = quiet_trainer(tmp_path, callbacks, steps=steps)
    with card:
        trainer.fit(net, data)
    return card.max_allocated(), trainer


def test_a_fit_a_plan_table_and_a_reused_plan_on_a_small_card(tmp_path) -> None:
    data = token_loader(24, seq=16, vocab=64, batch_size=8)
    torch.manual_seed(0)
    full_plan = _full(_Lit())
    none_peak, _ = _fit_peak(tmp_path, [], data=data)
    full_peak, _ = _fit_peak(tmp_path, [ActivationCheckpointTuner(plan=full_plan)], data=data)
    card_bytes = (full_peak + none_peak) // 2
    search = dict(memory_pass="every", **SEARCH)
    plan_path = tmp_path / "plan.json"
    tuned = ActivationCheckpointTuner(max_memory="1GiB", plan_path=plan_path, search=search, max_shape=(8, 16))
    peak, trainer = _fit_peak(tmp_path, [tuned], data=data, card_bytes=card_bytes)
    assert trainer.global_step == 3 and peak <= card_bytes
    assert not tuned.plan.is_empty and tuned.trials_run > 0
    assert tuned.plan_table is not None, "a plan table was built on the card"
    reused = ActivationCheckpointTuner(max_memory="1GiB", plan_path=plan_path, max_shape=(8, 16))
    peak, trainer = _fit_peak(tmp_path, [reused], data=data, card_bytes=card_bytes)
    assert trainer.global_step == 3 and peak <= card_bytes
    assert reused.trials_run == 0 and reused.plan.key() == tuned.plan.key()


def test_cached_and_pinned_memory_is_released_however_the_search_ends(monkeypatch) -> None:
    from lightning_ckpt.search import setup as tune_module
    from lightning_ckpt.search.trials import SearchInterrupted

    released: list[torch.device] = []
    original = tune_module.release_cached_memory
    monkeypatch.setattr(tune_module, "release_cached_memory", lambda d: (released.append(d), original(d)))
    model, tokens = _gpt(layers=2)
    with pytest.raises(SearchInterrupted):
        tune(
            model,
            lambda: model(tokens, tokens),
            config=TuneConfig(**SEARCH),
            hooks=SearchHooks(should_stop=lambda: True),
        )
    assert released, "offload trials' pinned host memory is returned when a search is interrupted too"


def test_the_profile_starts_its_anchor_step_from_an_emptied_cache(small_card) -> None:
    # On an H200 capped at 21.8 GiB the capture's cached blocks left the anchor's logits no room (6.14 GiB refused
    # with 11.17 allocated and 4.74 cached but free): the cache is emptied between the capture and the anchor.
    from lightning_ckpt.memory.profile import profile_memory

    model, tokens = _gpt(layers=2)
    emptied: list[int] = []

    class Counting(SimulatedCard):
        def empty_cache(self) -> None:
            emptied.append(self.allocated())
            super().empty_cache()

    with Counting(2**40, resident=(model,)):
        profile_memory(model, lambda: model(tokens, tokens))
    assert emptied, "the profile emptied the cache before its anchor step"
