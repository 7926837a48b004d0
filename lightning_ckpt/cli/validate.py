"""``lightning-ckpt validate``: is a plan file well formed, and does it fit a model the user names with ``--model``?

Loading the user's code is the delicate part: a ``sys.exit()`` in it is reported as a usage error rather than ending the
command with the model's exit code."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning_ckpt.cli.usage import EXIT_OK, EXIT_REFUSED, UsageError, load_plan
from lightning_ckpt.errors import LightningCkptError
from lightning_ckpt.plan.format import Plan, closest_names
from lightning_ckpt.plan.table import PlanTable

__all__ = ["build_model", "check_plan", "load_factory", "run_validate"]


def load_factory(spec: str) -> Callable[[], Any]:
    """``pkg.module:factory`` or ``path/to/file.py:factory`` -> the object it names; the current directory and a
    file's own directory are importable (as with ``python -m`` and ``python file.py``)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(
            f"--model {spec!r} must be MODULE:CALLABLE or FILE.py:CALLABLE, e.g. mypkg.models:build_model or "
            "models.py:build_model, where the callable takes no arguments and returns the nn.Module."
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"--model {spec!r}: the file {target!r} does not exist.")
        loader_spec = importlib.util.spec_from_file_location(f"_lightning_ckpt_model_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise UsageError(f"--model {spec!r}: {target!r} cannot be loaded as a Python file.")
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            with _running_user_code(spec, f"importing {target!r}", f"importing {target!r} failed:"):
                loader_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # console scripts do not put the current directory on the path
        with _running_user_code(spec, f"importing module {target!r}", f"cannot import module {target!r}:"):
            module = importlib.import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise UsageError(
                f"--model {spec!r}: {target!r} has no attribute {attr!r}. Closest names: {closest_names(part, names)}."
            )
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def _running_user_code(spec: str, doing: str, failed: str, error: type[Exception] = UsageError) -> Iterator[None]:
    """The user's code failing, as ``error``. SystemExit is not an Exception: left alone it would end ``validate``
    silently with the model's exit code (0 for a bare ``sys.exit()``, which a CI job would take for a pass)."""
    try:
        yield
    except SystemExit as exit_:
        call = "sys.exit()" if exit_.code is None else f"sys.exit({exit_.code!r})"
        raise UsageError(
            f"--model {spec!r}: {doing} called {call} (SystemExit), so no model was built and the plan was not "
            "checked. The code that --model loads must only define the model: move the script part (argument "
            'parsing, training) under `if __name__ == "__main__":`, or point --model at a module that does not run a '
            "script when imported."
        ) from None
    except Exception as err:
        raise error(f"--model {spec!r}: {failed} {type(err).__name__}: {err}") from None


def build_model(spec: str) -> Any:
    """Call the factory that ``spec`` names and check it gave an ``nn.Module`` (an instance is used as is)."""
    from torch import nn

    obj = load_factory(spec)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise UsageError(f"--model {spec!r} names a {type(obj).__name__}, not a callable that returns an nn.Module.")
    with _running_user_code(spec, "calling it", "calling it with no arguments raised", LightningCkptError):
        model = obj()
    if not isinstance(model, nn.Module):
        raise LightningCkptError(f"--model {spec!r} returned {type(model).__name__} {model!r:.60}, not an nn.Module.")
    return model


def _prefix_hint(missing: str, names: list[str]) -> str:
    """Spot the usual cause of missing names: the plan was tuned on a wrapper of this model, or vice versa."""
    longer = [n for n in names if n.endswith("." + missing)]
    if longer:
        prefix = longer[0][: -len(missing)]
        return (
            f"this model has {missing!r} as {longer[0]!r}: the plan was tuned on the inner model; have the factory return "
            f"the module at {prefix.rstrip('.')!r}, or re-tune on this model."
        )
    parts = missing.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[i:]) in names:
            prefix = ".".join(parts[:i])
            return (
                f"without the leading {prefix + '.'!r}, {missing!r} exists: the plan was tuned on a wrapper (such as the "
                f"LightningModule) whose {prefix!r} attribute holds this model; have the factory return that wrapper."
            )
    return ""


def check_plan(plan: Plan, model: Any) -> list[str]:
    """Every reason ``plan`` does not fit ``model`` (empty when it fits). The model is left as it was."""
    # torch, here and not at import: the other commands read plan files without it.
    from lightning_ckpt.discovery import canonical_fqn, unwrap_compiled
    from lightning_ckpt.model import model_fingerprint
    from lightning_ckpt.plan.apply import apply_plan

    root = unwrap_compiled(model)
    problems = []
    if plan.fingerprint is not None and (actual := model_fingerprint(root)) != plan.fingerprint:
        problems.append(
            f"fingerprint: the plan was tuned for a model with fingerprint {plan.fingerprint}, but this "
            f"{type(root).__name__} has {actual} (module tree, parameter shapes or dtypes differ). Re-tune for it."
        )
    # Plans name modules without the "_orig_mod" steps a nested torch.compile wrapper adds.
    names = list(dict.fromkeys(canonical_fqn(n) for n, _ in root.named_modules() if n))
    name_set = set(names)
    missing = [fqn for fqn in [*plan.blocks, *plan.segments] if fqn and fqn not in name_set]
    for fqn in missing:
        what = "stack" if fqn in plan.segments else "block"
        problems.append(
            f"{what} {fqn!r} does not exist in this {type(root).__name__}. Closest names: {closest_names(fqn, names)}."
        )
    if missing and (hint := _prefix_hint(missing[0], names)):
        problems.append(f"hint: {hint}")
    if not missing:
        # Names resolve: let apply_plan judge the rest (children, nesting, segment stacks), then undo it.
        try:
            apply_plan(root, plan, check_fingerprint=False).remove()
        except LightningCkptError as err:
            problems.append(f"apply: {err}")
    return problems


def run_validate(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)  # the schema, names and budget: an unreadable or malformed file is refused here
    PlanTable.of_plan(plan, source=str(args.plan))  # as the callback reads it: a malformed table is a PlanError
    if args.model is None:
        profile = plan.provenance.profile
        if profile:
            from lightning_ckpt.search.replan import SavedProfile

            # As replan reads it: a profile that cannot be re-planned from is a PlanError (exit 2, as a bad file).
            SavedProfile.of_plan(plan, source=str(args.plan))
        kept = "a profile to re-plan from" if profile else "no profile"
        print(
            f"OK: {args.plan} is a well-formed plan file ({plan.describe()}; {kept}); give --model "
            "MODULE:CALLABLE to check it against the model too"
        )
        return EXIT_OK
    model = build_model(args.model)
    problems = check_plan(plan, model)
    if problems:
        print(f"REFUSED: {args.plan} does not fit {args.model} ({type(model).__name__}):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return EXIT_REFUSED
    checked = "fingerprint and block names" if plan.fingerprint else "block names (no fingerprint recorded)"
    print(f"OK: {args.plan} fits {args.model} ({type(model).__name__}; {plan.describe()}; checked {checked})")
    return EXIT_OK
