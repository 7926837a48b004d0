"""``lightning-ckpt replan``: the best plan for another budget, predicted from the profile a plan file keeps
(``search.replan``): no model is built and nothing runs."""

from __future__ import annotations

import argparse
import json

from lightning_ckpt.cli.usage import EXIT_OK, UsageError, load_plan
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.plan.table import PlanTable, table_line
from lightning_ckpt.search.replan import replan

__all__ = ["run_replan"]


def run_replan(args: argparse.Namespace) -> int:
    if args.max_memory is None and args.activation_budget is None:
        raise UsageError("give the new budget: --max-memory (e.g. 40GiB) or --activation-budget (e.g. 0.5).")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, but got {args.batch_size}.")
    plan = load_plan(args.plan)
    try:
        max_memory = float(args.max_memory) if _is_fraction(args.max_memory) else args.max_memory
        result = replan(
            plan,
            max_memory=max_memory,
            activation_budget=args.activation_budget,
            batch_size=args.batch_size,
            source=args.plan,
        )
    except ConfigurationError as err:
        raise UsageError(str(err)) from None
    table = PlanTable.of_plan(result.plan)
    if args.json:
        out = {
            "predicted": True,
            "plan": result.plan.describe(),
            "budget": result.budget.description,
            "batch_size": result.batch_size,
            "predicted_seconds": result.predicted_seconds,
            "predicted_samples_per_second": result.predicted_samples_per_second,
            "predicted_peak_bytes": result.predicted_peak_bytes,
            "predicted_activation_bytes": result.predicted_activation_bytes,
            "plans_scored": result.considered,
            "plans_fitting": result.fitting,
            "time_measured": result.time_measured,
            "notes": list(result.notes),
            "plan_table": table.describe() if table else None,
            "written": args.output,
        }
        print(json.dumps(out, indent=2))
    else:
        print(result.describe())
        for note in result.notes:
            print(f"note: {note}")
        if table is not None:
            print(table_line(table, result.budget) + " (each bucket re-planned from the profile it keeps)")
    if args.output:
        path = result.plan.save(args.output)
        if not args.json:
            print(f"wrote {path} (marked predicted: metadata['replanned']; the budget guard checks its first steps)")
    return EXIT_OK


def _is_fraction(value: str | None) -> bool:
    """``--max-memory 0.8`` is a share of the device, as ``max_memory=0.8`` is; anything else is bytes or a size."""
    try:
        return value is not None and 0 < float(value) <= 1 and "." in value
    except ValueError:
        return False
