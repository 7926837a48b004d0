"""The seed documents' trade-off table, measured: activation memory saved and recompute FLOPs per plan.

Deterministic (memory from a live-tensor tracker, cost from FlopCounterMode), so it runs on CPU and
gives the same numbers on any machine. Run: ``python benchmarks/seed_table.py`` (writes
``benchmarks/results/seed_table.json``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_ckpt import BlockPlan, Plan, baselines, plan_applied
from lightning_ckpt.measure.step import track_step_memory
from lightning_ckpt.testing import GPT, GPTConfig

# What the seed documents (shared/seeds) claim, quoted next to what we measure.
CLAIMS = {
    "full": "10-20x less activation memory for ~33% more compute",
    "sqrt_segments": "sqrt(N) segments: 100 units of activation memory -> ~20",
    "selective_mlp": "selective FFN (with flash attention): ~80% saved for ~12% more compute",
    "ops_save_matmuls": "(no claim) keep matmuls, recompute pointwise ops",
    "ops_save_matmuls_alternate": "(no claim) torchtitan op-SAC: keep every other mm",
    "offload": "(no claim) activations in host memory; a no-op on a CPU model",
}


def measure(model: GPT, tokens: torch.Tensor, plan: Plan) -> tuple[int, int]:
    def step() -> None:
        model(tokens, tokens).backward()

    with plan_applied(model, plan):
        reading = track_step_memory(step, model=model, extra=(tokens,))
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as flops:
            step()
        model.zero_grad(set_to_none=True)
    return reading.activation_bytes, flops.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="0 lets CPU SDPA use its flash kernel (no T x T probabilities saved), like the seeds' flash attention",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "seed_table.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=args.layers, n_embd=args.embd, n_head=4, block_size=args.seq, vocab_size=96, dropout=args.dropout
    )
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    plans = baselines(model)
    plans["ops_save_matmuls_alternate"] = Plan(
        {f"transformer.h.{i}": BlockPlan("ops", save_list="save_matmuls_alternate") for i in range(args.layers)}
    )
    rows = []
    base_act, base_flops = measure(model, tokens, plans["none"])
    for name, plan in plans.items():
        act, flops = measure(model, tokens, plan)
        rows.append(
            {
                "plan": name,
                "activation_bytes": act,
                "activation_units_of_100": round(100 * act / base_act, 1),
                "memory_reduction_x": round(base_act / act, 2),
                "memory_saved_pct": round(100 * (1 - act / base_act), 1),
                "step_flops": flops,
                "recompute_overhead_pct": round(100 * (flops - base_flops) / base_flops, 1),
                "claim": CLAIMS.get(name, ""),
            }
        )
    print(
        f"GPT {args.layers} layers, d={args.embd}, T={args.seq}, batch {args.batch}, dropout {args.dropout}, fp32, CPU "
        f"(sqrt segments = {round(math.sqrt(args.layers))} chunks)"
    )
    print(f"{'plan':<28}{'act MiB':>9}{'units/100':>10}{'saved':>8}{'x less':>8}{'+FLOPs':>8}  seed claim")
    for r in rows:
        print(
            f"{r['plan']:<28}{r['activation_bytes'] / 2**20:>9.2f}{r['activation_units_of_100']:>10.1f}"
            f"{r['memory_saved_pct']:>7.1f}%{r['memory_reduction_x']:>8.2f}{r['recompute_overhead_pct']:>7.1f}%  {r['claim']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
