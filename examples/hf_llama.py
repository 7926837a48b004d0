"""Tune activation checkpointing for a HuggingFace ``LlamaForCausalLM``, unmodified, on GPU or CPU.

The model is built from a small ``LlamaConfig`` (random weights; nothing is downloaded) and trained
as a character-level language model on train_gpt.py's offline corpus (standard-library docstrings).
The tuner finds the decoder layers (``model.model.layers``) and their children (``self_attn``,
``mlp``) by itself: the HF model is neither edited nor wrapped, and its ``gradient_checkpointing``
switch stays off. The chosen plan goes to ``plans/llama.json``, TensorBoard logs under ``runs/``.

On a CUDA GPU (``--accelerator auto``, the default, picks it) the Llama is 12 layers, 768 wide (4 key-value
heads of 12), 1024 characters of context, batch 16, in bf16-mixed where the card supports it; on CPU it is
8 layers, 128 wide, 128 characters, batch 16.

Run:           python examples/hf_llama.py
On CPU only:   python examples/hf_llama.py --accelerator cpu
Reuse a plan:  python examples/hf_llama.py --reuse        (zero trials)
Quick check:   python examples/hf_llama.py --fast
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ckpt import ActivationCheckpointTuner

# train_gpt.py owns the offline corpus; this keeps it importable however this file is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import CharDataset, on_cuda, stdlib_corpus, trainer_device  # noqa: E402


class LlamaLM(L.LightningModule):
    def __init__(self, config: LlamaConfig, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        # use_cache=False: a KV cache is for generation; in training it only holds memory. The loss is
        # computed here because CharDataset's targets are already shifted (HF's labels= would shift again).
        logits = self.model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def llama_config(vocab_size: int, *, fast: bool, cuda: bool = False) -> LlamaConfig:
    """A Llama with the real architecture (RMSNorm, RoPE, SwiGLU, grouped-query attention), only smaller."""
    if fast:
        layers, hidden, seq, heads, kv_heads = 4, 32, 32, 4, 2
    elif cuda:
        layers, hidden, seq, heads, kv_heads = 12, 768, 1024, 12, 4
    else:
        layers, hidden, seq, heads, kv_heads = 8, 128, 128, 4, 2
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="tiny model and a handful of steps (used by tests)")
    parser.add_argument(
        "--accelerator", choices=("auto", "gpu", "cpu"), default="auto", help="auto: the CUDA GPU when there is one"
    )
    parser.add_argument("--reuse", action="store_true", help="apply the saved plan file without searching")
    parser.add_argument("--activation-budget", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trials", type=int, default=14)
    parser.add_argument("--plan", type=Path, default=Path("plans/llama.json"))
    parser.add_argument("--logs", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    text = stdlib_corpus()
    vocab = sorted(set(text))
    config = llama_config(len(vocab), fast=args.fast, cuda=on_cuda(args.accelerator))
    batch_size, steps, trials, measure_steps = (
        (4, 3, min(args.trials, 6), 1) if args.fast else (16, args.steps, args.trials, 2)
    )
    dataset = CharDataset(text, config.max_position_embeddings, vocab)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0)

    if args.reuse:
        tuner = ActivationCheckpointTuner(plan=args.plan)
    else:
        tuner = ActivationCheckpointTuner(
            activation_budget=args.activation_budget,
            plan_path=args.plan,
            search=dict(n_trials=trials, measure_steps=measure_steps),
        )
    trainer = L.Trainer(
        **trainer_device(args.accelerator),
        max_steps=steps,
        callbacks=[tuner],
        logger=TensorBoardLogger(args.logs, name="llama"),
        enable_checkpointing=False,
        log_every_n_steps=5,
        enable_model_summary=False,
    )
    trainer.fit(LlamaLM(config), loader)
    final_loss = float(trainer.callback_metrics["train_loss"])
    print(f"\nplan: {tuner.plan.describe() if tuner.plan else None}; trials run: {tuner.trials_run}; "
          f"final train loss {final_loss:.3f}")  # fmt: skip
    print(f"inspect the plan: lightning-ckpt show {args.plan}")
    print(f"view the search:  tensorboard --logdir {args.logs}")
    return {"plan": tuner.plan, "trials": tuner.trials_run, "loss": final_loss}


if __name__ == "__main__":
    main()
