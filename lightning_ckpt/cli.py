"""The ``lightning-ckpt`` command: inspect plan files from the shell.

Exit codes: 0 success, 1 a plan or model was refused (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_ckpt import __version__
from lightning_ckpt.errors import LightningCkptError
from lightning_ckpt.plan import Plan


def _show(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    print(f"plan:        {plan.name or '(unnamed)'}  [{plan.describe()}]")
    print(f"fingerprint: {plan.fingerprint or '(not checked)'}")
    width = max([len(f) for f in plan.blocks] + [5])
    if plan.blocks:
        print(f"\n{'block':<{width}}  mode")
        for fqn, bp in plan.blocks.items():
            print(f"{fqn:<{width}}  {bp.describe()}")
    for fqn, n in plan.segments.items():
        print(f"segments: {fqn or '<root>'} in {n} chunks")
    for key, value in plan.metadata.items():
        print(f"{key}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-ckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lightning-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command")
    show = sub.add_parser("show", help="print a plan file as a table")
    show.add_argument("plan", help="path to a plan JSON file")
    show.set_defaults(func=_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except LightningCkptError as err:
        print(f"lightning-ckpt: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
