"""FSDP2 on 2 CPU ranks (gloo): the per-rank memory model for every baseline, and the tuned plan vs the best
fitting baseline, timed side by side.

Each rank shards a GPT with ``fully_shard`` (blocks, then the root), profiles it, measures every baseline
with the FSDP-aware tracker and compares with the prediction, for ``reshard_after_forward`` True and
False. Then ``tune()`` runs on both ranks in lockstep (an activation budget of 60%), and the tuned plan
and every fitting baseline are re-timed in interleaved rounds (each round a few steps of each plan, both
ranks stepping together, communication included). Run alone on a quiet machine:
``python benchmarks/fsdp.py`` (writes ``benchmarks/results/fsdp.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.pipeline import SearchHooks

MiB = 1024 * 1024


class _DistSync:
    """``lightning_ckpt.search.distributed.Sync`` over the default process group."""

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out


def _model(args: argparse.Namespace, reshard: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from lightning_ckpt.testing import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.width, vocab_size=256, block_size=args.seq))
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _rank_main(rank: int, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from lightning_ckpt import baselines, plan_applied, tune
    from lightning_ckpt.measure.step import StepSettings, measure_step, track_step_memory
    from lightning_ckpt.memory.profile import profile_memory

    x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    result: dict[str, Any] = {"rank": rank, "memory": {}}
    for reshard in (True, False):
        model = _model(args, reshard)
        model(x, x).backward()  # FSDP2's lazy initialisation, outside any measurement
        model.zero_grad(set_to_none=True)
        mm = profile_memory(model, lambda model=model: model(x, x), extra=(x,))
        rows = {}
        for name, plan in baselines(model, memory_model=mm).items():
            with plan_applied(model, plan, check_fingerprint=False):
                reading = track_step_memory(lambda model=model: model(x, x).backward(), model=model, extra=(x,))
            model.zero_grad(set_to_none=True)
            pred = mm.predict(plan)
            rows[name] = {"peak": reading.peak_bytes, "predicted_peak": pred.peak_bytes,
                          "activation": reading.activation_bytes, "predicted_activation": pred.activation_bytes}  # fmt: skip
        result["memory"]["reshard_after_forward" if reshard else "keep_unsharded"] = rows

    model = _model(args, True)
    model(x, x).backward()
    model.zero_grad(set_to_none=True)
    sync = _DistSync()
    t0 = time.perf_counter()
    tuned = tune(model, lambda: model(x, x), activation_budget=args.budget, batch_size=args.batch, seq_len=args.seq, extra_tensors=(x,), config=TuneConfig(n_trials=args.trials, measure_steps=2), hooks=SearchHooks(sync=sync))  # fmt: skip
    result["tuning_seconds"] = time.perf_counter() - t0
    result["tuned"] = tuned.best.describe()
    fitting = {name: t.plan for name, t in tuned.baselines.items() if t.status == "ok"}
    plans = {"tuned": tuned.best, **{f"baseline:{k}": v for k, v in fitting.items()}}
    times: dict[str, list[float]] = {k: [] for k in plans}
    for _ in range(args.rounds):
        for name, plan in plans.items():
            with plan_applied(model, plan, check_fingerprint=False):
                m = measure_step(
                    lambda: model(x, x).backward(),
                    StepSettings(warmup=1, steps=args.steps, track_memory=False),
                    model=model,
                )
            slowest = max(sync.all_gather(m.median_seconds or float("inf")))  # ranks step together
            times[name].append(slowest)
    result["side_by_side"] = {k: 2 * args.batch / statistics.median(v) for k, v in times.items()}
    result["budget"] = tuned.budget.description
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while the other still talks to it (std::terminate at exit)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--budget", type=float, default=0.6, help="activation budget (fraction of none's)")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fsdp.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, tmp), nprocs=2)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"GPT {args.layers}x{args.width}, {args.batch}x{args.seq} tokens per rank, 2 CPU ranks (gloo), FSDP2")
    print(
        f"{'mode':22s} {'plan':17s} {'rank':>4s} {'peak MiB':>9s} {'pred':>9s} {'err':>7s} {'act MiB':>8s} {'pred':>8s} {'err':>7s}"
    )
    worst = 0.0
    for mode in ("reshard_after_forward", "keep_unsharded"):
        for name in ranks[0]["memory"][mode]:
            for r in ranks:
                row = r["memory"][mode][name]
                pe = row["predicted_peak"] / row["peak"] - 1
                ae = row["predicted_activation"] / max(1, row["activation"]) - 1
                worst = max(worst, abs(pe), abs(ae))
                print(f"{mode:22s} {name:17s} {r['rank']:4d} {row['peak'] / MiB:9.2f} {row['predicted_peak'] / MiB:9.2f} "
                      f"{100 * pe:+6.2f}% {row['activation'] / MiB:8.2f} {row['predicted_activation'] / MiB:8.2f} "
                      f"{100 * ae:+6.2f}%")  # fmt: skip
    print(f"worst per-rank error: {100 * worst:.2f}% (target: 5%)")
    sbs = ranks[0]["side_by_side"]
    best_baseline = max((v, k) for k, v in sbs.items() if k != "tuned") if len(sbs) > 1 else None
    print(f"\nbudget {ranks[0]['budget']}; tuned plan: {ranks[0]['tuned']} (search {ranks[0]['tuning_seconds']:.1f} s)")
    for k, v in sorted(sbs.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v:8.1f} samples/s (global, side by side)")
    ratio = sbs["tuned"] / best_baseline[0] if best_baseline else None
    if ratio is not None:
        print(f"tuned / best fitting baseline ({best_baseline[1]}): {ratio:.3f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"torch": torch.__version__, "config": {k: str(v) for k, v in vars(args).items()},
                                    "ranks": ranks, "worst_memory_error": worst, "ratio_vs_best_baseline": ratio,
                                    "best_baseline": best_baseline[1] if best_baseline else None}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
