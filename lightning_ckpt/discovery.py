"""Find the repeated layer stack(s) of an arbitrary model: checkpointing pays off per block (a small input, large
internals), and models keep their blocks in an ``nn.ModuleList``/``nn.Sequential`` of same-class modules."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from torch import nn

from lightning_ckpt.errors import DiscoveryError
from lightning_ckpt.stacks import Block, Child, LayerStack

__all__ = ["canonical_fqn", "discover_blocks", "is_compile_wrapper", "unwrap_compiled"]

# Stacks holding less than this share of the largest stack's parameters are ignored: encoder-decoder models have
# two large stacks, while small helper lists (two projection heads) are not worth planning over.
_MIN_SHARE_OF_LARGEST = 0.1

# Child names (or class names) of a block's feed-forward part in nanoGPT, HF, timm and torchtitan.
_MLP_PATTERN = re.compile(r"(mlp|ffn|feed_?forward|intermediate|c_fc|fc\d?$|dense_h_to_4h|moe|experts)", re.I)
_ATTN_PATTERN = re.compile(r"(attn|attention|self_attn|mixer)", re.I)
_NORM_PATTERN = re.compile(r"(norm|ln)", re.I)
# Containers whose members run side by side on one input: never a stack of layers (MoE experts, heads, branches).
_PARALLEL_PATTERN = re.compile(r"(expert|moe|head|branch|tower)", re.I)
# A stack's blocks are replaced by the repeated layers inside them (ResNet/ConvNeXt stages) when those hold this share.
_MIN_INNER_SHARE = 0.5


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """Return the module ``torch.compile`` wrapped, so FQNs are the same compiled or not."""
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
        model = model._orig_mod
    return model


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (``OptimizedModule``) around ``_orig_mod``."""
    return isinstance(module.__dict__.get("_modules", {}).get("_orig_mod"), nn.Module)


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without the ``_orig_mod`` steps that ``torch.compile(submodule)`` wrappers add; the plain name still
    resolves on the compiled model, as the wrapper forwards attribute lookups to ``_orig_mod``."""
    return ".".join(part for part in fqn.split(".") if part != "_orig_mod")


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _classify(name: str, module: nn.Module) -> str:
    cls = type(module).__name__
    if _NORM_PATTERN.search(name) or "Norm" in cls:
        return "norm"
    if _ATTN_PATTERN.search(name) or "Attention" in cls:
        return "attention"
    if _MLP_PATTERN.search(name) or re.search(r"(MLP|FeedForward|Intermediate|MoE|LayerFF$)", cls):
        return "mlp"
    return "other"


def _callable_children(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """A block's children that its forward calls, looking through plain containers (T5's ``layer.0``, ``layer.1``)."""
    out = []
    for name, child in module.named_children():
        if type(child) in (nn.ModuleList, nn.ModuleDict):
            out += _callable_children(child, f"{prefix}{name}.")
        else:
            out.append((prefix + name, child))
    return out


def _make_block(fqn: str, index: int, module: nn.Module) -> Block:
    module = unwrap_compiled(module)  # a block wrapped by torch.compile(block): describe the block itself
    fqn = canonical_fqn(fqn)
    children = tuple(
        Child(name=n, class_name=type(c).__name__, kind=_classify(n, c), num_params=_num_params(c))
        for n, c in _callable_children(module)
    )
    return Block(fqn, index, type(module).__name__, _num_params(module), children)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _same_class_container(module: nn.Module) -> bool:
    """An ``nn.ModuleList``/``nn.Sequential`` of same-class modules that are not containers themselves."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
        return False
    kids = list(module.children())
    return len({type(c) for c in kids}) == 1 and not isinstance(kids[0], (nn.ModuleList, nn.Sequential))


def _inner_stacks(model: nn.Module, stack: LayerStack) -> list[LayerStack] | None:
    """The repeated layers inside ``stack``'s blocks when those blocks are CNN stages, one stack per stage, or None. A
    stage is a poor unit to checkpoint (its input is a large share of the activations); whole stages remain reachable as
    segments over the layers. One level only: a ResNet layer's ``Sequential`` is a residual block."""
    shapes = {tuple(p.shape for p in model.get_submodule(b.fqn).parameters()) for b in stack.blocks}
    if len(shapes) == 1:
        return None  # identical blocks: already the repeated unit
    found: list[tuple[str, nn.Module]] = []
    for block in stack.blocks:
        parent = unwrap_compiled(model.get_submodule(block.fqn))
        options = [
            (name, child)
            for name, child in parent.named_children()
            if _same_class_container(child) and not _PARALLEL_PATTERN.search(name)
        ]
        if not options:
            return None
        found.append(max(options, key=lambda nc: _num_params(nc[1])))
    classes = {type(next(iter(c.children()))) for _, c in found}
    inner_params = sum(_num_params(c) for _, c in found)
    if len(classes) != 1 or inner_params < _MIN_INNER_SHARE * stack.num_params or inner_params == 0:
        return None
    out = []
    for block, (name, container) in zip(stack.blocks, found, strict=True):
        fqn = _join(block.fqn, name)
        blocks = tuple(_make_block(_join(fqn, n), i, c) for i, (n, c) in enumerate(container.named_children()))
        out.append(LayerStack(fqn, type(container).__name__, blocks))
    return out


def _auto_stacks(model: nn.Module, *, shared: bool = False) -> list[LayerStack]:
    """Repeated stacks; with ``shared``, containers of one composite module instead: ALBERT keeps its one
    layer, called once per depth, in ``albert_layer_groups[0].albert_layers[0]`` (the innermost wins)."""
    candidates: list[LayerStack] = []
    for fqn, module in model.named_modules(remove_duplicate=False):
        if not _same_class_container(module) or (len(module) != 1 if shared else len(module) < 2):
            continue
        kids = list(module.named_children())
        if shared and next(kids[0][1].children(), None) is None:
            continue  # a lone Linear in a list is a layer, not a block
        blocks = tuple(_make_block(_join(fqn, n), i, c) for i, (n, c) in enumerate(kids))
        stack = LayerStack(canonical_fqn(fqn), type(module).__name__, blocks)
        if stack.num_params > 0:
            candidates.append(stack)
    if not candidates:
        return []
    # Equal parameters: the deeper container first, so that the one enclosing it is not chosen too.
    candidates.sort(key=lambda s: (s.num_params, s.fqn.count(".")), reverse=True)
    largest = candidates[0].num_params
    chosen: list[LayerStack] = []
    for stack in candidates:
        if stack.num_params < _MIN_SHARE_OF_LARGEST * largest:
            break
        # Not a stack inside a chosen block (MoE experts), nor one enclosing a chosen stack (keep the finer one).
        if any(stack.fqn.startswith(b + ".") for c in chosen for b in c.block_fqns):
            continue
        if any(c.fqn.startswith(stack.fqn + ".") or stack.fqn == "" for c in chosen):
            continue
        chosen.append(stack)
    return [inner for stack in sorted(chosen, key=lambda s: s.fqn) for inner in _inner_stacks(model, stack) or [stack]]


def _matches(fqn: str, module: nn.Module, item: type | str) -> bool:
    """A module class, a class name, or an FQN glob (a name with a dot or a wildcard)."""
    if isinstance(item, type):
        return isinstance(module, item)
    return fnmatch.fnmatchcase(fqn, item) if any(c in item for c in ".*?[") else type(module).__name__ == item


def _explicit_stacks(model: nn.Module, spec: Iterable[type | str]) -> list[LayerStack]:
    spec = list(spec)
    for item in spec:
        if not isinstance(item, (type, str)):
            raise DiscoveryError(
                f"block_types entries must be module classes, class names or FQN patterns, but got {item!r} "
                f"({type(item).__name__}). Pass e.g. block_types=[MyBlock], ['MyBlock'] or ['encoder.layers.*']."
            )
    matched: list[tuple[str, nn.Module]] = []
    for raw_fqn, module in model.named_modules():
        if is_compile_wrapper(module):
            continue  # its _orig_mod is matched under the same canonical name
        fqn = canonical_fqn(raw_fqn)
        # Outermost matches only: a block inside a block is planned as part of its parent.
        inside = any(fqn.startswith(m + ".") for m, _ in matched)
        if fqn and not inside and any(_matches(fqn, module, item) for item in spec):
            matched.append((fqn, module))
    if not matched:
        known = sorted({type(m).__name__ for m in model.modules()})
        raise DiscoveryError(
            f"block_types={spec!r} matched no module of {type(model).__name__}. "
            f"Module classes in this model: {', '.join(known[:30])}. "
            "Pass one of these class names, the class itself, or an FQN pattern such as 'model.layers.*'."
        )
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    for fqn, module in matched:
        by_parent.setdefault(fqn.rpartition(".")[0], []).append((fqn, module))
    stacks = []
    for parent, members in sorted(by_parent.items()):
        container = model.get_submodule(parent) if parent else model
        blocks = tuple(_make_block(fqn, i, m) for i, (fqn, m) in enumerate(members))
        stacks.append(LayerStack(parent, type(container).__name__, blocks))
    return stacks


def discover_blocks(model: nn.Module, *, block_types: Iterable[type | str] | None = None) -> list[LayerStack]:
    """Return the layer stacks to plan over, largest-parameter stacks first in FQN order.

    ``block_types`` overrides the search: module classes, class names, or FQN glob patterns
    (``"encoder.layer.*"``). FQNs are those of the uncompiled model, so plans apply compiled or not.
    """
    root = unwrap_compiled(model)
    if block_types is not None:
        stacks = _explicit_stacks(root, block_types)
    else:
        # No repeated stack: a layer shared across depth (ALBERT) is kept alone in a list, called n times.
        stacks = _auto_stacks(root) or _auto_stacks(root, shared=True)
    if not stacks:
        raise DiscoveryError(
            f"No repeated layer stack found in {type(root).__name__}: no nn.ModuleList or nn.Sequential of "
            "same-class modules with parameters. Name the blocks explicitly, e.g. "
            "discover_blocks(model, block_types=[MyBlock]) or block_types=['backbone.stages.*'] "
            "(ActivationCheckpointTuner(search={'block_types': [...]}) takes the same values); a block the forward calls "
            "several times (weights shared across depth) is named the same way."
        )
    return stacks
