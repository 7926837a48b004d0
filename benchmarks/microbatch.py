"""Joint (plan, micro-batch) tuning vs no checkpointing at the largest micro-batch that fits.

GPT example on CPU, fixed global batch (``--global-batch``, default 32 = micro-batch 8 x 4
accumulation). The budget is the no-checkpointing activation memory at the user's micro-batch
(``--budget`` x that), so without checkpointing the largest micro-batch that fits is the user's.
Both configurations are then measured side by side, interleaved over ``--rounds`` rounds, each
round timing one global batch's worth of steps (accumulation x micro-batch): time per global batch
= accumulation x median step time at the micro-batch.

When the tuner picks exactly the no-checkpointing configuration, it is measured once and the ratio
is 1 by identity: timing the same configuration twice would only measure the machine's noise.

Run: ``python benchmarks/microbatch.py`` (budgets of 100%, 50% and 20%, about 4 minutes on 2 cores;
writes ``benchmarks/results/microbatch.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt import Plan, plan_applied
from lightning_ckpt.measure.step import StepSettings, measure_step
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.microbatch import divisors, resize_batch, tune_micro_batch
from lightning_ckpt.testing import GPT, GPTConfig


def run_budget(args: argparse.Namespace, model: GPT, batch: Any, fraction: float) -> dict[str, Any]:
    """Tune (plan, micro-batch) at one budget, then time it against no checkpointing side by side."""

    def loss_for(m: int):  # noqa: ANN202
        x = batch(m)
        return lambda: model(x, x)

    found = tune_micro_batch(model, loss_for, base_micro_batch=args.micro_batch, global_batch=args.global_batch, activation_budget=fraction, extra_for=lambda m: (batch(m),), config=TuneConfig(n_trials=args.trials, measure_steps=args.search_steps))  # fmt: skip
    limit = found.result.budget.limit_bytes
    # The no-checkpointing configuration: the largest micro-batch whose none plan fits the budget.
    trials = found.result.trials  # one search over every (plan, micro-batch)
    none_fits = [
        m for m in divisors(args.global_batch)
        if any(t.micro_batch == m and t.plan.is_empty and t.status == "ok" for t in trials)
    ]  # fmt: skip
    none_m = max(none_fits) if none_fits else args.micro_batch
    tuned_plan = Plan(found.result.best.blocks, found.result.best.segments)
    none_name = f"no checkpointing, micro-batch {none_m} x{args.global_batch // none_m}"
    tuned_name = f"tuned {found.result.best.describe()}, micro-batch {found.micro_batch} x{found.accumulation}"
    identical = tuned_plan.is_empty and found.micro_batch == none_m
    configs = {none_name: (Plan(), none_m)}
    if not identical:
        configs[tuned_name] = (tuned_plan, found.micro_batch)
    seconds: dict[str, list[float]] = {k: [] for k in configs}
    memory: dict[str, int] = {}
    for r in range(args.rounds):
        for name, (plan, m) in configs.items():
            x = batch(m)
            with plan_applied(model, plan, check_fingerprint=False):
                # One global batch per round: every configuration is timed on the same samples.
                meas = measure_step(
                    lambda x=x: model(x, x).backward(),
                    StepSettings(warmup=1, steps=args.global_batch // m, track_memory=r == 0),
                    model=model,
                    batch_size=m,
                    extra=(x,),
                )
            seconds[name].append(meas.median_seconds * (args.global_batch // m))
            if r == 0:
                memory[name] = meas.activation_bytes
    rows = {
        name: {"samples_per_second": args.global_batch / statistics.median(s), "activation_bytes": memory[name],
               "fits": memory[name] <= limit}
        for name, s in seconds.items()
    }  # fmt: skip
    ratio = 1.0 if identical else rows[tuned_name]["samples_per_second"] / rows[none_name]["samples_per_second"]
    # What the search measured at each micro-batch: the evidence for (or against) a larger one.
    best_of: dict[int, Any] = {}
    for t in sorted((t for t in trials if t.feasible and t.samples_per_second), key=lambda t: t.samples_per_second):
        best_of[t.micro_batch] = t  # the fastest last
    searched = {
        m: {"plan": t.plan.describe(), "samples_per_second": t.samples_per_second,
            "activation_bytes": t.activation_bytes, "status": t.status}
        for m, t in sorted(best_of.items())
    }  # fmt: skip
    print(f"\nGPT {args.layers}x128, T=128, global batch {args.global_batch}, CPU; "
          f"budget {found.result.budget.description}")  # fmt: skip
    for name, row in rows.items():
        print(f"  {name:<60}{row['samples_per_second']:>8.1f} samples/s  activation "
              f"{row['activation_bytes'] / 2**20:6.1f} MiB  fits={row['fits']}")  # fmt: skip
    print("  best measured during the search, per micro-batch:")
    for m, row in searched.items():
        sps = f"{row['samples_per_second']:8.1f}" if row["samples_per_second"] else "       -"
        act = (row["activation_bytes"] or 0) / 2**20
        print(f"    micro-batch {m:>3}: {row['plan']:<40}{sps} samples/s  activation {act:6.1f} MiB  {row['status']}")
    verdict = "1 (the tuner chose the no-checkpointing configuration itself)" if identical else f"{ratio:.3f}x"
    print(f"  throughput ratio tuned / no-checkpointing: {verdict}; micro-batches not searched: "
          f"{dict(found.skipped) or 'none'}")  # fmt: skip
    return {
        "budget_fraction": fraction, "budget_bytes": limit, "rows": rows, "ratio": ratio, "identical": identical,
        "searched": searched, "skipped": {str(k): v for k, v in found.skipped.items()},
        "chosen": {"micro_batch": found.micro_batch, "accumulation": found.accumulation,
                   "plan": found.result.best.describe()},
        "confirmation": {t.label: {"samples_per_second": t.samples_per_second,
                                   "search_samples_per_second": t.first_samples_per_second}
                         for t in found.result.trials if t.confirmed},
        "tuning_seconds": found.result.tuning_seconds,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.2],
                        help="fractions of the no-checkpointing activation memory at --micro-batch")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--search-steps", type=int, default=3, help="timed steps per trial during the search")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "microbatch.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=4, n_embd=128, block_size=128, vocab_size=96, dropout=0.1))
    base = torch.randint(0, 96, (args.micro_batch, 128), generator=torch.Generator().manual_seed(0))

    def batch(m: int) -> torch.Tensor:
        return resize_batch(base, args.micro_batch, m)

    results = [run_budget(args, model, batch, fraction) for fraction in args.budgets]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": {k: str(v) for k, v in vars(args).items()}, "budgets": results, "torch": torch.__version__}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
