"""How far apart are two outside re-timings of the same plans? The same baselines, re-timed in N fresh processes.

``repeatability.py`` judges a search's claim against one re-timing in one fresh process. If fresh processes
disagree among themselves about the plans' relative speed, no claim can be closer to a re-timing than that.
This runs ``--processes`` fresh processes (default 5), each re-timing the case's baseline plans side by side
as ``repeatability.worker_retime`` does (``--rounds`` interleaved rotated rounds of ``--steps`` timed steps, a
warm-up step in each plan's first round), and prints each process's speed ratios over the first baseline and
the range of the per-round ratios inside it, then the spread across processes. ``--env NAME=VALUE`` sets a
variable in every re-timing process (e.g. glibc's ``MALLOC_MMAP_THRESHOLD_``, ``OMP_NUM_THREADS``).

Run: ``python benchmarks/retime_spread.py mixer --processes 5`` (about 2 minutes on 2 cores); writes
``benchmarks/results/retime_spread_<case><--tag>.json``. The design before the confirmation alternated plans
step by step: ``--rounds 6 --steps 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def _job(case: str, tmp: Path, rounds: int, steps: int) -> Path:
    """The case's baselines as plan files and a re-timing job naming them."""
    import repeatability as R

    from lightning_ckpt import baselines

    built = R.BUILDERS[case](False)
    paths = {}
    for name, plan in baselines(built.model).items():
        if name in ("full", "selective_mlp", "sqrt_segments"):
            paths[name] = str(tmp / f"{name}.json")
            plan.save(paths[name])
    job = {"case": case, "tiny": False, "budget": 0.5, "threads": None, "plans": {}, "baselines": paths,
           "limit_bytes": None, "rounds": rounds, "steps": steps}  # fmt: skip
    path = tmp / "job.json"
    path.write_text(json.dumps(job))
    return path


def _within(rounds: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """Each plan's per-round speed ratio over the first plan's, low and high: the noise inside one process."""
    names = list(rounds)
    first = rounds[names[0]]
    out = {}
    for name in names[1:]:
        ratios = [f / s for f, s in zip(first, rounds[name], strict=True)]
        out[name] = (min(ratios), max(ratios))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=("gpt", "mixer", "llama"))
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in every re-timing process (e.g. MALLOC_MMAP_THRESHOLD_=...)")  # fmt: skip
    parser.add_argument("--tag", default="", help="suffix of the output file's name")
    args = parser.parse_args()
    env = dict(os.environ) | dict(item.split("=", 1) for item in args.env)
    tmp = Path(tempfile.mkdtemp())
    job = _job(args.case, tmp, args.rounds, args.steps)
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import repeatability as R; "
            f"print(json.dumps(R.worker_retime(json.load(open({str(job)!r})))))")  # fmt: skip
    runs, within = [], []
    for i in range(args.processes):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
        plans = json.loads(out.splitlines()[-1])["plans"]
        speeds = {k.removeprefix("baseline:"): v["samples_per_second"] for k, v in plans.items()}
        rounds = {k.removeprefix("baseline:"): v["round_seconds"] for k, v in plans.items()}
        runs.append(speeds)
        within.append(_within(rounds))
        print(f"process {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in speeds.items())
              + "; within the process, per-round ratio range: "
              + ", ".join(f"{k} {lo:.3f}-{hi:.3f}" for k, (lo, hi) in within[-1].items()), flush=True)  # fmt: skip
    names = list(runs[0])
    first = names[0]
    spread = {}
    for name in names[1:]:
        ratios = [r[name] / r[first] for r in runs]
        spread[name] = {"ratios_over_" + first: ratios, "min": min(ratios), "max": max(ratios),
                        "max_over_min": max(ratios) / min(ratios), "median": statistics.median(ratios)}  # fmt: skip
        print(f"{name} / {first}: {', '.join(f'{x:.3f}' for x in ratios)}; max/min {max(ratios) / min(ratios):.3f}")
    out_path = HERE / "results" / f"retime_spread_{args.case}{args.tag}.json"
    record = {"command": " ".join(sys.argv), "env": args.env, "runs": runs, "within_process": within, "spread": spread}
    out_path.write_text(json.dumps(record, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
