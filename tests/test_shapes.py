"""How big a batch is, and how a plan's activations grow with it (``lightning.shapes``)."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.shapes import BatchSize, ShapeScaling, batch_size_of, grown_to


def test_a_batch_has_a_size_whatever_its_structure():
    tokens = torch.zeros(4, 64, dtype=torch.long)
    assert batch_size_of((tokens, tokens)) == BatchSize(4, 64)
    images = {"pixels": torch.zeros(8, 3, 16, 16), "label": torch.zeros(8, dtype=torch.long)}
    assert batch_size_of(images) == BatchSize(8, 3 * 16 * 16)
    assert batch_size_of({"meta": "no tensors"}) is None
    # A packed batch: its shape says one row of padding; the user's key says how many tokens it holds.
    packed = {"cu_seqlens": torch.tensor([0, 5, 40, 41, 90]), "input_ids": torch.zeros(1, 128, dtype=torch.long)}
    assert batch_size_of(packed) == BatchSize(5, 25)  # cu_seqlens first: 5 rows, the ids' 128 elements over them
    assert batch_size_of(packed, lambda b: (1, int(b["cu_seqlens"][-1]))) == BatchSize(1, 90)
    assert batch_size_of(packed, lambda b: int(b["cu_seqlens"][-1])) == BatchSize(1, 90)
    with pytest.raises(ConfigurationError, match=r"shape_key must return \(rows, length\).*returned 'long'"):
        batch_size_of(packed, lambda b: "long")


def test_sizes_compare_by_rows_and_length():
    assert BatchSize(4, 64).exceeds(BatchSize(4, 16)) and BatchSize(8, 16).exceeds(BatchSize(4, 64))
    assert not BatchSize(4, 16).exceeds(BatchSize(4, 64))
    assert BatchSize(8, 16).covering(BatchSize(4, 64)) == BatchSize(8, 64)


def test_growth_with_length_is_the_worst_case_until_a_step_of_that_plan_shows_it():
    scaling = ShapeScaling()
    short, long = BatchSize(4, 16), BatchSize(4, 64)
    assert scaling.linear_share("p") == 0.0 and scaling.scale("p", long, short) == 16.0, "all quadratic"
    assert scaling.scale("p", BatchSize(8, 16), short) == 2.0, "rows scale linearly"
    # A step at 4x the length used 6x the activations: a * 4 + (1 - a) * 16 = 6, a = 10/12.
    scaling.observe("p", 6_000, long, 1_000, short)
    assert scaling.learned("p") and scaling.linear_share("p") == pytest.approx(10 / 12)
    assert scaling.scale("p", BatchSize(4, 256), short) == pytest.approx(10 / 12 * 16 + 2 / 12 * 256)
    assert not scaling.learned("q") and scaling.scale("q", long, short) == 16.0, "learned per plan"
    # Readings at the reference's length say nothing of the growth; shares stay within [0, 1], the smallest kept.
    scaling.observe("p", 2_000, BatchSize(8, 16), 1_000, short)
    assert len(scaling.linear_shares["p"]) == 1
    scaling.observe("p", 100, long, 1_000, short)
    assert scaling.linear_share("p") == pytest.approx(10 / 12)
    scaling.observe("p", 30_000, long, 1_000, short)
    assert scaling.linear_share("p") == 0.0


@pytest.mark.parametrize("plan_name", ["none", "full"])
def test_the_predicted_growth_covers_true_activations_at_several_lengths(plan_name):
    # A GPT whose attention materialises its scores: activations grow faster than the length. Predicted from the
    # 8-token step, the worst case is never below the truth; once the 16-token step is read, the rest is predicted
    # within 10%.
    from lightning_ckpt import baselines
    from lightning_ckpt.measure.step import StepSettings, measure_step
    from lightning_ckpt.plan.apply import plan_applied
    from lightning_ckpt.testing import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=128, vocab_size=64, dropout=0.0))
    plan = baselines(gpt)[plan_name] if plan_name != "none" else None
    truth = {}
    for length in (8, 16, 32, 64, 128):
        x = torch.randint(0, 64, (4, length))
        with plan_applied(gpt, plan) if plan is not None else _nothing():
            truth[length] = measure_step(
                lambda x=x: gpt(x, x), StepSettings(warmup=0, steps=1), model=gpt
            ).activation_bytes
    ref = BatchSize(4, 8)
    scaling = ShapeScaling()
    for length in (16, 32, 64, 128):
        assert truth[8] * scaling.scale(plan_name, BatchSize(4, length), ref) >= truth[length]
    scaling.observe(plan_name, truth[16], BatchSize(4, 16), truth[8], ref)
    for length in (32, 64, 128):
        predicted = truth[8] * scaling.scale(plan_name, BatchSize(4, length), ref)
        assert predicted == pytest.approx(truth[length], rel=0.10), (length, predicted / truth[length])


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_a_batch_grows_to_the_declared_maximum_by_repeating_rows_and_positions():
    ids = torch.arange(8).reshape(2, 4)
    mask = torch.ones(2, 1, 4, 4)
    grown = grown_to({"input_ids": ids, "labels": ids + 100, "mask": mask, "step": 3}, BatchSize(3, 10))
    assert grown["input_ids"].shape == (3, 10) and grown["labels"].shape == (3, 10)
    assert grown["mask"].shape == (3, 1, 10, 10) and grown["step"] == 3
    assert grown["input_ids"][2].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # row 0 again, positions repeated
    assert torch.equal(grown["labels"] - 100, grown["input_ids"])
    # Rows 0 keeps the batch's own; a batch already as large stays as it is.
    assert grown_to((ids,), BatchSize(0, 6))[0].shape == (2, 6)
    same = (ids,)
    assert grown_to(same, BatchSize(1, 3)) is same
    with pytest.raises(ConfigurationError, match=r"max_shape needs token batches.*\(2, 3, 8, 8\)"):
        grown_to((torch.zeros(2, 3, 8, 8),), BatchSize(2, 16))


def test_a_declared_maximum_is_rows_and_length_or_a_length():
    assert BatchSize.declared((8, 1024)) == BatchSize(8, 1024)
    assert BatchSize.declared(1024) == BatchSize(0, 1024) and BatchSize.declared(None) is None
    for bad in (0, "1024", (8,), (8, 0), 1.5, True):
        with pytest.raises(ConfigurationError, match="max_shape must be the longest batch"):
            BatchSize.declared(bad)
