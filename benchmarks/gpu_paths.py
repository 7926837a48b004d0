"""The CUDA paths that CPU tests only fake, run on a real card: the guard's readings and a compiled trial's budget.

Run when a GPU is lent (after ``gpu_check.py``, or with its parts trimmed to leave room), from the project root:

    PYTHONUNBUFFERED=1 python benchmarks/gpu_paths.py            # CUDA, ~2 minutes on an H200
    python benchmarks/gpu_paths.py --dry-run                      # tiny model on CPU: the code paths only

Two parts, each recorded in ``$OUT/gpu_paths.json`` (or ``--out``) and printed as a table:

* **guard**: a ``Trainer`` fit under ``activation_budget=0.5`` with AdamW. The guard's step records (the first
  real steps after lock-in, from the plan file) are printed beside the chosen plan's trial figures. On the
  first step the allocator's ``peak - resting`` also holds the new gradients and AdamW's state; the guard's
  activation figure must not (``step_reader.RealStepReader``), so it stays within a few percent of the trial's and
  no switch happens.
* **compiled**: ``tune`` on a ``torch.compile``-d GPT under a ``max_memory`` that the compiled no-checkpointing
  step does not fit. Each trial's peak is the allocator's over the compiled steps (no tracked eager pass), so the
  chosen plan's real compiled step, re-run after the search, must stay under the budget, and ``none`` must not be
  chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import ActivationCheckpointTuner, Plan, apply_plan, tune
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.search.compile import compiled_search, reset_compiled
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.testing import GPT, GPTConfig

SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all", "first:0.5"], "rest_modes": ["none"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU: exercises the code paths only")
    p.add_argument("--parts", default="guard,compiled")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_paths.json, else benchmarks/results)")
    return p.parse_args()


def sizes(dry: bool) -> dict[str, int]:
    if dry:
        return {"layers": 4, "embd": 64, "heads": 2, "vocab": 64, "seq": 32, "batch": 4}
    return {"layers": 8, "embd": 768, "heads": 12, "vocab": 32768, "seq": 1024, "batch": 16}


def gpt(s: dict[str, int]) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=s["layers"], n_head=s["heads"], n_embd=s["embd"], vocab_size=s["vocab"],
                    block_size=s["seq"], dropout=0.0)  # fmt: skip
    return GPT(cfg)


def batches(s: dict[str, int], n: int, device: torch.device) -> TensorDataset:
    tokens = torch.randint(0, s["vocab"], (n * s["batch"], s["seq"] + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1].to(device), tokens[:, 1:].to(device))


class LitGPT(L.LightningModule):
    def __init__(self, s: dict[str, int]) -> None:
        super().__init__()
        self.model = gpt(s)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(x, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)


def part_guard(s: dict[str, int], device: torch.device, tmp: Path) -> dict[str, Any]:
    plan_path = tmp / "guard_plan.json"
    plan_path.unlink(missing_ok=True)  # search every time: the guard reads the steps after a lock-in
    cb = ActivationCheckpointTuner(
        activation_budget=0.5,
        plan_path=plan_path,
        verbose=False,
        search=dict(n_trials=8, measure_steps=2, search_space=SPACE),
        guard=dict(steps=3),
    )
    trainer = L.Trainer(
        accelerator=device.type, devices=1, max_steps=5, callbacks=[cb], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed" if device.type == "cuda" else 32,
    )  # fmt: skip
    trainer.fit(LitGPT(s), DataLoader(batches(s, 5, torch.device("cpu")), batch_size=s["batch"]))
    best = cb.result.best_trial
    checks = Plan.load(plan_path).metadata.get("real_steps") or []  # the guard's records, as the plan file keeps them
    print(f"guard: chosen {cb.plan.describe()}, budget {cb.result.budget.description}")
    print(f"  trial:  peak {best.peak_bytes:>14,}  activation {best.activation_bytes:>14,}")
    for c in checks:
        print(f"  step {c['step']}: peak {c['peak_bytes']:>14,}  activation {c['activation_bytes']:>14,}  "
              f"within budget {c['within_budget']}  plan {c['plan']}")  # fmt: skip
    first = checks[0]["activation_bytes"] if checks else None
    return {
        "plan": cb.plan.describe(), "budget_limit": cb.result.budget.limit_bytes,
        "trial_peak": best.peak_bytes, "trial_activation": best.activation_bytes, "step_checks": checks,
        "first_step_activation_over_trial": first / best.activation_bytes if first and best.activation_bytes else None,
        "switched": any(c["plan"] != checks[0]["plan"] for c in checks) if checks else None,
    }  # fmt: skip


def part_compiled(s: dict[str, int], device: torch.device) -> dict[str, Any]:
    reset_compiled()
    model = gpt(s).to(device)
    compiled = torch.compile(model)
    x, y = (t[: s["batch"]] for t in batches(s, 1, device).tensors)
    step = lambda: compiled(x, y)  # noqa: E731
    harness = StepHarness(root=model, step_fn=step, device=device, extra=(x, y), batch_size=s["batch"])
    trials = compiled_search(model, harness, compiled=True, allow_graph_breaks=True)
    assert trials is not None
    none_peak = trials.measure_compiled(Plan()).peak_bytes  # the compiled step without checkpointing
    assert none_peak is not None
    limit = int(0.8 * none_peak)
    result = tune(compiled, step, max_memory=limit, batch_size=s["batch"], config=TuneConfig(n_trials=8, search_space=SPACE, measure_steps=2))  # fmt: skip
    handle = apply_plan(model, result.best)
    reset_compiled()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step().backward()
        model.zero_grad(set_to_none=True)
    real_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    handle.remove()
    reset_compiled()
    rows = [{"plan": t.label, "status": t.status, "peak": t.peak_bytes, "activation": t.activation_bytes,
             "samples_per_second": t.samples_per_second} for t in result.trials]  # fmt: skip
    print(f"compiled: none peak {none_peak:,}, budget {limit:,}, chosen {result.best_trial.label}")
    for r in rows:
        print(
            f"  {r['plan']:<28} {r['status']:<12} peak {r['peak'] or 0:>14,}  sps {r['samples_per_second'] or 0:8.2f}"
        )
    print(f"  chosen plan's real compiled step peak: {real_peak}")
    return {
        "none_peak": none_peak, "budget_limit": limit, "chosen": result.best_trial.label, "trials": rows,
        "real_peak_after": real_peak, "real_peak_within_budget": real_peak <= limit if real_peak else None,
    }  # fmt: skip


def main() -> int:
    args = parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_paths.py needs a CUDA device (or --dry-run for the code paths on CPU).", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    s = sizes(args.dry_run)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or "benchmarks/results") / "gpu_paths.json"
    tmp = out.parent / "gpu_paths_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if
                               device.type == "cuda" else "cpu", "dry_run": args.dry_run, "sizes": s}  # fmt: skip
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            summary[part] = part_guard(s, device, tmp) if part == "guard" else part_compiled(s, device)
        except Exception as exc:  # noqa: BLE001 - record and go on to the next part
            summary[part] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{part}: FAILED {summary[part]['error']}")
        summary[part]["seconds"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
