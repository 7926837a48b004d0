"""End-to-end: ActivationCheckpointTuner inside Trainer.fit on CPU with a tiny GPT."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from linear_clock import LinearClock
from lit import LitGPT, quiet_trainer, token_loader
from torch import nn
from torchmetrics import MeanMetric

from lightning_ckpt import ActivationCheckpointTuner, Plan, applied_plan, apply_plan
from lightning_ckpt.errors import ConfigurationError, DiscoveryError
from lightning_ckpt.testing import GPT, GPTConfig

SMALL_SPACE = {
    "modes": ["full", "selective:mlp", "ops:save_matmuls"],
    "selections": ["all", "first:0.5"],
    "rest_modes": ["none"],
    "segments": True,
    "chunks": [2],
}


class TinyGPT(LitGPT):
    def __init__(self, oom_on: str | None = None) -> None:
        super().__init__(n_layer=4, n_embd=32, vocab_size=48, block_size=16, dropout=0.1)
        self.bn = nn.BatchNorm1d(32)  # a batch-dependent buffer the trials must not disturb
        self.mean_loss = MeanMetric()
        self.oom_on = oom_on

    def training_step(self, batch, batch_idx):
        x, y = batch
        plan = applied_plan(self)
        if self.oom_on and plan is not None and plan.describe() == self.oom_on and torch.is_grad_enabled():
            raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = self.model(x, y) + 1e-3 * self.bn(self.model.transformer.wte(x).mean(1)).square().mean()
        self.mean_loss(loss)
        self.log("train_loss", loss)
        self.log("mean_loss", self.mean_loss)
        return loss


def trainer(tmp_path, callbacks, *, steps=3, ckpt=False, **kwargs) -> L.Trainer:
    logger = TensorBoardLogger(tmp_path / "tb", name="run")
    return quiet_trainer(tmp_path, callbacks, steps=steps, logger=logger, enable_checkpointing=ckpt, **kwargs)


def tuner(search=None, **kwargs) -> ActivationCheckpointTuner:
    searching = {**dict(n_trials=8, measure_steps=1, warmup_steps=1, search_space=SMALL_SPACE), **(search or {})}
    return ActivationCheckpointTuner(**{"verbose": False, **kwargs}, search=searching)


def test_budget_forces_a_checkpointing_plan_that_fits(tmp_path):
    cb = tuner(activation_budget=0.5, plan_path=tmp_path / "plans" / "gpt.json")
    trainer(tmp_path, [cb]).fit(TinyGPT(), token_loader(64))
    result = cb.result
    assert not result.fell_back
    assert result.best_trial.status == "ok" and not result.best.is_empty
    assert result.best_trial.activation_bytes <= result.budget.limit_bytes
    assert any(t.status in ("pruned", "over_budget") for t in result.trials), "the budget excluded something"
    # The plan file round-trips and records the evidence.
    saved = Plan.load(tmp_path / "plans" / "gpt.json")
    assert saved == cb.plan == result.best
    assert saved.metadata["budget"]["kind"] == "activation"
    assert "none" in saved.metadata["baselines"] and saved.metadata["measured"]["samples_per_second"] > 0


def test_without_budget_the_fastest_measured_plan_wins(tmp_path):
    # On the Linear clock (each Linear call 1 ms, nothing else) the plans' times are the same on any machine: on a
    # busy one the allowance can end the side-by-side rounds before a verdict, and the reference baseline is kept.
    clock = LinearClock()
    cb = tuner(search=dict(tie_tolerance=0.0, clock=clock))
    with clock.installed():
        trainer(tmp_path, [cb]).fit(TinyGPT(), token_loader(64))
    measured = [t for t in cb.result.trials if t.status == "ok"]
    assert cb.result.best_trial.samples_per_second == max(t.samples_per_second for t in measured)


def test_reuse_runs_zero_trials_and_applies_the_same_plan(tmp_path):
    path = tmp_path / "gpt.json"
    first = tuner(activation_budget=0.5, plan_path=path)
    trainer(tmp_path, [first]).fit(TinyGPT(), token_loader(64))
    reuse = ActivationCheckpointTuner(plan=path, verbose=False)
    seen = {}

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen["plan"] = applied_plan(pl_module)

    trainer(tmp_path, [reuse, Spy()]).fit(TinyGPT(), token_loader(64))
    assert reuse.trials_run == 0 and reuse.result is None
    assert seen["plan"] == first.plan
    # The same plan_path on a later run is a cache: same model and budget, no search.
    again = tuner(activation_budget=0.5, plan_path=path)
    trainer(tmp_path, [again]).fit(TinyGPT(), token_loader(64))
    assert again.trials_run == 0 and again.plan == first.plan


def test_resume_from_checkpoint_reapplies_without_trials(tmp_path):
    cb = tuner(activation_budget=0.5)
    t = trainer(tmp_path, [cb], steps=2, ckpt=True)
    t.fit(TinyGPT(), token_loader(64))
    ckpt = t.checkpoint_callback.best_model_path or t.checkpoint_callback.last_model_path
    assert ckpt
    resumed = tuner(activation_budget=0.5)
    trainer(tmp_path, [resumed], steps=4, ckpt=True).fit(TinyGPT(), token_loader(64), ckpt_path=ckpt)
    assert resumed.trials_run == 0 and resumed.plan == cb.plan


def test_simulated_oom_in_one_trial_is_survived(tmp_path):
    cb = tuner(search=dict(n_trials=8, predict_time=False))  # every plan that fits runs, the failing one too
    trainer(tmp_path, [cb]).fit(TinyGPT(oom_on="selective(mlp) h.0-3"), token_loader(64))
    statuses = {t.label: t.status for t in cb.result.trials}
    assert statuses["baseline:selective_mlp"] == "oom"
    assert cb.result.best.describe() != "selective(mlp) h.0-3"


def _fit_state(tmp_path, callbacks, plan=None):
    L.seed_everything(7)
    module = TinyGPT()
    if plan is not None:
        apply_plan(module, plan)
    t = trainer(tmp_path, callbacks, steps=4)
    t.fit(module, token_loader(64))
    opt = t.optimizers[0].state_dict()
    return {
        "weights": {k: v.clone() for k, v in module.state_dict().items()},
        "opt": [s["exp_avg"].clone() for s in opt["state"].values()],
        "metrics": {k: float(v) for k, v in t.callback_metrics.items()},
        "step": t.global_step,
        "rng": torch.get_rng_state(),
        "mean_loss_updates": module.mean_loss._update_count,
    }


def test_tuning_leaves_no_trace_beyond_the_chosen_plan(tmp_path):
    cb = tuner(activation_budget=0.5)
    with_tuner = _fit_state(tmp_path / "a", [cb])
    by_hand = _fit_state(tmp_path / "b", [], plan=cb.plan)
    assert with_tuner["step"] == by_hand["step"] == 4
    assert with_tuner["metrics"] == by_hand["metrics"]
    assert with_tuner["mean_loss_updates"] == by_hand["mean_loss_updates"]
    assert torch.equal(with_tuner["rng"], by_hand["rng"])
    for k, v in by_hand["weights"].items():
        assert torch.equal(with_tuner["weights"][k], v), k  # includes BatchNorm running stats
    for a, b in zip(with_tuner["opt"], by_hand["opt"], strict=True):
        assert torch.equal(a, b)


def test_tensorboard_entries(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = tuner(activation_budget=0.5)
    t = trainer(tmp_path, [cb])
    t.fit(TinyGPT(), token_loader(64))
    acc = EventAccumulator(
        f"{t.logger.log_dir}/lightning_ckpt", size_guidance={"scalars": 0, "tensors": 0, "images": 0}
    )
    acc.Reload()
    scalar_tags = acc.Tags()["tensors"]  # the report writes scalars as tensors (add_scalar new_style)
    assert any("samples_per_second" in tag for tag in scalar_tags)
    assert any("peak" in tag for tag in scalar_tags)
    assert acc.Tags()["images"], "the Pareto figure"
    texts = [tag for tag in acc.Tags()["tensors"] if "plan" in tag]
    assert texts


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_memory": "20 gigs"}, "not a memory size"),
        ({"max_memory": -1}, "positive"),
        ({"activation_budget": 0}, r"\(0, 1\]"),
        ({"search": {"n_trials": 0}}, "n_trials"),
        ({"search": {"search_space": {"mode": ["full"]}}}, "Unknown search-space names"),
        ({"plan_path": f"{__file__}/plan.json"}, "cannot be written"),  # parent is a file
        ({"plan": Plan(), "search": {"n_trials": 5}, "guard": {"on_stale_plan": "raise"}}, "could never be used"),
        ({"search": {"on_infeasible": "shrug"}}, "on_infeasible"),
        ({"search": {"n_trial": 5}}, "Unknown tune settings"),
        ({"search": 5}, "search must be a TuneConfig or a dict"),
        ({"guard": {"step": 2}}, "Unknown guard settings"),
        ({"tune_micro_batch": 1}, "tune_micro_batch must be True or the batch-size attribute"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        ActivationCheckpointTuner(**kwargs)


def test_model_with_nothing_to_checkpoint(tmp_path):
    class Flat(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 48))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0].float()).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(DiscoveryError, match="block_types"):
        trainer(tmp_path, [tuner()]).fit(Flat(), token_loader(64))


def test_stale_plan_file_retunes_or_raises(tmp_path):
    path = tmp_path / "stale.json"
    other = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=48, block_size=16))
    from lightning_ckpt import baselines

    baselines(other)["full"].save(path)
    data = json.loads(path.read_text())
    data["blocks"] = {f"model.{k}": v for k, v in data["blocks"].items()}
    path.write_text(json.dumps(data))
    from lightning_ckpt.errors import StalePlanError

    with pytest.raises(StalePlanError):
        trainer(tmp_path, [ActivationCheckpointTuner(plan=path, guard={"on_stale_plan": "raise"}, verbose=False)]).fit(
            TinyGPT(), token_loader(64)
        )
    cb = tuner(plan=path)
    with pytest.warns(UserWarning, match="Re-tuning"):
        trainer(tmp_path, [cb]).fit(TinyGPT(), token_loader(64))
    assert cb.trials_run > 0


def test_strategy_that_already_checkpoints_is_refused():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_ckpt.testing.nanogpt import Block

    strategy = FSDPStrategy(activation_checkpointing_policy={Block})
    with pytest.raises(ConfigurationError, match="already applies activation checkpointing"):
        tuner().setup(SimpleNamespace(strategy=strategy), TinyGPT(), "fit")


class _BarClock(L.Callback):
    """Reads Lightning's progress bar right after the first (tuned) step: how long it says the epoch took."""

    def __init__(self) -> None:
        self.elapsed: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning.pytorch.callbacks import RichProgressBar

        if batch_idx != 0:
            return
        bar = trainer.progress_bar_callback
        if isinstance(bar, RichProgressBar):
            self.elapsed = bar.progress.tasks[bar.train_progress_bar_id].elapsed
        else:
            self.elapsed = bar.train_progress_bar.format_dict["elapsed"]


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_quiet_search_one_bar_one_result_line_and_step_one_is_not_the_search(tmp_path, capsys, caplog, bar):
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    if bar == "rich":
        pytest.importorskip("rich")  # optional for Lightning (the GPU image has no rich)
    # Every plan measured (predict_time=False, no allowance, which would keep the trials short for the rounds): a
    # search long enough beside two training steps to tell them apart.
    settings = dict(n_trials=8, measure_steps=3, warmup_steps=2, search_space=SMALL_SPACE, predict_time=False,
                    search_steps=None)  # fmt: skip
    cb = ActivationCheckpointTuner(activation_budget=0.9, search=settings)  # verbose left at its default
    clock = _BarClock()
    progress_bar = TQDMProgressBar() if bar == "tqdm" else RichProgressBar()
    trainer(tmp_path, [cb, clock, progress_bar], steps=2, enable_progress_bar=True).fit(TinyGPT(), token_loader(64))
    out = capsys.readouterr().out + caplog.text  # rank_zero_info goes through logging
    assert out.count("lightning_ckpt: chose ") == 1 and cb.result.best.describe() in out
    assert "[trial " not in out and "samples/s  recompute" not in out  # no trial lines, no table
    assert "lightning_ckpt: tuning" in out  # the tuner's own bar
    assert cb.result.n_measured >= 2
    # Lightning's bar does not count the search as the first step's time.
    assert clock.elapsed is not None and clock.elapsed < 0.5 * cb.result.tuning_seconds, (
        clock.elapsed,
        cb.result.tuning_seconds,
    )


def test_verbose_prints_every_trial_and_the_table(tmp_path, capsys, caplog):
    cb = tuner(activation_budget=0.5, verbose=True)
    trainer(tmp_path, [cb]).fit(TinyGPT(), token_loader(64))
    out = capsys.readouterr().out + caplog.text
    assert out.count("[trial ") >= len(cb.result.trials)
    assert "winner (*)" in out and "lightning_ckpt: chose " in out
