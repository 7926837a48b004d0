"""Data whose lengths vary: how many real steps go over the budget, and at what speed, by how the plan was chosen.

The GPT example trained with Lightning on batches whose lengths follow a long tail (lognormal, clipped to
``--min-len``..``--max-len`` tokens, as padded SFT batches do), under a peak budget at which ``none`` fits the
median batch and the longest needs checkpointing. Each row is a fresh fit with the callback:

- ``first batch, no switching``: tuned on the first batch; the guard only warns (v0.3's plan for the run);
- ``first batch, guard``: tuned on the first batch; the guard predicts each batch longer than any read so far
  before its forward and moves to a plan that fits (the default);
- ``max_shape, one plan``: the longest length declared, ``max_shape=(rows, max_len)``, ``guard={"buckets": False}``:
  one plan tuned for it runs every batch;
- ``plan table``: the same declaration with the default ``guard={"buckets": True}``: the search's plan for the longest
  bucket, and for each shorter bucket (halving lengths) the plan predicted fastest that fits at its longest length,
  switched before each batch's forward (the first step under each bucket's plan is read by the guard).

Every real step's peak (forward, backward and the optimizer's update) is read by the live-tensor tracker in one
fit; the speed (tokens per second over the steps after the search) is timed in further fits of each row without
the tracker, ``--repeats`` of them in round-robin over the rows (the median is shown), so the machine's drift falls
on every row alike. Ratios are to the ``max_shape, one plan`` row, measured in the same run.

Run: ``python benchmarks/variable_length.py`` (2-core CPU: a few minutes); writes
``benchmarks/results/variable_length.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointTuner, Plan, apply_plan, baselines
from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.testing import GPT, GPTConfig

SHAPE = dict(n_layer=4, n_head=4, n_embd=64, vocab_size=96)
SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all", "first:0.5"], "rest_modes": ["none"],
         "segments": False}  # fmt: skip


class Lit(L.LightningModule):
    def __init__(self, max_len: int, track: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**SHAPE, block_size=max_len, dropout=0.0))
        self.track, self.peaks, self.tokens, self.seconds = track, [], [], []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(x, y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self._t0)
        self.tokens.append(batch[0].numel())

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if not self.track:
            return optimizer.step(closure=optimizer_closure)
        tracker = new_live_tracker("cpu")
        tracker.track_external(self, optimizer)
        tracker.total_peak = tracker.now()[0]
        with tracker:
            optimizer.step(closure=optimizer_closure)
        self.peaks.append(tracker.total_peak)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def lengths(n: int, rng: torch.Generator, lo: int, hi: int, median: int) -> list[int]:
    """``n`` lognormal lengths (median ``median``, sigma 0.6) clipped to [lo, hi], multiples of 8."""
    draws = torch.randn(n, generator=rng) * 0.6 + math.log(median)
    return [int(min(hi, max(lo, 8 * round(math.exp(float(d)) / 8)))) for d in draws]


def batches(lens: list[int], rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lens:
        data = torch.randint(0, SHAPE["vocab_size"], (rows, length + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def fit(data: list, callbacks: list, max_len: int, track: bool) -> Lit:
    module = Lit(max_len, track)
    trainer = L.Trainer(accelerator="cpu", max_steps=len(data), callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    loader = DataLoader(data, batch_size=None, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return module


def peak_of(plan_name: str, data: list, max_len: int) -> int:
    """The highest real-step peak with a baseline applied by hand over ``data`` (two steps: AdamW's state)."""
    module = Lit(max_len, track=True)
    plan = baselines(module)[plan_name] if plan_name != "none" else Plan()
    handle = apply_plan(module, plan)
    fit_module = fit_with(module, data)
    handle.remove()
    return max(fit_module.peaks)


def fit_with(module: Lit, data: list) -> Lit:
    trainer = L.Trainer(accelerator="cpu", max_steps=len(data), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(data, batch_size=None, shuffle=False))
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="timed fits per row (round-robin); the median is shown")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--median-len", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "variable_length.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lens = lengths(args.steps, torch.Generator().manual_seed(0), args.min_len, args.max_len, args.median_len)
    lens[0] = 8 * round(args.median_len / 8)  # the first batch, which the search measures by default, is a typical one
    if args.max_len not in lens:
        lens[len(lens) // 3] = args.max_len  # the tail reaches the declared maximum at least once
    data = batches(lens, args.rows, seed=1)
    first = [data[0]] * 2
    longest = batches([args.max_len] * 2, args.rows, seed=2)
    none_first, none_max = peak_of("none", first, args.max_len), peak_of("none", longest, args.max_len)
    full_max = peak_of("full", longest, args.max_len)
    budget = max(none_first, full_max + (none_max - full_max) // 4)
    print(f"lengths: first {lens[0]}, median {sorted(lens)[len(lens) // 2]}, max {max(lens)}; budget "
          f"{budget / 2**20:.2f} MiB (none: {none_first / 2**20:.2f} MiB on the first batch, {none_max / 2**20:.2f} "
          f"at the longest; full at the longest {full_max / 2**20:.2f})", flush=True)  # fmt: skip
    search = dict(n_trials=8, measure_steps=1, search_space=SPACE)
    rows = {
        "first batch, no switching": dict(guard={"on_budget_exceeded": "warn", "every": 1}),
        "first batch, guard": dict(guard={"every": 1}),
        "max_shape, one plan": dict(max_shape=(args.rows, args.max_len), guard={"every": 1, "buckets": False}),
        "plan table": dict(max_shape=(args.rows, args.max_len), guard={"every": 1}),
    }
    results = []
    logs = tempfile.mkdtemp(prefix="variable_length_tb_")  # the callback's TensorBoard runs: not this checkout's
    for name, options in rows.items():
        cb = ActivationCheckpointTuner(max_memory=budget, verbose=False, search=search, log_dir=logs, **options)
        tracked = fit(data, [cb], args.max_len, track=True)
        over = [p for p in tracked.peaks if p > budget]
        plans = sorted({c.plan for c in cb.step_checks})
        results.append({"row": name, "steps_over_budget": len(over), "steps": len(tracked.peaks),
                        "max_peak_of_budget": max(tracked.peaks) / budget, "plans_run": plans,
                        "tuned": cb.result.best.describe() if cb.result else None,
                        "table": cb.plan_table.describe() if cb.plan_table is not None else None,
                        "tokens_per_second_each": []})  # fmt: skip
    # Speed: each row's fit again without the tracker (the guard reads only its first steps and each longer batch,
    # as by default), in round-robin over the rows, ``--repeats`` times: the machine's drift falls on every row.
    for _ in range(args.repeats):
        for name, options in rows.items():
            cb = ActivationCheckpointTuner(max_memory=budget, verbose=False, search=search, log_dir=logs,
                                           **{**options, "guard": {**options["guard"], "every": 0}})  # fmt: skip
            timed = fit(data, [cb], args.max_len, track=False)
            tokens, seconds = sum(timed.tokens[1:]), sum(timed.seconds[1:])  # after the search's step
            next(r for r in results if r["row"] == name)["tokens_per_second_each"].append(tokens / seconds)
    for r in results:
        r["tokens_per_second"] = sorted(r["tokens_per_second_each"])[len(r["tokens_per_second_each"]) // 2]
    ref = next(r for r in results if r["row"] == "max_shape, one plan")["tokens_per_second"]
    print(f"{'row':28s} {'over budget':>12s} {'max peak':>9s} {'tokens/s':>9s} {'vs max_shape':>12s}  plans")
    for r in results:
        r["vs_max_shape"] = r["tokens_per_second"] / ref
        print(f"{r['row']:28s} {r['steps_over_budget']:>5d} of {r['steps']:<3d} {r['max_peak_of_budget']:8.2f}x "
              f"{r['tokens_per_second']:9.0f} {r['vs_max_shape']:11.2f}x  {', '.join(r['plans_run'])}")  # fmt: skip
    payload = {"command": " ".join(["python", "benchmarks/variable_length.py", *sys.argv[1:]]), "torch": torch.__version__,
               "lengths": lens, "rows_per_batch": args.rows, "budget_bytes": budget, "rows": results}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
