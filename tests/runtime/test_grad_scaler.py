"""fp16 loss scaling on 2 gloo ranks (eager and compiled) when an overflow lands in one rank's gradient
shards (grad_scaler_cases.py): ``osdp.GradScaler`` skips the step on every rank and
trains as FSDP2 with FSDP's ``ShardedGradScaler``; ``torch.amp.GradScaler`` (one rank
skips, the other steps) and any step taken on some ranks only are caught at the next
backward ([Note: optimizer steps in lockstep] in osdp/runtime/optimizer_steps.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import osdp

from . import grad_scaler_cases as gc
from .dist_harness import spawn

_RESULTS: list = []


def results() -> list[dict]:
    if not _RESULTS:
        _RESULTS.extend(spawn(gc.run, 2))
    return _RESULTS


def test_the_overflow_is_in_one_ranks_shards_only():
    """The premise: at the overflow step rank 0's embedding gradient shard holds an inf,
    rank 1's does not; at the other steps both are finite."""
    finite = [r["osdp"]["emb_grad_finite"] for r in results()]
    assert finite[0][gc.OVERFLOW_STEP] is False and finite[1][gc.OVERFLOW_STEP] is True
    assert all(f[s] for f in finite for s in range(gc.STEPS) if s != gc.OVERFLOW_STEP)


def test_osdp_grad_scaler_skips_on_every_rank_and_trains_as_fsdp2():
    ranks = [r["osdp"] for r in results()]
    fsdp2 = results()[0]["fsdp2"]
    for out in ranks:
        assert out["error"] is None
        # the overflow step changed nothing on either rank; every other step did
        assert out["changed"] == [s != gc.OVERFLOW_STEP for s in range(gc.STEPS)]
        # one scale on every rank, halved once, as FSDP2's ShardedGradScaler keeps it
        assert out["scales"] == fsdp2["scales"]
    assert fsdp2["scales"][gc.OVERFLOW_STEP] == gc.INIT_SCALE / 2
    # the same fp16 math (gathers cast to fp16, gradients reduced in fp16, fp32 master
    # weights): equal to fp32 rounding (bitwise in this run)
    for key, want in fsdp2["state"].items():
        torch.testing.assert_close(ranks[0]["state"][key], want, rtol=1e-6, atol=1e-9, msg=key)
    initial = gc.build().state_dict()
    assert max((ranks[0]["state"][k] - initial[k]).abs().max().item() for k in initial) > 1e-3  # it trained


def test_osdp_grad_scaler_on_the_compiled_path_trains_as_eager():
    for r in results():
        eager, compiled = r["osdp"], r["osdp_compiled"]
        assert compiled["error"] is None
        assert (compiled["scales"], compiled["changed"]) == (eager["scales"], eager["changed"])
        for key, want in eager["state"].items():
            assert torch.equal(compiled["state"][key], want), key


def test_torch_grad_scaler_is_caught_at_the_next_backward():
    """torch.amp.GradScaler skips the step on rank 0 (its shard overflowed) and steps on
    rank 1: both ranks raise at the next backward, naming the steps and the fix."""
    for rank, r in enumerate(results()):
        name, message, step = r["torch"]["error"]
        assert (name, step) == ("RanksOutOfStepError", gc.OVERFLOW_STEP + 1), r["torch"]["error"]
        assert "rank 0: 0, rank 1: 1" in message and "osdp.GradScaler(model)" in message
        assert "Restore the last checkpoint" in message


def test_a_step_taken_on_some_ranks_only_is_caught():
    """No scaler, fp32: rank 0 skips the first step on a condition of its own."""
    for r in results():
        name, message, step = r["uneven_step"]["error"]
        assert (name, step) == ("RanksOutOfStepError", 1)
        assert "rank 0: 0, rank 1: 1" in message


@pytest.mark.usefixtures("one_rank_group")
def test_grad_scaler_needs_a_wrapped_model():
    with pytest.raises(osdp.OSDPError, match=r"takes a model wrapped by osdp.OSDP, got Linear"):
        osdp.GradScaler(nn.Linear(2, 2))


@pytest.mark.usefixtures("one_rank_group")
def test_grad_scaler_on_one_rank_scales_as_torch_does():
    """One rank: the same scales and parameters as torch.amp.GradScaler on the same
    wrapped model, the overflow step skipped by both."""
    runs = {}
    for kind in ("osdp", "torch"):
        model = osdp.OSDP(gc.build(), default_mode="zdp", mixed_precision=osdp.MixedPrecision(torch.float16))
        opt = torch.optim.SGD(model.parameters(), lr=gc.LR)
        scaler = (osdp.GradScaler(model, init_scale=gc.INIT_SCALE) if kind == "osdp"
                  else torch.amp.GradScaler("cpu", init_scale=gc.INIT_SCALE))
        out = gc._train(model, opt, scaler, rank=0)
        runs[kind] = (out["scales"], out["changed"], model.full_state_dict(rank0_only=False))
    assert runs["osdp"][:2] == runs["torch"][:2]
    assert runs["osdp"][0][gc.OVERFLOW_STEP] == gc.INIT_SCALE / 2
    for key, want in runs["torch"][2].items():
        assert torch.equal(runs["osdp"][2][key], want), key


def test_optimizer_step_counting_survives_models_collected_during_a_step():
    """A counter collected while an optimizer steps (a garbage collection inside the step)
    must not change torch's global hooks as the step iterates them ("OrderedDict mutated
    during iteration", seen in the suite); the counters of live models keep counting."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from osdp.runtime.optimizer_steps import OptimizerSteps

    # first: the counters' hooks come after it in torch's dict of global hooks
    handle = register_optimizer_step_post_hook(lambda *_: gc.collect())
    gc.disable()  # collected inside the step, not before it
    param = nn.Parameter(torch.ones(2))
    live = OptimizerSteps([param])
    for _ in range(3):  # unreachable counters in reference cycles: only gc frees them
        dead = OptimizerSteps([param])
        dead.cycle = dead
        del dead
    try:
        optim = torch.optim.SGD([param], lr=0.1)
        param.grad = torch.ones(2)
        optim.step()
        optim.step()
    finally:
        gc.enable()
        handle.remove()
    assert live.take() == 2


def test_an_fp16_mean_whose_sum_overflows_stays_finite():
    """Each rank's gradient is 40000, the mean 40000, the sum past fp16's largest: summed
    then divided it was inf (so a loss scaler skipped a step FSDP2 takes); divided in part
    before the sum, as FSDP2 does, it is FSDP2's 40000, eager and compiled, sharded and
    replicated ([Note: fp16 gradient average] in osdp/runtime/mixed_precision.py)."""
    for r in spawn(gc.run_mean_overflow, 2):
        (want,) = r["fsdp2"]
        assert torch.equal(want, torch.full_like(want, gc.MEAN_OVERFLOW_INPUT))
        for name in ("zdp", "rep", "zdp_compiled", "rep_compiled"):
            (got,) = r[name]
            assert torch.equal(got, torch.full_like(got, gc.MEAN_OVERFLOW_INPUT)), (name, got)
