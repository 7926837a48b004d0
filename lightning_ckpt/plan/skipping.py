"""Stacks whose parent skips blocks by configuration (LayerDrop, stochastic depth): no segments there, as a segment
needs a parent that calls each block every step. The draw would also make a profile measure whichever depth its step
ran, so ``full_depth`` zeroes the rates for the search: every figure is the deepest step's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from lightning_ckpt.stacks import LayerStack

__all__ = ["SKIP_ATTRIBUTES", "full_depth", "skipping_stacks"]

# Probabilities, on the module that loops over the stack, with which it skips a block in training.
SKIP_ATTRIBUTES = (
    "layerdrop",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "layer_drop",
    "drop_path",
    "drop_path_rate",
    "stochastic_depth_prob",
)
# On the parent's config only the generic name: a shared seq2seq config holds the encoder's and decoder's rates.
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


def _skip_rates(root: nn.Module, stack_fqn: str) -> list[tuple[object, str, str, float]]:
    """(owner, where, attribute, rate) of every rate above zero that makes the module holding stack ``stack_fqn``
    skip blocks at random in training. The root stands in for the parent of a root-level stack."""
    parent_fqn = stack_fqn.rpartition(".")[0]
    parent = root.get_submodule(parent_fqn) if parent_fqn else root
    path = f"model.{parent_fqn}" if parent_fqn else "model"
    owners = [(parent, path, SKIP_ATTRIBUTES), (getattr(parent, "config", None), f"{path}.config", _CONFIG_ATTRIBUTES)]
    found = []
    for owner, where, attrs in owners:
        for attr in attrs:
            rate = _rate(owner, attr) if owner is not None else None
            if rate is not None and rate > 0:
                found.append((owner, where, attr, rate))
    return found


def skipping_stacks(root: nn.Module, stacks: Sequence[LayerStack]) -> dict[str, str]:
    """Stack FQN -> ``"<attribute> = <rate>"``, the configuration that makes its parent skip blocks."""
    found = {s.fqn: _skip_rates(root, s.fqn) for s in stacks}
    return {fqn: f"{rates[0][1]}.{rates[0][2]} = {rates[0][3]:g}" for fqn, rates in found.items() if rates}


@contextmanager
def full_depth(root: nn.Module, stacks: Sequence[LayerStack]) -> Iterator[dict[str, str]]:
    """Every parent that skips blocks by configuration runs all of them while this holds (rates zeroed, restored on
    exit); yields stack FQN -> ``"<attribute> = <rate>"`` zeroed. Parents still draw: the random stream is unchanged."""
    zeroed: list[tuple[object, str, float]] = []
    said: dict[str, str] = {}
    try:
        for stack in stacks:
            for owner, where, attr, rate in _skip_rates(root, stack.fqn):
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
