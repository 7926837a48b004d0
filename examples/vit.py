"""Tune activation checkpointing for a HuggingFace ``ViTForImageClassification``, unmodified, on GPU or CPU.

The task is synthetic but learnable, so nothing is downloaded: each image is faint noise with one
bright square, and the label is the quadrant the square sits in. The images are generated from a
fixed seed, so every run sees the same data. The tuner finds the encoder layers (``vit.layers``)
and their children (``attention``, ``mlp``) by itself; the HF model is neither edited nor wrapped.
The chosen plan goes to ``plans/vit.json``, TensorBoard logs under ``runs/``.

On a CUDA GPU (``--accelerator auto``, the default, picks it) the model is ViT-S-sized (12 layers, 384 wide)
on 64x64 images cut into 4x4 patches (257 tokens), batch 128, in bf16-mixed where the card supports it; on
CPU it is 8 layers, 128 wide, on 32x32 images in 8x8 patches (17 tokens), batch 32.

Run:           python examples/vit.py
On CPU only:   python examples/vit.py --accelerator cpu
Reuse a plan:  python examples/vit.py --reuse        (zero trials)
Quick check:   python examples/vit.py --fast
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import ViTConfig, ViTForImageClassification

from lightning_ckpt import ActivationCheckpointTuner

# train_gpt.py owns the device choice (--accelerator); this keeps it importable however this file is run.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import on_cuda, trainer_device  # noqa: E402

QUADRANTS = ("top-left", "top-right", "bottom-left", "bottom-right")


def quadrant_images(n: int, *, image_size: int = 32, seed: int = 0) -> TensorDataset:
    """``n`` noise images, each with one bright square (a quarter of the side) inside one quadrant.

    The square's position inside its quadrant is random, so the model has to look at the pixels
    rather than memorise a few patches; the label (0-3, see ``QUADRANTS``) is that quadrant.
    """
    g = torch.Generator().manual_seed(seed)
    images = 0.1 * torch.randn(n, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, len(QUADRANTS), (n,), generator=g)
    half, side = image_size // 2, image_size // 4
    offsets = torch.randint(0, half - side + 1, (n, 2), generator=g)
    for i, (label, (dy, dx)) in enumerate(zip(labels.tolist(), offsets.tolist(), strict=True)):
        top, left = (label // 2) * half + dy, (label % 2) * half + dx
        images[i, :, top : top + side, left : left + side] += 1.0
    return TensorDataset(images, labels)


class ViTClassifier(L.LightningModule):
    def __init__(self, config: ViTConfig, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = ViTForImageClassification(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self.model(pixel_values=images).logits
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(-1) == labels).float().mean(), prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def vit_config(*, fast: bool, cuda: bool = False) -> ViTConfig:
    """A ViT with the real architecture (patch embedding, [CLS] token, pre-norm encoder), only smaller."""
    if fast:
        layers, hidden, heads, image, patch = 4, 32, 4, 32, 8  # 16 patches + [CLS]
    elif cuda:
        layers, hidden, heads, image, patch = 12, 384, 6, 64, 4  # ViT-S width, 256 patches + [CLS]
    else:
        layers, hidden, heads, image, patch = 8, 128, 4, 32, 8
    return ViTConfig(
        image_size=image,
        patch_size=patch,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        num_labels=len(QUADRANTS),
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="tiny model and a handful of steps (used by tests)")
    parser.add_argument(
        "--accelerator", choices=("auto", "gpu", "cpu"), default="auto", help="auto: the CUDA GPU when there is one"
    )
    parser.add_argument("--reuse", action="store_true", help="apply the saved plan file without searching")
    parser.add_argument("--activation-budget", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--trials", type=int, default=14)
    parser.add_argument("--plan", type=Path, default=Path("plans/vit.json"))
    parser.add_argument("--logs", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    cuda = on_cuda(args.accelerator)
    config = vit_config(fast=args.fast, cuda=cuda)
    if args.fast:
        n_images, batch_size, steps, trials, measure_steps = 256, 8, 3, min(args.trials, 6), 1
    else:
        n_images, batch_size, steps, trials, measure_steps = 4096, 128 if cuda else 32, args.steps, args.trials, 2
    loader = DataLoader(quadrant_images(n_images, image_size=config.image_size), batch_size=batch_size, shuffle=True)

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
        logger=TensorBoardLogger(args.logs, name="vit"),
        enable_checkpointing=False,
        log_every_n_steps=5,
        enable_model_summary=False,
    )
    trainer.fit(ViTClassifier(config), loader)
    final_loss = float(trainer.callback_metrics["train_loss"])
    final_acc = float(trainer.callback_metrics["train_acc"])
    print(f"\nplan: {tuner.plan.describe() if tuner.plan else None}; trials run: {tuner.trials_run}; "
          f"final train loss {final_loss:.3f}, accuracy {final_acc:.0%} (chance: 25%)")  # fmt: skip
    print(f"inspect the plan: lightning-ckpt show {args.plan}")
    print(f"view the search:  tensorboard --logdir {args.logs}")
    return {"plan": tuner.plan, "trials": tuner.trials_run, "loss": final_loss, "accuracy": final_acc}


if __name__ == "__main__":
    main()
