"""The GPU check: lightning_ckpt on one real CUDA card, in parts, each saying what it verified.

CI has no GPU; this is what a session that is lent one runs (about 5 minutes on an H200, bf16-mixed, the
124.5M-parameter ``lightning_ckpt.testing.GPT`` at batch 32 x 1024 unless a part says otherwise). It is built
on the public API (``from lightning_ckpt import ...``); the one internal it touches is named in ``no_pruning``.
Parts, in the order they run (the ones that verify OOM fixes first):

  c0 the allocator switch (a few seconds): does ``expandable_segments`` take effect on this torch, set before CUDA
     starts (a subprocess with ``PYTORCH_CUDA_ALLOC_CONF``) and by the run-time setter (another), each read off a
     64 MiB probe's segment (``is_expandable`` in ``torch.cuda.memory_snapshot()``).
  c  OOM survival: the card made small (``set_per_process_memory_fraction``) so that no checkpointing does not
     fit: ``tune`` must record the real OOM, go on, leak nothing and keep the user's cap; whether the tuner's cap
     overrides a smaller user cap; and the tuner's own cap enforcing a budget for real (nothing pruned).
  d  offload vs none at the full batch: device memory, step time, the plan's host pool, the link measured each way
     and its bound (the pool's bytes at that rate against the step), pinned host memory kept afterwards; the time
     model's exposed transfer of ``offload`` and ``offload_input`` (predicted from the profile's link and windows)
     against the measured one (the step less the predicted compute: within 20%); and ``tune`` at 21.8 GiB (the
     midpoint of none and full in the dry run), the plan it chose side by side with none (target: 0.93x or faster),
     with each block's forward window beside the time its bytes take on the link.
  b  ``tune`` under a ``max_memory`` halfway between the full and none peaks, then the chosen plan and every
     baseline timed side by side (CUDA events, interleaved); budget violations, plans pruned although they fit,
     ``oom`` trials whose allocated peak fits (the cap limits reserved memory), the real step with AdamW state.
  a  the memory model: each baseline plan's predicted peak (the trials of a ``tune`` over those plans alone) vs
     ``torch.cuda.max_memory_allocated`` read here, outside the package; plus an fp32 control.
  g  a ``Trainer(precision="bf16-mixed")`` fit with ``ActivationCheckpointTuner`` and AdamW under the budget of (b)
     plus AdamW's state: real step peaks after lock-in vs the budget.
  f  ``ActivationCheckpointTuner(tune_micro_batch=True)``: plan and micro-batch tuned together at a fixed global
     batch, vs no checkpointing at the largest micro-batch that fits, side by side; real step peaks vs budget.
  e  ``torch.compile`` (inductor): compile seconds per trial, step time, graph breaks, recompiles.

The package's INFO log goes to this script's output (what the allocator ran under, each refused pass and its retry).
A part that ends in an error keeps the whole message and, where an allocator exists, its ``memory_stats`` figures
(retries, OOMs, inactive split bytes, reserved peak) and its largest segments.

Each part is timed and isolated (its own try/except; the allocator cap and memory are reset after it). A part
whose estimate would end past ``--time-budget`` seconds (counted from the start of the process) is skipped, and an
alarm at ``--hard-limit`` interrupts the part running then. The JSON (``--out``; default ``$OUT/gpu_check.json``
when OUT is set, else ``benchmarks/results/gpu/gpu_check.json``) is rewritten after every part, so a killed run
keeps what it measured; a table is printed at the end. A part's status is ``ok``, ``failed`` (it ran, and missed a
target: ``missed`` says which), ``error``, ``skipped`` (time budget) or ``deadline``; the exit code is 0 when every
part that ran is ``ok``.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py                # CUDA: the check itself
    python benchmarks/gpu_check.py --dry-run                         # tiny model on CPU: the code paths (CI)
    python benchmarks/gpu_check.py --parts c,b --time-budget 120     # some parts

``--dry-run`` runs every part on a tiny model on CPU. What needs CUDA (the allocator's peaks, its cap, pinned host
memory) is skipped there, and each part's ``result["needs_cuda"]`` says what and why; everything else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

T0 = time.perf_counter()  # the time budget counts from here: imports (torch, CUDA) included
GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "gpu"

# part -> (name, estimated seconds on an H200). Run in the order of --parts; the default puts the parts that verify
# the OOM fixes first (c must pass; b reports oom trials whose allocated peak fits), then the rest by importance.
PARTS: dict[str, tuple[str, float]] = {
    "c0": ("allocator_switch", 10),
    "c": ("oom_survival", 40),
    "d": ("offload", 150),
    "b": ("tuner_vs_baselines_budget", 70),
    "a": ("memory_model_vs_allocator", 45),
    "g": ("lightning_callback_e2e", 55),
    "f": ("micro_batch_joint", 60),
    "e": ("compile", 50),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU: the code paths only")
    p.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated parts, run in this order (default: %(default)s)"
    )
    p.add_argument("--time-budget", type=float, default=315.0, help="no part starts that would end after this (s)")
    p.add_argument("--hard-limit", type=float, default=340.0, help="alarm: interrupt the part running then (s)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (CUDA)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (CUDA)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--budget-frac", type=float, default=0.5,
                   help="(b, g) budget = full peak + this x (none peak - full peak), both measured here")  # fmt: skip
    p.add_argument("--trials", type=int, default=10, help="(b) n_trials")
    p.add_argument("--rounds", type=int, default=3, help="side-by-side rounds")
    p.add_argument("--compile-layers", type=int, default=4, help="(e) layers of the compiled GPT")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_check.json, else benchmarks/results/gpu/)")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.out:
    OUT_PATH = Path(ARGS.out)
elif os.environ.get("OUT"):
    OUT_PATH = Path(os.environ["OUT"]) / "gpu_check.json"
else:  # a dry run never overwrites the card's results
    OUT_PATH = RESULTS / ("gpu_check_dry_run.json" if ARGS.dry_run else "gpu_check.json")
SUMMARY: dict[str, Any] = {"script": "benchmarks/gpu_check.py", "dry_run": ARGS.dry_run, "env": {}, "parts": {}}


def elapsed() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 6 if ARGS.dry_run else 3)


def short_err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def write_summary() -> None:
    SUMMARY["elapsed_s"] = round(elapsed(), 1)
    try:
        OUT_PATH.parent.mkdir(parents=True, exist_ok=True)
        tmp = OUT_PATH.with_name(OUT_PATH.name + ".tmp")
        tmp.write_text(json.dumps(SUMMARY, indent=1, default=str))
        os.replace(tmp, OUT_PATH)
    except OSError as exc:
        print(f"could not write {OUT_PATH}: {exc}", file=sys.stderr)


def fatal(message: str) -> None:
    SUMMARY["fatal"] = message
    print(message, flush=True)
    write_summary()
    sys.exit(2)


import torch  # noqa: E402

if not ARGS.dry_run and not torch.cuda.is_available():
    fatal(
        f"CUDA is not available (torch {torch.__version__}, built with CUDA {torch.version.cuda}); this check needs "
        "an NVIDIA GPU. --dry-run runs its code paths on CPU."
    )
try:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    import lightning_ckpt
    from lightning_ckpt import ActivationCheckpointTuner, Plan, SearchHooks, TuneConfig, baselines, plan_applied, tune
    from lightning_ckpt.measure.allocator import allocator_figures, search_allocator
    from lightning_ckpt.measure.device_memory import device_memory
    from lightning_ckpt.measure.link import measure_link
    from lightning_ckpt.memory.profile import profile_step
    from lightning_ckpt.plan.format import BlockPlan
    from lightning_ckpt.plan.policies import SAVE_LISTS  # documented in the API reference
    from lightning_ckpt.testing import GPT, GPTConfig, SimulatedCard
    from lightning_ckpt.testing.allocator import AllocatorSizes
except ImportError as exc:
    fatal(
        f"lightning_ckpt not importable ({exc}): run from the repository root after `pip install -e .` (or with it on "
        "PYTHONPATH); on a torch outside the tested range set LIGHTNING_CKPT_ALLOW_UNTESTED_TORCH=1"
    )

_handler = logging.StreamHandler(sys.stdout)
_handler.setFormatter(logging.Formatter("[log] %(message)s"))
logging.getLogger("lightning_ckpt").addHandler(_handler)
logging.getLogger("lightning_ckpt").setLevel(logging.INFO)
CUDA = not ARGS.dry_run
# The dry run's card: CUDA's caching allocator (segments, splits, refusals) with its thresholds scaled to a tiny model.
DRY_SEGMENTS = AllocatorSizes.scaled(1024)
DEVICE = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
if not CUDA:
    torch.set_num_threads(1)
# The callback's own forward context under Trainer(precision="bf16-mixed"): trials run under it, and so do ours.
PRECISION = MixedPrecision("bf16-mixed", DEVICE.type).forward_context
NEEDS_CUDA = "needs CUDA (dry run on CPU)"


class Deadline(BaseException):
    """Raised by the hard alarm; a BaseException, so the package's ``except Exception`` lets it through."""


# --------------------------------------------------------------------------------------------------
# Model, batch, steps, timing
# --------------------------------------------------------------------------------------------------
def sync() -> None:
    if CUDA:
        torch.cuda.synchronize(DEVICE)


def free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def gpt_config(layers: int) -> GPTConfig:
    if ARGS.dry_run:
        return GPTConfig(n_layer=min(layers, 4), n_head=2, n_embd=32, vocab_size=64, block_size=32, dropout=0.0)
    return GPTConfig(n_layer=layers, n_head=12, n_embd=768, vocab_size=50304, block_size=ARGS.seq, dropout=0.0)


def batch_dims() -> tuple[int, int]:
    return (4, 32) if ARGS.dry_run else (ARGS.batch, ARGS.seq)


def make_batch(vocab: int, b: int, t: int, device: torch.device = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (b, t + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def make_fwd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, mixed: bool = True) -> Callable[[], Any]:
    def fwd() -> torch.Tensor:
        with PRECISION() if mixed else contextlib.nullcontext():
            return model(x, y)

    return fwd


class Shared:
    """The model and batch parts a, b, c, d, f share, and what they measure once."""

    model: Any = None
    x: Any = None
    y: Any = None
    baseline_result: Any = None  # tune() over the baselines only: predicted and measured peaks per baseline
    peaks: dict[str, int | None] | None = None  # none / full / resting, measured (uncapped) here


SHARED = Shared()


def ensure_model() -> None:
    if SHARED.model is None:
        torch.manual_seed(0)
        SHARED.model = GPT(gpt_config(ARGS.layers)).to(DEVICE)
        b, t = batch_dims()
        SHARED.x, SHARED.y = make_batch(SHARED.model.config.vocab_size, b, t)
        SHARED.peaks = None
        SUMMARY["env"]["model_params_m"] = round(sum(p.numel() for p in SHARED.model.parameters()) / 1e6, 1)
        SUMMARY["env"]["batch"] = [b, t]


def drop_model() -> None:
    SHARED.model = SHARED.x = SHARED.y = SHARED.baseline_result = SHARED.peaks = None
    free()


def time_steps(fn: Callable[[], Any], n: int, before: Callable[[], Any] | None = None) -> list[float]:
    """Milliseconds per step: CUDA events (the GPU's timeline) on CUDA, perf_counter on CPU."""
    if CUDA:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        sync()
        for start, end in events:
            if before is not None:
                before()
            start.record()
            fn()
            end.record()
        sync()
        return [start.elapsed_time(end) for start, end in events]
    out = []
    for _ in range(n):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def run_config(model: torch.nn.Module, plan: Plan, step: Callable[[], Any], n_steps: int) -> dict[str, Any]:
    """One warm-up step, then ``n_steps`` timed steps of ``plan``, uncapped; on CUDA the allocator's peak over the
    timed steps and the resting bytes before them, read here (not by the package). A CUDA OOM is recorded."""
    out: dict[str, Any] = {"status": "ok"}
    try:
        with plan_applied(model, plan, check_fingerprint=False):
            zero_grads(model)
            step()
            zero_grads(model)
            if CUDA:
                sync()
                gc.collect()
                out["resting"] = torch.cuda.memory_allocated(DEVICE)
                torch.cuda.reset_peak_memory_stats(DEVICE)
            out["ms"] = time_steps(step, n_steps, before=lambda: zero_grads(model))
            if CUDA:
                out["peak"] = torch.cuda.max_memory_allocated(DEVICE)
                out["reserved_peak"] = torch.cuda.max_memory_reserved(DEVICE)
    except torch.OutOfMemoryError as exc:
        out = {"status": "oom", "error": short_err(exc)}
    finally:
        zero_grads(model)
    if out["status"] != "ok":
        free()
    return out


def side_by_side(model: torch.nn.Module, configs: dict[str, tuple[Plan, Callable[[], Any], int, int]]) -> dict:
    """configs: name -> (plan, step, steps per round, samples per step). ``--rounds`` interleaved rounds in
    alternating order, memory read in the first. Returns name -> median ms per round, samples/s, peak."""
    times: dict[str, list[float]] = {k: [] for k in configs}
    first: dict[str, dict[str, Any]] = {}
    names = list(configs)
    for r in range(ARGS.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if first.get(name, {}).get("status", "ok") != "ok":
                continue
            plan, step, n, _ = configs[name]
            res = run_config(model, plan, step, n)
            first.setdefault(name, res)
            if res["status"] == "ok":
                times[name].append(sum(res["ms"]))
    out = {}
    for name, (_, _, n, samples) in configs.items():
        row: dict[str, Any] = {"status": first.get(name, {}).get("status", "skipped")}
        if times[name]:
            med = statistics.median(times[name])
            row.update(ms_per_round=round(med, 2), sps=round(n * samples / (med / 1000), 2),
                       spread_pct=round(100 * (max(times[name]) - min(times[name])) / med, 1))  # fmt: skip
        row["peak"] = first.get(name, {}).get("peak")
        row["reserved_peak"] = first.get(name, {}).get("reserved_peak")
        out[name] = row
    return out


def progress_printer(tag: str) -> Callable[[Any, Any], None]:
    def progress(trial: Any, budget: Any) -> None:
        sps = f"{trial.samples_per_second:.1f}/s" if trial.samples_per_second else "-"
        log(f"  {tag} #{trial.number} {trial.label[:50]:<50} {trial.status:<11} pred {gib(trial.predicted_peak_bytes)} "
            f"meas {gib(trial.peak_bytes)} GiB {sps}")  # fmt: skip

    return progress


def remaining(reserve: float = 15.0) -> float:
    return max(10.0, ARGS.time_budget - elapsed() - reserve)


def trial_rows(trials: Any) -> list[list[Any]]:
    return [[t.number, t.label[:48], str(t.status), gib(t.predicted_peak_bytes), gib(t.peak_bytes),
             round(t.samples_per_second, 2) if t.samples_per_second else None] for t in trials]  # fmt: skip


def statuses(trials: Any) -> dict[str, int]:
    return {str(k): v for k, v in Counter(str(t.status) for t in trials).items()}


def baseline_search(model: torch.nn.Module, fwd: Callable[[], Any], x: Any, y: Any) -> dict[str, Any]:
    """``tune`` over a space that holds the baseline plans (``baselines``) and nothing else, no budget given, every
    plan measured: name -> its trial, with the memory model's predicted peak and the peak the package measured.
    (The search's own baselines leave out offload, which is one of the space's "all blocks" plans here.)"""
    named = baselines(model)
    sqrt = named.get("sqrt_segments")
    space = {"modes": ["full", "offload"], "selections": ["all"], "rest_modes": [], "segments": sqrt is not None,
             "chunks": sorted(set(sqrt.segments.values())) if sqrt is not None else []}  # fmt: skip
    res = tune(model, fwd, batch_size=x.shape[0], seq_len=x.shape[1], extra_tensors=(x, y), config=TuneConfig(n_trials=len(named) + 2, search_space=space, predict_time=False, confirm_top=0, holdout_rounds=0, warmup_steps=1, measure_steps=2, count_flops=False, memory_pass="every", process_warmup_steps=1, timeout=remaining(60)))  # fmt: skip
    by_key = {t.plan.key(): t for t in res.trials}
    return {name: by_key[plan.key()] for name, plan in named.items() if plan.key() in by_key}


def ensure_peaks() -> dict[str, int | None]:
    """The none and full peaks of the shared model and batch. CUDA: the allocator's, read here, uncapped. CPU:
    the package's own figures from ``baseline_search`` (the allocator's need CUDA)."""
    ensure_model()
    if SHARED.peaks is None:
        model, fwd = SHARED.model, make_fwd(SHARED.model, SHARED.x, SHARED.y)
        if CUDA:
            none = run_config(model, Plan(), lambda: fwd().backward(), 1)
            full = run_config(model, baselines(model)["full"], lambda: fwd().backward(), 1)
            peaks = {"none": none.get("peak"), "full": full.get("peak"), "resting": none.get("resting")}
        else:
            SHARED.baseline_result = SHARED.baseline_result or baseline_search(model, fwd, SHARED.x, SHARED.y)
            found = SHARED.baseline_result
            peaks = {"none": found["none"].peak_bytes, "full": found["full"].peak_bytes, "resting": None}
        SHARED.peaks = peaks
    return SHARED.peaks


# --------------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------------
def part_a() -> dict[str, Any]:
    ensure_model()
    model, x, y = SHARED.model, SHARED.x, SHARED.y
    fwd = make_fwd(model, x, y)
    t0 = time.perf_counter()
    SHARED.baseline_result = SHARED.baseline_result or baseline_search(model, fwd, x, y)
    out: dict[str, Any] = {"search_s": round(time.perf_counter() - t0, 1)}
    rows: dict[str, Any] = {}
    for name, trial in SHARED.baseline_result.items():
        row: dict[str, Any] = {"status": str(trial.status), "pred_gib": gib(trial.predicted_peak_bytes),
                               "package_meas_gib": gib(trial.peak_bytes)}  # fmt: skip
        if CUDA:  # the allocator's reading, outside the package (uncapped): what the prediction is judged against
            r = run_config(model, trial.plan, lambda: fwd().backward(), 2)
            row.update(meas_gib=gib(r.get("peak")), reserved_gib=gib(r.get("reserved_peak")),
                       ms=round(statistics.median(r["ms"]), 1) if r.get("ms") else None)  # fmt: skip
            truth = r.get("peak")
        else:
            truth = trial.peak_bytes
        if truth and trial.predicted_peak_bytes:
            row["err_pct"] = round(100 * (trial.predicted_peak_bytes / truth - 1), 2)
        rows[name] = row
        log(f"(a) {name:<18} {row}")
    out["plans"] = rows
    errs = {k: abs(v["err_pct"]) for k, v in rows.items() if "err_pct" in v}
    out["max_abs_err_pct"] = max(errs.values()) if errs else None
    out["over_10pct"] = sorted(k for k, v in errs.items() if v > 10)
    if not CUDA:
        out["needs_cuda"] = {"allocator_peaks": f"{NEEDS_CUDA}: err_pct compares with the package's tracked figure"}
    free()
    # fp32 control at a small batch: the same prediction without autocast, to tell precision effects from the rest.
    if elapsed() + 30 < ARGS.time_budget or ARGS.dry_run:
        bc = max(1, x.shape[0] // 8)
        xc, yc = x[:bc], y[:bc]
        fwd32 = make_fwd(model, xc, yc, mixed=False)
        res32 = baseline_search(model, fwd32, xc, yc)
        ctrl: dict[str, Any] = {"batch": bc}
        for name in ("none", "full", "selective_mlp", "ops_save_matmuls"):
            trial = res32.get(name)
            if trial is None or not trial.predicted_peak_bytes:
                continue
            truth = (
                run_config(model, trial.plan, lambda: fwd32().backward(), 1).get("peak") if CUDA else trial.peak_bytes
            )
            if truth:
                ctrl[name] = round(100 * (trial.predicted_peak_bytes / truth - 1), 2)
        out["fp32_control_err_pct"] = ctrl
        log(f"(a) fp32 control err%: {ctrl}")
        free()
    return out


def part_b() -> dict[str, Any]:
    ensure_model()
    model, x, y = SHARED.model, SHARED.x, SHARED.y
    b, t = batch_dims()
    fwd = make_fwd(model, x, y)
    peaks = ensure_peaks()
    none_peak, full_peak = peaks["none"], peaks["full"]
    budget = int(full_peak + ARGS.budget_frac * (none_peak - full_peak))
    out: dict[str, Any] = {"budget_gib": gib(budget), "none_peak_gib": gib(none_peak), "full_peak_gib": gib(full_peak),
                           "resting_gib": gib(peaks["resting"])}  # fmt: skip
    log(f"(b) budget {gib(budget)} GiB (none peak {gib(none_peak)}, full peak {gib(full_peak)})")
    res = tune(model, fwd, max_memory=budget, batch_size=b, seq_len=t, extra_tensors=(x, y), config=TuneConfig(n_trials=ARGS.trials, warmup_steps=1, measure_steps=2, count_flops=False, confirm_top=2, timeout=min(120.0, remaining(150)), process_warmup_steps=1), hooks=SearchHooks(progress=progress_printer("(b)")))  # fmt: skip
    tuned = res.best
    out.update(chosen=tuned.describe(), fell_back=res.fell_back, tuning_s=round(res.tuning_seconds, 1),
               budget=res.budget.description, statuses=statuses(res.trials),
               trials=trial_rows([tr for tr in res.trials if tr.status != "pruned"]),
               pruned_baselines=sorted(n for n, tr in res.baselines.items() if tr.status == "pruned"))  # fmt: skip
    ok_over = [tr.label for tr in res.trials if tr.status == "ok" and (tr.peak_bytes or 0) > budget]

    # Side by side: the chosen plan and every baseline, interleaved, uncapped (to see the real peaks).
    step = lambda: fwd().backward()  # noqa: E731
    base = baselines(model)
    same_as = next((n for n, p in base.items() if p.key() == tuned.key()), None)
    configs: dict[str, tuple[Plan, Callable[[], Any], int, int]] = {} if same_as else {"tuned": (tuned, step, 2, b)}
    configs.update({n: (p, step, 1 if n == "offload" else 2, b) for n, p in base.items()})
    sbs = side_by_side(model, configs)
    if not CUDA:  # no allocator: whether a plan fits is the package's own figure
        found = {n: tr.peak_bytes for n, tr in res.baselines.items()}
        found["tuned"] = res.best_trial.peak_bytes if res.best_trial is not None else None
        for name, row in sbs.items():
            row["peak"] = found.get(name)
        out["needs_cuda"] = {"allocator_peaks": f"{NEEDS_CUDA}: 'fits' uses the package's tracked figures"}
    for row in sbs.values():
        row["fits"] = row["peak"] is not None and row["peak"] <= budget
        row["peak_gib"], row["reserved_gib"] = gib(row.pop("peak")), gib(row.pop("reserved_peak"))
    fitting = {n: r for n, r in sbs.items() if n != "tuned" and r["fits"] and r.get("sps")}
    best_base = max(fitting, key=lambda n: fitting[n]["sps"]) if fitting else None
    tuned_row = sbs[same_as or "tuned"]
    out.update(side_by_side=sbs, tuned_is_baseline=same_as, best_fitting_baseline=best_base)
    if best_base and tuned_row.get("sps"):
        out["tuned_over_best_fitting_baseline"] = round(tuned_row["sps"] / fitting[best_base]["sps"], 3)
    if tuned_row.get("sps") and sbs.get("full", {}).get("sps"):
        out["tuned_over_full"] = round(tuned_row["sps"] / sbs["full"]["sps"], 3)
    out["violations"] = len(ok_over) + (0 if tuned_row["fits"] else 1)
    out["ok_trials_over_budget"] = ok_over
    # Plans the memory model pruned although they fit when run (baselines: those are re-measured above).
    out["pruned_but_fit"] = sorted(n for n in out["pruned_baselines"] if sbs.get(n, {}).get("fits"))
    # "oom" trials whose allocated peak fits (the cap limits reserved memory): each re-run once, uncapped.
    false_oom = []
    for tr in res.trials:
        if tr.status == "oom" and (elapsed() + 20 < ARGS.time_budget or ARGS.dry_run):
            r = run_config(model, tr.plan, step, 1)
            if r["status"] == "ok" and CUDA and r["peak"] <= budget:
                false_oom.append([tr.label[:48], gib(r["peak"]), gib(r.get("reserved_peak"))])
    out["oom_but_allocated_fits"] = false_oom
    # The real training step of the chosen plan once AdamW state exists (lr=0: the weights do not change). The search
    # above had no optimizer, so its budget holds no AdamW state: this shows by how much a real step goes past it
    # (part g searches with the optimizer).
    out["adamw_state_gib"] = gib(adamw_state_bytes(model))
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        with plan_applied(model, tuned, check_fingerprint=False):
            for i in range(3):
                if i == 2 and CUDA:
                    sync()
                    torch.cuda.reset_peak_memory_stats(DEVICE)
                fwd().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        if CUDA:
            sync()
            peak = torch.cuda.max_memory_allocated(DEVICE)
            out.update(train_step_peak_gib=gib(peak), train_step_over_budget=peak > budget)
        del opt
    except torch.OutOfMemoryError as exc:
        out["train_step_error"] = short_err(exc)
    zero_grads(model)
    free()
    return out


@contextlib.contextmanager
def no_pruning() -> Iterator[None]:
    """``tune`` with a memory model that predicts every plan fits, so plans over the card or the budget really run
    (and meet the allocator's cap). The one internal this check touches: the real-step memory model ``tune`` builds
    (``lightning_ckpt.search.tune.RealStepMemory``); when it moves, part c fails in the dry run's test."""
    import lightning_ckpt.search.tune as tune_module

    real = tune_module.RealStepMemory

    class NoPrune(real):  # type: ignore[misc, valid-type]
        def predict(self, plan: Any) -> tuple[int, int]:
            return 0, 0

    tune_module.RealStepMemory = NoPrune
    try:
        yield
    finally:
        tune_module.RealStepMemory = real


class CudaCard:
    """The CUDA allocator in the terms of ``lightning_ckpt.testing.SimulatedCard`` (which stands in for it in the
    dry run): the card's size, the per-process cap (``set_per_process_memory_fraction``), the allocated bytes."""

    def __init__(self) -> None:
        self.total_bytes = torch.cuda.get_device_properties(DEVICE).total_memory

    def __enter__(self) -> CudaCard:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def get_fraction(self) -> float:
        return torch.cuda.get_per_process_memory_fraction(DEVICE)

    def set_fraction(self, fraction: float) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, DEVICE)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(DEVICE)


def on_card(card: Any, res: Any, model: torch.nn.Module, step: Callable[[], Any], alloc0: int) -> dict[str, Any]:
    """A search on the card: what its trials did, whether the plan it chose runs a step under the card's cap, and
    what it left allocated."""
    trials = list(res.trials)
    first_oom = next((tr.number for tr in trials if tr.status == "oom"), None)
    none = res.baselines.get("none")
    chosen = run_config(model, res.best, step, 1)  # under the cap, as a real step after lock-in
    gc.collect()
    return {
        "trials": [[tr.label[:40], str(tr.status)] for tr in trials if tr.status != "pruned"],
        "statuses": statuses(trials), "budget": res.budget.description,
        "real_oom_recorded": any(tr.status == "oom" and "OutOfMemoryError" in (tr.error or "") for tr in trials),
        "search_continued": first_oom is not None and any(tr.number > first_oom for tr in trials),
        "none_status": str(none.status) if none is not None else None,
        "chosen": res.best.describe(), "fell_back": res.fell_back, "chosen_step_on_card": chosen["status"],
        "grads_none_after": all(p.grad is None for p in model.parameters()),
        "alloc_delta_mib": round((card.allocated() - alloc0) / 2**20, 3),
    }  # fmt: skip


def part_c() -> dict[str, Any]:
    """The card made small: its cap halfway between the full and none peaks of a step, so no checkpointing does not
    fit. On CUDA the cap is ``set_per_process_memory_fraction``; in the dry run a ``SimulatedCard`` on CPU raises
    the same ``torch.OutOfMemoryError`` past it, and the package reads its memory from it as from CUDA's allocator."""
    ensure_model()
    model, x, y = SHARED.model, SHARED.x, SHARED.y
    fwd = make_fwd(model, x, y)
    step = lambda: fwd().backward()  # noqa: E731
    if CUDA:
        peaks, card = dict(ensure_peaks()), CudaCard()
        free()  # the cold reserved peak of full: what the card must hold beside the allocated peak
        cold = run_config(model, baselines(model)["full"], step, 1)
        peaks["full_reserved"] = cold.get("reserved_peak")
    else:
        peaks = {}
        for name in ("none", "full"):
            with SimulatedCard(2**40, resident=(model, x, y), segments=DRY_SEGMENTS) as big:
                big.empty_cache()
                big.reset_peak()
                run_config(model, baselines(model)[name], step, 1)
                peaks[name], peaks[f"{name}_reserved"] = big.max_allocated(), big.max_reserved()
        # As the H200 on torch 2.11 was: a run-time switch of expandable segments that does nothing.
        card = SimulatedCard(4 * peaks["none"], resident=(model, x, y), segments=DRY_SEGMENTS, runtime_switch=False)
    small = int(peaks["full"] + 0.5 * (peaks["none"] - peaks["full"]))
    space = {"modes": ["full", "selective:mlp"], "selections": ["all"], "segments": True}
    warm = 0 if ARGS.dry_run else 1  # the simulated card's dispatch mode makes every CPU step slow; no timing matters
    settings = dict(search_space=space, confirm_top=0, holdout_rounds=0, warmup_steps=warm, measure_steps=1,
                    count_flops=False, process_warmup_steps=warm)  # fmt: skip
    full_reserved = peaks.get("full_reserved")
    out: dict[str, Any] = {
        "card_gib": gib(small),
        "none_peak_gib": gib(peaks["none"]),
        "full_peak_gib": gib(peaks["full"]),
        # From a cold cache, as every pass of the search starts: what full checkpointing reserves beside what it
        # allocates, and the room the card leaves the search above that (negative: full alone would be refused).
        "full_reserved_peak_gib": gib(full_reserved),
        "headroom_gib": gib(small - full_reserved) if full_reserved is not None else None,
    }
    if not CUDA:
        out["simulated"] = f"SimulatedCard on CPU ({NEEDS_CUDA} for the real allocator)"
    with card:
        prev = card.get_fraction()
        try:
            free()
            alloc0 = card.allocated()
            card.set_fraction(small / card.total_bytes)
            # c1: the search as a user runs it on the small card (no budget: the card's own).
            res = tune(
                model,
                fwd,
                extra_tensors=(x, y),
                config=TuneConfig(n_trials=4, timeout=remaining(60), **settings),
                hooks=SearchHooks(progress=progress_printer("(c1)")),
            )
            out["c1_small_card"] = on_card(card, res, model, step, alloc0)
            out["allocator_regime"] = res.best.metadata.get("allocator")
            out["allocator_after_c1"] = allocator_figures(device_memory(DEVICE))
            # c2: the same with nothing pruned, so plans that do not fit the card run and run out of memory for real;
            # the tuner's cap must not lift the user's ('none' is not ok), and the search must go on.
            with no_pruning():
                res = tune(
                    model,
                    fwd,
                    extra_tensors=(x, y),
                    config=TuneConfig(n_trials=3, timeout=remaining(50), **settings),
                    hooks=SearchHooks(progress=progress_printer("(c2)")),
                )
            out["c2_small_card_unpruned"] = on_card(card, res, model, step, alloc0)
            out["c2_fraction_kept"] = abs(card.get_fraction() - small / card.total_bytes) < 1e-9
            # c3: the user's cap back; the tuner's own cap enforces the budget for real (nothing pruned).
            card.set_fraction(prev)
            free()
            with no_pruning():
                res = tune(model, fwd, max_memory=small, extra_tensors=(x, y), config=TuneConfig(n_trials=3, timeout=remaining(40), **settings), hooks=SearchHooks(progress=progress_printer("(c3)")))  # fmt: skip
            out["c3_tuner_cap"] = on_card(card, res, model, step, alloc0)
            out["c3_over_budget_not_ok"] = not any(
                tr.status == "ok" and (tr.peak_bytes or 0) > small for tr in res.trials
            )
            out["c3_fraction_restored"] = abs(card.get_fraction() - prev) < 1e-9
        finally:
            card.set_fraction(prev)
            free()
    return out


_PROBE = """
import json, os, sys, torch
runtime = sys.argv[1] == "runtime"
if runtime:
    torch.empty(1, device="cuda")  # CUDA has started, as in a fit by the time the search runs
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
probe = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
ptr = probe.data_ptr()
seg = next((s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"]), {})
print(json.dumps({"is_expandable": seg.get("is_expandable"), "segment_bytes": seg.get("total_size")}))
"""


def part_c0() -> dict[str, Any]:
    """Whether ``expandable_segments`` takes effect on this torch, both ways of setting it, read off a probe's segment:
    set in the environment before CUDA starts, and by the run-time setter after it started (on torch 2.11 the setter
    did nothing, and nothing checked). Each in a fresh process, so this process's allocator stays as the user's."""
    out: dict[str, Any] = {}
    if CUDA:
        for way, env in (("environment", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}), ("runtime", {})):
            child_env = {
                k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
            }
            done = subprocess.run([sys.executable, "-c", _PROBE, way], env={**child_env, **env}, capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
            lines = done.stdout.strip().splitlines()
            out[way] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-600:]}
        out["this_process"] = {
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
        }
    else:  # the simulated card: configured when it starts, and a run-time switch that does nothing (as on torch 2.11)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        try:
            with SimulatedCard(2**30, segments=DRY_SEGMENTS, expandable=None) as card:
                out["environment"] = {"is_expandable": card.expandable_in_effect()}
        finally:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        with SimulatedCard(2**30, segments=DRY_SEGMENTS, runtime_switch=False), search_allocator(DEVICE) as regime:
            out["runtime"] = {"is_expandable": regime.expandable_segments, "how": regime.how}
        out["needs_cuda"] = {"allocator": f"{NEEDS_CUDA}: the simulated card's allocator stands in for CUDA's"}
    out["environment_takes_effect"] = bool(out["environment"].get("is_expandable"))
    out["runtime_switch_takes_effect"] = bool(out["runtime"].get("is_expandable"))
    log(f"(c0) expandable segments: environment {out['environment']}, run-time switch {out['runtime']}")
    return out


def part_d() -> dict[str, Any]:
    """Offload against none on the part-c model at its full batch: device memory, step time, the host pool (one per
    plan, reused every step), the link measured each way with pinned copies, and the link's bound: how long the bytes
    the pool took would take to move at that rate, against the step's own time. In the dry run the same pool runs
    stream-free on a simulated card (the card's memory, not the link)."""
    ensure_model()
    model, x, y = SHARED.model, SHARED.x, SHARED.y
    fwd = make_fwd(model, x, y)
    step = lambda: fwd().backward()  # noqa: E731
    base = baselines(model)
    out: dict[str, Any] = {"batch": x.shape[0]}

    def host() -> dict[str, Any]:
        if not CUDA:
            return {}
        s = torch.cuda.host_memory_stats()
        return {"pinned_gib": gib(s.get("allocated_bytes.current", 0)),
                "pinned_active_gib": gib(s.get("active_bytes.current", 0))}  # fmt: skip

    link = measure_link(DEVICE)
    out["link_gb_s"] = (
        {"to_host": round(link.to_host / 1e9, 2), "to_device": round(link.to_device / 1e9, 2)} if link else None
    )
    out["host_before"] = host()
    card = contextlib.nullcontext() if CUDA else SimulatedCard(2**40, resident=(model, x, y))
    base["offload_input"] = Plan({fqn: BlockPlan("offload_input") for fqn in base["full"].blocks})
    with card:
        for name in ("none", "offload", "offload_input"):
            free()
            r = run_config(model, base[name], step, 2)
            # What the step adds to the device above the resting state: activations, gradients, temporaries.
            added = r["peak"] - r["resting"] if CUDA and r["status"] == "ok" else None
            out[name] = {"status": r["status"], "peak_gib": gib(r.get("peak")), "step_memory_gib": gib(added),
                         "ms": round(statistics.median(r["ms"]), 1) if r.get("ms") else None}  # fmt: skip
            log(f"(d) {name}: {out[name]}")
        with plan_applied(model, base["offload"], check_fingerprint=False) as handle:
            if (
                not CUDA and handle.offload_pool is not None
            ):  # the dry run's tensors are all smaller than a copy's worth
                handle.offload_pool.min_bytes = 1024
            zero_grads(model)
            step()  # one more step, read through the plan's pool
            zero_grads(model)
            pool = handle.offload_pool.stats() if handle.offload_pool is not None else None
    if pool is not None:
        out["pool"] = {"capacity_gib": gib(pool.capacity_bytes), "offloaded_gib_per_step": gib(pool.peak_bytes),
                       "tensors": pool.offloaded_tensors, "prefetched": pool.prefetched_tensors, "chunks": pool.chunks}  # fmt: skip
    if link is not None and pool is not None and out["none"]["ms"]:
        # The link's bound: each way, the pool's bytes at the measured rate, against the plain step's time.
        out_ms, back_ms = (1000 * link.seconds(pool.peak_bytes, to_host=way) for way in (True, False))
        out["link_bound"] = {"to_host_ms": round(out_ms, 1), "to_device_ms": round(back_ms, 1),
                             "none_step_ms": out["none"]["ms"],
                             "transfer_over_step": round((out_ms + back_ms) / out["none"]["ms"], 2)}  # fmt: skip
    if out["none"]["step_memory_gib"] and out["offload"]["step_memory_gib"] is not None:
        out["offload_step_memory_ratio"] = round(out["offload"]["step_memory_gib"] / out["none"]["step_memory_gib"], 3)
    if out["none"]["ms"] and out["offload"]["ms"]:
        out["offload_time_ratio"] = round(out["offload"]["ms"] / out["none"]["ms"], 2)
    free()  # what the package does after every trial (gc, empty_cache)
    out["host_after_trial_release"] = host()
    from lightning_ckpt.search.runners import release_cached_memory  # what tune() runs when the search ends

    release_cached_memory(DEVICE)
    out["host_after_search_release"] = host()  # target: pinned back to 0 (issue 48 item 5)
    out["space_has_offload"] = "offload" in TuneConfig().search_space.for_device(DEVICE.type).modes
    out.update(offload_prediction(model, fwd, x, y, base, out))
    out.update(offload_search(model, fwd, x, y, step))
    if not CUDA:
        out["needs_cuda"] = {
            "memory": f"{NEEDS_CUDA}: the link, device and pinned host memory; the pool on a simulated card",
            "exposed": f"{NEEDS_CUDA}: no link to measure, so no transfer to predict",
        }
    return out


def offload_prediction(model: Any, fwd: Any, x: Any, y: Any, base: dict[str, Plan], d: dict[str, Any]) -> dict:
    """The time model's exposed transfer (``TimeModel.transfer``: the profile's link and each block's windows) of the
    offloading baselines, against the measured one: each plan's measured step less its predicted compute (the plain
    step fitted to none's measured time, plus the recompute). Per block: its forward window and what it moves."""
    card = contextlib.nullcontext() if CUDA else SimulatedCard(2**40, resident=(model, x, y))
    with card:
        timing = profile_step(model, fwd, extra=(x, y), time_blocks={"full", "offload", "offload_input"}).time
    if timing is None or not d["none"]["ms"]:
        return {"exposed": None}
    timing = timing.calibrated([(Plan(), "none", d["none"]["ms"] / 1000)])
    row = timing.blocks[0]
    out: dict[str, Any] = {"link_measured": timing.measured_at.get("link"), "block_window_ms": {
        "forward": round(1000 * row.seconds.get("forward", 0.0), 2),
        "backward": round(1000 * (row.seconds["none"] - row.seconds.get("forward", 0.0)), 2)},
        "block_moves_gib": {k: gib(v) for k, v in row.offloaded_bytes.items()}, "exposed": {}}  # fmt: skip
    for name in ("offload", "offload_input"):
        moves, predicted, measured = timing.transfer(base[name]), timing.predict_seconds(base[name]), d[name]["ms"]
        if moves is None or predicted is None or not measured:
            out["exposed"][name] = None  # no link (the dry run), or the plan did not run
            continue
        seen = measured / 1000 - (predicted - moves.exposed_seconds)
        out["exposed"][name] = {"predicted_ms": round(1000 * moves.exposed_seconds, 1), "measured_ms": round(1000 * seen, 1),
                                "link_ms": round(1000 * moves.link_seconds, 1), "recompute_saved_ms": round(1000 * moves.recompute_seconds, 1),
                                "within_20pct": abs(moves.exposed_seconds - seen) <= 0.2 * max(seen, 1e-3)}  # fmt: skip
        log(f"(d) {name}: exposed transfer {out['exposed'][name]}")
    return out


def offload_search(model: Any, fwd: Any, x: Any, y: Any, step: Any) -> dict[str, Any]:
    """``tune`` at 21.8 GiB (the issue's budget on the H200; in the dry run the midpoint of none and full), the
    offloading modes in its space, then the chosen plan side by side with none: its speed over no checkpointing."""
    peaks = ensure_peaks()
    budget = int(21.8 * GIB) if CUDA else int((peaks["none"] + peaks["full"]) / 2)
    b, t = batch_dims()
    res = tune(model, fwd, max_memory=budget, batch_size=b, seq_len=t, extra_tensors=(x, y), config=TuneConfig(n_trials=ARGS.trials, warmup_steps=1, measure_steps=2, count_flops=False, confirm_top=2, timeout=min(120.0, remaining(60)), process_warmup_steps=1), hooks=SearchHooks(progress=progress_printer("(d)")))  # fmt: skip
    sbs = side_by_side(model, {"none": (Plan(), step, 2, b), "tuned": (res.best, step, 2, b)})
    out: dict[str, Any] = {"tune_budget_gib": gib(budget), "tuned": res.best.describe(), "tuned_statuses": statuses(res.trials),
                           "offload_trials": [[t.label[:48], str(t.status), t.pruned_by] for t in res.trials if "offload" in t.label],
                           "tuned_offload": res.best.metadata.get("measured", {}).get("offload")}  # fmt: skip
    if sbs["none"].get("sps") and sbs["tuned"].get("sps"):
        out["tuned_over_none"] = round(sbs["tuned"]["sps"] / sbs["none"]["sps"], 3)
    log(f"(d) tune at {gib(budget)} GiB chose {out['tuned']}: {out.get('tuned_over_none')}x none")
    return out


class LitGPT(L.LightningModule):
    """The shared GPT as a LightningModule; ``batch_size`` and ``train_dataloader`` for the micro-batch search."""

    def __init__(self, layers: int, data: Any = None, batch_size: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(gpt_config(layers))
        self.data = data
        self.batch_size = batch_size

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        xb, yb = batch
        return self.model(xb, yb)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)


class PeakRecorder(L.Callback):
    """The allocator's peak of each real training step from the second on (CUDA)."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= 1 and CUDA:
            sync()
            torch.cuda.reset_peak_memory_stats(DEVICE)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= 1 and CUDA:
            sync()
            self.peaks.append(torch.cuda.max_memory_allocated(DEVICE))


def fit(
    lit: LitGPT, tuner: ActivationCheckpointTuner, *, steps: int, accumulate: int = 1
) -> tuple[PeakRecorder, float]:
    recorder = PeakRecorder()
    trainer = L.Trainer(accelerator="gpu" if CUDA else "cpu", devices=1, precision="bf16-mixed", max_steps=steps,
                        accumulate_grad_batches=accumulate, callbacks=[tuner, recorder], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tempfile.mkdtemp(prefix="gpu_check_"))  # fmt: skip
    t0 = time.perf_counter()
    trainer.fit(lit)
    return recorder, round(time.perf_counter() - t0, 1)


def adamw_state_bytes(model: torch.nn.Module) -> int:
    """What AdamW adds to a step that tune() without an optimizer does not see: two fp32 moments per parameter."""
    return 2 * sum(p.numel() * 4 for p in model.parameters())


def part_g() -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    drop_model()  # the budget below is about this run alone
    b, t = batch_dims()
    lit = LitGPT(ARGS.layers).to(DEVICE)
    x, y = make_batch(lit.model.config.vocab_size, b * 4, t, torch.device("cpu"))
    lit.data, lit.batch_size = TensorDataset(x, y), b
    needs: dict[str, str] = {}
    if CUDA:  # as in (b), measured on this model: full peak + frac x (none peak - full peak), plus AdamW's state
        xb, yb = x[:b].to(DEVICE), y[:b].to(DEVICE)
        step = lambda: make_fwd(lit.model, xb, yb)().backward()  # noqa: E731
        none, full = (run_config(lit.model, baselines(lit.model)[n], step, 1) for n in ("none", "full"))
        del xb, yb, step
        free()
        budget = int(full["peak"] + ARGS.budget_frac * (none["peak"] - full["peak"])) + adamw_state_bytes(lit.model)
        tuner_budget: dict[str, Any] = {"max_memory": budget}
    else:
        budget, tuner_budget = None, {"activation_budget": ARGS.budget_frac}
        needs["budget"] = f"{NEEDS_CUDA}: a peak budget in bytes; activation_budget={ARGS.budget_frac} instead"
        needs["step_peaks"] = f"{NEEDS_CUDA}: the allocator's peak of each real step"
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    search = dict(n_trials=4, measure_steps=1, warmup_steps=1, timeout=min(90.0, remaining(60)))
    tuner = ActivationCheckpointTuner(**tuner_budget, plan_path=tmp / "plan.json", log_dir=tmp / "tb", search=search)
    recorder, fit_s = fit(lit, tuner, steps=3)
    result = tuner.result
    out: dict[str, Any] = {"budget_gib": gib(budget), "fit_s": fit_s, "plan": tuner.plan.describe() if tuner.plan else None,
                           "statuses": statuses(result.trials) if result else None,
                           "tuning_s": round(result.tuning_seconds, 1) if result else None,
                           "plan_file_written": (tmp / "plan.json").exists()}  # fmt: skip
    if result is not None and result.best_trial is not None:
        out["chosen_trial_peak_gib"] = gib(result.best_trial.peak_bytes)
        out["verdict"] = result.best.metadata.get("search", {}).get("verdict")
    if recorder.peaks:
        out["train_step_peaks_gib"] = [gib(p) for p in recorder.peaks]
        out["train_step_over_budget"] = budget is not None and max(recorder.peaks) > budget
    if needs:
        out["needs_cuda"] = needs
    return out  # its locals (the model, the batch) go with it; run_part frees the cache


def part_f() -> dict[str, Any]:
    from torch.utils.data import TensorDataset

    drop_model()
    g, t = batch_dims()
    base = max(1, g // 4)  # the user's micro-batch; accumulation g // base keeps the global batch g
    lit = LitGPT(ARGS.layers).to(DEVICE)
    x, y = make_batch(lit.model.config.vocab_size, g * 2, t, torch.device("cpu"))
    lit.data, lit.batch_size = TensorDataset(x, y), base
    sizes = [m for m in (base // 2, base, base * 2, g) if m >= 1 and g % m == 0]
    out: dict[str, Any] = {"global": g, "user_micro_batch": base}
    adam = adamw_state_bytes(lit.model)
    none_peak: dict[int, int | None] = {}
    if CUDA:
        # Measured (uncapped) none peaks per micro-batch, and full at twice the user's: a budget where none fits at
        # the user's micro-batch but not at twice it, where full checkpointing does (when it can).
        xs, ys = x[:g].to(DEVICE), y[:g].to(DEVICE)
        for m in sizes:
            r = run_config(lit.model, Plan(), lambda m=m: make_fwd(lit.model, xs[:m], ys[:m])().backward(), 1)
            none_peak[m] = r.get("peak")
        up = min((m for m in sizes if m > base), default=None)
        full_up = None
        if up is not None:
            r = run_config(lit.model, baselines(lit.model)["full"],
                           lambda: make_fwd(lit.model, xs[:up], ys[:up])().backward(), 1)  # fmt: skip
            full_up = r.get("peak")
        lo = max(none_peak[base] * 1.05, (full_up or 0) * 1.05)
        hi = none_peak[up] * 0.97 if up is not None and none_peak.get(up) else lo
        budget = int((lo + hi) / 2 if lo < hi else lo) + adam
        fits = [m for m in sizes if none_peak[m] is not None and none_peak[m] + adam <= budget]
        m_ref = max(fits) if fits else base
        tuner_budget: dict[str, Any] = {"max_memory": budget}
        out.update(budget_gib=gib(budget), none_peak_gib={m: gib(v) for m, v in none_peak.items()},
                   full_peak_gib_at_2x=gib(full_up), adamw_state_gib=gib(adam))  # fmt: skip
        del xs, ys
        free()
    else:
        budget, m_ref, tuner_budget = None, base, {"activation_budget": 0.6}
        out["needs_cuda"] = {"budget": f"{NEEDS_CUDA}: a peak budget from the allocator; activation_budget=0.6 instead",
                             "step_peaks": f"{NEEDS_CUDA}: the allocator's peak of each real step"}  # fmt: skip
    out["ref_micro_batch"] = m_ref
    log(f"(f) budget {gib(budget)} GiB; none fits up to micro-batch {m_ref} (measured)")
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    search = dict(n_trials=8, measure_steps=2, warmup_steps=1, confirm_rounds=2, confirm_max_rounds=4,
                  holdout_rounds=2, holdout_max_rounds=4, timeout=min(90.0, remaining(60)))  # fmt: skip
    tuner = ActivationCheckpointTuner(**tuner_budget, tune_micro_batch=True, plan_path=tmp / "plan.json", search=search)
    recorder, fit_s = fit(lit, tuner, steps=2, accumulate=g // base)
    lit.to(DEVICE)  # Lightning's teardown moves the module back to the CPU
    result, spec = tuner.result, tuner.micro_batch or {}
    chosen = tuner.plan or Plan()
    out.update(fit_s=fit_s, chosen=chosen.describe(), chosen_micro_batch=spec.get("size"),
               accumulation=spec.get("accumulation"), statuses=statuses(result.trials) if result else None,
               tuning_s=round(result.tuning_seconds, 1) if result else None)  # fmt: skip
    none_status: dict[int, str] = {}
    for tr in result.trials if result else ():
        if tr.plan.is_empty and tr.micro_batch is not None:
            none_status.setdefault(int(tr.micro_batch), str(tr.status))
    out["none_status_per_micro_batch"] = none_status
    out["none_pruned_but_fits"] = sorted(m for m, s in none_status.items() if s == "pruned" and m <= m_ref and CUDA)
    if recorder.peaks:
        out["train_step_peaks_gib"] = [gib(p) for p in recorder.peaks]
        out["train_step_over_budget"] = budget is not None and max(recorder.peaks) > budget
    # Side by side, per global batch: no checkpointing at the largest micro-batch that fits vs the tuned pair.
    mt = int(spec.get("size") or base)
    xs, ys = x[:g].to(DEVICE), y[:g].to(DEVICE)
    configs = {
        "ref_none": (Plan(), lambda: make_fwd(lit.model, xs[:m_ref], ys[:m_ref])().backward(), g // m_ref, m_ref)
    }
    identical = chosen.is_empty and mt == m_ref
    if not identical:
        configs["tuned"] = (chosen, lambda: make_fwd(lit.model, xs[:mt], ys[:mt])().backward(), g // mt, mt)
    sbs = side_by_side(lit, configs)  # the callback's plan names blocks from the LightningModule (model.transformer...)
    for row in sbs.values():
        row["fits"] = None if budget is None or row["peak"] is None else row["peak"] + adam <= budget
        row["peak_gib"] = gib(row.pop("peak"))
        row.pop("reserved_peak")
    out["side_by_side"] = sbs
    if identical:
        out["ratio_tuned_vs_none"], out["ratio_note"] = 1.0, "the tuner chose none at the reference micro-batch"
    elif sbs["tuned"].get("sps") and sbs["ref_none"].get("sps"):
        out["ratio_tuned_vs_none"] = round(sbs["tuned"]["sps"] / sbs["ref_none"]["sps"], 3)
    return out  # its locals (the model, the batch) go with it; run_part frees the cache


def part_e() -> dict[str, Any]:
    drop_model()
    b, t = batch_dims()
    bc = max(1, b // 4)
    torch.manual_seed(0)
    model = GPT(gpt_config(ARGS.compile_layers)).to(DEVICE)
    xc, yc = make_batch(model.config.vocab_size, bc, t)
    backend = "inductor" if CUDA else "aot_eager"  # aot_eager: no C++ compiler needed for the dry run
    out: dict[str, Any] = {"layers": model.config.n_layer, "batch": bc, "backend": backend}
    eager = run_config(model, Plan(), lambda: make_fwd(model, xc, yc)().backward(), 3)
    out["eager_none_ms"] = round(statistics.median(eager["ms"]), 2) if eager.get("ms") else eager["status"]
    compiled = torch.compile(model, backend=backend)
    space = {"modes": ["full"], "selections": ["all"], "segments": False, "baselines": False, "compile_budgets": [0.5]}
    res = tune(compiled, make_fwd(compiled, xc, yc), batch_size=bc, seq_len=t, extra_tensors=(xc, yc), config=TuneConfig(n_trials=3, search_space=space, confirm_top=0, warmup_steps=1, measure_steps=3, count_flops=False, process_warmup_steps=1, timeout=remaining(30)), hooks=SearchHooks(progress=progress_printer("(e)")))  # fmt: skip
    rows = []
    for tr in res.trials:
        c = tr.extra.get("compile", {})
        rows.append({"plan": tr.label[:40], "status": str(tr.status), "compile_s": round(c.get("compile_seconds", 0), 1),
                     "ms": round(1000 * tr.median_seconds, 2) if tr.median_seconds else None,
                     "peak_gib": gib(tr.peak_bytes), "breaks": c.get("graph_breaks"),
                     "recompiles": c.get("recompiles"), "conflict": tr.extra.get("conflict")})  # fmt: skip
    out.update(trials=rows, chosen=res.best.describe(), tuning_s=round(res.tuning_seconds, 1),
               compile_s_total=round(sum(r["compile_s"] for r in rows), 1))  # fmt: skip
    torch._dynamo.reset()
    return out


PART_FNS: dict[str, Callable[[], dict[str, Any]]] = {
    "a": part_a, "b": part_b, "c0": part_c0, "c": part_c, "d": part_d, "e": part_e, "f": part_f, "g": part_g,
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Environment, verdicts, table
# --------------------------------------------------------------------------------------------------
def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "device": str(DEVICE),
                            "lightning_ckpt": lightning_ckpt.__version__,
                            "precision": "lightning MixedPrecision('bf16-mixed').forward_context"}  # fmt: skip
    for module in ("lightning", "optuna", "triton"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    if CUDA:
        props = torch.cuda.get_device_properties(DEVICE)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", total_gib=gib(props.total_memory),
                    free_gib_at_start=gib(torch.cuda.mem_get_info(DEVICE)[0]),
                    fraction_at_start=torch.cuda.get_per_process_memory_fraction(DEVICE),
                    alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))  # fmt: skip
    return info


def attention_ops() -> dict[str, Any]:
    """Which aten attention op SDPA dispatches to here (bf16 as trained, fp32 as the fp32 control), and whether the
    ``save_matmuls`` save-list holds it."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    listed = {str(op) for op in SAVE_LISTS["save_matmuls"].ops}
    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(2, 4, 256, 64, device=DEVICE, dtype=dtype, requires_grad=True)
        with Ops() as ops:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        found = sorted(o for o in ops.seen if "attention" in o)
        out[str(dtype).removeprefix("torch.")] = {"ops": found, "in_save_matmuls": all(o in listed for o in found)}
    return out


def result(key: str) -> dict[str, Any]:
    return SUMMARY["parts"].get(key, {}).get("result") or {}


def verdicts() -> dict[str, Any]:
    """The figures to read first (None: the part did not produce them)."""
    a, b, c, d, e, f, g = (result(k) for k in "abcdefg")
    c1, c2 = c.get("c1_small_card") or {}, c.get("c2_small_card_unpruned") or {}
    return {
        "a_max_abs_err_pct": a.get("max_abs_err_pct"), "a_over_10pct": a.get("over_10pct"),
        "a_fp32_control_err_pct": a.get("fp32_control_err_pct"),
        "b_chosen": b.get("chosen"), "b_budget_gib": b.get("budget_gib"), "b_violations": b.get("violations"),
        "b_tuned_over_best_fitting_baseline": b.get("tuned_over_best_fitting_baseline"),
        "b_best_fitting_baseline": b.get("best_fitting_baseline"), "b_tuned_over_full": b.get("tuned_over_full"),
        "b_pruned_but_fit": b.get("pruned_but_fit"), "b_oom_but_allocated_fits": b.get("oom_but_allocated_fits"),
        "b_train_step_over_budget": b.get("train_step_over_budget"),
        "c0_environment_takes_effect": result("c0").get("environment_takes_effect"),
        "c0_runtime_switch_takes_effect": result("c0").get("runtime_switch_takes_effect"),
        "c_full_reserved_peak_gib": c.get("full_reserved_peak_gib"), "c_headroom_gib": c.get("headroom_gib"),
        "c_allocator": (c.get("allocator_regime") or {}).get("how"),
        "c1_chosen_on_small_card": c1.get("chosen"), "c1_statuses": c1.get("statuses"),
        "c1_leak_mib": c1.get("alloc_delta_mib"),
        "c2_real_oom_recorded_and_search_continued": bool(c2.get("real_oom_recorded") and c2.get("search_continued")) if c2 else None,
        "c2_none_status_under_user_cap": c2.get("none_status"),
        "c3_over_budget_not_ok": c.get("c3_over_budget_not_ok"),
        "d_offload_step_memory_ratio": d.get("offload_step_memory_ratio"), "d_offload_time_ratio": d.get("offload_time_ratio"),
        "d_pinned_gib_after_release": (d.get("host_after_search_release") or {}).get("pinned_gib"),
        "d_link_gb_s": d.get("link_gb_s"), "d_link_bound": d.get("link_bound"), "d_pool": d.get("pool"),
        "e_compile_s_total": e.get("compile_s_total"), "e_tuning_s": e.get("tuning_s"),
        "f_chosen": f.get("chosen"), "f_chosen_micro_batch": f.get("chosen_micro_batch"),
        "f_ratio_tuned_vs_none": f.get("ratio_tuned_vs_none"), "f_none_pruned_but_fits": f.get("none_pruned_but_fits"),
        "f_train_step_over_budget": f.get("train_step_over_budget"),
        "g_plan": g.get("plan"), "g_train_step_over_budget": g.get("train_step_over_budget"),
        "parts_status": {k: v.get("status") for k, v in SUMMARY["parts"].items()},
    }  # fmt: skip


def headline(key: str) -> str:
    """One line per part for the table: what it found."""
    r = result(key)
    if not r:
        return ""
    if key == "a":
        return f"max |pred/meas - 1| {r.get('max_abs_err_pct')}% over {len(r.get('plans', {}))} baselines; fp32 {r.get('fp32_control_err_pct')}"
    if key == "b":
        return (f"chose {r.get('chosen')}: {r.get('tuned_over_best_fitting_baseline')}x {r.get('best_fitting_baseline')}, "
                f"{r.get('tuned_over_full')}x full; violations {r.get('violations')}; oom but fits {r.get('oom_but_allocated_fits')}")  # fmt: skip
    if key == "c0":
        return f"expandable segments: set before CUDA starts {r.get('environment_takes_effect')}, run-time switch {r.get('runtime_switch_takes_effect')}"
    if key == "c":
        c1, c2 = r.get("c1_small_card") or {}, r.get("c2_small_card_unpruned") or {}
        return (f"{r.get('card_gib')} GiB card: chose {c1.get('chosen')} ({c1.get('statuses')}), leak "
                f"{c1.get('alloc_delta_mib')} MiB; unpruned: OOM recorded {c2.get('real_oom_recorded')}, went on "
                f"{c2.get('search_continued')}, none {c2.get('none_status')}")  # fmt: skip
    if key == "d":
        bound = (r.get("link_bound") or {}).get("transfer_over_step")
        return (f"offload's step adds {r.get('offload_step_memory_ratio')} of none's memory at {r.get('offload_time_ratio')}x "
                f"the step time (link bound {bound}x the step); exposed {r.get('exposed')}; tune at "
                f"{r.get('tune_budget_gib')} GiB chose {r.get('tuned')}: {r.get('tuned_over_none')}x none; pinned after "
                f"the search's release {(r.get('host_after_search_release') or {}).get('pinned_gib')} GiB")  # fmt: skip
    if key == "e":
        return f"compile {r.get('compile_s_total')} s over {len(r.get('trials', []))} trials; eager none {r.get('eager_none_ms')} ms; tuned in {r.get('tuning_s')} s"
    if key == "f":
        return (f"chose {r.get('chosen')} at micro-batch {r.get('chosen_micro_batch')}: {r.get('ratio_tuned_vs_none')}x none "
                f"at {r.get('ref_micro_batch')}; steps over budget {r.get('train_step_over_budget')}")  # fmt: skip
    if key == "g":
        peaks = r.get("train_step_peaks_gib")
        return (f"chose {r.get('plan')} in {r.get('tuning_s')} s; real step peak {max(peaks) if peaks else None} of "
                f"{r.get('budget_gib')} GiB; over {r.get('train_step_over_budget')}")  # fmt: skip
    return ""


def print_table() -> None:
    env = SUMMARY["env"]
    where = f"{env.get('name', 'CPU (dry run)')}, torch {env.get('torch')}, {SUMMARY.get('elapsed_s')} s"
    print(f"=== gpu_check: {where} ===")
    print(f"{'part':<4} {'name':<26} {'status':<8} {'s':>6}  result")
    for key, entry in SUMMARY["parts"].items():
        what = entry.get("error") or entry.get("reason") or "; ".join([*entry.get("missed", []), headline(key)])
        print(f"{key:<4} {entry.get('name', ''):<26} {entry['status']:<8} {entry.get('seconds', 0):>6}  {what}")
    print(f"wrote {OUT_PATH}", flush=True)


def _alarm(signum: int, frame: Any) -> None:
    raise Deadline(f"hard limit of {ARGS.hard_limit:.0f} s reached")


def missed_targets(key: str, r: dict[str, Any]) -> list[str]:
    """What a part measured that misses its target (the part then has status ``failed``)."""
    missed = []
    if key == "a" and r.get("over_10pct"):
        missed.append(f"memory model more than 10% off for {r['over_10pct']}")
    if key == "b" and r.get("violations"):
        missed.append(f"{r['violations']} plan(s) the search kept are over the budget")
    if key == "c":
        for run in ("c1_small_card", "c2_small_card_unpruned", "c3_tuner_cap"):
            got = r.get(run) or {}
            if got.get("chosen_step_on_card") != "ok":
                missed.append(f"{run}: the chosen plan's step is {got.get('chosen_step_on_card')} on the card")
            if not got.get("grads_none_after"):
                missed.append(f"{run}: gradients left behind")
            if (got.get("alloc_delta_mib") or 0) > 0.02 * (r.get("card_gib") or 0) * 1024:
                missed.append(f"{run}: {got['alloc_delta_mib']} MiB still allocated after the search (a leak)")
        c2 = r.get("c2_small_card_unpruned") or {}
        if not (c2.get("real_oom_recorded") and c2.get("search_continued")):
            missed.append("c2: a plan that does not fit the card did not end as a recorded OOM the search went past")
        if c2.get("none_status") == "ok":
            missed.append("c2: 'none' ran on the small card: the tuner's cap lifted the user's")
        for k in ("c2_fraction_kept", "c3_over_budget_not_ok", "c3_fraction_restored"):
            if r.get(k) is False:
                missed.append(f"{k} is False")
    if key == "d" and CUDA:
        missed += [f"{n}: exposed transfer predicted more than 20% off" for n, e in (r.get("exposed") or {}).items()
                   if e is not None and not e["within_20pct"]]  # fmt: skip
        if (r.get("tuned_over_none") or 0) < 0.93:
            missed.append(f"tune at 21.8 GiB chose a plan at {r.get('tuned_over_none')}x none (target 0.93x)")
    if key in ("f", "g") and r.get("train_step_over_budget"):
        missed.append("a real training step after lock-in went over the budget")
    return missed


def run_part(key: str) -> dict[str, Any]:
    name, estimate = PARTS[key]
    entry: dict[str, Any] = {"name": name}
    if elapsed() + (0.0 if ARGS.dry_run else estimate) > ARGS.time_budget:  # the estimates are an H200's
        entry.update(status="skipped", reason=f"time budget: at {elapsed():.0f} s, needs ~{estimate:.0f} s")
        log(f"({key}) skipped: {entry['reason']}")
        return entry
    log(f"({key}) {name} ...")
    t0 = time.perf_counter()
    try:
        entry["result"] = PART_FNS[key]()
        entry["missed"] = missed_targets(key, entry["result"])
        entry["status"] = "failed" if entry["missed"] else "ok"
    except Deadline as exc:
        entry.update(status="deadline", error=str(exc))
    except Exception as exc:  # a failing part must not stop the others
        entry.update(status="error", error=short_err(exc), trace=traceback.format_exc().strip().splitlines()[-8:])
        entry["error_message"] = str(exc)  # whole: a refusal's figures are at its end
        figures = getattr(exc, "allocator", None) or {}
        with contextlib.suppress(Exception):
            figures = figures or allocator_figures(device_memory(DEVICE))
        entry["allocator"] = figures
    finally:
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        if CUDA:
            with contextlib.suppress(Exception):
                torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
                entry["alloc_gib_after"] = gib(torch.cuda.memory_allocated(DEVICE))
        with contextlib.suppress(Exception):
            free()
    log(f"({key}) {entry['status']} in {entry['seconds']} s")
    return entry


def main() -> int:
    log(f"gpu_check: device {DEVICE}, dry_run={ARGS.dry_run}, out={OUT_PATH}")
    try:
        SUMMARY["env"].update(env_info(), attention_ops=attention_ops())
    except Exception as exc:  # the environment's description must not stop the check
        SUMMARY["env"]["error"] = short_err(exc)
    log(f"env: {json.dumps(SUMMARY['env'], default=str)}")
    if hasattr(signal, "SIGALRM"):
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(max(1, int(ARGS.hard_limit - elapsed())))
    try:
        for key in [k.strip() for k in ARGS.parts.split(",") if k.strip()]:
            if key not in PARTS:
                SUMMARY["parts"][key] = {"status": "error", "error": f"unknown part {key!r}; parts: {', '.join(PARTS)}"}
            elif any(e["status"] == "deadline" for e in SUMMARY["parts"].values()):
                SUMMARY["parts"][key] = {"name": PARTS[key][0], "status": "skipped", "reason": "after the hard limit"}
            else:
                SUMMARY["parts"][key] = run_part(key)
            write_summary()
    except Deadline as exc:  # the alarm rang between parts: what ran is kept
        SUMMARY["deadline"] = str(exc)
    if hasattr(signal, "SIGALRM"):
        signal.alarm(0)
    SUMMARY["verdicts"] = verdicts()
    write_summary()
    print_table()
    return 1 if any(e["status"] in ("error", "deadline", "failed") for e in SUMMARY["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
