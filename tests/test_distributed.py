"""The tuner under DDP (2 CPU ranks, gloo), run as subprocesses: ranks agree, only rank 0 writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ranks import run_ranks

from lightning_ckpt.budget import Budget, RequestedBudget
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.distributed import LocalSync, combine_trials
from lightning_ckpt.search.ledger import TrialRecord
from lightning_ckpt.search.setup import resolve_budget

WORKER = Path(__file__).with_name("ddp_worker.py")


def _run(out: Path, *args: str) -> list[dict]:
    return run_ranks(WORKER, out, *args)


@pytest.mark.slow
def test_ddp_ranks_agree_survive_one_rank_oom_and_reuse(tmp_path):
    # Both fits in one launch of two ranks (the launch costs more than a fit): the search, then a reuse.
    first = _run(
        tmp_path, "--oom-rank", "1", "--oom-on", "selective(mlp) h.0-1", "--then-table", "--then-guard", "--then-reuse"
    )
    r0, r1 = first
    assert r0["digest"] == r1["digest"] and r0["plan"]["blocks"] == r1["plan"]["blocks"]
    assert r0["trials_run"] == r1["trials_run"] > 0
    # The OOM happened on rank 1 only, yet both ranks recorded the trial as infeasible.
    assert r0["statuses"]["baseline:selective_mlp"] == r1["statuses"]["baseline:selective_mlp"] == "oom"
    assert r0["statuses"] == r1["statuses"]
    assert r0["wrote_plan_file"] and not r1["wrote_plan_file"]
    assert Plan.load(tmp_path / "plan.json").digest() == r0["digest"]

    # One DDP step with the tuned plan equals one single-process step on the global batch.
    sys.path.insert(0, str(WORKER.parent))
    import ddp_worker

    from lightning_ckpt import apply_plan

    module = ddp_worker.TinyGPT()
    apply_plan(module, Plan.load(tmp_path / "plan.json"))
    x, y = ddp_worker.data().tensors
    module.model(x, y).backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
    for k, v in module.state_dict().items():
        torch.testing.assert_close(torch.tensor(r0["weights"][k]), v, rtol=1e-5, atol=1e-6)

    # The plan also trains under find_unused_parameters. Its budget resolves differently per rank (as the default
    # CUDA budget does): the ranks guard against one budget, rank 0's, or a step judged differently would hang.
    reuse = [json.loads((tmp_path / f"reuse-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["trials_run"] for r in reuse] == [0, 0]
    assert reuse[0]["digest"] == reuse[1]["digest"] == r0["digest"]
    assert reuse[0]["budget_limit"] == reuse[1]["budget_limit"] == 10 * 2**30

    # A plan table under several ranks: rank 0's table on both, and each step every rank runs the plan of the
    # bucket of that step's longest batch on any rank, whatever its own batch's length.
    import ddp_worker

    t0, t1 = (json.loads((tmp_path / f"table-rank{r}.json").read_text()) for r in (0, 1))
    assert t0["table"] is not None and t0["table"] == t1["table"] and len(t0["table"]) >= 2
    assert t0["wrote_plan_file"] and not t1["wrote_plan_file"]
    table = t0["table"]
    assert len({key for _, key in table}) >= 2, "the buckets run different plans: switching is exercised"
    assert [n for n, _ in t0["ran"]] == ddp_worker.TABLE_LENGTHS[0] and [
        n for n, _ in t1["ran"]
    ] == ddp_worker.TABLE_LENGTHS[1]
    longest = [max(a, b) for a, b in zip(*ddp_worker.TABLE_LENGTHS.values(), strict=True)]
    expected = [next(key for edge, key in table if n <= edge) for n in longest]
    assert [key for _, key in t0["ran"]] == [key for _, key in t1["ran"]] == expected

    # Without a table: tuned on first batches of 4 and 8 tokens (none fits; the trials' memory is the 8-token rank's),
    # then rank 1 alone gets a batch 2x longer than any before. Both ranks judge each step by its largest batch on
    # any rank and scale from the largest tuned batch: nothing moves on the 8-token step (a rank scaling from its
    # own 4-token batch would move alone there), and both move to the same lower-memory plan before the 16-token
    # step's forward, which then fits.
    g0, g1 = (json.loads((tmp_path / f"guard-rank{r}.json").read_text()) for r in (0, 1))
    assert [n for n, _ in g1["ran"]] == ddp_worker.GUARD_LENGTHS[1]
    none = Plan().key()
    assert g0["chosen"] == none
    assert [key for _, key in g0["ran"][:3]] == [key for _, key in g1["ran"][:3]] == [none] * 3
    assert g0["ran"][3][1] == g1["ran"][3][1] != none
    assert any("checked before its forward" in w for w in g0["warned"]), g0["warned"]
    assert g0["checks"] == g1["checks"] and all(fits for _, _, fits, _ in g0["checks"]), g0["checks"]


def _trial(status, sps, seconds, peak):
    return TrialRecord(number=0, plan=Plan(), label="x", params={}, status=status, samples_per_second=sps,
                       median_seconds=seconds, peak_bytes=peak, activation_bytes=peak)  # fmt: skip


def test_combine_takes_worst_status_max_memory_and_slowest_rank():
    budget = Budget("peak", 1000)
    both = combine_trials([_trial("ok", 40.0, 0.1, 500), _trial("ok", 20.0, 0.2, 700)], budget)
    assert both.status == "ok" and both.peak_bytes == 700
    assert both.samples_per_second == pytest.approx((4 + 4) / 0.2)  # 8 samples per global step of 0.2 s
    assert combine_trials([_trial("ok", 40.0, 0.1, 500), _trial("oom", None, None, None)], budget).status == "oom"
    over = combine_trials([_trial("ok", 40.0, 0.1, 500), _trial("ok", 40.0, 0.1, 1500)], budget)
    assert over.status == "over_budget"


def test_a_soft_overrun_on_one_rank_is_an_over_budget_trial_for_all_and_does_not_end_a_sharded_search():
    # One rank's step completed above the limit (CUDA: between the limit and the cap). It must not be an OOM,
    # which ends a sharded search on that rank alone while the others wait in an all-gather.
    from lightning_ckpt.measure.measurement import Measurement
    from lightning_ckpt.search.ledger import TrialStatus

    over = Measurement("over_budget", peak_bytes=1500, activation_bytes=900, error="peak exceeds memory_limit_bytes")
    assert not TrialStatus(over.status).failed and TrialStatus(over.status).ran
    budget = Budget("peak", 1000)
    both = combine_trials([_trial("ok", 40.0, 0.1, 500), _trial("over_budget", None, None, 1500)], budget)
    assert both.status == "over_budget" and both.peak_bytes == 1500


def test_an_activation_budget_is_a_share_of_the_largest_ranks_step():
    # The ranks' first batches can differ in length; trials are judged by the most any rank used, so an activation
    # budget must be a share of the no-checkpointing activations of the rank that needs the most, not rank 0's.
    class TwoRanks:
        is_leader, world_size = True, 2

        def broadcast(self, obj):
            return obj

        def all_gather(self, obj):
            return [obj, 3 * obj]  # rank 1's batch is longer

    memory = SimpleNamespace(
        model=SimpleNamespace(predict_activation=lambda plan: 1000),
        optimizer=SimpleNamespace(step_peak_bytes=0, note=""),
    )
    view = SimpleNamespace(device=torch.device("cpu"))
    requested = RequestedBudget.parse(activation_budget=0.5)
    assert resolve_budget(requested, memory, object(), view, TwoRanks()).limit_bytes == 1500
    assert resolve_budget(requested, memory, object(), view, LocalSync()).limit_bytes == 500
