"""Stacks whose parent skips blocks by configuration (LayerDrop, stochastic depth): no segments there.

A segment runs several blocks at once, so it needs a parent that calls each of them, in order, every
step. LayerDrop breaks that on purpose: Hugging Face's BART, MBart, Whisper, wav2vec2 and others draw a
coin before every block in training and skip some. The profile's chain check sees such a parent only
when it draws in the batch it profiles; the configuration says so before any step, for every step.

The same draw makes a profile or a trial measure whichever depth its one step happened to run: profiled on a
step where 1 of 3 layers ran, a full-depth step's activations were predicted half of what they are, and a plan
chosen on them ran at 1.7x the budget on every full-depth step. ``full_depth`` sets the rates to zero for the
search, so every figure it reads is the deepest step's (the worst case the budget must hold for), while the
stacks are still known to skip (no segments there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from lightning_ckpt.stacks import LayerStack

__all__ = ["SKIP_ATTRIBUTES", "full_depth", "skipping_parent", "skipping_stacks"]

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


# (id(owner), attribute) -> the rate it had before ``full_depth`` set it to zero: still the configured rate.
_ZEROED: dict[tuple[int, str], float] = {}


def _rate(owner: object, attr: str) -> float | None:
    if (id(owner), attr) in _ZEROED:
        return _ZEROED[id(owner), attr]
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
    found = _skip_rates(parent, path)
    return f"{found[0][1]}.{found[0][2]} = {found[0][3]:g}" if found else None


def _skip_rates(parent: nn.Module, path: str) -> list[tuple[object, str, str, float]]:
    """(owner, where, attribute, rate) of every rate above zero that makes ``parent`` skip blocks."""
    owners = [(parent, path, SKIP_ATTRIBUTES), (getattr(parent, "config", None), f"{path}.config", _CONFIG_ATTRIBUTES)]
    found = []
    for owner, where, attrs in owners:
        for attr in attrs:
            rate = _rate(owner, attr) if owner is not None else None
            if rate is not None and rate > 0:
                found.append((owner, where, attr, rate))
    return found


def skipping_stacks(root: nn.Module, stacks: Sequence[LayerStack]) -> dict[str, str]:
    """Stack FQN -> the configuration that makes its parent skip blocks (see ``skipping_parent``)."""
    found = {s.fqn: skipping_parent(root, s.fqn) for s in stacks}
    return {fqn: why for fqn, why in found.items() if why is not None}


@contextmanager
def full_depth(root: nn.Module, stacks: Sequence[LayerStack]) -> Iterator[dict[str, str]]:
    """Every parent that skips blocks by configuration runs all of them while this holds (its rates set to zero,
    restored on exit, whatever happens); ``skipping_stacks`` still reports the configured rates. Yields what was
    zeroed (stack FQN -> ``"<attribute> = <rate>"``). The parents draw their coins as before (Hugging Face draws
    ``torch.rand`` and compares), so the random stream a step consumes is unchanged."""
    zeroed: list[tuple[object, str, float]] = []
    said: dict[str, str] = {}
    try:
        for stack in stacks:
            parent_fqn = stack.fqn.rpartition(".")[0]
            parent = root.get_submodule(parent_fqn) if parent_fqn else root
            path = f"model.{parent_fqn}" if parent_fqn else "model"
            for owner, where, attr, rate in _skip_rates(parent, path):
                said.setdefault(stack.fqn, f"{where}.{attr} = {rate:g}")
                if (id(owner), attr) in _ZEROED:
                    continue  # a config shared by two stacks: zeroed once
                value = getattr(owner, attr)
                _ZEROED[id(owner), attr] = rate
                zeroed.append((owner, attr, value))
                setattr(owner, attr, type(value)(0))
        yield said
    finally:
        for owner, attr, value in reversed(zeroed):
            setattr(owner, attr, value)
            _ZEROED.pop((id(owner), attr), None)
