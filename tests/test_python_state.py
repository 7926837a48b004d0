"""The search leaves the model's Python attributes and forward-written parameters as a run with no search would.

Issue cases: a counter-driven curriculum in ``training_step`` (``self.calls += 1``) was advanced by every
trial, so the first real step skipped the curriculum; ``nn.Embedding(max_norm=...)`` renormalises rows in
place in forward, which aborted the fit with advice about ``optimizer.step()``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lit import LitGPT, quiet_trainer, token_loader
from torch import nn

from lightning_ckpt import ActivationCheckpointTuner, apply_plan, tune
from lightning_ckpt.measure.python_state import PythonState
from lightning_ckpt.measure.snapshot import WRITTEN_IN_FORWARD, find_parameters_written_in_forward
from lightning_ckpt.search.config import TuneConfig


class Curriculum:
    def __init__(self) -> None:
        self.stage = 0
        self.history: list[int] = []


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.name = "a"
        self.lengths: list[int] = [1]
        self.table = {"k": (1, 2)}
        self.curriculum = Curriculum()
        self.scratch = torch.zeros(2)  # a plain tensor attribute, not a buffer
        self.other = self.lin  # a submodule reference held twice

    def forward(self, x):
        self.calls += 1
        self.name += "b"
        self.lengths.append(x.shape[0])
        self.table["k"] = (9,)
        self.curriculum.stage += 1
        self.curriculum.history.append(self.calls)
        self.fresh = "created in forward"
        return self.lin(x).sum()


def test_plain_attributes_are_put_back_in_place_new_ones_removed_and_tensors_named():
    m = Stateful()
    lengths, curriculum = m.lengths, m.curriculum
    state = PythonState.capture(m)
    m(torch.randn(3, 4))
    m.scratch.add_(1)
    m.curriculum = Curriculum()  # rebound: the original object comes back
    state.restore()
    assert (m.calls, m.name, m.table, m.lengths) == (0, "a", {"k": (1, 2)}, [1])
    assert m.lengths is lengths  # restored in place: other references see the restored list
    assert m.curriculum is curriculum and (curriculum.stage, curriculum.history) == (0, [])
    assert not hasattr(m, "fresh")
    assert state.unrestorable == {"scratch"}
    with pytest.warns(UserWarning, match=r"scratch.*register_buffer"):
        state.warn_unrestorable()


def test_restoring_wrapper_makes_every_call_see_the_first_calls_state():
    m = Stateful()
    step = PythonState.capture(m).restoring(lambda: m(torch.randn(2, 4)))
    for _ in range(3):
        step()
        assert m.calls == 0 and m.curriculum.stage == 0


def test_parameters_written_in_forward_are_found_marked_and_left_as_they_were():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, max_norm=0.5)
    with torch.no_grad():
        emb.weight.mul_(10)  # every row over max_norm
    before = emb.weight.detach().clone()
    found = find_parameters_written_in_forward(emb, lambda: emb(torch.tensor([1, 2])).sum())
    assert found == ("weight",)
    assert getattr(emb.weight, WRITTEN_IN_FORWARD) is True
    assert torch.equal(emb.weight, before)  # the detection step's renorm was undone


# ---------------------------------------------------------------------------------------------------
# End to end: a fit with the tuner trains exactly as a fit with the chosen plan applied by hand.
# ---------------------------------------------------------------------------------------------------
class CurriculumGPT(LitGPT):
    """Short sequences for the first two calls of training_step, then full length (a counter-driven curriculum)."""

    def __init__(self, max_norm: float | None = None) -> None:
        super().__init__(n_layer=4, n_embd=32, vocab_size=48, block_size=16, dropout=0.1, lr=1e-2)
        if max_norm is not None:
            self.model.transformer.wte.max_norm = max_norm
        self.calls = 0
        self.shapes: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        if self.calls <= 2:
            x, y = x[:, :4], y[:, :4]
        self.shapes.append(tuple(x.shape))
        return self.model(x, y)


def _fit(tmp_path, module, callbacks):
    L.seed_everything(3)
    quiet_trainer(tmp_path, callbacks, steps=4).fit(module, token_loader(32))
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["curriculum", "curriculum_and_embedding_max_norm"])
def test_a_fit_with_the_tuner_trains_as_the_chosen_plan_applied_by_hand(tmp_path, max_norm):
    cb = ActivationCheckpointTuner(
        activation_budget=0.6, verbose=False, search=dict(n_trials=6, measure_steps=1, warmup_steps=1)
    )
    tuned = CurriculumGPT(max_norm)
    with_tuner = _fit(tmp_path / "a", tuned, [cb])
    assert tuned.calls == 4, "the search must not advance the step counter"
    assert tuned.shapes == [(8, 4), (8, 4), (8, 16), (8, 16)]
    by_hand = CurriculumGPT(max_norm)
    apply_plan(by_hand, cb.plan)
    plain = _fit(tmp_path / "b", by_hand, [])
    for name, value in plain.items():
        assert torch.equal(with_tuner[name], value), name


def test_profile_and_trials_see_the_batch_of_the_first_call():
    torch.manual_seed(0)
    module = CurriculumGPT()
    x, y = next(iter(token_loader(32)))
    seen: list[tuple[int, ...]] = []

    def step():
        out = module.training_step((x, y), 0)
        seen.append(module.shapes[-1])
        return out

    tune(module, step, batch_size=8, config=TuneConfig(n_trials=4, measure_steps=1, warmup_steps=1))
    assert module.calls == 0 and module.shapes == []
    assert set(seen) == {(8, 4)}, "every step of the search sees what the first real call sees"
