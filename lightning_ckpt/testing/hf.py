"""Small HuggingFace models built from configs (no weights are downloaded), for tests and benchmarks.

``transformers`` is an optional (dev) dependency; these factories import it when called."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["image_batch", "lm_batch", "tiny_gpt2", "tiny_llama", "tiny_vit"]


def tiny_llama(*, layers: int = 4, hidden: int = 64, vocab: int = 128, dropout: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, attention_dropout=dropout)
    cfg = LlamaConfig(**sizes, **heads, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def tiny_gpt2(*, layers: int = 4, hidden: int = 64, vocab: int = 128, dropout: float = 0.1) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    drop = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), dropout)
    sizes = dict(vocab_size=vocab, n_positions=256, n_embd=hidden, n_layer=layers, n_head=4)
    cfg = GPT2Config(**sizes, **drop, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(cfg)


def tiny_vit(
    *, layers: int = 4, hidden: int = 64, image_size: int = 32, patch: int = 8, labels: int = 10, dropout: float = 0.1
) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    sizes = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=hidden * 4)
    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    cfg = ViTConfig(image_size=image_size, patch_size=patch, num_channels=3, num_labels=labels, **sizes, **drop)
    return ViTForImageClassification(cfg)


def lm_batch(vocab: int = 128, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def image_batch(batch: int = 2, image_size: int = 32, labels: int = 10, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(batch, 3, image_size, image_size, generator=g),
        "labels": torch.randint(0, labels, (batch,), generator=g),
    }
