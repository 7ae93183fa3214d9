"""Profiler and auto_plan on real gloo process groups (2 ranks, one spawn)."""
import pytest
import torch

from runtime.dist_harness import spawn
from torch_transformer import TiedTransformer

from osdp.profiler.hardware import _fit_line


def test_line_fit_recovers_intercept_and_slope():
    xs = [1, 2, 4, 8]
    intercept, slope = _fit_line(xs, [0.5 + 0.25 * x for x in xs])
    assert intercept == pytest.approx(0.5) and slope == pytest.approx(0.25)
    # a decreasing measurement is noise: slope clamps to 0, never negative
    assert _fit_line([1, 2], [2.0, 1.0])[1] == 0.0


def _ranks(rank, world, cache_dir):
    import osdp
    from osdp.errors import InfeasiblePlanError
    from osdp.models import GPT, example_batch, get_preset
    from osdp.planner import profile_cache as pc
    from osdp.profiler import hardware as prof

    torch.manual_seed(0)
    config = get_preset("tiny")
    model = GPT(config)
    inputs = example_batch(config, 4)
    kwargs = dict(cache_dir=cache_dir, comm_sizes=(4096, 65536, 1 << 20), repeats=1, progress=False)
    out = {}
    # one speed of the machine throughout: a busy test machine would otherwise fail the
    # speed check ([Note: profile cache]), which is not this test's subject
    saved = prof.profile_compute, prof.profile_collectives, pc.machine_speed
    pc.machine_speed = lambda device: pc.Speed(1e11, False)
    try:
        plan = osdp.auto_plan(model, inputs, "64MiB", **kwargs)
        out["plan"] = plan.to_dict()
        out["hash"] = plan.plan_hash()

        # the second call finds everything in the cache: nothing is measured again
        def refuse(*a, **k):
            raise AssertionError("measured again despite the cache")

        prof.profile_compute = prof.profile_collectives = refuse
        _, cluster, run = prof.profile(model, inputs, memory_limit="64MiB", **kwargs)
        out["device"] = cluster.for_run(run).to_dict()
    finally:
        prof.profile_compute, prof.profile_collectives, pc.machine_speed = saved

    # nothing fits: every rank raises the same typed error instead of hanging
    try:
        osdp.auto_plan(model, inputs, "1KiB", **kwargs)
        out["infeasible"] = None
    except InfeasiblePlanError as exc:
        out["infeasible"] = (str(exc), exc.min_bytes)
    return out


@pytest.mark.slow
def test_auto_plan_is_identical_on_every_rank(tmp_path):
    a, b = spawn(_ranks, 2, str(tmp_path))
    assert a["hash"] == b["hash"] and a["plan"] == b["plan"]
    assert a["plan"]["world_size"] == 2 and a["plan"]["batch_size"] >= 1
    assert a["device"] == b["device"]
    # the fit's split between latency and bandwidth depends on timing noise; what must
    # hold is a non-negative fit that predicts real time for a real message
    for coll in ("all_gather", "reduce_scatter"):
        fit = a["device"][coll]
        assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
        assert fit["alpha_s"] + fit["beta_s_per_byte"] * (1 << 20) > 0
    assert a["device"]["op_compute"], "no compute fits were measured"
    assert a["infeasible"] is not None and a["infeasible"] == b["infeasible"]
    assert a["infeasible"][1] > 1024


def test_auto_resolves_the_optimizer_temporaries_from_the_model_device():
    """torch's AdamW runs its for-loop off CUDA: a CPU model (on a machine without CUDA)
    is planned with per-tensor temporaries; a setting given explicitly stays."""
    from osdp.auto import for_model_device
    from osdp.planner.cost_model import PlannerSettings

    model = torch.nn.Linear(4, 4)
    want = "foreach" if torch.cuda.is_available() else "per_tensor"
    assert for_model_device(None, model).optimizer_temporaries == want
    assert for_model_device(PlannerSettings(optimizer_temporaries="none"), model).optimizer_temporaries == "none"
    with pytest.raises(Exception, match="optimizer_temporaries must be one of"):
        PlannerSettings(optimizer_temporaries="fused")


@pytest.mark.usefixtures("one_rank_group")
def test_auto_mode_without_loss_fn_plans_for_the_loops_cross_entropy(tmp_path, caplog):
    """Issue 35.2: a model returning logits, auto mode without loss_fn, a loop computing
    ``F.cross_entropy`` over the logits it holds. Planned for the output's sum (a loss
    whose gradient is a broadcast scalar), the plan (no checkpointing, 11.83 MiB
    predicted) measured 12.00-12.03 MiB at step 1 against the 11.9 MiB limit and raised
    MemoryLimitExceeded. With the cross-entropy assumed ([Note: example inputs and the
    loss]) the plan prices it (here: by checkpointing a block) and every step fits;
    rank 0 says once what it assumed and the plan keeps it.

    The policy is "zdp" so that timings cannot pick the plan: with "osdp" a noisy
    profile (CI) picked every unit ``rep`` with the last block checkpointed, predicted
    11.87 MiB and measured 11.93 at that block's recompute, a miss of the memory model
    that is not this test's subject (in the closing note of issue 35)."""
    import logging

    import torch.nn.functional as F

    import osdp
    from osdp.planner.cost_model import PlannerSettings

    torch.manual_seed(0)
    batch, seq, vocab, limit = 16, 32, 101, int(11.9 * 2**20)
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="osdp.auto"):
        model = osdp.OSDP(TiedTransformer(vocab, seq), memory_limit=limit, example_inputs=(tokens,),
                          settings=PlannerSettings(checkpointing="auto", policy="zdp"),
                          # the batch fixed: the memory, not timings, decides between plans
                          auto_kwargs=dict(batch=batch, calibrate=False, batches=(batch,), repeats=1,
                                           progress=False, cache_dir=str(tmp_path)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):  # step 0 makes AdamW's state, step 1 is a steady one
        x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(step))
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, vocab), x.view(-1))
        loss.backward()
        optim.step()  # the step's peak is checked here: MemoryLimitExceeded when over
        optim.zero_grad()
        assert model.step_memory().step == step and model.step_memory().peak_bytes <= limit
    assert model.plan.predicted.peak_bytes <= limit
    assumed = [r.getMessage() for r in caplog.records if r.name == "osdp.auto" and "loss_fn=" in r.getMessage()]
    assert len(assumed) == 1 and "cross_entropy over the last dimension" in assumed[0], caplog.records
    assert model.plan.assumed_loss and model.plan.assumed_loss in assumed[0]


@pytest.mark.usefixtures("one_rank_group")
def test_auto_mode_leaves_the_models_buffers_and_random_streams_as_they_were(tmp_path):
    """Profiling runs forwards in train mode on the user's model: a BatchNorm's running
    statistics moved toward the example batch's, by as many forwards as each rank's
    timing took (stock ResNet on 2 ranks: num_batches_tracked 0 -> 12 and 0 -> 16, the
    running means apart), and dropout drew from the user's random stream."""
    import torch.nn as nn

    import osdp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 3))
    with torch.no_grad():
        model[1].running_mean.fill_(0.5)  # as pretrained statistics
    before = {name: b.clone() for name, b in model.named_buffers()}
    expected_draw = torch.rand(4, generator=torch.Generator().manual_seed(1))
    inputs = (torch.randn(8, 8),)
    torch.manual_seed(1)
    wrapped = osdp.OSDP(model, memory_limit="64MiB", example_inputs=inputs,
                        auto_kwargs=dict(calibrate=False, batches=(8,), repeats=1, progress=False,
                                         cache_dir=str(tmp_path)))
    draw = torch.rand(4)
    for name, value in wrapped.module.named_buffers():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    assert torch.equal(draw, expected_draw)


@pytest.mark.usefixtures("one_rank_group")
def test_auto_mode_refuses_samples_larger_than_the_examples(tmp_path):
    """Training on longer sequences than auto mode planned for ran, and the step's
    memory check blamed the plan ("the plan predicted ... +45.9%; lower the batch size")
    where the cause was the input (found by a helper on stock GPT-2: sequence 32 against
    the example's 8). Shorter samples, and other arguments, pass."""
    import osdp
    from osdp.errors import OSDPError

    torch.manual_seed(0)
    vocab, seq = 50, 16
    tokens = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(0))
    model = osdp.OSDP(TiedTransformer(vocab, seq), memory_limit="64MiB", example_inputs=(tokens,),
                      auto_kwargs=dict(calibrate=False, batches=(4,), repeats=1, progress=False,
                                       cache_dir=str(tmp_path)))
    name = next(iter(model.planned_sample_shapes))  # the forward's first parameter
    assert model.planned_sample_shapes == {name: (8,)}
    model(tokens[:, :5]).sum().backward()
    longer = torch.randint(0, vocab, (4, 16))
    # positional or by keyword, as the example was given or not (a helper found the
    # check keyed by position, so model(ids) against example_inputs={"input_ids": ...}
    # passed unchecked)
    for call in (lambda: model(longer), lambda: model(**{name: longer})):
        with pytest.raises(OSDPError, match=rf"'{name}': samples of shape \(16,\) are larger than the example's "
                                            r"\(8,\)"):
            call()
    model(tokens).sum().backward()  # the refused steps left nothing behind
