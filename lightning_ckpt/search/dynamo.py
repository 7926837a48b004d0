"""What dynamo did: a model's random ops and CUDA graphs, and what compiling one plan cost and broke
(``CompileStats``, ``conflict_reason``), read off dynamo's process-wide counters."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_ckpt.discovery import canonical_fqn, is_compile_wrapper, unwrap_compiled
from lightning_ckpt.plan import forwards as forwards_module
from lightning_ckpt.plan.forwards import CHECKPOINT_FRAMES

__all__ = [
    "CompileStats",
    "DynamoWatch",
    "break_count",
    "break_summaries",
    "conflict_reason",
    "eager_ops",
    "is_dynamo_refusal",
    "random_ops",
    "recompile_count",
    "recompile_limit",
    "uses_cuda_graphs",
]

_COMPILED_NODE = "CompiledFunctionBackward"  # autograd node of an AOTAutograd-compiled graph
_MAX_REASONS = 5


def random_ops(root: nn.Module) -> str | None:
    """The first module of ``root`` (uncompiled) that draws random numbers in training: dropout modules, and attention
    modules that pass a dropout float to SDPA (nanoGPT, HF). Functional dropout with a literal probability is unseen."""
    for fqn, module in root.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return canonical_fqn(fqn) or type(module).__name__
        for name in ("dropout", "dropout_p", "attention_dropout"):
            value = module.__dict__.get(name)
            if isinstance(value, float) and value > 0:
                return f"{canonical_fqn(fqn)}.{name}"
    return None


def uses_cuda_graphs(model: nn.Module) -> bool:
    """Whether a ``torch.compile`` wrapper in ``model`` was made with CUDA graphs (``mode="reduce-overhead"``), read
    from the wrapper's backend chain as torch 2.13 keeps it; a torch that keeps it elsewhere reads as False."""
    for module in [model, *unwrap_compiled(model).modules()]:
        if not is_compile_wrapper(module):
            continue
        backend = getattr(getattr(module, "dynamo_ctx", None) or getattr(module, "_dynamo_ctx", None), "callback", None)
        for _ in range(8):
            config = getattr(backend, "config", None)
            if isinstance(config, dict) and config.get("triton.cudagraphs"):
                return True
            backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
                backend, "_torchdynamo_orig_callable", None
            )
            if backend is None:
                break
    return False


def recompile_limit() -> int:
    """Dynamo's limit on the graphs one frame may hold (``recompile_limit``; ``cache_size_limit`` before torch 2.6)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def recompile_count() -> int:
    """Recompilations since the last ``reset_compiled()``: guard failures dynamo recorded, all frames."""
    from torch._dynamo.utils import guard_failures

    return sum(len(reasons) for reasons in guard_failures.values())


@dataclass(frozen=True)
class CompileStats:
    """What compiling one plan cost and did; stored in ``TrialRecord.extra["compile"]``."""

    compile_seconds: float = 0.0  # the first (compiling) step: tuning cost (0: it ran graphs compiled before)
    graphs: int = 0  # graphs dynamo compiled for this plan
    graph_breaks: int = 0  # all frames
    region_breaks: int = 0  # of those, inside a checkpointed region of ours (the region runs eagerly)
    recompiles: int = 0  # during the trial's steps (a stable plan has none after the first step)
    recompile_limit_hit: bool = False  # a frame now runs eagerly
    eager_ops: int | None = None  # autograd ops of the forward recorded outside compiled graphs
    saved_bytes: int | None = None  # distinct storages saved for backward, state excluded
    break_reasons: tuple[str, ...] = ()  # ``reason (file:line)``, at most five

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["break_reasons"] = list(self.break_reasons)
        return d


def conflict_reason(stats: CompileStats, reference: CompileStats | None) -> str | None:
    """Why ``stats`` shows a plan fighting the compiler, compared with the no-checkpointing reference."""
    ref, reasons = reference or CompileStats(), []
    if stats.region_breaks:
        where = next((r for r in stats.break_reasons if "[in checkpointed region]" in r), "")
        reasons.append(
            f"{stats.region_breaks} graph break(s) inside checkpointed regions, which then run eagerly "
            f"(pytorch#135816){': ' + where if where else ''}"
        )
    if stats.graph_breaks > ref.graph_breaks and not stats.region_breaks:
        reasons.append(f"{stats.graph_breaks} graph breaks where the uncheckpointed model has {ref.graph_breaks}")
    if stats.recompile_limit_hit and not ref.recompile_limit_hit:
        reasons.append("hit torch._dynamo.config.recompile_limit, so a frame runs eagerly from now on (pytorch#135458)")
    if stats.eager_ops is not None and ref.eager_ops is not None and stats.eager_ops > ref.eager_ops:
        reasons.append(
            f"{stats.eager_ops - ref.eager_ops} more forward op(s) run outside compiled graphs than without "
            "checkpointing"
        )
    return "; ".join(reasons) or None


class DynamoWatch:
    """Dynamo's process-wide failure counters (``torch._dynamo.utils.counters``), read as a difference."""

    def __init__(self) -> None:
        from torch._dynamo.utils import counters

        self._counters = counters
        self._unimplemented = Counter(counters["unimplemented"])

    def limit_hit(self) -> bool:
        new = Counter(self._counters["unimplemented"]) - self._unimplemented
        return any("recompile limit" in msg.lower() or "cache_size_limit" in msg for msg in new)


def break_count() -> int:
    from torch._dynamo.utils import graph_break_reasons

    return len(graph_break_reasons)


def break_summaries(since: int = 0) -> tuple[int, int, tuple[str, ...]]:
    """(graph breaks, breaks inside our regions, short reasons) recorded since the last dynamo reset (from the
    ``since``-th on), read from ``graph_break_reasons``: its user stacks tell a break inside our checkpoint wrapper."""
    from torch._dynamo.utils import graph_break_reasons

    ours = os.path.abspath(forwards_module.__file__)
    breaks = graph_break_reasons[since:]
    in_region, reasons = 0, []
    for r in breaks:
        inside = any(os.path.abspath(f.filename) == ours and f.name in CHECKPOINT_FRAMES for f in r.user_stack)
        in_region += inside
        first = ((r.reason or "").strip() or "graph break").splitlines()[0]
        frame = r.user_stack[-1] if r.user_stack else None
        where = f" ({os.path.basename(frame.filename)}:{frame.lineno})" if frame is not None else ""
        text = f"{first[:120]}{where}{' [in checkpointed region]' if inside else ''}"
        if text not in reasons and len(reasons) < _MAX_REASONS:
            reasons.append(text)
    # Region breaks first: they are the ones a user must see.
    reasons.sort(key=lambda t: "[in checkpointed region]" not in t)
    return len(breaks), in_region, tuple(reasons)


def eager_ops(loss: torch.Tensor) -> int:
    """Autograd nodes of the step's graph outside compiled graphs (each an op that ran eagerly)."""
    seen: set[Any] = set()
    stack, count = [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ not in (_COMPILED_NODE, "AccumulateGrad")
        stack.extend(fn for fn, _ in node.next_functions)
    return count


def is_dynamo_refusal(exc: BaseException) -> bool:
    """A graph break or recompile limit that dynamo turned into an error (``fullgraph=True``)."""
    from torch._dynamo import exc as dynamo_exc

    refusals = (getattr(dynamo_exc, n, None) for n in ("Unsupported", "FailOnRecompileLimitHit"))
    return any(isinstance(cls, type) and isinstance(exc, cls) for cls in refusals)
