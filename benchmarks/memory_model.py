"""The memory model's accuracy: predicted vs measured peak and activation memory for every baseline plan,
in fp32 and under bf16 autocast; and the budget on real training steps (AdamW, fp32 and bf16-mixed).

For each reference model (the nanoGPT test model, an HF Llama and an HF ViT built from small configs)
the model is profiled once with ``profile_memory`` (memory-safe: no pass holds more than the
full-checkpointing step), then every baseline plan is applied and measured with the live-tensor tracker
(``track_step_memory``, the same reading ``measure_step`` reports on CPU). Deterministic: it runs on CPU
and gives the same bytes on any machine. Run: ``python benchmarks/memory_model.py`` (writes
``benchmarks/results/memory_model.json``; about two minutes on two cores).

Each model is profiled twice: in fp32, and with the forward under ``torch.autocast("cpu", bfloat16)``,
which is what Lightning's ``precision="bf16-mixed"`` does on CPU (and stands in for CUDA mixed
precision). HF GPT-2 runs from its default config (``use_cache=True``), with the cache turned off as
the tuner does; HF T5 is the encoder-decoder (its stacks are not chains, so no segments are offered).

The second table is the promise itself: a ``Trainer.fit`` with AdamW and ``max_memory`` halfway between
the real-step peaks of ``full`` and ``none`` (each measured with the plan applied by hand), tuned by
the callback; every real step afterwards (forward, backward and ``optimizer.step()``, read whole by the
live-tensor tracker) is compared with the budget.

What dominates the error: the prediction is exact to the byte for per-block plans (none, full,
selective, ops, offload). The only error is in ``sqrt_segments``, an under-prediction of one
hidden-state tensor per checkpointed chunk: ``plan/forwards.py``'s ``Chunk`` keeps a reference to the chunk's
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
from lightning_ckpt.measure.step import track_step_memory
from lightning_ckpt.memory.profile import profile_memory
from lightning_ckpt.plan.caches import kv_cache_disabled
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


def gpt2_default_case() -> tuple[str, nn.Module, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
    from lightning_ckpt.testing.hf import lm_batch, tiny_gpt2

    model = tiny_gpt2(layers=8, hidden=128, vocab=512)  # use_cache=True, HF's default
    batch = lm_batch(vocab=512, batch=4, seq=128)
    return "HF GPT-2 8x128 default config", model, (lambda: model(**batch).loss), tuple(batch.values())


def t5_case() -> tuple[str, nn.Module, Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=512, d_model=128, d_kv=32, d_ff=512, num_layers=4, num_heads=4, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, 512, (4, 128), generator=g),
        "labels": torch.randint(1, 512, (4, 64), generator=g),
    }
    return "HF T5 4+4x128 (4x128 -> 4x64)", model, (lambda: model(**batch).loss), tuple(batch.values())


def _bf16(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward()

    return run


def run_case(make: Callable[[], tuple]) -> dict[str, Any]:
    torch.manual_seed(0)
    name, model, forward, extra = make()
    model.train()
    out: dict[str, Any] = {"model": name, "class": type(model).__name__}
    with kv_cache_disabled(model):  # as the tuner does: a training forward needs no KV cache
        for precision, fwd in (("fp32", forward), ("bf16", _bf16(forward))):
            t0 = time.perf_counter()
            mm = profile_memory(model, fwd, extra=extra)
            profile_seconds = time.perf_counter() - t0
            rows = []
            for plan_name, plan in baselines(model, memory_model=mm).items():
                with plan_applied(model, plan):
                    reading = track_step_memory(lambda fwd=fwd: fwd().backward(), model=model, extra=extra)
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
            out[precision] = {
                "blocks": len(mm.blocks),
                "unchained_stacks": list(mm.unchained_stacks),
                "profile_seconds": round(profile_seconds, 3),
                "fixed_bytes": mm.fixed_bytes,
                "resting_bytes": mm.resting_bytes,
                "plans": rows,
                "breakdown": mm.table(),
            }
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':32s} {'plan':17s} {'peak MiB':>9s} {'fp32 err':>9s} {'act err':>8s}   "
        f"{'bf16 peak':>9s} {'bf16 err':>9s} {'act err':>8s}"
    )
    print(header)
    print("-" * len(header))
    for res in results:
        bf16 = {r["plan"]: r for r in res["bf16"]["plans"]}
        for r in res["fp32"]["plans"]:
            b = bf16[r["plan"]]
            print(
                f"{res['model']:32s} {r['plan']:17s} {r['measured_peak_bytes'] / MiB:9.3f} "
                f"{100 * r['peak_error']:+8.2f}% {100 * r['activation_error']:+7.2f}%   "
                f"{b['measured_peak_bytes'] / MiB:9.3f} {100 * b['peak_error']:+8.2f}% {100 * b['activation_error']:+7.2f}%"
            )
    worst = max(
        max(abs(r["peak_error"]), abs(r["activation_error"]))
        for res in results
        for p in ("fp32", "bf16")
        for r in res[p]["plans"]
    )
    print(f"worst absolute error: {100 * worst:.2f}% (target: 5%)")


# -- the budget on real steps ----------------------------------------------------------------------
def real_step_rows(steps: int = 5) -> list[dict[str, Any]]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, Plan, apply_plan, discover_blocks
    from lightning_ckpt.measure.tracker import new_live_tracker
    from lightning_ckpt.plan.baselines import uniform_plan

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(n_layer=6, n_head=4, n_embd=128, vocab_size=256, block_size=64, dropout=0.1))
            self.peaks: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(*batch)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            tracker = new_live_tracker("cpu")  # the whole real step: closure (forward, backward) and the update
            tracker.track_external(self, optimizer)
            tracker.total_peak = tracker.now()[0]
            with tracker:
                optimizer.step(closure=optimizer_closure)
            self.peaks.append(tracker.total_peak)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.randint(0, 256, (16 * steps, 65), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=16)

    def fit(net: Net, precision: str, callbacks: list[Any]) -> None:
        L.Trainer(
            accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, precision=precision,
        ).fit(net, loader)  # fmt: skip

    def by_hand(precision: str, plan_of: Callable[[nn.Module], Plan]) -> int:
        net = Net()
        with apply_plan(net, plan_of(net)):
            fit(net, precision, [])
        return max(net.peaks)

    rows = []
    for precision in ("32-true", "bf16-mixed"):
        lo = by_hand(precision, lambda n: uniform_plan(discover_blocks(n), BlockPlan("full")))
        hi = by_hand(precision, lambda n: Plan())
        budget = (lo + hi) // 2
        net = Net()
        cb = ActivationCheckpointTuner(max_memory=budget, verbose=False, search=dict(n_trials=12, measure_steps=2))
        fit(net, precision, [cb])
        best = cb.result.best_trial
        rows.append(
            {
                "precision": precision,
                "full_real_peak_bytes": lo,
                "none_real_peak_bytes": hi,
                "budget_bytes": budget,
                "chosen": cb.result.best.describe(),
                "trial_forward_backward_peak_bytes": best.forward_backward_peak_bytes,
                "predicted_real_peak_bytes": best.predicted_peak_bytes,
                "trial_real_peak_bytes": best.peak_bytes,
                "real_step_peaks_bytes": net.peaks,
                "max_real_over_budget": max(net.peaks) / budget,
                "violations": sum(p > budget for p in net.peaks),
                "guard": [c.to_dict() for c in cb.step_checks],
            }
        )
    return rows


def print_real_steps(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'precision':11s} {'budget MiB':>10s} {'chosen':>22s} {'trial fwd+bwd':>13s} {'predicted':>9s} "
        f"{'max real':>9s} {'real/budget':>11s} {'violations':>10s}"
    )
    for r in rows:
        print(
            f"{r['precision']:11s} {r['budget_bytes'] / MiB:10.2f} {r['chosen']:>22s} "
            f"{r['trial_forward_backward_peak_bytes'] / MiB:13.2f} {r['trial_real_peak_bytes'] / MiB:9.2f} "
            f"{max(r['real_step_peaks_bytes']) / MiB:9.2f} {r['max_real_over_budget']:11.3f} "
            f"{r['violations']:>4d}/{len(r['real_step_peaks_bytes'])}"
        )


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
        cases += [llama_case, vit_case, gpt2_default_case, t5_case]
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF config notices
        for case in cases:
            results.append(run_case(case))
        print_table(results)
        if args.breakdown:
            for res in results:
                print(f"\n{res['model']}\n{res['fp32']['breakdown']}")
        real = real_step_rows()
    print_real_steps(real)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "torch": torch.__version__,
        "device": "cpu",
        "reading": "track_step_memory (live-tensor tracker); error = predicted / measured - 1; "
        "bf16 = forward under torch.autocast('cpu', bfloat16)",
        "results": results,
        "real_steps": real,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
