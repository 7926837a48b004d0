"""The memory model's accuracy: predicted vs measured peak and activation memory for every baseline plan.

For each reference model (the nanoGPT test model, an HF Llama and an HF ViT built from small configs)
the model is profiled once with ``profile_memory`` (memory-safe: no pass holds more than the
full-checkpointing step), then every baseline plan is applied and measured with the live-tensor tracker
(``track_step_memory``, the same reading ``measure_step`` reports on CPU). Deterministic: it runs on CPU
and gives the same bytes on any machine. Run: ``python benchmarks/memory_model.py`` (writes
``benchmarks/results/memory_model.json``; well under a minute on two cores).

What dominates the error: the prediction is exact to the byte for per-block plans (none, full,
selective, ops, offload). The only error is in ``sqrt_segments``, an under-prediction of one
hidden-state tensor per checkpointed chunk: ``apply.py``'s ``_Chunk`` keeps a reference to the chunk's
last output (``last_output``) after the parent has consumed it, so that tensor outlives its backward.
With that reference cleared once the last member has run, segments are exact too. With an HF KV cache
enabled (``use_cache=True``), blocks that are not checkpointed also hold the cache's K/V until the end
of the forward, which the profile (run without cache, as training needs none) does not count.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ckpt import baselines, plan_applied
from lightning_ckpt.measure import track_step_memory
from lightning_ckpt.memory_model import profile_memory
from lightning_ckpt.testing import GPT, GPTConfig

MiB = 1024 * 1024


def gpt_case() -> tuple[str, nn.Module, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
    model = GPT(GPTConfig(n_layer=12, vocab_size=64, n_embd=64, block_size=64))
    x = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    return "nanoGPT 12x64 (4x64 tokens)", model, (lambda: model(x, y)), (x, y)


def llama_case() -> tuple[str, nn.Module, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
    from lightning_ckpt.testing.hf import lm_batch, tiny_llama

    model = tiny_llama(layers=8, hidden=128, vocab=512)
    batch = lm_batch(vocab=512, batch=4, seq=128)
    return "HF Llama 8x128 (4x128 tokens)", model, (lambda: model(**batch, use_cache=False).loss), tuple(batch.values())


def vit_case() -> tuple[str, nn.Module, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
    from lightning_ckpt.testing.hf import image_batch, tiny_vit

    model = tiny_vit(layers=8, hidden=128, image_size=64, patch=8)
    batch = image_batch(batch=8, image_size=64)
    return "HF ViT 8x128 (8 images 64px)", model, (lambda: model(**batch).loss), tuple(batch.values())


def run_case(make: Callable[[], tuple]) -> dict[str, Any]:
    torch.manual_seed(0)
    name, model, forward, extra = make()
    model.train()
    t0 = time.perf_counter()
    mm = profile_memory(model, forward, extra=extra)
    profile_seconds = time.perf_counter() - t0
    rows = []
    for plan_name, plan in baselines(model).items():
        with plan_applied(model, plan):
            reading = track_step_memory(lambda: forward().backward(), model=model, extra=extra)
        model.zero_grad(set_to_none=True)
        pred = mm.predict(plan)
        rows.append(
            {
                "plan": plan_name,
                "describe": plan.describe(),
                "measured_peak_bytes": reading.peak_bytes,
                "predicted_peak_bytes": pred.peak_bytes,
                "peak_error": pred.peak_bytes / reading.peak_bytes - 1,
                "measured_activation_bytes": reading.activation_bytes,
                "predicted_activation_bytes": pred.activation_bytes,
                "activation_error": pred.activation_bytes / reading.activation_bytes - 1,
                "predicted_peak_phase": pred.peak_phase,
            }
        )
    return {
        "model": name,
        "class": type(model).__name__,
        "blocks": len(mm.blocks),
        "profile_seconds": round(profile_seconds, 3),
        "fixed_bytes": mm.fixed_bytes,
        "resting_bytes": mm.resting_bytes,
        "plans": rows,
        "breakdown": mm.table(),
    }


def print_table(results: list[dict[str, Any]]) -> None:
    header = f"{'model':32s} {'plan':17s} {'peak MiB':>9s} {'pred':>9s} {'err':>7s}   {'act MiB':>9s} {'pred':>9s} {'err':>7s}"
    print(header)
    print("-" * len(header))
    for res in results:
        for r in res["plans"]:
            print(
                f"{res['model']:32s} {r['plan']:17s} {r['measured_peak_bytes'] / MiB:9.3f} "
                f"{r['predicted_peak_bytes'] / MiB:9.3f} {100 * r['peak_error']:+6.2f}%   "
                f"{r['measured_activation_bytes'] / MiB:9.3f} {r['predicted_activation_bytes'] / MiB:9.3f} "
                f"{100 * r['activation_error']:+6.2f}%"
            )
        print(f"{'':32s} (profiled in {res['profile_seconds']:.2f} s)")
    worst = max(max(abs(r["peak_error"]), abs(r["activation_error"])) for res in results for r in res["plans"])
    print(f"worst absolute error: {100 * worst:.2f}% (target: 10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_model.json")
    parser.add_argument("--breakdown", action="store_true", help="also print each model's per-block table")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    cases: list[Callable[[], tuple]] = [gpt_case]
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: only the nanoGPT model is benchmarked")
    else:
        cases += [llama_case, vit_case]
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF config notices
        for case in cases:
            results.append(run_case(case))
    print_table(results)
    if args.breakdown:
        for res in results:
            print(f"\n{res['model']}\n{res['breakdown']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "torch": torch.__version__,
        "device": "cpu",
        "reading": "track_step_memory (live-tensor tracker); error = predicted / measured - 1",
        "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
