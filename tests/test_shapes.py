"""How big a batch is, and how a plan's activations grow with it (``lightning.shapes``)."""

from __future__ import annotations

import pytest
import torch

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.shapes import WORST_CASE_POWER, BatchSize, ShapeScaling, batch_size_of


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


def test_growth_with_length_is_the_worst_case_until_a_step_shows_it():
    scaling = ShapeScaling()
    short, long = BatchSize(4, 16), BatchSize(4, 64)
    assert scaling.power == WORST_CASE_POWER and scaling.scale(long, short) == 16.0
    assert scaling.scale(BatchSize(8, 16), short) == 2.0, "rows scale linearly"
    # A step at 4x the length used 6x the activations: between linear (4x) and quadratic (16x).
    scaling.observe(6_000, long, 1_000, short)
    assert scaling.learned and scaling.power == pytest.approx(1.2925, abs=1e-3)
    assert scaling.scale(BatchSize(4, 256), short) == pytest.approx(16**1.2925, rel=1e-3)
    # Readings at the reference's length say nothing of the power; the power stays within [1, 2].
    scaling.observe(2_000, BatchSize(8, 16), 1_000, short)
    assert len(scaling.powers) == 1
    scaling.observe(100, long, 1_000, short)
    scaling.observe(100, long, 1_000, short)
    assert scaling.power == 1.0
