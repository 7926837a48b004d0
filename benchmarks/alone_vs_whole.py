"""What a plan adds to a step on blocks compiled alone (how a compiled search measures it) and compiled whole (how the
user trains), side by side: where the two disagree, a compiled search of a whole-compiled model can rank wrongly.

``compiled_exhaustive.py`` found the 32-layer GPT compiled whole choosing ``pt2_budget(0.3)`` at 0.959x the fastest
selective plan. This benchmark asks why. For the same GPT (width 128, batch 8 x 64 tokens, no dropout), each depth
in a fresh process with an empty inductor cache, the same plans are re-timed in interleaved rounds (each round runs
every plan a few steps, in alternating order), first on the blocks compiled alone (``search.assembly``, the search's
runner), then compiled whole (``torch.compile(model)``, each plan compiled once and kept). Per plan and way:

* ``added_ms``: the median over rounds of the plan's step minus the no-checkpointing step of the same round: what the
  plan adds, paired by round (this machine's steps jump between two speeds; within a round both plans mostly see one);
* ``over_pt2``: the median over rounds of the plan's step over ``pt2_budget(0.3)``'s in the same round: below 1, the
  plan is faster than the PT2 budget.

``alone_over_whole_added``: ``added_ms`` alone over compiled whole: 1 where blocks alone measure what the whole compile
runs. Run: ``python benchmarks/alone_vs_whole.py --layers 8 32`` (2-core CPU: about 2 minutes at 8 layers, 8 at 32);
writes ``benchmarks/results/alone_vs_whole.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.search.compile import compiled_search, release_kept_graphs, reset_compiled

sys.path.insert(0, str(Path(__file__).parent))
from compiled_retiming import BATCH, SHAPE, compiled_gpt  # noqa: E402  (the same model)

ROUNDS = 12
STEPS = 3  # timed steps per plan per round
PT2 = "pt2_budget(0.3)"
NONE = "none"


def plans_for(layers: int) -> dict[str, Plan]:
    """The PT2 budget the search chose, the two plans that beat it compiled whole, full on every block, and none."""
    blocks = [f"transformer.h.{i}" for i in range(layers)]
    quarter = layers // 4
    both, mlp, full = BlockPlan("selective", ("attn", "mlp")), BlockPlan("selective", ("mlp",)), BlockPlan("full")
    return {
        PT2: Plan(compile_memory_budget=0.3),
        f"selective(attn,mlp) h.0-{quarter - 1}, selective(mlp) rest": Plan(
            blocks={b: both if i < quarter else mlp for i, b in enumerate(blocks)}
        ),
        f"full h.0-{quarter - 1}, selective(mlp) rest": Plan(
            blocks={b: full if i < quarter else mlp for i, b in enumerate(blocks)}
        ),
        "full": Plan(blocks=dict.fromkeys(blocks, full)),
        NONE: Plan(),
    }


def worker(layers: int, out: Path) -> None:
    warnings.simplefilter("ignore")
    model, compiled, x = compiled_gpt(layers, regional=False)

    def step() -> torch.Tensor:
        return compiled(x, x)

    model.zero_grad(set_to_none=True)
    step().backward()  # the user's own first compile, as a search starts after it
    reset_compiled()
    plans = plans_for(layers)
    blocks = tuple(f"transformer.h.{i}" for i in range(layers))
    harness = StepHarness(model, step, torch.device("cpu"), extra=(x,), batch_size=BATCH,
                          seq_len=SHAPE["block_size"], warmup_steps=1, measure_steps=STEPS)  # fmt: skip
    record: dict = {"layers": layers, "ways": {}}
    for way, runner_blocks in (("alone", blocks), ("whole", ())):
        runner = compiled_search(compiled, harness, compiled=True, allow_graph_breaks=False, blocks=runner_blocks)
        assert runner is not None
        samples: dict[str, list[float]] = {n: [] for n in plans}
        first: dict[str, float] = {}
        for r in range(ROUNDS):
            for name, plan in plans.items() if r % 2 == 0 else reversed(plans.items()):
                t0 = time.perf_counter()
                m = runner.retime(plan, STEPS)
                first.setdefault(name, time.perf_counter() - t0)
                assert m.ok and m.median_seconds, (way, name, m.status, m.error)
                samples[name].append(m.median_seconds)
        release_kept_graphs()
        rows = {}
        for name, values in samples.items():
            rows[name] = {
                "median_ms": 1e3 * statistics.median(values),
                "added_ms": 1e3 * statistics.median(v - n for v, n in zip(values, samples[NONE], strict=True)),
                "over_pt2": statistics.median(v / p for v, p in zip(values, samples[PT2], strict=True)),
                "first_round_seconds": first[name],  # compiles where the plan's graphs were new
                "round_ms": [1e3 * v for v in values],
            }
        record["ways"][way] = rows
    for name in plans:
        whole = record["ways"]["whole"][name]["added_ms"]
        alone = record["ways"]["alone"][name]["added_ms"]
        record["ways"]["alone"][name]["alone_over_whole_added"] = alone / whole if abs(whole) > 1e-9 else None
    out.write_text(json.dumps(record, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "alone_vs_whole.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), Path(args.worker[1]))
        return
    payload = {
        "command": "python benchmarks/alone_vs_whole.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "shape": {**SHAPE, "batch": BATCH},
        "rounds": ROUNDS,
        "rows": [],
    }
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            subprocess.run([sys.executable, __file__, "--worker", str(layers), out.name], check=True, env=env)
            record = json.loads(Path(out.name).read_text())
        payload["rows"].append(record)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2))
        print(
            f"\n{layers} layers{'':38s} | {'alone: adds':>12} {'/ pt2':>6} | {'whole: adds':>12} {'/ pt2':>6} | alone/whole"
        )
        for name, alone in record["ways"]["alone"].items():
            whole = record["ways"]["whole"][name]
            ratio = alone.get("alone_over_whole_added")
            print(
                f"{name:48s} | {alone['added_ms']:9.1f} ms {alone['over_pt2']:6.3f} | {whole['added_ms']:9.1f} ms "
                f"{whole['over_pt2']:6.3f} | {'' if ratio is None else f'{ratio:.2f}'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
