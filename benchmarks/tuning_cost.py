"""What a search costs, in plain training steps: GPTs of 8 to 64 layers, the tuner's defaults, on CPU.

For each depth the plain step (forward + backward, no plan) is timed first, then ``tune()`` runs with
its defaults (40 trials, the default space) and an activation budget of 50%. The cost is reported as
wall seconds and as *plain-step equivalents* (tuning seconds / plain step seconds), split into where
it went: the memory profile, the measured optimizer step, the trials (tracked memory pass, warm-up,
timed steps, FLOP count), the confirmation round, and the rest (sampler, process warm-up). Each depth
is searched ``--repeats`` times (3) in fresh models; the table shows the median run by cost, the JSON
every run. Run it on a quiet machine: ``python benchmarks/tuning_cost.py`` (writes
``benchmarks/results/tuning_cost.json``).

``--shapes`` measures a search on GPTs of other shapes (``SHAPES``: 4 to 32 blocks, width 64 to 256, batch 2 to
16, sequence 64 to 256; plain steps from about 10 ms to about 400 ms on a quiet 2-core CPU), each search in a fresh
process (``--one '<shape as JSON>'``), so that it pays for its process's first calls as a user's first search does:
the ``--depths`` runs above profile the model before they time ``tune()``. The plain step is timed after the
search, in the same process and on the same model (``tune`` leaves the model as it was), so the process is as warm
as the user's training is after a search; timing it first would warm the process the search is meant to find cold.
The table gives the plain step, the search's wall time (the tuner's defaults, a 50% activation budget), their
ratio in plain steps and, where the result has them (``result.cost.seconds``), each phase's seconds and share; the JSON
(``benchmarks/results/tuning_cost_shapes.json``) every run, the torch version, the date, the cores and the
command. ``--shapes --plain-only`` times only the plain steps (a few each, in this process): run it first, on the
quiet machine, to see that they span about 10-500 ms there. ``--shapes --quick`` is a smoke run: the smallest shape,
one search (the same defaults), written to a temporary file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt import tune
from lightning_ckpt.memory.optimizer_measure import measure_optimizer_step
from lightning_ckpt.memory.profile import profile_step
from lightning_ckpt.testing import GPT, GPTConfig


def plain_step_seconds(model: torch.nn.Module, x: torch.Tensor, steps: int = 10) -> float:
    for _ in range(3):
        model(x, x).backward()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x, x).backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def run_depth(depth: int, *, batch: int, seq: int, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=depth, n_head=4, n_embd=width, vocab_size=256, block_size=seq, dropout=0.0))
    x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = plain_step_seconds(model, x)

    def loss() -> torch.Tensor:
        return model(x, x)

    t0 = time.perf_counter()
    profile_step(model, loss, optimizer=optimizer, extra=(x,))  # memory and block timings, as tune profiles
    profile_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    measure_optimizer_step(model, optimizer, device="cpu", extra=(x,))
    optimizer_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = tune(model, loss, optimizer=optimizer, activation_budget=0.5, batch_size=batch, seq_len=seq,
                  extra_tensors=(x,))  # fmt: skip
    total = time.perf_counter() - t0
    trial_seconds = sum(t.seconds for t in result.trials)
    confirmed = [t for t in result.trials if t.confirmed]
    confirm_steps = sum(t.steps for t in confirmed)  # incl. the trial's own; the split below uses time
    rest = total - profile_seconds - optimizer_seconds - trial_seconds
    return {
        "depth": depth,
        "plain_step_seconds": step,
        "tuning_seconds": total,
        "plain_step_equivalents": total / step,
        "training_steps_run": result.tuning_steps,
        "trials": len(result.trials),
        "measured": result.n_measured,
        "space_size": result.best.metadata["search"]["space_size"],
        "profile_seconds": profile_seconds,
        "optimizer_step_seconds": optimizer_seconds,
        "trial_seconds": trial_seconds,
        "confirmation_and_rest_seconds": rest,
        "confirmed_trials": len(confirmed),
        "confirmed_trial_steps": confirm_steps,
        "chosen": result.best.describe(),
        "time_model": result.best.metadata["search"].get("time_model"),
        # how many rounds chose the plan (``chosen_after``) and how many fresh ones gave its claim (``rounds``)
        "verdict": result.best.metadata["search"].get("verdict"),
        "prediction_errors": [t.prediction_error for t in result.trials if t.prediction_error is not None],
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose cost is the median (the lower middle one of an even count), with every run's cost beside it."""
    ordered = sorted(runs, key=lambda r: r["plain_step_equivalents"])
    return {
        **ordered[(len(ordered) - 1) // 2],
        "plain_step_equivalents_of_runs": [r["plain_step_equivalents"] for r in runs],
    }


# The shapes ``--shapes`` searches, smallest plain step first (``--quick`` takes the first): depth 4-32 blocks, width
# 64-256, batch 2-16, sequence 64-256, and plain steps from about 10 ms to about 400 ms on a quiet 2-core CPU. The step
# beside each is the quiet machine's (2026-12-07, ``results/tuning_cost_shapes.json``) where it was measured, else
# what it was picked for, scaled from those by its forward and backward FLOPs (the machine was busy when they were
# picked); ``--shapes --plain-only`` times them on the machine at hand.
SHAPES: tuple[dict[str, Any], ...] = tuple(
    dict(zip(("layers", "width", "heads", "batch", "seq"), v, strict=True))
    for v in [
        (4, 128, 4, 4, 64),  # ~10 ms (picked): the shallowest, a fast step
        (8, 64, 4, 4, 64),  # 10.4 ms
        (8, 128, 4, 2, 128),  # 18.9 ms
        (16, 64, 4, 4, 256),  # 65.8 ms: the longest sequence
        (32, 64, 4, 8, 64),  # 90.5 ms: the --depths 32 shape, the deepest
        (12, 128, 4, 8, 128),  # 113.5 ms: issue #66's
        (4, 256, 8, 16, 80),  # 131 ms: the widest, the largest batch
        (12, 256, 8, 8, 128),  # ~400 ms (picked): the slowest step
    ]
)

# What a child prints before its figures (one JSON line), so that anything else it prints cannot be taken for them.
_RESULT_MARK = "TUNING_COST_RESULT "


def _shape_name(shape: Mapping[str, Any]) -> str:
    return f"{shape['layers']}x{shape['width']}, batch {shape['batch']}x{shape['seq']}"


def _build(shape: Mapping[str, Any]) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=shape["layers"], n_head=shape["heads"], n_embd=shape["width"], vocab_size=256,
                       block_size=shape["seq"], dropout=0.0)  # fmt: skip
    x = torch.randint(0, 256, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    return GPT(config), x


def _timed_plain_steps(
    model: torch.nn.Module, x: torch.Tensor, *, warmup: int, least: int, seconds: float
) -> list[float]:
    """Plain steps (forward + backward, no plan): ``warmup`` untimed, then at least ``least`` timed and at least
    ``seconds`` of them (a 10 ms step gets more than ten), at most 200."""
    for _ in range(warmup):
        model(x, x).backward()
    times: list[float] = []
    while len(times) < 200 and (len(times) < least or sum(times) < seconds):
        t0 = time.perf_counter()
        model(x, x).backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return times


def search_one(shape: Mapping[str, Any], *, quick: bool = False) -> dict[str, Any]:
    """One search on ``shape`` in this (fresh) process, then the plain step on the same model."""
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))  # as the --depths runs
    model, x = _build(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        return model(x, x)

    t0 = time.perf_counter()
    result = tune(model, loss, optimizer=optimizer, activation_budget=0.5, batch_size=shape["batch"],
                  seq_len=shape["seq"], extra_tensors=(x,))  # fmt: skip
    search_seconds = time.perf_counter() - t0
    times = _timed_plain_steps(
        model, x, warmup=2 if quick else 3, least=5 if quick else 10, seconds=0.5 if quick else 3.0
    )
    step = statistics.median(times)
    phases = result.cost.seconds if getattr(result, "cost", None) is not None else None  # phase -> seconds
    if isinstance(phases, Mapping):
        phases = {
            str(k): float(v) for k, v in phases.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    else:
        phases = None
    return {
        "shape": dict(shape),
        "name": _shape_name(shape),
        "plain_step_seconds": step,
        "plain_step_times": times,
        "tuning_seconds": search_seconds,
        "plain_step_equivalents": search_seconds / step,
        "phases": phases,
        "phase_plain_steps": {k: v / step for k, v in phases.items()} if phases is not None else None,
        "training_steps_run": result.tuning_steps,
        "trials": len(result.trials),
        "measured": result.n_measured,
        "chosen": result.best.describe(),
        "verdict": result.best.metadata["search"].get("verdict"),
        # The allowance counts plain steps as the search timed them (its ``none`` trial): the same figure beside the
        # outside one above, and which rounds the allowance stopped.
        "search_plain_step_seconds": result.cost.plain_step_seconds,
        "search_plain_steps": result.cost.plain_steps,
        "allowance": result.best.metadata["search"].get("allowance"),
    }


def _search_in_fresh_process(shape: Mapping[str, Any], *, quick: bool) -> dict[str, Any]:
    """``search_one`` in a child process of its own; its wall time from spawn to exit beside its figures."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(dict(shape))]
    if quick:
        command.append("--quick")
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"the search of {_shape_name(shape)} failed (exit {done.returncode}): {shlex.join(command)}")
    return {**json.loads(lines[-1][len(_RESULT_MARK) :]), "process_seconds": wall}


def _phases_cell(row: Mapping[str, Any]) -> str:
    phases = row.get("phases")
    if phases is None:
        return "n/a"
    total, step = row["tuning_seconds"], row["plain_step_seconds"]
    return ", ".join(f"{name} {s:.1f} s = {s / step:.0f} steps ({s / total:.0%})" for name, s in phases.items())


def _shapes_table(rows: list[dict[str, Any]], repeats: int) -> str:
    head = "| model (layers x width, batch x seq) | plain step ms | search s | plain steps |"
    rule = "|---|---|---|---|"
    if repeats > 1:
        head, rule = head + " runs (plain steps) |", rule + "---|"
    head, rule = head + " phases (seconds, plain steps, share of the search) |", rule + "---|"
    lines = [head, rule]
    for r in rows:
        cells = [f"GPT {r['name']}", f"{1000 * r['plain_step_seconds']:.1f}", f"{r['tuning_seconds']:.1f}",
                 f"{r['plain_step_equivalents']:.0f}"]  # fmt: skip
        if repeats > 1:
            cells.append(" / ".join(f"{v:.0f}" for v in r["plain_step_equivalents_of_runs"]))
        cells.append(_phases_cell(r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plain_only(shapes: tuple[dict[str, Any], ...]) -> None:
    """The plain step of each shape, a few steps each, in this process: whether ``SHAPES`` spans 10-500 ms here."""
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    print("| model (layers x width, batch x seq) | plain step ms (median of 5) |\n|---|---|")
    for shape in shapes:
        model, x = _build(shape)
        times = _timed_plain_steps(model, x, warmup=2, least=5, seconds=0.0)
        print(f"| GPT {_shape_name(shape)} | {1000 * statistics.median(times):.1f} |", flush=True)


def run_shapes(args: argparse.Namespace) -> None:
    shapes = SHAPES[:1] if args.quick else SHAPES
    repeats = 1 if args.quick else args.repeats
    runs: dict[str, list[dict[str, Any]]] = {}
    for shape in shapes:
        name = _shape_name(shape)
        for i in range(repeats):
            print(f"searching GPT {name} (run {i + 1} of {repeats}) in a fresh process...", flush=True)
            run = _search_in_fresh_process(shape, quick=args.quick)
            runs.setdefault(name, []).append(run)
            print(f"  plain step {1000 * run['plain_step_seconds']:.1f} ms, search {run['tuning_seconds']:.1f} s = "
                  f"{run['plain_step_equivalents']:.0f} plain steps ({run['process_seconds']:.0f} s in all)", flush=True)  # fmt: skip
    rows = [_median_run(r) for r in runs.values()]
    print(_shapes_table(rows, repeats))
    out = args.out or (
        Path(tempfile.gettempdir()) / "tuning_cost_shapes_quick.json"
        if args.quick
        else Path(__file__).parent / "results" / "tuning_cost_shapes.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": shlex.join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "processor": platform.processor()},
        "device": "cpu",
        "activation_budget": 0.5,
        "plain_step": "median forward + backward without a plan, timed after the search in the search's process",
        "repeats": repeats,
        "rows": rows,
        "runs": runs,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3,
                        help="searches per depth or shape, each in fresh models (--shapes: fresh processes); the "
                        "table shows the median by cost")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON written (default: results/tuning_cost.json; with --shapes "
                        "results/tuning_cost_shapes.json, with --quick a temporary file)")  # fmt: skip
    parser.add_argument("--shapes", action="store_true", help="search each of SHAPES in a fresh process")
    parser.add_argument("--plain-only", action="store_true", help="with --shapes: time only their plain steps")
    parser.add_argument("--quick", action="store_true", help="with --shapes: a smoke run of the smallest shape")
    parser.add_argument("--one", metavar="JSON", help=argparse.SUPPRESS)  # the child of --shapes: one search
    args = parser.parse_args()
    if args.one is not None:
        print(_RESULT_MARK + json.dumps(search_one(json.loads(args.one), quick=args.quick)), flush=True)
        return
    if args.shapes:
        if args.plain_only:
            plain_only(SHAPES)
        else:
            run_shapes(args)
        return
    args.out = args.out or Path(__file__).parent / "results" / "tuning_cost.json"
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    runs = {d: [run_depth(d, batch=args.batch, seq=args.seq, width=args.width) for _ in range(args.repeats)]
            for d in args.depths}  # fmt: skip
    rows = [_median_run(runs[d]) for d in args.depths]
    print(f"{'layers':>6s} {'step ms':>8s} {'tuning s':>9s} {'plain-step eq':>13s} {'runs':>15s} {'steps run':>9s} "
          f"{'measured':>8s} {'profile s':>9s} {'trials s':>8s} {'confirm+rest s':>14s} {'time err':>8s}  chosen")  # fmt: skip
    for r in rows:
        costs = "/".join(f"{v:.0f}" for v in r["plain_step_equivalents_of_runs"])
        errors = [abs(e) for e in r.get("prediction_errors") or ()]
        error = f"{statistics.median(errors):.1%}" if errors else "-"
        print(
            f"{r['depth']:6d} {1000 * r['plain_step_seconds']:8.1f} {r['tuning_seconds']:9.1f} "
            f"{r['plain_step_equivalents']:13.0f} {costs:>15s} {r['training_steps_run']:9d} {r['measured']:8d} "
            f"{r['profile_seconds']:9.1f} {r['trial_seconds']:8.1f} {r['confirmation_and_rest_seconds']:14.1f} "
            f"{error:>8s}  {r['chosen']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(), "batch": args.batch,
               "seq": args.seq, "width": args.width, "repeats": args.repeats, "rows": rows,
               "runs": {str(d): r for d, r in runs.items()}}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
