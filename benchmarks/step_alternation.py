"""How should a confirmation round time its plans? One step each, alternating, against one warm-up and three steps.

The confirmation (``lightning_ckpt.search.confirm``) pairs plans by round: a round's ratio cancels whatever the
machine's speed was at that moment. The shorter a round, the closer in time its two figures, and the more of the
machine's drift the ratio cancels; a warm-up step per plan per round is a step that is paid for and not used.
This times two baselines of a case (``full`` and ``sqrt_segments``) in one process, both ways, on the same
machine minutes apart:

- alternating: A B B A A B ... single steps, no warm-up after the first; each adjacent A, B is a pair;
- blocked: rounds of one warm-up and ``--steps`` timed steps per plan (the median), as the confirmation did.

It prints, for each, the ratio, the standard error of its log, and the steps spent, and the standard error
scaled to the same number of steps, and whether a step just after the other plan's is slower than one after its
own (a switching cost would bias the alternating ratio). Run: ``python benchmarks/step_alternation.py mixer gpt``
(about 2 minutes on 2 cores); writes ``benchmarks/results/step_alternation.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def _ratio(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(B's speed over A's, standard error of its log) from paired (A seconds, B seconds)."""
    logs = [math.log(a / b) for a, b in pairs]
    return math.exp(statistics.fmean(logs)), statistics.stdev(logs) / math.sqrt(len(logs))


def run_case(case_name: str, pairs: int, rounds: int, steps: int) -> dict:
    import repeatability as R

    from lightning_ckpt import baselines, plan_applied

    case = R.BUILDERS[case_name](False)
    named = baselines(case.model)
    plans = {"A": named["full"], "B": named["sqrt_segments"]}

    def one(name: str) -> float:
        with plan_applied(case.model, plans[name], check_fingerprint=False):
            start = time.perf_counter()
            case.loss_fn().backward()
            seconds = time.perf_counter() - start
        for p in case.model.parameters():
            p.grad = None
        return seconds

    for name in "ABABAB":  # the process's first steps are slow
        one(name)
    sequence: list[tuple[str, bool, float]] = []  # (plan, after a step of the same plan, seconds)
    previous = None
    for name in "ABBA" * (pairs // 2):
        sequence.append((name, previous == name, one(name)))
        previous = name
    adjacent = []
    for i in range(0, len(sequence), 2):
        first, second = sequence[i], sequence[i + 1]
        adjacent.append((first[2], second[2]) if first[0] == "A" else (second[2], first[2]))
    alt_ratio, alt_se = _ratio(adjacent)
    switch = {}
    for name in "AB":
        after_other = [s for n, same, s in sequence if n == name and not same]
        after_same = [s for n, same, s in sequence if n == name and same]
        switch[name] = statistics.median(after_other) / statistics.median(after_same)

    blocked = []
    for _ in range(rounds):
        figures = []
        for name in "AB":
            one(name)  # the warm-up
            figures.append(statistics.median(one(name) for _ in range(steps)))
        blocked.append((figures[0], figures[1]))
    blk_ratio, blk_se = _ratio(blocked)
    alt_steps, blk_steps = len(sequence), rounds * 2 * (steps + 1)
    row = {
        "case": case_name,
        "plans": {"A": "full", "B": "sqrt_segments"},
        "alternating": {"ratio_b_over_a": alt_ratio, "se_log": alt_se, "steps": alt_steps},
        "blocked": {"ratio_b_over_a": blk_ratio, "se_log": blk_se, "steps": blk_steps, "timed_steps": steps},
        "se_log_at_equal_steps": {"alternating": alt_se, "blocked": blk_se * math.sqrt(blk_steps / alt_steps)},
        "after_other_over_after_same_median": switch,
    }
    scaled = row["se_log_at_equal_steps"]["blocked"]
    print(
        f"{case_name}: alternating {alt_ratio:.3f} (SE {alt_se:.3f}, {alt_steps} steps); blocked 1+{steps} "
        f"{blk_ratio:.3f} (SE {blk_se:.3f}, {blk_steps} steps; {scaled:.3f} at {alt_steps} steps: "
        f"{scaled / alt_se:.1f}x the alternating); a step after the other plan's over one after its own: "
        + ", ".join(f"{row['plans'][k]} {v:.3f}" for k, v in switch.items()),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=("gpt", "mixer", "llama"))
    parser.add_argument("--pairs", type=int, default=120, help="adjacent A, B pairs of the alternating design")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the blocked design")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan per blocked round")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "step_alternation.json")
    args = parser.parse_args()
    rows = [run_case(c, args.pairs, args.rounds, args.steps) for c in args.cases]
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "cases": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
