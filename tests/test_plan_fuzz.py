"""Corrupt and hand-edited plan files (#36): every reader either works or refuses the file with a ``PlanError``
naming the field (the CLI exits 2, never 1, which ``diff --exit-code`` means "the plans differ"), within 2 seconds.

The file mutated is a real one, ``tests/data/plan_real.json``: written by the Lightning callback, with a profile, a
plan table, the budget, the search, the run conditions and the guard's steps (``tests/data/make_plan_real.py``
regenerates it; a tune costs minutes on two cores, so it is not tuned per run). The property test replaces
values anywhere in it with wrong types, well-typed values that do not belong there, huge or non-finite numbers,
deep nesting and long strings, drops and adds fields, and empties, duplicates and reorders lists (1-3 changes per
file); the tests after it pin each cause of a crash the issue found on the code before this fix.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lit import LitGPT, quiet_trainer, token_loader

from lightning_ckpt import ActivationCheckpointTuner, Plan
from lightning_ckpt.budget import RequestedBudget
from lightning_ckpt.cli.main import main
from lightning_ckpt.errors import LightningCkptError, PlanError
from lightning_ckpt.lightning.applied import ReplanCheck
from lightning_ckpt.lightning.reuse import RunConditions, condition_changes, reusable
from lightning_ckpt.model import ModelView
from lightning_ckpt.plan.table import PlanTable, table_line
from lightning_ckpt.search.replan import replan

REAL = Path(__file__).parent / "data" / "plan_real.json"
BASE: dict[str, Any] = json.loads(REAL.read_text())
SECONDS = 2.0  # CPU seconds any reader may take on any file


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in the document (the root excluded), as a tuple of keys and indices."""
    out = [path] if path else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out += _paths(value, (*path, key))
    return out


PATHS = _paths(BASE)


class Raw:
    """JSON text put into the file as written: values ``json.dumps`` cannot spell (huge integers, deep nesting)."""

    def __init__(self, text: str) -> None:
        self.text = text


# Values a corrupt or hand-edited file may hold anywhere: every JSON type, numbers out of every bound, non-finite
# numbers, integers past Python's digit limit, nesting past the parser's, and strings long enough to print pages.
BAD_VALUES = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 0.5, -0.5, "", "x", "20GiB", [], {}, [1, "a"], {"a": 1}, [[]]]),
    # Well-typed values a hand edit may put in the wrong place: they pass the schema and reach the readers' logic.
    st.sampled_from(["none", "full", "selective:mlp", "model.transformer.h.0", "cuda:0", 2**53, 1e-300, 10**6]),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", str(10**400), "9" * 5000, str(2**64)]).map(Raw),
    st.sampled_from([40, 3000]).map(lambda depth: Raw("[" * depth + "]" * depth)),
    st.sampled_from([10_000, 200_000]).map(lambda n: "x" * n),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
MUTATION = st.tuples(
    st.sampled_from(["replace", "retype", "retype", "drop", "add", "empty", "duplicate", "reverse"]),
    st.sampled_from(PATHS),
    BAD_VALUES,
)


def mutated(mutations: list[tuple[str, tuple[Any, ...], Any]]) -> str:
    """The real plan file's text with ``mutations`` applied (a path an earlier one removed is skipped)."""
    doc = copy.deepcopy(BASE)
    raws: list[str] = []
    for kind, path, value in mutations:
        parent: Any = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            target = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):  # an earlier mutation put a string there
            continue
        if isinstance(value, Raw):
            raws.append(value.text)
            value = f"\x00raw{len(raws) - 1}"
        value = copy.deepcopy(value)  # sampled values are shared objects: one must not end up inside itself
        if kind == "drop":
            del parent[path[-1]]
        elif kind == "add" and isinstance(target, dict):
            target["unexpected_field"] = value
        elif kind == "empty" and isinstance(target, (dict, list)):
            target.clear()
        elif kind == "duplicate" and isinstance(target, list) and target:
            target.append(copy.deepcopy(target[0]))
        elif kind == "reverse" and isinstance(target, list):
            target.reverse()
        elif kind == "retype":  # a value of the same type, so the schema may let it through
            parent[path[-1]] = _same_type(target, value)
        else:
            parent[path[-1]] = value
    text = json.dumps(doc)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}"), raw)
    return text


def _same_type(target: Any, value: Any) -> Any:
    if isinstance(target, bool):
        return not target
    if isinstance(target, int):
        return value if type(value) is int and abs(value) <= 2**53 else -target
    if isinstance(target, float):
        return value if type(value) is float else target * 1e6
    if isinstance(target, str):
        return value if isinstance(value, str) and len(value) < 100 else target[::-1]
    return value


def cli(*args: str) -> tuple[int, str]:
    """Exit code and stderr of the command, run in-process: anything but a LightningCkptError propagates."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, err.getvalue()


@pytest.fixture(scope="module")
def view() -> ModelView:
    """The model the real plan was tuned for (its fingerprint matches), as the callback sees it."""
    return ModelView.of(LitGPT(n_layer=2, block_size=32, dropout=0.0), None)


def callback_reads(plan: Plan, view: ModelView) -> None:
    """What the callback does with a saved plan at fit start (``ActivationCheckpointTuner._reuse``) without a
    Trainer: reuse it for the budget it was tuned for, re-plan it from its profile for another, follow its plan
    table, compare its predictions with the first steps and its batch with the first batch."""
    conditions = RunConditions(**BASE["metadata"]["conditions"])
    for requested, on_stale_plan in (
        (RequestedBudget(), "raise"),
        (RequestedBudget.parse(activation_budget=0.9), "retune"),
    ):
        with contextlib.suppress(LightningCkptError):  # a refusal ends the fit with it: fine
            _, reused = reusable(plan, "plan file", conditions, view, requested, on_stale_plan=on_stale_plan)
            if reused is None:
                continue
            check = ReplanCheck.of(reused, torch.device("cpu"))
            if check is not None:
                check.line()
            condition_changes(reused, conditions, batch_known=True)
            table = PlanTable.of_plan(reused, source="plan file")
            if table is not None:
                table_line(table, None)


def timed(what: str, fn: Any) -> Any:
    # CPU seconds, not wall seconds: what a reader spends on a file, whatever else the machine is running.
    start = time.process_time()
    try:
        return fn()
    finally:
        seconds = time.process_time() - start
        assert seconds < SECONDS, f"{what} took {seconds:.2f} s on a corrupt plan file"


def check_every_reader(path: Path, view: ModelView) -> None:
    try:
        plan: Plan | None = timed("Plan.load", lambda: Plan.load(path))
    except PlanError as err:
        assert str(path) in str(err) and "field" in str(err) or "JSON" in str(err) or "nested" in str(err), err
        plan = None
    # The CLI: a file that does not load exits 2 with one error line; one that loads is shown and compared.
    commands = {
        ("show",): (0,),
        ("show", "--json"): (0,),
        ("diff", "--exit-code", str(REAL)): (0, 1),
        ("validate",): (0, 2),  # 2: its profile cannot be re-planned from
        ("replan", "--activation-budget", "0.9"): (0, 1, 2),  # 1: nothing predicted to fit
    }
    for args, when_loaded in commands.items():
        code, err = timed(" ".join(args), lambda args=args: cli(*args, str(path)))
        assert code in (when_loaded if plan is not None else (2,)), (args, code, err)
        if code == 2:
            assert err.startswith(f"lightning-ckpt {args[0]}: error: ") and "Traceback" not in err, err
    if plan is not None:
        timed("the callback's reuse and re-plan", lambda: callback_reads(plan, view))
        with contextlib.suppress(LightningCkptError):
            timed("replan", lambda: replan(plan, max_memory=2**40, batch_size=3))


@settings(
    max_examples=60,
    deadline=None,  # each reader is timed on its own (SECONDS)
    derandomize=True,  # the same files on every run: CI is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_every_reader_works_or_refuses_a_corrupt_plan_file(mutations, view, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(mutated(mutations))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a stale plan warns that it re-tunes
        check_every_reader(path, view)


def test_the_real_plan_file_works_with_every_reader(view, tmp_path):
    """The unmutated file: every command succeeds, the callback reuses it, and it re-plans for another budget."""
    for args in (
        ["show"],
        ["show", "--json"],
        ["diff", str(REAL)],
        ["validate"],
        ["replan", "--activation-budget", "0.9"],
    ):
        assert cli(*args, str(REAL))[0] == 0, args
    plan = Plan.load(REAL)
    conditions = RunConditions(**BASE["metadata"]["conditions"])
    assert reusable(plan, "plan file", conditions, view, RequestedBudget(), on_stale_plan="raise")[1] is plan
    wanted = RequestedBudget.parse(activation_budget=0.9)
    replanned = reusable(plan, "plan file", conditions, view, wanted, on_stale_plan="raise")[1]
    assert replanned is not None and replanned.metadata["replanned"]["predicted"] is True


# -- each cause of a crash the issue found, as a file a user could have ------------------------------------------------
def write(tmp_path: Path, edit: Any, *, raw: str | None = None) -> Path:
    """The real plan with ``edit(data)`` applied; ``raw`` replaces the JSON string "RAW" as written."""
    data = copy.deepcopy(BASE)
    edit(data)
    text = json.dumps(data)
    path = tmp_path / "bad.json"
    path.write_text(text.replace('"RAW"', raw) if raw is not None else text)
    return path


def _set(*keys: Any, value: Any = "RAW") -> Any:
    def edit(data: Any) -> None:
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("raw", "found"),
    [
        ("9" * 4301, "an integer of 4301 digits"),  # past Python's int digit limit: a ValueError before
        (str(10**400), "an integer of 401 digits"),  # an OverflowError wherever it meets a float
        ("NaN", "NaN"),
        ("-Infinity", "-Infinity"),
        ("1e400", "1e400"),  # json reads it as inf
    ],
)
def test_a_number_no_plan_holds_is_refused_naming_its_field_and_every_command_exits_2(tmp_path, raw, found):
    path = write(tmp_path, _set("metadata", "measured", "peak_bytes"), raw=raw)
    with pytest.raises(PlanError, match=rf"field metadata\.measured\.peak_bytes: holds {found}"):
        Plan.load(path)
    for args in (["show"], ["show", "--json"], ["validate"], ["replan", "--activation-budget", "0.9"]):
        assert cli(*args, str(path))[0] == 2, args
    # Not 1, which --exit-code means "the plans differ": a CI job must not read a corrupt file as a change.
    code, err = cli("diff", "--exit-code", str(REAL), str(path))
    assert code == 2 and "metadata.measured.peak_bytes" in err


def test_nesting_deeper_than_any_plan_is_refused_naming_where(tmp_path):
    path = write(tmp_path, _set("metadata", "run"), raw="[" * 100 + "]" * 100)
    with pytest.raises(PlanError, match=r"field metadata\.run\[0\]\[0\].*nested more than 32 levels"):
        Plan.load(path)
    deeper = write(tmp_path, _set("metadata", "run"), raw="[" * 100_000 + "]" * 100_000)  # past the parser's limit
    with pytest.raises(PlanError, match="nested too deeply"):
        Plan.load(deeper)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("metadata", "budget", value="20GiB"), "metadata.budget: must be an object"),
        (_set("metadata", "budget", "limit_bytes", value="20GiB"), "metadata.budget.limit_bytes: must be an integer"),
        (_set("metadata", "search", value=["TPE"]), "metadata.search: must be an object"),
        (_set("metadata", "search", "fell_back", value="yes"), "metadata.search.fell_back: must be"),
        (_set("metadata", "conditions", value="cpu"), "metadata.conditions: must be an object"),
        (
            _set("metadata", "conditions", "device_capacity_bytes", value="80GB"),
            "metadata.conditions.device_capacity_bytes: must be",
        ),
    ],
    ids=["budget", "budget.limit_bytes", "search", "search.fell_back", "conditions", "conditions.capacity"],
)
def test_a_mistyped_budget_search_or_conditions_is_refused_by_the_callback_naming_the_field(tmp_path, edit, field):
    path = write(tmp_path, edit)
    with pytest.raises(PlanError, match=rf"field {field.replace('.', '[.]')}"):
        ActivationCheckpointTuner(plan=path)  # plan=: read at construction


def test_a_corrupt_plan_path_file_fails_the_fit_with_a_plan_error_naming_the_field(tmp_path):
    path = write(tmp_path, _set("metadata", "budget", "fraction", value="half"))
    tuner = ActivationCheckpointTuner(plan_path=path, verbose=False)
    with pytest.raises(PlanError, match=r"field metadata\.budget\.fraction: must be a number or null"):
        quiet_trainer(tmp_path, [tuner], steps=1).fit(LitGPT(n_layer=2, block_size=32, dropout=0.0), token_loader(8))
    assert json.loads(path.read_text())["metadata"]["budget"]["fraction"] == "half", "the file is left as it was"


PROFILE_EDITS = [
    (_set("metadata", "profile", "memory", "blocks", 0, "saved_bytes", "full", value="16KiB"), "saved_bytes.full"),
    (_set("metadata", "profile", "memory", "phases", 0, value=["pre", None, "1", 2]), "phases[0][2]"),
    (_set("metadata", "profile", "time", "calibration", "base_seconds", value="fast"), "base_seconds"),
    (_set("metadata", "profile", "stacks", 0, "blocks", 0, "children", 0, value="mlp"), "children[0]"),
    (_set("metadata", "profile", "search_space", "modes", value=[7]), "search_space.modes[0]"),
    (_set("metadata", "profile", "optimizer_step", value=[0, 0, 0]), "profile.optimizer_step"),
    (_set("metadata", "profile", "batch_size", value=0), "profile.batch_size"),
]


@pytest.mark.parametrize(("edit", "field"), PROFILE_EDITS, ids=[f for _, f in PROFILE_EDITS])
def test_a_mistyped_profile_is_refused_by_replan_and_the_callbacks_re_plan_naming_the_field(
    tmp_path, view, edit, field
):
    path = write(tmp_path, edit)
    code, err = cli("replan", str(path), "--activation-budget", "0.9")
    assert code == 2 and field in err, err
    with pytest.raises(PlanError, match="field metadata.profile"):
        ActivationCheckpointTuner(plan=path, activation_budget=0.9)  # the callback would re-plan it for 0.9


def test_show_refuses_a_mistyped_profile_naming_the_field(tmp_path):
    path = write(tmp_path, _set("metadata", "profile", "time", "calibration", "base_seconds", value="fast"))
    for args in (["show"], ["show", "--json"]):
        code, err = cli(*args, str(path))
        assert code == 2 and "field metadata.profile.time.calibration.base_seconds: must be a number" in err, err


def test_a_profile_that_breaks_no_type_but_no_prediction_holds_is_refused_by_every_re_plan(tmp_path, view):
    """Well-typed but inconsistent: a phase names a block the profile does not have."""
    path = write(tmp_path, _set("metadata", "profile", "memory", "phases", 1, 1, value=7))
    code, err = cli("replan", str(path), "--activation-budget", "0.9")
    assert code == 2 and f"{path}: field metadata.profile.memory.phases[1]: phase 'fwd' names block 7" in err, err
    assert cli("validate", str(path))[0] == 2
    assert cli("show", str(path))[0] == 0, "show only prints the profile"
    plan = Plan.load(path)
    conditions = RunConditions(**BASE["metadata"]["conditions"])
    with pytest.warns(UserWarning, match="could not re-plan"):
        wanted = RequestedBudget.parse(activation_budget=0.9)
        assert reusable(plan, "plan file", conditions, view, wanted, on_stale_plan="retune")[1] is None


def _hand_added_block(data: Any) -> None:
    data["blocks"]["model.transformer.h.12"] = {"mode": "full"}  # the model and the file's profile have h.0 and h.1


@pytest.mark.parametrize("command", [["validate"], ["show"], ["replan", "--activation-budget", "0.5"], ["diff"]])
def test_a_block_its_own_profile_never_saw_is_refused_by_every_command(tmp_path, command):
    path = write(tmp_path, _hand_added_block)
    args = [command[0], str(path), *command[1:]] + ([str(REAL)] if command[0] == "diff" else [])
    code, err = cli(*args)
    assert code == 2, err  # refused as a bad file, not "OK" with the old measured figures
    assert "'model.transformer.h.12' is not in the profile the file keeps" in err and "bad.json" in err


def test_plan_path_with_a_hand_edited_block_re_tunes_with_a_warning_naming_the_file(tmp_path):
    path = write(tmp_path, _hand_added_block)
    tuner = ActivationCheckpointTuner(plan_path=path, activation_budget=0.6, search={"n_trials": 2}, verbose=False)
    with pytest.warns(UserWarning, match=r"bad\.json.*model\.transformer\.h\.12.*Re-tuning instead"):
        quiet_trainer(tmp_path, [tuner], steps=1).fit(LitGPT(n_layer=2, block_size=32, dropout=0.0), token_loader(8))
    assert tuner.trials_run > 0  # it searched, and the file now holds the search's plan
    assert "model.transformer.h.12" not in json.loads(path.read_text())["blocks"]


def test_plan_with_a_hand_edited_block_is_refused_naming_the_file(tmp_path):
    path = write(tmp_path, _hand_added_block)
    with pytest.raises(PlanError, match=r"bad\.json.*'model\.transformer\.h\.12' is not in the profile"):
        ActivationCheckpointTuner(plan=path)


def test_a_plan_naming_a_module_the_model_lacks_re_tunes_instead_of_failing_the_fit(tmp_path, view):
    # No profile to check it against in the file: the model is what it is checked against, before anything applies.
    data = copy.deepcopy(BASE)
    data["metadata"] = {k: v for k, v in data["metadata"].items() if k not in ("profile", "plan_table")}
    _hand_added_block(data)
    plan = Plan.from_dict(data, source="hand-edited")
    conditions = RunConditions(**BASE["metadata"]["conditions"])
    with pytest.warns(UserWarning, match=r"names 1 module\(s\) this model does not have: 'model\.transformer\.h\.12'"):
        assert reusable(plan, "plan=x.json", conditions, view, RequestedBudget(), on_stale_plan="retune")[1] is None
    with pytest.raises(PlanError, match="does not have"):
        reusable(plan, "plan=x.json", conditions, view, RequestedBudget(), on_stale_plan="raise")
