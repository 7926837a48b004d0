"""configs/*.yaml: each parses with the LightningCLI entry point and builds the callback it describes.

A renamed callback argument or a typo in a config fails here, not in a user's first run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, ConfigurationError, GuardConfig, Plan, TuneConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
TUNER = "lightning_ckpt.ActivationCheckpointTuner"

# The smallest model and search that still tune for real: keeps the end-to-end run to seconds.
TINY = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--data.block_size", "16",
        "--data.batch_size", "4", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"]  # fmt: skip


def _load_cli_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt_cli", ROOT / "examples" / "train_gpt_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_gpt_cli = _load_cli_module()


class BuildWithoutTrainer(train_gpt_cli.CharGPTCLI):
    """Parse a config and build its model, data and callbacks exactly as ``fit`` would, but no Trainer:
    a GPU config must be checkable on a CPU-only machine."""

    def instantiate_classes(self) -> None:
        # jsonargparse >= 4.49 renamed instantiate_classes to instantiate.
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        self.config_init = instantiate(self.config)


def _tuner_sections(path: Path) -> list[dict[str, Any]]:
    callbacks = yaml.safe_load(path.read_text())["trainer"].get("callbacks", [])
    return [cb.get("init_args", {}) for cb in callbacks if cb["class_path"] == TUNER]


def _expected(key: str, value: Any) -> tuple[str, Any]:
    """The attribute a YAML value lands in, and the value it should have there."""
    if key in ("plan_path", "log_dir"):
        return key, Path(value)
    if key == "search":
        return "config", TuneConfig().with_overrides(value)
    if key == "guard":
        return "guard", GuardConfig(**value)
    if key == "plan":
        return "_given_plan", Plan.load(value)  # the file is read when the callback is built
    return key, value


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Relative paths in configs (plans/, runs/) resolve here; reuse_plan.yaml finds a plan to reuse."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_gpt_cli.py"])  # LightningCLI warns when pytest's own args are there
    Plan({"model.transformer.h.0": BlockPlan("full")}, name="for-reuse").save(tmp_path / "plans" / "gpt.json")
    return tmp_path


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_builds_the_callback_it_describes(path, in_tmp):
    sections = _tuner_sections(path)
    assert len(sections) == 1, f"{path.name} should configure exactly one ActivationCheckpointTuner"
    cli = BuildWithoutTrainer(
        train_gpt_cli.CharGPTModule, train_gpt_cli.CharDataModule, args=["--config", str(path)], run=False
    )
    (tuner,) = [cb for cb in cli.config_init.trainer.callbacks if isinstance(cb, ActivationCheckpointTuner)]
    for key, value in sections[0].items():
        attribute, expected = _expected(key, value)
        assert getattr(tuner, attribute) == expected, f"{path.name}: {key}"
    model_section = yaml.safe_load(path.read_text()).get("model", {})
    assert {k: cli.config_init.model.hparams[k] for k in model_section} == model_section


def test_a_typo_in_a_config_is_refused(tmp_path, in_tmp, capsys):
    text = (ROOT / "configs" / "cpu_quickstart.yaml").read_text().replace("activation_budget:", "activation_budgt:")
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(SystemExit):
        BuildWithoutTrainer(
            train_gpt_cli.CharGPTModule, train_gpt_cli.CharDataModule, args=["--config", "typo.yaml"], run=False
        )
    assert "activation_budgt" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_quickstart_tunes_then_reuse_plan_reuses(in_tmp):
    (in_tmp / "plans" / "gpt.json").unlink()
    search = [
        "--trainer.callbacks.init_args.search.n_trials",
        "2",
        "--trainer.callbacks.init_args.search.measure_steps",
        "1",
    ]
    first = train_gpt_cli.main(["fit", "--config", str(ROOT / "configs" / "cpu_quickstart.yaml"), *TINY, *search])
    (tuner,) = [cb for cb in first.trainer.callbacks if isinstance(cb, ActivationCheckpointTuner)]
    assert first.trainer.global_step == 2 and tuner.trials_run > 0
    assert Plan.load(in_tmp / "plans" / "gpt.json") == tuner.plan
    assert list((in_tmp / "runs" / "gpt_cli").rglob("events.out.tfevents.*"))

    again = train_gpt_cli.main(["fit", "--config", str(ROOT / "configs" / "reuse_plan.yaml"), *TINY])
    (reused,) = [cb for cb in again.trainer.callbacks if isinstance(cb, ActivationCheckpointTuner)]
    assert reused.trials_run == 0 and reused.plan == tuner.plan


def test_every_callback_argument_has_help_and_enumerations_are_choices():
    """``--help`` of a LightningCLI (jsonargparse reads the docstring) explains every argument, and options
    with a fixed set of values are typed ``Literal``, so a wrong value is refused with the choices."""
    import inspect
    import typing

    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ActivationCheckpointTuner, "cb")
    actions = {a.dest.removeprefix("cb."): a for a in parser._actions if a.dest.startswith("cb.")}
    names = [n for n in inspect.signature(ActivationCheckpointTuner).parameters]
    missing = [n for n in names if not (actions[n].help or "").strip()]
    assert not missing, f"callback arguments without help text: {missing}"
    hints = {
        **typing.get_type_hints(TuneConfig),
        **typing.get_type_hints(GuardConfig),
        **typing.get_type_hints(ActivationCheckpointTuner.__init__),
    }
    choices = {
        "on_stale_plan": ("retune", "raise"),
        "on_infeasible": ("fallback", "raise"),
        "on_budget_exceeded": ("switch", "raise", "warn"),
        "memory_pass": ("finalists", "every"),
    }
    for name, values in choices.items():
        assert typing.get_args(hints[name]) == values, name
    # search= and guard= also take a dict, which jsonargparse accepts as it is: their configs refuse a wrong
    # value when the callback is built, with the choices.
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    refused = {"search.on_infeasible": "'fallback' or 'raise'", "guard.on_budget_exceeded": "'switch', 'raise' or"}
    for name, match in refused.items():
        with pytest.raises(ConfigurationError, match=match):
            instantiate(parser.parse_args([f"--cb.{name}", "shrug"]))
