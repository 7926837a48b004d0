"""Tuned plan vs every baseline that fits vs the exhaustive best, at several activation budgets.

For the GPT example (8 layers, d=128, T=128, batch 16, CPU) and budgets of 80%, 50% and 30% of the
no-checkpointing activation memory:

1. ``tune`` with a TPE budget of ``--trials`` measured trials (the tuned plan, and its tuning cost);
2. ``tune`` exhaustively over the same space (every distinct plan measured: the exhaustive best);
3. a final side-by-side measurement, interleaved over ``--rounds`` rounds so that machine drift hits
   every plan alike: every baseline that fits, the tuned plan, the exhaustive best. A plan that
   appears under several names (the tuned plan is often a baseline or the exhaustive best) is
   measured once, so such ratios are 1 by identity rather than a sample of noise.

Then the lock-in check: steps of ``Trainer.fit`` with the tuned plan locked in by the callback
(``plan=``) versus the same plan applied by hand, interleaved.

Then the "load changes mid-search" row (``--load-budget``, default 50%): the same search with busy
processes on every core from a quarter to three quarters of its quiet duration (another job starting
and ending on the machine), then, on the quiet machine again, that tuned plan and every fitting
baseline re-timed side by side. Target: tuned >= 0.97x the best fitting baseline.

Run: ``python benchmarks/tuner_vs_baselines.py`` (about 15 minutes on 2 cores); writes
``benchmarks/results/tuner_vs_baselines.json`` and, for the load row, ``tuner_vs_baselines_load.json``
(``--only-load`` runs that row alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_ckpt import Plan, baselines, discover_blocks, plan_applied, tune
from lightning_ckpt.measure.step import StepSettings, measure_step
from lightning_ckpt.memory.profile import profile_memory
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.space import SearchSpace
from lightning_ckpt.testing import GPT, GPTConfig

SPACE = SearchSpace.from_config(
    {
        "modes": ["full", "selective:mlp", "selective:attention+mlp", "ops:save_matmuls"],
        "selections": ["all", "first:0.5", "every:2"],
        "rest_modes": ["none", "selective:mlp"],
        "chunks": [2, 3, 4],
    }
)


def side_by_side(model: GPT, loss_fn: Any, plans: dict[str, Plan], *, rounds: int, steps: int, batch: int) -> dict:
    """Median samples/s per plan over interleaved rounds, plus measured activation memory.

    Each distinct plan is measured once: names that share a plan (the tuned plan is often a baseline
    or the exhaustive best) share its figures, because timing one plan twice only samples noise.
    """
    distinct: dict[str, Plan] = {}
    alias: dict[str, str] = {}
    for name, plan in plans.items():
        digest = Plan(plan.blocks, plan.segments).digest()
        alias[name] = next((n for n, p in distinct.items() if Plan(p.blocks, p.segments).digest() == digest), name)
        distinct.setdefault(alias[name], plan)
    times: dict[str, list[float]] = {name: [] for name in distinct}
    memory: dict[str, int] = {}

    def step() -> None:
        loss_fn().backward()

    for r in range(rounds):
        for name, plan in distinct.items():
            with plan_applied(model, plan, check_fingerprint=False):
                m = measure_step(
                    step, StepSettings(warmup=1, steps=steps, track_memory=r == 0), model=model, batch_size=batch
                )
            if m.status != "ok":
                raise RuntimeError(f"{name}: {m.status} {m.error}")
            times[name].append(m.median_seconds)
            if r == 0:
                memory[name] = m.activation_bytes
    return {
        name: {"samples_per_second": batch / statistics.median(times[alias[name]]),
               "activation_bytes": memory[alias[name]], "same_plan_as": alias[name] if alias[name] != name else None}
        for name in plans
    }  # fmt: skip


def lockin_overhead(config: GPTConfig, plan: Plan, tokens: torch.Tensor, *, steps: int, rounds: int) -> dict:
    """Per-step time of Trainer.fit with the plan locked in by the callback vs applied by hand."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ckpt import ActivationCheckpointTuner, apply_plan

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(batch[0], batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self._t)

    loader = DataLoader(TensorDataset(tokens.repeat(steps + 2, 1)), batch_size=tokens.shape[0])
    results: dict[str, list[float]] = {"callback": [], "by_hand": []}
    for _ in range(rounds):
        for how in ("callback", "by_hand"):
            module, timer = Module(), StepTimer()
            callbacks: list[Any] = [timer]
            if how == "callback":
                callbacks.insert(0, ActivationCheckpointTuner(plan=plan, verbose=False))
            else:
                apply_plan(module, plan)
            trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
            trainer.fit(module, loader)
            results[how].append(statistics.median(timer.times[2:]))  # the first steps warm up
    cb, hand = statistics.median(results["callback"]), statistics.median(results["by_hand"])
    return {"callback_step_seconds": cb, "by_hand_step_seconds": hand, "ratio": cb / hand, "raw": results}


LOAD_WINDOWS = {"middle half": (0.25, 0.75), "from a quarter to the end": (0.25, None)}


def load_mid_search(model: GPT, loss_fn: Any, tokens: torch.Tensor, args: argparse.Namespace) -> dict:
    """Tune while busy processes hold every core for part of the search (``LOAD_WINDOWS``, fractions of the
    quiet search's duration; None: until the search ends), then judge each choice on the quiet machine."""
    common = dict(activation_budget=args.load_budget, batch_size=args.batch, extra_tensors=(tokens,),
                  config=TuneConfig(search_space=SPACE, measure_steps=args.steps, seed=0, n_trials=args.trials))  # fmt: skip
    t0 = time.perf_counter()
    quiet = tune(model, loss_fn, **common)
    quiet_seconds = time.perf_counter() - t0
    searches: dict[str, dict] = {}
    chosen: dict[str, Plan] = {}
    for name, (begin, end) in LOAD_WINDOWS.items():
        busy: list[subprocess.Popen] = []
        window: dict[str, float] = {}
        t1 = time.perf_counter()

        def start(window=window, busy=busy, t1=t1) -> None:
            window["start"] = time.perf_counter() - t1
            busy.extend(
                subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)
            )

        def stop(window=window, busy=busy, t1=t1) -> None:
            if busy:
                window.setdefault("stop", time.perf_counter() - t1)
            for p in busy:
                p.kill()
                p.wait()
            busy.clear()

        timers = [threading.Timer(begin * quiet_seconds, start)]
        timers += [threading.Timer(end * quiet_seconds, stop)] if end is not None else []
        for t in timers:
            t.start()
        try:
            loaded = tune(model, loss_fn, **common)
        finally:
            for t in timers:
                t.cancel()
            stop()
        chosen[name] = loaded.best
        searches[name] = {
            "load_window_seconds": window, "search_seconds": time.perf_counter() - t1,
            "tuned": loaded.best.describe(),
            "speed_changes_seen": (loaded.best.metadata.get("search") or {}).get("speed_changes"),
            "fitting_baselines": [k for k, t in loaded.baselines.items() if t.status == "ok"],
        }  # fmt: skip
    fitting = {name: plan for name, plan in baselines(model).items()
               if any(name in s["fitting_baselines"] for s in searches.values())}  # fmt: skip
    plans = {**{f"baseline:{k}": v for k, v in fitting.items()}, **{f"tuned, load {k}": p for k, p in chosen.items()},
             "tuned quiet": quiet.best}  # fmt: skip
    measured = side_by_side(model, loss_fn, plans, rounds=args.rounds, steps=args.steps, batch=args.batch)
    best_baseline = max((v["samples_per_second"], k) for k, v in measured.items() if k.startswith("baseline:"))
    for name, search in searches.items():
        search["vs_best_baseline"] = measured[f"tuned, load {name}"]["samples_per_second"] / best_baseline[0]
    row = {
        "budget_fraction": args.load_budget, "busy_processes": os.cpu_count(), "quiet_search_seconds": quiet_seconds,
        "tuned_quiet": quiet.best.describe(), "searches": searches, "measured_quiet_side_by_side": measured,
        "best_baseline": best_baseline[1],
        "tuned_quiet_vs_best_baseline": measured["tuned quiet"]["samples_per_second"] / best_baseline[0],
    }  # fmt: skip
    print(f"\nload changes mid-search ({os.cpu_count()} busy processes; quiet search {quiet_seconds:.0f} s)")
    for name, search in searches.items():
        w = search["load_window_seconds"]
        print(f"  load {name}: busy from {w.get('start', 0):.0f} s to {w.get('stop', search['search_seconds']):.0f} s "
              f"of a {search['search_seconds']:.0f} s search; speed changes seen: {search['speed_changes_seen']}")  # fmt: skip
    print(f"  {'plan (re-timed side by side, quiet)':<64}{'samples/s':>10}")
    for name, v in measured.items():
        plan = plans[name].describe() if name.startswith("tuned") else ""
        same = f"  (= {v['same_plan_as']})" if v["same_plan_as"] else ""
        print(f"  {(name + (': ' + plan if plan else '')):<64}{v['samples_per_second']:>10.1f}{same}")
    for name, search in searches.items():
        print(f"  tuned (load {name}) / best fitting baseline ({best_baseline[1]}): {search['vs_best_baseline']:.3f}x")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.8, 0.5, 0.3])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tuner_vs_baselines.json")
    parser.add_argument("--load-budget", type=float, default=0.5, help="the budget of the load-changes row")
    parser.add_argument("--only-load", action="store_true", help="run only the load-changes-mid-search row")
    parser.add_argument("--no-load", action="store_true", help="leave out the load-changes-mid-search row")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    config = GPTConfig(n_layer=args.layers, n_head=4, n_embd=128, block_size=128, vocab_size=96, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(config)
    tokens = torch.randint(0, 96, (args.batch, 128), generator=torch.Generator().manual_seed(0))

    def loss_fn() -> torch.Tensor:
        return model(tokens, tokens)

    def load_row() -> None:
        """The load-changes-mid-search row, in a JSON file of its own beside ``--out``."""
        out = args.out.with_name(args.out.stem + "_load.json")
        row = load_mid_search(model, loss_fn, tokens, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) for k, v in vars(args).items()}
        out.write_text(json.dumps({"config": config, "row": row, "torch": torch.__version__}, indent=2))
        print(f"wrote {out}")

    if args.only_load:
        load_row()
        return
    none_activation = profile_memory(model, loss_fn, extra=(tokens,)).predict_activation(Plan())
    space_size = len(SPACE.enumerate(discover_blocks(model), fingerprint=None))
    rows = []
    for fraction in args.budgets:
        limit = int(fraction * none_activation)
        common = dict(activation_budget=fraction, batch_size=args.batch, extra_tensors=(tokens,))
        search = dict(search_space=SPACE, measure_steps=args.steps, seed=0)
        t0 = time.perf_counter()
        tuned = tune(model, loss_fn, config=TuneConfig(n_trials=args.trials, **search), **common)
        tuned_seconds = time.perf_counter() - t0
        # Every plan measured: the time model must not decide what the reference measures.
        exhaustive = tune(
            model, loss_fn, config=TuneConfig(n_trials=space_size, predict_time=False, **search), **common
        )
        fitting = {
            name: plan
            for name, plan in baselines(model).items()
            if name in exhaustive.baselines and exhaustive.baselines[name].status == "ok"
        }
        plans = {**{f"baseline:{k}": v for k, v in fitting.items()}, "tuned": tuned.best, "exhaustive": exhaustive.best}
        measured = side_by_side(model, loss_fn, plans, rounds=args.rounds, steps=args.steps, batch=args.batch)
        best_baseline = max((v["samples_per_second"], k) for k, v in measured.items() if k.startswith("baseline:"))
        row = {
            "budget_fraction": fraction,
            "budget_bytes": limit,
            "tuned_plan": tuned.best.describe(),
            "exhaustive_plan": exhaustive.best.describe(),
            "tuned_fell_back": tuned.fell_back,
            "measured": measured,
            "best_baseline": best_baseline[1],
            "tuned_vs_best_baseline": measured["tuned"]["samples_per_second"] / best_baseline[0],
            "tuned_vs_exhaustive": measured["tuned"]["samples_per_second"]
            / measured["exhaustive"]["samples_per_second"],
            "budget_violations": sum(
                v["activation_bytes"] > limit for k, v in measured.items() if k in ("tuned", "exhaustive")
            ),
            "tuning_seconds": tuned_seconds,
            "tuning_steps": tuned.tuning_steps,
            "tuning_trials_measured": tuned.n_measured,
            "tuning_time_model": (tuned.best.metadata.get("search") or {}).get("time_model"),
            "exhaustive_trials_measured": exhaustive.n_measured,
        }
        rows.append(row)
        print(f"\nbudget {fraction:.0%} of no-checkpointing activation memory ({limit / 2**20:.1f} MiB)")
        print(f"  {'plan':<40}{'samples/s':>10}{'act MiB':>9}  fits")
        for name, v in measured.items():
            label = {"tuned": f"tuned: {row['tuned_plan']}", "exhaustive": f"exhaustive: {row['exhaustive_plan']}"}.get(
                name, name
            )
            fits = "yes" if v["activation_bytes"] <= limit else "NO"
            same = f"  (= {v['same_plan_as']})" if v["same_plan_as"] else ""
            print(f"  {label:<40}{v['samples_per_second']:>10.1f}{v['activation_bytes'] / 2**20:>9.1f}  {fits}{same}")
        print(f"  tuned / best fitting baseline ({row['best_baseline']}): {row['tuned_vs_best_baseline']:.3f}x; "
              f"tuned / exhaustive: {row['tuned_vs_exhaustive']:.3f}x; budget violations: {row['budget_violations']}; "
              f"tuning cost {tuned_seconds:.0f} s, {tuned.tuning_steps} steps, {tuned.n_measured} trials measured")  # fmt: skip

    # The tightest budget's plan, renamed for the LightningModule that holds the GPT as `model`.
    in_module = Plan({f"model.{k}": v for k, v in tuned.best.blocks.items()},
                     segments={f"model.{k}": n for k, n in tuned.best.segments.items()})  # fmt: skip
    lockin = lockin_overhead(config, in_module, tokens, steps=30, rounds=3)
    print(f"\nlock-in: step time with the callback {lockin['callback_step_seconds'] * 1e3:.1f} ms vs by hand "
          f"{lockin['by_hand_step_seconds'] * 1e3:.1f} ms -> ratio {lockin['ratio']:.3f}")  # fmt: skip
    if not args.no_load:
        load_row()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": {k: str(v) for k, v in vars(args).items()}, "none_activation_bytes": none_activation,
               "space_size": space_size, "rows": rows, "lockin": lockin, "torch": torch.__version__}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
