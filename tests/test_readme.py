"""The README's usage snippet runs as written (with a small model and datamodule supplied)."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.testing import GPT, GPTConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    match = re.search(r"<!-- readme-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its <!-- readme-snippet --> code block"
    return match.group(1)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=48, block_size=16))

    def training_step(self, batch, batch_idx):
        return self.model(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        tokens = torch.randint(0, 48, (32, 17), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def test_readme_snippet_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _snippet().replace("max_steps=100", "max_steps=2, logger=False, enable_checkpointing=False")
    namespace = {"model": Model(), "datamodule": Data()}
    exec(compile(code, str(README), "exec"), namespace)
    assert (tmp_path / "plans" / "gpt.json").exists()
    assert namespace["tuner"].trials_run > 0


def test_readme_images_exist_and_screenshots_come_from_the_script():
    import importlib.util
    import re

    text = README.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    root = README.parent
    assert images and all((root / path).is_file() for path in images), images
    spec = importlib.util.spec_from_file_location("screenshots", root / "docs" / "screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shots = {p for p in images if p.startswith("docs/screenshots/")}
    assert shots and shots <= {f"docs/screenshots/{name}.png" for name in module.TABS}


def test_the_readme_stays_short_enough_to_read_and_links_the_rest():
    # A newcomer's page: at most 300 lines; measurements and tables beyond the headline live in docs/.
    text = README.read_text()
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines; move detail to docs/"
    assert "docs/benchmarks.md#" in text


def test_the_quick_start_says_its_times_are_for_an_idle_machine_and_how_to_install_a_cuda_build():
    # Issue #64: the main job took 18m27s instead of "about 3 minutes" with one of two cores taken, and the README
    # said nothing of it; the Quick start pinned the CPU wheel and never said how to get a CUDA build.
    text = README.read_text()
    quick = text[text.index("## Quick start") : text.index("<!-- test-command -->")]
    assert "idle" in quick and "--threads N" in quick, quick
    cuda = re.search(r"pip install torch --index-url (https://download\.pytorch\.org/whl/cu\d+)", quick)
    assert cuda and "--accelerator gpu" in quick, quick
    example = (README.parent / "examples" / "train_gpt.py").read_text()
    assert cuda.group(1) in example, "the example's refusal of --accelerator gpu names the README's command"
