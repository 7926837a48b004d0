"""Apply each baseline checkpointing plan to a small GPT and print the activation memory it saves.

Run: python examples/apply_plan.py
"""

from __future__ import annotations

import torch

from lightning_ckpt import baselines, discover_blocks, plan_applied
from lightning_ckpt.measure.step import track_step_memory
from lightning_ckpt.testing import GPT, GPTConfig


def main() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=12, n_head=4, n_embd=128, block_size=128, vocab_size=96))
    tokens = torch.randint(0, 96, (8, 128))
    (stack,) = discover_blocks(model)
    print(f"found {len(stack.blocks)} blocks in {stack.fqn!r}; children: {[c.name for c in stack.blocks[0].children]}")

    none = None
    print(f"{'plan':<18}{'activation MiB':>15}{'saved':>8}")
    for name, plan in baselines(model).items():
        with plan_applied(model, plan):
            reading = track_step_memory(lambda: model(tokens, tokens).backward(), model=model, extra=(tokens,))
        model.zero_grad(set_to_none=True)
        none = none or reading.activation_bytes
        saved = 1 - reading.activation_bytes / none
        print(f"{name:<18}{reading.activation_bytes / 2**20:>15.1f}{saved:>8.0%}")


if __name__ == "__main__":
    main()
