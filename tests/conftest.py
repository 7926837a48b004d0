from __future__ import annotations

import os

import pytest
import torch

from lightning_ckpt.testing import GPT, GPTConfig
from lightning_ckpt.versions import torch_version


def pytest_configure(config):
    # Under pytest -n 2 (the README command) two workers share the two cores: one intra-op thread each keeps
    # them from oversubscribing the machine (two pools of two threads spin against each other).
    # Not on torch 2.6: its inductor, compiling on CPU with one intra-op thread, emits wrong code for the test
    # GPT's backward (the tied embedding weight's gradient differs from eager in a third of its elements, with no
    # plan applied; reproduced with a fresh inductor cache, and 2.13 compiles it right), and the kernel then sits in
    # the on-disk cache for every later process, whatever its threads. The oldest leg pays the oversubscription.
    if os.environ.get("PYTEST_XDIST_WORKER") and (torch_version() or (99, 0)) >= (2, 7):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=48, block_size=32, dropout=0.1))


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(1))
