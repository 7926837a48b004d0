"""Small reference models shipped with the package, so tests, examples and benchmarks share them.

Like ``optuna.testing``, this is public so users can reproduce our measurements on the same models, and the card their
runs fail on (``SimulatedCard``, with CUDA's caching allocator in miniature when given ``AllocatorSizes``)."""

from lightning_ckpt.testing.allocator import AllocatorSizes
from lightning_ckpt.testing.card import SimulatedCard
from lightning_ckpt.testing.nanogpt import GPT, GPTConfig

__all__ = ["GPT", "AllocatorSizes", "GPTConfig", "SimulatedCard"]
