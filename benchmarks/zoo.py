"""The model zoo table: each architecture's stacks, exactness, worst memory-model error and 50%-budget tune.

Runs the same checks as ``tests/test_zoo.py`` (``lightning_ckpt.testing.zoo``) and prints the README's
zoo table; writes ``benchmarks/results/zoo.json``. Memory figures are deterministic (CPU, live-tensor
tracker); the tuned plan's samples/s is not. Run: ``python benchmarks/zoo.py`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from lightning_ckpt import baselines, discover_blocks
from lightning_ckpt.testing.zoo import ZOO, build, exactness, memory_errors, tune_at_half_activation


def row(name: str) -> dict:
    start = time.perf_counter()
    case = build(name)
    stacks = {s.fqn: len(s.blocks) for s in discover_blocks(case.model)}
    plans = baselines(case.model)
    diffs = exactness(name, plans)
    memory = memory_errors(name)
    errors = {k: (pred - real) / real for k, (pred, real) in memory.items() if real > 0}
    worst = max(errors, key=lambda k: abs(errors[k]))
    result = tune_at_half_activation(name)
    chosen = result.best_trial
    tuned_exact = not exactness(name, {"chosen": result.best})["chosen"]
    return {
        "model": name,
        "note": case.note,
        "stacks": stacks,
        "baselines": sorted(plans),
        "inexact_baselines": {k: v[:5] for k, v in diffs.items() if v},
        "memory": {k: {"predicted": p, "measured": m} for k, (p, m) in memory.items()},
        "worst_memory_error": {"baseline": worst, "error": errors[worst]},
        "tune": {
            "fell_back": result.fell_back,
            "plan": result.best.describe(),
            "activation_bytes": chosen.activation_bytes,
            "budget_bytes": result.budget.limit_bytes,
            "exact": tuned_exact,
            "trials": len(result.trials),
        },
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zoo.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    print("| model | what | stacks (blocks) | baselines exact | worst memory error | tuned at 50% activation |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        r = row(name)
        rows.append(r)
        stacks = ", ".join(f"`{k}` ({v})" for k, v in r["stacks"].items())
        exact = "all" if not r["inexact_baselines"] else "NOT: " + ", ".join(r["inexact_baselines"])
        worst = f"{r['worst_memory_error']['error']:+.1%} ({r['worst_memory_error']['baseline']})"
        t = r["tune"]
        fits = (
            "nothing fits (fell back)"
            if t["fell_back"]
            else f"{t['activation_bytes'] / t['budget_bytes']:.0%} of budget"
        )
        tuned = f"{t['plan']}: {fits}, {'exact' if t['exact'] else 'NOT exact'}"
        print(f"| {name} | {r['note']} | {stacks} | {exact} | {worst} | {tuned} |", flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
