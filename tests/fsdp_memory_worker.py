"""Run by tests/test_fsdp.py: the per-rank memory model under FSDP2 on 2 CPU ranks (gloo), every baseline.

Writes ``<out>/memory<reshard>-<rank>.json`` for each ``reshard_after_forward`` setting asked for (``1,0``: both, in
one process group, so the test pays one launch): per baseline, the measured and predicted peak and activation bytes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def run(rank: int, out: str, settings: list[bool], port: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for reshard in settings:
        measure(rank, out, reshard)
    dist.barrier()  # no rank tears gloo down while the other still talks to it (std::terminate at exit)
    dist.destroy_process_group()


def measure(rank: int, out: str, reshard: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    from lightning_ckpt import baselines, plan_applied
    from lightning_ckpt.measure.step import track_step_memory
    from lightning_ckpt.memory.profile import profile_memory
    from lightning_ckpt.testing import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=128, block_size=64))
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    x = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(rank))
    model(x, x).backward()  # FSDP2's lazy initialisation, outside any measurement
    model.zero_grad(set_to_none=True)
    mm = profile_memory(model, lambda: model(x, x), extra=(x,))
    rows = {}
    for name, plan in baselines(model, memory_model=mm).items():
        with plan_applied(model, plan, check_fingerprint=False):
            reading = track_step_memory(lambda: model(x, x).backward(), model=model, extra=(x,))
        model.zero_grad(set_to_none=True)
        pred = mm.predict(plan)
        rows[name] = {"peak": reading.peak_bytes, "predicted_peak": pred.peak_bytes,
                      "activation": reading.activation_bytes, "predicted_activation": pred.activation_bytes}  # fmt: skip
    local_params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    Path(out, f"memory{int(reshard)}-{rank}.json").write_text(json.dumps({"rows": rows, "parameter_bytes": mm.parameter_bytes,
                                                           "local_parameter_bytes": local_params,
                                                           "unchained": list(mm.unchained_stacks)}))  # fmt: skip


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(run, args=(sys.argv[1], [v == "1" for v in sys.argv[2].split(",")], sys.argv[3]), nprocs=2)
