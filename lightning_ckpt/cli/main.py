"""The ``lightning-ckpt`` command: read, compare and check plan files from the shell.

    lightning-ckpt show plans/gpt.json                    the plan, the run it was tuned for, the evidence
    lightning-ckpt diff plans/old.json plans/new.json     what changed between two plans
    lightning-ckpt validate plans/gpt.json --model mypkg.models:build_model
                                                          does the plan fit this model? (for CI)
    lightning-ckpt replan plans/gpt.json --max-memory 40GiB -o plans/gpt-40g.json
                                                          the best plan for another budget, predicted (<1 s)
    lightning-ckpt bench --layers 8                       the seed trade-off table (benchmarks/seed_table.py)

Exit codes: 0 success; 1 a plan or model was refused (the message says why: the plan does not fit the
model, no plan is predicted to fit the budget); 2 bad usage or a bad plan file (an unknown option, a file
that does not exist or is not a well-formed plan, a --model that cannot be imported or that calls sys.exit()).
`diff` follows diff(1) and `git diff`: 0, or with --exit-code 0 same / 1 different; 2 on any error,
a plan file that does not load included (so 1 only ever means "the plans differ").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_ckpt import __version__
from lightning_ckpt.cli.bench import run_bench
from lightning_ckpt.cli.diff import DIFF_JSON_HELP, run_diff
from lightning_ckpt.cli.replan import run_replan
from lightning_ckpt.cli.show import SHOW_JSON_HELP, run_show
from lightning_ckpt.cli.usage import EXIT_REFUSED, EXIT_USAGE, UsageError
from lightning_ckpt.cli.validate import run_validate
from lightning_ckpt.errors import LightningCkptError, PlanError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-ckpt",
        description="Read, compare and check activation-checkpointing plan files.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lightning-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{show,diff,validate,replan,bench}")
    for add in (_add_show, _add_diff, _add_validate, _add_replan, _add_bench):
        add(sub)
    return parser


def _add_show(sub: argparse._SubParsersAction) -> None:
    show = sub.add_parser(
        "show",
        help="print a plan file: blocks, the run it was tuned for, measured figures",
        description="Print a plan file: its blocks, the run and budget it was tuned for, the search and the "
        "figures measured while tuning.",
        epilog=SHOW_JSON_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("plan", help="path to a plan JSON file")
    show.add_argument("--json", action="store_true", help="print one JSON object for scripts (keys below)")
    show.set_defaults(func=run_show)


def _add_diff(sub: argparse._SubParsersAction) -> None:
    diff = sub.add_parser(
        "diff",
        help="what changed between two plan files (--exit-code: 1 when they differ)",
        description="Compare two plan files: checkpointing (blocks, segments, torch.compile budget), fingerprint "
        "and budget (by value), then run, versions and measured figures. Exit codes as diff(1): 0, or with "
        "--exit-code 0 same / 1 different; 2 on any error (a missing or malformed plan file included).",
        epilog=DIFF_JSON_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("a", help="the older plan file")
    diff.add_argument("b", help="the newer plan file")
    diff.add_argument(
        "--exit-code",
        action="store_true",
        help="exit 1 when the plans differ in checkpointing, fingerprint or budget, 0 when not (as git diff)",
    )
    diff.add_argument("--json", action="store_true", help="print one JSON object for scripts (keys below)")
    # A plan that does not load is trouble (2), never "different" (1): a CI job must not read it as a change.
    diff.set_defaults(func=run_diff, error_exit=EXIT_USAGE)


def _add_validate(sub: argparse._SubParsersAction) -> None:
    validate = sub.add_parser(
        "validate",
        help="check a plan file (schema, names, budget, profile), and with --model against a model: fingerprint "
        "and every block name (exit 0 OK, 1 refused, 2 not a well-formed plan file)",
        description="Check that the plan file is well formed (the schema, block names, budget, plan table and saved "
        "profile as every reader of it checks them). With --model, also build the model and check that the plan was "
        "tuned for it (fingerprint) and that every block it names exists and can be checkpointed. Nothing is trained.",
    )
    validate.add_argument("plan", help="path to a plan JSON file")
    validate.add_argument(
        "--model",
        default=None,
        help="MODULE:CALLABLE or FILE.py:CALLABLE, e.g. mypkg.models:build_model or models.py:build_model; a "
        "callable taking no arguments that returns the model the plan was tuned on (with the Lightning callback: "
        "the LightningModule)",
    )
    validate.set_defaults(func=run_validate)


def _add_replan(sub: argparse._SubParsersAction) -> None:
    replan = sub.add_parser(
        "replan",
        help="the best plan for another budget, predicted from the profile the plan file keeps (no model, <1 s)",
        description="Score every plan of the searched space with the memory and time models the plan file keeps, "
        "and print the fastest predicted to fit the new budget, marked predicted (nothing is run). With -o it is "
        "written as a plan file; a run applying it has its first real steps checked by the budget guard.",
    )
    replan.add_argument("plan", help="path to a plan JSON file written by a search (it keeps metadata['profile'])")
    budget = replan.add_mutually_exclusive_group()
    budget.add_argument("--max-memory", help="peak memory budget: bytes or a size (40GiB), or a device share (0.8)")
    budget.add_argument(
        "--activation-budget", type=float, help="a share of the no-checkpointing activation memory, e.g. 0.5"
    )
    replan.add_argument(
        "--batch-size", type=int, help="re-plan for another batch size (activations and step time scale linearly)"
    )
    replan.add_argument("-o", "--output", help="write the re-planned plan to this file")
    replan.add_argument("--json", action="store_true", help="print one JSON object for scripts")
    replan.set_defaults(func=run_replan)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="run benchmarks/seed_table.py (memory saved and recompute cost per baseline plan)",
        description="Run benchmarks/seed_table.py from this checkout. Every other argument goes to the script "
        "(--layers, --embd, --seq, --batch, --dropout, --out; see `python benchmarks/seed_table.py --help`).",
        allow_abbrev=False,
    )
    bench.add_argument("--script", help="the benchmark script to run (default: benchmarks/seed_table.py)")
    bench.set_defaults(func=run_bench)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if extra and args.func is not run_bench:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if args.func is run_bench else args.func(args)
    except (UsageError, LightningCkptError) as err:
        print(f"lightning-ckpt {args.command}: error: {err}", file=sys.stderr)
        # A file that is not a well-formed plan is bad input, as a missing one is.
        return EXIT_USAGE if isinstance(err, (UsageError, PlanError)) else getattr(args, "error_exit", EXIT_REFUSED)
