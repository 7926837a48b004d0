"""Small things a user reads (issue #64, item 9): counts that agree with their noun, example names in the model's
order. Each is a line a first run printed wrong."""

from __future__ import annotations

import pytest

from lightning_ckpt import BlockPlan, Plan, apply_plan
from lightning_ckpt.budget import Budget
from lightning_ckpt.errors import PlanError
from lightning_ckpt.formatting import count
from lightning_ckpt.plan.format import closest_names
from lightning_ckpt.report.text import time_model_line
from lightning_ckpt.search.result import TuneResult
from lightning_ckpt.testing import GPT, GPTConfig


def test_a_count_agrees_with_its_noun():
    assert [count(n, "plan") for n in (0, 1, 2)] == ["0 plans", "1 plan", "2 plans"]
    assert count(1, "leading plan") == "1 leading plan" and count(3, "graph") == "3 graphs"


def test_the_time_model_line_of_a_search_that_measured_one_plan_says_1_plan():
    summary = {"predicted_and_measured": 1, "median_abs_error": 0.02, "max_abs_error": 0.02, "noise_margin": 0.05,
               "pruned_by_time": 1}  # fmt: skip
    best = Plan(metadata={"search": {"time_model": summary}})
    result = TuneResult(best, None, (), Budget("none"), tuning_seconds=1.0, tuning_steps=1)
    line = time_model_line(result)
    assert "over 1 plan predicted, then measured" in line and "1 plan pruned as unable" in line, line
    assert "1 plans" not in line


def test_an_unknown_block_is_refused_with_example_names_in_the_models_order():
    # difflib ranks by similarity: "'transformer.h.10', 'transformer.h.1', 'transformer.h.11'" read as a shuffle.
    model = GPT(GPTConfig(n_layer=12, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    with pytest.raises(PlanError) as err:
        apply_plan(model, Plan({"transformer.h.1x": BlockPlan("full")}))
    assert "'transformer.h.1', 'transformer.h.10', 'transformer.h.11'" in str(err.value), str(err.value)
    assert closest_names("zzz", ["b.10", "b.2", "a.1"]) == "'a.1', 'b.2', 'b.10'"
