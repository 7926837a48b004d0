"""The documentation site says what the package has: its extras install what they are for, the API page shows
documented constants without private source, and the CLI list names every command (issue 35, item 12)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

from lightning_ckpt.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_extra_builds_the_site_and_the_browser_comes_only_with_the_screenshots_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.startswith("playwright") for dep in extras["docs"]), "mkdocs needs no browser"
    assert any(dep.startswith("playwright") for dep in extras["screenshots"])
    assert '".[screenshots]"' in (ROOT / "docs" / "screenshots.py").read_text()


def _directives(text: str) -> list[tuple[str, str]]:
    """(target, options block) of every ``::: target`` in a page."""
    return re.findall(r"^::: (\S+)\n((?:    .*\n)*)", text, flags=re.M)


def test_every_constant_on_the_api_page_is_documented_and_shows_no_private_source():
    for target, options in _directives((ROOT / "docs" / "api.md").read_text()):
        module, _, name = target.rpartition(".")
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        if not path.exists():
            continue  # a name re-exported by a package root: documented where it lives
        body = ast.parse(path.read_text()).body
        for i, node in enumerate(body):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
                continue
            following = body[i + 1] if i + 1 < len(body) else None
            documented = isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant)
            assert documented, f"{target} has no docstring (a string right after the assignment)"
            private = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id.startswith("_")}
            if private:
                assert "show_attribute_values: false" in options, f"{target} would show private names {private}"


def test_the_docs_name_every_cli_command():
    commands = re.search(r"\{(.+)\}", build_parser()._subparsers._group_actions[0].metavar).group(1).split(",")
    index = (ROOT / "docs" / "index.md").read_text()
    listed = re.search(r"`lightning-ckpt`\s+command \(([^)]*)\)", index).group(1)
    missing = [c for c in commands if f"`{c}`" not in listed and c != "bench"]
    assert not missing, f"docs/index.md's command list leaves out {missing}"
    plan_files = (ROOT / "docs" / "plan-files.md").read_text()
    assert all(f"lightning-ckpt {c}" in plan_files for c in commands)
