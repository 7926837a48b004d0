"""The search space: a few categorical dimensions that map one-to-one onto plans.

Dimensions (each switchable):

* ``structure``: ``none`` | ``blocks`` (per-block modes) | ``segments`` (sqrt(N)-style chunks);
* ``selection``: which blocks of each stack get ``mode`` - ``all``, ``first:<fraction>``, ``every:<n>``;
* ``mode``: ``full`` | ``selective:<kind>`` (children of that kind, e.g. ``mlp``) | ``ops:<save_list>`` | ``offload``
  (saved tensors to host memory) | ``offload_input`` (checkpointed, its input to host memory);
* ``rest_mode``: the mode of the blocks the selection leaves out (``none`` or a cheaper mode);
* ``chunks``: segment count per stack when ``structure == segments``;
* ``compile_budget``: PT2's ``activation_memory_budget`` when ``structure == pt2_budget`` (compiled
  models only: the partitioner's own knapsack, no checkpointing of ours).

Plans are built from these values alone: every trial, baseline and enumeration goes through ``plan_for``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.plan.chunks import sqrt_chunks, sqrt_segments
from lightning_ckpt.plan.format import BlockPlan, Plan
from lightning_ckpt.plan.save_list_names import SAVE_LIST_NAMES
from lightning_ckpt.search.ledger import trial_key
from lightning_ckpt.stacks import Block, LayerStack

__all__ = ["Candidate", "SearchSpace", "offered_candidates"]

log = logging.getLogger(__name__)

_DEFAULT_MODES = (
    "full",
    "selective:mlp",
    "selective:attention",
    "selective:attention+mlp",
    "ops:save_matmuls",
    "ops:save_matmuls_alternate",
    "offload",
    "offload_input",
)
_DEFAULT_SELECTIONS = ("all", "first:0.25", "first:0.5", "first:0.75", "every:2", "every:3")
_DEFAULT_REST_MODES = ("none", "selective:mlp", "ops:save_matmuls", "offload", "offload_input")
# PT2 activation memory budgets tried for compiled models (fractions of what the partitioner saves by default).
_DEFAULT_COMPILE_BUDGETS = (0.7, 0.5, 0.3, 0.1)
# Modes the compiler already does by itself, dropped for compiled models: AOTAutograd's min-cut partitioner
# recomputes cheap pointwise ops and keeps matmul outputs, exactly what ``save_matmuls`` asks for. Save-lists that
# *also* drop matmuls go beyond it and stay.
COVERED_BY_PARTITIONER = ("ops:save_matmuls",)
# What ``from_config`` takes, in the order a plan file keeps them (``to_config``).
_CONFIG_NAMES = ("modes", "selections", "rest_modes", "segments", "baselines", "chunks", "compile_budgets")


@dataclass(frozen=True)
class Candidate:
    """A point of the space: its dimension values and the plan they mean."""

    params: Mapping[str, Any]
    plan: Plan
    label: str = ""
    baseline: str | None = None  # the baseline's name when the candidate is one

    @property
    def micro_batch(self) -> int | None:
        """The joint search's micro-batch dimension (``params["micro_batch"]``); None in a search of one shape."""
        value = self.params.get("micro_batch")
        return int(value) if value is not None else None

    def key(self) -> str:
        return trial_key(self.plan, self.micro_batch)


def _mode_plan(block: Block, mode: str) -> BlockPlan | None:
    """The BlockPlan for ``mode`` on ``block``; None when the block has nothing that mode can act on."""
    if mode == "none":
        return BlockPlan()
    if mode in ("full", "offload", "offload_input"):
        return BlockPlan(mode)
    kind, _, arg = mode.partition(":")
    if kind == "ops":
        return BlockPlan("ops", save_list=arg)
    if kind == "selective":
        children = tuple(child for child_kind in arg.split("+") for child in block.children_of_kind(child_kind))
        return BlockPlan("selective", children) if children else None
    raise ConfigurationError(f"Unknown mode {mode!r} in the search space.")


def _selection(selection: Any) -> Callable[[int, int], bool]:
    """Whether ``selection`` selects a block (its index, the stack's length); refused where it is malformed."""
    example = "Use e.g. search_space={'selections': ['all', 'first:0.5', 'every:2']}."
    if not isinstance(selection, str):
        raise ConfigurationError(f"search_space selections must be strings, but got {selection!r}. {example}")
    kind, _, arg = selection.partition(":")
    if selection == "all":
        return lambda index, n_blocks: True
    if kind == "first":
        try:
            fraction = float(arg)
        except ValueError:
            fraction = float("nan")
        if not 0 < fraction <= 1:
            raise ConfigurationError(
                f"Selection {selection!r}: 'first:<fraction>' takes a fraction of the blocks in (0, 1]. {example}"
            )
        return lambda index, n_blocks: index < max(1, math.ceil(fraction * n_blocks))
    if kind == "every":
        if not (arg.isdigit() and int(arg) >= 1):
            raise ConfigurationError(f"Selection {selection!r}: 'every:<n>' takes an integer n >= 1. {example}")
        return lambda index, n_blocks: index % int(arg) == 0
    raise ConfigurationError(f"Unknown selection {selection!r}; use 'all', 'first:<fraction>' or 'every:<n>'.")


@dataclass(frozen=True)
class SearchSpace:
    """Which dimensions are searched and with which values; ``None``/empty switches a dimension off. Offloading
    modes are dropped for models not on CUDA. ``compile_budgets``: the PT2 memory budgets tried for compiled models
    (``None``: the defaults, ``()``: none); ``for_compile()`` switches them on."""

    modes: tuple[str, ...] = _DEFAULT_MODES
    selections: tuple[str, ...] = _DEFAULT_SELECTIONS
    rest_modes: tuple[str, ...] = _DEFAULT_REST_MODES
    chunks: tuple[int, ...] | None = None  # None: 2, sqrt(N), N/2 per the largest stack
    segments: bool = True
    baselines: bool = True
    compile_budgets: tuple[float, ...] | None = None
    compiled: bool = False  # set by for_compile(): adds the pt2_budget structure

    def __post_init__(self) -> None:
        for b in self.compile_budgets or ():
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b <= 1.0:
                raise ConfigurationError(
                    f"compile_budgets entries must be numbers in [0, 1] (fractions of the activations "
                    f"torch.compile saves by default), but got {b!r}. Use e.g. compile_budgets=[0.5, 0.3]."
                )
        for mode in (*self.modes, *self.rest_modes):
            kind, _, arg = mode.partition(":")
            if kind == "ops" and arg not in SAVE_LIST_NAMES:
                raise ConfigurationError(
                    f"Unknown op save-list {arg!r} in search space mode {mode!r}. Known: {', '.join(sorted(SAVE_LIST_NAMES))}."
                )
            if kind not in ("none", "full", "offload", "offload_input", "ops", "selective") or (
                kind == "selective" and not arg
            ):
                raise ConfigurationError(
                    f"Unknown search space mode {mode!r}. Use 'full', 'offload', 'offload_input', 'ops:<save_list>' or "
                    "'selective:<kind>[+<kind>]' with kinds mlp, attention, norm, other."
                )
        for sel in self.selections:
            _selection(sel)
        for c in self.chunks or ():
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ConfigurationError(
                    f"search_space chunks must be segment counts (integers >= 1), but got {c!r}. "
                    "Use e.g. search_space={'chunks': [2, 4]}."
                )
        if not self.modes and not self.segments:
            raise ConfigurationError("The search space is empty: give at least one mode or enable segments.")

    @classmethod
    def from_config(cls, config: SearchSpace | Mapping[str, Any] | None) -> SearchSpace:
        """Build from a dict of overrides (e.g. from YAML); unknown names are refused with the known ones."""
        if config is None:
            return cls()
        if isinstance(config, SearchSpace):
            return config
        if not isinstance(config, Mapping):
            raise ConfigurationError(f"search_space must be a dict or SearchSpace, but got {type(config).__name__}.")
        if unknown := sorted(set(config) - set(_CONFIG_NAMES)):
            raise ConfigurationError(
                f"Unknown search-space names {unknown}. Known names: {', '.join(sorted(_CONFIG_NAMES))}. "
                "For example search_space={'modes': ['full', 'selective:mlp'], 'segments': False}."
            )
        kwargs: dict[str, Any] = {}
        for key, value in config.items():
            if key in ("segments", "baselines"):
                kwargs[key] = bool(value)
            elif value is False or value is None:
                kwargs[key] = ()
            elif key == "compile_budgets":
                kwargs[key] = tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value)
            else:
                kwargs[key] = tuple(value)
        return cls(**kwargs)

    def to_config(self) -> dict[str, Any]:
        """The dict ``from_config`` builds this space from (what a plan file keeps of the space searched)."""
        values = {n: getattr(self, n) for n in _CONFIG_NAMES}
        return {n: list(v) if isinstance(v, tuple) else v for n, v in values.items() if v is not None}

    def _without(self, drop: Callable[[str], bool], **changes: Any) -> SearchSpace:
        """This space without the modes ``drop`` names, as the selected and as the rest mode."""
        modes, rest = (tuple(m for m in ms if not drop(m)) for ms in (self.modes, self.rest_modes))
        return replace(self, modes=modes, rest_modes=rest, **changes)

    def for_device(self, device_type: str) -> SearchSpace:
        # On a CPU model activations already live in host memory: offload cannot save anything.
        return self if device_type == "cuda" else self._without(lambda m: m.startswith("offload"))

    def for_compile(self) -> SearchSpace:
        """The space for a model run under ``torch.compile``: PT2 memory budgets in, covered modes out."""
        budgets = _DEFAULT_COMPILE_BUDGETS if self.compile_budgets is None else self.compile_budgets
        return self._without(lambda m: m in COVERED_BY_PARTITIONER, compiled=True, compile_budgets=budgets)

    @property
    def budget_choices(self) -> tuple[float, ...]:
        """The PT2 memory budgets searched (empty unless the model is compiled)."""
        return tuple(sorted(set(self.compile_budgets or ()), reverse=True)) if self.compiled else ()

    def chunk_choices(self, stacks: Sequence[LayerStack]) -> tuple[int, ...]:
        if not self.segments:
            return ()
        n = max(len(s.blocks) for s in stacks)
        chunks = self.chunks if self.chunks is not None else (2, round(math.sqrt(n)), n // 2)
        return tuple(sorted({c for c in chunks if 2 <= c <= n}))

    def structures(self, stacks: Sequence[LayerStack]) -> tuple[str, ...]:
        out = ["none"]
        if self.modes:
            out.append("blocks")
        if self.chunk_choices(stacks) and any(s.container_class in ("ModuleList", "Sequential") for s in stacks):
            out.append("segments")
        if self.budget_choices:
            out.append("pt2_budget")
        return tuple(out)

    def plan_for(self, params: Mapping[str, Any], stacks: Sequence[LayerStack], *, fingerprint: str | None) -> Plan:
        structure = params["structure"]
        if structure == "none":
            return Plan(fingerprint=fingerprint)
        if structure == "pt2_budget":
            return Plan(fingerprint=fingerprint, compile_memory_budget=float(params["compile_budget"]))
        if structure == "segments":
            chunks = int(params["chunks"])
            segments = {
                s.fqn: min(chunks, len(s.blocks))
                for s in stacks
                if s.container_class in ("ModuleList", "Sequential") and len(s.blocks) >= 2
            }
            return Plan(segments=segments, fingerprint=fingerprint)
        selection, mode = params["selection"], params["mode"]
        rest = params.get("rest_mode", "none") if selection != "all" else "none"
        selected, blocks = _selection(selection), {}
        for stack in stacks:
            for block in stack.blocks:
                bp = _mode_plan(block, mode if selected(block.index, len(stack.blocks)) else rest)
                if bp is not None:
                    blocks[block.fqn] = bp
        return Plan(blocks, fingerprint=fingerprint)

    def distributions(self, stacks: Sequence[LayerStack]) -> dict[str, Any]:
        """The Optuna dimensions ``suggest`` draws from, for adding trials run outside ask/tell."""
        from optuna.distributions import CategoricalDistribution

        dists = {"structure": CategoricalDistribution(self.structures(stacks))}
        if self.modes:
            dists["selection"] = CategoricalDistribution(self.selections or ("all",))
            dists["mode"] = CategoricalDistribution(self.modes)
            if self.rest_modes:
                dists["rest_mode"] = CategoricalDistribution(self.rest_modes)
        if self.chunk_choices(stacks):
            dists["chunks"] = CategoricalDistribution(self.chunk_choices(stacks))
        if self.budget_choices:
            dists["compile_budget"] = CategoricalDistribution(self.budget_choices)
        return dists

    def suggest(self, trial: Any, stacks: Sequence[LayerStack]) -> dict[str, Any]:
        """Draw dimension values from an Optuna trial (conditional dimensions only when they apply)."""
        params: dict[str, Any] = {"structure": trial.suggest_categorical("structure", self.structures(stacks))}
        if params["structure"] == "blocks":
            params["selection"] = trial.suggest_categorical("selection", self.selections or ("all",))
            params["mode"] = trial.suggest_categorical("mode", self.modes)
            if params["selection"] != "all" and self.rest_modes:
                params["rest_mode"] = trial.suggest_categorical("rest_mode", self.rest_modes)
        elif params["structure"] == "segments":
            params["chunks"] = trial.suggest_categorical("chunks", self.chunk_choices(stacks))
        elif params["structure"] == "pt2_budget":
            params["compile_budget"] = trial.suggest_categorical("compile_budget", self.budget_choices)
        return params

    def enumerate(self, stacks: Sequence[LayerStack], *, fingerprint: str | None) -> list[Candidate]:
        """Every distinct plan of the space (deduplicated by what the plan does), baselines first."""
        seen: dict[str, Candidate] = {}
        for cand in self.baseline_candidates(stacks, fingerprint=fingerprint):
            seen.setdefault(cand.plan.key(), cand)
        for params in self._all_params(stacks):
            plan = self.plan_for(params, stacks, fingerprint=fingerprint)
            seen.setdefault(plan.key(), Candidate(params, plan, plan.describe()))
        return list(seen.values())

    def _all_params(self, stacks: Sequence[LayerStack]) -> Iterable[dict[str, Any]]:
        for structure in self.structures(stacks):
            if structure == "none":
                yield {"structure": "none"}
            elif structure == "segments":
                for c in self.chunk_choices(stacks):
                    yield {"structure": "segments", "chunks": c}
            elif structure == "pt2_budget":
                for b in self.budget_choices:
                    yield {"structure": "pt2_budget", "compile_budget": b}
            else:
                for sel, mode in itertools.product(self.selections or ("all",), self.modes):
                    for rest in self.rest_modes if sel != "all" and self.rest_modes else (None,):
                        p = {"structure": "blocks", "selection": sel, "mode": mode}
                        yield p if rest is None else {**p, "rest_mode": rest}

    def baseline_candidates(self, stacks: Sequence[LayerStack], *, fingerprint: str | None) -> list[Candidate]:
        """The named baselines (none, full, sqrt segments, selective MLP, op save-list) as points of this space."""
        if not self.baselines:
            return []

        def named(name: str, params: dict[str, Any]) -> Candidate:
            plan = replace(self.plan_for(params, stacks, fingerprint=fingerprint), name=name)
            return Candidate(params, plan, f"baseline:{name}", baseline=name)

        out = [named("none", {"structure": "none"})]
        for mode, name in (
            ("full", "full"),
            ("selective:mlp", "selective_mlp"),
            ("ops:save_matmuls", "ops_save_matmuls"),
        ):
            if self.compiled and mode in COVERED_BY_PARTITIONER:
                continue
            cand = named(name, {"structure": "blocks", "selection": "all", "mode": mode})
            if mode == "selective:mlp" and not cand.plan.blocks:
                continue  # no block has a recognisable MLP child
            out.append(cand)
        segments = sqrt_segments(stacks)
        if self.segments and segments and "segments" in self.structures(stacks):
            plan = Plan(segments=segments, name="sqrt_segments", fingerprint=fingerprint)
            chunks = sqrt_chunks(max(len(s.blocks) for s in stacks))
            params: dict[str, Any] = {"structure": "segments", "chunks": chunks}
            if self.plan_for(params, stacks, fingerprint=fingerprint).key() != plan.key():
                # Stacks of different depths get different counts, which no one value of ``chunks`` means: the
                # explicit counts keep the trial out of the sampler's model (as for a baseline outside the space).
                params = {"structure": "segments", "segments": dict(segments)}
            out.append(Candidate(params, plan, "baseline:sqrt_segments", baseline="sqrt_segments"))
        # The compiler's own answer at each memory level: what a user of torch.compile would try by hand.
        out += [
            named(f"pt2_budget_{b:g}", {"structure": "pt2_budget", "compile_budget": b}) for b in self.budget_choices
        ]
        return out


def offered_candidates(
    space: SearchSpace, stacks: Sequence[LayerStack], fingerprint: str | None, memory_model: Any
) -> tuple[list[LayerStack], list[Candidate]]:
    """The stacks a search (or a re-plan) plans over and its candidates: no mode on a block no gradient flows
    through (checkpointing it only recomputes it), nothing the profile shows cannot run. With no block left to plan,
    the one candidate is no checkpointing."""
    inert = tuple(getattr(memory_model, "inert_blocks", ()))
    planned = memory_model.plannable_stacks(stacks) if inert else list(stacks)
    if inert:
        log.info("lightning_ckpt: no mode offered on blocks no gradient flows through: %s", ", ".join(inert))
    if not planned:  # the space needs a stack to be described over; it offers only its 'none' point here
        none = Plan(name="none", fingerprint=fingerprint)
        return list(stacks), [Candidate({"structure": "none"}, none, "baseline:none", baseline="none")]
    out = []
    for cand in space.enumerate(planned, fingerprint=fingerprint):
        if (why := memory_model.can_run(cand.plan)) is not None:
            log.info("lightning_ckpt: not offering %s: %s", cand.label, why)
        else:
            out.append(cand)
    return planned, out
