"""uniform_plan (one shape for every unit) and auto mode's split reference built on it."""
import pytest

from osdp.auto import split_reference
from osdp.models import GPTConfig
from osdp.planner import calibration as cal
from osdp.planner.cluster import load_cluster
from osdp.planner.cost_model import PlannerSettings, evaluate
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.run import RunSettings
from osdp.planner.uniform_plan import uniform_plan

CONFIG = GPTConfig(vocab_size=256, seq_len=32, num_layers=2, hidden=64, heads=4)


def _setup(limit=64 * 2**20):
    desc = describe_gpt(CONFIG)
    device = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0).for_run(
        RunSettings(world_size=4, memory_limit_bytes=limit))
    return desc, device


def test_every_unit_takes_the_one_shape_where_its_op_allows_it():
    desc, device = _setup()
    # Linears: their backward reads the weights, so dp and zdp slices differ (a row-split
    # embedding frees its slices after forward in both modes: one option per slice count)
    splittable = {op.name for op in desc.ops if op.splittable and not op.tied_to and op.kind == "linear"}
    fsdp = uniform_plan(desc, device, PlannerSettings(), 4)
    assert all(u.modes == ("zdp",) for u in fsdp.units)
    kept = uniform_plan(desc, device, PlannerSettings(), 4, slices=1, zdp_slices=0)
    assert all(u.modes == ("dp",) for u in kept.units)
    mixed = uniform_plan(desc, device, PlannerSettings(max_slices=2), 4, slices=4, zdp_slices=2)
    for u in mixed.units:
        if u.name in splittable:
            assert u.slices == 4 and sorted(u.modes) == ["dp", "dp", "zdp", "zdp"]
        elif u.split_op is None:
            assert u.slices == 1 and u.modes == ("zdp",)
    assert not mixed.checkpoint_blocks and mixed.batch_size == 4
    # its predictions are the cost model's for this very assignment
    a = cal.assignment_of(desc, device, mixed)
    assert evaluate(a.template, a.batch, a.option_index, a.variant).peak_bytes == mixed.predicted.peak_bytes
    with pytest.raises(ValueError, match="zdp_slices"):
        uniform_plan(desc, device, PlannerSettings(), 4, slices=2, zdp_slices=3)


def test_a_checkpointed_uniform_plan_checkpoints_every_block_and_pays_its_recompute():
    desc, device = _setup()
    plain = uniform_plan(desc, device, PlannerSettings(), 4)
    ckpt = uniform_plan(desc, device, PlannerSettings(), 4, checkpointed=True)
    assert ckpt.checkpoint_blocks == tuple(b.name for b in desc.blocks) and not plain.checkpoint_blocks
    assert [u.modes for u in ckpt.units] == [u.modes for u in plain.units]
    # the block keeps only its input, and its backward gathers and computes forward again
    assert ckpt.predicted.peak_bytes < plain.predicted.peak_bytes
    assert ckpt.predicted.step_s > plain.predicted.step_s
    a = cal.assignment_of(desc, device, ckpt)
    assert evaluate(a.template, a.batch, a.option_index, a.variant).peak_bytes == ckpt.predicted.peak_bytes


def test_the_split_reference_only_where_the_planner_may_split_and_it_fits():
    desc, device = _setup()
    ref = split_reference(desc, device, PlannerSettings(max_slices=16), 4)
    assert ref is not None and {u.slices for u in ref.units} == {1, 4}
    assert all(set(u.modes) == {"zdp"} for u in ref.units)
    assert {u.slices for u in split_reference(desc, device, PlannerSettings(max_slices=2), 4).units} == {1, 2}
    assert split_reference(desc, device, PlannerSettings(max_slices=1), 4) is None
    assert split_reference(desc, device, PlannerSettings(policy="zdp"), 4) is None
    small_desc, small = _setup(limit=ref.predicted.peak_bytes // 2)  # the window shrinks with the budget
    assert split_reference(small_desc, small, PlannerSettings(), 4) is None
