"""Model zoo conformance: every architecture users train, built tiny from ``transformers`` configs.

For each (``lightning_ckpt.testing.zoo``): discovery finds the stacks; every baseline trains bit for bit as
no plan does (losses, every gradient of 3 optimizer steps, buffers and weights; dropout on, LayerDrop
seeded so that steps skip different blocks); the memory model predicts every baseline's activation peak
within 5%; and ``tune()`` under a 50% activation budget picks a plan that fits and is exact, or says why
nothing fits. One parametrised suite, in the shape of transformers' ``ModelTesterMixin``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from lightning_ckpt import baselines, discover_blocks  # noqa: E402
from lightning_ckpt.testing.zoo import ZOO, build, exactness, memory_errors, tune_at_half_activation  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

# The repeated stacks each architecture must be found at (FQN -> block count).
STACKS = {
    "nanogpt": {"gpt.transformer.h": 4},
    "gpt2": {"transformer.h": 4},
    "llama": {"model.layers": 4},
    "qwen2": {"model.layers": 4},
    "mistral": {"model.layers": 4},
    "mixtral": {"model.layers": 4},
    "qwen2_moe": {"model.layers": 4},
    "bert": {"bert.encoder.layer": 4},
    "albert": {"albert.encoder.albert_layer_groups.0.albert_layers": 1},  # one layer, called 4 times
    "t5": {"encoder.block": 3, "decoder.block": 3},
    "bart": {"model.encoder.layers": 4, "model.decoder.layers": 4},
    "whisper": {"model.encoder.layers": 3, "model.decoder.layers": 3},
    "vit": {"vit.layers": 4},
    "resnet": {"resnet.encoder.stages.0.layers": 3, "resnet.encoder.stages.1.layers": 3},
    "convnext": {"convnext.encoder.stages.0.layers": 3, "convnext.encoder.stages.1.layers": 3},
}
TOLERANCE = 0.05


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_discovery(name):
    case = build(name)
    found = {s.fqn: len(s.blocks) for s in discover_blocks(case.model)}
    assert found == STACKS[name]


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_every_baseline_trains_exactly_as_no_plan(name):
    plans = baselines(build(name).model)
    assert {"none", "full"} <= set(plans)
    diffs = exactness(name, plans)
    assert not {k: v[:5] for k, v in diffs.items() if v}, f"{name}: differs from no plan"


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_memory_model_predicts_every_baseline_within_5_percent(name):
    errors = {label: (pred - real) / real for label, (pred, real) in memory_errors(name).items() if real > 0}
    off = {k: f"{v:+.1%}" for k, v in errors.items() if abs(v) > TOLERANCE}
    assert not off, f"{name}: predicted activation off by more than 5%: {off}"


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_tune_at_half_activation_fits_and_is_exact_or_says_why(name):
    result = tune_at_half_activation(name)
    if result.fell_back:
        assert "fits the budget" in result.fallback_message and "Raise" in result.fallback_message
        return
    best = result.best_trial
    assert best.status == "ok" and best.activation_bytes <= result.budget.limit_bytes
    assert not exactness(name, {"chosen": result.best})["chosen"]
