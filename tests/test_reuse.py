"""Plan reuse and the budget: every source (resumed checkpoint, ``plan=``, an earlier fit, the plan file) is
reused only for the budget it was tuned for, compared by value; and a plan file another run wrote meanwhile
is never overwritten silently.

Which plan a search picks depends on timing, so no test here asserts on it: plans are written by hand, and
the tests assert on budgets, warnings, trial counts and file contents.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import warnings

import lightning as L
import pytest
from lit import quiet_trainer, token_loader
from test_conditions import CONDITIONS, SPACE, net  # the same tiny GPT module as the reuse-conditions tests

from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, Plan
from lightning_ckpt.errors import ConfigurationError, StalePlanError, StalePlanWarning
from lightning_ckpt.model import model_fingerprint

GIB = 2**30
NO_BUDGET = {"kind": "none", "limit_bytes": None, "fraction": None, "description": "no budget", "requested": None}
HALF_ACTIVATION = {
    "kind": "activation",
    "limit_bytes": 2**40,
    "fraction": 0.5,
    "description": "50% of no-checkpointing activation memory",
    "requested": None,
}
PEAK_20GIB = {
    "kind": "peak",
    "limit_bytes": 20 * GIB,
    "fraction": None,
    "description": "20.0 GiB peak",
    "requested": "20GiB",
}


def trainer(tmp_path, *callbacks, steps: int = 2) -> L.Trainer:
    return quiet_trainer(tmp_path, list(callbacks), steps=steps)


def tuner(search=None, **kwargs) -> ActivationCheckpointTuner:
    searching = {**dict(n_trials=3, measure_steps=1, search_space=SPACE), **(search or {})}
    return ActivationCheckpointTuner(**{"verbose": False, **kwargs}, search=searching)


def saved_plan(budget, *, block: str = "model.transformer.h.0", fingerprint: str | None = None, name: str = "saved"):
    """A plan as the callback saves it (budget and conditions recorded), for ``net()``, written by hand."""
    return Plan(
        {block: BlockPlan("full")},
        name=name,
        fingerprint=fingerprint or model_fingerprint(net()),
        metadata={"budget": budget, "conditions": CONDITIONS},
    )


def write(path, plan: Plan):
    plan.save(path)
    return path


# -- item 4: a resumed checkpoint's plan is reused only for its budget ----------------------------------------------
def _checkpoint_tuned_without_budget(tmp_path):
    path = write(tmp_path / "plan.json", saved_plan(NO_BUDGET))
    t = trainer(tmp_path, ActivationCheckpointTuner(plan=path, verbose=False))
    t.fit(net(), token_loader(32))
    t.save_checkpoint(tmp_path / "resume.ckpt")
    return tmp_path / "resume.ckpt"


def test_resuming_with_a_changed_budget_retunes_for_it_and_guards_it(tmp_path):
    ckpt = _checkpoint_tuned_without_budget(tmp_path)
    with pytest.raises(StalePlanError, match=r"resumed checkpoint was tuned for no budget.*activation_budget=0\.3"):
        trainer(tmp_path, tuner(activation_budget=0.3, guard={"on_stale_plan": "raise"}), steps=4).fit(
            net(), token_loader(32), ckpt_path=ckpt
        )
    cb = tuner(activation_budget=0.3)
    with pytest.warns(UserWarning, match=r"resumed checkpoint was tuned for no budget.*activation_budget=0\.3"):
        trainer(tmp_path, cb, steps=4).fit(net(), token_loader(32), ckpt_path=ckpt)
    assert cb.trials_run > 0
    assert cb.result.budget.kind == "activation" and cb.result.budget.fraction == 0.3
    assert cb.step_checks, "the guard reads real steps against the requested budget"


def test_resuming_with_the_same_budget_written_otherwise_reuses_and_guards_it(tmp_path):
    path = write(tmp_path / "plan.json", saved_plan(PEAK_20GIB))
    t = trainer(tmp_path, ActivationCheckpointTuner(plan=path, verbose=False))
    t.fit(net(), token_loader(32))
    t.save_checkpoint(tmp_path / "resume.ckpt")
    cb = tuner(max_memory=20 * GIB)
    trainer(tmp_path, cb, steps=4).fit(net(), token_loader(32), ckpt_path=tmp_path / "resume.ckpt")
    assert cb.trials_run == 0 and cb.plan == Plan.load(path)
    assert cb.step_checks and all(check.within_budget for check in cb.step_checks)


# -- item 5: a stale plan is re-tuned for a budget: the plan's own, or the callback's if given ----------------------
@pytest.mark.parametrize(
    "given, kind, named",
    [
        ({}, "activation", "activation_budget=0.5"),
        # Below any host's memory: a CPU budget above it is clamped to it (issue #64), which is not what this checks.
        ({"max_memory": "1GiB"}, "peak", "max_memory='1GiB'"),
    ],
    ids=["the-plan's", "the-callback's"],
)
def test_a_stale_plan_argument_is_retuned_for_a_budget_the_warning_names(tmp_path, given, kind, named):
    path = write(tmp_path / "plan.json", saved_plan(HALF_ACTIVATION, fingerprint="0" * 16))
    cb = tuner(plan=path, **given)
    with pytest.warns(UserWarning, match=rf"another model.*Re-tuning for {named}") as seen:
        trainer(tmp_path, cb).fit(net(), token_loader(32))
    assert cb.trials_run > 0 and cb.result.budget.kind == kind
    if kind == "activation":
        assert cb.result.budget.fraction == 0.5
        assert not any("was tuned for" in str(w.message) and "asks for" in str(w.message) for w in seen)
    else:
        assert cb.result.budget.limit_bytes == 1 * GIB
    saved = cb.plan.metadata["budget"]
    assert (saved["kind"], saved["fraction"] if kind == "activation" else saved["requested"]) == (
        (kind, 0.5) if kind == "activation" else (kind, "1GiB")
    )


def test_a_stale_plan_file_is_retuned_for_its_own_budget(tmp_path):
    path = write(tmp_path / "plan.json", saved_plan(HALF_ACTIVATION, fingerprint="0" * 16))
    cb = tuner(plan_path=path)
    with pytest.warns(StalePlanWarning, match=r"another model.*Re-tuning for activation_budget=0\.5") as seen:
        trainer(tmp_path, cb).fit(net(), token_loader(32))
    assert cb.result.budget.kind == "activation" and cb.result.budget.fraction == 0.5
    # Issue #64: it was a UserWarning from lightning_ckpt/lightning/reuse.py's own line; now a category a user can
    # filter, pointing at the user's line that started the fit.
    stale = [w for w in seen if issubclass(w.category, StalePlanWarning)]
    assert stale and all(w.filename == __file__ for w in stale), [(w.filename, w.lineno) for w in stale]
    write(path, saved_plan(HALF_ACTIVATION, fingerprint="0" * 16))
    with warnings.catch_warnings(record=True) as filtered:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=StalePlanWarning)
        trainer(tmp_path, tuner(plan_path=path)).fit(net(), token_loader(32))
    assert not [w for w in filtered if "another model" in str(w.message)], "the user's filter silences it"


def test_without_a_budget_the_plan_argument_is_guarded_by_its_own(tmp_path):
    path = write(tmp_path / "plan.json", saved_plan(HALF_ACTIVATION))
    cb = ActivationCheckpointTuner(plan=path, verbose=False)
    trainer(tmp_path, cb, steps=3).fit(net(), token_loader(32))
    assert cb.trials_run == 0
    assert cb.step_checks and all(check.activation_bytes is not None for check in cb.step_checks)


# -- item 6: budgets are compared by value, for every reuse source -------------------------------------------------
@pytest.mark.parametrize("written", ["20GiB", "20 GiB", "20gib", 20 * GIB, float(20 * GIB), "21474836480"])
def test_the_same_budget_written_otherwise_reuses_the_plan_file(tmp_path, written):
    path = write(tmp_path / "plan.json", saved_plan(PEAK_20GIB))
    cb = tuner(max_memory=written, plan_path=path)
    trainer(tmp_path, cb).fit(net(), token_loader(32))
    assert cb.trials_run == 0 and cb.result is None and cb.plan == Plan.load(path)


@pytest.mark.parametrize("source", ["plan_path", "plan"])
def test_another_budget_retunes_with_a_warning_naming_both(tmp_path, source):
    path = write(tmp_path / "plan.json", saved_plan(PEAK_20GIB))
    cb = tuner(max_memory="2GiB", **{source: path})  # below any host's memory, which would clamp it
    with pytest.warns(UserWarning, match=r"tuned for max_memory='20GiB'.*asks for max_memory='2GiB'"):
        trainer(tmp_path, cb).fit(net(), token_loader(32))
    assert cb.trials_run > 0 and cb.result.budget.limit_bytes == 2 * GIB


def test_another_fraction_of_activation_memory_is_another_budget(tmp_path):
    path = write(tmp_path / "plan.json", saved_plan(HALF_ACTIVATION))
    same = tuner(activation_budget=0.5, plan_path=path)
    trainer(tmp_path, same).fit(net(), token_loader(32))
    assert same.trials_run == 0
    other = tuner(activation_budget=0.25, plan_path=path)
    with pytest.warns(UserWarning, match=r"activation_budget=0\.5.*activation_budget=0\.25"):
        trainer(tmp_path, other).fit(net(), token_loader(32))
    assert other.result.budget.fraction == 0.25


def test_requested_budgets_are_parsed_once_and_equal_by_value():
    from lightning_ckpt.budget import RequestedBudget
    from lightning_ckpt.cli.metadata import budget_values

    twenty = RequestedBudget.parse("20GiB")
    assert (
        twenty
        == RequestedBudget.parse(21474836480)
        == RequestedBudget.parse("20 GiB")
        == RequestedBudget.parse(float(20 * GIB))
    )
    assert twenty != RequestedBudget.parse("20GB")  # 20 * 10**9
    assert RequestedBudget.parse(activation_budget=1) == RequestedBudget.parse(activation_budget=1.0)
    assert RequestedBudget.parse(0.8) != RequestedBudget.parse(activation_budget=0.8)  # device vs activation share
    assert RequestedBudget.parse(1.0) != RequestedBudget.parse(1)  # 100% of the device vs one byte
    assert RequestedBudget.parse() == RequestedBudget.of_plan(saved_plan(NO_BUDGET))
    assert RequestedBudget.of_plan(saved_plan(PEAK_20GIB)) == twenty
    assert RequestedBudget.of_plan(saved_plan(HALF_ACTIVATION)) == RequestedBudget.parse(activation_budget=0.5)
    assert RequestedBudget.of_plan(Plan()) is None  # a hand-written plan records no budget
    sizeless = RequestedBudget.from_saved({"kind": "peak"})  # a hand-edited one: a kind, no size
    assert not sizeless.recorded and sizeless != twenty and sizeless != RequestedBudget.parse()
    assert "max_memory='20GiB'" in twenty.describe() and "20.0 GiB" in twenty.describe()
    # The CLI reads a plan's requested budget with the same parser.
    assert budget_values(PEAK_20GIB)["requested"] == twenty.value == 20 * GIB
    with pytest.raises(ConfigurationError, match="not both"):
        RequestedBudget.parse("20GiB", 0.5)


# -- item 7: a plan file another run wrote meanwhile is kept, and the run that lost says so ------------------------
OTHER = saved_plan(HALF_ACTIVATION, block="model.transformer.h.1", name="written by another run")


class WriteThePlanFileMeanwhile(L.Callback):
    """Another process saving its plan to the same file while this run tunes (runs before the tuner's hook)."""

    def __init__(self, source, path) -> None:
        self.source, self.path = source, path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            save = "import sys; from lightning_ckpt import Plan; Plan.load(sys.argv[1]).save(sys.argv[2])"
            subprocess.run([sys.executable, "-c", save, str(self.source), str(self.path)], check=True)


def test_a_plan_file_written_by_another_run_meanwhile_is_kept_and_the_loser_says_so(tmp_path, caplog):
    path, source = tmp_path / "plan.json", write(tmp_path / "other.json", OTHER)
    cb = tuner(activation_budget=0.5, plan_path=path)
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning) as seen:
        trainer(tmp_path, WriteThePlanFileMeanwhile(source, path), cb, steps=3).fit(net(), token_loader(32))
    on_disk = Plan.load(path)
    assert on_disk.name == "written by another run" and on_disk == OTHER, "the other run's plan was overwritten"
    assert cb.plan is not None and cb.result is not None and not cb.wrote_plan_file
    lost = [str(w.message) for w in seen if str(path) in str(w.message)]
    assert len(lost) == 1, [str(w.message) for w in seen]
    assert OTHER.describe() in lost[0] and OTHER.digest() in lost[0] and cb.plan.describe() in lost[0]
    assert f"plan saved to {path}" not in caplog.text
    assert cb.step_checks, "the guard ran, and did not write its figures over the other run's plan either"


def test_two_processes_saving_one_new_plan_file_exactly_one_wins(tmp_path):
    path = tmp_path / "plan.json"
    script = textwrap.dedent(
        f"""
        import sys
        from lightning_ckpt import BlockPlan, Plan
        from lightning_ckpt.errors import PlanFileChangedError
        name = sys.argv[1]
        try:
            Plan({{"h." + name: BlockPlan("full")}}, name=name).save({str(path)!r}, unchanged_since=None)
        except PlanFileChangedError as err:
            print("LOST", err)
        else:
            print("SAVED")
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, text=True) for i in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(out.split()[0] for out in outs) == ["LOST", "SAVED"], outs
    winner = Plan.load(path)
    lost = next(out for out in outs if out.startswith("LOST"))
    assert winner.describe() in lost and winner.digest() in lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"], "no temporary or lock file is left behind"


def test_a_save_that_finds_the_file_changed_writes_nothing_and_names_what_it_holds(tmp_path):
    from lightning_ckpt.errors import PlanFileChangedError
    from lightning_ckpt.plan.file import plan_file_version

    path = tmp_path / "plan.json"
    assert plan_file_version(path) is None
    mine, theirs = saved_plan(NO_BUDGET, name="mine"), OTHER
    seen = plan_file_version(write(path, saved_plan(NO_BUDGET, name="first")))
    theirs.save(path, unchanged_since=seen)  # the file is as last seen: written
    before = path.read_bytes()
    with pytest.raises(PlanFileChangedError, match="changed since") as info:
        mine.save(path, unchanged_since=seen)
    assert theirs.describe() in str(info.value) and theirs.digest() in str(info.value)
    assert info.value.current == theirs and path.read_bytes() == before
    mine.save(path, unchanged_since=theirs.file_version())  # what theirs wrote is what is there
    assert Plan.load(path).name == "mine"
    path.unlink()
    mine.save(path, unchanged_since=seen)  # a deleted file holds no plan to lose
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
