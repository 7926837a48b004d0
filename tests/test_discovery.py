from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt import discover_blocks
from lightning_ckpt.errors import DiscoveryError
from lightning_ckpt.testing import GPT, GPTConfig
from lightning_ckpt.testing.nanogpt import Block


def test_nanogpt_stack_and_children(gpt):
    (stack,) = discover_blocks(gpt)
    assert stack.fqn == "transformer.h"
    assert stack.block_fqns == tuple(f"transformer.h.{i}" for i in range(4))
    kinds = {c.name: c.kind for c in stack.blocks[0].children}
    assert kinds == {"ln_1": "norm", "attn": "attention", "ln_2": "norm", "mlp": "mlp"}
    assert stack.num_params == sum(p.numel() for p in gpt.transformer.h.parameters())


def test_compiled_model_has_same_fqns(gpt):
    compiled = torch.compile(gpt)  # wrapping only; nothing is compiled until called
    assert [s.block_fqns for s in discover_blocks(compiled)] == [s.block_fqns for s in discover_blocks(gpt)]


@pytest.mark.parametrize(
    ("factory", "stack_fqn", "mlp_child"),
    [
        ("tiny_llama", "model.layers", "mlp"),
        ("tiny_gpt2", "transformer.h", "mlp"),
        ("tiny_vit", "vit.layers", "mlp"),
    ],
)
def test_huggingface_models(factory, stack_fqn, mlp_child):
    pytest.importorskip("transformers")
    from lightning_ckpt.testing import hf

    model = getattr(hf, factory)(layers=3)
    (stack,) = discover_blocks(model)
    assert stack.fqn == stack_fqn
    assert len(stack.blocks) == 3
    assert mlp_child in stack.blocks[0].children_of_kind("mlp")
    assert stack.blocks[0].children_of_kind("attention")


def test_override_by_class_name_and_pattern(gpt):
    by_class = discover_blocks(gpt, block_types=[Block])
    by_name = discover_blocks(gpt, block_types=["Block"])
    by_pattern = discover_blocks(gpt, block_types=["transformer.h.*"])
    assert by_class == by_name == by_pattern
    # Explicit types may pick finer units: the MLPs, grouped under their parent blocks.
    mlps = discover_blocks(gpt, block_types=["MLP"])
    assert [b.fqn for s in mlps for b in s.blocks] == [f"transformer.h.{i}.mlp" for i in range(4)]


def test_nested_stacks_are_not_double_counted():
    class Expertful(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            return sum(e(x) for e in self.experts)

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*[Expertful() for _ in range(3)]))
    stacks = discover_blocks(model)
    assert [s.fqn for s in stacks] == ["1"]


def test_no_repeated_stack_gets_actionable_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(DiscoveryError, match="block_types="):
        discover_blocks(model)


def test_override_matching_nothing_lists_classes(gpt):
    with pytest.raises(DiscoveryError, match="CausalSelfAttention"):
        discover_blocks(gpt, block_types=["NoSuchBlock"])


def test_bigger_stack_wins():
    cfg = GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=8, block_size=8)
    model = nn.ModuleDict({"small": nn.ModuleList(nn.Linear(2, 2) for _ in range(3)), "gpt": GPT(cfg)})
    assert [s.fqn for s in discover_blocks(model)] == ["gpt.transformer.h"]
