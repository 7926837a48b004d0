"""Run a compiled model's trials on blocks compiled alone, so a plan change swaps compiled blocks instead of compiling.

The trials run the model as a regional compile does (torchtitan's way): every stack block compiled alone, every other
compiled region eager, and a plan's forwards the objects the block had under that mode before (``reused_forwards``),
which dynamo guards by code and type: one graph per distinct block and mode serves every plan. Only the chosen plan
compiles the user's way. What this does not see (fusion across blocks, a PT2 budget's one knapsack over a whole
graph): ``search.whole_check`` and docs/compile.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_ckpt.discovery import is_compile_wrapper, unwrap_compiled
from lightning_ckpt.plan.forwards import CHUNK_BLOCKS, is_segment_forward, original_forward

__all__ = ["BlocksCompiledAlone", "graphs_compiled", "partition_only_backend", "room_for_graphs"]

# Graphs one code object may hold while trials run (dynamo's default is 8): every block call of every stack runs
# ``Module._call_impl``, so its graphs are distinct blocks x modes x batch shapes x PT2 budgets.
GRAPHS_PER_FRAME = 512


def graphs_compiled() -> int:
    """Graphs dynamo compiled in this process (``counters["stats"]["unique_graphs"]``): a difference is a compile."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def partition_only_backend() -> Any:
    """A ``torch.compile`` backend running inductor up to its partition, then the partitioned graphs as they are: what
    a whole compile saves for backward, to the byte (unlike ``aot_eager_decomp_partition``, which lacks the joint-graph
    passes), at a fraction of its cost. Not for convolutions: inductor's later layout optimization saves channels-last
    copies this does not see. A new backend per call: dynamo guards a frame's graphs on their backend."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    def unchanged(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=unchanged)

    return backend


@contextlib.contextmanager
def room_for_graphs(limit: int = GRAPHS_PER_FRAME) -> Iterator[None]:
    """Dynamo's recompile limits raised to ``limit`` (never lowered) for the enclosed trials."""
    config = torch._dynamo.config
    names = [n for n in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit") if hasattr(config, n)]
    patch = {n: max(int(getattr(config, n)), limit) for n in names}
    with config.patch(**patch):
        yield


class BlocksCompiledAlone:
    """``model`` as a compiled search runs it, while ``installed()`` is entered; ``blocks``: the stacks' block FQNs."""

    def __init__(self, model: nn.Module, root: nn.Module, blocks: tuple[str, ...]) -> None:
        self.blocks = blocks
        self._compiled: list[tuple[nn.Module, Any]] = []  # blocks we compile alone, with their compiled call
        alone: set[int] = set()
        for fqn in blocks:
            wrapper = root.get_submodule(fqn)
            block = unwrap_compiled(wrapper)
            alone.add(id(block))
            if is_compile_wrapper(wrapper) or block._compiled_call_impl is not None:
                continue  # the user compiled it alone: it runs as they compiled it
            # Made once: dynamo keys graphs by code and guards, so every trial reuses what an earlier one compiled.
            self._compiled.append((block, torch.compile(block._call_impl)))
        # A segment's blocks, called one by one inside its eager checkpoint (``segments_eager``).
        self._chunk_call = torch.compile(_chunk_block)
        self._eager: list[tuple[Any, str, Any]] = []  # (object, attribute, value while installed)
        # ``model`` and every module under it, compile wrappers included, each once.
        for module in {id(m): m for m in (model, *model.modules())}.values():
            inner = unwrap_compiled(module)
            if id(inner) in alone:
                continue
            if is_compile_wrapper(module):
                self._eager.append((module, "forward", module._orig_mod.__call__))
            elif module._compiled_call_impl is not None:
                self._eager.append((module, "_compiled_call_impl", None))
            ctx = module.__dict__.get("_compiler_ctx")
            if isinstance(ctx, dict) and ctx.get("original_forward") is not None:  # Lightning's from_compiled
                self._eager.append((module, "forward", ctx["original_forward"]))

    @contextlib.contextmanager
    def segments_eager(self, root: nn.Module, stacks: Iterable[str]) -> Iterator[None]:
        """The segmented ``stacks``' blocks eager, each called through one compiled call of its ``original_forward``:
        compiled alone, a segment's head block would trace its whole chunk, one graph per chunk length."""
        prefixes = tuple(f"{s}." if s else "" for s in stacks)
        touched: list[tuple[nn.Module, str, Any]] = []
        for fqn in self.blocks:
            if not fqn.startswith(prefixes):
                continue
            wrapper = root.get_submodule(fqn)
            block = unwrap_compiled(wrapper)
            if not is_segment_forward(block.__dict__.get("forward")):
                continue
            if is_compile_wrapper(wrapper):
                touched.append((wrapper, "forward", block.__call__))
            touched.append((block, "_compiled_call_impl", None))
        with _patched([*touched, (CHUNK_BLOCKS, "call", self._chunk_call)] if touched else []):
            yield

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """Every compiled region but the blocks compiled through a fresh ``partition_only_backend`` while entered."""
        backend = partition_only_backend()
        # ``None``: a ``.compile()``-d module, whose eager call is its ``_call_impl``.
        compiled = [(obj, name, torch.compile(eager if eager is not None else obj._call_impl, backend=backend))
                    for obj, name, eager in self._eager]  # fmt: skip
        with _patched(compiled):
            yield

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Blocks compiled alone and the rest eager for the enclosed steps; the user's compile afterwards."""
        with _patched([*self._eager, *((block, "_compiled_call_impl", call) for block, call in self._compiled)]):
            yield


_MISSING = object()


@contextlib.contextmanager
def _patched(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(object, attribute, value)`` set in the object's ``__dict__`` while entered, then put back as it was."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            obj.__dict__[name] = value
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = value


def _chunk_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return original_forward(block)(*args, **kwargs)
