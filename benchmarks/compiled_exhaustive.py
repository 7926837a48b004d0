"""Is a compiled search's choice the fastest plan that fits? The search against every plan of its space, measured.

For the compiled GPT of ``compiled_retiming.py`` (width 128, batch 8 x 64 tokens, no dropout, activation budget
50%, the tuner's defaults), each depth and way of compiling (``whole``: ``torch.compile(model)``; ``regional``:
``block.compile()`` on each block, as torchtitan does) runs in a fresh process with an empty inductor cache:

1. ``tune`` as a user calls it: the chosen plan, and what the search cost (seconds, and plain compiled steps);
2. every plan of the search's space compiled whole and measured (time and memory) by the search's own runner,
   except those the search's compiled memory model predicted more than 10% over the budget (its median error is
   0-5.5%; ``compiled_retiming.py``): the exhaustive measurement;
3. the chosen plan and the three fastest fitting plans of step 2 re-timed side by side in interleaved rounds (each
   round switches plans every few steps; a plan's graph is compiled once and reused), 6 rounds and more until the
   90% interval of the rounds' paired ratio (the strongest other contender's seconds over the chosen plan's, within
   each round: ``paired_ratio``) is 3% wide or lies wholly above or below 0.97 (24 rounds at most): the chosen
   plan's throughput over the fastest's, the issue's ">= 0.97x";
4. the compiled time model's error on every plan step 2 measured: the search's fitted model (blocks compiled
   alone, anchored on the steps it measured), and the same model with what the plans add scaled by one factor
   fitted on the compiled ``full`` step (``scaled``: how much of the error is one systematic factor).

Every row also measures the user's own first compile (the first step of the plain model compiled their way, in the
row's fresh process and empty cache): the search's yardstick; a ``regional`` row also the whole model's first compile,
alone in a fresh process. Each row keeps the search's trials (``search_trials``: measured on the blocks compiled
alone, or pruned with their prediction). ``--search-only`` stops after step 1: the search's cost against that
compile, the compiles it ran, the choice (``--out`` another file). ``--rescore`` recomputes the side-by-side figures
of a result file from its recorded rounds. Each full row also gives the lock-in compile (``lock_in_compile_seconds``:
the chosen plan's first compile the user's way after the search, which training pays when it resumes) and the search
with it over the user's compile. ``--check-whole-compile`` tunes with ``TuneConfig(check_whole_compile=True)``: a PT2
budget chosen on the blocks compiled alone is compiled the user's way beside the fastest plan of ours and the faster
kept (``search.whole_check``; ``whole_compile_check`` in the row says what it did).

Run: ``python benchmarks/compiled_exhaustive.py --layers 8 32 --ways regional whole`` (2-core CPU, 2026-12-06: 3 to
9 minutes a row but the whole 32-layer one, about 26), or ``--rows 8:regional 8:whole 32:regional``; writes
``benchmarks/results/compiled_exhaustive.json`` after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_ckpt import Plan, TuneConfig, tune
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.search.compile import compiled_search, release_kept_graphs, reset_compiled
from lightning_ckpt.timing.model import TimeModel

sys.path.insert(0, str(Path(__file__).parent))
from compiled_retiming import BATCH, SHAPE, compiled_gpt, plain_compiled_step  # noqa: E402  (the same model)

WAYS = ("regional", "whole")
ROUNDS = 6  # side-by-side rounds of step 3, at least
MAX_ROUNDS = 24  # ... and at most, stopping once the ratio's interval is this narrow:
SETTLED = 0.03  # (or once it lies wholly above or below the target)
TARGET = 0.97  # the chosen plan's throughput over the fastest's, at least
MEMORY_MARGIN = 1.10  # step 2 skips plans predicted over 110% of the budget


def worker(way: str, layers: int, out: Path, search_only: bool = False, check_whole: bool = False) -> None:
    model, compiled, x = compiled_gpt(layers, regional=way == "regional")

    def step() -> torch.Tensor:
        return compiled(x, x)

    # The user's own first compile: the first step of the plain model compiled their way, in this fresh process
    # and empty inductor cache (what a user pays at the first step of training, the search's yardstick).
    users_first_compile = _first_step_seconds(model, step)
    _, plain = plain_compiled_step(model, step)
    reset_compiled()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tune(compiled, step, activation_budget=0.5, batch_size=BATCH, seq_len=SHAPE["block_size"],
                      extra_tensors=(x,), config=TuneConfig(check_whole_compile=check_whole))  # fmt: skip
    search_seconds = time.perf_counter() - t0
    budget, chosen = result.budget, result.best
    saved = chosen.provenance.compiled_profile
    cost = {
        "way": way,
        "layers": layers,
        "users_first_compile_seconds": users_first_compile,
        "search_seconds": search_seconds,
        "search_over_users_first_compile": search_seconds / users_first_compile,
        "plain_compiled_step_seconds": plain,
        "plain_step_equivalents": search_seconds / plain,
        "compiles": chosen.metadata.get("compiles"),
        "check_whole_compile": check_whole,
        "whole_compile_check": dict(chosen.provenance.whole_compile_check) or None,
        "pt2_partitioned_whole": [dict(p) for p in chosen.provenance.pt2_partitioned_whole] or None,
        "chosen": chosen.describe(),
        "budget": budget.description,
        # What the search measured, on the blocks compiled alone, and what it predicted for the plans it pruned.
        "search_trials": [
            {
                "plan": t.label,
                "status": str(t.status),
                "pruned_by": t.pruned_by,
                "median_seconds": t.median_seconds,
                "predicted_seconds": t.predicted_seconds,
                "side_by_side_seconds": list(t.confirmation_seconds),
                "activation_bytes": t.activation_bytes,
                "predicted_activation_bytes": t.predicted_activation_bytes,
            }
            for t in result.trials
        ],
        # The time model the search pruned by: its base and the anchors it was fitted on (label, the seconds the
        # plan adds by the blocks' timings, the step measured), and each distinct block's seconds per mode.
        "time_model": {k: (saved.get("time") or {}).get(k) for k in ("calibration", "blocks")},
    }
    if search_only:
        out.write_text(json.dumps(cost, indent=2))
        return
    fitted = TimeModel.from_dict(saved["time"]) if saved.get("time") else None

    # 2. Every plan of the space the memory model does not rule out by more than the margin, measured compiled.
    harness = StepHarness(model, step, torch.device("cpu"), extra=(x,), batch_size=BATCH,
                          seq_len=SHAPE["block_size"], warmup_steps=1, measure_steps=3)  # fmt: skip
    runner = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False)
    assert runner is not None
    limit = budget.limit_bytes or 0
    plans: dict[str, tuple[str, Plan, int | None]] = {}
    for t in result.trials:
        predicted = t.predicted_activation_bytes
        if predicted is not None and limit and predicted > MEMORY_MARGIN * limit and not t.plan.is_empty:
            continue  # (``none`` is always measured: the time model's base)
        plans.setdefault(t.plan.key(), (t.label, t.plan, predicted))
    rows = []
    t_sweep = time.perf_counter()
    for label, plan, predicted in plans.values():
        m = runner.measure(plan, None)
        rows.append({
            "plan": label,
            "status": m.status,
            "fits": bool(m.ok and budget.fits(m.peak_bytes, m.activation_bytes)),
            "median_seconds": m.median_seconds,
            "activation_bytes": m.activation_bytes,
            "predicted_activation_bytes": predicted,
            "predicted_seconds": fitted.predict_seconds(plan) if fitted is not None else None,
            "added_seconds": fitted.added_seconds(plan) if fitted is not None else None,
            "compile_seconds": (m.extra.get("compile") or {}).get("compile_seconds"),
            "_plan": plan,
        })  # fmt: skip
        print(f"  {label}: {m.status} {m.median_seconds}", flush=True)
    sweep_seconds = time.perf_counter() - t_sweep
    # What training pays when it resumes with the chosen plan: its first compile the user's way after the search (the
    # sweep's first compile of it, in this process and cache; served by the caches where the search compiled it so).
    lock_in = next((r["compile_seconds"] for r in rows if r["_plan"].key() == chosen.key()), None)
    fitting = sorted((r for r in rows if r["fits"] and r["median_seconds"]), key=lambda r: r["median_seconds"])

    # 3. The chosen plan beside the three fastest fitting plans, interleaved rounds.
    chosen_key = chosen.key()
    contenders = {r["_plan"].key(): (r["plan"], r["_plan"]) for r in fitting[:3]}
    contenders.setdefault(chosen_key, ("chosen", chosen))
    samples: dict[str, list[float | None]] = {k: [] for k in contenders}
    for r in range(MAX_ROUNDS):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for key in order:
            m = runner.retime(contenders[key][1], 3)
            samples[key].append(m.median_seconds if m.ok and m.median_seconds else None)
        if r + 1 >= ROUNDS and len(samples) > 1:
            # The chosen plan against the strongest of the others: above 1 it was the fastest, by that much.
            rival, paired, interval = paired_ratio(samples, chosen_key)
            if interval[1] - interval[0] <= SETTLED or interval[0] >= TARGET or interval[1] < TARGET:
                break
    release_kept_graphs()
    side = {contenders[k][0]: statistics.median(_ok(v)) for k, v in samples.items() if _ok(v)}
    rival, paired, interval = paired_ratio(samples, chosen_key)
    ratio = min(1.0, paired)

    # 4. The time model's error on every measured plan, as fitted and with one scale on what plans add.
    errors = [r["predicted_seconds"] / r["median_seconds"] - 1 for r in rows
              if r["predicted_seconds"] and r["median_seconds"]]  # fmt: skip
    none = next((r for r in rows if r["_plan"].is_empty and r["median_seconds"]), None)
    full = next((r for r in rows if r["plan"].endswith(":full") and r["median_seconds"] and r["added_seconds"]), None)
    scaled_errors: list[float] = []
    scale = None
    if none is not None and full is not None:
        scale = (full["median_seconds"] - none["median_seconds"]) / full["added_seconds"]
        for r in rows:
            if r["added_seconds"] is not None and r["median_seconds"]:
                predicted = none["median_seconds"] + scale * r["added_seconds"]
                scaled_errors.append(predicted / r["median_seconds"] - 1)
    search = chosen.metadata.get("search", {})
    record = {
        **cost,
        "lock_in_compile_seconds": lock_in,
        "search_and_lock_in_over_users_first_compile": (search_seconds + lock_in) / users_first_compile
        if lock_in is not None
        else None,
        "plans_in_space": len({t.plan.key() for t in result.trials}),
        "plans_measured_exhaustively": len(rows),
        "exhaustive_seconds": sweep_seconds,
        "fastest_fitting_exhaustive": fitting[0]["plan"] if fitting else None,
        "side_by_side_median_seconds": side,
        "side_by_side_rounds": len(samples[chosen_key]),
        "side_by_side_round_seconds": {contenders[k][0]: v for k, v in samples.items()},
        "chosen_side_by_side": contenders[chosen_key][0],
        "strongest_rival_side_by_side": contenders[rival][0] if rival is not None else None,
        "chosen_over_fastest": ratio,
        # The median of the rounds' paired ratios (the strongest other contender's seconds over the chosen plan's,
        # within each round; ``paired_ratio``), at most 1, and its 90% bootstrap interval: above 1, the chosen plan
        # was the fastest.
        "chosen_over_fastest_interval": list(interval),
        "search_time_errors": {
            k: (search.get("time_model") or {}).get(k)
            for k in ("predicted_and_measured", "median_abs_error", "max_abs_error")
        },  # fmt: skip
        "time_model_median_abs_error_all_plans": statistics.median(abs(e) for e in errors) if errors else None,
        "time_model_max_abs_error_all_plans": max((abs(e) for e in errors), default=None),
        # The same plain step measured twice in this process (before the search, and in step 2): the noise floor.
        "none_in_sweep_over_plain_step": none["median_seconds"] / plain - 1 if none is not None else None,
        "scale_fitted_on_full": scale,
        "scaled_median_abs_error_all_plans": (
            statistics.median(abs(e) for e in scaled_errors) if scaled_errors else None
        ),
        "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }
    out.write_text(json.dumps(record, indent=2))


def _first_step_seconds(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> float:
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    step().backward()
    return time.perf_counter() - t0


def first_compile_worker(layers: int, out: Path) -> None:
    """The same model's first step compiled whole, alone in a fresh process and cache: a regional row's second
    yardstick (compiled block by block, the user's own compile is one block's graph, reused by every block)."""
    model, compiled, x = compiled_gpt(layers, regional=False)
    out.write_text(json.dumps({"seconds": _first_step_seconds(model, lambda: compiled(x, x))}))


def _ok(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def paired_ratio(
    samples: dict[str, list[float | None]], chosen_key: str
) -> tuple[str | None, float, tuple[float, float]]:
    """The strongest other contender, the median of its per-round ratio ``its seconds / the chosen plan's``, and that
    median's 90% bootstrap interval. Paired within a round (plans run one after another, a few steps each): this
    machine's speed drifts and jumps between rounds (steps of 178 or 230 ms for the same plan, 2026-12-05), which
    medians of unpaired samples mix up; within a round both plans mostly see the same machine."""
    best: tuple[str, float, list[float]] | None = None
    for key, values in samples.items():
        if key == chosen_key:
            continue
        ratios = [f / c for f, c in zip(values, samples[chosen_key], strict=True) if f is not None and c is not None]
        if len(ratios) >= 2 and (best is None or statistics.median(ratios) < best[1]):
            best = (key, statistics.median(ratios), ratios)
    if best is None:
        return None, 1.0, (0.0, float("inf"))
    key, median, ratios = best
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return key, median, (medians[100], medians[1899])


def rescore(path: Path) -> None:
    """The side-by-side figures of every row of ``path`` recomputed from its recorded rounds (``paired_ratio``)."""
    payload = json.loads(path.read_text())
    for r in payload["rows"]:
        rounds = r.get("side_by_side_round_seconds")
        if not rounds:
            continue
        rival, paired, interval = paired_ratio(rounds, r["chosen_side_by_side"])
        r.update(
            strongest_rival_side_by_side=rival,
            chosen_over_fastest=min(1.0, paired),
            chosen_over_fastest_interval=list(interval),
        )
        print(f"{r['way']:>8} {r['layers']:>3} layers | {r['chosen_over_fastest']:.3f}x ({interval[0]:.3f}-"
              f"{interval[1]:.3f}) against {rival}")  # fmt: skip
    path.write_text(json.dumps(payload, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compiled_exhaustive.json")
    parser.add_argument("--rows", nargs="+", help="LAYERS:WAY pairs instead of every --layers x --ways")
    parser.add_argument(
        "--search-only",
        action="store_true",
        help="the search's cost against the user's first compile only (no exhaustive measurement)",
    )
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="recompute the side-by-side figures of the rows in --out from their recorded rounds (paired_ratio)",
    )
    parser.add_argument(
        "--check-whole-compile",
        action="store_true",
        help="tune with TuneConfig(check_whole_compile=True): a PT2 budget chosen on the blocks is checked compiled "
        "your way (write it to another --out)",
    )
    parser.add_argument(
        "--keep-other-rows",
        action="store_true",
        help="keep the rows of --out that this run does not measure (each row records the command that measured it)",
    )
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--first-compile-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        way, layers, out = args.worker
        worker(way, int(layers), Path(out), args.search_only, args.check_whole_compile)
        return
    if args.first_compile_worker:
        layers, out = args.first_compile_worker
        first_compile_worker(int(layers), Path(out))
        return
    if args.rescore:
        rescore(args.out)
        return
    records = []
    rows = [(layers, way) for layers in args.layers for way in args.ways]
    if args.rows:
        rows = [(int(r.split(":")[0]), r.split(":")[1]) for r in args.rows]
    command = "python benchmarks/compiled_exhaustive.py " + " ".join(sys.argv[1:])
    payload = {"command": command, "torch": torch.__version__, "shape": {**SHAPE, "batch": BATCH}, "rows": records}
    kept: list[dict] = []
    if args.keep_other_rows and args.out.exists():
        before = json.loads(args.out.read_text())
        kept = [{"command": before.get("command"), **r} for r in before.get("rows", [])]
    for layers, way in rows:
        t0 = time.perf_counter()
        flags = ["--check-whole-compile"] if args.check_whole_compile else []
        record = _fresh_process([sys.executable, __file__, *flags, "--worker", way, str(layers)], args.search_only)
        if way == "regional":
            whole = _fresh_process([sys.executable, __file__, "--first-compile-worker", str(layers)], False)
            record["whole_first_compile_seconds"] = whole["seconds"]
            record["search_over_whole_first_compile"] = record["search_seconds"] / whole["seconds"]
        record["row_seconds"] = time.perf_counter() - t0
        record["command"] = command
        records.append(record)
        if kept:  # the rows measured before, in their order, this run's in place of theirs
            fresh = {(r["layers"], r["way"]): r for r in records}
            old = {(r["layers"], r["way"]) for r in kept}
            payload["rows"] = [fresh.get((r["layers"], r["way"]), r) for r in kept]
            payload["rows"] += [r for key, r in fresh.items() if key not in old]
        # Written after every row: a long run stopped part way keeps the rows it finished.
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2))
        r = records[-1]
        whole_line = (
            f" (whole: {r['whole_first_compile_seconds']:.0f} s, {r['search_over_whole_first_compile']:.2f}x)"
            if way == "regional" else ""
        )  # fmt: skip
        if args.search_only:
            print(
                f"{way:>8} {layers:>3} layers | your first compile {r['users_first_compile_seconds']:.0f} s | search "
                f"{r['search_seconds']:.0f} s = {r['search_over_users_first_compile']:.2f}x{whole_line} | compiled "
                f"{(r['compiles'] or {}).get('graphs')} graphs in {(r['compiles'] or {}).get('seconds', 0):.0f} s | "
                f"chosen {r['chosen']}",
                flush=True,
            )
            continue
        print(
            f"{way:>8} {layers:>3} layers | your first compile {r['users_first_compile_seconds']:.0f} s | search "
            f"{r['search_seconds']:.0f} s = {r['search_over_users_first_compile']:.2f}x{whole_line} | lock-in compile "
            f"{r['lock_in_compile_seconds']:.1f} s | chosen {r['chosen']} | "
            f"{r['chosen_over_fastest']:.3f}x the fastest side by side (fastest other / chosen, 90%: "
            f"{r['chosen_over_fastest_interval'][0]:.3f}-{r['chosen_over_fastest_interval'][1]:.3f}, "
            f"{r['side_by_side_rounds']} rounds; fastest measured: {r['fastest_fitting_exhaustive']}) | time "
            f"error, all {r['plans_measured_exhaustively']} plans: median "
            f"{r['time_model_median_abs_error_all_plans']}, scaled {r['scaled_median_abs_error_all_plans']}",
            flush=True,
        )


def _fresh_process(cmd: list[str], search_only: bool) -> dict:
    """Runs a worker in a fresh process with an empty inductor cache (each compile measured as a user's first)."""
    with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        subprocess.run([*cmd, out.name, *(["--search-only"] if search_only else [])], check=True, env=env)
        return json.loads(Path(out.name).read_text())


if __name__ == "__main__":
    main()
