"""The plan file's provenance read by type: sections, the micro-batch, mistyped sections, names refused, disk."""

from __future__ import annotations

import pytest

from lightning_ckpt import BlockPlan, Plan
from lightning_ckpt.plan.provenance import MicroBatch, Provenance

_MICRO = {"size": 4, "accumulation": 8, "global": 32, "original_size": 32, "tie_tolerance": 0.01}


def test_sections_read_by_type_and_unknown_keys_are_kept_as_written():
    plan = Plan(
        {"h.0": BlockPlan("full")},
        metadata={
            "budget": {"kind": "peak", "limit_bytes": 1 << 20},
            "micro_batch": _MICRO,
            "real_steps": [{"peak_bytes": 10}],
            "switched_from": "none",
            "user_note": "tuned on Tuesday",
        },
    )
    p = plan.provenance
    assert p.budget["limit_bytes"] == 1 << 20
    assert p.micro_batch == MicroBatch(4, 8, 32, 32, 0.01)
    assert p.real_steps == ({"peak_bytes": 10},)
    assert p.switched_from == "none"
    assert p.other == {"user_note": "tuned on Tuesday"}
    assert not p.search and not p.profile and p.replanned == {}
    with pytest.raises(TypeError):
        p.budget["kind"] = "none"  # read-only: a reader cannot change what the plan records


def test_a_mistyped_section_reads_as_absent_and_stays_in_the_file():
    """A hand-edited file may hold anything: readers see no section, and the file keeps what it held."""
    plan = Plan(metadata={"search": 3, "profile": [1, 2], "micro_batch": {"size": "x"}, "real_steps": "many"})
    p = plan.provenance
    assert p.search == {} and p.profile == {} and p.micro_batch is None and p.real_steps == ()
    assert p.other == {"search": 3, "profile": [1, 2], "micro_batch": {"size": "x"}, "real_steps": "many"}
    assert plan.with_provenance(budget={"kind": "none"}).metadata["search"] == 3


def test_sections_are_written_in_the_files_json_form_and_none_drops_one(tmp_path):
    plan = Plan({"h.0": BlockPlan("full")}).with_provenance(
        micro_batch=MicroBatch(2, 4, 8, 8), real_steps=({"peak_bytes": 1},), measured={"samples_per_second": 5.0}
    )
    assert plan.metadata["micro_batch"] == {
        "size": 2,
        "accumulation": 4,
        "global": 8,
        "original_size": 8,
        "tie_tolerance": None,
    }
    assert plan.metadata["real_steps"] == [{"peak_bytes": 1}]
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.provenance == plan.provenance
    assert "measured" not in plan.with_provenance(measured=None).metadata


def test_a_name_that_is_no_section_is_refused_with_the_sections_named():
    with pytest.raises(TypeError, match="no section 'budgte'.*budget"):
        Plan().with_provenance(budgte={"kind": "none"})
    assert "budget" in {f for f in Provenance.__dataclass_fields__}


def test_a_plan_read_for_its_provenance_pickles_and_copies_as_it_was():
    """Ranks gather plans (``all_gather_object`` pickles them) and Lightning checkpoints carry them: a plan whose
    provenance was read once holds read-only mappings, which pickle refused (FSDP2's ranks then lost each other)."""
    import copy
    import pickle

    plan = Plan({"h.0": BlockPlan("full")}, metadata={"budget": {"kind": "none"}, "micro_batch": _MICRO, "note": 1})
    assert plan.provenance.budget
    for again in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert again == plan and again.metadata == plan.metadata and again.provenance == plan.provenance
    assert pickle.loads(pickle.dumps(plan.provenance)) == plan.provenance
