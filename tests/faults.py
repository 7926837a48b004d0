"""Fault injection for reliability tests: make a step raise, a plan file fail to save, a SIGTERM arrive.

Each injector is a context manager that undoes itself on exit and yields a ``Fault`` that counts the
calls it saw and says whether it fired, so a test can check the fault really happened where it meant
it to. ``snapshot_model`` / ``assert_model_intact`` check what a fault must never leave behind: a
patched forward, a renamed or missing module or state_dict key, a changed weight or buffer.

    before = snapshot_model(model)
    with fail_on_call(model, "training_step", at=3), pytest.raises(InjectedFault):
        trainer.fit(model)
    assert_model_intact(model, before)
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "Fault",
    "InjectedFault",
    "ModelSnapshot",
    "assert_model_intact",
    "fail_on_call",
    "fail_plan_save",
    "sigterm_handler",
    "sigterm_on_call",
    "snapshot_model",
]


class InjectedFault(RuntimeError):
    """The default error an injector raises, so a test can tell it from a real failure."""


@dataclass
class Fault:
    """What an injector saw: how many calls it intercepted and whether (and at which call) it fired."""

    at: int
    calls: int = 0
    fired: bool = False
    fired_at: list[int] = field(default_factory=list)

    def _tick(self) -> bool:
        self.calls += 1
        if self.calls == self.at:
            self.fired, self.fired_at = True, [*self.fired_at, self.calls]
            return True
        return False


@contextlib.contextmanager
def _patch_method(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Set an instance attribute wrapping ``obj.name``; on exit restore exactly what the instance had."""
    had_own = name in vars(obj)
    own = vars(obj).get(name)
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, own)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def fail_on_call(
    obj: Any, name: str = "training_step", *, at: int, exc: BaseException | None = None
) -> Iterator[Fault]:
    """Make ``obj.name(...)`` raise ``exc`` (default ``InjectedFault``) at its ``at``-th call (1-based).

    Every other call goes through to the original method. Works on a LightningModule's
    ``training_step`` (Lightning looks the method up on the instance) or on any object's method.
    """
    fault = Fault(at)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if fault._tick():
                raise exc if exc is not None else InjectedFault(f"injected fault in {name} call {fault.calls}")
            return original(*args, **kwargs)

        return wrapped

    with _patch_method(obj, name, make):
        yield fault


@contextlib.contextmanager
def sigterm_on_call(obj: Any, name: str = "training_step", *, at: int) -> Iterator[Fault]:
    """Send SIGTERM to this process at the start of the ``at``-th call of ``obj.name``, then run the call.

    The signal is handled by whatever handler is installed (Lightning's trainer installs one during
    ``fit`` that stops at the next step boundary). Without a handler SIGTERM ends the process, so use
    this only under a Trainer or inside ``sigterm_handler()``. POSIX only; main thread only.
    """
    fault = Fault(at)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if fault._tick():
                os.kill(os.getpid(), signal.SIGTERM)  # the Python handler runs before kill() returns to us
            return original(*args, **kwargs)

        return wrapped

    with _patch_method(obj, name, make):
        yield fault


@contextlib.contextmanager
def sigterm_handler() -> Iterator[list[int]]:
    """Record SIGTERMs instead of dying of them (for tests without a Trainer); restores the old handler."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_plan_temp(path: Any) -> bool:
    # Plan.save writes ".<name>.<random>.tmp" beside the target, then renames it over the target.
    name = Path(os.fsdecode(path)).name
    return name.startswith(".") and name.endswith(".tmp")


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # not Linux: treat every fsync in the window as the plan's
        return ".unknown.tmp"


@contextlib.contextmanager
def fail_plan_save(stage: str = "replace", *, at: int = 1, exc: BaseException | None = None) -> Iterator[Fault]:
    """Make the ``at``-th ``Plan.save`` fail at ``stage``: ``"write"`` (flushing the temporary file to disk)
    or ``"replace"`` (renaming it over the plan file). The default error is ``OSError(ENOSPC)``.

    Only the plan's own temporary file is affected; ``os.replace``/``os.fsync`` calls for other files
    (a Lightning checkpoint, a log) go through.
    """
    if stage not in ("write", "replace"):
        raise ValueError(f"stage must be 'write' or 'replace', but got {stage!r}")
    fault = Fault(at)
    error = exc if exc is not None else OSError(errno.ENOSPC, "No space left on device (injected)")
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if stage == "replace" and _is_plan_temp(src) and fault._tick():
            raise error
        return real_replace(src, dst, *args, **kwargs)

    def fsync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        if stage == "write" and _is_plan_temp(_fd_path(number)) and fault._tick():
            raise error
        return real_fsync(fd)

    os.replace, os.fsync = replace, fsync
    try:
        yield fault
    finally:
        os.replace, os.fsync = real_replace, real_fsync


# ---------------------------------------------------------------------------------------------------
# Is the model intact?
# ---------------------------------------------------------------------------------------------------
_OUR_ATTRS = ("forward", "_lightning_ckpt_prev_forward")


@dataclass(frozen=True)
class ModelSnapshot:
    """What ``assert_model_intact`` compares against: taken by ``snapshot_model`` before the fault."""

    modules: tuple[tuple[str, str], ...]  # (FQN, class name) in order
    state_keys: tuple[str, ...]
    state: dict[str, torch.Tensor]  # detached copies
    parameter_ids: dict[str, int]
    instance_attrs: dict[str, dict[str, int]]  # FQN -> {"forward": id(...)} for instance-level forwards
    training: dict[str, bool]
    requires_grad: dict[str, bool]


def snapshot_model(model: nn.Module) -> ModelSnapshot:
    """Copy everything ``assert_model_intact`` checks (weights and buffers are cloned)."""
    state = model.state_dict(keep_vars=True)
    return ModelSnapshot(
        modules=tuple((fqn, type(m).__name__) for fqn, m in model.named_modules()),
        state_keys=tuple(state),
        state={k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)},
        parameter_ids={fqn: id(p) for fqn, p in model.named_parameters()},
        instance_attrs={
            fqn: {a: id(vars(m)[a]) for a in _OUR_ATTRS if a in vars(m)} for fqn, m in model.named_modules()
        },
        training={fqn: m.training for fqn, m in model.named_modules()},
        requires_grad={fqn: p.requires_grad for fqn, p in model.named_parameters()},
    )


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (so NaN equals the same NaN, and -0.0 differs from 0.0), on any device."""
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


def assert_model_intact(model: nn.Module, before: ModelSnapshot, *, weights: bool = True) -> None:
    """Assert ``model`` is as ``before`` found it: no instance ``forward`` left behind (apply.py installs
    them; see ``applied_plan``), the same modules, FQNs, ``state_dict`` keys and parameter objects,
    the same train/eval modes and ``requires_grad`` flags, and (``weights=True``) every weight and buffer
    bitwise equal. Pass ``weights=False`` after real optimizer steps, which legitimately change them.
    """
    problems = []
    now_attrs = {fqn: {a: id(vars(m)[a]) for a in _OUR_ATTRS if a in vars(m)} for fqn, m in model.named_modules()}
    for fqn, attrs in now_attrs.items():
        if attrs != before.instance_attrs.get(fqn, {}):
            left = sorted(set(attrs) | set(before.instance_attrs.get(fqn, {})))
            problems.append(f"module {fqn or '<root>'!r} has instance attribute(s) {left} changed or left behind")
    modules = tuple((fqn, type(m).__name__) for fqn, m in model.named_modules())
    if modules != before.modules:
        gone = sorted(set(before.modules) - set(modules))[:5]
        new = sorted(set(modules) - set(before.modules))[:5]
        problems.append(f"module tree changed: missing {gone}, new {new}")
    state = model.state_dict(keep_vars=True)
    if tuple(state) != before.state_keys:
        gone = sorted(set(before.state_keys) - set(state))[:5]
        new = sorted(set(state) - set(before.state_keys))[:5]
        problems.append(f"state_dict keys changed: missing {gone}, new {new}")
    params = {fqn: id(p) for fqn, p in model.named_parameters()}
    replaced = sorted(k for k in params.keys() & before.parameter_ids.keys() if params[k] != before.parameter_ids[k])
    if replaced:
        problems.append(f"parameter objects replaced: {replaced[:5]}")
    flipped = sorted(fqn for fqn, m in model.named_modules() if before.training.get(fqn, m.training) != m.training)
    if flipped:
        problems.append(f"train/eval mode changed on {flipped[:5]}")
    grad_flags = sorted(
        fqn for fqn, p in model.named_parameters() if before.requires_grad.get(fqn, p.requires_grad) != p.requires_grad
    )
    if grad_flags:
        problems.append(f"requires_grad changed on {grad_flags[:5]}")
    if weights:
        changed = sorted(
            k
            for k, v in before.state.items()
            if k in state
            and not (
                isinstance(state[k], torch.Tensor)
                and state[k].shape == v.shape
                and state[k].dtype == v.dtype
                and _bitwise_equal(state[k].detach(), v)
            )
        )
        if changed:
            problems.append(f"weights or buffers differ from the snapshot: {changed[:5]}")
    assert not problems, "model not intact:\n  " + "\n  ".join(problems)
