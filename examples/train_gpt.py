"""Train a character-level nanoGPT with ActivationCheckpointTuner, on the GPU when there is one.

The corpus is the documentation the Python standard library ships (module, class and function
docstrings), so nothing is downloaded. The memory budget (``--activation-budget``, a fraction of
the no-checkpointing activation memory) is tight enough that checkpointing is necessary; the tuner
searches plans on the first batch, applies the fastest one that fits, writes ``plans/gpt.json`` and
TensorBoard logs under ``runs/``, then training continues with that plan.

On a CUDA GPU (``--accelerator auto``, the default, picks it) the model has GPT-2-small's shape (12 layers,
768 wide, 1024 characters of context, batch 32: roughly 8 GiB of activations without checkpointing) and
trains in bf16-mixed where the card supports it; on CPU it is 8 layers, 128 wide, 128 characters, batch 16.
The budget is a share of that activation memory on both, so it binds on any card.

Run:           python examples/train_gpt.py
On CPU only:   python examples/train_gpt.py --accelerator cpu
Reuse a plan:  python examples/train_gpt.py --reuse        (zero trials)
Re-plan:       python examples/train_gpt.py --reuse --activation-budget 0.3   (writes plans/gpt-0.3.json)
               (another budget, from the profile the plan file keeps: zero trials, the first steps checked)
Quick check:   python examples/train_gpt.py --fast

On a shared machine the CPU run takes the cores that are free: it reads the load average when it starts and runs
torch on that many threads (``--threads`` sets them), since a thread on a core another job holds makes every step
wait for it. ``--accelerator gpu`` needs a CUDA build of torch (the README's "On a GPU" says how to install one).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ckpt import ActivationCheckpointTuner
from lightning_ckpt.testing import GPT, GPTConfig

STDLIB_MODULES = (
    "argparse", "collections", "contextlib", "dataclasses", "functools", "itertools", "json", "logging",
    "pathlib", "random", "re", "statistics", "string", "textwrap", "typing", "unittest", "heapq", "bisect",
    "fractions", "decimal", "difflib", "calendar", "csv", "shutil", "tempfile", "threading", "queue",
)  # fmt: skip


def stdlib_corpus() -> str:
    """Docstrings of a fixed list of standard-library modules: ~0.5 MB of English text, offline."""
    parts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, attr, None))
            if doc and len(doc) > 40:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int, vocab: list[str]) -> None:
        self.stoi = {c: i for i, c in enumerate(vocab)}
        self.data = torch.tensor([self.stoi.get(c, 0) for c in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharGPT(L.LightningModule):
    def __init__(self, config: GPTConfig, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def on_cuda(accelerator: str) -> bool:
    """Whether ``--accelerator`` means the CUDA GPU: ``auto`` picks it when there is one. (Lightning's own
    ``auto`` would also pick Apple's MPS, which this package has not been tested on: there it stays on CPU.)"""
    return accelerator == "gpu" or (accelerator == "auto" and torch.cuda.is_available())


def trainer_device(accelerator: str) -> dict[str, object]:
    """The Trainer's device arguments: one CUDA GPU in bf16-mixed where the card supports bf16 (else fp32), or
    the CPU in fp32 exactly as before GPUs were supported (no precision argument, so the same output)."""
    if not on_cuda(accelerator):
        return {"accelerator": "cpu"}
    torch.set_float32_matmul_precision("high")  # what autocast leaves in fp32 still runs on tensor cores
    precision = "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"
    return {"accelerator": "gpu", "devices": 1, "precision": precision}


def free_cores(cores: int, load: float) -> int:
    """The cores no other job holds: ``cores`` this process may run on less the load average (the running jobs),
    at least one. torch starts a thread per core; on a 2-core machine with one core taken, its second thread waits for
    that core at every parallel op, and the README's 3-minute run took 18."""
    return max(1, cores - round(load))


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """How many threads torch runs on and the line that says why: ``--threads`` when given, else ``free_cores``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if requested is not None:
        return requested, f"torch runs on {requested} of {cores} CPU cores (--threads)"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = min(torch.get_num_threads(), free_cores(cores, load))
    return (
        threads,
        f"torch runs on {threads} of {cores} CPU cores: the load average says {load:.1f} are busy (--threads N to choose)",
    )


def check_accelerator(parser: argparse.ArgumentParser, accelerator: str) -> None:
    """``--accelerator gpu`` on a torch without CUDA ends with what to do, not in Lightning's
    ``MisconfigurationException`` from deep inside the Trainer."""
    if accelerator == "gpu" and not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        parser.error(
            f"--accelerator gpu needs a CUDA GPU, but torch {torch.__version__} is {build} and sees no GPU. Install "
            "a CUDA build (pip install torch --index-url https://download.pytorch.org/whl/cu130, the CUDA version "
            "your driver supports: the README's 'On a GPU'), check nvidia-smi, or run on the CPU with --accelerator cpu."
        )


def make_trainer(accelerator: str, steps: int, callbacks: list[L.Callback], logs: Path) -> L.Trainer:
    """The Trainer: one epoch of ``steps`` batches (the corpus holds tens of thousands). ``max_epochs=1`` rather than
    Lightning's default for a ``max_steps`` run (-1), which Rich's bar drew as ``Epoch 0/-2``; the epoch cut to
    ``steps`` batches, or the bar would count towards the corpus's 20600 with an ETA of hours."""
    return L.Trainer(
        **trainer_device(accelerator),
        max_steps=steps,
        max_epochs=1,
        limit_train_batches=steps,
        callbacks=callbacks,
        logger=TensorBoardLogger(logs, name="gpt"),
        enable_checkpointing=False,
        log_every_n_steps=5,
        enable_model_summary=False,
    )


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="tiny model and a handful of steps (used by tests)")
    parser.add_argument(
        "--accelerator", choices=("auto", "gpu", "cpu"), default="auto", help="auto: the CUDA GPU when there is one"
    )
    parser.add_argument("--reuse", action="store_true", help="apply the saved plan file without searching")
    parser.add_argument(
        "--activation-budget", type=float, default=None, help="default 0.5; with --reuse: re-plan for this budget"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trials", type=int, default=14)
    parser.add_argument("--plan", type=Path, default=Path("plans/gpt.json"))
    parser.add_argument("--logs", type=Path, default=Path("runs"))
    parser.add_argument("--storage", default=None, help="Optuna storage for the search, e.g. sqlite:///runs/ckpt.db")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: the free cores)")
    args = parser.parse_args(argv)
    check_accelerator(parser, args.accelerator)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, but got {args.threads}.")

    L.seed_everything(0, verbose=False)
    if not on_cuda(args.accelerator):
        threads, line = cpu_threads(args.threads)
        torch.set_num_threads(threads)
        print(line, file=sys.stderr)
    text = stdlib_corpus()
    vocab = sorted(set(text))
    if args.fast:
        config = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=len(vocab), dropout=0.1)
        batch_size, steps, trials = 4, 3, min(args.trials, 6)
    elif on_cuda(args.accelerator):  # GPT-2 small's shape: a step's activations are what fills a card
        config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=len(vocab), dropout=0.1)
        batch_size, steps, trials = 32, args.steps, args.trials
    else:
        config = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=128, vocab_size=len(vocab), dropout=0.1)
        batch_size, steps, trials = 16, args.steps, args.trials
    loader = DataLoader(CharDataset(text, config.block_size, vocab), batch_size=batch_size, shuffle=True, num_workers=0)

    if args.reuse:
        # A new budget re-plans from the file's profile: the re-planned plan, with its first measured steps
        # (metadata.replanned.first_measured), goes to a file of its own; the searched one stays as it is.
        replanned = args.plan.with_name(f"{args.plan.stem}-{args.activation_budget}{args.plan.suffix}")
        tuner = ActivationCheckpointTuner(
            plan=args.plan,
            activation_budget=args.activation_budget,
            plan_path=replanned if args.activation_budget is not None else None,
        )
    else:
        tuner = ActivationCheckpointTuner(
            activation_budget=0.5 if args.activation_budget is None else args.activation_budget,
            plan_path=args.plan,
            search=dict(n_trials=trials, measure_steps=2, storage=args.storage),
        )
    trainer = make_trainer(args.accelerator, steps, [tuner], args.logs)
    trainer.fit(CharGPT(config), loader)
    final_loss = float(trainer.callback_metrics["train_loss"])
    # Where to view the search is said once, by the tuner's own line (a reused plan ran none).
    print(f"final train loss {final_loss:.3f}")
    return {"plan": tuner.plan, "trials": tuner.trials_run, "loss": final_loss}


if __name__ == "__main__":
    main()
