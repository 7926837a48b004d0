"""Discovery of blocks nested in stages (CNNs) and of a layer shared across depth (ALBERT)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt import baselines, discover_blocks
from lightning_ckpt.errors import DiscoveryError
from lightning_ckpt.search.space import SearchSpace


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class Stage(nn.Module):
    """A downsampling convolution, then ``depth`` residual blocks, as timm/torchvision stages are built."""

    def __init__(self, c_in: int, c: int, depth: int) -> None:
        super().__init__()
        self.down = nn.Conv2d(c_in, c, 2, stride=2)
        self.blocks = nn.Sequential(*(ResBlock(c) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.down(x))


class CNN(nn.Module):
    def __init__(self, widths=(8, 16, 32), depths=(2, 3, 2)) -> None:
        super().__init__()
        ins = (3, *widths[:-1])
        self.stages = nn.Sequential(*(Stage(i, c, d) for i, c, d in zip(ins, widths, depths, strict=True)))
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(x).mean((2, 3)))


def test_blocks_inside_stages_are_the_blocks():
    """Before: the three stages were the blocks (``stages.0``-``stages.2``)."""
    stacks = discover_blocks(CNN())
    assert [(s.fqn, len(s.blocks)) for s in stacks] == [
        ("stages.0.blocks", 2),
        ("stages.1.blocks", 3),
        ("stages.2.blocks", 2),
    ]
    assert stacks[1].block_fqns == ("stages.1.blocks.0", "stages.1.blocks.1", "stages.1.blocks.2")
    assert all(b.class_name == "ResBlock" for s in stacks for b in s.blocks)
    # One level only: a residual block's own Sequential of convolutions is not a stack of blocks.
    assert not any(".body" in s.fqn for s in stacks)
    plans = baselines(CNN())
    assert set(plans["full"].blocks) == {b for s in stacks for b in s.block_fqns}
    assert plans["sqrt_segments"].segments == {"stages.0.blocks": 1, "stages.1.blocks": 2, "stages.2.blocks": 1}


@pytest.mark.parametrize(
    ("name", "depths"), [("resnet", [3, 4, 6, 3]), ("resnet_basic", [2, 2]), ("convnext", [2, 2, 6, 2])]
)
def test_hf_cnns_are_planned_over_the_layers_of_each_stage(name, depths):
    pytest.importorskip("transformers")
    from transformers import ConvNextConfig, ConvNextForImageClassification, ResNetConfig, ResNetForImageClassification

    if name.startswith("resnet"):
        layer_type = "basic" if name == "resnet_basic" else "bottleneck"
        widths = [8 * 2**i for i in range(len(depths))]
        cfg = ResNetConfig(embedding_size=8, hidden_sizes=widths, depths=depths, layer_type=layer_type)
        model, prefix, layer = ResNetForImageClassification(cfg), "resnet", "ResNetBasicLayer"
        layer = "ResNetBottleNeckLayer" if layer_type == "bottleneck" else layer
    else:
        cfg = ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=depths)
        model, prefix, layer = ConvNextForImageClassification(cfg), "convnext", "ConvNextLayer"
    stacks = discover_blocks(model)
    assert [s.fqn for s in stacks] == [f"{prefix}.encoder.stages.{i}.layers" for i in range(len(depths))]
    assert [len(s.blocks) for s in stacks] == depths
    assert {b.class_name for s in stacks for b in s.blocks} == {layer}
    # Segments within each stage are in the space, so runs of layers can be checkpointed as one.
    space = SearchSpace().for_device("cpu")
    segments = [c.plan for c in space.enumerate(stacks, fingerprint=None) if c.plan.segments]
    assert segments and all(set(p.segments) <= {s.fqn for s in stacks} for p in segments)


def test_stages_holding_experts_are_not_opened():
    """Parallel containers (experts, heads) are parts of one block, whatever their share of the parameters."""

    class Experts(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(c, c) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(e(x) for e in self.experts)

    # Blocks of different widths, like stages: only the name tells the experts from a stack of layers.
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(Experts(8), Experts(16), Experts(32)))
    assert [s.fqn for s in discover_blocks(model)] == ["1"]


def test_identical_blocks_with_a_sequential_inside_stay_the_blocks():
    """A transformer-like stack of alike blocks is already the repeated unit, even when each block keeps its
    layers in a Sequential of one class holding all its parameters."""

    class MLPBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.net(x)

    model = nn.Sequential(*(MLPBlock() for _ in range(4)))
    assert [s.fqn for s in discover_blocks(model)] == [""]


def test_albert_shared_layer_is_found_without_block_types():
    """Before: "No repeated layer stack found" (ALBERT keeps its one layer alone in a list)."""
    pytest.importorskip("transformers")
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                       intermediate_size=64)  # fmt: skip
    (stack,) = discover_blocks(AlbertForMaskedLM(cfg))
    assert stack.block_fqns == ("albert.encoder.albert_layer_groups.0.albert_layers.0",)
    assert stack.blocks[0].class_name == "AlbertLayer"
    assert stack.blocks[0].children_of_kind("attention") == ("attention",)


def test_a_lone_layer_in_a_list_is_not_a_block():
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(DiscoveryError, match=r"block_types=.*several times"):
        discover_blocks(model)
