"""The tiny nanoGPT LightningModule, random-token batches and quiet CPU Trainer that the Lightning tests share.

A test file subclasses ``LitGPT`` only for what it tests (a fault in ``training_step``, a buffer, a metric,
an ``optimizer_step`` that reads memory); sizes, seeds and data stay arguments, so each test keeps the model
and the batches its assertions were written for. Imported as ``from lit import ...``, like ``faults.py``:
pytest puts tests/ on ``sys.path``, and the ``*_worker.py`` scripts run from tests/.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.testing import GPT, GPTConfig


class LitGPT(L.LightningModule):
    """``self.model``, a GPT seeded with 0 (or one built elsewhere), trained on ``(x, y)`` batches."""

    def __init__(
        self,
        *,
        n_layer: int = 4,
        n_embd: int = 32,
        vocab_size: int = 48,
        block_size: int = 16,
        dropout: float = 0.1,
        model: nn.Module | None = None,
        optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        if model is None:
            torch.manual_seed(0)
            sizes = dict(n_layer=n_layer, n_head=2, n_embd=n_embd, vocab_size=vocab_size, block_size=block_size)
            model = GPT(GPTConfig(**sizes, dropout=dropout))
        self.model = model
        self.optimizer_class, self.lr = optimizer, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, y)

    def configure_optimizers(self):
        return self.optimizer_class(self.parameters(), lr=self.lr)


def token_dataset(n: int, seq: int = 16, *, vocab: int = 48, seed: int | None = 0) -> TensorDataset:
    """``n`` random token rows as (input, next-token target) pairs; ``seed=None`` draws from the global RNG."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, seq + 1), generator=generator)
    return TensorDataset(data[:, :-1], data[:, 1:])


def token_loader(n: int, seq: int = 16, *, vocab: int = 48, batch_size: int = 8, seed: int | None = 0) -> DataLoader:
    """In order (no shuffling): the tuner's first batch, and so what it tunes on, is the same every run."""
    return DataLoader(token_dataset(n, seq, vocab=vocab, seed=seed), batch_size=batch_size, shuffle=False)


def quiet_trainer(tmp_path: Path | None, callbacks: list, *, steps: int, **kwargs) -> L.Trainer:
    """A CPU Trainer that writes and prints nothing of its own; ``kwargs`` add to or override its settings."""
    settings = dict(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})
