"""Stacks whose parent skips blocks by configuration (LayerDrop, stochastic depth): no segments there.

A segment runs several blocks at once, so it needs a parent that calls each of them, in order, every
step. LayerDrop breaks that on purpose: Hugging Face's BART, MBart, Whisper, wav2vec2 and others draw a
coin before every block in training and skip some. The profile's chain check sees such a parent only
when it draws in the batch it profiles; the configuration says so before any step, for every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_ckpt.stacks import LayerStack

__all__ = ["SKIP_ATTRIBUTES", "skipping_parent", "skipping_stacks"]

# Probabilities, kept on the module that loops over the stack, with which it skips a block in training
# (BartEncoder.layerdrop, Wav2Vec2Encoder.config.layerdrop, ...). Any value above zero skips some steps.
SKIP_ATTRIBUTES = (
    "layerdrop",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "layer_drop",
    "drop_path",
    "drop_path_rate",
    "stochastic_depth_prob",
)
# On the parent's config only the generic name: a shared seq2seq config holds both the encoder's and the
# decoder's rates, and the parent's own attribute says which one it uses.
_CONFIG_ATTRIBUTES = ("layerdrop",)


def _rate(owner: object, attr: str) -> float | None:
    value = getattr(owner, attr, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # a DropPath module, a flag: not a rate
        return None
    return float(value)


def skipping_parent(root: nn.Module, stack_fqn: str) -> str | None:
    """``"<attribute> = <rate>"`` when the module that holds stack ``stack_fqn`` skips blocks at random in
    training (a rate above zero), else None. The root stands in for the parent of a root-level stack."""
    parent_fqn = stack_fqn.rpartition(".")[0]
    parent = root.get_submodule(parent_fqn) if parent_fqn else root
    path = f"model.{parent_fqn}" if parent_fqn else "model"
    owners = [(parent, path, SKIP_ATTRIBUTES), (getattr(parent, "config", None), f"{path}.config", _CONFIG_ATTRIBUTES)]
    for owner, where, attrs in owners:
        for attr in attrs:
            rate = _rate(owner, attr) if owner is not None else None
            if rate is not None and rate > 0:
                return f"{where}.{attr} = {rate:g}"
    return None


def skipping_stacks(root: nn.Module, stacks: Sequence[LayerStack]) -> dict[str, str]:
    """Stack FQN -> the configuration that makes its parent skip blocks (see ``skipping_parent``)."""
    found = {s.fqn: skipping_parent(root, s.fqn) for s in stacks}
    return {fqn: why for fqn, why in found.items() if why is not None}
