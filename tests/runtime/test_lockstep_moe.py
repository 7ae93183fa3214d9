"""A user-written mixture of experts (one module per expert) under OSDP on 2 gloo ranks
that route their tokens differently, against single-process training; see
lockstep_moe_cases.py."""
from __future__ import annotations

import pytest
import torch

from . import lockstep_moe_cases as mc
from .dist_harness import spawn

WORLD = 2
_RESULTS: list = []


@pytest.fixture(scope="module")
def results():
    if not _RESULTS:
        _RESULTS.append(spawn(mc.run, WORLD))
    return _RESULTS[0]


def test_ranks_route_to_different_experts():
    """The premise: some expert gets tokens on one rank and none on the other."""
    model = mc.build()
    x = mc.batch(0, WORLD)["x"]
    per_rank = [mc.experts_used(model, x[r * mc.LOCAL_BATCH:(r + 1) * mc.LOCAL_BATCH]) for r in range(WORLD)]
    assert any(a != b for a, b in zip(*per_rank)), per_rank


@pytest.mark.parametrize("name", list(mc.MODES))
def test_moe_trains_as_single_process(results, name):
    reference = mc.build()
    ref_losses = mc.train(reference, WORLD, None)
    for r in results:
        assert r[name]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(r[name]["state"][key], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", list(mc.LEAF_MODES))
def test_skipping_moe_as_one_unit_trains_as_single_process(results, name):
    """Each rank calls only its routed experts; the block is one unit, so every rank
    gathers the same units and reduces every expert's gradient, zero where no token of
    any rank went (some step has such an expert): as the plain model that calls every
    expert gives it, and as ZeRO-3 does. One process running the skipping model leaves
    that expert's .grad None instead, and AdamW then skips it ([Note: leaf modules])."""
    assert mc.unrouted_somewhere(WORLD), "the premise: some expert gets no token of any rank in some step"
    reference = mc.build(mc.MoE)
    ref_losses = mc.train(reference, WORLD, None)
    for r in results:
        assert r[name]["units"] == ["inp", "moe.0", "moe.1", "head"]
        assert r[name]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(r[name]["state"][key], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{key}: {m}")



def test_skipping_moe_in_auto_mode_plans_and_trains_leaves(tmp_path):
    """Auto mode's trial steps route differently per rank too: the leaves must reach the
    description, the plan and every trial."""
    results = spawn(mc.run_auto, WORLD, str(tmp_path))
    reference = mc.build(mc.MoE)
    ref_losses = mc.train(reference, WORLD, None)
    for r in results:
        assert r["units"] == ["inp", "moe.0", "moe.1", "head"]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    assert results[0]["modes"] == results[1]["modes"]


@pytest.mark.slow
def test_skipping_moe_as_leaves_on_hsdp_and_hpz_layouts():
    """4 ranks (about 10 s): the leaf units' shard and replica collectives, and their
    node copies, with ranks that call different experts."""
    results = spawn(mc.run_layouts, 4)
    reference = mc.build(mc.MoE)
    ref_losses = mc.train(reference, 4, None)
    for r in results:
        for name, got in r.items():
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), name
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{name} {key}: {m}")
