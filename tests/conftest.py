from __future__ import annotations

import os

import pytest
import torch

from lightning_ckpt.testing import GPT, GPTConfig
from lightning_ckpt.versions import torch_version


def pytest_configure(config):
    # Under pytest -n 2 (the README command) two workers share the two cores: one intra-op thread each keeps
    # them from oversubscribing the machine (two pools of two threads spinning against each other made eager
    # steps up to 10x slower on the torch 2.6 leg).
    # On torch 2.6 inductor reads the thread count at compile time, and with one thread it emits wrong code for
    # the test GPT's backward (the tied embedding weight's gradient differs from eager in a third of its
    # elements, with no plan applied; reproduced with a fresh inductor cache, and 2.13 compiles it right). There
    # its kernels are compiled for the machine's threads (config.cpp.threads) while eager runs one.
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if (torch_version() or (99, 0)) < (2, 7):
        from torch._inductor import config as inductor_config

        inductor_config.cpp.threads = torch.get_num_threads()
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
