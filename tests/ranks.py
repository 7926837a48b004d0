"""Run a 2-rank worker script (``tests/*_worker.py``) in a subprocess and read what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_ranks(worker: Path, out: Path, *args: str) -> list[dict]:
    """``worker out *args``, run from ``out``; each rank writes ``out/rank<r>.json``, returned in rank order."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(worker), str(out), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=out)  # fmt: skip
    # Rank 0's lines apart: when rank 0 dies, rank 1's traceback (the lost peer) fills the tail and hides its cause.
    rank0 = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("[rank1]"))
    assert proc.returncode == 0, proc.stdout[-3000:] + rank0[-5000:] + proc.stderr[-2000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
