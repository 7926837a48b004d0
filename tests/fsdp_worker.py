"""Run by tests/test_fsdp.py in a subprocess: a 2-rank CPU fit under FSDP2 (Lightning's ModelParallelStrategy).

Each rank writes what it saw to ``<out>/rank<r>.json``; rank 0 also saves the trained weights
(gathered from the shards) to ``<out>/weights.pt`` so the test can compare with a single process. ``--fits`` runs
several fits in one launch (the tuned one, FSDP2 alone, a reuse of the plan file).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner, applied_plan
from lightning_ckpt.model import model_fingerprint
from lightning_ckpt.testing import GPT, GPTConfig

SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all"], "rest_modes": [], "segments": False}

# The process group's timeout bounds two waits: the ranks meeting at start-up, and every collective after it. A test
# of a rank that fails inside a sharded step wants the second short (the other rank waits that long in its
# all-gather), but rank 1 first starts Python, imports torch and Lightning and builds the model while rank 0 waits
# for it: over 20 s on a busy 2-core machine. So the strategy gets at least this for the meeting, and each rank sets
# ``--timeout`` for the collectives once the group is up (``ShardedGPT.configure_model``).
RENDEZVOUS_SECONDS = 300.0


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.0))


class ShardedGPT(LitGPT):
    def __init__(self, fail_rank: int = -1, fail_on: str = "", collective_timeout: float | None = None) -> None:
        # SGD, not Adam: Adam's first step is lr x sign(grad), which turns float-level differences in
        # near-zero gradients (two ranks' average vs one mean) into +-lr, hiding whether training matches.
        super().__init__(model=make_model(), optimizer=torch.optim.SGD, lr=0.1)
        self.plans_seen: list[str | None] = []
        self.fail_rank, self.fail_on = fail_rank, fail_on
        self.collective_timeout = collective_timeout
        self.batches: dict[int, list] = {}

    def configure_model(self) -> None:
        from torch.distributed.distributed_c10d import _set_pg_timeout
        from torch.distributed.fsdp import fully_shard

        if self.collective_timeout is not None:  # the group is up: the collectives' own timeout (RENDEZVOUS_SECONDS)
            _set_pg_timeout(timedelta(seconds=self.collective_timeout))
        for block in self.model.transformer.h:
            fully_shard(block)
        fully_shard(self.model)

    def training_step(self, batch, batch_idx):
        plan = applied_plan(self)
        if self.global_rank == self.fail_rank and plan is not None and plan.describe() == self.fail_on:
            raise torch.OutOfMemoryError("simulated: out of memory on one rank, inside a sharded step")
        self.plans_seen.append(plan.digest() if plan is not None else None)
        self.batches[self.trainer.global_step] = [t.tolist() for t in batch]  # the samples this rank trained on
        return super().training_step(batch, batch_idx)


def fit(out: Path, args: argparse.Namespace, *, tuner: bool, prefix: str = "") -> dict:
    """One FSDP2 fit writing to ``out``: with the tuner (searching, or reusing ``out/plan.json`` when it exists),
    or FSDP2 alone. Rank 0 saves the trained weights to ``out/<prefix>weights.pt``; the report is what this rank saw."""
    module = ShardedGPT(args.fail_rank, args.fail_on, collective_timeout=args.timeout)
    cb = ActivationCheckpointTuner(
        activation_budget=0.9,
        verbose=False,
        plan_path=out / "plan.json",
        search=dict(n_trials=4, measure_steps=1, search_space=SPACE, predict_time=not args.fail_on),
    )
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=max(args.timeout, RENDEZVOUS_SECONDS))
    )
    trainer = quiet_trainer(out, [cb] if tuner else [], steps=args.steps, devices=2, strategy=strategy)
    trainer.fit(module, token_loader(32, batch_size=4))
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(weights, out / f"{prefix}weights.pt")
    return {
        "rank": trainer.global_rank,
        "digest": cb.plan.digest() if cb.plan else None,
        "plan": cb.plan.to_dict() if cb.plan else None,
        "trials_run": cb.trials_run,
        "wrote_plan_file": cb.wrote_plan_file,
        "plans_seen": module.plans_seen,
        "fingerprint": model_fingerprint(module.model),
        "unsharded_fingerprint": model_fingerprint(make_model()),
        "left_applied": applied_plan(module) is not None,
        "batches": module.batches,
    }


def table_fit(out: Path, args: argparse.Namespace) -> dict:
    """A sharded fit following a plan table on batches whose lengths differ between the ranks (tests/ddp_worker.py's):
    the buckets are profiled in lockstep (each profile gathers parameters) and every step runs one plan on all ranks,
    so no rank waits on a gather another never issues."""
    from ddp_worker import TABLE_LENGTHS, RankBatches

    module = ShardedGPT(collective_timeout=args.timeout)
    cb = ActivationCheckpointTuner(
        activation_budget=0.7,
        max_shape=16,
        verbose=False,
        plan_path=out / "table-plan.json",
        search=dict(n_trials=4, measure_steps=1, search_space=SPACE),
    )
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=max(args.timeout, RENDEZVOUS_SECONDS))
    )
    trainer = quiet_trainer(out, [cb], steps=len(TABLE_LENGTHS[0]), devices=2, strategy=strategy)
    trainer.fit(module, RankBatches())
    table = cb.plan_table
    return {
        "rank": trainer.global_rank,
        "lengths": [len(module.batches[step][0][0]) for step in sorted(module.batches)],
        "plans_seen": module.plans_seen,
        "table": [[b.max_length, b.plan.digest()] for b in table.buckets] if table is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--fits",
        default="tuned",
        help="the fits to run one after another in this launch (a launch of two ranks costs more than a fit): "
        "'tuned' (the tuner, writing out/rank<r>.json), 'plain' (FSDP2 alone, in out/plain/) and 'reuse' (the "
        "tuner again, reusing out/plan.json, in out/reuse-rank<r>.json and out/reuse-weights.pt), comma-separated",
    )
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-on", default="")
    parser.add_argument("--timeout", type=float, default=1800.0, help="the collectives' timeout, seconds")
    args = parser.parse_args()
    # A launch that hangs prints where each rank waits just before the test's 300 s limit kills it without a word.
    faulthandler.dump_traceback_later(280, exit=True)
    for name in args.fits.split(","):
        if name == "table":
            report = table_fit(args.out, args)
            (args.out / f"table-rank{report['rank']}.json").write_text(json.dumps(report))
            continue
        out = args.out / "plain" if name == "plain" else args.out
        out.mkdir(exist_ok=True)
        prefix = "reuse-" if name == "reuse" else ""
        report = fit(out, args, tuner=name != "plain", prefix=prefix)
        (out / f"{prefix}rank{report['rank']}.json").write_text(json.dumps(report))
    # The group's threads outlived the interpreter otherwise: "terminate called without an active exception" at exit.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
