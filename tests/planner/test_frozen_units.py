"""Frozen units ([Note: frozen units] in osdp/planner/cost_model/unit_bytes.py): describe
marks them, the cost model prices no gradient, optimizer state or reduction for them and
no backward where none reaches, a plan carries them, and a frozen plan's prediction holds
its measured peak on a fake 8-rank group. References: hand arithmetic on the settings'
byte counts, the runtime's measured peak."""
import hashlib
import json
import math
import warnings
from dataclasses import replace

import pytest
import torch

import osdp
from osdp.errors import FrozenPlanWarning, OSDPError
from osdp.memtrack import LiveBytesTracker
from osdp.models import GPT, example_batch, get_preset
from osdp.planner import make_plan
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
from osdp.planner.cost_model import PlannerSettings, build_template, optimizer_step_bytes, static_bytes
from osdp.planner.description import ModelDesc, OpDesc, describe
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.plan import Plan
from osdp.planner.run import RunSettings
from osdp.planner.step_sim import simulate_step
from osdp.planner.uniform_plan import uniform_plan


MiB = 1 << 20
P = 256 * 256  # elements of each synthetic linear


def device(world):
    return DeviceInfo(name="test", world_size=world, memory_limit_bytes=1 << 30,
                      all_gather=CollectiveCost(alpha_s=1e-5, beta_s_per_byte=1e-9),
                      reduce_scatter=CollectiveCost(alpha_s=2e-5, beta_s_per_byte=2e-9), flops_per_s=1e12,
                      op_overhead_s=1e-5, slice_overhead_s=3e-6, memory_bandwidth_bytes_per_s=1e11, constant_bytes=0)


def option(t, op, g, k):
    """The template's option of op ``op`` with ``g`` slices, ``k`` of them zdp (no checkpoint)."""
    return next(o for o in range(t.opt_begin[op, 0], t.opt_end[op, 0]) if t.opt_slices[o] == g and t.opt_zdp[o] == k)


def _linears(*flags):
    """Three 256x256 linears; ``flags``: per op (trainable, in_backward)."""
    return ModelDesc("lin", tuple(
        OpDesc(f"l{i}", "linear", P, P * 4, 4096.0, 1e6, True, 256, param_tensors=1, trainable=t, in_backward=b)
        for i, (t, b) in enumerate(flags)))


def _frozen(model, trained):
    """Freeze every parameter of ``model`` whose name does not start with one of ``trained``."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trained))
    return model


# ---- describe --------------------------------------------------------------------------

def test_describe_marks_frozen_units_and_the_prefix_no_backward_reaches():
    config = get_preset("tiny-ic")
    torch.manual_seed(0)
    model = _frozen(GPT(config), ("blocks.1.",))
    desc = describe(model, example_batch(config, 2))
    by_name = {op.name: op for op in desc.ops}
    first_trained = next(i for i, op in enumerate(desc.ops) if op.trainable)
    assert desc.ops[first_trained].name == "blocks.1.ln_1"
    assert all(op.trainable == op.name.startswith("blocks.1.") for op in desc.ops)
    # nothing before the first trained unit is in backward; everything after it is
    assert [op.in_backward for op in desc.ops] == [i >= first_trained for i in range(len(desc.ops))]
    # the prefix saves nothing for a backward that never comes
    assert by_name["blocks.0.mlp.c_fc"].act_bytes_per_sample == 0
    assert by_name["blocks.2.mlp.c_fc"].act_bytes_per_sample > 0


def test_a_tied_use_trains_as_its_owner_and_a_meta_model_is_described_alike():
    config = replace(get_preset("small"), tie_embeddings=True)
    torch.manual_seed(0)
    real = describe(_frozen(GPT(config), ("blocks.",)), example_batch(config, 2))
    head = next(op for op in real.ops if op.tied_to)
    assert head.tied_to == "wte" and not head.trainable and head.in_backward
    with torch.device("meta"):
        meta_model = _frozen(GPT(config), ("blocks.",))
    meta = describe(meta_model, example_batch(config, 2))
    assert [(op.name, op.trainable, op.in_backward) for op in meta.ops] == \
        [(op.name, op.trainable, op.in_backward) for op in real.ops]


def test_a_trained_unit_is_always_in_backward():
    with pytest.raises(OSDPError, match="trains but is not in backward"):
        OpDesc("l", "linear", 4, 16, 0.0, 0.0, False, trainable=True, in_backward=False)


def test_the_fingerprint_names_frozen_units_and_is_unchanged_when_all_train():
    trained = _linears((True, True), (True, True), (True, True))
    old_parts = [(op.name, op.kind, op.param_count, op.tied_to) for op in trained.ops]
    assert trained.fingerprint() == hashlib.sha256(json.dumps(old_parts).encode()).hexdigest()[:16]
    frozen = _linears((False, False), (True, True), (True, True))
    assert frozen.fingerprint() != trained.fingerprint()
    back = ModelDesc.from_dict(json.loads(json.dumps(frozen.to_dict())))
    assert back == frozen and back.fingerprint() == frozen.fingerprint()


# ---- the cost model ----------------------------------------------------------------------

def test_a_frozen_unit_has_no_gradient_optimizer_state_or_reduction():
    dev = device(world=4)
    settings = PlannerSettings(grads_set_to_none=False, optimizer_temporaries="foreach")
    desc = _linears((True, True), (False, True), (True, True))
    shard = math.ceil(P / 4) * 4  # bytes of one op's shard (fp32)
    static = static_bytes(desc, dev, settings)
    assert static["sharded_params"] == 3 * shard  # every unit holds its shard
    assert static["sharded_grads"] == 2 * shard
    assert static["optimizer_state"] == 2 * (shard / 4 * settings.optimizer_state_bytes_per_param
                                             + settings.optimizer_state_bytes_per_tensor)
    # foreach AdamW makes one copy of every tensor it steps: not the frozen one's
    assert optimizer_step_bytes(desc, dev, settings)["optimizer_temporaries"] == 2 * shard
    t = build_template(desc, dev, settings)
    for i, trains in enumerate((True, False, True)):
        reductions = t.opt_reduce_b_s[t.opt_begin[i, 0]:t.opt_end[i, 0]]
        assert (reductions > 0).all() if trains else (reductions == 0).all()
    # a frozen op's backward (no profile): the input's gradient, half a trained one's
    assert t.bwd_per_sample_s[1] == pytest.approx(t.bwd_per_sample_s[0] / 2)


def test_a_frozen_prefix_neither_computes_nor_gathers_in_backward():
    dev = device(world=4)
    settings = PlannerSettings(prefetch_bytes=1e12)
    desc = _linears((False, False), (False, True), (True, True))
    t = build_template(desc, dev, settings)
    assert t.bwd_intercept_s[0] == t.bwd_per_sample_s[0] == 0.0
    prefix = range(t.opt_begin[0, 0], t.opt_end[0, 0])
    assert all(t.opt_gather_b_s[o] == 0 and t.opt_held_bytes[o] == 0 for o in prefix)
    # a frozen op that backward reaches gathers its zdp weights again (dX reads them)
    assert t.opt_gather_b_s[option(t, 1, 1, 1)] > 0
    # the step simulation: one gradient collective, the trained unit's; nothing gathered
    # in backward for the prefix (its one all-gather is the forward's)
    chosen = [option(t, i, 1, 1) for i in range(3)]
    sim = simulate_step(t, 4, chosen, [0] * len(t.segments), coalesce_bytes=0)
    assert sim.reductions == 1
    assert sim.all_gathers == 3 + 2  # forward: all three; backward: the two it reaches


# ---- plans -------------------------------------------------------------------------------

def _planned_frozen_gpt(world: int, limit_bytes: int, trained: tuple[str, ...]):
    config = get_preset("small")
    torch.manual_seed(0)
    desc = describe(_frozen(GPT(config), trained), example_batch(config, 2))
    cluster = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0)
    dev = cluster.for_run(RunSettings(world_size=world, memory_limit_bytes=limit_bytes))
    plan = make_plan(desc, dev, PlannerSettings(max_slices=4))
    torch.manual_seed(0)
    return config, desc, _frozen(GPT(config), trained), plan


def test_a_plan_stores_its_frozen_units_and_hands_them_to_the_runtime():
    dev = load_cluster(DEFAULT_CLUSTER).for_run(RunSettings(world_size=2, memory_limit_bytes=1 << 30))
    desc = _linears((False, False), (True, True), (True, True))
    plan = uniform_plan(desc, dev, PlannerSettings(), 2)
    data = plan.to_dict()
    assert data["units"][0]["frozen"] is True and "frozen" not in data["units"][1]
    assert Plan.from_dict(data) == plan
    assert plan.runtime_config().frozen_units == ("l0",)
    data["units"][0]["frozen"] = "yes"
    with pytest.raises(OSDPError, match=r"units\[0\] \(l0\).frozen must be true or false"):
        Plan.from_dict(data)


# the frozen patterns users train with: a frozen backbone's prefix (the first blocks and
# the embeddings), and adapters-like (attention inputs and the head train, all else frozen)
@pytest.mark.parametrize("trained, limit_mib", [
    (("blocks.2.", "blocks.3.", "ln_f.", "lm_head."), 24),
    (("blocks.0.attn.c_attn.", "blocks.1.attn.c_attn.", "blocks.2.attn.c_attn.", "blocks.3.attn.c_attn.",
      "lm_head."), 20),
])
@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_a_frozen_plan_stays_within_its_prediction_on_a_fake_group(fake_world, trained, limit_mib):
    config, desc, model, plan = _planned_frozen_gpt(fake_world, limit_mib * MiB, trained)
    assert any(u.frozen for u in plan.units) and not all(u.frozen for u in plan.units)
    # the same model all trained, at this batch: over the limit, or priced higher
    trained_desc = replace(desc, ops=tuple(replace(op, trainable=True, in_backward=True) for op in desc.ops))
    dev = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0).for_run(
        RunSettings(world_size=fake_world, memory_limit_bytes=limit_mib * MiB))
    try:
        all_trained = make_plan(trained_desc, dev, PlannerSettings(max_slices=4), batch=plan.batch_size)
    except OSDPError:
        all_trained = None
    assert all_trained is None or all_trained.predicted.peak_bytes > plan.predicted.peak_bytes
    wrapped = osdp.OSDP(model, plan=plan, memory_limit=plan.memory_limit_bytes * 2)
    optim = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    for seed in range(2):  # the first step makes AdamW's state
        state = [t for s in optim.state.values() for t in s.values() if torch.is_tensor(t)]
        with LiveBytesTracker(list(wrapped.parameters()) + state) as reference:
            idx, targets = example_batch(config, plan.batch_size, seed=seed)
            wrapped(idx, targets).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
    step = wrapped.step_memory()
    assert step.step == 1 and step.complete
    assert abs(step.peak_bytes - reference.peak_bytes) <= 0.01 * reference.peak_bytes
    assert step.peak_bytes <= plan.memory_limit_bytes
    assert -0.05 <= step.prediction_error <= 0.0, (step.peak_bytes, plan.predicted.peak_bytes, step.where)
    print(f"\n{len(trained)} trained prefixes: batch {plan.batch_size}, measured {step.peak_bytes} B {step.where}, "
          f"predicted {plan.predicted.peak_bytes:.0f} B ({step.prediction_error:+.2%})")


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_unit_planned_frozen_that_trains_is_warned_about_once(fake_world):
    config, _, model, plan = _planned_frozen_gpt(fake_world, 64 * MiB, ("blocks.3.", "ln_f.", "lm_head."))
    wrapped = osdp.OSDP(model, plan=plan)
    idx, targets = example_batch(config, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FrozenPlanWarning)
        wrapped(idx, targets).backward()  # as planned: no warning
    model.get_submodule("blocks.0.mlp.c_fc").requires_grad_(True)
    with pytest.warns(FrozenPlanWarning, match=r"blocks\.0\.mlp\.c_fc train, but the plan .* priced them frozen"):
        wrapped(idx, targets).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FrozenPlanWarning)
        wrapped(idx, targets).backward()  # once per unit


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_frozen_split_matmul_saves_no_more_than_the_frozen_linear_it_replaces(fake_world):
    """describe measures a frozen Linear saving no input (no weight gradient reads it); the
    split op that replaces it saved its input anyway: 6 MiB over a LoRA-like stock Llama's
    prediction with its Linears in 4 slices (vocabulary 4096, batch 8). dX still flows."""
    def saved_storages(module, x):
        seen = set()

        def pack(t):
            seen.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
        return out, seen

    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).requires_grad_(False)
    model = osdp.OSDP(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)), splits={"0": 4}, default_mode="zdp")
    model.requires_grad_(False)
    x = torch.randn(16, 64, requires_grad=True)
    input_storage = x.untyped_storage().data_ptr()
    assert input_storage not in saved_storages(linear, x)[1]
    out, saved = saved_storages(model, x)
    assert input_storage not in saved
    out.sum().backward()
    weight = osdp.checkpoint.full_state_dict(model)["0.weight"]
    torch.testing.assert_close(x.grad, torch.ones(16, 32) @ weight)
