"""How a search runs: one ``TuneConfig`` that the callback builds once and ``tune``/``tune_micro_batch`` take.

The budget (what must fit) is not here; these are the settings of the search itself, validated in
one place so a bad value fails at construction, naming the setting and a valid example.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from lightning_ckpt.budget import host_memory, parse_bytes
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.search.space import SearchSpace

__all__ = ["TuneConfig"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The integer settings and the least value each may take.
_LOWEST = {
    "warmup_steps": 0,
    "measure_steps": 1,
    "process_warmup_steps": 0,
    "confirm_top": 0,
    "confirm_steps": 1,
    "confirm_rounds": 1,
    "confirm_max_rounds": 1,
    "holdout_rounds": 0,
    "holdout_max_rounds": 0,
}

# The settings that are fractions in [0, 1), each with a valid example.
_FRACTIONS = {"tie_tolerance": "0.01", "whole_compile_margin": "0.08"}


@dataclass(frozen=True)
class TuneConfig:
    """Settings of one search.

    n_trials: most candidates measured (pruned ones are free); timeout: most seconds to search.
    search_space: a ``SearchSpace`` or a dict of overrides. sampler, storage, study_name, seed: Optuna's (seeded TPE
    in memory by default). ``storage`` (e.g. ``"sqlite:///ac.db"``) keeps the study, one trial per plan, and resumes an
    interrupted search; ``study_name`` defaults to ``lightning_ckpt-<model fingerprint>-<run digest>``. ``sampler``
    proposes plans from an in-memory copy of the study (``ledger.py``) in place of the time model's sampler.
    warmup_steps / measure_steps: steps per trial left out of / used for timing. block_types: override block
    discovery. on_infeasible: ``"fallback"`` or ``"raise"`` when nothing fits. tie_tolerance: plans this close in
    throughput are tied (``choice.CHOICE_RULE``: a baseline keeps a tie with a tuned plan; between tuned plans, the
    lower memory wins). count_flops: count recompute FLOPs. enforce_budget: cap the CUDA allocator during trials.
    process_warmup_steps: untimed steps before the first trial (thread pools, allocator growth).
    confirm_top / confirm_rounds / confirm_max_rounds: the tuned leaders re-timed side by side with every fitting
    baseline in interleaved rounds; after ``confirm_rounds`` settled plans stop being timed, and the rounds stop once
    the choice is decided, at most ``confirm_max_rounds``.
    confirm_steps: timed steps per plan per round (the first round adds a warm-up). One, so the plans alternate step
    by step: the interval narrows most for the same steps (``benchmarks/step_alternation.py``).
    holdout_rounds / holdout_max_rounds: a winning tuned plan and the reference are timed again in fresh rounds, at
    least ``holdout_rounds`` and until the claim's 90% interval is within ±3% or ``holdout_max_rounds``: the rounds
    that chose a plan favour it (a winner's curse). 0: the choosing rounds' verdict is shown.
    allow_graph_breaks: under ``torch.compile``, let plans that add graph breaks win on throughput.
    check_whole_compile: under ``torch.compile`` of a region holding several blocks, when the choice made on the
    blocks compiled alone sets a PT2 budget, compile it and our fastest fitting plan your way, re-time them side by
    side and keep the faster (``search.whole_check``). Off by default: two more compiles of your model; without it the
    budget is weighed with ``whole_compile_margin``: kept only if, re-timed on the blocks, it runs more than
    ``1 + whole_compile_margin`` times the fastest of our three fastest fitting plans, since compiled whole our plans
    move towards it (``benchmarks/alone_vs_whole.py``). 0: the faster on the blocks.
    memory_pass: ``"finalists"`` (default): on CPU, where the memory model is exact, a trial's memory is its
    prediction and only the plans that can still be chosen get the tracked pass and the FLOP count; ``"every"``: every
    trial gets them (~3.5 and ~2 steps).
    predict_time: the time model decides what is measured: after the baselines, the predicted-fastest plans until none
    left can beat the best measured one. False measures what the sampler proposes, up to ``n_trials``.
    search_when_none_fits: when the memory model predicts that no checkpointing fits, it is measured once and
    chosen, and nothing else runs (checkpointing only adds recompute). True searches anyway, e.g. for the Pareto
    figure.
    search_steps: the search's allowance in plain training steps: each side-by-side round starts only where the
    allowance can pay for it and for what follows; a tuned plan the rounds could not confirm keeps the reference.
    The search plans to 90% of it, so that counted in a plain step timed at another moment (up to 10% apart) it stays
    within. None: no allowance.
    compiled: whether every trial compiles its plan (None: detected). micro_batches: the sizes the joint micro-batch
    search tries (None: every divisor of the global batch). clock: what the trials and rounds time their steps with
    (``time.perf_counter``): a test can pass a clock that runs faster instead of sleeping.
    max_host_memory: the host memory the offloading modes' pool may pin (bytes or e.g. ``"64GiB"``): a plan whose
    offloaded bytes exceed it is pruned as over budget. None: half of what the machine has free when the search
    starts (pinned pages cannot be swapped out: pinning most of them starves the data loader and the system).
    """

    n_trials: int = 40
    timeout: float | None = None
    search_space: SearchSpace = field(default_factory=SearchSpace)
    sampler: Any = None
    storage: str | None = None
    study_name: str | None = None
    seed: int = 0
    warmup_steps: int = 1
    measure_steps: int = 3
    block_types: Any = None
    on_infeasible: Literal["fallback", "raise"] = "fallback"
    tie_tolerance: float = 0.01
    count_flops: bool = True
    enforce_budget: bool = True
    process_warmup_steps: int = 2
    confirm_top: int = 3
    confirm_steps: int = 1
    confirm_rounds: int = 6
    confirm_max_rounds: int = 24
    holdout_rounds: int = 6  # the floor; the rounds go on until the claim is within ±3% (CLAIM_HALF_WIDTH)
    holdout_max_rounds: int = 32
    allow_graph_breaks: bool = False
    check_whole_compile: bool = False
    whole_compile_margin: float = 0.08
    memory_pass: Literal["finalists", "every"] = "finalists"
    predict_time: bool = True
    search_when_none_fits: bool = False
    search_steps: float | None = 150.0
    compiled: bool | None = None
    micro_batches: tuple[int, ...] | None = None
    clock: Callable[[], float] = time.perf_counter
    max_host_memory: int | str | None = None

    def __post_init__(self) -> None:
        if not callable(self.clock):
            raise ConfigurationError(
                f"clock must be a function returning seconds, e.g. time.perf_counter, got {self.clock!r}."
            )
        for name in ("search_when_none_fits", "predict_time", "count_flops", "enforce_budget"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be True or False, but got {getattr(self, name)!r}.")
        if self.max_host_memory is not None:
            object.__setattr__(self, "max_host_memory", parse_bytes(self.max_host_memory, what="max_host_memory"))
        if self.memory_pass not in ("finalists", "every"):
            raise ConfigurationError(f"memory_pass must be 'finalists' or 'every', but got {self.memory_pass!r}.")
        object.__setattr__(self, "search_space", SearchSpace.from_config(self.search_space))
        if not _is_int(self.n_trials) or self.n_trials < 1:
            raise ConfigurationError(f"n_trials must be an integer >= 1 (e.g. n_trials=40), but got {self.n_trials!r}.")
        timeout = self.timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf
        ):
            raise ConfigurationError(
                f"timeout must be a positive number of seconds or None (e.g. timeout=600), but got {timeout!r}."
            )
        steps = self.search_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, (int, float)) or not steps > 0):
            raise ConfigurationError(
                f"search_steps must be a positive number of plain steps or None (e.g. 150), but got {steps!r}."
            )
        if self.on_infeasible not in ("fallback", "raise"):
            raise ConfigurationError(f"on_infeasible must be 'fallback' or 'raise', but got {self.on_infeasible!r}.")
        for name, example in _FRACTIONS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigurationError(f"{name} must be in [0, 1) (e.g. {example}), but got {value!r}.")
        for name, low in _LOWEST.items():
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}.")
        for most, least in (("confirm_max_rounds", "confirm_rounds"), ("holdout_max_rounds", "holdout_rounds")):
            if getattr(self, most) < getattr(self, least):
                raise ConfigurationError(f"{most} ({getattr(self, most)}) must be >= {least} ({getattr(self, least)}).")
        if not _is_int(self.seed):
            raise ConfigurationError(
                f"seed must be an integer, e.g. seed=0, but got {type(self.seed).__name__} {self.seed!r}."
            )
        for name, example in (("study_name", "study_name='gpt-ac'"), ("storage", "storage='sqlite:///ac.db'")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigurationError(
                    f"{name} must be a string, e.g. {example}, but got {type(value).__name__} {value!r}."
                )

    def host_limit(self) -> int | None:
        """``max_host_memory``, or half of what the machine has free now (``/proc/meminfo``'s MemAvailable, else its
        free pages) within ``host_memory``; None where nothing can be read."""
        if self.max_host_memory is not None:
            return int(self.max_host_memory)
        free = None
        with contextlib.suppress(OSError, ValueError, StopIteration):
            lines = Path("/proc/meminfo").read_text().splitlines()
            free = 1024 * next(int(line.split()[1]) for line in lines if line.startswith("MemAvailable:"))
        with contextlib.suppress(AttributeError, ValueError, OSError):
            free = free or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        host = host_memory()
        return None if free is None else min(free, host[0] if host is not None else free) // 2

    def with_overrides(self, overrides: Mapping[str, Any]) -> TuneConfig:
        """This config with ``overrides`` (keyword arguments of ``tune``) applied; unknown names are refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigurationError(f"Unknown tune settings {unknown}. Known settings: {', '.join(sorted(known))}.")
        return replace(self, **overrides) if overrides else self
