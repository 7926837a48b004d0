"""What a search costs, in plain training steps: GPTs of 8 to 64 layers, the tuner's defaults, on CPU.

For each depth the plain step (forward + backward, no plan) is timed first, then ``tune()`` runs with
its defaults (40 trials, the default space) and an activation budget of 50%. The cost is reported as
wall seconds and as *plain-step equivalents* (tuning seconds / plain step seconds), split into where
it went: the memory profile, the measured optimizer step, the trials (tracked memory pass, warm-up,
timed steps, FLOP count), the confirmation round, and the rest (sampler, process warm-up). Each depth
is searched ``--repeats`` times (3) in fresh models; the table shows the median run by cost, the JSON
every run. Run it on a quiet machine: ``python benchmarks/tuning_cost.py`` (writes
``benchmarks/results/tuning_cost.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt import tune
from lightning_ckpt.memory.optimizer_measure import measure_optimizer_step
from lightning_ckpt.memory.profile import profile_step
from lightning_ckpt.testing import GPT, GPTConfig


def plain_step_seconds(model: torch.nn.Module, x: torch.Tensor, steps: int = 10) -> float:
    for _ in range(3):
        model(x, x).backward()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x, x).backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def run_depth(depth: int, *, batch: int, seq: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=depth, n_head=4, n_embd=width, vocab_size=256, block_size=seq, dropout=0.0))
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = plain_step_seconds(model, x)

    def loss() -> torch.Tensor:
        return model(x, x)

    t0 = time.perf_counter()
    profile_step(model, loss, optimizer=optimizer, extra=(x,))  # memory and block timings, as tune profiles
    profile_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    measure_optimizer_step(model, optimizer, device="cpu", extra=(x,))
    optimizer_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = tune(model, loss, optimizer=optimizer, activation_budget=0.5, batch_size=batch, seq_len=seq,
                  extra_tensors=(x,))  # fmt: skip
    total = time.perf_counter() - t0
    trial_seconds = sum(t.seconds for t in result.trials)
    confirmed = [t for t in result.trials if t.confirmed]
    confirm_steps = sum(t.steps for t in confirmed)  # incl. the trial's own; the split below uses time
    rest = total - profile_seconds - optimizer_seconds - trial_seconds
    return {
        "depth": depth,
        "plain_step_seconds": step,
        "tuning_seconds": total,
        "plain_step_equivalents": total / step,
        "training_steps_run": result.tuning_steps,
        "trials": len(result.trials),
        "measured": result.n_measured,
        "space_size": result.best.metadata["search"]["space_size"],
        "profile_seconds": profile_seconds,
        "optimizer_step_seconds": optimizer_seconds,
        "trial_seconds": trial_seconds,
        "confirmation_and_rest_seconds": rest,
        "confirmed_trials": len(confirmed),
        "confirmed_trial_steps": confirm_steps,
        "chosen": result.best.describe(),
        "time_model": result.best.metadata["search"].get("time_model"),
        # how many rounds chose the plan (``chosen_after``) and how many fresh ones gave its claim (``rounds``)
        "verdict": result.best.metadata["search"].get("verdict"),
        "prediction_errors": [t.prediction_error for t in result.trials if t.prediction_error is not None],
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose cost is the median (the lower middle one of an even count), with every run's cost beside it."""
    ordered = sorted(runs, key=lambda r: r["plain_step_equivalents"])
    return {
        **ordered[(len(ordered) - 1) // 2],
        "plain_step_equivalents_of_runs": [r["plain_step_equivalents"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tuning_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    runs = {d: [run_depth(d, batch=args.batch, seq=args.seq, width=args.width) for _ in range(args.repeats)]
            for d in args.depths}  # fmt: skip
    rows = [_median_run(runs[d]) for d in args.depths]
    print(f"{'layers':>6s} {'step ms':>8s} {'tuning s':>9s} {'plain-step eq':>13s} {'runs':>15s} {'steps run':>9s} "
          f"{'measured':>8s} {'profile s':>9s} {'trials s':>8s} {'confirm+rest s':>14s} {'time err':>8s}  chosen")  # fmt: skip
    for r in rows:
        costs = "/".join(f"{v:.0f}" for v in r["plain_step_equivalents_of_runs"])
        errors = [abs(e) for e in r.get("prediction_errors") or ()]
        error = f"{statistics.median(errors):.1%}" if errors else "-"
        print(
            f"{r['depth']:6d} {1000 * r['plain_step_seconds']:8.1f} {r['tuning_seconds']:9.1f} "
            f"{r['plain_step_equivalents']:13.0f} {costs:>15s} {r['training_steps_run']:9d} {r['measured']:8d} "
            f"{r['profile_seconds']:9.1f} {r['trial_seconds']:8.1f} {r['confirmation_and_rest_seconds']:14.1f} "
            f"{error:>8s}  {r['chosen']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(), "batch": args.batch,
               "seq": args.seq, "width": args.width, "repeats": args.repeats, "rows": rows,
               "runs": {str(d): r for d, r in runs.items()}}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
