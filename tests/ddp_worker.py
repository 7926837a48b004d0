"""Run by tests/test_distributed.py in a subprocess: a 2-rank CPU DDP fit with the tuner.

Lightning's ``ddp`` launcher re-runs this script for rank 1; each rank writes what it saw to
``<out>/rank<r>.json`` so the test can compare ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy
from lit import LitGPT, quiet_trainer, token_dataset
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import ActivationCheckpointTuner, Plan, applied_plan

SPACE = {"modes": ["full", "selective:mlp"], "selections": ["all"], "rest_modes": [], "segments": False}


class TinyGPT(LitGPT):
    def __init__(self, oom_rank: int = -1, oom_on: str = "") -> None:
        super().__init__(
            n_layer=2, n_embd=32, vocab_size=48, block_size=16, dropout=0.0, optimizer=torch.optim.SGD, lr=0.1
        )
        self.oom_rank, self.oom_on = oom_rank, oom_on

    def training_step(self, batch, batch_idx):
        plan = applied_plan(self)
        if self.global_rank == self.oom_rank and plan is not None and plan.describe() == self.oom_on:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory on one rank")
        return super().training_step(batch, batch_idx)


def data() -> TensorDataset:
    return token_dataset(8)


TABLE_LENGTHS = {0: [4, 16, 4, 4], 1: [4, 4, 4, 16]}  # each rank's batch lengths, step by step: they differ


# The first batches differ (the search's trials measure rank 1's longer one), then a step whose longest batch is the
# tuned length, then one 2x longer than any before, on rank 1 only.
GUARD_LENGTHS = {0: [4, 8, 4, 4], 1: [8, 4, 4, 16]}


class RankBatches:
    """Each rank's own token batches (4 rows), whose lengths differ from rank to rank within a step."""

    def __init__(self, lengths: dict[int, list[int]] = TABLE_LENGTHS) -> None:
        self.lengths = lengths

    def __iter__(self):
        rank = torch.distributed.get_rank()
        for step, length in enumerate(self.lengths[rank]):
            tokens = token_dataset(4, length, seed=100 * rank + step).tensors
            yield tokens[0], tokens[1]

    def __len__(self) -> int:
        return len(self.lengths[0])


class RecordingGPT(TinyGPT):
    """Records each step's batch length and the plan applied while it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[list] = []

    def training_step(self, batch, batch_idx):
        plan = applied_plan(self)
        self.ran.append([int(batch[0].shape[1]), plan.key() if plan is not None else Plan().key()])
        return super().training_step(batch, batch_idx)


def table_fit(out: Path) -> dict:
    """A fit with a plan table (max_shape 16, lengths 4 to 16) on batches whose lengths differ between the ranks."""
    tuner = ActivationCheckpointTuner(
        activation_budget=0.7,  # full checkpointing keeps about 0.6 of this tiny GPT's activations at length 16
        max_shape=16,
        plan_path=out / "table-plan.json",
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
    )
    module = RecordingGPT()
    trainer = quiet_trainer(None, [tuner], steps=len(TABLE_LENGTHS[0]), devices=2, strategy="ddp")
    trainer.fit(module, RankBatches())
    table = tuner.plan_table
    return {
        "rank": trainer.global_rank,
        "ran": module.ran,
        "table": [[b.max_length, b.plan.key()] for b in table.buckets] if table is not None else None,
        "wrote_plan_file": tuner.wrote_plan_file,
    }


def fit(out: Path, args: argparse.Namespace, *, reuse: bool) -> dict:
    """One DDP fit: the tuner searching (a trial made to fail on one rank), or reusing ``out/plan.json`` under
    ``find_unused_parameters`` with a budget that resolves differently per rank."""
    plan_path = out / "plan.json"
    if reuse:
        tuner = ActivationCheckpointTuner(plan=plan_path, verbose=False)
    else:
        tuner = ActivationCheckpointTuner(
            plan_path=plan_path,
            verbose=False,
            log_dir=out / "tb",
            # A plan made to fail must run: the time model would not measure a plan it predicts cannot win.
            search=dict(n_trials=6, measure_steps=1, search_space=SPACE, predict_time=not args.oom_on),
        )
    module = TinyGPT(-1 if reuse else args.oom_rank, args.oom_on)
    strategy = DDPStrategy(find_unused_parameters=True) if reuse else "ddp"
    trainer = quiet_trainer(None, [tuner], steps=1, devices=2, strategy=strategy)
    trainer.fit(module, DataLoader(data(), batch_size=4, shuffle=False))
    result = tuner.result
    return {
        "rank": trainer.global_rank,
        "plan": tuner.plan.to_dict() if tuner.plan else None,
        "digest": tuner.plan.digest() if tuner.plan else None,
        "trials_run": tuner.trials_run,
        "statuses": {t.label: t.status for t in result.trials} if result else {},
        "wrote_plan_file": tuner.wrote_plan_file,
        "budget_limit": tuner._session.guard.budget.limit_bytes if tuner._session.guard is not None else None,
        "weights": {k: v.tolist() for k, v in module.state_dict().items()},
    }


def guard_fit(out: Path) -> dict:
    """No max_shape: tuned on the first batches (4 and 8 tokens), where ``none`` fits the budget; then a step whose
    longest batch is the tuned 8 (on rank 0 this time), then rank 1 alone gets a batch 2x longer than any before,
    over the budget under ``none``. The guard must act before that step's forward on both ranks alike, and on no
    step before it."""
    tuner = ActivationCheckpointTuner(
        # A real step under none peaks at 387-473 KiB on the 8-token batches (DDP's buckets included) and at
        # 537 KiB on the 16-token one: between them.
        max_memory="510KiB",
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
    )
    module = RecordingGPT()
    trainer = quiet_trainer(None, [tuner], steps=len(GUARD_LENGTHS[0]), devices=2, strategy="ddp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, RankBatches(GUARD_LENGTHS))
    return {
        "rank": trainer.global_rank,
        "ran": module.ran,
        "chosen": tuner.result.best.key(),
        "checks": [[c.step, c.size, c.within_budget, c.peak_bytes] for c in tuner.step_checks],
        "warned": [str(w.message) for w in caught if "lightning_ckpt" in str(w.message)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--oom-rank", type=int, default=-1)
    parser.add_argument("--oom-on", default="")
    parser.add_argument(
        "--then-table",
        action="store_true",
        help="after the search, a fit following a plan table on batches whose lengths differ between the ranks; "
        "written to out/table-rank<r>.json",
    )
    parser.add_argument(
        "--then-guard",
        action="store_true",
        help="then a fit where one rank's batch is longer than any before (out/guard-rank<r>.json)",
    )
    parser.add_argument(
        "--then-reuse",
        action="store_true",
        help="after the search, in the same launch (it costs more than a fit), a second fit reusing the plan file "
        "under find_unused_parameters, its budget resolved per rank; written to out/reuse-rank<r>.json",
    )
    args = parser.parse_args()
    first = fit(args.out, args, reuse=False)
    (args.out / f"rank{first['rank']}.json").write_text(json.dumps(first))
    if args.then_table:
        table = table_fit(args.out)
        (args.out / f"table-rank{table['rank']}.json").write_text(json.dumps(table))
    if args.then_guard:
        guarded = guard_fit(args.out)
        (args.out / f"guard-rank{guarded['rank']}.json").write_text(json.dumps(guarded))
    if args.then_reuse:
        # As the default CUDA budget does: a share of each GPU's free memory, which differs per rank.
        from lightning_ckpt.budget import Budget, RequestedBudget

        limit = (10 + 10 * int(os.environ.get("LOCAL_RANK", "0"))) * 2**30
        RequestedBudget.resolve = lambda *a, **k: Budget("peak", limit, None, f"{limit} bytes free on this rank")
        again = fit(args.out, args, reuse=True)
        (args.out / f"reuse-rank{again['rank']}.json").write_text(json.dumps(again))


if __name__ == "__main__":
    sys.exit(main())
