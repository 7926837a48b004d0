"""Joint (plan, micro-batch) tuning vs no checkpointing at the largest micro-batch that fits.

GPT example on CPU, fixed global batch (``--global-batch``, default 32 = micro-batch 8 x 4
accumulation). The budget is the no-checkpointing activation memory at the user's micro-batch
(``--budget`` x that), so without checkpointing the largest micro-batch that fits is the user's.
Both configurations are then measured side by side, interleaved over ``--rounds`` rounds: time per
global batch = accumulation x step time at the micro-batch.

Run: ``python benchmarks/microbatch.py`` (writes ``benchmarks/results/microbatch.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

import torch

from lightning_ckpt import Plan, plan_applied
from lightning_ckpt.measure import measure_step
from lightning_ckpt.microbatch import divisors, resize_batch, tune_micro_batch
from lightning_ckpt.testing import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--budget", type=float, default=1.0, help="fraction of no-checkpointing activation memory")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "microbatch.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=4, n_embd=128, block_size=128, vocab_size=96, dropout=0.1))
    base = torch.randint(0, 96, (args.micro_batch, 128), generator=torch.Generator().manual_seed(0))

    def batch(m: int) -> torch.Tensor:
        return resize_batch(base, args.micro_batch, m)

    def loss_for(m: int):  # noqa: ANN202
        x = batch(m)
        return lambda: model(x, x)

    found = tune_micro_batch(
        model, loss_for, base_micro_batch=args.micro_batch, global_batch=args.global_batch,
        activation_budget=args.budget, n_trials=args.trials, measure_steps=2, extra_for=lambda m: (batch(m),),
    )  # fmt: skip
    limit = found.result.budget.limit_bytes
    # The no-checkpointing configuration: the largest micro-batch whose none plan fits the budget.
    scaled = found.per_micro_batch
    none_fits = [
        m for m in divisors(args.global_batch)
        if m in scaled and any(t.plan.is_empty and t.status == "ok" for t in scaled[m].trials)
    ]  # fmt: skip
    none_m = max(none_fits) if none_fits else args.micro_batch
    configs = {
        f"no checkpointing, micro-batch {none_m} x{args.global_batch // none_m}": (Plan(), none_m),
        f"tuned {found.result.best.describe()}, micro-batch {found.micro_batch} x{found.accumulation}": (
            Plan(found.result.best.blocks, found.result.best.segments),
            found.micro_batch,
        ),
    }
    seconds: dict[str, list[float]] = {k: [] for k in configs}
    memory: dict[str, int] = {}
    for r in range(args.rounds):
        for name, (plan, m) in configs.items():
            x = batch(m)
            with plan_applied(model, plan, check_fingerprint=False):
                meas = measure_step(lambda x=x: model(x, x).backward(), model=model, warmup=1, steps=2,
                                    batch_size=m, track_memory=r == 0, extra=(x,))  # fmt: skip
            seconds[name].append(meas.median_seconds * (args.global_batch // m))
            if r == 0:
                memory[name] = meas.activation_bytes
    rows = {
        name: {"samples_per_second": args.global_batch / statistics.median(s), "activation_bytes": memory[name],
               "fits": memory[name] <= limit}
        for name, s in seconds.items()
    }  # fmt: skip
    (none_name, tuned_name) = list(rows)
    ratio = rows[tuned_name]["samples_per_second"] / rows[none_name]["samples_per_second"]
    print(
        f"GPT {args.layers}x128, T=128, global batch {args.global_batch}, CPU; budget {found.result.budget.description}"
    )
    for name, row in rows.items():
        print(f"  {name:<60}{row['samples_per_second']:>8.1f} samples/s  activation "
              f"{row['activation_bytes'] / 2**20:6.1f} MiB  fits={row['fits']}")  # fmt: skip
    print(f"  throughput ratio tuned / no-checkpointing: {ratio:.3f}x  (micro-batches not searched: "
          f"{dict(found.skipped) or 'none'})")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "ratio": ratio, "chosen": {"micro_batch": found.micro_batch,
                                    "accumulation": found.accumulation, "plan": found.result.best.describe()},
                                    "torch": torch.__version__}, indent=2))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
