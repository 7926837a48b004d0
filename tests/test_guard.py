"""The budget on the real run: AdamW state and step, mixed precision, the guard after lock-in, larger batches."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lit import LitGPT, quiet_trainer, token_loader
from torch.utils.data import DataLoader

from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, Plan, apply_plan, discover_blocks
from lightning_ckpt.errors import InfeasibleBudgetError
from lightning_ckpt.lightning.guard import lower_memory_trial
from lightning_ckpt.measure.tracker import new_live_tracker
from lightning_ckpt.plan.baselines import uniform_plan

SPACE = {
    "modes": ["full", "selective:mlp"],
    "selections": ["all", "first:0.5"],
    "rest_modes": ["none"],
    "segments": False,
}


class Net(LitGPT):
    """A GPT trained with AdamW whose every real step (closure + optimizer step) is read by the live tracker."""

    def __init__(self, optimizer: str = "adamw") -> None:
        adamw = _LateStateAdamW if optimizer == "late_state" else torch.optim.AdamW
        super().__init__(n_layer=4, n_embd=64, vocab_size=64, block_size=32, dropout=0.0, optimizer=adamw, lr=1e-3)
        self.peaks: list[int] = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        tracker = new_live_tracker("cpu")
        tracker.track_external(self, optimizer)
        tracker.total_peak = tracker.now()[0]
        with tracker:
            optimizer.step(closure=optimizer_closure)
        self.peaks.append(tracker.total_peak)


class _LateStateAdamW(torch.optim.AdamW):
    """AdamW that creates an extra parameter-sized buffer per parameter only from its second step on:
    the state a measured first step cannot show, which only the guard can catch."""

    def step(self, closure=None):
        loss = super().step(closure)
        self._steps = getattr(self, "_steps", 0) + 1
        if self._steps >= 2:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("late", torch.zeros_like(p))
                    self.state[p].setdefault("late2", torch.zeros_like(p))
        return loss


def loader(batch: int = 8, seq: int = 32, n: int = 64) -> DataLoader:
    return token_loader(n, seq, vocab=64, batch_size=batch)


def fit(tmp_path, callbacks, model: Net, *, steps: int = 4, precision: str = "32-true", data=None) -> L.Trainer:
    trainer = quiet_trainer(tmp_path, callbacks, steps=steps, precision=precision)
    trainer.fit(model, data or loader())
    return trainer


def real_peak(tmp_path, plan_of, precision: str, steps: int = 3, data=None) -> int:
    """The highest real-step peak with a plan applied by hand, no tuner."""
    net = Net()
    handle = apply_plan(net, plan_of(net))
    fit(tmp_path, [], net, steps=steps, precision=precision, data=data)
    handle.remove()
    return max(net.peaks)


def full(net: Net) -> Plan:
    return uniform_plan(discover_blocks(net), BlockPlan("full"))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_every_real_step_after_lock_in_fits_the_budget(tmp_path, precision):
    lo, hi = real_peak(tmp_path, full, precision), real_peak(tmp_path, lambda n: Plan(), precision)
    assert hi > 1.3 * lo, "the case must leave room for plans between full and none"
    budget = (lo + hi) // 2
    net = Net()
    cb = ActivationCheckpointTuner(
        max_memory=budget, verbose=False, search=dict(n_trials=6, measure_steps=1, search_space=SPACE)
    )
    fit(tmp_path, [cb], net, steps=4, precision=precision)
    assert not cb.result.fell_back
    assert len(net.peaks) == 4
    assert max(net.peaks) <= budget, f"real steps peaked at {[p / budget for p in net.peaks]} of the budget"
    # The trial figures it chose on are the real step's: optimizer state and step included, and close.
    best = cb.result.best_trial
    assert best.peak_bytes > best.forward_backward_peak_bytes
    assert best.peak_bytes == pytest.approx(max(net.peaks), rel=0.05)
    # The guard read the first real steps and found them within the budget; the plan file would say so.
    assert [c.within_budget for c in cb.step_checks] == [True, True]
    assert cb.plan.metadata["real_steps"][0]["peak_bytes"] <= budget
    assert cb.plan.metadata["optimizer_step"]["state_bytes_after"] > 0


def test_guard_catches_late_optimizer_state_and_switches_to_a_lower_memory_plan(tmp_path):
    lo, hi = real_peak(tmp_path, full, "32-true"), real_peak(tmp_path, lambda n: Plan(), "32-true")
    net = Net("late_state")
    # Budget that `none` meets in trials (optimizer step measured once, without the late state) but not later.
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    budget = hi + params
    # n_trials=1: only the first baseline, `none`, is measured, so the choice does not depend on timing.
    cb = ActivationCheckpointTuner(
        max_memory=budget,
        verbose=False,
        plan_path=tmp_path / "plan.json",
        search=dict(n_trials=1, measure_steps=1, search_space=SPACE),
        guard=dict(steps=3),
    )
    with pytest.warns(UserWarning, match="over the budget.*Switching to"):
        fit(tmp_path, [cb], net, steps=5)
    assert cb.result.best.is_empty, "without the late state, no checkpointing fits"
    over = [c for c in cb.step_checks if not c.within_budget]
    assert over and over[0].plan == "none"
    assert not cb.plan.is_empty and cb.plan.metadata["switched_from"] == "none"
    assert cb.step_checks[-1].within_budget
    saved = Plan.load(tmp_path / "plan.json")
    assert saved == cb.plan and any(not c["within_budget"] for c in saved.metadata["real_steps"])
    assert lo < budget


def test_guard_can_raise_instead(tmp_path):
    hi = real_peak(tmp_path, lambda n: Plan(), "32-true")
    net = Net("late_state")
    budget = hi + sum(p.numel() * p.element_size() for p in net.parameters())
    cb = ActivationCheckpointTuner(
        max_memory=budget,
        verbose=False,
        search=dict(n_trials=1, measure_steps=1, search_space=SPACE),
        guard=dict(steps=3, on_budget_exceeded="raise"),
    )
    with pytest.raises(InfeasibleBudgetError, match="over the budget"):
        fit(tmp_path, [cb], net, steps=5)


class _GrowingLoader:
    """Batches of 8 sequences, then one of 32: a curriculum the tuned first batch did not show."""

    def __init__(self) -> None:
        self.batches = [next(iter(loader(8))), next(iter(loader(8))), next(iter(loader(32)))]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_a_larger_later_batch_is_checked_against_the_budget(tmp_path):
    lo, hi = real_peak(tmp_path, full, "32-true"), real_peak(tmp_path, lambda n: Plan(), "32-true")
    budget = (lo + hi) // 2
    cb = ActivationCheckpointTuner(
        max_memory=budget,
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
        guard=dict(steps=1, on_budget_exceeded="warn"),
    )
    net = Net()
    with pytest.warns(UserWarning, match=r"batch 32 x 32\) used .* over the budget"):
        fit(tmp_path, [cb], net, steps=3, data=_GrowingLoader())
    # Steps 0 and 1 by the guard (the first with the optimizer's state throughout is step 1), step 2 for its batch.
    assert [c.batch_dims[0] for c in cb.step_checks] == [8, 8, 32]
    assert [c.within_budget for c in cb.step_checks] == [True, True, False]


def test_lower_memory_trial_picks_the_fastest_plan_expected_to_fit():
    from lightning_ckpt.budget import Budget
    from lightning_ckpt.search.ledger import TrialRecord

    def rec(name: str, peak: int, sps: float, status: str = "ok") -> TrialRecord:
        plan = Plan({"h.0": BlockPlan("full")}, name=name) if name != "none" else Plan()
        if name == "b":
            plan = Plan({"h.1": BlockPlan("full")})
        if name == "c":
            plan = Plan({"h.0": BlockPlan("full"), "h.1": BlockPlan("full")})
        return TrialRecord(0, plan, name, {}, status, peak_bytes=peak, samples_per_second=sps)

    trials = [rec("none", 100, 10.0), rec("a", 80, 9.0), rec("b", 70, 8.0), rec("c", 50, 5.0, "over_budget")]
    budget = Budget("peak", 90)
    assert lower_memory_trial(trials, Plan().key(), budget, excess=15).label == "b"  # a: 80 + 15 > 90
    assert lower_memory_trial(trials, Plan().key(), budget, excess=30).label == "c"
    assert lower_memory_trial(trials, Plan().key(), budget, excess=50) is None


def _rec(plan: Plan, label: str, peak: int, sps: float | None, status: str = "ok"):
    from lightning_ckpt.search.ledger import TrialRecord

    if status == "pruned":  # a plan the search predicted and never ran
        return TrialRecord(0, plan, label, {}, status, predicted_peak_bytes=peak, predicted_activation_bytes=peak)
    return TrialRecord(0, plan, label, {}, status, peak_bytes=peak, activation_bytes=peak, samples_per_second=sps)


def test_the_guard_never_moves_to_a_plan_that_needs_more_memory_nor_back_to_one_that_went_over():
    from lightning_ckpt.budget import Budget
    from lightning_ckpt.lightning.guard import lower_plan

    net = Net()
    stacks = discover_blocks(net)
    none, full_plan = Plan(), full(net)
    half = Plan({"model.transformer.h.0": BlockPlan("full"), "model.transformer.h.1": BlockPlan("full")})
    # `full` was pruned by the time model (predicted, never measured); `none` and `half` ran.
    trials = [_rec(none, "none", 100, 10.0), _rec(half, "half", 70, 8.0), _rec(full_plan, "full", 40, None, "pruned")]
    budget = Budget("peak", 90)
    # `full` over the budget: `none` fits its trial figure plus nothing, but needs more than `full`: no move (the
    # old guard compared with nothing and moved to `none`, then back to `full`, step after step).
    assert lower_plan(full_plan, trials, budget, stacks) is None
    # `none` over: the fastest measured plan below it that fits, `half`; once `half` went over too, `full`.
    assert lower_plan(none, trials, budget, stacks, exclude={none.key()}).key() == half.key()
    lower = lower_plan(half, trials, budget, stacks, exclude={none.key(), half.key()})
    assert lower.key() == full_plan.key() and lower.metadata["switched_from"] == half.describe()
    # A prediction at a larger batch: `half` at 2x its activations (70 + 70) does not fit, so `full` it is.
    doubled = lower_plan(none, trials, budget, stacks, exclude={none.key()}, predict=lambda key, peak, act: 2 * act)
    assert doubled.key() == full_plan.key()
    # Nothing below `full` is left once it went over: stay.
    assert lower_plan(full_plan, trials, budget, stacks, exclude={none.key(), half.key(), full_plan.key()}) is None


class _Batches:
    """The given (rows, length) batches in order: a curriculum, a long tail."""

    def __init__(self, shapes, extra=None) -> None:
        self.batches = [next(iter(loader(rows, seq=length, n=rows))) for rows, length in shapes]
        if extra is not None:
            self.batches = [(*b, torch.tensor(e)) for b, e in zip(self.batches, extra, strict=True)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


SHORT, LONG = (32, 8), (32, 32)


def _short_then_long(tmp_path) -> tuple[_Batches, int]:
    """A short batch, then four 4x longer ones, and a budget that `none` meets on the short batch and only
    checkpointing meets on the long ones."""
    # Two steps each: the second holds AdamW's state, as every later step does.
    none_short = real_peak(tmp_path, lambda n: Plan(), "32-true", steps=2, data=_Batches([SHORT] * 2))
    full_long = real_peak(tmp_path, full, "32-true", steps=2, data=_Batches([LONG] * 2))
    none_long = real_peak(tmp_path, lambda n: Plan(), "32-true", steps=2, data=_Batches([LONG] * 2))
    budget = max(none_short, full_long) * 21 // 20
    assert none_long > budget, "the long batch needs checkpointing at this budget"
    return _Batches([SHORT] + [LONG] * 4), budget


def test_a_longer_later_batch_is_moved_to_a_plan_that_fits_before_its_forward_and_never_back(tmp_path):
    # The run: tuned on short batches, then 4x longer ones. The old guard read the long step after it ran
    # (2x the budget; on a GPU an OOM), switched to `full`, then oscillated `full` / `none`.
    data, budget = _short_then_long(tmp_path)
    cb = ActivationCheckpointTuner(
        max_memory=budget, verbose=False, search=dict(n_trials=6, measure_steps=1, search_space=SPACE)
    )
    net = Net()
    with pytest.warns(UserWarning, match=r"next batch \(32 x 32, .* Switching to .* before it runs"):
        fit(tmp_path, [cb], net, steps=5, data=data)
    assert len(net.peaks) == 5 and max(net.peaks) <= budget, [p / budget for p in net.peaks]
    long_checks = [c for c in cb.step_checks if c.size == "32 x 32"]
    assert long_checks and all(c.within_budget for c in long_checks)
    assert "none" not in [c.plan for c in long_checks], "never back to a plan that needs more"


def test_with_the_longest_batch_declared_the_search_tunes_for_it_and_no_step_goes_over(tmp_path):
    data, budget = _short_then_long(tmp_path)
    cb = ActivationCheckpointTuner(
        max_memory=budget,
        max_shape=LONG,
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
        guard=dict(on_budget_exceeded="raise"),
    )
    net = Net()
    fit(tmp_path, [cb], net, steps=5, data=data)  # "raise": any step over the budget, read or predicted, fails
    assert cb.plan.metadata["conditions"]["seq_len"] == LONG[1], "tuned for the declared longest batch"
    assert not cb.plan.is_empty and len(net.peaks) == 5 and max(net.peaks) <= budget
    assert all(c.within_budget for c in cb.step_checks)


def test_after_the_first_steps_one_step_in_every_n_is_read(tmp_path):
    cb = ActivationCheckpointTuner(
        max_memory=10**10,
        verbose=False,
        search=dict(n_trials=2, measure_steps=1, search_space=SPACE),
        guard=dict(steps=1, every=2),
    )
    fit(tmp_path, [cb], Net(), steps=6)
    # Batches 0-1 (through the first holding the optimizer's state), then every second one (3 and 5); a check
    # records the global step after its update.
    assert [c.step for c in cb.step_checks] == [1, 2, 4, 6]


class _PackedNet(Net):
    def training_step(self, batch, batch_idx):
        x, y, _lengths = batch
        return self.model(x, y)


def test_a_packed_batch_is_sized_by_the_users_key(tmp_path):
    # Every batch is padded to 4 x 32; the sequences it packs sum to 32, 32, then 128 tokens: only the key says so.
    data = _Batches([(4, 32)] * 3, extra=[[8, 8, 8, 8], [8, 8, 8, 8], [32, 32, 32, 32]])
    cb = ActivationCheckpointTuner(
        max_memory=10**10,
        verbose=False,
        search=dict(n_trials=2, measure_steps=1, search_space=SPACE),
        guard=dict(steps=1, every=0, shape_key=lambda b: (1, int(b[2].sum()))),
    )
    fit(tmp_path, [cb], _PackedNet(), steps=3, data=data)
    assert [c.size for c in cb.step_checks] == ["1 x 32", "1 x 32", "1 x 128"]


# ---------------------------------------------------------------------------------------------------
# activation_budget: real steps are read as trials are (activation = what the step creates other than
# gradients and optimizer state), on CPU and on CUDA.
# ---------------------------------------------------------------------------------------------------
def test_under_an_activation_budget_real_steps_read_the_trials_activation(tmp_path):
    net = Net()
    cb = ActivationCheckpointTuner(
        activation_budget=0.5, verbose=False, search=dict(n_trials=6, measure_steps=1, search_space=SPACE)
    )
    fit(tmp_path, [cb], net, steps=3)
    trial = cb.result.best_trial.activation_bytes
    assert [c.within_budget for c in cb.step_checks] == [True, True]
    for check in cb.step_checks:  # Lightning runs the step inside optimizer.step(closure): still activation
        assert check.activation_bytes == pytest.approx(trial, rel=0.02), (check.activation_bytes, trial)


def test_under_an_activation_budget_a_later_batch_4x_longer_is_caught(tmp_path):
    class Growing:
        def __init__(self) -> None:
            self.batches = [next(iter(loader(8, seq=8))), next(iter(loader(8, seq=8))), next(iter(loader(8, seq=32)))]

        def __iter__(self):
            return iter(self.batches)

        def __len__(self) -> int:
            return 3

    cb = ActivationCheckpointTuner(
        activation_budget=0.5,
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
        guard=dict(steps=1, on_budget_exceeded="raise"),
    )
    # Caught before its forward (on a GPU, after it is an out-of-memory error): nothing of it ran.
    match = r"next batch \(8 x 32, larger than the 8 x 8 read so far\) is predicted .* checked before its forward"
    with pytest.raises(InfeasibleBudgetError, match=match):
        fit(tmp_path, [cb], Net(), steps=3, data=Growing())
    assert [c.within_budget for c in cb.step_checks] == [True, True]


def test_on_cuda_an_activation_reading_leaves_out_gradients_and_optimizer_state(monkeypatch):
    # The allocator's peak - resting of a first real step also holds the new gradients (1x params) and AdamW's
    # state (2x): a fake allocator reports exactly that, and the reading must still be the tracker's activation.
    from lightning_ckpt.lightning import step_reader

    counters = {"allocated": 0, "peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(step_reader, "new_live_tracker", lambda device, model, opt: new_live_tracker("cpu", model, opt))
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    x, y = next(iter(loader()))

    def step(reader, **kw):
        counters["allocated"] = params
        reader.start(net, [optimizer], (x, y), **kw)
        optimizer.step(closure=lambda: net.training_step((x, y), 0).backward() or 0.0)
        counters["peak"] = params * 4 + 1000  # params + grads + AdamW's two moments + temporaries
        return reader.stop()

    cpu_reading = step(step_reader.RealStepReader(torch.device("cpu")))  # the same step, read as on CPU
    optimizer.zero_grad(set_to_none=True)
    reader = step_reader.RealStepReader(torch.device("cuda", 0))
    reading = step(reader)
    assert reading.peak_bytes == params * 4 + 1000  # the peak is the allocator's
    assert reading.activation_bytes == cpu_reading.activation_bytes > 0  # activation is the tracker's
    assert reading.activation_bytes != reading.peak_bytes - reading.resting_bytes
    optimizer.zero_grad(set_to_none=True)
    assert step(reader, activation=False).activation_bytes is None  # a peak budget reads the allocator only


def test_a_compiled_real_step_is_read_as_compiled_trials_are_on_cuda_and_cpu(monkeypatch):
    # The tracker's dispatch mode would make dynamo run the step eagerly: a compiled step's activation is the bytes
    # it saves for backward (compile.SavedForBackward), its CUDA peak the allocator's, with no tracker at all.
    from lightning_ckpt.lightning import step_reader
    from lightning_ckpt.measure.saved_for_backward import SavedForBackward
    from lightning_ckpt.search.compile import reset_compiled

    reset_compiled()
    net = Net()
    compiled = torch.compile(net, backend="aot_eager")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = next(iter(loader()))
    with SavedForBackward(net, [optimizer], (x, y)) as expected:
        compiled.training_step((x, y), 0).backward()
    net.zero_grad(set_to_none=True)

    def step(reader):
        reader.start(net, [optimizer], (x, y), compiled=True)
        optimizer.step(closure=lambda: compiled.training_step((x, y), 0).backward() or 0.0)
        optimizer.zero_grad(set_to_none=True)
        return reader.stop()

    monkeypatch.setattr(step_reader, "new_live_tracker", lambda *a: pytest.fail("a compiled step must not be tracked"))
    on_cpu = step(step_reader.RealStepReader(torch.device("cpu")))
    assert on_cpu.activation_bytes == expected.saved_bytes > 0
    assert on_cpu.peak_bytes == on_cpu.resting_bytes + on_cpu.activation_bytes  # as a compiled CPU trial's
    counters = {"allocated": 0, "peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    counters.update(allocated=5000, peak=99999)
    on_cuda = step(step_reader.RealStepReader(torch.device("cuda", 0)))
    assert on_cuda.peak_bytes == 99999 and on_cuda.activation_bytes == expected.saved_bytes
    reset_compiled()


class _SkippingNet(Net):
    """Skips batch 1 (``training_step`` returns None): Lightning runs no backward and no optimizer step for it."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def test_a_skipped_step_does_not_use_up_a_guard_reading(tmp_path):
    cb = ActivationCheckpointTuner(
        max_memory=10**10,
        verbose=False,
        search=dict(n_trials=2, measure_steps=1, search_space=SPACE),
        guard=dict(steps=2, every=0),
    )
    fit(tmp_path, [cb], _SkippingNet(), steps=3)
    # Batches 0 and 2 are read (global steps 1 and 3 after their updates; Lightning counts the skipped one too);
    # batch 1 ran no backward and is not a reading: before, it used up the second one (at step 2) and the first
    # step holding AdamW's state was never read.
    assert [c.step for c in cb.step_checks] == [1, 3]
    assert all(c.peak_bytes > 0 for c in cb.step_checks)


def test_a_step_the_allocator_served_only_by_releasing_its_cache_moves_down_the_frontier(caplog):
    # A step within the budget that needed the allocator to release its cache is one fragmented cache away from a
    # refusal on the card: the guard moves to the next plan down before the next step (or warns, if told to).
    from lightning_ckpt.budget import Budget
    from lightning_ckpt.lightning.guard import BudgetGuard, GuardConfig, StepCheck
    from lightning_ckpt.lightning.step_reader import RealStepReader
    from lightning_ckpt.model import ModelView
    from lightning_ckpt.testing import SimulatedCard
    from lightning_ckpt.testing.allocator import AllocatorSizes

    net = Net()
    view = ModelView.of(net)
    none, full_plan = Plan(), full(net)
    half = Plan({"model.transformer.h.0": BlockPlan("full"), "model.transformer.h.1": BlockPlan("full")})
    trials = [_rec(none, "none", 100, 10.0), _rec(half, "half", 70, 8.0), _rec(full_plan, "full", 40, 6.0)]
    # The reader reads the retries off the card: a step that fragments its cache and asks for the large size again.
    card = SimulatedCard(8 * 2**20, segments=AllocatorSizes.scaled(256))
    reader = RealStepReader(torch.device("cpu"))
    with card:
        reader.start(torch.nn.Linear(2, 2), [], activation=False)
        first, other = torch.empty(4 * 2**20, dtype=torch.uint8), torch.empty(2**20, dtype=torch.uint8)
        del first
        kept = [torch.empty(64 * 2**10, dtype=torch.uint8) for _ in range(8)]  # split the cached 4 MiB
        del other  # a segment of its own, fully free: released so that the next request fits
        again = torch.empty(4 * 2**20, dtype=torch.uint8)
        reading = reader.stop()
        del kept, again
    assert reading is not None and reading.alloc_retries >= 1
    check = StepCheck(3, 90, 90, (8, 32), none.describe(), True, alloc_retries=reading.alloc_retries)
    assert check.to_dict()["alloc_retries"] == reading.alloc_retries
    guard = BudgetGuard(GuardConfig(), torch.device("cpu"), Budget("peak", 95))
    lower = guard.near_refusal(check, none, trials, view)
    assert lower is not None and lower.key() == half.key()
    assert guard.near_refusal(StepCheck(4, 60, 60, (8, 32), half.describe(), True), half, trials, view) is None
    warn = BudgetGuard(GuardConfig(on_budget_exceeded="warn"), torch.device("cpu"), Budget("peak", 95))
    with pytest.warns(UserWarning, match="near refusing"):
        assert warn.near_refusal(check, none, trials, view) is None
