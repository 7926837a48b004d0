"""``lightning-ckpt bench``: run the repository's benchmark script as ``python script.py ARGS`` would."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from lightning_ckpt.cli.usage import EXIT_OK, EXIT_REFUSED, UsageError

__all__ = ["run_bench"]


def _find_benchmark(name: str) -> Path | None:
    """The script in the checkout this package itself was installed from (``pip install -e``), or None (a wheel):
    never the current directory's, where another checkout's script would run."""
    root = Path(__file__).resolve().parents[2]
    candidate = root / "benchmarks" / name
    return candidate if (root / "pyproject.toml").is_file() and candidate.is_file() else None


def run_bench(args: argparse.Namespace, extra: list[str]) -> int:
    script = Path(args.script) if args.script else _find_benchmark("seed_table.py")
    if script is None or not script.is_file():
        where = repr(args.script) if args.script else "benchmarks/seed_table.py"
        raise UsageError(
            f"{where} not found. `lightning-ckpt bench` runs the repository's benchmark script, which is not part of "
            "an installed wheel: install lightning-ckpt from a checkout (pip install -e .), or pass --script PATH."
        )
    # Run it as `python script.py ARGS` would: its own argv, its directory importable.
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *extra]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return EXIT_REFUSED
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return EXIT_OK
