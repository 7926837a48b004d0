"""A small fit with the tuner under Lightning's tqdm or Rich progress bar: what ``test_terminal.py`` runs in a
pseudo-terminal. Usage: ``python tests/terminal_fit.py tqdm|rich DIR [confirm]``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

sys.path.insert(0, str(Path(__file__).parent))
from lit import LitGPT, token_loader  # noqa: E402

from lightning_ckpt import ActivationCheckpointTuner  # noqa: E402

warnings.filterwarnings("ignore")  # Python's warnings are not log lines: this checks the tuner's and Lightning's
bar = RichProgressBar() if sys.argv[1] == "rich" else TQDMProgressBar()
search = {"n_trials": 4, "measure_steps": 1}
if sys.argv[3:] == ["confirm"]:  # side-by-side rounds the bar must move through (test_terminal's moving-bar test)
    # No allowance: a step of a few milliseconds spends 150 plain steps before the rounds (the test is about them).
    search.update(n_trials=6, confirm_rounds=4, confirm_max_rounds=4, holdout_rounds=0, search_steps=None)
tuner = ActivationCheckpointTuner(activation_budget=0.6, search=search)
trainer = L.Trainer(
    accelerator="cpu",
    max_steps=4,
    callbacks=[tuner, bar],
    logger=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    default_root_dir=sys.argv[2],
)
trainer.fit(LitGPT(n_layer=4, block_size=32, dropout=0.0), token_loader(16))
