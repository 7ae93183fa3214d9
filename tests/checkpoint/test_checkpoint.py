"""osdp.checkpoint on 2 and 4 gloo ranks: full state dicts, sharded DCP checkpoints with
optimizer state, resume (exact at the same world size and plan; across world sizes and
plans exact parameters, then training within the parity tolerance), mismatch
rejection with nothing changed, atomic writes.

One spawn per world size runs every scenario (``ckpt_cases.py``); the world-size-4
spawn loads the checkpoint the world-size-2 spawn wrote.
"""
from __future__ import annotations

import pytest
import torch

from runtime.dist_harness import spawn

from . import ckpt_cases as cc

_RESULTS: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


def results(world_size, root):
    if world_size not in _RESULTS:
        if world_size == 4:
            results(2, root)  # writes the checkpoint the 4-rank run loads
        fn = cc.run_w2 if world_size == 2 else cc.run_w4
        _RESULTS[world_size] = spawn(fn, world_size, root)
    return _RESULTS[world_size]


def assert_equal_states(a, b, what):
    assert list(a) == list(b), f"{what}: keys differ"
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, f"{what}: {key}"
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs (max {(a[key] - b[key]).abs().max().item():.3g})"


def assert_close_states(a, b, what):
    assert list(a) == list(b), f"{what}: keys differ"
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {key}: {m}")


def assert_equal_units(a, b, what):
    assert len(a) == len(b)
    for i, ((shard_a, states_a), (shard_b, states_b)) in enumerate(zip(a, b)):
        assert torch.equal(shard_a, shard_b), f"{what}: unit {i} shard"
        assert len(states_a) == len(states_b), f"{what}: unit {i} parameter count"
        for j, (state_a, state_b) in enumerate(zip(states_a, states_b)):
            assert sorted(state_a) == sorted(state_b), f"{what}: unit {i} parameter {j} state keys"
            for key in state_a:
                assert torch.equal(state_a[key], state_b[key]), f"{what}: unit {i} parameter {j} {key}"


# ---- full state dicts ----------------------------------------------------------------
def test_full_state_dict_is_the_original_model_state(root):
    r0, r1 = results(2, root)
    assert_equal_states(r0["full_initial"], r0["original"], "full_state_dict vs the unwrapped model")
    assert_equal_states(r0["plain_after_load"], r0["original"], "plain model after load_state_dict(strict=True)")
    assert r1["full_initial"] == {}, "rank0_only: other ranks get nothing"
    for r in (r0, r1):
        assert_equal_states(r["full_all_ranks"], r0["original"], "rank0_only=False")
    # tied names share one tensor, like the original model's state dict
    assert r0["full_initial"]["lm_head.weight"] is r0["full_initial"]["wte.weight"]


def test_load_full_state_dict_round_trips(root):
    r0 = results(2, root)[0]
    assert not all(torch.equal(r0["full_target"][k], r0["original"][k]) for k in r0["original"])
    assert_equal_states(r0["full_after_broadcast_load"], r0["full_target"], "broadcast from rank 0")
    assert_equal_states(r0["full_after_local_load"], r0["original"], "every rank passes the state dict")
    assert_equal_states(r0["full_file"], r0["original"], "save_full file")
    assert_equal_states(r0["full_after_load_full"], r0["original"], "load_full")


def test_full_state_dicts_under_mixed_precision_are_the_master_weights(root):
    """bf16 compute: full state dicts, their loads and save_full are the fp32 weights
    (they were bf16, the weights rounded, and a load rounded what it loaded)."""
    r0 = results(2, root)[0]
    assert_equal_states(r0["mp_full_initial"], r0["original"], "full_state_dict under bf16 compute")
    assert_equal_states(r0["mp_full_after_load"], r0["full_target"], "load_full_state_dict under bf16 compute")
    assert_equal_states(r0["mp_full_file"], r0["full_target"], "save_full under bf16 compute")
    assert {v.dtype for v in r0["mp_full_file"].values()} == {torch.float32}


# ---- resume ---------------------------------------------------------------------------
def test_resume_same_world_size_and_plan_is_bit_identical(root):
    for r in results(2, root):
        assert r["load_info"]["step"] == cc.SAVE_AT
        assert r["load_info"]["extra"]["note"] == "resume here"
        assert torch.equal(r["load_info"]["extra"]["rng"], torch.arange(3))
        assert_equal_units(r["units_after_load"], r["units_step3"], "state right after load")
        assert_equal_units(r["units_resumed"], r["units_uninterrupted"], "state after resuming")
        assert r["losses_before_save"] + r["losses_resumed"] == r["losses_uninterrupted"]
    r0 = results(2, root)[0]
    assert_equal_states(r0["full_resumed"], r0["full_uninterrupted"], "final parameters")
    # the resumed model did start from other weights: the load mattered
    assert r0["losses_resumed"][0] != r0["losses_before_save"][0]


def test_checkpoint_holds_original_parameters_and_optimizer_state(root):
    r0 = results(2, root)[0]
    plain = r0["plain_dcp"]
    ref, steps = r0["optim_reference_step3"]
    assert steps == {float(cc.SAVE_AT)}
    for key, value in r0["full_step3"].items():
        if key != "lm_head.weight":  # tied: stored once, under wte.weight
            assert torch.equal(plain[f"model.{key}"], value), key
            assert float(plain[f"optim.{key}.step"]) == cc.SAVE_AT
    assert len(ref) == 2 * (len(r0["full_step3"]) - 1)
    for key, value in ref.items():
        assert torch.equal(plain[key], value), key
        assert value.abs().max() > 0, f"{key} is all zeros: the reference would not catch a bad mapping"


def test_resume_with_another_plan(root):
    r = results(2, root)
    r0 = r[0]
    assert_equal_states(r0["full_plan_b"], r0["full_step3"], "loaded into plan B")
    for rank in r:  # plan A -> checkpoint -> plan B -> checkpoint -> plan A: optimizer state exact
        assert_equal_units(rank["units_round_trip"], rank["units_step3"], "round trip through plan B")
    torch.testing.assert_close(
        torch.tensor(r0["losses_plan_b"]), torch.tensor(r0["losses_uninterrupted"][cc.SAVE_AT :]), rtol=1e-5, atol=0
    )
    assert_close_states(r0["full_plan_b_end"], r0["full_uninterrupted"], "plan B final parameters")


def test_resume_on_more_ranks(root):
    w2 = results(2, root)[0]
    w4 = results(4, root)
    r0 = w4[0]
    for r in w4:
        assert r["load_info"]["step"] == cc.SAVE_AT
    expected_losses = torch.tensor(w2["losses_uninterrupted"][cc.SAVE_AT :])
    assert_equal_states(r0["full_loaded_a"], w2["full_step3"], "2 -> 4 ranks, same plan")
    assert_equal_states(r0["full_loaded_b"], w2["full_step3"], "2 -> 4 ranks, plan B")
    torch.testing.assert_close(torch.tensor(r0["losses_a"]), expected_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(r0["losses_b"]), expected_losses, rtol=1e-5, atol=0)
    assert_close_states(r0["full_end_a"], w2["full_uninterrupted"], "2 -> 4 final parameters")


def test_resume_on_fewer_ranks(root):
    w2 = results(2, root)[0]
    w4 = results(4, root)
    r0 = w4[0]
    assert "pair_losses" not in w4[2]
    assert r0["pair_load_info"]["step"] == cc.SAVE_AT
    assert_equal_states(r0["pair_full_loaded"], r0["full_w4_step3"], "4 -> 2 ranks, plan B")
    torch.testing.assert_close(
        torch.tensor(r0["losses_w4_before_save"] + r0["pair_losses"]),
        torch.tensor(w2["losses_uninterrupted"]),
        rtol=1e-5,
        atol=0,
    )
    assert_close_states(r0["pair_full_end"], w2["full_uninterrupted"], "4 -> 2 final parameters")


# ---- mismatches ----------------------------------------------------------------------
def test_checkpoint_of_another_model_is_rejected(root):
    for r in results(2, root):
        err = r["err_other_model"]
        assert err is not None and "from another model" in err
        assert "wte.weight: checkpoint [97, 12] vs model [97, 10]" in err, err
        err = r["err_untied"]
        assert err is not None and "only in the model: ['lm_head.weight']" in err and "tied" in err, err
        assert r["err_optimizer_class"] is not None and "SGD" in r["err_optimizer_class"]
        assert r["err_no_optimizer_state"] is not None and "no optimizer state" in r["err_no_optimizer_state"]
        err = r["err_full_bad"]
        assert err is not None and "extra.weight" in err and "blocks.0.mlp.c_fc.weight" in err, err
        assert r["err_broken"] is not None
        assert r["load_without_optimizer"]["step"] is None


def test_failed_loads_change_nothing(root):
    for r in results(2, root):
        before, after = r["unchanged_units"]
        assert_equal_units(after, before, "model and optimizer after failed loads")
        assert any(state for _, state in before), "the optimizer had state to lose"
    before, after = results(2, root)[0]["unchanged_full"]
    assert_equal_states(after, before, "full state after failed loads")


# ---- atomic writes --------------------------------------------------------------------
@pytest.mark.parametrize("crash", ["after_crash_write", "after_crash_rename"])
def test_crashed_save_keeps_the_previous_checkpoint(root, crash):
    r = results(2, root)
    for rank in r:
        assert rank[f"err_{crash[6:]}"] is not None, "the simulated crash must surface on every rank"
        after = rank[crash]
        assert after["files"], "the previous checkpoint's files changed"
        assert after["partial_left"] == [], f"partial directories left: {after['partial_left']}"
        assert after["step"] == 1
    assert_equal_states(r[0][crash]["full"], r[0]["v1"], "previous checkpoint after a crashed save")
    assert not all(torch.equal(r[0]["v1"][k], r[0]["v2"][k]) for k in r[0]["v1"])


def test_save_replaces_an_existing_checkpoint(root):
    r0 = results(2, root)[0]
    step, full = r0["after_replace"]
    assert step == 2
    assert_equal_states(full, r0["v2"], "replaced by exchange")
    step, full = r0["after_fallback_replace"]
    assert step == 3
    assert_equal_states(full, r0["v3"], "replaced by the two-rename fallback")
    assert not [f for f in r0["listing_after_replace"] if "osdp-" in f]


def test_crashed_full_save_keeps_the_previous_file(root):
    r0 = results(2, root)[0]
    assert r0["err_crash_full"] is not None and results(2, root)[1]["err_crash_full"] is not None
    assert_equal_states(r0["full_file_after_crash"], r0["full_file_v3"], "full checkpoint file after a crash")
    assert_equal_states(r0["full_file_v3"], r0["v3"], "full checkpoint file")
    assert not [f for f in r0["listing_after_full_crash"] if "osdp-" in f]


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(root):
    for r in results(2, root):
        assert r["err_precious"] is not None and "refusing" in r["err_precious"]
        assert r["precious_files"] == ["notes.txt"]
