"""A compiled search on blocks compiled alone (``search.assembly``): graphs per distinct block and mode, not per plan.

CPU, inductor, the 2- to 4-layer test GPT at sequence length 16: each graph compiles in a second or two.
"""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt import Plan, apply_plan
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.measure.saved_for_backward import SavedForBackward
from lightning_ckpt.plan.apply import reused_forwards
from lightning_ckpt.plan.format import BlockPlan
from lightning_ckpt.search.assembly import BlocksCompiledAlone, graphs_compiled, partition_only_backend
from lightning_ckpt.search.compile import compiled_search, reset_compiled
from lightning_ckpt.testing import GPT, GPTConfig

CONFIG = dict(n_head=2, n_embd=32, vocab_size=48, block_size=16)


def gpt(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG, n_layer=layers, dropout=0.0))


def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (4, CONFIG["block_size"]), generator=torch.Generator().manual_seed(1))


def blocks(layers: int) -> tuple[str, ...]:
    return tuple(f"transformer.h.{i}" for i in range(layers))


def selective(layers: int, *children: str) -> Plan:
    return Plan({fqn: BlockPlan("selective", children=children) for fqn in blocks(layers)})


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    reset_compiled()
    yield
    reset_compiled()


def _grads(model: torch.nn.Module, step) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_selective_plan_on_blocks_compiled_one_by_one_compiles_one_graph_for_all_of_them():
    """Before, a checkpointed child's forward was a partial, which dynamo guards by identity: every block compiled
    its own graph and the eighth hit the recompile limit, running eagerly from then on."""
    layers = 8
    model, x = gpt(layers), tokens()
    expected = _grads(model, lambda: model(x, x))
    for block in model.transformer.h:
        block.compile()
    handle = apply_plan(model, selective(layers, "mlp"))
    try:
        from torch._dynamo.utils import counters

        before, limit_hits = graphs_compiled(), len(counters["unimplemented"])
        got = _grads(model, lambda: model(x, x))
        assert graphs_compiled() - before == 1
        assert len(counters["unimplemented"]) == limit_hits  # no recompile limit reached
        got_again = _grads(model, lambda: model(x, x))
        assert graphs_compiled() - before == 1
    finally:
        handle.remove()
    assert "_lightning_ckpt_child_guard" not in model.transformer.h[0].mlp.__dict__  # the guard leaves with the plan
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_again[name], g, rtol=1e-4, atol=1e-5)


def test_installed_runs_the_blocks_compiled_alone_and_the_rest_eager_then_puts_the_users_compile_back():
    model, x = gpt(2), tokens()
    compiled = torch.compile(model)
    wrapper_forward = compiled.__dict__["forward"]
    assembly = BlocksCompiledAlone(compiled, model, blocks(2))
    from torch._dynamo.utils import counters

    with assembly.installed():
        assert compiled.__dict__["forward"] != wrapper_forward  # the whole-model compile is bypassed
        assert all(b.__dict__.get("_compiled_call_impl") is not None for b in model.transformer.h)
        frames = dict(counters["frames"])
        compiled(x, x).backward()
        # One frame per block call compiled (the blocks share one graph), nothing for the model around them.
        assert counters["frames"]["ok"] - frames.get("ok", 0) == 1
    assert compiled.__dict__["forward"] is wrapper_forward
    assert all("_compiled_call_impl" not in b.__dict__ for b in model.transformer.h)


def test_a_compiled_search_compiles_distinct_block_modes_not_plans_and_a_plan_switch_compiles_nothing():
    layers = 4
    model, x = gpt(layers), tokens()
    compiled = torch.compile(model)
    harness = StepHarness(model, lambda: compiled(x, x), torch.device("cpu"), extra=(x,), batch_size=4,
                          warmup_steps=0, measure_steps=1)  # fmt: skip
    runner = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False, blocks=blocks(layers))
    assert runner is not None and runner.assembly is not None
    full = {fqn: BlockPlan("full") for fqn in blocks(layers)}
    plans = [
        Plan(),
        Plan(full),
        Plan(dict(list(full.items())[:2])),  # full on two blocks, none on two: modes compiled already
        Plan(dict(list(full.items())[2:])),
        selective(layers, "mlp"),
        Plan(compile_memory_budget=0.3),
    ]
    measured = [runner.measure(p, None) for p in plans]
    assert all(m.ok for m in measured), [m.error for m in measured]
    graphs = [m.extra["compile"]["graphs"] for m in measured]
    assert graphs[2] == graphs[3] == 0  # a new plan of known modes: swaps compiled blocks
    assert runner.graphs == sum(graphs) <= 4  # none, full, selective(mlp), the budget
    assert measured[1].activation_bytes < measured[2].activation_bytes < measured[0].activation_bytes
    assert measured[5].activation_bytes < measured[0].activation_bytes  # the budget's graph is its own
    before = graphs_compiled()
    for p in plans[:5]:
        m = runner.retime(p, 1, warmup=0)
        assert m.ok and not m.extra["compile"]["compiled"]
    assert graphs_compiled() == before


def test_gradients_of_every_plan_on_blocks_compiled_alone_equal_eager():
    layers = 2
    model, x = gpt(layers), tokens()
    compiled = torch.compile(model)
    assembly = BlocksCompiledAlone(compiled, model, blocks(layers))
    memo: dict = {}
    for plan in [Plan(), Plan({"transformer.h.0": BlockPlan("full")}), selective(layers, "attn", "mlp")]:
        expected = _grads(model, lambda: model(x, x))
        with assembly.installed():
            with reused_forwards(memo):
                handle = apply_plan(model, plan)
            try:
                got = _grads(model, lambda: compiled(x, x))
            finally:
                handle.remove()
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=f"{plan.describe()}: {name}")


def test_segments_on_blocks_compiled_alone_compile_one_block_graph_for_every_chunk_length_and_match_eager():
    """A segment's head compiled alone traced its whole chunk into one graph per chunk length; on blocks compiled
    alone the chunk's checkpoint runs eagerly around one compiled graph of the plain block."""
    layers = 4
    model, x = gpt(layers), tokens()
    expected = _grads(model, lambda: model(x, x))
    compiled = torch.compile(model)
    harness = StepHarness(model, lambda: compiled(x, x), torch.device("cpu"), extra=(x,), batch_size=4,
                          warmup_steps=0, measure_steps=1)  # fmt: skip
    runner = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False, blocks=blocks(layers))
    assert runner is not None and runner.assembly is not None
    none = runner.measure(Plan(), None)
    segments = [runner.measure(Plan(segments={"transformer.h": n}), None) for n in (2, 3)]
    assert none.ok and all(m.ok for m in segments), [m.error for m in segments]
    assert sum(m.extra["compile"]["graphs"] for m in segments) <= 1  # the plain block, for both chunk lengths
    # Every block still runs compiled: the chunks' blocks each through its graph, the last (not checkpointed)
    # segment's as without a plan; a block left eager would be a conflict (ops outside compiled graphs).
    assert all(m.conflict is None for m in segments), [m.conflict for m in segments]
    assert all(m.extra["compile"]["eager_ops"] == none.extra["compile"]["eager_ops"] for m in segments)
    assert all(m.activation_bytes < none.activation_bytes for m in segments)
    with runner.assembly.installed(), runner.assembly.segments_eager(model, ["transformer.h"]):
        handle = apply_plan(model, Plan(segments={"transformer.h": 2}))
        try:
            got = _grads(model, lambda: compiled(x, x))
        finally:
            handle.remove()
    assert all("_compiled_call_impl" not in b.__dict__ for b in model.transformer.h)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5)


def test_partitioned_without_kernels_a_model_keeps_its_gradients_and_saves_what_its_budget_asks():
    """The backend that reads what a whole compile saves (``partition_only_backend``) runs inductor's partition on every
    torch a leg tests, so a change in inductor's internals it calls fails here, not in a user's search (where it would
    only drop the budget it was reading). Its bytes equal inductor's: ``tests/test_whole_check.py`` (slow)."""
    layers = 2
    model, x = gpt(layers), tokens()
    expected = _grads(model, lambda: model(x, x))
    saved = {}
    for budget in (0.05, 1.0):
        reset_compiled()
        compiled = torch.compile(model, backend=partition_only_backend())
        with torch._functorch.config.patch(activation_memory_budget=budget):
            got = _grads(model, lambda c=compiled: c(x, x))  # the step that partitions
            with SavedForBackward(model, extra=[x]) as counted:
                loss = compiled(x, x)
            saved[budget] = counted.saved_bytes
            loss.backward()
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=f"budget {budget}: {name}")
    assert 0 < saved[0.05] < saved[1.0]  # the partitioner recomputed to meet the small budget
