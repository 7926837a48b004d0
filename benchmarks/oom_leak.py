"""What a step that runs out of memory leaves alive, with and without the tracker's hook removal (issue 48).

torch's module trackers (under the live-tensor tracker that reads a trial's memory, and under the FLOP counter)
register multi-grad hooks on every module's inputs and outputs and drop the handles: the hook and the graph's
nodes hold each other, so a step that fails before its backward finishes keeps every activation it saved. The
package removes those hooks when a pass ends (``measure.tracker.removing_grad_hooks``). This runs one
``measure_step`` whose forward ends in an injected ``torch.OutOfMemoryError`` on a 6-layer GPT at batch 8 x 256
(the issue's shape), under a simulated card that counts live storage bytes, and prints the MiB left alive
afterwards: as the package runs it, and with the hook removal turned off (the code before the fix), each with the
live-tensor tracker on (``track_memory=True``, every trial on CUDA) and off.

    python benchmarks/oom_leak.py                  # writes benchmarks/results/oom_leak.json
    python benchmarks/oom_leak.py --dropout 0.1    # the same with dropout (its masks are saved too)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt.measure import tracker
from lightning_ckpt.measure.step import StepSettings, measure_step
from lightning_ckpt.testing import GPT, GPTConfig, SimulatedCard

OUT = Path(__file__).resolve().parent / "results" / "oom_leak.json"


@contextlib.contextmanager
def _hooks_kept() -> Any:
    """The code before the fix: the trackers' multi-grad hooks are never removed."""
    original = tracker.removing_grad_hooks
    tracker.removing_grad_hooks = contextlib.contextmanager(lambda: (yield []))
    try:
        yield
    finally:
        tracker.removing_grad_hooks = original


def left_alive(track: bool, dropout: float) -> tuple[float, str]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=128, block_size=256, dropout=dropout))
    tokens = torch.randint(0, 96, (8, 256))

    def step() -> None:
        model(tokens, tokens)
        raise torch.OutOfMemoryError("out of memory (injected after the forward; no size, so no second attempt)")

    card = SimulatedCard(2**40, resident=(model,))
    with card:
        start = card.allocated()
        m = measure_step(step, StepSettings(warmup=0, steps=1, track_memory=track), model=model)
        gc.collect()
        return (card.allocated() - start) / 2**20, m.status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    rows = []
    for fixed in (False, True):
        for track in (True, False):
            with contextlib.nullcontext() if fixed else _hooks_kept():
                mib, status = left_alive(track, args.dropout)
            rows.append(
                {"hooks_removed": fixed, "track_memory": track, "status": status, "mib_left_alive": round(mib, 1)}
            )
    print(f"{'hooks removed':>14} {'track_memory':>13} {'status':>7} {'MiB left alive':>15}")
    for r in rows:
        print(f"{r['hooks_removed']!s:>14} {r['track_memory']!s:>13} {r['status']:>7} {r['mib_left_alive']:>15}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    model = f"GPT 6 layers, 128 wide, batch 8 x 256, dropout {args.dropout}"
    out = OUT if args.dropout == 0.0 else OUT.with_name(f"oom_leak_dropout{args.dropout}.json")
    out.write_text(json.dumps({"model": model, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
