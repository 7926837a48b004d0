"""A PT2 budget chosen on blocks compiled alone, checked compiled the user's way before it is kept.

Where the user compiles several blocks in one graph, PT2's ``activation_memory_budget`` is one knapsack over every
block's ops, not one per block, so a budget does not rank on the blocks as it runs. Budgets near the limit are
partitioned as the user's compile partitions them, and a chosen budget is weighed against our fastest fitting plans:
on the blocks, where it must lead by ``whole_compile_margin``, or (``check_whole_compile=True``) compiled the user's
way. Measurements: docs/compile.md.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

from lightning_ckpt.formatting import format_bytes
from lightning_ckpt.measure.harness import StepHarness
from lightning_ckpt.memory.compiled import CompiledMemoryModel
from lightning_ckpt.plan.format import Plan
from lightning_ckpt.search.compile import CompiledTrials
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.ledger import TrialRecord, TrialStatus
from lightning_ckpt.search.rounds import CLAIM_HALF_WIDTH, ConfirmEntry, SideBySide, confirm_interleaved, retimer
from lightning_ckpt.search.trials import Trials
from lightning_ckpt.search.verdict import Verdict

__all__ = [
    "Partitioned",
    "WholeCheck",
    "check_whole_compile",
    "holds_several_blocks",
    "outside_blocks_bytes",
    "partition_pt2_budgets",
    "pt2_budget_check",
    "compiles_of",
    "weigh_on_blocks",
]

log = logging.getLogger(__name__)


def holds_several_blocks(regions: Sequence[str], blocks: Sequence[str]) -> bool:
    """Whether one compiled region (``""``: the whole model) holds several ``blocks``: one PT2 knapsack over them."""
    return any(sum(b.startswith(f"{region}." if region else "") for b in blocks) > 1 for region in regions)


@dataclass(frozen=True)
class WholeCheck:
    """What the check did: the PT2 budget (``leader``) against our fastest fitting plan (``rival``), compiled the
    user's way or on the blocks; ``ratio``: the rival's speed over the leader's, paired by round (90% interval)."""

    leader: str
    rival: str
    leader_fits: bool
    rival_fits: bool
    ratio: float | None
    low: float | None
    high: float | None
    rounds: int
    kept: str
    graphs: int
    compile_seconds: float
    seconds: float
    compile_seconds_each: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the plain model's, the leader's, the rival's
    compiled_whole: bool = True
    margin: float = 0.0
    rivals: tuple[str, ...] = ()  # every plan of ours weighed; ``rival``: the fastest of them against the leader

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def describe(self) -> str:
        speed = (
            f"{self.rival} ran {self.ratio:.3f}x its speed ({self.low:.3f}-{self.high:.3f}, {self.rounds} rounds)"
            if self.ratio is not None and self.low is not None and self.high is not None
            else "they were not re-timed side by side"
        )
        where = "compiled your way" if self.compiled_whole else "on the blocks compiled alone"
        fits = "" if self.leader_fits and self.rival_fits else (
            f"; {where} {self.leader if not self.leader_fits else self.rival} is over budget"
        )  # fmt: skip
        lead = f"; the budget is kept only more than {self.margin:.0%} faster" if self.margin else ""
        return f"{self.leader}, {where} beside {self.rival}: {speed}{fits}{lead}; kept {self.kept}"


@dataclass(frozen=True)
class Partitioned:
    """A PT2 budget's bytes on the blocks and partitioned whole (None: the partition failed), and whether that fits."""

    plan: str
    on_blocks: int | None
    whole: int | None
    fits: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.whole is None:
            return f"{self.plan} failed to partition as your compile partitions it, so it is not kept"
        return (
            f"{self.plan} partitioned as your compile partitions it (no kernels, {self.seconds:.1f} s): "
            f"{format_bytes(self.whole)} against {format_bytes(self.on_blocks)} on the blocks compiled alone, "
            f"{'within' if self.fits else 'over'} the budget"
        )


# PT2 budgets over budget on the blocks partitioned whole: each costs one partition of the user's compiled regions.
PARTITIONS = 1


def outside_blocks_bytes(profiled: Any) -> int:
    """Bytes the compiled ``none`` step saves outside the blocks, which a whole graph may recompute (0: unknown)."""
    none = getattr(profiled, "none_activation_bytes", None)
    blocks = [row.saved_bytes.get("none") for row in getattr(profiled, "blocks", ())]
    if none is None or not blocks or any(b is None for b in blocks):
        return 0
    return max(0, int(none) - sum(int(b) for b in blocks if b is not None))


def partition_pt2_budgets(
    records: Sequence[TrialRecord], trials: Trials, leader: TrialRecord, runner: Any, outside: int
) -> tuple[TrialRecord | None, tuple[Partitioned, ...]]:
    """The first PT2 budget that fits partitioned whole (None: none did), and what was partitioned. Tried: the largest
    budgets over budget on the blocks by at most ``outside`` bytes, which a whole graph's knapsack may fit as it also
    weighs that code, then the leader unless it has room for all that code saves. Each is measured: a budget's bytes
    are not monotonic in it (pytorch#197838)."""
    budget = trials.budget
    limit = getattr(budget, "limit_bytes", None)

    def excess(t: TrialRecord) -> int | None:  # bytes over the budget on the blocks (negative: room), None unknown
        value = budget.value_of(t.peak_bytes, t.activation_bytes)
        return None if limit is None or value is None else value - limit

    over: list[TrialRecord] = []
    for t in records:
        if t.plan.compile_memory_budget is None or t.status != TrialStatus.OVER_BUDGET or t.number == leader.number:
            continue
        if t.micro_batch == leader.micro_batch and (e := excess(t)) is not None and e <= outside:
            over.append(t)
    over.sort(key=lambda t: (-(t.plan.compile_memory_budget or 0.0), t.number))
    chosen = over[:PARTITIONS]
    leader_free = None  # the leader's budget, kept without a partition
    if leader.plan.compile_memory_budget is not None:
        if outside and (e := excess(leader)) is not None and e + outside <= 0:
            # A whole graph's knapsack saves about the blocks' bytes plus at most the outside code's: not partitioned
            # (slow on deep models); the guard still reads the real steps after lock-in.
            leader_free = leader
        else:
            chosen.append(leader)
    found: list[Partitioned] = []
    for trial in chosen:
        trials.check_stop()
        t0 = time.perf_counter()
        judged = trials.judge(trial, runner.measure_partitioned(trial.plan))
        fits = all(trials.sync.all_gather(bool(judged.feasible)))  # every rank keeps the same
        on_blocks = budget.value_of(trial.peak_bytes, trial.activation_bytes)
        whole = budget.value_of(judged.peak_bytes, judged.activation_bytes) if judged.activation_bytes else None
        found.append(Partitioned(trial.label, on_blocks, whole, fits, time.perf_counter() - t0))
        log.info("lightning_ckpt: %s", found[-1].describe())
        if fits:
            return judged, tuple(found)
    return leader_free, tuple(found)


def _weigh(
    records: Sequence[TrialRecord],
    trials: Trials,
    leader: TrialRecord,
    runner: Any,
    margin: float = 0.0,
    *,
    compiled_whole: bool,
    leader_fits: bool | None = None,
) -> tuple[TrialRecord, WholeCheck | None]:
    if leader.plan.compile_memory_budget is None:
        return leader, None
    rivals = _rivals(records, 1 if compiled_whole else RIVALS_ON_BLOCKS)
    if not rivals:
        return leader, None
    t0, graphs0, seconds0 = time.perf_counter(), getattr(runner, "graphs", 0), getattr(runner, "compile_seconds", 0.0)
    trials.check_stop()
    # The plain model compiled the user's way: what graph breaks are compared with (the blocks' runner has its own).
    plain = _compile_seconds(runner.measure_compiled(Plan())) if compiled_whole else 0.0
    # A leader whose fit was judged partitioned whole is kept as given.
    fits = {leader.number: bool(leader_fits)} if leader_fits is not None else {}
    judged, compile_each = _measured(trials, runner, (leader, *rivals), fits)
    fitting = [r for r in rivals if fits[r.number]]
    threshold = 1.0 / (1.0 + margin)  # the rival's speed over the leader's above which the rival is kept
    rounds = fits[leader.number] and bool(fitting)
    rival, verdict = _side_by_side(trials, leader, fitting, runner, threshold) if rounds else (None, None)
    rival, verdict = rival or (fitting or rivals)[0], verdict or _NOT_RETIMED  # else the first by rank that fits
    # Both fit: the rival unless the leader leads by more than the margin (a tie keeps the leader at margin 0).
    both = fits[leader.number] and fits[rival.number]
    keep_rival = (verdict.ratio or 0.0) > threshold if both else (fits[rival.number] and not fits[leader.number])
    # Compiled whole, the measurement is of another graph than the trials': the rival keeps its search record. On the
    # blocks it is the trials' kind, and a pruned rival has no other.
    kept = (rival if compiled_whole or rival.feasible else judged[rival.number]) if keep_rival else leader
    each = (plain, compile_each[leader.number], compile_each[rival.number]) if compiled_whole else (0.0, 0.0, 0.0)
    if compiled_whole:
        graphs, compile_seconds = 3, plain + sum(compile_each.values())
    else:  # only what the blocks had not compiled yet (a pruned rival's segment, say)
        graphs = getattr(runner, "graphs", 0) - graphs0
        compile_seconds = getattr(runner, "compile_seconds", 0.0) - seconds0
    check = WholeCheck(
        leader=leader.label,
        rival=rival.label,
        leader_fits=fits[leader.number],
        rival_fits=fits[rival.number],
        ratio=verdict.ratio,
        low=verdict.low,
        high=verdict.high,
        rounds=verdict.rounds,
        kept=kept.label,
        graphs=graphs,
        compile_seconds=compile_seconds,
        compile_seconds_each=each,
        seconds=time.perf_counter() - t0,
        compiled_whole=compiled_whole,
        margin=margin,
        rivals=tuple(r.label for r in rivals),
    )
    (log.warning if keep_rival and compiled_whole else log.info)("lightning_ckpt: %s", check.describe())
    return kept, check


# ``leader``, or our fastest fitting plan unless the leader runs more than ``1 + margin`` times its speed, both measured
# by the runner: compiled the user's way (a ``CompiledTrials`` without blocks), or re-timed side by side on the blocks
# (where the blocks' figure flatters the budget); and what was done (None: nothing to weigh). ``leader_fits``: the
# leader's fit as judged partitioned whole, which then stands for its fit on the blocks.
check_whole_compile = partial(_weigh, compiled_whole=True)
weigh_on_blocks = partial(_weigh, compiled_whole=False)


# Plans of ours weighed against the budget on the blocks: the time model ranks them, the rounds choose (compiled whole,
# each rival is a compile of the user's model: one).
RIVALS_ON_BLOCKS = 3
# The verdict of a rival not re-timed beside the leader.
_NOT_RETIMED = Verdict("", None, None, None, None, 0, 1.0)


def _rivals(records: Sequence[TrialRecord], count: int) -> list[TrialRecord]:
    """The ``count`` fastest fitting plans of ours, measured or pruned by the time model (the plan that beats a
    flattered budget may be one the search never ran). Predictions are scaled by the median measured over predicted
    seconds, else a time model's base off the machine's figures would put every pruned plan behind every measured one."""
    pairs = [t.median_seconds / t.predicted_seconds for t in records if t.median_seconds and t.predicted_seconds]
    scale = statistics.median(pairs) if pairs else 1.0
    ours: list[tuple[float, int, TrialRecord]] = []
    for t in records:
        if t.plan.compile_memory_budget is not None or t.plan.is_empty:
            continue
        if t.feasible and t.median_seconds:
            ours.append((t.median_seconds, t.number, t))
        elif t.status == TrialStatus.PRUNED and t.pruned_by == "time" and t.predicted_seconds:
            ours.append((t.predicted_seconds * scale, t.number, t))
    return [t for _, _, t in sorted(ours, key=lambda x: (x[0], x[1]))[:count]]


def _compile_seconds(out: Any) -> float:
    return float((out.extra.get("compile") or {}).get("compile_seconds") or 0.0)


def _measured(
    trials: Trials, runner: Any, plans: Sequence[TrialRecord], fits: dict[int, bool]
) -> tuple[dict[int, TrialRecord], dict[int, float]]:
    """Each of ``plans`` whose fit ``fits`` does not give measured by ``runner`` and judged, its fit on every rank added
    to ``fits``: the records by number, and the seconds each measured plan's compile took."""
    judged, seconds = {t.number: t for t in plans if t.number in fits}, {}
    for trial in (t for t in plans if t.number not in judged):
        trials.check_stop()
        out = runner.measure(trial.plan, trials.memory_limit(trial.micro_batch))
        judged[trial.number] = trials.judge(trial, out)
        fits[trial.number] = all(trials.sync.all_gather(bool(judged[trial.number].feasible)))  # every rank the same
        seconds[trial.number] = _compile_seconds(out)
    return judged, seconds


def _side_by_side(
    trials: Trials, leader: TrialRecord, rivals: Sequence[TrialRecord], runner: Any, threshold: float
) -> tuple[TrialRecord | None, Verdict | None]:
    """The rival the rounds found fastest against the leader, with its verdict (None: no ratio), re-timed in interleaved
    rounds until that ratio is precise or decided against ``threshold``."""
    config = trials.config
    steps = config.confirm_steps
    # Entered as plans, none a baseline: the rounds' own rule would stop timing a baseline found slower than the
    # fastest one, and these rounds compare exactly these plans.
    entries = [
        ConfirmEntry(replace(t, baseline=None), retimer(runner, t.plan, steps), 1, steps, 1) for t in (leader, *rivals)
    ]
    labels: Mapping[int, str] = {t.number: t.label for t in (leader, *rivals)}

    def verdicts_of(side: SideBySide) -> dict[int, Verdict | None]:
        return {r.number: side.verdict(r.number, labels, config.tie_tolerance, reference=leader.number) for r in rivals}

    def precise(side: SideBySide) -> bool:
        found = [v for v in verdicts_of(side).values() if v is not None and v.ratio is not None]
        if not found:
            return False
        v = max(found, key=lambda v: v.ratio or 0.0)
        if v.low is None or v.high is None or v.low <= 0:
            return False
        # Decided or precise: more rounds would not change which is kept.
        return v.low > threshold or v.high < threshold or math.sqrt(v.high / v.low) <= 1 + CLAIM_HALF_WIDTH

    rounds = max(1, config.holdout_rounds or config.confirm_rounds)
    side = confirm_interleaved(
        entries,
        min_rounds=rounds,
        max_rounds=max(rounds, config.holdout_max_rounds or rounds),
        sync=trials.sync,
        until=precise,
        check_stop=trials.check_stop,
    )
    verdicts = verdicts_of(side)
    timed = [r for r in rivals if (v := verdicts[r.number]) is not None and v.ratio is not None]
    rival = max(timed, key=lambda r: verdicts[r.number].ratio or 0.0, default=None)
    return rival, verdicts[rival.number] if rival is not None else None


def pt2_budget_check(
    search: Any,
    runner: CompiledTrials,
    harness: StepHarness,
    config: TuneConfig,
    sections: dict[str, Any],
    profiled: CompiledMemoryModel | None = None,
) -> Callable[[TrialRecord], TrialRecord] | None:
    """``pipeline.conclude``'s ``after_choice`` where the trials ran on blocks compiled alone and the user compiles
    several blocks in one graph, None elsewhere; it records what it did in the provenance ``sections``."""
    if runner.assembly is None or not holds_several_blocks(runner.regions, runner.assembly.blocks):
        return None

    def after_choice(best: TrialRecord) -> TrialRecord:
        contender, partitioned = partition_pt2_budgets(
            search.records, search.trials, best, runner, outside_blocks_bytes(profiled)
        )
        if partitioned:
            sections["pt2_partitioned_whole"] = [p.to_dict() for p in partitioned]
            sections["compiles"] = compiles_of(runner, profiled)
        if contender is None and best.plan.compile_memory_budget is None:
            return best
        leader = contender or best  # no budget fits whole: the leader's is weighed as over budget
        if config.check_whole_compile:
            # A runner without blocks: every plan it measures is compiled the way the user compiles.
            whole = CompiledTrials(harness, regions=runner.regions, allow_graph_breaks=config.allow_graph_breaks,
                                   reserve_headroom_bytes=runner.reserve_headroom_bytes)  # fmt: skip
            kept, check = check_whole_compile(search.records, search.trials, leader, whole)
        else:
            fits = None if not partitioned else bool(contender)
            kept, check = weigh_on_blocks(
                search.records, search.trials, leader, runner, config.whole_compile_margin, leader_fits=fits
            )
        if check is None:
            return kept
        sections["whole_compile_check"] = check.to_dict()
        if not config.check_whole_compile:
            sections["compiles"] = compiles_of(runner, profiled)  # a pruned rival may have compiled a segment
            return kept
        compiles = dict(sections.get("compiles") or {})
        compiles["graphs"] = compiles.get("graphs", 0) + check.graphs
        compiles["seconds"] = compiles.get("seconds", 0.0) + check.compile_seconds
        sections["compiles"] = {**compiles, "whole_graphs": check.graphs, "whole_seconds": check.compile_seconds}
        return kept

    return after_choice


def compiles_of(runner: CompiledTrials, profiled: CompiledMemoryModel | None) -> dict[str, Any]:
    """What a compiled search compiled (graphs, and the seconds of the steps that compiled them), in the profile and
    in the trials."""
    profile_graphs = profiled.compiles if profiled is not None else 0
    profile_seconds = profiled.compile_seconds if profiled is not None else 0.0
    trial_seconds = runner.compile_seconds
    if runner.assembly is None:  # every measured plan compiled from a reset
        trial_seconds = sum(stats.compile_seconds for _, stats in runner._cache.values())
    return {
        "assembled": runner.assembly is not None,
        "graphs": profile_graphs + runner.graphs,
        "seconds": profile_seconds + trial_seconds,
        "profile_graphs": profile_graphs,
        "profile_seconds": profile_seconds,
        "trial_graphs": runner.graphs,
        "trial_seconds": trial_seconds,
        "plans_measured": len(runner._cache),
    }
