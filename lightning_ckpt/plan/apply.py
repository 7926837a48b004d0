"""Apply a plan to a model in place, reversibly, without changing a single FQN: each planned module gets an
instance-level ``forward`` (a ``functools.partial`` of a module-level function, so ``deepcopy`` and ``pickle`` work),
which ``PlanHandle.remove()`` deletes."""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from torch import nn

from lightning_ckpt.discovery import is_compile_wrapper, unwrap_compiled
from lightning_ckpt.errors import ApplyError, PlanError
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.buffer_guard import BufferGuard
from lightning_ckpt.plan.chain import StackWatch
from lightning_ckpt.plan.chunks import refuse_segment_misfit, segment_chunks
from lightning_ckpt.plan.foreign import refuse_foreign_checkpointing
from lightning_ckpt.plan.format import BlockPlan, Plan, closest_names
from lightning_ckpt.plan.forwards import (
    CHILD_GUARD,
    PREV_FORWARD,
    Chunk,
    checkpointed_forward,
    child_forward,
    is_ours,
    offloaded_forward,
    segment_head_forward,
    segment_member_forward,
)
from lightning_ckpt.plan.handle import (
    ACTIVE,
    HANDLE_ATTR,
    Patch,
    PlanHandle,
    applied_plan,
    installed_by,
    set_compile_memory_budget,
)
from lightning_ckpt.plan.offload import OffloadPool

__all__ = ["apply_plan", "plan_applied", "reused_forwards"]

_T = TypeVar("_T")
# ``reused_forwards``' memo, by (id(module), what): it holds each module, so an id is never reused while held.
_REUSED: ContextVar[dict[tuple[Any, ...], Any] | None] = ContextVar("lightning_ckpt_reused_forwards", default=None)


@contextlib.contextmanager
def reused_forwards(memo: dict[tuple[Any, ...], Any]) -> Iterator[None]:
    """Plans applied inside give a module a mode it had before with the very forward object it had (``memo``), so to
    dynamo's guards switching back to a plan does not recompile; the caller drops ``memo`` with the compiled graphs."""
    token = _REUSED.set(memo)
    try:
        yield
    finally:
        _REUSED.reset(token)


def _reused(key: tuple[Any, ...], make: Callable[..., _T], *args: Any) -> _T:
    """``make(*args)``, or inside ``reused_forwards`` what it made for ``key`` the first time."""
    memo = _REUSED.get()
    if memo is None:
        return make(*args)
    if key not in memo:
        memo[key] = make(*args)
    return memo[key]


log = logging.getLogger(__name__)

_Install = tuple[nn.Module, str, Any]  # (module, its FQN, the forward to give it)


def _resolve(root: nn.Module, fqn: str, what: str) -> nn.Module:
    try:
        # Unwrapped: a block under torch.compile(block) is patched inside the compiled region, not around it.
        return unwrap_compiled(root.get_submodule(fqn)) if fqn else root
    except AttributeError:
        names = [n for n, _ in root.named_modules() if n]
        raise PlanError(
            f"{what} {fqn!r} does not exist in {type(root).__name__}. Closest module names: "
            f"{closest_names(fqn, names)}. Fix the FQN in the plan, or re-tune for this model."
        ) from None


def _selective_installs(root: nn.Module, block: nn.Module, fqn: str, bp: BlockPlan) -> list[_Install]:
    # A block compiled alone (``block.compile()``, or ``torch.compile(block)`` in its parent): its children's forwards
    # must let one graph serve every block (``forwards.child_forward``).
    wrapper = root.get_submodule(fqn) if fqn else root
    compiled_alone = is_compile_wrapper(wrapper) or getattr(block, "_compiled_call_impl", None) is not None
    installs = []
    for child_name in bp.children:
        try:
            child = block.get_submodule(child_name)
        except AttributeError:
            kids = [n for n, _ in block.named_children()]
            raise PlanError(
                f"Block {fqn!r} has no child {child_name!r} to checkpoint selectively. Its children are: "
                f"{', '.join(kids) or '(none)'}. Fix the 'children' list of this block in the plan."
            ) from None
        if compiled_alone:
            forward = _reused((id(child), "child", None), child_forward, child)
        else:
            forward = _reused((id(child), "checkpoint", None), _checkpointing, child, None)
        installs.append((child, f"{fqn}.{child_name}", forward))
    return installs


def _checkpointing(module: nn.Module, save_list: str | None, saves_inputs: bool = False) -> functools.partial[Any]:
    return functools.partial(checkpointed_forward, module, save_list, BufferGuard([module], saves_inputs=saves_inputs))


def _block_installs(root: nn.Module, plan: Plan) -> list[_Install]:
    installs: list[_Install] = []
    pool: OffloadPool | None = None  # one per plan: every offloaded block's saved tensors, fetched a block ahead
    for fqn, bp in plan.blocks.items():
        block = _resolve(root, fqn, "Block")
        if bp.mode in ("full", "ops", "offload_input"):
            offloaded = bp.mode == "offload_input"
            key = (id(block), "checkpoint", bp.save_list, offloaded)
            forward = _reused(key, _checkpointing, block, bp.save_list, offloaded)
        if bp.mode.startswith("offload"):  # ``offload_input``: the checkpoint's one saved input goes to the pool
            pool = pool or _reused((id(root), "offload pool"), OffloadPool)
            inner = forward if bp.mode == "offload_input" else None
            key = (id(block), bp.mode, id(pool))
            forward = _reused(key, functools.partial, offloaded_forward, block, pool, inner)
        if bp.mode != "selective":
            installs.append((block, fqn, forward))
        else:
            installs += _selective_installs(root, block, fqn, bp)
    return installs


def _segmented_stack(root: nn.Module, plan: Plan, stack_fqn: str, n_chunks: int) -> tuple[nn.Module, list[str]]:
    """The stack ``plan.segments`` names and its children's names, refused unless segments can run on it."""
    stack = _resolve(root, stack_fqn, "Stack")
    if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        raise ApplyError(
            f"segments need a stack that runs its blocks in order (nn.Sequential or nn.ModuleList), but "
            f"{stack_fqn!r} is a {type(stack).__name__}, whose forward may call its children in any order. "
            "Use per-block modes for this model instead of segments."
        )
    names = [n for n, _ in stack.named_children()]
    overlapping = [f for f in plan.blocks if f == stack_fqn or f.startswith(f"{stack_fqn}." if stack_fqn else "")]
    refuse_segment_misfit(stack_fqn, n_chunks, len(names), overlapping)
    return stack, names


def _segment_installs(root: nn.Module, plan: Plan) -> tuple[list[_Install], list[StackWatch]]:
    installs: list[_Install] = []
    watches: list[StackWatch] = []
    for stack_fqn, n_chunks in plan.segments.items():
        stack, names = _segmented_stack(root, plan, stack_fqn, n_chunks)
        key = (id(stack), "segments", n_chunks)
        stack_installs, watch, chunks = _reused(key, _stack_segments, stack, stack_fqn, names, n_chunks)
        # Reused: nothing of a step that ended part-way (a failed trial) is handed out, and the watch starts afresh.
        for chunk in chunks:
            chunk.clear()
        watch.reason = None
        installs += stack_installs
        watches.append(watch)
    return installs, watches


def _stack_segments(
    stack: nn.Module, stack_fqn: str, names: list[str], n_chunks: int
) -> tuple[list[_Install], StackWatch, list[Chunk]]:
    installs: list[_Install] = []
    watch = StackWatch(stack_fqn)
    chunks = []
    # The last chunk is not checkpointed (as in checkpoint_sequential): backward needs its activations first.
    for start, end in segment_chunks(len(names), n_chunks)[:-1]:
        fqns = tuple(f"{stack_fqn}.{n}" if stack_fqn else n for n in names[start:end])
        modules = [unwrap_compiled(stack.get_submodule(n)) for n in names[start:end]]
        chunk = Chunk(fqns, modules, watch)
        chunks.append(chunk)
        installs.append((modules[0], fqns[0], functools.partial(segment_head_forward, modules[0], chunk)))
        for i, m in enumerate(modules[1:], start=1):
            installs.append((m, fqns[i], functools.partial(segment_member_forward, m, chunk, i)))
    return installs, watch, chunks


def _refuse_conflicts(installs: list[_Install]) -> None:
    """Refuse a module planned twice, one already checkpointed by a plan, and a module planned inside another."""
    seen: dict[int, str] = {}
    for module, fqn, _ in installs:
        if id(module) in seen:
            raise PlanError(f"Module {fqn!r} is planned twice (also as {seen[id(module)]!r}). Give it one mode.")
        seen[id(module)] = fqn
        if is_ours(module.__dict__.get("forward")):
            raise ApplyError(
                f"Module {fqn!r} already has lightning_ckpt checkpointing, installed by {installed_by(module)}. "
                "Remove that plan first (handle.remove(), or lightning_ckpt.plan_handle(that model).remove())."
            )
    fqns_planned = sorted(seen.values())
    for a, b in zip(fqns_planned, fqns_planned[1:], strict=False):
        if b.startswith(a + "."):
            raise PlanError(
                f"Module {b!r} is planned inside {a!r}, which is planned too; nested checkpointing recomputes twice. "
                "Plan either the block or its children."
            )


def _install(module: nn.Module, forward: Any) -> Patch:
    prev = module.__dict__.get("forward")
    if prev is not None:
        module.__dict__[PREV_FORWARD] = prev
    module.__dict__["forward"] = forward
    if isinstance(forward, types.MethodType):  # ``forwards.child_forward``: its guard lives on the child
        module.__dict__[CHILD_GUARD] = BufferGuard([module])
    return Patch(module, forward)


def apply_plan(model: nn.Module | ModelView, plan: Plan, *, check_fingerprint: bool = True) -> PlanHandle:
    """Apply ``plan`` to ``model`` in place and return a handle whose ``remove()`` undoes it.

    ``model`` may be a ``ModelView``, whose fingerprint is computed once. Everything is validated before the first
    module is touched, so a refused plan leaves the model as it was. Apply before ``torch.compile``-ing, or reset
    dynamo afterwards: a compiled graph does not see a changed forward until it recompiles. A plan's
    ``compile_memory_budget`` is set process-wide until ``remove()``.
    """
    root = model.root if isinstance(model, ModelView) else unwrap_compiled(model)
    current = applied_plan(root)
    if current is not None:
        raise ApplyError(
            f"A plan is already applied to this {type(root).__name__} ({current.describe()}). "
            "Call handle.remove() on the handle apply_plan returned (or lightning_ckpt.plan_handle(model).remove(), "
            "e.g. for a copy or a loaded model) before applying another plan."
        )
    if check_fingerprint:
        plan.check_fingerprint(model if isinstance(model, ModelView) else root)
    refuse_foreign_checkpointing(root, plan)
    installs = _block_installs(root, plan)
    segment_installs, watches = _segment_installs(root, plan)
    installs += segment_installs
    _refuse_conflicts(installs)

    # Process-wide while the plan is applied: the partitioner reads it at every (re)compile.
    budget = plan.compile_memory_budget
    previous_budget = set_compile_memory_budget(budget) if budget is not None else None
    patches = [_install(module, forward) for module, _fqn, forward in installs]
    pool = next((f.args[1] for _m, _f, f in installs if getattr(f, "func", None) is offloaded_forward), None)
    handle = PlanHandle(root, plan, patches, previous_budget, watches, offload_pool=pool)
    ACTIVE[root] = handle
    # Held by the model itself so that a copy of it (deepcopy, pickle, torch.save) carries its own handle.
    root.__dict__[HANDLE_ATTR] = handle
    log.info("lightning_ckpt: applied plan %s (%d modules)", plan.describe(), len(patches))
    return handle


@contextlib.contextmanager
def plan_applied(model: nn.Module | ModelView, plan: Plan, *, check_fingerprint: bool = True) -> Iterator[PlanHandle]:
    """Context manager form: the plan is removed on exit, even when the body raises."""
    handle = apply_plan(model, plan, check_fingerprint=check_fingerprint)
    try:
        yield handle
    finally:
        handle.remove()
