"""The package layout keeps the data flow one-way: a stage never imports a later one, and each outside
library (Lightning, Optuna, TensorBoard and matplotlib) is imported by one subpackage only."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lightning_ckpt"
# Data-flow order. The top-level modules (errors, versions, stacks, discovery, model, budget, formatting) are shared by
# every stage.
STAGES = ("plan", "measure", "timing", "memory", "search", "report", "lightning", "cli")
# Imports past ``__all__`` in the search core, rewritten elsewhere: each entry goes when its import is fixed.
LIBRARIES = {"lightning": "lightning", "pytorch_lightning": "lightning", "optuna": "search",
             "tensorboard": "report", "matplotlib": "report"}  # fmt: skip


def _stage(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 and parts[0] in STAGES else None


def _imports(path: Path) -> list[tuple[str, int]]:
    """Modules imported at run time (``if TYPE_CHECKING:`` blocks left out), with their line numbers."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body for n in ast.walk(child)
    }  # fmt: skip
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, node.lineno))
    return out


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "testing" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_stage_imports_only_earlier_stages_and_its_own_libraries(path):
    stage = _stage(path)
    rank = STAGES.index(stage) if stage else -1
    if path == PACKAGE / "__init__.py":
        rank = len(STAGES)  # the package root re-exports the public names of every stage
    for module, line in _imports(path):
        parts = module.split(".")
        if parts[0] == "lightning_ckpt" and len(parts) > 1 and parts[1] in STAGES:
            assert STAGES.index(parts[1]) <= rank, f"{path.name}:{line} imports the later stage {module}"
        owner = LIBRARIES.get(parts[0])
        if owner is not None:
            assert stage == owner, f"{path.name}:{line} imports {parts[0]}, which only lightning_ckpt/{owner}/ may"


def test_the_lazy_package_root_names_each_export_once_where_it_lives():
    """The root imports nothing at run time (``__getattr__`` loads a name on first use); its ``TYPE_CHECKING``
    imports are what type checkers and the API docs read. Both, and ``__all__``, must name the same places."""
    import lightning_ckpt

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    typed = {
        alias.name: node.module
        for guard in tree.body
        if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
        for node in guard.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == lightning_ckpt._EXPORTS
    assert set(lightning_ckpt.__all__) == {*lightning_ckpt._EXPORTS, "__version__"}
    for name, module in lightning_ckpt._EXPORTS.items():
        assert getattr(lightning_ckpt, name) is getattr(importlib.import_module(module), name), name


# Inside ``search/``, the same one-way flow: the record and its ledger first, the loop and the phases after it, the
# entry points (``tune``, the joint micro-batch search) last.
SEARCH_ORDER = ("ledger", "space", "config", "distributed", "choice", "verdict", "runners", "rounds", "dynamo", "assembly",
                "compile", "trials", "sampler", "loop", "confirmation", "phases", "result", "whole_check", "pipeline",
                "setup", "replan", "tune", "buckets", "microbatch")  # fmt: skip


def test_the_search_modules_import_only_earlier_ones():
    found = {p.stem for p in (PACKAGE / "search").glob("*.py")} - {"__init__"}
    assert found == set(SEARCH_ORDER), "every search module has its place in SEARCH_ORDER"
    for name in SEARCH_ORDER:
        for module, line in _imports(PACKAGE / "search" / f"{name}.py"):
            parts = module.split(".")
            if parts[:2] == ["lightning_ckpt", "search"] and len(parts) > 2:
                assert SEARCH_ORDER.index(parts[2]) < SEARCH_ORDER.index(name), (
                    f"search/{name}.py:{line} imports {module}"
                )


def _module_path(module: str) -> Path | None:
    """The file of ``lightning_ckpt.x.y`` (a module or a package's ``__init__``), or None outside the package."""
    parts = module.split(".")
    if parts[0] != "lightning_ckpt":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _declared_all(path: Path) -> set[str] | None:
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return set(ast.literal_eval(node.value))
    return None


def _private_imports() -> list[str]:
    """``path: module.name`` for every import of a name its module's ``__all__`` does not list (or a ``_`` name)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            source = _module_path(node.module)
            if source is None:
                continue
            public = _declared_all(source) or set()
            for alias in node.names:
                if _module_path(f"{node.module}.{alias.name}") is not None:
                    continue  # a submodule
                if alias.name.startswith("_") and alias.name != "__version__" or alias.name not in public:
                    found.append(f"{path.relative_to(PACKAGE.parent)}: {node.module}.{alias.name}")
    return found


def test_a_module_imports_only_the_names_its_source_module_exports():
    """``__all__`` is each module's interface: a name another module needs is exported where it lives, never
    reached for past ``__all__`` (and never a ``_`` name)."""
    leaks = _private_imports()
    assert not leaks, "imports of names outside their module's __all__:\n" + "\n".join(leaks)
