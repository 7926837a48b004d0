"""A zoo of real architectures, built tiny from ``transformers`` configs (no weights are downloaded).

One builder per architecture, as in transformers' ``ModelTesterMixin``, so one conformance suite (``tests/test_zoo.py``)
and one benchmark (``benchmarks/zoo.py``) run the same checks on every kind of model users train. Dropout stays on
everywhere, so exactness also covers the RNG replayed by recompute."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.testing.hf import image_batch

__all__ = ["ZOO", "ZooCase", "build", "exactness", "memory_errors", "tune_at_half_activation"]

VOCAB = 64
SEQ = 16
BATCH = 2


@dataclass
class ZooCase:
    name: str
    model: nn.Module
    batch_for: Callable[[int], dict[str, Any]]  # step -> the model's keyword arguments
    note: str = ""  # what is special about this architecture

    def loss(self, step: int = 0, batch: dict[str, Any] | None = None) -> torch.Tensor:
        out = self.model(**(batch if batch is not None else self.batch_for(step)))
        return out["loss"] if isinstance(out, dict) else out.loss


def _ids(step: int, vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ, low: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(low, vocab, (batch, seq), generator=g)


def _lm(step: int) -> dict[str, Any]:
    ids = _ids(step)
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _seq2seq(step: int) -> dict[str, Any]:
    return {"input_ids": _ids(step), "labels": _ids(step + 500, seq=SEQ // 2), "use_cache": False}


def _images(step: int) -> dict[str, Any]:
    return image_batch(BATCH, seed=2000 + step)


# The sizes the tiny transformers share.
_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
_TINY_TEXT = dict(_TINY, max_position_embeddings=64)
_DECODER = dict(_TINY_TEXT, num_key_value_heads=2, attention_dropout=0.1)
_TINY_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, pad_token_id=1, bos_token_id=0, eos_token_id=2)
for _side in ("encoder", "decoder"):
    _TINY_SEQ2SEQ.update({f"{_side}_attention_heads": 4, f"{_side}_ffn_dim": 64})


def _sdpa(cfg: Any) -> Any:
    cfg._attn_implementation = "sdpa"
    return cfg


def nanogpt() -> ZooCase:
    from lightning_ckpt.testing.nanogpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=VOCAB, block_size=SEQ, dropout=0.1))

    class Wrapped(nn.Module):  # the zoo's calling convention: keyword batch in, an output with .loss out
        def __init__(self) -> None:
            super().__init__()
            self.gpt = model

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, use_cache: bool = False) -> Any:
            return {"loss": self.gpt(input_ids, labels)}

    return ZooCase("nanogpt", Wrapped(), _lm, "the package's own GPT")


def gpt2() -> ZooCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4, bos_token_id=None, eos_token_id=None
    )
    return ZooCase("gpt2", GPT2LMHeadModel(_sdpa(cfg)), _lm, "decoder-only, tied embeddings")


def llama() -> ZooCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    return ZooCase("llama", LlamaForCausalLM(_sdpa(LlamaConfig(**_DECODER))), _lm, "decoder-only, GQA")


def qwen2() -> ZooCase:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return ZooCase("qwen2", Qwen2ForCausalLM(_sdpa(Qwen2Config(**_DECODER))), _lm, "decoder-only")


def mistral() -> ZooCase:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**_DECODER, sliding_window=8)
    return ZooCase("mistral", MistralForCausalLM(_sdpa(cfg)), _lm, "decoder-only, sliding window")


def mixtral() -> ZooCase:
    from transformers import MixtralConfig, MixtralForCausalLM

    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
    cfg = MixtralConfig(**_DECODER, num_local_experts=4, **moe)
    return ZooCase("mixtral", MixtralForCausalLM(_sdpa(cfg)), _lm, "MoE, router aux loss in the loss")


def qwen2_moe() -> ZooCase:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    moe = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02, decoder_sparse_step=1)
    sizes = dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[])
    cfg = Qwen2MoeConfig(**_DECODER, **sizes, **moe)
    return ZooCase("qwen2_moe", Qwen2MoeForCausalLM(_sdpa(cfg)), _lm, "MoE with a shared expert, router aux loss")


def bert() -> ZooCase:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(**_TINY_TEXT, num_labels=3)

    def batch(step: int) -> dict[str, Any]:
        ids = _ids(step)
        mask = torch.ones_like(ids)
        mask[0, SEQ // 2 :] = 0  # the first sequence is padded: the mask matters
        g = torch.Generator().manual_seed(3000 + step)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (BATCH,), generator=g)}

    return ZooCase("bert", BertForSequenceClassification(_sdpa(cfg)), batch, "encoder, padded attention mask")


def albert() -> ZooCase:
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(**_TINY_TEXT, embedding_size=16)

    def batch(step: int) -> dict[str, Any]:
        ids = _ids(step)
        return {"input_ids": ids, "labels": ids.clone()}

    return ZooCase("albert", AlbertForMaskedLM(_sdpa(cfg)), batch, "one layer shared across depth")


def t5() -> ZooCase:
    from transformers import T5Config, T5ForConditionalGeneration

    sizes = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4)
    cfg = T5Config(**sizes, decoder_start_token_id=0, pad_token_id=0)
    return ZooCase("t5", T5ForConditionalGeneration(cfg), _seq2seq, "encoder-decoder, shared position bias")


def bart() -> ZooCase:
    from transformers import BartConfig, BartForConditionalGeneration

    layers = dict(encoder_layers=4, decoder_layers=4, encoder_layerdrop=0.5, decoder_layerdrop=0.5)
    cfg = BartConfig(**_TINY_SEQ2SEQ, **layers, max_position_embeddings=64, decoder_start_token_id=2)
    return ZooCase("bart", BartForConditionalGeneration(_sdpa(cfg)), _seq2seq, "encoder-decoder, LayerDrop 0.5")


def whisper() -> ZooCase:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    audio = dict(num_mel_bins=8, encoder_layers=3, decoder_layers=3, max_source_positions=16, max_target_positions=32)
    cfg = WhisperConfig(**_TINY_SEQ2SEQ, **audio, decoder_start_token_id=0, dropout=0.1)

    def batch(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(4000 + step)
        return {
            "input_features": torch.randn(BATCH, 8, 32, generator=g),
            "labels": _ids(step, seq=8),
            "use_cache": False,
        }

    return ZooCase("whisper", WhisperForConditionalGeneration(_sdpa(cfg)), batch, "speech encoder-decoder")


def vit() -> ZooCase:
    from transformers import ViTConfig, ViTForImageClassification

    sizes = {k: v for k, v in _TINY.items() if k != "vocab_size"}
    cfg = ViTConfig(**sizes, image_size=32, patch_size=8, num_labels=10, hidden_dropout_prob=0.1)
    return ZooCase("vit", ViTForImageClassification(_sdpa(cfg)), _images, "vision transformer")


def resnet() -> ZooCase:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[3, 3], layer_type="basic", num_labels=10)
    return ZooCase("resnet", ResNetForImageClassification(cfg), _images, "CNN, BatchNorm, blocks inside stages")


def convnext() -> ZooCase:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[3, 3], num_labels=10, image_size=32)
    return ZooCase("convnext", ConvNextForImageClassification(cfg), _images, "CNN, blocks inside stages")


_BUILDERS = (nanogpt, gpt2, llama, qwen2, mistral, mixtral, qwen2_moe, bert, albert, t5, bart, whisper, vit, resnet)
ZOO: dict[str, Callable[[], ZooCase]] = {f.__name__: f for f in (*_BUILDERS, convnext)}


def build(name: str, seed: int = 0) -> ZooCase:
    """The named case, seeded, in train mode (dropout and LayerDrop on)."""
    torch.manual_seed(seed)
    case = ZOO[name]()
    case.model.train()
    return case


# ---------------------------------------------------------------------------------------------------
# The conformance checks, shared by tests/test_zoo.py (asserts) and benchmarks/zoo.py (the README table).
# ---------------------------------------------------------------------------------------------------
def _train(name: str, plan: Any, steps: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], dict]:
    """``steps`` seeded SGD steps of a fresh ``name`` model under ``plan`` (None: no plan)."""
    from lightning_ckpt.plan.apply import plan_applied

    case = build(name)
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.1)
    losses, grads = [], []
    handle = plan_applied(case.model, plan) if plan is not None else contextlib.nullcontext()
    with handle:
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # dropout and LayerDrop draw differently on every step
            loss = case.loss(step)
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None})
            optimizer.step()
    return losses, grads, {k: v.clone() for k, v in case.model.state_dict().items()}


def exactness(name: str, plans: dict[str, Any], steps: int = 3) -> dict[str, list[str]]:
    """Per plan, what differs bit for bit from no plan over ``steps`` optimizer steps: losses, every
    gradient of every step, buffers and weights afterwards (an empty list: exact)."""
    ref_losses, ref_grads, ref_state = _train(name, None, steps)
    out = {}
    for label, plan in plans.items():
        losses, grads, state = _train(name, plan, steps)
        diffs = [f"loss@{i}" for i, (a, b) in enumerate(zip(ref_losses, losses, strict=True)) if not torch.equal(a, b)]
        for i, (ref, got) in enumerate(zip(ref_grads, grads, strict=True)):
            if ref.keys() != got.keys():
                diffs.append(f"grads@{i}: {sorted(ref.keys() ^ got.keys())[:3]}")
            diffs += [f"grad@{i}:{n}" for n in ref if n in got and not torch.equal(ref[n], got[n])]
        diffs += [f"state:{k}" for k, v in ref_state.items() if not torch.equal(v, state[k])]
        out[label] = diffs
    return out


def _forward(case: ZooCase) -> tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
    batch = case.batch_for(0)

    def forward() -> torch.Tensor:
        torch.manual_seed(7)  # the same dropout and LayerDrop draws in the profile and in every measurement
        return case.loss(batch=batch)

    return forward, tuple(v for v in batch.values() if isinstance(v, torch.Tensor))


def memory_errors(name: str) -> dict[str, tuple[int, int]]:
    """Per baseline, (predicted, measured) activation bytes: the profile's prediction against the live-tensor
    tracker's reading of a real step under that plan."""
    from lightning_ckpt.measure.step import track_step_memory
    from lightning_ckpt.memory.profile import profile_memory
    from lightning_ckpt.plan.apply import plan_applied
    from lightning_ckpt.plan.baselines import baselines

    case = build(name)
    forward, extra = _forward(case)
    model = profile_memory(case.model, forward, extra=extra)
    out = {}
    for label, plan in baselines(case.model, memory_model=model).items():  # those the profile shows can run
        with plan_applied(case.model, plan):
            reading = track_step_memory(lambda: forward().backward(), model=case.model, extra=extra)
        case.model.zero_grad(set_to_none=True)
        out[label] = (model.predict_activation(plan), reading.activation_bytes)
    return out


def tune_at_half_activation(name: str, **settings: Any) -> Any:
    """``tune()`` under ``activation_budget=0.5`` with a short search; returns the ``TuneResult``."""
    from lightning_ckpt.search.tune import tune

    case = build(name)
    forward, extra = _forward(case)
    defaults = dict(n_trials=6, warmup_steps=0, measure_steps=1, process_warmup_steps=1, confirm_rounds=1)
    config = TuneConfig(**{**defaults, "confirm_max_rounds": 1, "confirm_top": 2, **settings})
    return tune(case.model, forward, activation_budget=0.5, extra_tensors=extra, batch_size=BATCH, config=config)
