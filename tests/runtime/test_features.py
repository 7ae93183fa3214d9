"""Mixed precision, gradient accumulation, auto mode and plan checks, edge models and
faults on spawned gloo ranks (one spawn for the features, one per fault scenario).

Tolerances: mixed precision is compared with FSDP2 ``MixedPrecisionPolicy`` (same
bf16 math: first-step gradients equal to 1e-6, losses to 1e-3) and with single-process
``torch.autocast(bfloat16)`` training, where OSDP's error may be at most twice FSDP2's
error against the same reference (plus bf16 resolution for the split op, which
accumulates in fp32 instead). Gradient accumulation is fp32: k micro-batches must match
one big batch to 1e-5 like the parity tests.
"""
from __future__ import annotations

import os
import re
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

from . import feature_cases as fc
from . import parity_cases as pc
from .dist_harness import free_port, spawn

_RESULTS: list = []


def results():
    if not _RESULTS:
        with tempfile.TemporaryDirectory() as cache_dir:
            _RESULTS.extend(spawn(fc.run_features, 2, cache_dir))
    return _RESULTS


# ---- mixed precision ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["random", "split"])
def test_mixed_precision_matches_fsdp2_and_autocast(name):
    rank0 = results()[0]
    losses, state, probe = rank0["mp"][name]
    fsdp_losses, fsdp_state, fsdp_grads = rank0["mp_fsdp2"]
    ref_losses, ref_grads, _ = rank0["mp_ref"]
    grads = probe["first_grads"]
    assert set(grads) == set(ref_grads)
    # FSDP2 runs the same bf16 math; the split op accumulates its slices in fp32
    if name == "random":
        for key in fsdp_grads:
            torch.testing.assert_close(grads[key], fsdp_grads[key], rtol=1e-6, atol=1e-6, msg=key)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fsdp_losses), rtol=1e-3, atol=0)
    else:
        assert fc.rel_err(grads, fsdp_grads) < 1e-2
    # against autocast: no worse than twice FSDP2's own bf16 error
    fsdp_err = fc.rel_err(fsdp_grads, ref_grads)
    assert 0 < fsdp_err < 2e-2
    assert fc.rel_err(grads, ref_grads) <= 2 * fsdp_err
    assert fc.max_rel(losses, ref_losses) <= 2 * fc.max_rel(fsdp_losses, ref_losses) + 1e-3
    # the collectives moved bf16 (half the bytes), master shards and grads stay fp32
    for unit, padded in probe["padded"].items():
        assert probe["gathered_bytes"][unit] == 2 * padded, unit
    assert probe["shard_dtypes"] == ["torch.float32"] and probe["grad_dtypes"] == ["torch.float32"]
    assert probe["loss_dtype"] == "torch.bfloat16"
    initial = pc.make_model("uneven").state_dict()
    assert max((state[k] - initial[k]).abs().max().item() for k in initial) > 1e-2  # it trained


# ---- gradient accumulation --------------------------------------------------------------
@pytest.mark.parametrize("sync", ["last", "every", "plan_last", "plan_every"])
def test_accumulation_matches_one_big_batch(sync):
    rank0 = results()[0]
    ref_losses, ref_state = rank0["acc_ref"]
    losses, state, probe = rank0["acc"][sync]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-5, msg=key)
    last = sync in ("last", "plan_last")
    # "last": no reduce-scatter before the last micro-batch, unsharded fp32 grads held;
    # "every": one reduce-scatter per micro-batch into the sharded .grad
    assert set(probe["reduce_scatters"].values()) == {1 if last else fc.MICRO}
    assert probe["has_grad_after_first_micro"] is (not last)
    assert (probe["grad_bytes_after_first_micro"] > 0) is last
    assert probe["grad_bytes_after_step"] == 0
    if sync.startswith("plan_"):
        assert probe["accumulation_steps"] == fc.MICRO and probe["gradient_sync"] == sync[5:]


# ---- edge models, model checks, auto mode --------------------------------------------------
def test_zero_and_one_element_parameters_train_like_a_single_process():
    wrapped, ref = results()[0]["edge"]["tiny"]
    assert list(wrapped) == list(ref)
    for key in ref:
        torch.testing.assert_close(wrapped[key], ref[key], rtol=1e-6, atol=1e-6, msg=key)
    assert wrapped["zero.p"].numel() == 0 and wrapped["scale"].item() != 1.5


def test_frozen_model_forward_and_input_grads():
    for r in results():
        (y, g), (y_ref, g_ref) = r["edge"]["frozen"]
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)
        assert r["edge"]["frozen_gathered_after"] == [] and r["edge"]["frozen_has_trainable"] is False


def test_ranks_with_different_models_raise():
    for r in results():
        assert r["edge"]["different_models"] and "different models" in r["edge"]["different_models"]


def test_auto_mode_plans_wraps_and_checks():
    a, b = (r["auto"] for r in results())
    assert a["plan_hash"] == b["plan_hash"] and a["batch_size"] == b["batch_size"] >= 1
    for unit, modes in a["plan_units"].items():  # the runtime runs the plan's modes
        if len(modes) == 1:
            assert a["unit_modes"][unit] == modes[0], unit
        else:
            assert [a["unit_modes"][f"{unit}[{i}]"] for i in range(len(modes))] == modes, unit
    assert a["loss"] > 0
    for r in (a, b):  # bit-identical to training with the same plan given by hand
        assert r["losses_auto"] == r["losses_by_hand"]
        assert all(torch.equal(x, y) for x, y in zip(r["params_auto"], r["params_by_hand"]))
    assert "exceeds the plan's batch_size" in a["too_big"]
    assert "made for another model" in a["other_model"] and "'wte'" in a["other_model"]


# ---- faults ---------------------------------------------------------------------------------
def _run_fault(world_size, mode, timeout_s, compile=None):
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=fc.fault_worker, args=(r, world_size, port, out_dir, mode, timeout_s, compile))
                 for r in range(world_size)]
        start = time.perf_counter()
        for p in procs:
            p.start()
        deadline = start + 60 + 4 * timeout_s
        for p in procs[:-1]:  # the healthy ranks must finish on their own
            p.join(max(1.0, deadline - time.perf_counter()))
        alive = [p for p in procs[:-1] if p.is_alive()]
        for p in procs:  # the hung rank is still asleep: end it
            if p.is_alive():
                p.kill()
            p.join()
        out = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return out, len(alive)


@pytest.mark.parametrize("world_size,mode", [(3, "exit"), pytest.param(2, "hang", marks=pytest.mark.slow)])
def test_dead_or_hung_rank_fails_the_others_within_timeout(world_size, mode):
    timeout_s = 3.0
    out, alive = _run_fault(world_size, mode, timeout_s)
    assert alive == 0
    if mode == "exit":
        assert out[-1] is not None and out[-1]["result"] == "exited"
    for rank in range(world_size - 1):
        res = out[rank]
        assert res is not None and res["ok"], res
        kind, message, elapsed, step = res["result"]
        assert kind == "CollectiveTimeoutError", message
        assert step == 1
        assert "failed or did not complete within timeout_s=3" in message
        assert re.search(r"(all-gather|reduce-scatter) of (unit '|\d+ units \(')", message), message
        assert elapsed < timeout_s + 10, elapsed


def test_compiled_step_of_a_hung_rank_fails_the_others_within_timeout():
    """The compiled path's collectives are bounded by timeout_s too, not by the process
    group's own timeout (gloo's 30 minutes): [Note: compiled collective timeouts]."""
    timeout_s = 3.0
    out, alive = _run_fault(2, "hang", timeout_s, compile={"backend": "aot_eager"})
    assert alive == 0
    kind, message, elapsed, step = out[0]["result"]
    assert kind == "CollectiveTimeoutError", message
    assert step == 1
    assert "rank 0: a collective of the compiled forward failed or did not complete within timeout_s=3" in message
    assert elapsed < timeout_s + 10, elapsed
