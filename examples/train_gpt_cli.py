"""The character-level GPT of train_gpt.py behind LightningCLI, so YAML files under configs/ drive it.

Every argument of ``ActivationCheckpointTuner`` is a YAML key under ``trainer.callbacks``; the model
and data sizes are keys under ``model`` and ``data``. Nothing is downloaded (the corpus is the
standard library's docstrings, as in train_gpt.py).

Run:           python examples/train_gpt_cli.py fit --config configs/cpu_quickstart.yaml
Reuse a plan:  python examples/train_gpt_cli.py fit --config configs/reuse_plan.yaml
Override:      python examples/train_gpt_cli.py fit --config configs/cpu_quickstart.yaml --trainer.max_steps 20
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

from lightning_ckpt.testing import GPT, GPTConfig

# train_gpt.py owns the offline corpus; this keeps it importable however this file is run
# (as a script, from the tests, or from another directory).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import CharDataset, stdlib_corpus  # noqa: E402


class CharDataModule(L.LightningDataModule):
    """The standard-library docstring corpus, cut into ``block_size``-character windows.

    The vocabulary is known once the corpus is read, so the CLI links ``data.vocab_size`` into
    ``model.vocab_size`` instead of asking the user to type it.
    """

    def __init__(self, block_size: int = 128, batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__()
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.text = stdlib_corpus()
        self.vocab = sorted(set(self.text))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def train_dataloader(self) -> DataLoader:
        dataset = CharDataset(self.text, self.block_size, self.vocab)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)


class CharGPTModule(L.LightningModule):
    """nanoGPT with flat hyperparameters, so YAML says ``n_layer: 8`` rather than a nested config.

    Args:
        compile: compile the GPT in place (``nn.Module.compile``), which keeps every module name, so
            a plan tuned eagerly applies to the compiled model and vice versa.
    """

    def __init__(
        self,
        n_layer: int = 8,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        vocab_size: int = 96,
        dropout: float = 0.1,
        lr: float = 3e-3,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPTConfig(
            n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size, dropout=dropout
        )
        self.model = GPT(config)
        if compile:
            self.model.compile()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class CharGPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One source of truth for sizes the data decides: the window length and the vocabulary.
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None, *, run: bool = True) -> CharGPTCLI:
    """Build (and by default run) the CLI; tests pass ``args`` and read the trainer and callbacks back."""
    return CharGPTCLI(CharGPTModule, CharDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
