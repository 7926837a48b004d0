"""A plan refused for another model says what differs, read from the plan's saved profile (issue 35, item 10)."""

from __future__ import annotations

import copy

import pytest
import torch
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner, Plan, apply_plan, tune
from lightning_ckpt.errors import StalePlanError
from lightning_ckpt.plan.format import BlockPlan, describe_model_change, model_changes
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.testing import GPT, GPTConfig

SPACE = {"modes": ["full"], "selections": ["all"], "rest_modes": ["none"], "segments": False}


def gpt(**changes) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(n_layer=4, n_head=2, n_embd=32, vocab_size=48, block_size=16), **changes}))


@pytest.fixture(scope="module")
def tuned() -> Plan:
    """A plan from a real (small) search on a 4-layer GPT: it keeps the profile of the stacks it was tuned on."""
    model = gpt()
    x = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(1))
    result = tune(
        model,
        lambda: model(x, x),
        activation_budget=0.9,
        config=TuneConfig(n_trials=2, search_space=SPACE, measure_steps=1),
    )
    assert "stacks" in result.best.metadata["profile"]
    return result.best


def refusal(plan: Plan, model: torch.nn.Module) -> str:
    with pytest.raises(StalePlanError) as err, apply_plan(model, plan):
        pass
    return str(err.value)


def test_more_layers_are_named_with_both_counts(tuned):
    message = refusal(tuned, gpt(n_layer=6))
    assert "transformer.h has 4 blocks in the plan and 6 in this model" in message
    assert f"fingerprint {tuned.fingerprint} in the plan" in message and "check_fingerprint=False" in message


def test_a_wider_model_names_the_first_block_and_its_parameter_counts(tuned):
    wide = gpt(n_embd=48)
    counts = [sum(p.numel() for p in m.transformer.h[0].parameters()) for m in (gpt(), wide)]
    message = refusal(tuned, wide)
    assert (
        f"transformer.h.0 (Block) has {counts[0]:,} parameters in the plan and {counts[1]:,} in this model" in message
    )


def test_another_dtype_is_named_by_the_parameters_bytes(tuned):
    message = refusal(tuned, gpt().to(torch.bfloat16))
    assert "the parameters take" in message and "another dtype" in message


def test_a_renamed_child_and_a_change_outside_the_stacks(tuned):
    model = gpt()
    for block in model.transformer.h:
        block.feed_forward = block.mlp
        del block.mlp
    assert "transformer.h.0's children are ln_1, attn, ln_2, mlp in the plan and" in refusal(tuned, model)
    model = gpt()
    model.extra = torch.nn.Identity()  # a module outside the stacks: no parameters, so only the tree differs
    assert "its layer stacks match the plan's; the module tree" in refusal(tuned, model)


def test_a_plan_without_a_profile_names_blocks_this_model_lacks():
    plan = Plan({f"transformer.h.{i}": BlockPlan("full") for i in range(6)}, fingerprint="0" * 16)
    message = refusal(plan, gpt())
    assert "2 of the plan's 6 blocks are not in this model (e.g. 'transformer.h.4')" in message
    changes = [f"change {i}" for i in range(5)]
    assert describe_model_change(changes) == "change 0; change 1; change 2; and 2 more"
    assert model_changes(None, [], plan_blocks=("a",), module_names=frozenset({"a"})) == []


def test_the_callback_reusing_a_plan_for_another_model_says_what_differs(tmp_path):
    path = tmp_path / "plan.json"
    tuner = ActivationCheckpointTuner(activation_budget=0.9, plan_path=path, search={"n_trials": 2}, verbose=False)
    quiet_trainer(tmp_path, [tuner], steps=1).fit(LitGPT(dropout=0.0), token_loader(64))
    deeper = LitGPT(dropout=0.0)
    deeper.model.transformer.h.append(copy.deepcopy(deeper.model.transformer.h[0]))
    reuse = ActivationCheckpointTuner(
        activation_budget=0.9, plan_path=path, guard={"on_stale_plan": "raise"}, verbose=False
    )
    with pytest.raises(StalePlanError, match=r"model\.transformer\.h has \d+ blocks in the plan and \d+ in this model"):
        quiet_trainer(tmp_path, [reuse], steps=1).fit(deeper, token_loader(64))
