"""The KV-cache notice is said only where a cache would really be built (issue 35, item 11)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_ckpt.plan import caches
from lightning_ckpt.plan.caches import kv_cache_disabled

transformers = pytest.importorskip("transformers")

NOTICE = "builds a KV cache in every training forward"


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(caches, "_said", set())


def _gpt2():
    from lightning_ckpt.testing.hf import tiny_gpt2

    return tiny_gpt2(layers=2, hidden=32, vocab=64)


def _roberta():
    config = transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=40)  # fmt: skip
    assert config.use_cache and not config.is_decoder, "an encoder whose config keeps HF's use_cache=True"
    return transformers.RobertaForMaskedLM(config)


def _said(caplog, model, **call) -> bool:
    ids = torch.randint(0, 64, (2, 8))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=caches.__name__), kv_cache_disabled(model):
        model(input_ids=ids, labels=ids, **call)
        model(input_ids=ids, labels=ids, **call)
    return NOTICE in caplog.text


def test_a_decoder_that_would_build_a_cache_is_told_once(caplog):
    model = _gpt2()
    assert _said(caplog, model)
    assert caplog.text.count(NOTICE) == 1
    assert model.config.use_cache, "the user's setting comes back"


def test_an_encoder_only_model_and_a_call_that_turns_the_cache_off_are_not(caplog):
    assert not _said(caplog, _roberta())
    model = _gpt2()
    assert not _said(caplog, model, use_cache=False), "the call already passes use_cache=False"
    assert not model._forward_pre_hooks, "no hook is left behind"
    assert model.config.use_cache
