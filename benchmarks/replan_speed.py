"""How long ``lightning-ckpt replan`` takes as a command, start to finish, beside ``import torch``.

Re-planning reads the profile a plan file keeps and scores every plan of the searched space; it imports no
torch, Lightning or Optuna (``tests/test_replan.py`` runs it where they cannot be imported). This times the
whole command as a user runs it: a fresh ``python -m lightning_ckpt.cli replan PLAN --activation-budget ...``
process, ``--repeats`` times (5) per budget, median wall seconds, and ``python -c "import torch"`` the same way
for scale; one more run per budget under ``-X importtime`` says whether torch was imported.

Give it a plan file written by a search (the main job's: ``python examples/train_gpt.py`` writes
``plans/gpt.json``): ``python benchmarks/replan_speed.py --plan plans/gpt.json`` (writes
``benchmarks/results/replan_speed.json``). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def wall(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of ``python ARGS`` in a fresh process, and the process (stderr: the import times)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    return time.perf_counter() - t0, done


def imported_torch(importtime: str) -> bool:
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in importtime.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, default=Path("plans/gpt.json"), help="a plan file written by a search")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.3, 0.5, 0.8], help="activation budgets")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "replan_speed.json")
    args = parser.parse_args()
    if not args.plan.exists():
        sys.exit(f"{args.plan} does not exist: run `python examples/train_gpt.py` first, or pass --plan")

    rows: list[dict[str, Any]] = []
    torch_runs = [wall(["-c", "import torch"])[0] for _ in range(args.repeats)]
    rows.append(
        {"command": "python -c 'import torch'", "median_s": statistics.median(torch_runs), "runs_s": torch_runs}
    )
    for budget in args.budgets:
        cmd = ["-X", "importtime", "-m", "lightning_ckpt.cli", "replan", str(args.plan), "--activation-budget",
               str(budget), "--json"]  # fmt: skip
        runs = []
        for _ in range(args.repeats):
            seconds, done = wall(cmd[2:])
            runs.append(seconds)
        torch_seen = imported_torch(wall(cmd)[1].stderr)  # one more run, under -X importtime (which slows it)
        if done.returncode != 0:  # refused (nothing predicted to fit): timed all the same, the reason kept
            reason = done.stderr.strip().splitlines()[-1]
            rows.append({"command": f"lightning-ckpt replan --activation-budget {budget}", "median_s":
                         statistics.median(runs), "runs_s": runs, "imported_torch": torch_seen, "refused": reason})  # fmt: skip
            continue
        chosen = json.loads(done.stdout)
        rows.append({
            "command": f"lightning-ckpt replan --activation-budget {budget}",
            "median_s": statistics.median(runs),
            "runs_s": runs,
            "imported_torch": torch_seen,
            "plan": chosen["plan"],
            "plans_scored": chosen["plans_scored"],
        })  # fmt: skip

    print(f"{'command':<48} {'median':>8} {'runs (s)':<40} torch imported")
    for r in rows:
        runs = " ".join(f"{s:.2f}" for s in r["runs_s"])
        print(f"{r['command']:<48} {r['median_s']:>7.2f}s {runs:<40} {r.get('imported_torch', '-')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {**vars(args), "plan": str(args.plan), "out": str(args.out)},
                                    "python": sys.version.split()[0], "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
