"""Compiled training: no checkpointing, full, the tuned plan and PT2's own memory budget at matching memory.

For the GPT example compiled with ``torch.compile`` (inductor), at two activation budgets (fractions
of the compiled no-checkpointing step's activation memory):

1. ``tune`` on the compiled model (every trial compiles its plan; PT2 ``activation_memory_budget``
   values are candidates too) gives the tuned plan;
2. a sweep of PT2 budgets measures the memory the partitioner's own knapsack reaches at each;
   "pt2 @ matching memory" is the largest PT2 budget whose activation memory is no more than the
   tuned plan's (the compiler's answer at the tuned plan's memory);
3. a final side-by-side measurement, interleaved over ``--rounds`` rounds: none, full, tuned, pt2 @
   matching memory, and (when the tuned plan is a PT2 budget) the fastest feasible plan of our own
   checkpointing modes. Each measurement compiles its plan from scratch (``CompiledTrials.measure_compiled``).

Memory on CPU is the compiled step's saved-for-backward bytes (``lightning_ckpt.search.compile``); on CUDA
the allocator's peak. CPU timings on a shared 2-core machine are noisy, so the table reports ratios
to no checkpointing; run on a GPU for absolute numbers (``--preset gpt2-125m --device cuda --bf16``).

The model runs with dropout 0: with dropout, torch 2.13's memory-budget partitioner may recompute
the dropout mask with fresh randomness (pytorch#190758), so the tuner leaves PT2 budgets out.

Run: ``python benchmarks/compile.py --threads 1`` (CPU, 2 cores: about 8 minutes with a warm inductor
cache, 20 cold, most of it compiling); writes ``benchmarks/results/compile.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt import Plan, baselines, tune
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.search.compile import CompiledTrials, compiled_search, reset_compiled
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.testing import GPT, GPTConfig

PRESETS = {
    # The README's GPT example (examples/train_gpt.py) without dropout.
    "example": dict(n_layer=8, n_head=4, n_embd=128, block_size=128, vocab_size=96, batch=16),
    # GPT-2 small, ~124M parameters: the GPU configuration.
    "gpt2-125m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, batch=8),
}
PT2_SWEEP = (0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
SPACE = {
    "modes": ["full", "selective:mlp", "selective:attention+mlp", "ops:save_matmuls_alternate"],
    "selections": ["all", "first:0.5", "every:2"],
    "rest_modes": ["none", "selective:mlp"],
    "chunks": [2, 4],
    "compile_budgets": [0.5, 0.3, 0.1],
}


def row(name: str, plan: Plan, m: Any) -> dict[str, Any]:
    stats = m.extra["compile"]  # what dynamo did (CompileStats.to_dict)
    return {
        "plan": name,
        "describe": plan.describe(),
        "status": m.status,
        "samples_per_second": m.samples_per_second,
        "median_seconds": m.median_seconds,
        "peak_bytes": m.peak_bytes,
        "activation_bytes": m.activation_bytes,
        "compile_seconds": stats["compile_seconds"],
        "graph_breaks": stats["graph_breaks"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="example")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="autocast to bfloat16 (GPU runs)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.3])
    parser.add_argument("--trials", type=int, default=14, help="measured trials per tuning run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1: steadier on a busy CPU)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the final measurement")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compile.json")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    preset = dict(PRESETS[args.preset])
    batch = args.batch or preset.pop("batch")
    preset.pop("batch", None)
    if args.layers:
        preset["n_layer"] = args.layers
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**preset, dropout=0.0)).to(device)
    compiled = torch.compile(model)
    seq = preset["block_size"]
    x = torch.randint(0, preset["vocab_size"], (batch, seq), device=device)
    y = torch.randint(0, preset["vocab_size"], (batch, seq), device=device)

    def loss() -> torch.Tensor:
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
        with ctx:
            return compiled(x, y)

    harness = StepHarness(model, loss, device, extra=(x, y), batch_size=batch, seq_len=seq, warmup_steps=1,
                          measure_steps=args.steps)  # fmt: skip
    trials: CompiledTrials = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT {preset['n_layer']} layers, d={preset['n_embd']}, T={seq}, batch {batch}, {params / 1e6:.1f}M params, "
        f"{'bf16' if args.bf16 else 'fp32'}, {device}, torch {torch.__version__}, compiled (inductor)"
    )
    started = time.perf_counter()
    named = baselines(model)
    none_plan, full_plan = named["none"], named["full"]

    # The partitioner's own knapsack: activation memory per PT2 budget.
    sweep = {}
    for b in PT2_SWEEP:
        m = trials.measure_compiled(Plan(compile_memory_budget=b))
        sweep[b] = m.activation_bytes
    none_act = trials.measure_compiled(none_plan).activation_bytes
    print(
        "PT2 sweep (activation % of none): " + ", ".join(f"{b:g}: {100 * a / none_act:.0f}%" for b, a in sweep.items())
    )

    results = []
    for budget in args.budgets:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = tune(compiled, loss, activation_budget=budget, batch_size=batch, seq_len=seq, extra_tensors=(x, y), config=TuneConfig(n_trials=args.trials, search_space=SPACE, measure_steps=args.steps))  # fmt: skip
        tuned = result.best
        tuned_act = result.best_trial.activation_bytes if result.best_trial else None
        fitting = [b for b, a in sweep.items() if tuned_act is not None and a is not None and a <= tuned_act]
        matched = max(fitting) if fitting else min(PT2_SWEEP)
        # Our own (eager-style) plans alone: the fastest feasible trial that sets no PT2 budget.
        ours = [
            t for t in result.trials if t.feasible and t.samples_per_second and t.plan.compile_memory_budget is None
        ]
        best_ours = max(ours, key=lambda t: t.samples_per_second).plan if ours else None
        plans = {
            "none": none_plan,
            "full": full_plan,
            "tuned": tuned,
            f"pt2 @ matching memory ({matched:g})": Plan(compile_memory_budget=matched),
        }
        if best_ours is not None and best_ours != tuned:
            plans[f"best checkpointing plan: {best_ours.describe()}"] = best_ours
        per_plan: dict[str, list[Any]] = {name: [] for name in plans}
        for _ in range(args.rounds):
            for name, plan in plans.items():
                per_plan[name].append(trials.measure_compiled(plan, cached=False))
        rows = []
        for name, plan in plans.items():
            ms = per_plan[name]
            r = row(name, plan, ms[0])
            rates = [m.samples_per_second for m in ms if m.samples_per_second]
            r["samples_per_second"] = statistics.median(rates) if rates else None
            rows.append(r)
        base = rows[0]
        for r in rows:
            r["speed_vs_none"] = (
                r["samples_per_second"] / base["samples_per_second"]
                if r["samples_per_second"] and base["samples_per_second"]
                else None
            )
            r["activation_vs_none"] = (
                r["activation_bytes"] / base["activation_bytes"] if r["activation_bytes"] else None
            )
            r["peak_vs_none"] = r["peak_bytes"] / base["peak_bytes"] if r["peak_bytes"] else None
        limit = result.budget.limit_bytes
        results.append(
            {
                "activation_budget": budget,
                "limit_bytes": limit,
                "tuned_plan": tuned.describe(),
                "tuning_seconds": result.tuning_seconds,
                "tuning_compile_seconds": sum(t.extra.get("compile", {}).get("compile_seconds", 0.0)
                                              for t in result.trials),
                "trials": len(result.trials),
                "conflicts": sum(t.status == "conflict" for t in result.trials),
                "tuning_trials": [
                    {"label": t.label, "status": t.status, "samples_per_second": t.samples_per_second,
                     "activation_bytes": t.activation_bytes, "confirmed": t.confirmed,
                     "compile_seconds": t.extra.get("compile", {}).get("compile_seconds")}
                    for t in result.trials
                ],
                "rows": rows,
            }
        )  # fmt: skip
        print(f"\nbudget {budget:.0%} of compiled no-checkpointing activation memory (limit {limit / 2**20:.2f} MiB); "
              f"tuned: {tuned.describe()} ({len(result.trials)} trials, {result.tuning_seconds:.0f} s)")  # fmt: skip
        print(f"{'plan':<52}{'samples/s':>10}{'x none':>8}{'act MiB':>9}{'x none':>8}{'peak MiB':>10}{'x none':>8}"
              f"{'fits':>6}{'compile s':>11}")  # fmt: skip
        for r in rows:
            fits = r["activation_bytes"] is not None and r["activation_bytes"] <= limit
            sps = r["samples_per_second"]
            print(
                f"{r['plan']:<52}{(f'{sps:.1f}' if sps else '-'):>10}{_x(r['speed_vs_none']):>8}"
                f"{_mib(r['activation_bytes']):>9}{_x(r['activation_vs_none']):>8}{_mib(r['peak_bytes']):>10}"
                f"{_x(r['peak_vs_none']):>8}{('yes' if fits else 'no'):>6}{r['compile_seconds']:>11.1f}"
            )
    reset_compiled()
    out = {
        "config": {**preset, "batch": batch, "device": str(device), "bf16": args.bf16, "torch": torch.__version__,
                   "params": params, "trials": args.trials, "rounds": args.rounds, "steps": args.steps,
                   "threads": torch.get_num_threads(),
                   "command": "python benchmarks/compile.py " + " ".join(sys.argv[1:])},
        "memory_definition": "CPU: saved-for-backward bytes of the compiled step (activation), resting + that (peak); "
        "CUDA: torch.cuda.max_memory_allocated",
        "pt2_sweep_activation_bytes": {str(k): v for k, v in sweep.items()},
        "none_activation_bytes": none_act,
        "budgets": results,
        "seconds": time.perf_counter() - started,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out} ({out['seconds']:.0f} s)")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.2f}"


if __name__ == "__main__":
    main()
