"""Can the user trust the search's choice? Repeated searches, each re-timed against every fitting baseline.

For each case (a model at an activation budget: the package's GPT, an MLP-mixer, a tiny Llama; budgets 50% and
30% of the no-checkpointing activation memory), ``--searches`` searches (default 10) each run ``tune()`` with
the tuner's defaults and ``activation_budget=B``, and write the plan they chose and what they claimed for it:
the claimed ratio is the chosen plan's speed over the fastest fitting baseline's, as the search's verdict states
it (``metadata["search"]["verdict"]``: its ratio and 90% interval when the tuned plan won, 1.0 when the reference
baseline was kept). Then every chosen plan and every fitting baseline (the plan the search ran under that name,
fitting as ``tuner_vs_baselines.py`` decides it: its trial's status is ok) are re-timed side by side in interleaved
rounds (``--rounds``, default 40, the order rotated every round, ``--steps`` timed steps per plan per round,
default 1, one warm-up step in a plan's first round only: the confirmation's own design, see
``step_alternation.py``), and each search gets its re-timed ratio: the chosen plan's speed over the fastest fitting
baseline's, as the verdict computes it (geometric mean of the paired per-round ratios), the fastest baseline being
the one whose paired ratios over the others are highest (with 40 rounds the benchmark can afford the pairing;
the search's confirmation takes the baseline of highest median, the rule its choice uses).

Why fresh processes: each search runs in a process of its own (``--worker search``), so that nothing one search
leaves behind (warm thread pools and oneDNN caches, the allocator's pools, an Optuna study in memory) helps or
hurts the next: every search starts as a user's first one does, and the N searches are N independent draws. The
re-timing runs in yet another process (``--worker retime``), so the chosen plan is not judged in the process that
chose it, nor after the caches it warmed there. Processes exchange JSON files in a temporary directory.

Targets, per case: the re-timed ratio is >= 0.97 in EVERY search (the worst search is reported, not the median:
one bad choice in ten is a user who loses), and the claimed ratio is within 5% of the re-timed one
(``|claimed / re-timed - 1| <= 0.05``) in at least 9 of 10 searches (``ceil(0.9 * N)`` of N).

``--load``: busy processes on every core from 25% to 75% of a search's typical duration (a quiet calibration
search per case, not counted, measures it; its plan is re-timed as ``quiet``), as in
``tuner_vs_baselines.py``'s load row; the re-timing always runs on the quiet machine.

Run: ``python benchmarks/repeatability.py`` (all cases, both budgets, 10 searches each; writes
``benchmarks/results/repeatability.json``, or ``repeatability_load.json`` with ``--load``). Subsets:
``--cases gpt llama --budgets 0.5 --searches 3``; ``--threads N`` sets torch's threads in every worker (default:
torch's own). How long a full run takes, an ESTIMATE (not timed): roughly an hour on 2 CPU cores, scaled from the
``--tiny`` run (each search process: 5-13 s of start-up and imports, 40-150 training steps of search) by the
full-size steps (about 0.07 s for the mixer and the Llama, 0.3-0.6 s for the GPT, on one thread of a busy 2-core
machine): 60 searches of 20 s (mixer, Llama) to 1-1.5 min (GPT) each, plus six re-timings of 1-3 min; ``--load``
adds a calibration search per case, and its searches run slower. ``--tiny`` shrinks every model and batch (and
uses one thread) so the whole protocol runs in about a minute: for smoke tests only, its figures say nothing
(its JSON says so, and goes to ``repeatability_tiny.json`` unless ``--out`` is given). Smoke test:
``python benchmarks/repeatability.py --tiny --searches 1 --rounds 2 --cases gpt mixer llama --budgets 0.5``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).parent / "results"
CASES = ("gpt", "mixer", "llama")
RETIMED_TARGET = 0.97  # re-timed ratio, worst search
CLAIM_TOLERANCE = 0.05  # |claimed / re-timed - 1|
CLAIM_SHARE = 0.9  # of the searches
LOAD_WINDOW = (0.25, 0.75)  # of a quiet search's duration
BUSY_COMMAND = ("-c", "while True: pass")  # one per core, run with sys.executable


# ---------------------------------------------------------------------------------------------------
# The models: built the same way (same seeds, same batch) in every process.
# ---------------------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    model: nn.Module
    loss_fn: Callable[[], torch.Tensor]  # the forward of one step on the fixed batch, returning the loss
    extra: tuple[torch.Tensor, ...]  # the batch's tensors (held live by the step; tune counts them)
    batch_size: int
    seq_len: int | None
    config: dict[str, Any] = field(default_factory=dict)


def _seeded(loss: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``loss`` with the same dropout draws in every call: every step of every process computes the same thing."""

    def step() -> torch.Tensor:
        torch.manual_seed(7)
        return loss()

    return step


def gpt_case(tiny: bool) -> Case:
    """examples/train_gpt.py's model (8 layers, d=128, T=128, batch 16; vocab 96 as tuner_vs_baselines)."""
    from lightning_ckpt.testing import GPT, GPTConfig

    if tiny:
        cfg = dict(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=96, dropout=0.1)
        batch = 4
    else:
        cfg = dict(n_layer=8, n_head=4, n_embd=128, block_size=128, vocab_size=96, dropout=0.1)
        batch = 16
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    tokens = torch.randint(0, cfg["vocab_size"], (batch, cfg["block_size"]), generator=torch.Generator().manual_seed(0))
    return Case("gpt", model, _seeded(lambda: model(tokens, tokens)), (tokens,), batch, cfg["block_size"],
                {**cfg, "batch": batch})  # fmt: skip


class MixerBlock(nn.Module):
    """MLP-Mixer's block: an MLP across patches (``token_mlp``) and one across channels (``channel_mlp``)."""

    def __init__(self, patches: int, channels: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(channels)
        self.token_mlp = nn.Sequential(nn.Linear(patches, token_hidden), nn.GELU(), nn.Linear(token_hidden, patches))
        self.norm_2 = nn.LayerNorm(channels)
        self.channel_mlp = nn.Sequential(
            nn.Linear(channels, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm_1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm_2(x))


class Mixer(nn.Module):
    """A plain MLP-mixer classifier over pre-cut patches: embed, ``trunk`` (an ``nn.ModuleList``), pool, head."""

    def __init__(self, *, blocks: int, patches: int, patch_dim: int, channels: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(patch_dim, channels)
        self.trunk = nn.ModuleList(MixerBlock(patches, channels, patches * 2, channels * 4) for _ in range(blocks))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, patches: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches)
        for block in self.trunk:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x).mean(dim=1)), labels)


def mixer_case(tiny: bool) -> Case:
    """12 mixer blocks over 16 patches x 64 channels (patches of 4x4x3 pixels), batch 64."""
    if tiny:
        cfg = dict(blocks=4, patches=8, patch_dim=12, channels=16, classes=10)
        batch = 8
    else:
        cfg = dict(blocks=12, patches=16, patch_dim=48, channels=64, classes=10)
        batch = 64
    torch.manual_seed(0)
    model = Mixer(**cfg)
    g = torch.Generator().manual_seed(0)
    patches = torch.randn(batch, cfg["patches"], cfg["patch_dim"], generator=g)
    labels = torch.randint(0, cfg["classes"], (batch,), generator=g)
    return Case("mixer", model, _seeded(lambda: model(patches, labels)), (patches, labels), batch, None,
                {**cfg, "batch": batch})  # fmt: skip


def llama_case(tiny: bool) -> Case:
    """``LlamaForCausalLM`` from a config (no weights): 6 layers, hidden 128, 4 heads, 2 KV heads, batch 8 x 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = dict(num_hidden_layers=3, hidden_size=32, intermediate_size=64, vocab_size=64)
        batch, seq = 2, 16
    else:
        cfg = dict(num_hidden_layers=6, hidden_size=128, intermediate_size=344, vocab_size=512)
        batch, seq = 8, 64
    cfg.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"  # as the zoo (lightning_ckpt.testing.zoo) does
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.train()
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    return Case("llama", model, _seeded(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss), (ids,),
                batch, seq, {**cfg, "attn_implementation": "sdpa", "batch": batch, "seq": seq})  # fmt: skip


BUILDERS = {"gpt": gpt_case, "mixer": mixer_case, "llama": llama_case}


# ---------------------------------------------------------------------------------------------------
# Worker: one search, in a fresh process.
# ---------------------------------------------------------------------------------------------------
def _fitting_baselines(result: Any) -> list[str]:
    """The baselines that fit, as tuner_vs_baselines decides it: the search's baseline trials with status ok."""
    return sorted(name for name, t in result.baselines.items() if getattr(t.status, "value", t.status) == "ok")


def claimed(metadata: dict[str, Any]) -> dict[str, Any]:
    """What the search claimed for its choice: the chosen plan's speed over the fastest fitting baseline's.

    From the verdict (``metadata["search"]["verdict"]``) where there is one: its ratio and interval when the tuned
    plan won, else 1.0 (the reference baseline itself was kept). Without a verdict, what the search's own figures
    say: the chosen plan's samples/s over the fastest fitting baseline's (status ok).
    """
    verdict = (metadata.get("search") or {}).get("verdict")
    if isinstance(verdict, dict):
        if verdict.get("outcome") == "tuned" and verdict.get("ratio"):
            return {"source": "verdict", "ratio": verdict["ratio"], "low": verdict.get("low"),
                    "high": verdict.get("high"), "outcome": "tuned", "verdict": verdict}  # fmt: skip
        return {"source": "verdict", "ratio": 1.0, "low": None, "high": None,
                "outcome": verdict.get("outcome") or "baseline", "verdict": verdict}  # fmt: skip
    mine = (metadata.get("measured") or {}).get("samples_per_second")
    fitting = [b.get("samples_per_second") for b in (metadata.get("baselines") or {}).values()
               if b.get("status") == "ok" and b.get("samples_per_second")]  # fmt: skip
    ratio = mine / max(fitting) if mine and fitting else None
    return {"source": "measured figures (no verdict in the metadata)", "ratio": ratio, "low": None, "high": None,
            "outcome": None, "verdict": None}  # fmt: skip


def verdict_names_chosen(claim: dict[str, Any], best: Any) -> bool | None:
    """Whether the verdict is about the chosen plan: the tuned plan won and is its candidate, or the reference
    baseline was kept and is the plan chosen. None without a verdict or a chosen trial."""
    verdict = claim.get("verdict")
    if not verdict or best is None:
        return None
    if claim["outcome"] == "tuned":
        return verdict.get("candidate") == best.label
    return verdict.get("reference") == f"baseline:{best.baseline}"


def worker_search(job: dict[str, Any]) -> dict[str, Any]:
    from lightning_ckpt import tune

    case = BUILDERS[job["case"]](job["tiny"])
    started = time.time()
    t0 = time.perf_counter()
    result = tune(case.model, case.loss_fn, activation_budget=job["budget"], batch_size=case.batch_size,
                  seq_len=case.seq_len, extra_tensors=case.extra)  # fmt: skip
    seconds = time.perf_counter() - t0
    result.best.save(job["plan_path"])
    # The fitting baselines as this search ran them (its space's baseline points), for the re-timing to time the
    # very plans the claim compared against.
    fitting = _fitting_baselines(result)
    baseline_plans = {}
    for name in fitting:
        path = Path(job["plan_path"]).with_suffix(f".baseline-{name}.json")
        result.baselines[name].plan.save(path)
        baseline_plans[name] = {"path": str(path), "digest": result.baselines[name].plan.digest()}
    best = result.best_trial
    metadata = dict(result.best.metadata)
    chosen_baseline = best.baseline if best is not None else None
    claim = claimed(metadata)
    return {
        "tune_started_at": started,
        "search_seconds": seconds,
        "plan_path": job["plan_path"],
        "chosen": result.best.describe(),
        "chosen_label": best.label if best is not None else None,
        "chosen_baseline": chosen_baseline,
        "digest": result.best.digest(),
        "fell_back": result.fell_back,
        "budget": result.budget.to_dict(),
        "fitting_baselines": fitting,
        "baseline_plans": baseline_plans,
        "claimed": claim,
        # The verdict names the plan chosen: the candidate when the tuned plan won, else the reference baseline.
        "verdict_names_chosen": verdict_names_chosen(claim, best),
        "measured": metadata.get("measured"),
        "baselines": metadata.get("baselines"),
        "search": {k: v for k, v in (metadata.get("search") or {}).items() if k != "time_model"},
        "trials": len(result.trials),
        "trials_measured": result.n_measured,
        "tuning_steps": result.tuning_steps,
    }


# ---------------------------------------------------------------------------------------------------
# Worker: the side-by-side re-timing, in a fresh process on the quiet machine.
# ---------------------------------------------------------------------------------------------------
def worker_retime(job: dict[str, Any]) -> dict[str, Any]:
    from lightning_ckpt import Plan, baselines, plan_applied
    from lightning_ckpt.measure.step import StepSettings, measure_step
    from lightning_ckpt.memory.profile import profile_memory

    case = BUILDERS[job["case"]](job["tiny"])
    plans = {f"baseline:{k}": Plan.load(path) for k, path in job["baselines"].items()}
    plans.update({label: Plan.load(path) for label, path in job["plans"].items()})
    # The memory model predicts each plan's activation memory exactly on CPU: a cross-check of "fits".
    memory = profile_memory(case.model, case.loss_fn, extra=case.extra)
    # plan/baselines.py's plans of the same names: whether the search's baseline points are those plans.
    named = baselines(case.model, memory_model=memory)
    same_as_named = {k: k in named and named[k].digest() == plans[f"baseline:{k}"].digest() for k in job["baselines"]}
    limit = job["limit_bytes"]
    predicted = {label: memory.predict_activation(plan) for label, plan in plans.items()}

    distinct: dict[str, Plan] = {}  # one timing per distinct plan: a plan under two names would only sample noise
    alias: dict[str, str] = {}
    for label, plan in plans.items():
        alias[label] = next((n for n, p in distinct.items() if p.digest() == plan.digest()), label)
        distinct.setdefault(alias[label], plan)
    order = list(distinct)

    def step() -> None:
        case.loss_fn().backward()

    # Untimed steps first: a process's first steps are slow (thread pools, allocator growth), as tune's warm-up.
    with plan_applied(case.model, baselines(case.model)["full"], check_fingerprint=False):
        measure_step(step, StepSettings(warmup=2, steps=1, track_memory=False), model=case.model, extra=case.extra)
    seconds: dict[str, list[float]] = {name: [] for name in order}
    orders = []
    for r in range(job["rounds"]):
        shift = r % len(order)
        this_round = order[shift:] + order[:shift]  # rotated: over len(order) rounds each plan takes each place
        orders.append(this_round)
        for name in this_round:
            with plan_applied(case.model, distinct[name], check_fingerprint=False):
                m = measure_step(
                    step,
                    StepSettings(warmup=1 if r == 0 else 0, steps=job["steps"], track_memory=False),
                    model=case.model,
                    batch_size=case.batch_size,
                    extra=case.extra,
                )
            if m.status != "ok":
                raise RuntimeError(f"re-timing {name}: {m.status} {m.error}")
            seconds[name].append(m.median_seconds)
    return {
        "plans": {
            label: {
                "plan": plan.describe(),
                "same_plan_as": alias[label] if alias[label] != label else None,
                "round_seconds": seconds[alias[label]],
                "samples_per_second": case.batch_size / statistics.median(seconds[alias[label]]),
                "predicted_activation_bytes": predicted[label],
                "predicted_fits": limit is None or predicted[label] <= limit,
            }
            for label, plan in plans.items()
        },
        "orders": orders,
        "none_activation_bytes": memory.predict_activation(Plan()),
        "search_baseline_is_plan_baselines": same_as_named,
    }


# ---------------------------------------------------------------------------------------------------
# The parent: runs the workers, the load, and judges.
# ---------------------------------------------------------------------------------------------------
def run_worker(kind: str, job: dict[str, Any], tmp: Path, tag: str, *, load_at: tuple[float, float] | None = None):
    """Run one worker process on ``job`` (a JSON file in ``tmp``); returns (its output or None, wall seconds,
    the load window it ran under, the error text). ``load_at``: busy processes on every core from ``load_at[0]``
    to ``load_at[1]`` seconds after the worker starts."""
    job_path, out_path, log_path = tmp / f"{tag}.job.json", tmp / f"{tag}.out.json", tmp / f"{tag}.log"
    job_path.write_text(json.dumps(job))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(job_path), str(out_path)]
    busy: list[subprocess.Popen] = []
    window: dict[str, float] = {}
    lock = threading.Lock()  # the stop timer and the end of the search may stop the load at once

    def start() -> None:
        with lock:
            window["start"] = time.perf_counter() - launched
            busy.extend(subprocess.Popen([sys.executable, *BUSY_COMMAND]) for _ in range(os.cpu_count() or 1))

    def stop() -> None:
        with lock:
            if busy:
                window.setdefault("stop", time.perf_counter() - launched)
            for p in busy:
                p.kill()
                p.wait()
            busy.clear()

    timers = [threading.Timer(load_at[0], start), threading.Timer(load_at[1], stop)] if load_at else []
    launched, wall_started = time.perf_counter(), time.time()
    for t in timers:
        t.start()
    try:
        with log_path.open("w") as log:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    finally:
        for t in timers:
            t.cancel()
            t.join()  # a timer already firing finishes first: no busy process is started after the stop below
        stop()
    wall = time.perf_counter() - launched
    if rc != 0 or not out_path.exists():
        return None, wall, window, f"exit {rc}: " + log_path.read_text()[-3000:]
    out = json.loads(out_path.read_text())
    if "tune_started_at" in out:
        out["startup_seconds"] = out["tune_started_at"] - wall_started
    return out, wall, window, None


def run_case(case: str, budget: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    tag = f"{case}-{budget:g}"
    print(f"\n== {case} at {budget:.0%} activation budget: {args.searches} searches", flush=True)
    job = {"case": case, "tiny": args.tiny, "budget": budget, "threads": args.threads}
    calibration, load_at = None, None
    if args.load:
        calibration, wall, _, error = run_worker("search", {**job, "plan_path": str(tmp / f"{tag}-quiet.plan.json")},
                                                 tmp, f"{tag}-quiet")  # fmt: skip
        if error:
            return {"case": case, "budget_fraction": budget, "error": f"calibration search failed: {error}"}
        begin, end = (calibration["startup_seconds"] + f * calibration["search_seconds"] for f in LOAD_WINDOW)
        load_at = (begin, end)
        calibration["wall_seconds"] = wall
        print(f"  quiet calibration search: {calibration['search_seconds']:.1f} s (+{calibration['startup_seconds']:.1f}"
              f" s start-up); load from {begin:.1f} s to {end:.1f} s after each search process starts", flush=True)  # fmt: skip
    searches: list[dict[str, Any]] = []
    for i in range(args.searches):
        plan_path = str(tmp / f"{tag}-{i}.plan.json")
        out, wall, window, error = run_worker("search", {**job, "plan_path": plan_path}, tmp, f"{tag}-{i}",
                                              load_at=load_at)  # fmt: skip
        record = {"index": i, "wall_seconds": wall, "load_window_seconds": window or None}
        if error:
            print(f"  search {i}: FAILED ({error.splitlines()[0] if error else ''})", flush=True)
            searches.append({**record, "error": error})
            continue
        searches.append({**out, **record})
        print(f"  search {i}: {out['search_seconds']:.1f} s, chose {out['chosen_label']}", flush=True)
        if out["verdict_names_chosen"] is False:
            print(f"  note: search {i}'s verdict is not about the plan it chose: {out['claimed']['verdict']}")
    ok = [s for s in searches if "error" not in s]
    if not ok:
        return {"case": case, "budget_fraction": budget, "searches": searches, "error": "every search failed"}
    fitting = sorted({b for s in ok for b in s["fitting_baselines"]})
    if any(set(s["fitting_baselines"]) != set(fitting) for s in ok):
        print(f"  note: the searches disagree on which baselines fit: {[s['fitting_baselines'] for s in ok]}")
    baseline_paths = {}
    for name in fitting:
        runs = [s["baseline_plans"][name] for s in ok if name in s["baseline_plans"]]
        if len({r["digest"] for r in runs}) > 1:
            print(f"  note: the searches ran different plans as baseline {name}; the first one is re-timed")
        baseline_paths[name] = runs[0]["path"]
    plans = {f"search {s['index']}": s["plan_path"] for s in ok}
    if calibration is not None:
        plans["quiet"] = calibration["plan_path"]
    retime_job = {**job, "plans": plans, "baselines": baseline_paths, "limit_bytes": ok[0]["budget"].get("limit_bytes"),
                  "rounds": args.rounds, "steps": args.steps}  # fmt: skip
    print(f"  re-timing {len(plans)} chosen plans and {len(fitting)} fitting baselines side by side, "
          f"{args.rounds} rounds ...", flush=True)  # fmt: skip
    retimed, retime_wall, _, error = run_worker("retime", retime_job, tmp, f"{tag}-retime")
    if error:
        return {"case": case, "budget_fraction": budget, "searches": searches, "error": f"re-timing failed: {error}"}
    timed = retimed["plans"]
    mispredicted = [k for k in fitting if not timed[f"baseline:{k}"]["predicted_fits"]]
    if mispredicted:
        print(f"  note: the memory model predicts {mispredicted} over the budget, though the searches ran them as ok")
    differ = [k for k, same in retimed["search_baseline_is_plan_baselines"].items() if not same]
    if differ:
        print(f"  note: the search's baselines {differ} are not plan/baselines.py's plans of those names")
    fastest = fastest_paired({k: timed[f"baseline:{k}"] for k in fitting})
    best_baseline = (timed[f"baseline:{fastest}"]["samples_per_second"], fastest) if fastest else None
    for s in searches:
        if "error" in s:
            continue
        mine = timed[f"search {s['index']}"]
        s["retimed_samples_per_second"] = mine["samples_per_second"]
        s["chosen_predicted_fits"] = mine["predicted_fits"]
        s["retimed_paired"] = paired(timed[f"baseline:{fastest}"], mine) if fastest else None
        s["retimed_ratio"] = s["retimed_paired"]["ratio"] if s["retimed_paired"] else None
        c, r = s["claimed"]["ratio"], s["retimed_ratio"]
        s["claim_error"] = abs(c / r - 1) if c and r else None
    summary = summarize(searches, args.searches)
    row = {
        "case": case, "budget_fraction": budget, "budget": ok[0]["budget"], "fitting_baselines": fitting,
        "fastest_fitting_baseline": best_baseline[1] if best_baseline else None, "searches": searches,
        "retimed": retimed, "retime_wall_seconds": retime_wall, "calibration": calibration, "summary": summary,
    }  # fmt: skip
    if calibration is not None and best_baseline:
        row["quiet_retimed_ratio"] = paired(timed[f"baseline:{fastest}"], timed["quiet"])["ratio"]
    print_case(row, timed)
    return row


def fastest_paired(baselines: dict[str, dict[str, Any]]) -> str | None:
    """The fitting baseline whose paired speed ratios over every other baseline sum (in logs) highest: rounds
    pair the plans at one moment, so the machine's drift between rounds does not pick it."""
    if not baselines:
        return None

    def score(name: str) -> float:
        return sum(math.log(paired(other, baselines[name])["ratio"]) for o, other in baselines.items() if o != name)

    return max(sorted(baselines), key=score)


def paired(reference: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any] | None:
    """The candidate's speed over the reference's from the re-timing's paired rounds, as the search's verdict
    computes it (geometric mean of per-round ratios, 90% t interval): like for like with the claimed interval."""
    try:
        from lightning_ckpt.search.verdict import paired_interval
    except ImportError:
        return None
    ratio, low, high, rounds = paired_interval(dict(enumerate(reference["round_seconds"])),
                                               dict(enumerate(candidate["round_seconds"])))  # fmt: skip
    return {"ratio": ratio, "low": low, "high": high, "rounds": rounds}


def summarize(searches: list[dict[str, Any]], n: int) -> dict[str, Any]:
    judged = [s for s in searches if s.get("retimed_ratio") is not None]
    worst = min(judged, key=lambda s: s["retimed_ratio"], default=None)
    within = sum(s["claim_error"] is not None and s["claim_error"] <= CLAIM_TOLERANCE for s in judged)
    needed = math.ceil(CLAIM_SHARE * n)
    complete = len(judged) == n
    return {
        "searches": n,
        "judged": len(judged),
        "distinct_choices": len({s["digest"] for s in judged}),
        "choices": sorted({s["chosen_label"] for s in judged}),
        "worst_retimed_ratio": worst["retimed_ratio"] if worst else None,
        "worst_search": worst["index"] if worst else None,
        "median_retimed_ratio": statistics.median(s["retimed_ratio"] for s in judged) if judged else None,
        "within_5pct": within,
        "within_5pct_needed": needed,
        "pass_retimed": complete and worst is not None and worst["retimed_ratio"] >= RETIMED_TARGET,
        "pass_claimed": complete and within >= needed,
    }


def _claim_text(claim: dict[str, Any]) -> str:
    if claim["ratio"] is None:
        return "-"
    if claim["low"] is not None and claim["high"] is not None:
        return f"{claim['ratio']:.3f} [{claim['low']:.2f}, {claim['high']:.2f}]"
    if claim["outcome"] in ("baseline", "undecided"):
        return f"1.000 ({claim['outcome']})"
    return f"{claim['ratio']:.3f}"


def print_case(row: dict[str, Any], timed: dict[str, Any]) -> None:
    print(f"\n  {row['case']} at {row['budget_fraction']:.0%}: fitting baselines re-timed (samples/s):", end="")
    print("".join(f" {k} {timed[f'baseline:{k}']['samples_per_second']:.1f};" for k in row["fitting_baselines"]))
    print(f"  {'#':>3} {'search s':>9}  {'chosen plan':<52} {'claimed [90% interval]':>24} {'re-timed':>9} "
          f"{'|c/r-1|':>8}")  # fmt: skip
    for s in row["searches"]:
        if "error" in s:
            print(f"  {s['index']:>3} {'FAILED':>9}")
            continue
        chosen = s["chosen"] if s["chosen_baseline"] is None else f"baseline:{s['chosen_baseline']} ({s['chosen']})"
        chosen = chosen if len(chosen) <= 52 else chosen[:49] + "..."
        retimed = f"{s['retimed_ratio']:.3f}" if s["retimed_ratio"] is not None else "-"
        err = f"{s['claim_error']:.1%}" if s["claim_error"] is not None else "-"
        print(f"  {s['index']:>3} {s['search_seconds']:>9.1f}  {chosen:<52} {_claim_text(s['claimed']):>24} "
              f"{retimed:>9} {err:>8}")  # fmt: skip
    if "quiet_retimed_ratio" in row:
        print(f"  quiet calibration search's plan: re-timed ratio {row['quiet_retimed_ratio']:.3f}")


def print_summary(rows: list[dict[str, Any]]) -> None:
    print(f"\nsummary (targets: re-timed ratio >= {RETIMED_TARGET} in every search; claimed within "
          f"{CLAIM_TOLERANCE:.0%} of re-timed in >= {CLAIM_SHARE:.0%} of the searches)")  # fmt: skip
    print(f"  {'case':<8} {'budget':>6} {'searches':>8} {'choices':>7} {'worst re-timed (#)':>19} "
          f"{'median':>7} {'claimed within 5%':>18}  {'re-timed':>8} {'claimed':>8}")  # fmt: skip
    for row in rows:
        head = f"  {row['case']:<8} {row['budget_fraction']:>6.0%}"
        if "summary" not in row:
            print(f"{head}  ERROR: {row['error'].splitlines()[0]}")
            continue
        s = row["summary"]
        worst = f"{s['worst_retimed_ratio']:.3f} (#{s['worst_search']})" if s["worst_retimed_ratio"] else "-"
        median = f"{s['median_retimed_ratio']:.3f}" if s["median_retimed_ratio"] else "-"
        within = f"{s['within_5pct']}/{s['searches']} (need {s['within_5pct_needed']})"
        print(f"{head} {s['searches']:>8} {s['distinct_choices']:>7} {worst:>19} {median:>7} {within:>18}  "
              f"{'PASS' if s['pass_retimed'] else 'FAIL':>8} {'PASS' if s['pass_claimed'] else 'FAIL':>8}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.3])
    parser.add_argument("--searches", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--load", action="store_true", help="busy processes on every core for the middle of searches")
    parser.add_argument("--tiny", action="store_true", help="tiny models and batches, for smoke tests only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=("search", "retime"), help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)  # a worker's job file and output file
    args = parser.parse_args()
    if args.tiny and args.threads is None:
        # One thread: a tiny step is too short to share, and two threads on a core another job holds wait for
        # each other at every op (steps 50-100x slower), which would make the smoke test take minutes.
        args.threads = 1
    warnings.filterwarnings("ignore")
    if args.worker:
        job = json.loads(Path(args.paths[0]).read_text())
        if job.get("threads"):
            torch.set_num_threads(job["threads"])
        out = worker_search(job) if args.worker == "search" else worker_retime(job)
        Path(args.paths[1]).write_text(json.dumps(out, default=str))
        return
    out_path = args.out or RESULTS / f"repeatability{'_load' if args.load else ''}{'_tiny' if args.tiny else ''}.json"
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="repeatability-") as tmp:
        for case in args.cases:
            for budget in args.budgets:
                rows.append(run_case(case, budget, args, Path(tmp)))
    print_summary(rows)
    payload = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": args.threads or torch.get_num_threads(),
            "platform": platform.platform(),
        },
        "tiny": args.tiny,
        "note": "--tiny: shrunken models and batches, a smoke test of the protocol; its figures mean nothing"
        if args.tiny
        else None,
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "paths", "out")},
        "targets": {
            "retimed_ratio_every_search": RETIMED_TARGET,
            "claim_tolerance": CLAIM_TOLERANCE,
            "claim_share": CLAIM_SHARE,
            "load_window": LOAD_WINDOW if args.load else None,
        },  # fmt: skip
        "seconds": time.perf_counter() - started,
        "cases": rows,
    }
    try:
        import transformers

        payload["transformers"] = transformers.__version__
    except ImportError:
        pass
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwrote {out_path} ({payload['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
