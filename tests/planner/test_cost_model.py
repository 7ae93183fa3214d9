"""The cost model against hand-computed fp64 formulas, and its memory bookkeeping."""
import importlib.util
import math

import numpy as np
import pytest

from osdp.errors import OSDPError
from osdp.planner.cost_model import LOSS_SCALARS_BYTES, PlannerSettings, build_template, evaluate
from osdp.planner.description import BlockDesc, ModelDesc, OpDesc
from osdp.planner.device import CollectiveCost, DeviceInfo, parse_bytes

MiB = 2**20


def device(world=4, limit=1 << 30, **kw):
    args = dict(
        name="test",
        world_size=world,
        memory_limit_bytes=limit,
        all_gather=CollectiveCost(alpha_s=1e-5, beta_s_per_byte=1e-9),
        reduce_scatter=CollectiveCost(alpha_s=2e-5, beta_s_per_byte=2e-9),
        flops_per_s=1e12,
        op_overhead_s=1e-5,
        slice_overhead_s=3e-6,
        memory_bandwidth_bytes_per_s=1e11,
        constant_bytes=0,
    )
    args.update(kw)
    return DeviceInfo(**args)


def linear_model(n_ops=1, in_f=256, out_f=256, act=4096.0, flops=1e6):
    ops = tuple(
        OpDesc(f"l{i}", "linear", in_f * out_f, in_f * out_f * 4, act, flops, True, in_f)
        for i in range(n_ops)
    )
    return ModelDesc("lin", ops)


def option(t, op, g, k, variant=0):
    for o in range(t.opt_begin[op, variant], t.opt_end[op, variant]):
        if t.opt_slices[o] == g and t.opt_zdp[o] == k:
            return o
    raise AssertionError(f"no option g={g} k={k}")


def ring(alpha, beta, nbytes, n):
    return (n - 1) * alpha + (n - 1) / n * nbytes * beta


@pytest.mark.parametrize("g,k", [(1, 0), (1, 1), (4, 1), (4, 4), (16, 7)])
def test_option_time_matches_alpha_beta_gamma(g, k):
    desc = linear_model()
    dev = device()
    window = 1e12  # everything overlaps
    t = build_template(desc, dev, PlannerSettings(prefetch_bytes=window))
    b = 8
    P = 256 * 256 * 4
    s = P / g
    ag = ring(1e-5, 1e-9, s, 4)
    rs = ring(2e-5, 2e-9, s, 4)
    comp_f = 1e-5 + 1e6 / 1e12 * b + (g - 1) * 3e-6
    comp_b = 2 * (1e-5 + 1e6 / 1e12 * b) + (g - 1) * 3e-6
    expect = max(comp_f, g * ag) + max(comp_b, k * ag + g * rs)
    got = t.problem(b).opt_time_s[option(t, 0, g, k)]
    assert got == pytest.approx(expect, rel=1e-12)


def test_gather_is_exposed_when_two_slices_do_not_fit_the_window():
    desc = linear_model()
    P = 256 * 256 * 4
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=P * 1.5))
    p = t.problem(1)
    o1, o2 = option(t, 0, 1, 1), option(t, 0, 2, 2)
    comp_f = 1e-5 + 1e-6
    comp_b = 2 * comp_f
    ag1 = ring(1e-5, 1e-9, P, 4)
    rs1 = ring(2e-5, 2e-9, P, 4)
    # unsplit: 2P > window -> serial
    assert p.opt_time_s[o1] == pytest.approx(comp_f + ag1 + comp_b + ag1 + rs1, rel=1e-12)
    # two slices: 2 * P/2 <= window -> overlapped
    ag2, rs2 = ring(1e-5, 1e-9, P / 2, 4), ring(2e-5, 2e-9, P / 2, 4)
    comp_f2 = comp_f + 3e-6
    comp_b2 = comp_b + 3e-6
    assert p.opt_time_s[o2] == pytest.approx(max(comp_f2, 2 * ag2) + max(comp_b2, 2 * ag2 + 2 * rs2), rel=1e-12)


def test_the_forward_window_holds_the_unit_in_use_kept_or_not():
    """[Note: transient bytes] in runtime/lifecycle.py: a forward use's prefetch counts
    the unit in use, dp (kept) or zdp. l0 of five ops of P (4 ranks), window 6 P, by hand:
      dp:  forward: its P is in the prefix, the next four prefetched in the 5 P left,
           4 P; backward: nothing before it, its buffer and autograd's gradient 2 P,
           l1's reduction P, 3 P                                          -> 4 P
      zdp: forward: its P and the same 4 P; backward: itself again, 4 P   -> 5 P"""
    desc = linear_model(n_ops=5)
    P = 256 * 256 * 4
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=6 * P))
    assert t.opt_transient_bytes[option(t, 0, 1, 0)] == 4 * P
    assert t.opt_transient_bytes[option(t, 0, 1, 1)] == 5 * P


def test_dp_is_cheaper_in_time_and_dearer_in_memory():
    t = build_template(linear_model(), device(), PlannerSettings(prefetch_bytes=0))
    p = t.problem(1)
    dp, zdp = option(t, 0, 1, 0), option(t, 0, 1, 1)
    assert p.opt_time_s[dp] < p.opt_time_s[zdp]
    assert p.opt_held_q[dp] > 0 and p.opt_held_q[zdp] == 0


def test_peak_is_early_in_backward_with_a_breakdown():
    desc = linear_model(n_ops=5)
    dev = device()
    t = build_template(desc, dev, PlannerSettings(prefetch_bytes=0))
    b = 3
    choices = [option(t, i, 1, 0) for i in range(5)]  # all dp
    est = evaluate(t, b, choices, [0] * 5)
    P = 256 * 256 * 4
    shard = math.ceil(256 * 256 / 4)
    states = shard * (4 + 8) * 5 + LOSS_SCALARS_BYTES  # the loss and its gradient seed: 2 x 4 B
    # l4, first in backward, at its hook ([Note: the hook moment]): all 5 weights kept,
    # 4 ops' saved activations (its own input was released with autograd's node), in
    # backward nothing to gather (dp): the gradient autograd made and the buffer the
    # hook copies it into (2P), both live when its reduce-scatter's output (its shard)
    # is allocated, nothing reducing yet, no sharded gradient (zero_grad set them None)
    at_l4 = states + 5 * P + 4 * 4096 * b + 2 * P + shard * 4 + 4096 * b
    # l3: l4's weights and activations freed, its sharded gradient made; its 2P and its
    # output plus l4's gradient still reducing beside it ([Note: pending reduction])
    at_l3 = states + 4 * P + 3 * 4096 * b + 3 * P + shard * 4 + 4096 * b + shard * 4
    assert at_l3 > at_l4
    assert est.peak_op == "l3"
    assert est.peak_bytes == pytest.approx(at_l3)
    assert sum(est.breakdown.values()) == pytest.approx(est.peak_bytes)
    assert est.breakdown["saved_activations"] == 3 * 4096 * b
    assert est.breakdown["kept_dp_weights"] == 4 * P
    assert est.breakdown["in_flight_and_grad_buffers"] == 3 * P + shard * 4
    assert est.breakdown["sharded_grads_so_far"] == shard * 4
    # gradients kept between steps (zero_grad(set_to_none=False)) are paid throughout;
    # a reduce-scatter's output is then added into .grad and freed once waited for, so
    # at l3's issue l4's output, still in flight, stands where its sharded gradient was
    kept = build_template(desc, dev, PlannerSettings(prefetch_bytes=0, grads_set_to_none=False))
    est_kept = evaluate(kept, b, choices, [0] * 5)
    assert est_kept.peak_op == "l3"
    assert est_kept.peak_bytes == pytest.approx(at_l3 + shard * 4 * 5)


@pytest.mark.parametrize("g", [2, 4, 16])
def test_a_split_op_holds_two_slice_buffers_and_its_own_slices_shards_in_backward(g):
    """[Note: pending reduction] for a split op, by hand: l1 (first in backward) holds
    its slice buffer, nothing reducing before it and, from its first slice's
    reduce-scatter on, the op's whole sharded gradient (all g outputs, ceil(N/g/4)
    elements each: [Note: split parameters]); its busiest moment is its last slice's
    issue: two slice buffers (it and the previous slice, still reducing) and the g
    outputs. l0 beside l1's whole gradient still reducing: the larger of that with the
    g outputs, and the same two buffers and g outputs."""
    desc = linear_model(n_ops=2)
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=0))  # no prefetch: own gathers only
    P = 256 * 256 * 4
    grad, out = P / g, math.ceil(256 * 256 / g / 4) * 4
    own_gather = P / g  # zdp slices gather again in backward
    last = option(t, 1, g, g)
    assert t.opt_transient_bytes[last] == own_gather + grad + max(0 + g * out, grad + g * out)
    first = option(t, 0, g, g)
    pending = P  # l1 reduces alone; counted whole whatever its slicing
    assert t.opt_transient_bytes[first] == own_gather + grad + max(pending + g * out, grad + g * out)
    # gradients kept between steps: the shards are static, not made by backward; an
    # output is freed once reduced, so two are live (its own and the previous slice's)
    kept = build_template(desc, device(), PlannerSettings(prefetch_bytes=0, grads_set_to_none=False))
    assert kept.opt_transient_bytes[option(kept, 1, g, g)] == own_gather + 2 * grad + 2 * out


def test_a_split_ops_busiest_backward_moment_is_its_last_slices_issue():
    """[Note: split backward moments] by hand, l1 (last op, nothing pending) in 4 slices,
    2 zdp (indices 0, 1) and 2 dp (2, 3), no prefetch; s = P/4 = its slice gradient,
    outputs s/4 (4 ranks). The prefix holds the 2 dp slices; per slice in backward:
      3 (dp): no gather, its buffer s, nothing in flight, 1 output        -> 1.25 s
      2 (dp): its buffer, slice 3 reducing, 2 outputs, slice 3 freed       -> 1.5 s
      1 (zdp): gathered again s, 2 buffers, 3 outputs, slices 3, 2 freed   -> 1.75 s
      0 (zdp): gathered again s, 2 buffers, 4 outputs, slices 3, 2 freed   -> 2 s
    (the runtime frees a dp slice after its own backward; the prefix still holds it)"""
    desc = linear_model(n_ops=2)
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=0))
    s = 256 * 256 * 4 / 4
    o = option(t, 1, 4, 2)
    assert t.opt_held_bytes[o] == 2 * s
    assert t.opt_transient_bytes[o] == pytest.approx(2 * s, rel=1e-12)


def test_sharded_grads_appear_as_backward_passes_each_op():
    desc = linear_model(n_ops=3)
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=0))
    shard = math.ceil(256 * 256 / 4) * 4
    assert list(t.grads_after) == [2 * shard, shard, 0]


def test_search_memory_is_conservative_and_within_its_bound():
    from osdp.planner.search import evaluate_assignment

    desc = linear_model(n_ops=7, in_f=96, out_f=40, act=1000.0)
    t = build_template(desc, device(limit=parse_bytes("4MiB")), PlannerSettings(min_buckets=64, max_buckets=64))
    rng = np.random.default_rng(0)
    for _ in range(50):
        choice = [int(rng.integers(t.opt_begin[i, 0], t.opt_end[i, 0])) for i in range(7)]
        p = t.problem(2)
        _, _, quantized_peak, _ = evaluate_assignment(p, choice, [0] * 7)
        exact = evaluate(t, 2, choice, [0] * 7).peak_bytes
        assert quantized_peak >= exact - 1e-6
        # one quantum per op with kept weights plus one per segment (7 single-op segments)
        assert quantized_peak - exact <= t.quantum_bytes * (7 + 7) + 1e-6


def test_checkpointing_keeps_block_input_and_pays_recompute_and_a_gather():
    ops = tuple(OpDesc(f"b.{i}", "linear", 64 * 64, 64 * 64 * 4, 5000.0, 1e6, True, 64, block="b") for i in range(3))
    desc = ModelDesc("blk", ops, (BlockDesc("b", 0, 3, 700.0),))
    t = build_template(desc, device(limit=parse_bytes("8MiB")), PlannerSettings(checkpointing="auto", prefetch_bytes=1e12, min_buckets=65536))
    p = t.problem(4)
    assert list(p.seg_num_variants) == [2]
    assert p.act_in_segment_bytes[2, 0] == pytest.approx(3 * 5000 * 4)
    assert p.act_in_segment_bytes[2, 1] == pytest.approx(700 * 4 + 3 * 5000 * 4)
    plain, ckpt = option(t, 0, 1, 1, 0), option(t, 0, 1, 1, 1)
    assert p.opt_time_s[ckpt] > p.opt_time_s[plain]
    assert p.seg_carry_act_q[0, 1] < p.seg_carry_act_q[0, 0]


def test_bad_settings_and_sizes_are_rejected():
    with pytest.raises(OSDPError, match="policy"):
        PlannerSettings(policy="zero3")
    with pytest.raises(OSDPError, match="max slices"):
        PlannerSettings(max_slices=0)
    with pytest.raises(OSDPError, match="world_size must be an integer > 0"):
        device(world=0)
    with pytest.raises(OSDPError, match="memory_limit_bytes must be a number > 0"):
        device(limit=-1)
    with pytest.raises(OSDPError, match="batch size"):
        build_template(linear_model(), device()).problem(0)
    with pytest.raises(OSDPError, match="negative"):
        ModelDesc("x", (OpDesc("a", "linear", -1, 4, 0.0, 0.0, False),))
    for text in ("8XB", "", "-1GiB", "GiB"):
        with pytest.raises(OSDPError):
            parse_bytes(text)
    assert parse_bytes("1.5GiB") == 1.5 * 2**30


def test_mixed_precision_gathers_half_the_bytes_and_keeps_fp32_master_state():
    desc = linear_model()
    full = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12))
    mixed = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12, param_dtype_bytes=2, reduce_dtype_bytes=4))
    o_full, o_mixed = option(full, 0, 1, 0), option(mixed, 0, 1, 0)
    assert mixed.opt_held_bytes[o_mixed] == full.opt_held_bytes[o_full] / 2
    ag_half = ring(1e-5, 1e-9, 256 * 256 * 2, 4)
    assert mixed.opt_comm_f_s[o_mixed] == pytest.approx(ag_half, rel=1e-12)
    # gradients are still reduced in fp32
    assert mixed.opt_reduce_b_s[o_mixed] == pytest.approx(full.opt_reduce_b_s[o_full], rel=1e-12)
    assert mixed.static == full.static  # fp32 master shards, grads and moments
    assert mixed.act_per_sample[0] == pytest.approx(full.act_per_sample[0] / 2)


@pytest.mark.parametrize("sync", ["every", "last"])
def test_gradient_accumulation_time_and_accumulators(sync):
    desc = linear_model(n_ops=2)
    base = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12))
    acc = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12, accumulation_steps=3, gradient_sync=sync))
    b = 2
    o = option(acc, 0, 1, 1)
    one = base.problem(b).opt_time_s[option(base, 0, 1, 1)]
    got = acc.problem(b).opt_time_s[o]
    if sync == "every":
        assert got == pytest.approx(3 * one, rel=1e-12)
        assert "grad_accumulators" not in acc.static
    else:
        comp_f = 1e-5 + 1e6 / 1e12 * b
        comp_b = 2 * comp_f
        ag = ring(1e-5, 1e-9, 256 * 256 * 4, 4)
        no_rs = max(comp_f, ag) + max(comp_b, ag)
        assert got == pytest.approx(2 * no_rs + one, rel=1e-12)
        assert acc.static["grad_accumulators"] == 2 * 256 * 256 * 4


@pytest.mark.parametrize("temporaries", ["per_tensor", "foreach", "none", "auto"])
def test_the_optimizer_step_moment_by_hand(temporaries):
    """[Note: optimizer step moment], three Linears of 256 x 256, 512 x 256 and 128 x 256
    on 4 ranks (shards of 16384, 32768 and 8192 fp32 elements): static (params and
    AdamW's two moments, 12 B per element, and its step per tensor), every sharded
    gradient, the loss, and the temporaries: for-loop 2 x a shard + its larger neighbour
    in op order (l1: 2 x 131072 + 65536), foreach every shard once (229376)."""
    ops = tuple(OpDesc(f"l{i}", "linear", 256 * out_f, 256 * out_f * 4, 4096.0, 1e6, True, 256, param_tensors=1)
                for i, out_f in enumerate((256, 512, 128)))
    desc = ModelDesc("lin", ops)
    t = build_template(desc, device(), PlannerSettings(optimizer_temporaries=temporaries))
    shards = [16384 * 4, 32768 * 4, 8192 * 4]
    temps = {"per_tensor": 2 * shards[1] + shards[0], "foreach": sum(shards), "none": 0}
    temps["auto"] = max(temps["per_tensor"], temps["foreach"])
    assert t.step_bytes["optimizer_temporaries"] == temps[temporaries]
    static = sum(shards) * 3 + 3 * 4.0 + LOSS_SCALARS_BYTES
    assert sum(t.step_bytes.values()) == static + sum(shards) + temps[temporaries]
    assert t.step_bytes["sharded_grads"] == sum(shards)


def test_the_optimizer_step_is_the_peak_and_a_limit_below_it_has_no_plan():
    """Six replicated Linears (DDP) under foreach AdamW: at the step every whole gradient
    and a temporary copy of every parameter are live, more than at any op of backward.
    evaluate names the step; a limit between the ops' peak and the step's has no
    feasible plan in either search core (nor by enumeration), and above it the plan's
    peak is the step's."""
    from osdp.planner import search as S
    from osdp.planner.cost_model import OPTIMIZER_STEP, live_memory

    desc = linear_model(n_ops=6, act=16.0)
    settings = PlannerSettings(policy="rep", optimizer_temporaries="foreach")
    t = build_template(desc, device(), settings)
    only = [int(t.opt_begin[i, 0]) for i in range(6)]  # a rep op has one option
    flat = [0] * len(t.segments)
    est = evaluate(t, 1, only, flat)
    step = sum(t.step_bytes.values())
    P = 256 * 256 * 4
    assert t.step_bytes["replicated_grads"] == 6 * P and t.step_bytes["optimizer_temporaries"] == 6 * P
    assert est.peak_op == OPTIMIZER_STEP and est.peak_bytes == step and est.breakdown == t.step_bytes
    ops_peak = max(sum(parts.values()) for _, parts in live_memory(t, 1, only, flat))
    assert ops_peak < step
    cores = [S.search_python] + ([S.search_cpp] if importlib.util.find_spec("osdp._C") else [])
    tight = build_template(desc, device(limit=(ops_peak + step) / 2), settings).problem(1)
    assert not any(core(tight).feasible for core in cores) and not S.brute_force(tight).feasible
    roomy = build_template(desc, device(limit=step * 1.01), settings).problem(1)
    for core in cores:
        found = core(roomy)
        assert found.feasible and found.peak_bytes == step and found.peak_op == -1


def test_the_for_loop_step_holds_a_tensor_twice_beside_the_one_before_it():
    """Two replicated Linears with biases, stepped weight, bias, weight, bias: at the
    second weight the previous denom is the first bias, not the first weight (W&S 2x768
    all rep measured 2 x c_fc's weight + a bias); without tensor_numels each unit is
    taken as one tensor, a bound (weight + bias twice, beside the unit before)."""
    def model(numels):
        return ModelDesc("lin", tuple(
            OpDesc(f"l{i}", "linear", 256 * 257, 256 * 257 * 4, 4096.0, 1e6, True, 256, param_tensors=2,
                   tensor_numels=numels) for i in range(2)))

    settings = PlannerSettings(policy="rep", optimizer_temporaries="per_tensor")
    w, b = 256 * 256 * 4, 256 * 4
    described = build_template(model((256 * 256, 256)), device(), settings)
    assert described.step_bytes["optimizer_temporaries"] == 2 * w + b
    unknown = build_template(model(()), device(), settings)
    assert unknown.step_bytes["optimizer_temporaries"] == 3 * (w + b)
    with pytest.raises(OSDPError, match="add up to 65791, not to its param_count 65792"):
        model((256 * 256, 255))
