"""max_shape="probe": the longest batch, found before the first step from the datamodule or a probe of the loader,
without changing what training sees (issue 34, item 1)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lit import quiet_trainer
from test_guard import SPACE, Net, _Batches, fit, loader
from torch.utils.data import DataLoader, Dataset

from lightning_ckpt import ActivationCheckpointTuner
from lightning_ckpt.errors import ConfigurationError
from lightning_ckpt.lightning.shapes import PROBE_BATCHES, BatchSize, batch_size_of, probe_loader, probe_request

LENGTHS = [8, 16, 8, 32, 16, 8, 16, 8]  # the longest, 32, is one batch in eight


class _Premade(Dataset):
    """Whole batches of varying length, drawn in a shuffled order (a map-style dataset, batch_size=None)."""

    def __init__(self, lengths) -> None:
        self.batches = [next(iter(loader(4, seq=n, n=4))) for n in lengths]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def shuffled() -> DataLoader:
    return DataLoader(_Premade(LENGTHS), batch_size=None, shuffle=True)


def _tuner(**kwargs) -> ActivationCheckpointTuner:
    search = dict(n_trials=4, measure_steps=1, search_space=SPACE)
    return ActivationCheckpointTuner(activation_budget=0.5, verbose=False, search=search, **kwargs)


def test_the_request_is_parsed_at_construction():
    assert probe_request("probe") == PROBE_BATCHES and probe_request("probe:8") == 8
    assert probe_request(1024) is None and probe_request((8, 1024)) is None
    for bad in ("probes", "probe:0", "probe:x"):
        with pytest.raises(ConfigurationError, match="max_shape='probe'"):
            probe_request(bad)
    with pytest.raises(ConfigurationError, match="max_shape='probe'"):
        ActivationCheckpointTuner(activation_budget=0.5, max_shape="probe:many")
    # edges need a maximum
    ActivationCheckpointTuner(activation_budget=0.5, max_shape="probe", guard={"buckets": [8, 16]})


def test_a_probe_of_a_shuffled_loader_finds_the_longest_batch_and_leaves_training_as_it_was(tmp_path, caplog):
    torch.manual_seed(0)
    net = Net()
    cb = _tuner(max_shape="probe")
    with caplog.at_level("INFO"):
        fit(tmp_path, [cb], net, steps=10, data=shuffled())  # into a second epoch, shuffled again
    assert "max_shape 4 x 32, from a probe of 8 batches of the training loader (lengths 8-32)" in caplog.text
    assert cb.plan_table is not None and cb.plan_table.longest == 32  # the table reaches the longest batch
    # The probe drew from a fresh iterator and put the random states back: the same batches, the same weights.
    torch.manual_seed(0)
    plain = Net()
    fit(tmp_path, [], plain, steps=10, data=shuffled())
    for (name, a), b in zip(net.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b), name


class _DataModule(L.LightningDataModule):
    max_seq_length = 32

    def train_dataloader(self) -> DataLoader:
        return shuffled()


def test_a_datamodules_max_seq_length_is_used_without_probing(tmp_path, caplog):
    cb = _tuner(max_shape="probe")
    with caplog.at_level("INFO"):
        quiet_trainer(tmp_path, [cb], steps=1).fit(Net(), datamodule=_DataModule())
    assert "max_shape length 32, from _DataModule.max_seq_length (32)" in caplog.text
    assert cb.plan_table is not None and cb.plan_table.longest == 32


def test_a_one_shot_iterator_is_refused_not_consumed():
    batches = [next(iter(loader(4, seq=n, n=4))) for n in (8, 16)]
    it = iter(batches)
    with pytest.raises(ConfigurationError, match="one-shot iterator"):
        probe_loader(it, batch_size_of, 4)
    assert next(it) is batches[0], "nothing was drawn from it"
    with pytest.raises(ConfigurationError, match="one training loader"):
        probe_loader({"a": shuffled()}, batch_size_of, 4)
    assert probe_loader(_Batches([(4, 8), (4, 16)]), batch_size_of, 1).size == BatchSize(4, 8), "at most as asked"
