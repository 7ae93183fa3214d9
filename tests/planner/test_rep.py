"""The ``rep`` mode in the planner (docs/design/cost_model.md's [Note: rep mode], batch_sweep.py's
[Note: rep family]) against numbers worked out by hand, the search within a fixed rep
set against brute force, the scheduler's choice of rep set, the plan file and the
step simulation's replicated buckets.

Devices: world 4, all-gather a = 1e-5 s, b = 1e-9 s/B; reduce-scatter a = 2e-5, b = 2e-9;
so an all-reduce of G bytes over 4 ranks (reduce-scatter + all-gather, no measured
all-reduce) costs 3 (1e-5 + 2e-5) + 3/4 G (3e-9) s. Units are 256 x 256 fp32 linears
(P = G = 262144 bytes) unless said otherwise.
"""
import itertools
import json
import math

import pytest

from osdp.contract import MAX_INFLIGHT_REPLICATE_BUCKETS, REPLICATE_BUCKET_BYTES
from osdp.errors import OSDPError
from osdp.planner import search as S
from osdp.planner.calibration import assignment_of
from osdp.planner.cluster import ClusterProfile, Link
from osdp.planner.collective_cost import Collectives
from osdp.planner.cost_model import PlannerSettings, build_template, evaluate, live_memory, optimizer_step_s
from osdp.planner.description import BlockDesc, ModelDesc, OpDesc
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.plan import Plan
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings
from osdp.planner.batch_sweep import rep_family, schedule
from osdp.planner.step_sim import simulate_step

P = 256 * 256 * 4


def device(world=4, limit=1 << 30, **kw):
    args = dict(name="test", world_size=world, memory_limit_bytes=limit,
                all_gather=CollectiveCost(alpha_s=1e-5, beta_s_per_byte=1e-9),
                reduce_scatter=CollectiveCost(alpha_s=2e-5, beta_s_per_byte=2e-9),
                flops_per_s=1e12, op_overhead_s=1e-5, slice_overhead_s=3e-6,
                memory_bandwidth_bytes_per_s=1e11, constant_bytes=0)
    args.update(kw)
    return DeviceInfo(**args)


def linear(name, in_f=256, out_f=256, act=4096.0, flops=1e6, **kw):
    return OpDesc(name, "linear", in_f * out_f, in_f * out_f * 4, act, flops, True, in_f, **kw)


def model(n=3, **kw):
    return ModelDesc("lin", tuple(linear(f"l{i}", **kw) for i in range(n)))


def ring(alpha, beta, nbytes, n):
    return (n - 1) * alpha + (n - 1) / n * nbytes * beta


def all_reduce(nbytes, n=4):
    return ring(2e-5, 2e-9, nbytes, n) + ring(1e-5, 1e-9, nbytes, n)


def options(t, i, v=0):
    return list(range(t.opt_begin[i, v], t.opt_end[i, v]))


def option(t, i, g, k, v=0):
    return next(o for o in options(t, i, v) if t.opt_slices[o] == g and t.opt_zdp[o] == k)


# ---- the cost model ----------------------------------------------------------------------

def test_rep_op_time_and_memory_terms_by_hand():
    """l0, l1, l2 (P = G = 262144 B, 4096 B of activations per sample, 1e6 FLOPs), l1
    rep, window 1e12 (everything overlaps), batch 8.

    static: the shards of l0, l2: params 2 x 16384 x 4 = 131072, AdamW 2 x 16384 x 8 =
            262144; l1 whole: params 262144, AdamW 524288
    l1's one option: g 1, nothing kept, no gathers; backward comm = its bucket's
            all-reduce (alone in it: the whole latency): 3 (3e-5) + 3/4 G 3e-9 = 679.824 us;
            time = F + max(B, AR) with F = 1e-5 + 8e-6, B = 2F
    transient at l1: max(forward: l2's prefetch P, backward: l0's prefetch P + the
            gradient autograd made, G (l1 is a direct rep unit, fp32 throughout: that
            gradient becomes its .grad, no buffer beside it, [Note: direct replicated
            units]) + l2's gradient, maybe reduce-scattering, G) = 3 P
    after l1's backward (op l0): its buffer in the bucket being filled, G
    optimizer: 2 x 2 x (131072 + 262144 + 262144 + 524288) / 1e11."""
    desc = model(3)
    dev = device()
    t = build_template(desc, dev, PlannerSettings(prefetch_bytes=1e12, rep_units=("l1",)))
    # constant: the loss and the gradient backward starts from, 2 x 4 B
    assert t.static == {"sharded_params": 131072.0, "optimizer_state": 262144.0, "constant": 8.0,
                        "replicated_params": 262144.0, "replicated_optimizer_state": 524288.0}
    assert list(t.rep) == [False, True, False] and t.rep_units == ("l1",)
    (o,) = options(t, 1)
    assert (t.opt_slices[o], t.opt_zdp[o], t.opt_hpz[o]) == (1, 0, 0)
    assert (t.opt_held_bytes[o], t.opt_comm_f_s[o], t.opt_gather_b_s[o]) == (0, 0, 0)
    ar = 3 * 3e-5 + 0.75 * P * 3e-9
    assert t.opt_reduce_b_s[o] == pytest.approx(679.824e-6, rel=1e-12) == pytest.approx(ar, rel=1e-12)
    comp_f = 1e-5 + 8e-6
    assert t.problem(8).opt_time_s[o] == pytest.approx(comp_f + max(2 * comp_f, ar), rel=1e-12)
    assert t.opt_transient_bytes[o] == 3 * P
    assert list(t.rep_grads) == [P, 0, 0]
    # the sharded units' gradients no longer count l1's shard
    assert list(t.grads_after) == [P / 4, P / 4, 0]
    assert optimizer_step_s(desc, dev, t.settings) == pytest.approx(4 * 1179648 / 1e11, rel=1e-12)
    # the rest is as without rep: l0's and l2's options are unchanged
    plain = build_template(desc, dev, PlannerSettings(prefetch_bytes=1e12, rep_units=()))
    assert plain.rep_grads.sum() == 0 and "replicated_params" not in plain.static
    for i in (0, 2):
        assert [(t.opt_slices[x], t.opt_zdp[x]) for x in options(t, i)] == \
               [(plain.opt_slices[x], plain.opt_zdp[x]) for x in options(plain, i)]


def test_rep_plan_peak_by_hand():
    """The plan l0 dp, l1 rep, l2 dp of the test above at batch 3 (activations 12288 B
    per op, activation gradients as much), per op (static 1179648 + 8 B of loss scalars
    in each):
      l0: kept P, saved 12288, transient max(own gather P + l1? no: l1 is never
          gathered, so l2's prefetch P; backward: autograd's gradient G + its buffer G
          + l2's, maybe still reducing (l1 reduces in its bucket), G, + its own
          reduce-scatter's output G/4) = 3P + G/4, act grads 12288, l1 and l2's
          sharded grads G/4, l1's buffer G (replicated_grads), less its own
          12288 saved, released before the hook ([Note: the hook moment]) -> 2633736
      l1: kept P, saved 24576, transient 3P (direct: autograd's gradient is its .grad,
          no buffer), act grads 12288, l2's shard G/4 -> 2330632
      l2: kept 2P, saved 36864, transient max(P, P + 2G + G/4) = 3P + G/4 (nothing
          reduces before it), act grads 12288, less its own 12288 -> 2592776
    """
    desc = model(3)
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12, rep_units=("l1",)))
    choice = [option(t, 0, 1, 0), options(t, 1)[0], option(t, 2, 1, 0)]
    rows = live_memory(t, 3, choice, [0, 0, 0], exact=False)  # the search's window bound
    totals = [sum(parts.values()) for _, parts in rows]
    assert totals == [2633736, 2330632, 2592776]
    # the plan's own gathers: at l2's backward the bound counts l0 as a prefetch (P),
    # but l0 is dp, kept in the prefix: nothing is gathered there
    exact = [sum(parts.values()) for _, parts in live_memory(t, 3, choice, [0, 0, 0])]
    assert exact[:2] == totals[:2] and exact[2] == totals[2] - P
    assert rows[0][1]["replicated_grads"] == P and rows[0][1]["replicated_states"] == 786432
    assert rows[0][1]["sharded_grads_so_far"] == P / 4
    est = evaluate(t, 3, choice, [0, 0, 0])
    assert (est.peak_bytes, est.peak_op) == (2633736, "l0")


def test_rep_static_under_mixed_precision_and_kept_gradients():
    """param_dtype 2 bytes: the kept param_dtype copy, 65536 x 2; gradients kept between
    steps: the whole .grad, P, static (and no .grad term after backward: the buffer is
    added into it and freed; l0 still sees l1's buffer in the bucket being filled)."""
    desc = model(3)
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12, rep_units=("l1",), param_dtype_bytes=2,
                                                       reduce_dtype_bytes=4, grads_set_to_none=False))
    assert t.static["replicated_param_copies"] == 131072
    assert t.static["replicated_grads"] == P
    assert t.static["sharded_grads"] == 2 * P / 4
    assert list(t.rep_grads) == [P, 0, 0]


def test_a_direct_rep_units_gradient_is_added_into_its_kept_grad():
    """fp32 throughout, gradients kept between steps: l1 is direct ([Note: direct
    replicated units]), autograd adds its gradient into the static .grad (P): l0 sees no
    buffer of l1 in the bucket being filled, and l1's own transient holds autograd's
    gradient but no buffer (3 P, as with .grad set to None)."""
    desc = model(3)
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12, rep_units=("l1",),
                                                       grads_set_to_none=False))
    assert t.static["replicated_grads"] == P
    assert list(t.rep_grads) == [0, 0, 0]
    (o,) = options(t, 1)
    assert t.opt_transient_bytes[o] == 3 * P


R25 = 655360  # parameters of a 2.5 MiB fp32 unit


@pytest.mark.parametrize("reduce_bytes", [None, 2])
def test_buckets_share_latency_and_hold_their_gradients(reduce_bytes):
    """Five rep units u0..u4 of 655360 parameters (P = 2.5 MiB), buckets of 4 MiB.

    fp32 gradients (G = P): backward order u4, u3 -> 5 MiB, full: bucket {u4, u3},
    issued after u3's backward; {u2, u1} after u1's; {u0} at the end. Each unit pays
    the all-reduce rate on G and its bucket's latency / 2 (u0: all of it). After
    backward, per op j (in flight: buffer + staging, 2G; done: the buffer is the .grad, G):
      j=4: 0; j=3: u4 filling, G; j=2: {u4,u3} in flight, 4G; j=1: 4G + u2 filling, 5G;
      j=0: {u2,u1} in flight 4G, {u4,u3} done 2G: 6G.
    bf16 gradients (G = P/2): 4 units make 5 MiB: {u4..u1} issued after u1's backward,
    {u0} at the end; in flight a unit holds buffer + staging + the fp32 .grad made at
    the end (2G + P = 4G): j=3: G, j=2: 2G, j=1: 3G, j=0: 16G."""
    desc = ModelDesc("five", tuple(linear(f"u{i}", in_f=2560) for i in range(5)))
    assert desc.ops[0].param_count == R25
    names = tuple(op.name for op in desc.ops)
    settings = PlannerSettings(prefetch_bytes=1e12, rep_units=names, reduce_dtype_bytes=reduce_bytes)
    t = build_template(desc, device(), settings)
    G = R25 * (reduce_bytes or 4)
    assert REPLICATE_BUCKET_BYTES == 4 * 2**20 and MAX_INFLIGHT_REPLICATE_BUCKETS == 1
    lat, rate = 3 * 3e-5, 0.75 * 3e-9
    reduce = [t.opt_reduce_b_s[options(t, i)[0]] for i in range(5)]
    if reduce_bytes is None:
        assert reduce == pytest.approx([rate * G + lat] + [rate * G + lat / 2] * 4, rel=1e-12)
        assert list(t.rep_grads) == [6 * G, 5 * G, 4 * G, G, 0]
        buckets = [(3, 4), (1, 2), (0,)]
    else:
        assert reduce == pytest.approx([rate * G + lat] + [rate * G + lat / 4] * 4, rel=1e-12)
        assert list(t.rep_grads) == [16 * G, 3 * G, 2 * G, G, 0]
        buckets = [(1, 2, 3, 4), (0,)]
    # the shares of a bucket add up to its all-reduce
    for bucket in buckets:
        assert sum(reduce[i] for i in bucket) == pytest.approx(all_reduce(len(bucket) * G), rel=1e-12)


def test_measured_all_reduce_and_two_levels():
    """A measured all-reduce (gloo: the gradient collective) prices the all-reduce alone;
    across 2 nodes of 4 (inter: a 1e-4, b 1e-8 both ways): AR(G) = AR_intra(G; 4) +
    RS_e(G/4; 2) + AG_e(G/4; 2)."""
    measured = CollectiveCost(alpha_s=5e-5, beta_s_per_byte=4e-9)
    flat = Collectives(device(all_reduce=measured))
    assert flat.all_reduce_s(P) == pytest.approx(ring(5e-5, 4e-9, P, 4), rel=1e-12)
    assert Collectives(device()).all_reduce_s(P) == pytest.approx(all_reduce(P), rel=1e-12)
    inter = CollectiveCost(alpha_s=1e-4, beta_s_per_byte=1e-8)
    two = Collectives(device(world=8, node_size=4, inter_all_gather=inter, inter_reduce_scatter=inter))
    assert two.two_level
    expect = all_reduce(P, 4) + 2 * ring(1e-4, 1e-8, P / 4, 2)
    assert two.all_reduce_s(P) == pytest.approx(expect, rel=1e-12)
    # the HSDP layout all-reduces a rep unit over every rank too
    hsdp = Collectives(device(world=8, node_size=4, inter_all_gather=inter, inter_reduce_scatter=inter), "hsdp")
    assert hsdp.all_reduce_s(P) == pytest.approx(expect, rel=1e-12)


def test_a_measured_all_reduce_reaches_the_device_from_a_profile(tmp_path):
    ag = CollectiveCost(1e-5, 1e-9)
    ar = CollectiveCost(3e-5, 3e-9)
    profile = ClusterProfile("cpu", 2, 2**30, {"intra": Link(ag, ag, ar)}, 1e11)
    path = tmp_path / "c.json"
    profile.save(path)
    data = json.loads(path.read_text())
    assert data["links"]["intra"]["all_reduce"] == {"alpha_s": 3e-5, "beta_s_per_byte": 3e-9}
    loaded = ClusterProfile.from_dict(data)
    dev = loaded.for_run(RunSettings(world_size=2, memory_limit_bytes=2**30))
    assert dev.all_reduce == ar
    assert DeviceInfo.from_dict(dev.to_dict()).all_reduce == ar
    # without one, the files are written as before
    plain = ClusterProfile("gpu", 2, 2**30, {"intra": Link(ag, ag)}, 1e11)
    assert "all_reduce" not in plain.to_dict()["links"]["intra"]
    assert "all_reduce" not in plain.for_run(RunSettings(world_size=2)).to_dict()


def test_rep_units_are_checked_and_policy_rep_replicates_every_unit():
    tied = ModelDesc("tied", (OpDesc("e", "embedding", 1000, 4000, 0.0, 0.0, False),
                              linear("x"),
                              OpDesc("h", "linear", 0, 0, 0.0, 1e6, False, tied_to="e")))
    dev = device()
    with pytest.raises(OSDPError, match="rep_units names 'h', which is not a unit: it uses the weights of 'e'"):
        build_template(tied, dev, PlannerSettings(rep_units=("h",)))
    with pytest.raises(OSDPError, match="rep_units names 'nope'"):
        build_template(tied, dev, PlannerSettings(rep_units=["nope"]))
    with pytest.raises(OSDPError, match="rep_units must be None or a list"):
        PlannerSettings(rep_units="e")
    assert PlannerSettings(rep_units=["x", "e", "x"]).rep_units == ("e", "x")
    t = build_template(tied, dev, PlannerSettings(policy="rep"))
    assert list(t.rep) == [True, True, True] and t.rep_units == ("e", "x")
    # a tied unit is one unit: both uses rep, its all-reduce charged once, at the owner
    t = build_template(tied, dev, PlannerSettings(rep_units=("e",)))
    assert list(t.rep) == [True, False, True]
    assert t.opt_reduce_b_s[options(t, 0)[0]] == pytest.approx(all_reduce(4000), rel=1e-12)
    assert t.opt_reduce_b_s[options(t, 2)[0]] == 0
    # the other policies have no rep unit
    for policy in ("zdp", "dp", "hpz"):
        assert not build_template(tied, dev, PlannerSettings(policy=policy, rep_units=("e",))).rep.any()


def test_a_tied_uses_own_bias_follows_its_owner_into_rep():
    """A head tied to the embedding with a bias of its own (250 fp32) runs the
    embedding's mode (``plan_from_schedule``): with the embedding rep, the bias is
    replicated too (whole params and Adam's two moments, 250 x 12 B, beside the
    embedding's 1000 x 12), joins the bucket first (the head's backward comes first:
    one bucket of both, its latency shared) and its share is charged at the head."""
    tied = ModelDesc("tied", (OpDesc("e", "embedding", 1000, 4000, 0.0, 0.0, False),
                              linear("x"),
                              OpDesc("h", "linear", 250, 1000, 0.0, 1e6, False, tied_to="e")))
    t = build_template(tied, device(), PlannerSettings(rep_units=("e",)))
    assert list(t.rep) == [True, False, True]
    assert t.static["replicated_params"] == 5000
    # (these OpDescs declare no tensor count: no per-tensor state)
    assert t.static["replicated_optimizer_state"] == 1250 * PlannerSettings().optimizer_state_bytes_per_param
    assert t.static["sharded_params"] == P / 4
    latency = all_reduce(0)
    assert t.opt_reduce_b_s[options(t, 0)[0]] == pytest.approx(all_reduce(4000) - latency / 2, rel=1e-12)
    assert t.opt_reduce_b_s[options(t, 2)[0]] == pytest.approx(all_reduce(1000) - latency / 2, rel=1e-12)
    plan = make_plan(tied, device(), PlannerSettings(rep_units=("e",)), batch=1, baselines=False)
    assert {u.name: u.modes for u in plan.units}["h"] == ("rep",)
    # the plan read back (calibration, fidelity): the bias is not named in the rep set
    assert list(assignment_of(tied, device(), plan).template.rep) == [True, False, True]


# ---- the search within a fixed rep set ------------------------------------------------------

BLOCKED = ModelDesc("blocked", tuple(linear(f"b.{i}", in_f=64 * (i + 1), act=3000.0, block="b") for i in range(2))
                    + (linear("t", in_f=128, act=2000.0),),
                    (BlockDesc("b", 0, 2, 500.0),))


def _least_peak(t, batch) -> float:
    """The least peak (the search's window bound) over every plan of a small template."""
    p = t.problem(batch)
    per_segment = []
    for s in range(p.num_segments):
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        per_segment.append([(v, opts) for v in range(int(p.seg_num_variants[s]))
                            for opts in itertools.product(*(range(int(p.opt_begin[i, v]), int(p.opt_end[i, v]))
                                                            for i in range(first, first + count)))])
    return min(evaluate(t, batch, [o for _, opts in plan for o in opts], [v for v, _ in plan], exact=False).peak_bytes
               for plan in itertools.product(*per_segment))


@pytest.mark.parametrize("rep_units", [("b.1",), ("b.0", "t"), ()])
@pytest.mark.parametrize("batch", [1, 4])
def test_search_with_a_fixed_rep_set_is_exact(rep_units, batch):
    """Checkpointing "auto", slices up to 2, a rep set fixed: the search (both cores)
    against every plan, at limits from the least-memory plan's peak to the fastest
    plan's (where the constraint binds) and above."""
    from osdp.planner.batch_sweep import min_memory_estimate

    settings = PlannerSettings(checkpointing="auto", max_slices=2, rep_units=rep_units, min_buckets=256,
                               max_buckets=256)
    loose = build_template(BLOCKED, device(limit=1e12), settings)
    for i, op in enumerate(BLOCKED.ops):  # a rep op has its one option under each variant
        for v in range(len(loose.segments[0].variants) if i < 2 else 1):
            assert (len(options(loose, i, v)) == 1) == (op.name in rep_units)
    fastest = S.brute_force(loose.problem(batch))
    high = evaluate(loose, batch, fastest.option_index, fastest.variant, exact=False).peak_bytes
    low = _least_peak(loose, batch)
    assert low <= min_memory_estimate(loose, batch).peak_bytes  # the error message's plan: an upper bound
    assert low < high
    backends = ["python"] + (["cpp"] if _native_built() else [])
    optima = set()
    for limit in (low * 0.999, low * 1.04, (low + high) / 2, high * 0.99, high * 1.05):
        t = build_template(BLOCKED, device(limit=limit), settings)
        p = t.problem(batch)
        brute = S.brute_force(p)
        if brute.feasible:
            optima.add((brute.option_index, brute.variant))
        found = []
        for backend in backends:
            got = S.search(p, backend=backend)
            found.append((got.option_index, got.variant))
            assert got.feasible == brute.feasible
            if brute.feasible:
                assert got.time_s == brute.time_s and got.peak_bytes == brute.peak_bytes
                # an exact tie (same time and peak) may go to another plan than the
                # enumeration's first: the plan found must cost exactly the optimum
                feasible, time_s, peak, _ = S.evaluate_assignment(p, got.option_index, got.variant)
                assert feasible and (time_s, peak) == (brute.time_s, brute.peak_bytes)
                # the search's quantized peak is never below the exact one, which fits
                exact = evaluate(t, batch, got.option_index, got.variant).peak_bytes
                assert exact <= got.peak_bytes + 1e-6 and exact <= limit
        assert len(set(found)) == 1  # both cores break ties alike
    assert len(optima) >= 2  # the limit binds: the optimum moves with it


def _native_built() -> bool:
    try:
        S._native()
    except ImportError:
        return False
    return True


# ---- the scheduler's rep sets ---------------------------------------------------------------------

def latency_bound_device(limit):
    """Gathers cost 3 ms of latency each: replicating pays wherever it fits."""
    return device(limit=limit, all_gather=CollectiveCost(alpha_s=1e-3, beta_s_per_byte=1e-9))


# 1 MB of activations per sample and op: the batch stays small, the gathers' latency
# is never hidden behind compute
UNEVEN = ModelDesc("uneven", tuple(linear(f"u{i}", in_f=64 * (i + 1), act=1e6) for i in range(4)))


def test_scheduler_picks_all_rep_when_memory_is_loose_and_gathers_are_costly():
    """Four units (64 .. 256 x 256), 64 MiB: their whole states (1.9 MB) fit easily; a
    gather costs 3 ms of latency, the one bucket's all-reduce 3 (1e-3 + 2e-5) ms shared
    by the four: DDP. The plan says so unit by unit and matches the DDP baseline."""
    dev = latency_bound_device(64 * 2**20)
    best = schedule(UNEVEN, dev, PlannerSettings(), backend="python")
    assert best.template.rep_units == ("u0", "u1", "u2", "u3")
    ddp = schedule(UNEVEN, dev, PlannerSettings(policy="rep"), backend="python")
    assert (best.batch, best.result.time_s) == (ddp.batch, ddp.result.time_s)
    plan = make_plan(UNEVEN, dev, PlannerSettings(rerank=False), backend="python")
    assert all(u.modes == ("rep",) and u.replicated for u in plan.units)
    assert plan.baselines["ddp"].samples_per_s == pytest.approx(plan.predicted.samples_per_s, rel=1e-12)
    # the family: no rep unit, then every unit of at most 64x256, 128x256, ... fp32 bytes
    assert [m.rep_units for m in rep_family(UNEVEN, PlannerSettings())] == \
           [(), ("u0",), ("u0", "u1"), ("u0", "u1", "u2"), ("u0", "u1", "u2", "u3")]


# three small units and a 1024 x 4096 one (16 MiB)
MIX = ModelDesc("mix", tuple(linear(f"s{i}", in_f=64, act=1e5) for i in range(3))
                + (linear("big", in_f=1024, out_f=4096, act=1e5),))


def test_scheduler_never_picks_a_rep_set_that_does_not_fit():
    """Gathers of 10 ms latency. Every unit whole: static 16.25 MiB x (4 + 8) / 4 = 48.56
    MiB, over the 48 MiB limit by itself; the sets that fit are planned, and the best of
    them (the three small units rep) is exactly the best over them planned one by one."""
    limit = 48 * 2**20
    dev = device(limit=limit, all_gather=CollectiveCost(alpha_s=1e-2, beta_s_per_byte=1e-9))
    best = schedule(MIX, dev, PlannerSettings(), backend="python")
    assert best.estimate.fits and best.estimate.peak_bytes <= limit
    rates = {}
    for member in rep_family(MIX, PlannerSettings()):
        t = build_template(MIX, dev, member)
        if sum(t.static.values()) > limit:
            assert member.rep_units == ("big", "s0", "s1", "s2")
            continue
        s = schedule(MIX, dev, member, backend="python")
        rates[member.rep_units] = s.samples_per_s
    assert set(rates) == {(), ("s0", "s1", "s2")}
    assert best.template.rep_units == max(rates, key=rates.get) == ("s0", "s1", "s2")
    assert best.samples_per_s == rates[("s0", "s1", "s2")]
    with pytest.raises(OSDPError, match="no plan fits"):  # DDP itself does not
        schedule(MIX, dev, PlannerSettings(policy="rep"), backend="python")


def test_without_rep_units_the_plan_is_the_one_without_rep():
    """Where replicating does not pay (communication nearly free: it saves nothing and
    costs memory), the family's best is the plan of the search space without rep,
    option for option."""
    from osdp.models import GPTConfig
    from osdp.planner.gpt_desc import describe_gpt

    desc = describe_gpt(GPTConfig(vocab_size=256, seq_len=32, num_layers=3, hidden=64, heads=4))
    fast = CollectiveCost(0.0, 1e-13)
    dev = device(limit=10 * 2**20, all_gather=fast, reduce_scatter=fast)
    a = schedule(desc, dev, PlannerSettings(max_slices=4), backend="python")
    b = schedule(desc, dev, PlannerSettings(max_slices=4, rep_units=()), backend="python")
    assert a.template.rep_units == ()
    assert (a.batch, a.result.option_index, a.result.variant, a.result.time_s) == \
           (b.batch, b.result.option_index, b.result.variant, b.result.time_s)


# ---- the plan ---------------------------------------------------------------------------------------

def test_plan_with_rep_round_trips_and_runs_as_planned(tmp_path):
    dev = latency_bound_device(64 * 2**20)
    plan = make_plan(UNEVEN, dev, PlannerSettings(rep_units=("u0", "u1")), backend="python")
    assert plan.unit_modes()["u0"] == ("rep",) and plan.unit_modes()["u1"] == ("rep",)
    assert "rep" not in plan.unit_modes()["u3"]
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["units"][0]["modes"] == ["rep"]
    loaded = Plan.load(path, fingerprint=UNEVEN.fingerprint())
    assert loaded == plan and loaded.plan_hash() == plan.plan_hash()
    config = loaded.runtime_config()
    assert config.unit_modes["u0"] == ("rep",) and config.unit_modes["u1"] == ("rep",)
    assert "u0 " in str(loaded) and " rep" in str(loaded) and "DDP (all rep)" in str(loaded)
    # the calibration's view of the plan: the same rep set, the same prediction
    a = assignment_of(UNEVEN, dev, loaded)
    assert a.template.rep_units == ("u0", "u1")
    peak = evaluate(a.template, a.batch, a.option_index, a.variant).peak_bytes
    assert peak == pytest.approx(plan.predicted.peak_bytes)


def test_rep_on_a_slice_of_a_split_unit_is_refused():
    dev = latency_bound_device(64 * 2**20)
    data = make_plan(UNEVEN, dev, PlannerSettings(rep_units=(), rerank=False), backend="python").to_dict()
    data["units"][3].update(modes=["rep", "dp"], slices=2, split_op="linear_in_features")
    with pytest.raises(OSDPError) as info:
        Plan.from_dict(data)
    assert str(info.value) == (
        "plan field units[3] (u3).modes is ['rep', 'dp']: 'rep' (replicated) is for whole units only, not for a "
        "slice of a split unit; give the unit one mode ['rep'], or each slice one of 'dp', 'zdp', 'hpz' (see "
        "[Note: replicated units] in osdp/contract.py)")
    data["units"][3].update(modes=["rep"], slices=1, split_op="")
    assert Plan.from_dict(data).units[3].replicated


def test_baselines_and_rerank_stay_inside_the_users_rep_units():
    from osdp.planner.rerank import within

    assert within(PlannerSettings(), dict(policy="rep", checkpointing="none"))
    assert not within(PlannerSettings(rep_units=()), dict(policy="rep", checkpointing="none"))
    assert within(PlannerSettings(rep_units=()), dict(policy="zdp", checkpointing="none"))
    fixed = PlannerSettings(rep_units=("u0",))
    assert not within(fixed, dict(policy="zdp", checkpointing="none"))
    assert not within(fixed, dict(policy="rep", checkpointing="none"))
    assert within(fixed, dict(max_slices=1))
    assert not within(PlannerSettings(policy="zdp"), dict(policy="rep", checkpointing="none"))


# ---- the step simulation -----------------------------------------------------------------------

ms = 1e-3


def test_step_sim_replicated_buckets_by_hand():
    """Four rep units a, b, c, d of 655360 parameters (2.5 MiB, F 1 ms, B 2 ms), world 2,
    all-gather and reduce-scatter b = 1e-9 s/B, no latency: an all-reduce of S bytes is
    1e-9 S s (5 MiB: 5.24288 ms). Buckets of 4 MiB, one in flight.

    forward:  F a [0,1] .. F d [3,4]; nothing gathered
    backward: B d [4,6], B c [6,8]: {d, c} is 5 MiB, issued: AR [8,13.24288];
              B b [8,10], B a [10,12]: {b, a} issued at 12, queued behind the first:
              AR [13.24288,18.48576], and, a second in flight, compute waits for the
              first: [12,13.24288]; end of backward waits for the second -> 18.48576
    optimizer: whole states 4 x 655360 x (4 + 8) B: 2 x 2 x 31457280 / bw = 1 ms
    step 19.48576 ms; the cost model charges each unit 1e-9 G: the same 2 x 5.24288 ms
    of all-reduce in all."""
    desc = ModelDesc("four", tuple(OpDesc(n, "linear", R25, R25 * 4, 0.0, 1e9, False) for n in "abcd"))
    dev = DeviceInfo(name="hand", world_size=2, memory_limit_bytes=1e12,
                     all_gather=CollectiveCost(0.0, 1e-9), reduce_scatter=CollectiveCost(0.0, 1e-9),
                     flops_per_s=1e12, op_overhead_s=0.0, slice_overhead_s=0.0,
                     memory_bandwidth_bytes_per_s=4 * 31457280 / 1e-3, constant_bytes=0)
    t = build_template(desc, dev, PlannerSettings(policy="rep", prefetch_bytes=4e6))
    choice = [options(t, i)[0] for i in range(4)]
    sim = simulate_step(t, 1, choice, [0] * 4, timeline=True)
    ar = 5 * 2**20 * 1e-9
    assert sim.step_s == pytest.approx((18 + 2 * ar / ms - 10 + 1) * ms, rel=1e-12)
    assert (sim.all_gathers, sim.reductions) == (0, 2)
    comm = [(e.kind, e.what, round(e.start_s / ms, 9), round(e.end_s / ms, 9))
            for e in sim.timeline if e.resource == "comm"]
    assert comm == [("all_reduce", "d, c", 8, round(8 + ar / ms, 9)),
                    ("all_reduce", "b, a", round(8 + ar / ms, 9), round(8 + 2 * ar / ms, 9))]
    waits = [(e.what, round(e.start_s / ms, 9), round(e.end_s / ms, 9)) for e in sim.timeline if e.kind == "wait"]
    assert waits == [("oldest replicated bucket", 12, round(8 + ar / ms, 9)),
                     ("replicated buckets at the end of backward", round(8 + ar / ms, 9), round(8 + 2 * ar / ms, 9))]
    assert sim.phases["optimizer"].duration_s == pytest.approx(1 * ms, rel=1e-12)
    reduce = sum(t.opt_reduce_b_s[o] for o in choice)
    assert reduce == pytest.approx(2 * ar, rel=1e-12)
    assert math.isclose(sum(p.duration_s for p in sim.phases.values()), sim.step_s)


def test_step_sim_gathers_around_a_rep_unit_and_reduces_each_kind_apart():
    """x (1 MB, zdp), r (rep, 1 MB), y (1 MB, zdp); world 2, b = 2e-9 (AG = RS = 1 ms
    per MB, an all-reduce of 1 MB 2 ms), F 1, B 2, window 1 MB, optimizer 1 ms.

    forward:  AG x [0,1], F x [1,2], free, prefetch AG y [2,3] (r is never gathered),
              F r [2,3], F y [3,4]                                          -> 4
    backward: AG y [4,5], B y [5,7], RS y [7,8], free, prefetch AG x [8,9]; B r [7,9],
              r joins the bucket; B x [9,11], RS x [11,12]; end of backward: the bucket's
              AR r [12,14]; waits for RS x and the AR                        -> 14
    optimizer [14,15]."""
    desc = ModelDesc("mixed", tuple(OpDesc(n, "linear", 250_000, 1_000_000, 0.0, 1e9, False) for n in "xry"))
    # optimizer: x, y shards 125 000 x 12 B each, r whole 250 000 x 12: 2 x 2 x 6e6 / bw = 1 ms
    dev = DeviceInfo(name="hand", world_size=2, memory_limit_bytes=1e12,
                     all_gather=CollectiveCost(0.0, 2e-9), reduce_scatter=CollectiveCost(0.0, 2e-9),
                     flops_per_s=1e12, op_overhead_s=0.0, slice_overhead_s=0.0,
                     memory_bandwidth_bytes_per_s=2.4e10, constant_bytes=0)
    t = build_template(desc, dev, PlannerSettings(prefetch_bytes=1e6, rep_units=("r",)))
    choice = [option(t, 0, 1, 1), options(t, 1)[0], option(t, 2, 1, 1)]
    sim = simulate_step(t, 1, choice, [0] * 3, timeline=True)
    comm = [(e.kind, e.what, round(e.start_s / ms, 9), round(e.end_s / ms, 9))
            for e in sim.timeline if e.resource == "comm"]
    assert comm == [("all_gather", "x", 0, 1), ("all_gather", "y", 2, 3), ("all_gather", "y", 4, 5),
                    ("reduce_scatter", "y", 7, 8), ("all_gather", "x", 8, 9), ("reduce_scatter", "x", 11, 12),
                    ("all_reduce", "r", 12, 14)]
    assert sim.step_s == pytest.approx(15 * ms, rel=1e-12)
    assert {p: round(v.duration_s / ms, 9) for p, v in sim.phases.items()} == \
           {"forward": 4, "backward": 10, "optimizer": 1}
