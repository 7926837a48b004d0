"""Parents that skip blocks (LayerDrop): known before any step, and searched at their deepest step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ckpt import Plan, baselines, tune
from lightning_ckpt.discovery import discover_blocks
from lightning_ckpt.measure.step import StepSettings, measure_step
from lightning_ckpt.plan.apply import plan_applied
from lightning_ckpt.plan.skipping import full_depth, skipping_stacks
from lightning_ckpt.search.config import TuneConfig


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Config:
    def __init__(self, layerdrop: float) -> None:
        self.layerdrop = layerdrop


class DroppingEncoder(nn.Module):
    """Hugging Face's LayerDrop loop (wav2vec2's): a coin per block from torch's generator, the rate on the
    config."""

    def __init__(self, layers: int = 6, dim: int = 32, layerdrop: float = 0.8) -> None:
        super().__init__()
        self.config = Config(layerdrop)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            skip = self.training and torch.rand([]) < self.config.layerdrop
            if not skip:
                x = layer(x)
        return x.square().mean()


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return DroppingEncoder(), torch.randn(64, 32)


def test_full_depth_runs_every_block_and_restores_the_rate_while_the_stack_still_counts_as_skipping():
    model, x = _model()
    stacks = discover_blocks(model)
    calls = []
    for layer in model.layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    with full_depth(model, stacks) as zeroed:
        assert zeroed == {"layers": "model.config.layerdrop = 0.8"}
        assert model.config.layerdrop == 0.0
        assert skipping_stacks(model, stacks) == {"layers": "model.config.layerdrop = 0.8"}  # no segments offered
        for _ in range(5):
            model(x)
        assert len(calls) == 5 * len(model.layers)
    assert model.config.layerdrop == 0.8
    with pytest.raises(RuntimeError), full_depth(model, stacks):
        raise RuntimeError("a step failed")
    assert model.config.layerdrop == 0.8 and skipping_stacks(model, stacks)


def _full_depth_peak(model: nn.Module, x: torch.Tensor, plan: Plan | None) -> int:
    with full_depth(model, discover_blocks(model)), plan_applied(model, plan or Plan(), check_fingerprint=False):
        return measure_step(lambda: model(x), StepSettings(warmup=0, steps=1), model=model).peak_bytes


def test_a_layerdrop_model_is_tuned_for_its_full_depth_steps_whatever_the_profiled_step_skipped():
    # With LayerDrop at 0.8 a step runs about one block in five: a search that reads the depth its steps drew sees
    # `none` fit a budget that a full-depth step exceeds (the wav2vec2 ran at 1.7x it).
    model, x = _model()
    none, full = _full_depth_peak(model, x, None), _full_depth_peak(model, x, baselines(model)["full"])
    assert full < none
    limit = (none + full) // 2
    result = tune(model, lambda: model(x), max_memory=limit, config=TuneConfig(measure_steps=1, seed=0))
    assert model.config.layerdrop == 0.8, "the rate is the user's again after the search"
    assert result.best.blocks, "a full-depth step needs checkpointing at this budget"
    assert _full_depth_peak(model, x, result.best) <= limit
    assert not any(t.plan.segments for t in result.trials), "segments cannot run over blocks a parent skips"


def test_a_real_wav2vec2_runs_all_its_layers_under_full_depth_and_drops_some_outside_it():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2, num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, layerdrop=0.5, mask_time_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(cfg).train()
    stacks = discover_blocks(model)
    calls = []
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    audio = torch.randn(2, 400)
    for _ in range(4):
        model(audio)
    dropped = 4 * 4 - len(calls)
    assert dropped > 0, "LayerDrop 0.5 skips some layers in training"
    calls.clear()
    with full_depth(model, stacks) as zeroed:
        assert zeroed == {"encoder.layers": "model.encoder.config.layerdrop = 0.5"}
        for _ in range(4):
            model(audio)
    assert len(calls) == 4 * 4 and model.config.layerdrop == 0.5
