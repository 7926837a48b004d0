"""What re-timing costs in a compiled search: every round compiling its plans again, or each plan compiled once.

A compiled search confirms its leaders and every fitting baseline in interleaved rounds (6 to 24, then 8 to 32
held-out rounds of the winner and the reference), switching plans every step. Before, every re-timing reset dynamo
and compiled its plan again (``reset_compiled`` + a compile served by the FX graph cache); now a plan applied again
installs the forwards it had (``plan.apply.reused_forwards``), dynamo's guards match the graph compiled for it,
and a round costs its steps (``CompiledTrials.retime``).

The variants run the same ``tune`` on the compiled GPT (the issue's shape: 8 layers, width 128, batch 8 x 64
tokens, no dropout, activation budget 50%), each in a fresh process with an empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR``), so neither inherits the other's compiled code. ``every-round`` restores the old
behaviour by wrapping ``CompiledTrials.retime`` with a reset before and after each call and fresh forwards;
``once-regional`` compiles each block alone (``block.compile()``, as torchtitan does) instead of the whole model.
Reported: the search's seconds, the seconds spent inside re-timings, how many of them compiled, and the plain
compiled step, so the cost reads as plain compiled-step equivalents.

``--default-space``: the tuner's default space and trial count, as the issue's user ran it (write it to another
``--out``). ``--layers 8 32``: one row per depth and variant. Each row also keeps what the profile's regional
compiles cost (``profile_compile_seconds``: each distinct block alone, once per mode), how many plans were pruned
by the compiled time model, and the errors of the compiled predictions against the steps measured compiled.

Run: ``python benchmarks/compiled_retiming.py [--variants ...]`` (2-core CPU: about 12 minutes, most of it compiling); writes
``benchmarks/results/compiled_retiming.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt import tune
from lightning_ckpt.search import compile as compile_module
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.testing import GPT, GPTConfig

SHAPE = dict(n_layer=8, n_head=4, n_embd=128, block_size=64, vocab_size=96)
BATCH = 8
# How re-timing rounds run (and how the model is compiled): compiled afresh every round (the search before
# reused_forwards), each plan compiled once, and each plan compiled once on a model compiled block by block.
VARIANTS = ("every-round", "once", "once-regional")
SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all", "every:2"], "rest_modes": ["none"],
         "chunks": [2, 4], "compile_budgets": []}  # fmt: skip


def _instrument(variant: str) -> dict[str, Any]:
    """Count and time every re-timing; ``every-round`` also resets around each, as the search did before."""
    seen: dict[str, Any] = {"retimes": 0, "retime_seconds": 0.0, "retime_compiles": 0}
    original = compile_module.CompiledTrials.retime

    def retime(self: compile_module.CompiledTrials, plan: Any, steps: Any = None, *, warmup: int = 1) -> Any:
        t0 = time.perf_counter()
        if variant == "every-round":
            compile_module.reset_compiled()
            self._forwards = {}
        try:
            m = original(self, plan, steps, warmup=warmup)
        finally:
            if variant == "every-round":
                compile_module.reset_compiled()
        seen["retimes"] += 1
        seen["retime_seconds"] += time.perf_counter() - t0
        seen["retime_compiles"] += int(bool(m.extra.get("compile", {}).get("compiled")))
        return m

    compile_module.CompiledTrials.retime = retime  # type: ignore[method-assign]
    return seen


def compiled_gpt(layers: int, *, regional: bool) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """The benchmark's GPT (seeded), compiled whole or block by block (torchtitan's way: each block alone, the rest
    eager), and its token batch: the model, what is called, the batch."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPE, "n_layer": layers}, dropout=0.0))
    if regional:
        for block in model.transformer.h:
            block.compile()
        compiled = model
    else:
        compiled = torch.compile(model)
    return model, compiled, torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["block_size"]))


def plain_compiled_step(model: torch.nn.Module, step: Any) -> tuple[float, float]:
    """The seconds of the first three steps (the first compiles the plain model) and the median plain compiled step
    of the next ten; gradients cleared after."""
    first = time.perf_counter()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        step().backward()
    first = time.perf_counter() - first
    times = []
    for _ in range(10):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return first, sorted(times)[len(times) // 2]


def worker(variant: str, out: Path, threads: int | None, default_space: bool, layers: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    model, compiled, x = compiled_gpt(layers, regional=variant == "once-regional")

    def step() -> torch.Tensor:
        return compiled(x, x)

    first, plain = plain_compiled_step(model, step)
    compile_module.reset_compiled()
    seen = _instrument(variant)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        space = {} if default_space else {"search_space": SPACE}
        result = tune(compiled, step, activation_budget=0.5, batch_size=BATCH, seq_len=SHAPE["block_size"], extra_tensors=(x,), config=TuneConfig(**space))  # fmt: skip
    seconds = time.perf_counter() - t0
    trials = [t for t in result.trials if t.status != "pruned"]
    search = result.best.metadata.get("search", {})
    blocks, time_model = result.best.metadata.get("compiled_blocks", {}), search.get("time_model") or {}
    record = {
        "variant": variant,
        "layers": layers,
        "search_seconds": seconds,
        "plain_compiled_step_seconds": plain,
        "plain_step_equivalents": seconds / plain,
        "trials_measured": len(trials),
        "trial_compile_seconds": sum((t.extra or {}).get("compile", {}).get("compile_seconds", 0.0) for t in trials),
        **seen,
        "chosen": result.best.describe(),
        "verdict": result.best.metadata.get("search", {}).get("verdict"),
        "first_compiled_steps_seconds": first,  # three steps, the first compiling the plain model
        "profile_compile_seconds": blocks.get("compile_seconds"),
        "profile_compiles": blocks.get("compiles"),
        "status_counts": search.get("status_counts"),
        "pruned_by_time": time_model.get("pruned_by_time"),
        "time_errors": {k: time_model.get(k) for k in ("predicted_and_measured", "median_abs_error", "max_abs_error")},
        "activation_errors": blocks.get("activation_errors"),
    }
    out.write_text(json.dumps(record, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "compiled_retiming.json")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--default-space", action="store_true", help="the tuner's default space (the issue's user)")
    parser.add_argument("--layers", type=int, nargs="+", default=[SHAPE["n_layer"]], help="depths to run (each a row)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-layers", type=int, default=SHAPE["n_layer"], help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.paths[0]), args.threads, args.default_space, args.worker_layers)
        return
    rows = []
    asked = {(v, n) for v in args.variants for n in args.layers}
    if args.out.exists():  # variants and depths not asked for this time keep their rows
        kept = json.loads(args.out.read_text())["rows"]
        rows = [r for r in kept if (r["variant"], r.get("layers", SHAPE["n_layer"])) not in asked]
    for layers in args.layers:
        for variant in args.variants:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "row.json"
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
                cmd = [sys.executable, __file__, "--worker", variant, "--worker-layers", str(layers), str(out)]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                if args.default_space:
                    cmd += ["--default-space"]
                subprocess.run(cmd, check=True, env=env)
                rows.append(json.loads(out.read_text()))
            r = rows[-1]
            print(f"{layers:3d} layers {variant:13s} search {r['search_seconds']:6.1f} s = "
                  f"{r['plain_step_equivalents']:6.0f} plain compiled steps (profile compiles "
                  f"{r.get('profile_compile_seconds', 0.0):5.1f} s); {r['retimes']} re-timings, {r['retime_compiles']} "
                  f"compiled, {r['retime_seconds']:6.1f} s; {r['trials_measured']} trials "
                  f"({r['trial_compile_seconds']:.1f} s compiling); chose {r['chosen']}", flush=True)  # fmt: skip
    rows.sort(key=lambda r: (r.get("layers", SHAPE["n_layer"]), VARIANTS.index(r["variant"])))
    payload = {"shape": {**SHAPE, "batch": BATCH}, "space": "the tuner's default" if args.default_space else SPACE, "torch": torch.__version__,
               "command": " ".join(["python", "benchmarks/compiled_retiming.py", *sys.argv[1:]]), "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
