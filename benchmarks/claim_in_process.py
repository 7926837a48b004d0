"""Is a search's claim off because of the process it runs in? One search, then its choice re-timed twice.

For ``--searches`` searches of one case of ``repeatability.py`` (``case`` and activation ``budget``), each
search's chosen plan and fitting baselines are re-timed with ``repeatability.worker_retime`` (6 interleaved
rounds, 3 timed steps) twice: in the search's own process (a fresh model, the process the search ran in) and in
a fresh process. Where the two re-timings agree and the claim does not, the claim's error is the search's own
(its rounds chose the plan); where they disagree, the process is part of it. One JSON line per search.

Run: ``python benchmarks/claim_in_process.py gpt 0.3 3`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import repeatability as R  # noqa: E402

from lightning_ckpt import tune  # noqa: E402
from lightning_ckpt.search.verdict import Verdict  # noqa: E402


def _ratio(timed: dict, baselines: dict) -> tuple[float, str, float | None]:
    plans = timed["plans"]
    best = max((plans[f"baseline:{b}"]["samples_per_second"], b) for b in baselines)
    paired = R.paired(plans[f"baseline:{best[1]}"], plans["chosen"])
    return round(plans["chosen"]["samples_per_second"] / best[0], 3), best[1], paired and round(paired["ratio"], 3)


def main() -> None:
    case_name, budget, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    tmp = Path(tempfile.mkdtemp())
    for i in range(n):
        case = R.BUILDERS[case_name](False)
        t0 = time.perf_counter()
        result = tune(case.model, case.loss_fn, activation_budget=budget, batch_size=case.batch_size,
                      seq_len=case.seq_len, extra_tensors=case.extra)  # fmt: skip
        seconds = time.perf_counter() - t0
        verdict = Verdict.recorded(result.best.metadata["search"])
        plan_path = tmp / f"{i}.json"
        result.best.save(plan_path)
        baselines = {}
        for name in R._fitting_baselines(result):
            path = tmp / f"{i}.{name}.json"
            result.baselines[name].plan.save(path)
            baselines[name] = str(path)
        job = {"case": case_name, "tiny": False, "budget": budget, "threads": None, "plans": {"chosen": str(plan_path)},
               "baselines": baselines, "limit_bytes": None, "rounds": 6, "steps": 3}  # fmt: skip
        job_path = tmp / f"{i}.job.json"
        job_path.write_text(json.dumps(job))
        in_process = R.worker_retime(job)
        code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import repeatability as R; "
                f"print(json.dumps(R.worker_retime(json.load(open({str(job_path)!r})))))")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        fresh = json.loads(out.splitlines()[-1])
        row = {"chosen": result.best_trial.label, "claim": verdict and verdict.describe(),
               "claim_outcome": verdict and verdict.outcome, "search_s": round(seconds, 1),
               "inproc": _ratio(in_process, baselines), "fresh": _ratio(fresh, baselines),
               "steps": result.tuning_steps}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
