"""The plan table (search/buckets.py and the callback's buckets=): one plan per length bucket, chosen from a profile
at each bucket's longest length, switched by each batch's length before its forward, kept in the plan file."""

from __future__ import annotations

import itertools
import json

import lightning as L
import pytest
import torch
from linear_clock import LinearClock
from lit import LitGPT, quiet_trainer
from test_guard import LONG, SHORT, SPACE, Net, _Batches, _PackedNet, fit, full, real_peak

from lightning_ckpt import ActivationCheckpointTuner, BlockPlan, Plan, apply_plan
from lightning_ckpt.cli.main import main
from lightning_ckpt.cli.show import plan_summary
from lightning_ckpt.errors import ConfigurationError, PlanError
from lightning_ckpt.lightning.shapes import batch_at_length
from lightning_ckpt.memory.compiled import CompiledBlockMemory, CompiledMemoryModel
from lightning_ckpt.memory.profile import Profile
from lightning_ckpt.plan.handle import applied_plan
from lightning_ckpt.plan.table import PlanTable, bucket_edges
from lightning_ckpt.search.buckets import compiled_at
from lightning_ckpt.search.config import TuneConfig
from lightning_ckpt.search.replan import replan


def test_bucket_edges_halve_from_the_longest_or_follow_the_users():
    assert bucket_edges(48, 256) == (64, 128, 256), "the shortest bucket covers the shortest length"
    assert bucket_edges(32, 256) == (32, 64, 128, 256)
    assert bucket_edges(256, 256) == (256,)
    assert bucket_edges(1, 1024) == (8, 16, 32, 64, 128, 256, 512, 1024), "at most eight"
    assert bucket_edges(8, 512, [128, 64, 128, 900]) == (64, 128, 512), "sorted, deduplicated, capped at the longest"
    with pytest.raises(ConfigurationError, match="at most 8 buckets"):
        bucket_edges(8, 10_000, list(range(10, 100, 10)))


def test_buckets_are_checked_at_construction():
    with pytest.raises(ConfigurationError, match="needs max_shape"):
        ActivationCheckpointTuner(max_memory=10**9, guard={"buckets": [64, 128]})
    with pytest.raises(ConfigurationError, match="buckets must be True"):
        ActivationCheckpointTuner(max_memory=10**9, max_shape=256, guard={"buckets": [64, "128"]})
    ActivationCheckpointTuner(max_memory=10**9, max_shape=256, guard={"buckets": [64, 128]})


class _Recording(Net):
    """Records, for every real step, its batch length and the plan applied while it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[tuple[int, str]] = []

    def training_step(self, batch, batch_idx):
        plan = applied_plan(self)
        self.ran.append((batch[0].shape[1], plan.key() if plan is not None else Plan().key()))
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def budget(tmp_path_factory) -> int:
    """A budget that `none` meets on short batches and only checkpointing meets on long ones (test_guard's)."""
    tmp_path = tmp_path_factory.mktemp("budget")
    none_short = real_peak(tmp_path, lambda n: Plan(), "32-true", steps=2, data=_Batches([SHORT] * 2))
    full_long = real_peak(tmp_path, full, "32-true", steps=2, data=_Batches([LONG] * 2))
    none_long = real_peak(tmp_path, lambda n: Plan(), "32-true", steps=2, data=_Batches([LONG] * 2))
    budget = max(none_short, full_long) * 21 // 20
    assert none_long > budget, "the long batch needs checkpointing at this budget"
    return budget


CURRICULUM = [SHORT, LONG, SHORT, LONG, SHORT, (32, 16)]


def _tuner(budget: int, **kwargs) -> ActivationCheckpointTuner:
    settings = dict(
        max_memory=budget,
        max_shape=LONG,
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
        guard=dict(on_budget_exceeded="raise", steps=2, every=1),  # every step read; any over the budget fails
    )
    return ActivationCheckpointTuner(**{**settings, **kwargs})


def test_each_batch_runs_its_buckets_plan_within_the_budget_and_trains_as_without_one(tmp_path, capsys, budget):
    torch.manual_seed(0)
    net = _Recording()
    cb = _tuner(budget, plan_path=tmp_path / "plan.json")
    fit(tmp_path, [cb], net, steps=len(CURRICULUM), data=_Batches(CURRICULUM))
    table = cb.plan_table
    assert table is not None and table.longest == LONG[1] and len(table.buckets) >= 2
    short = table.buckets[table.bucket_for(SHORT[1])].plan
    assert short.is_empty, "no checkpointing fits a short batch at this budget: its bucket runs none"
    assert not cb.plan.is_empty and table.buckets[-1].plan.key() == cb.plan.key(), "the top bucket: the search's"
    # Every step ran its own bucket's plan, switched before its forward, and every step was read within the budget.
    assert [key for _, key in net.ran] == [table.buckets[table.bucket_for(length)].plan.key() for length, _ in net.ran]
    assert len(net.peaks) == len(CURRICULUM) and max(net.peaks) <= budget, [p / budget for p in net.peaks]
    assert all(c.within_budget for c in cb.step_checks)

    # Exact: the same steps without the tuner give bit-equal weights.
    torch.manual_seed(0)
    plain = Net()
    fit(tmp_path, [], plain, steps=len(CURRICULUM), data=_Batches(CURRICULUM))
    for (name, a), b in zip(net.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), name

    # The plan file keeps the table, and a later run reuses it with zero trials and switches the same way.
    saved = Plan.load(tmp_path / "plan.json")
    assert PlanTable.of_plan(saved) == PlanTable.of_plan(cb.plan)
    again = _Recording()
    cb2 = _tuner(budget, plan_path=tmp_path / "plan.json")
    fit(tmp_path, [cb2], again, steps=len(CURRICULUM), data=_Batches(CURRICULUM))
    assert cb2.trials_run == 0 and cb2.plan_table is not None
    assert [b.plan.key() for b in cb2.plan_table.buckets] == [b.plan.key() for b in table.buckets]
    assert again.ran == net.ran
    assert max(again.peaks) <= budget

    # show prints the table; replan re-plans every bucket from the profile it keeps, for a tighter budget.
    capsys.readouterr()
    assert main(["show", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert f"plan table   {len(table.buckets)} buckets by batch length" in out
    assert f"<= {SHORT[1]}" in out and "predicted" in out and "search" in out
    summary = plan_summary(saved)
    assert [row["max_length"] for row in summary["plan_table"]] == [b.max_length for b in table.buckets]
    tight = replan(saved, activation_budget=0.4)
    replanned = PlanTable.of_plan(tight.plan)
    assert replanned is not None and [b.max_length for b in replanned.buckets] == [b.max_length for b in table.buckets]
    assert replanned.buckets[-1].plan.key() == tight.plan.key()
    assert not replanned.buckets[-1].plan.is_empty, "40% of the longest batch's activations: it needs checkpointing"
    for b in replanned.buckets:
        assert tight.budget.value_of(b.predicted_peak_bytes, b.predicted_activation_bytes) <= tight.budget.limit_bytes


def test_without_buckets_every_batch_runs_the_plan_tuned_for_the_longest(tmp_path, budget):
    net = _Recording()
    cb = _tuner(budget, guard=dict(on_budget_exceeded="raise", steps=2, every=1, buckets=False))
    fit(tmp_path, [cb], net, steps=3, data=_Batches(CURRICULUM[:3]))
    assert cb.plan_table is None and "plan_table" not in cb.plan.metadata
    assert {key for _, key in net.ran} == {cb.plan.key()}


def test_a_packed_batch_gets_no_table_without_resize_and_says_why(tmp_path, caplog):
    # Every batch is 4 x 32 tokens; the sequences it packs are 8 tokens long, then 32: only the user's key tells
    # them apart, and without the user's resize such a batch cannot be cut to a bucket's length to profile it there.
    data = _Batches([(4, 32)] * 3, extra=[[8, 8, 8, 8], [32, 32, 32, 32], [8, 8, 8, 8]])
    cb = ActivationCheckpointTuner(
        max_memory=10**10,
        max_shape=32,
        verbose=False,
        search=dict(n_trials=2, measure_steps=1, search_space=SPACE),
        guard=dict(shape_key=lambda b: int(b[2].max())),
    )
    with caplog.at_level("INFO"):
        fit(tmp_path, [cb], _PackedNet(), steps=3, data=data)
    assert cb.plan_table is None and "plan_table" not in cb.plan.metadata
    assert "no plan table with batches sized by guard's shape_key and no guard resize" in caplog.text


PACK, SEQ = 256, 32  # a pack's buffer (tokens) and the length of the sequences packed in it (the GPT's block size)


def _pack(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed batch: ``tokens`` real tokens of ``SEQ``-long sequences in a ``PACK``-token buffer (padding after
    them), with their boundaries (``cu_seqlens``). The tensors' shape is the same for every pack."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 64, (2, 1, PACK), generator=g)
    return x, y, torch.tensor([*range(0, tokens, SEQ), tokens])


def _resize_pack(batch, length: int):
    """The user's resize: the pack holding ``length`` tokens, its real tokens repeated past the first ones."""
    x, y, cu = batch
    repeat = torch.arange(x.shape[1]) % int(cu[-1])
    return x[:, repeat], y[:, repeat], torch.tensor([*range(0, length, SEQ), length])


def _pack_key(batch) -> tuple[int, int]:
    return 1, int(batch[2][-1])


class _PackedSequences(Net):
    """Runs each sequence of a packed batch through the GPT by itself (as varlen attention does): a step's memory
    follows the real tokens, which only ``cu_seqlens`` says. Records each step's real tokens and plan."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[tuple[int, str]] = []

    def training_step(self, batch, batch_idx):
        x, y, cu = batch
        plan = applied_plan(self)
        self.ran.append((int(cu[-1]), plan.key() if plan is not None else Plan().key()))
        spans = list(itertools.pairwise(cu.tolist()))
        xs = torch.stack([x[0, a:b] for a, b in spans])  # the sequences, one per row
        ys = torch.stack([y[0, a:b] for a, b in spans])
        return self.model(xs, ys)


class _Packs:
    def __init__(self, tokens: list[int]) -> None:
        self.batches = [_pack(n, seed) for seed, n in enumerate(tokens)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _packed_peak(tmp_path, plan_of, tokens: int) -> int:
    net = _PackedSequences()
    handle = apply_plan(net, plan_of(net))
    fit(tmp_path, [], net, steps=2, data=_Packs([tokens] * 2))
    handle.remove()
    return max(net.peaks)


def test_packed_batches_are_bucketed_by_the_users_key_and_cut_by_the_users_resize(tmp_path):
    short, long = 2 * SEQ, PACK
    none_short = _packed_peak(tmp_path, lambda n: Plan(), short)
    full_long, none_long = _packed_peak(tmp_path, full, long), _packed_peak(tmp_path, lambda n: Plan(), long)
    budget = max(none_short, full_long) * 21 // 20
    assert none_long > budget, "the longest pack needs checkpointing at this budget"
    packs = [short, long, short, 4 * SEQ, long, short]
    torch.manual_seed(0)
    net = _PackedSequences()
    cb = ActivationCheckpointTuner(
        max_memory=budget,
        max_shape=PACK,  # tokens per pack, by the key
        verbose=False,
        search=dict(n_trials=6, measure_steps=1, search_space=SPACE),
        guard=dict(shape_key=_pack_key, resize=_resize_pack, on_budget_exceeded="raise", steps=2, every=1),
    )
    fit(tmp_path, [cb], net, steps=len(packs), data=_Packs(packs))
    table = cb.plan_table
    # The first pack holds 64 tokens: it was grown to the declared 256 by resize to search, and cut to each
    # bucket's length to profile it; the buckets are by real tokens, which the tensors' shapes never change.
    assert table is not None and [b.max_length for b in table.buckets] == [32, 64, 128, 256]
    assert table.buckets[table.bucket_for(short)].plan.is_empty, "a short pack fits the budget without checkpointing"
    assert not cb.plan.is_empty and table.buckets[-1].plan.key() == cb.plan.key()
    assert [key for _, key in net.ran] == [table.buckets[table.bucket_for(n)].plan.key() for n, _ in net.ran]
    assert [n for n, _ in net.ran] == packs
    assert len(net.peaks) == len(packs) and max(net.peaks) <= budget, [p / budget for p in net.peaks]
    assert [c.size for c in cb.step_checks][:2] == ["1 x 64", "1 x 256"]
    # Exact: the same packs without the tuner give bit-equal weights.
    torch.manual_seed(0)
    plain = _PackedSequences()
    fit(tmp_path, [], plain, steps=len(packs), data=_Packs(packs))
    for (name, a), b in zip(net.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_resize_that_misses_the_length_is_refused_by_the_key():
    with pytest.raises(ConfigurationError, match=r"guard resize\(batch, 128\) returned a batch of length 64"):
        batch_at_length(_pack(64, 0), 128, resize=lambda b, n: b, shape_key=_pack_key)
    with pytest.raises(ConfigurationError, match="guard resize must be a function"):
        ActivationCheckpointTuner(max_memory=10**9, guard=dict(shape_key=_pack_key, resize=128))


def test_a_malformed_table_is_refused_naming_the_field(tmp_path):
    top = Plan(name="top")
    good = {
        "key": "length",
        "rows": 4,
        "buckets": [
            {"max_length": 8, "plan": {"schema_version": 1, "blocks": {}}, "source": "predicted"},
            {"max_length": 32, "plan": top.to_dict(), "source": "search"},
        ],
    }
    plan = top.with_provenance(plan_table=good)
    assert [b.max_length for b in PlanTable.of_plan(plan).buckets] == [8, 32]
    bad_length = json.loads(json.dumps(good))
    bad_length["buckets"][0]["max_length"] = "8"
    with pytest.raises(PlanError, match=r"plan_table.*max_length must be an integer"):
        PlanTable.of_plan(top.with_provenance(plan_table=bad_length))
    unordered = json.loads(json.dumps(good))
    unordered["buckets"].reverse()
    with pytest.raises(PlanError, match="ascending"):
        PlanTable.of_plan(top.with_provenance(plan_table=unordered))
    with pytest.raises(PlanError, match="top bucket runs"):
        PlanTable.of_plan(Plan(name="other", segments={"h": 2}).with_provenance(plan_table=good))


def test_each_buckets_prediction_matches_the_true_step_at_its_length():
    # The core, without Lightning: a search at 64 tokens, then the table down to 8. Each bucket's plan is predicted
    # from a profile at its own length (no scaling rule), so its activation memory must match a real step there.
    from lightning_ckpt import tune
    from lightning_ckpt.measure.step import track_step_memory
    from lightning_ckpt.model import ModelView
    from lightning_ckpt.plan.apply import plan_applied
    from lightning_ckpt.search.buckets import bucket_profile, plan_table
    from lightning_ckpt.search.replan import SavedProfile
    from lightning_ckpt.testing import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=64, dropout=0.0))
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    result = tune(model, lambda: model(ids, ids), activation_budget=0.4, batch_size=4, seq_len=64, config=TuneConfig(n_trials=4, measure_steps=1, search_space=SPACE))  # fmt: skip
    view, space = ModelView.of(model), SavedProfile.of_plan(result.best).space

    def profile_at(length: int):
        x = ids[:, :length]
        return bucket_profile(view, lambda: model(x, x), space=space, extra=(x,))

    table = plan_table(result.best, profile_at, (8, 16, 32, 64), result.budget, rows=4)
    assert [b.source for b in table.buckets] == ["predicted"] * 3 + ["search"]
    for bucket in table.buckets[:-1]:
        x = ids[:, : bucket.max_length]
        with plan_applied(model, bucket.plan, check_fingerprint=False):
            reading = track_step_memory(lambda x=x: model(x, x).backward(), model=model, extra=(x,))
        model.zero_grad(set_to_none=True)
        assert bucket.predicted_activation_bytes == pytest.approx(reading.activation_bytes, rel=0.05), bucket
        assert reading.activation_bytes <= result.budget.limit_bytes, "the bucket's plan fits at its longest length"
    assert table.buckets[0].plan.is_empty, "at an eighth of the length nothing needs checkpointing"


def test_a_batch_longer_than_the_table_grows_a_bucket_before_its_forward_and_shorter_ones_keep_their_plans(
    tmp_path, caplog, budget
):
    # The table is built for 16 tokens at most (max_shape), then 32-token batches arrive: the guard predicts the top
    # plan over the budget before the long batch's forward and moves it to a lower-memory plan in a new bucket.
    # On the Linear clock (each Linear call 1 ms, nothing else) the search at 16 tokens chooses the same plan on any
    # machine: on a busy one its real timings could keep `full`, the lowest-memory plan, and leave no plan below it.
    shapes = [(32, 16), (32, 8), LONG, (32, 16), LONG, (32, 8)]
    net, clock = _Recording(), LinearClock()
    search = dict(n_trials=6, measure_steps=1, search_space=SPACE, clock=clock)
    cb = _tuner(budget, max_shape=(32, 16), search=search, guard=dict(on_budget_exceeded="switch", steps=2, every=1))
    with caplog.at_level("INFO"), clock.installed():
        fit(tmp_path, [cb], net, steps=len(shapes), data=_Batches(shapes))
    table = cb.plan_table
    assert table is not None and table.longest == LONG[1], table.describe()
    top, below = table.buckets[-1], table.buckets[-2]
    assert below.max_length == 16 and top.source == "guard" and top.plan.key() == cb.plan.key()
    assert "the table grows a bucket <= 32" in caplog.text
    ran = {length: key for length, key in net.ran[3:]}  # after the growth
    assert ran[LONG[1]] == top.plan.key() and ran[16] == below.plan.key() != top.plan.key()
    long_steps = [c for c in cb.step_checks if c.batch_dims[1] == LONG[1]]
    assert long_steps and all(c.within_budget for c in long_steps), "the long batches ran within the budget"
    assert PlanTable.of_plan(cb.plan) == table  # the plan file keeps the grown table


class _CountingCompiles(L.Callback):
    """After every step: dynamo's compiled-frame and graph counters, and the plan the step ran."""

    def __init__(self) -> None:
        self.frames: list[int] = []
        self.graphs: list[int] = []
        self.ran: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from torch._dynamo.utils import counters

        self.frames.append(counters["frames"]["ok"])
        self.graphs.append(counters["stats"]["unique_graphs"])
        plan = applied_plan(pl_module)
        self.ran.append(plan.key() if plan is not None else Plan().key())


@pytest.mark.slow
def test_a_compiled_model_switches_buckets_without_compiling_again_after_each_buckets_first_step(tmp_path):
    # Buckets <= 8 and <= 32 tokens; lengths vary inside each. Each bucket's plan compiles at its first batch, with
    # the length marked dynamic, so later lengths of the bucket and every switch back run the graphs compiled then.
    lengths = [8, 32, 6, 24, 4, 16, 8, 32]
    module = LitGPT(n_layer=2, n_embd=64, vocab_size=64, block_size=32, dropout=0.0, optimizer=torch.optim.SGD)
    # Switching, not PT2's choice. The baselines stay: the short bucket's prediction weighs its plans against the
    # none baseline, so a tiny recompute hidden in a step a busy machine slowed is no reason to checkpoint there.
    space = {**SPACE, "modes": ["full"], "compile_budgets": []}
    cb = ActivationCheckpointTuner(
        activation_budget=0.5,
        max_shape=(8, 32),
        verbose=False,
        search=dict(n_trials=3, measure_steps=1, search_space=space),
        # every step read; any over the budget fails
        guard=dict(on_budget_exceeded="raise", steps=2, every=1, buckets=[8, 32]),
    )
    spy = _CountingCompiles()
    trainer = quiet_trainer(tmp_path, [cb, spy], steps=len(lengths))
    trainer.fit(torch.compile(module), _Batches([(8, n) for n in lengths]))

    table = cb.plan_table
    assert table is not None and [b.max_length for b in table.buckets] == [8, 32], "a compiled model gets a table"
    short, top = table.buckets[0].plan, table.buckets[1].plan
    assert short.key() != top.key(), table.describe()
    assert spy.ran == [(short if n <= 8 else top).key() for n in lengths], "each step ran its bucket's plan"
    first_of_bucket = {lengths.index(8), lengths.index(32)}  # steps 0 (the search's) and 1
    for i in range(1, len(lengths)):
        if i not in first_of_bucket:
            assert spy.frames[i] == spy.frames[i - 1] and spy.graphs[i] == spy.graphs[i - 1], (
                f"step {i} (length {lengths[i]}) compiled: frames {spy.frames}, graphs {spy.graphs}"
            )
    assert len(cb.step_checks) == len(lengths) and all(c.within_budget for c in cb.step_checks)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # The short bucket's compiled memory was predicted from its blocks compiled alone at 8 tokens: the real step says.
    predicted = table.buckets[0].predicted_activation_bytes
    read = [c.activation_bytes for c, n in zip(cb.step_checks, lengths, strict=True) if n == 8]
    assert predicted == pytest.approx(max(read), rel=0.05), (predicted, read)


def test_a_compiled_buckets_memory_is_its_blocks_compiled_alone_and_the_rest_scaled_by_length():
    # At the longest length the compiled none step saved 1000 bytes, 800 of them in the two blocks' graphs: 200
    # outside (embeddings, head, loss), linear in the length. At a quarter of it the blocks, compiled alone there,
    # save 100 each under none and 10 under full.
    longest = [{"fqn": f"h.{i}", "saved_bytes": {"none": 400, "full": 40}} for i in range(2)]
    kept = {"blocks": longest, "none_activation_bytes": 1000, "none_peak_bytes": 5000}
    top = Plan(metadata={"compiled_blocks": kept})
    here = CompiledMemoryModel(
        blocks=tuple(CompiledBlockMemory(f"h.{i}", {"none": 100, "full": 10}) for i in range(2)), stacks={}
    )
    model = compiled_at(top, Profile(memory=None, compiled=here), 0.25)
    assert model.none_activation_bytes == 200 + 50 and model.none_peak_bytes == 5000 - 750
    assert model.predict_activation(Plan(blocks={"h.0": BlockPlan("full")})) == 250 - 90
    with pytest.raises(PlanError, match="measured no compiled none step"):
        compiled_at(Plan(metadata={"compiled_blocks": {"blocks": longest}}), Profile(memory=None, compiled=here), 0.5)
