"""Regenerate ``plan_real.json``: a plan file exactly as the Lightning callback writes it, for the fuzz test.

    .venv/bin/python tests/data/make_plan_real.py        # a few minutes on two CPU cores

A tiny GPT tuned on CPU with ``max_shape`` (so the file keeps a plan table beside the profile, the budget, the
search, the run conditions and the guard's real steps): every field a reader of plan files uses. The test reads
the file rather than tuning per run because a tune costs minutes here; regenerate it when the plan format
gains a field, and check that ``tests/test_plan_fuzz.py`` still passes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/lit.py

from lit import LitGPT, quiet_trainer, token_loader  # noqa: E402

from lightning_ckpt import ActivationCheckpointTuner  # noqa: E402


def main(out: Path = HERE / "plan_real.json") -> None:
    out.unlink(missing_ok=True)
    tuner = ActivationCheckpointTuner(
        activation_budget=0.6,
        plan_path=out,
        max_shape=32,
        search={"n_trials": 4, "measure_steps": 1},
        verbose=False,
    )
    with tempfile.TemporaryDirectory() as logs:  # the tuner's TensorBoard files: not kept
        # Batches of 16 tokens, a model that takes 32: a table of two buckets (<= 16, <= 32).
        model = LitGPT(n_layer=2, block_size=32, dropout=0.0)
        quiet_trainer(Path(logs), [tuner], steps=2).fit(model, token_loader(32, seq=16))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:]))
