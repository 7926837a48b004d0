from __future__ import annotations

import optuna
import pytest

from lightning_ckpt import baselines, discover_blocks
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.model import model_fingerprint
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.testing import GPT, GPTConfig


def test_baselines_come_first_and_are_named(gpt):
    stacks = discover_blocks(gpt)
    cands = SearchSpace().for_device("cpu").enumerate(stacks, fingerprint=None)
    labels = [c.label for c in cands[:5]]
    assert labels == ["baseline:none", "baseline:full", "baseline:selective_mlp", "baseline:ops_save_matmuls",
                      "baseline:sqrt_segments"]  # fmt: skip
    keys = [c.plan.key() for c in cands]
    assert len(keys) == len(set(keys)), "candidates are deduplicated by what the plan does"
    assert all(bp.mode != "offload" for c in cands for bp in c.plan.blocks.values()), "no offload on CPU"


@pytest.mark.parametrize("n_layer", [2, 3, 4])
def test_the_space_and_plan_baselines_name_the_same_baselines(n_layer):
    """One list of baselines: the space's are plan/baselines.py's plans. Before, a 2-block stack got sqrt(2) -> 1
    chunk there (a plan that recomputes nothing, as ``none``) and 2 chunks of one block here (block by block,
    as ``full``)."""
    model = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    stacks = discover_blocks(model)
    named = baselines(model)
    offered = {c.baseline: c.plan for c in SearchSpace().baseline_candidates(stacks, fingerprint=None)}
    assert set(offered) <= set(named)
    assert all(plan.key() == named[name].key() for name, plan in offered.items())
    assert ("sqrt_segments" in offered) == ("sqrt_segments" in named) == (n_layer > 2)
    if n_layer > 2:
        assert named["sqrt_segments"].segments == {"transformer.h": 2}


def test_plan_for_dimensions(gpt):
    stacks = discover_blocks(gpt)
    space = SearchSpace()
    fp = model_fingerprint(gpt)
    p = space.plan_for({"structure": "blocks", "selection": "first:0.5", "mode": "full", "rest_mode": "none"}, stacks,
                       fingerprint=fp)  # fmt: skip
    assert sorted(p.blocks) == ["transformer.h.0", "transformer.h.1"] and p.fingerprint == fp
    p = space.plan_for({"structure": "blocks", "selection": "every:2", "mode": "full", "rest_mode": "selective:mlp"},
                       stacks, fingerprint=None)  # fmt: skip
    assert p.blocks["transformer.h.0"].mode == "full" and p.blocks["transformer.h.1"].children == ("mlp",)
    p = space.plan_for({"structure": "blocks", "selection": "all", "mode": "selective:attention+mlp"}, stacks,
                       fingerprint=None)  # fmt: skip
    assert p.blocks["transformer.h.3"].children == ("attn", "mlp")
    assert space.plan_for({"structure": "segments", "chunks": 2}, stacks, fingerprint=None).segments == {
        "transformer.h": 2
    }


def test_suggest_round_trips_through_optuna(gpt):
    stacks = discover_blocks(gpt)
    space = SearchSpace().for_device("cpu")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    keys = set()
    for _ in range(30):
        trial = study.ask()
        params = space.suggest(trial, stacks)
        keys.add(space.plan_for(params, stacks, fingerprint=None).key())
        study.tell(trial, 1.0)
    assert len(keys) > 5


def test_restricted_space_is_small_enough_to_enumerate(gpt):
    stacks = discover_blocks(gpt)
    space = SearchSpace.from_config({"modes": ["full"], "selections": ["all", "first:0.5"], "rest_modes": [],
                                     "segments": False})  # fmt: skip
    plans = {c.plan.describe() for c in space.enumerate(stacks, fingerprint=None)}
    assert plans == {"none", "full h.0-3", "full h.0-1", "selective(mlp) h.0-3", "ops(save_matmuls) h.0-3"}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"modez": ["full"]}, "Unknown search-space names"),
        ({"modes": ["ops:keep_everything"]}, "Unknown op save-list"),
        ({"modes": ["sometimes"]}, "Unknown search space mode"),
        ({"selections": ["middle:3"]}, "Unknown selection"),
        ({"modes": [], "segments": False}, "empty"),
    ],
)
def test_bad_search_spaces(config, match):
    with pytest.raises(ConfigurationError, match=match):
        SearchSpace.from_config(config)


def test_the_offloading_modes_mix_in_per_block_on_a_card_and_stay_out_of_a_cpu_search(gpt):
    # Per block: offload its saved tensors, or checkpoint it and offload its input, beside the other modes.
    stacks = discover_blocks(gpt)
    cuda, cpu = SearchSpace().for_device("cuda"), SearchSpace().for_device("cpu")
    assert {"offload", "offload_input"} <= set(cuda.modes) & set(cuda.rest_modes)
    assert not any(m.startswith("offload") for m in (*cpu.modes, *cpu.rest_modes)), "nothing to offload from"
    mixes = {frozenset(bp.mode for bp in c.plan.blocks.values()) for c in cuda.enumerate(stacks, fingerprint=None)}
    assert {frozenset({"full", "offload_input"}), frozenset({"selective", "offload"})} <= mixes
    assert SearchSpace.from_config({"modes": ["offload_input"]}).modes == ("offload_input",)
    with pytest.raises(ConfigurationError, match="'offload_input'"):
        SearchSpace.from_config({"modes": ["offload_everything"]})
