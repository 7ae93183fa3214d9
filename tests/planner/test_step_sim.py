"""The step simulator against timelines worked out by hand.

Every case uses round numbers (world size 2, so a ring collective of S bytes costs
alpha + S * beta / 2; compute = flops / 1e12 FLOP/s at batch 1, backward = 2 x forward;
the optimizer step = 2 * 2 * (sharded params + optimizer state) / bandwidth, with the
bandwidth chosen to make it 1 ms). Times below are in ms. Notation: "AG x [a,b]" is an
all-gather of unit x on the comm stream from a to b, "F x [a,b]" / "B x [a,b]" / "R x
[a,b]" forward / backward / recompute compute, "RS x" the gradient reduction, "wait"
compute stalled.
"""
import math
from types import SimpleNamespace

import pytest

from osdp.planner.cost_model import PlannerSettings, build_template, evaluate
from osdp.planner.description import BlockDesc, ModelDesc, OpDesc
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.step_sim import (
    RUNTIME_COALESCE_BYTES,
    RUNTIME_MAX_INFLIGHT_REDUCTIONS,
    simulate_step,
)

ms = 1e-3
MB = 1e6  # a 250 000-parameter fp32 unit: AG = RS = 1 ms with beta = 2e-9 s/B


def device(ag=(0.0, 2e-9), rs=(0.0, 2e-9), bandwidth=1e30, world=2):
    return DeviceInfo(
        name="hand", world_size=world, memory_limit_bytes=1e12,
        all_gather=CollectiveCost(*ag), reduce_scatter=CollectiveCost(*rs),
        flops_per_s=1e12, op_overhead_s=0.0, slice_overhead_s=0.0,
        memory_bandwidth_bytes_per_s=bandwidth, constant_bytes=0,
    )


def unit_op(name, params=250_000, flops=1e9, kind="linear", **kw):
    return OpDesc(name, kind, params, params * 4, 0.0, flops, False, **kw)


def option(t, i, g, k, variant=0):
    for o in range(t.opt_begin[i, variant], t.opt_end[i, variant]):
        if t.opt_slices[o] == g and t.opt_zdp[o] == k:
            return o
    raise AssertionError(f"op {i} has no option g={g} k={k}")


def run(desc, dev, zdp, window, slices=None, variant=None, batch=1, **kw):
    settings = kw.pop("settings", PlannerSettings())
    t = build_template(desc, dev, settings.with_(prefetch_bytes=window))
    slices = slices or [1] * len(desc.ops)
    choice = [option(t, i, g, k) for i, (g, k) in enumerate(zip(slices, zdp))]
    return simulate_step(t, batch, choice, variant or [0] * len(t.segments), **kw)


def phases_ms(sim):
    return {p: round(v.duration_s / ms, 9) for p, v in sim.phases.items()}


THREE = ModelDesc("three", tuple(unit_op(f"l{i}") for i in range(3)))
# optimizer: 3 x 125 000 shard params: 1.5 MB params + 3 MB AdamW state; 2*2*4.5e6/bw = 1 ms
THREE_BW = 1.8e10


def test_three_zdp_units_window_of_one_unit_serializes_every_gather():
    """Window 1 MB = one unit: nothing can be gathered while another unit is live.

    forward:  AG l0 [0,1] wait, F l0 [1,2], free l0, prefetch AG l1 [2,3] (issued after
              F l0), wait, F l1 [3,4], AG l2 [4,5], F l2 [5,6]              -> 6
    backward: AG l2 [6,7] (l1 does not fit beside it), B l2 [7,9], RS l2 [9,10], free,
              prefetch AG l1 [10,11] (queued behind RS l2), B l1 [11,13], RS l1
              [13,14] (RS l2 done: no stall), AG l0 [14,15], B l0 [15,17], RS l0
              [17,18], end of backward waits for it                        -> 18
    optimizer [18,19]. step 19; compute 3+6+1 = 10, comm 6 AG + 3 RS = 9, exposed 9."""
    sim = run(THREE, device(bandwidth=THREE_BW), zdp=[1, 1, 1], window=MB)
    assert sim.step_s == pytest.approx(19 * ms)
    assert sim.compute_busy_s == pytest.approx(10 * ms)
    assert sim.comm_busy_s == pytest.approx(9 * ms)
    assert sim.exposed_comm_s == pytest.approx(9 * ms)
    assert phases_ms(sim) == {"forward": 6, "backward": 12, "optimizer": 1}
    assert sim.phases["backward"].exposed_s == pytest.approx(6 * ms)
    assert (sim.all_gathers, sim.reductions) == (6, 3)


def test_three_zdp_units_window_of_two_units_overlaps_the_next_gather():
    """Window 2 MB: the next unit is gathered while this one computes.

    forward:  AG l0 [0,1], prefetch AG l1 [1,2] (issued at 0), F l0 [1,2], free l0,
              prefetch AG l2 [2,3], F l1 [2,3], F l2 [3,4]                   -> 4
    backward: AG l2 [4,5], prefetch AG l1 [5,6], B l2 [5,7], RS l2 [7,8], prefetch AG
              l0 [8,9], B l1 [7,9], RS l1 [9,10], B l0 [9,11], RS l0 [11,12] -> 12
    optimizer [12,13]. step 13; exposed: 1 (first gather) + 1 (backward's first
    gather) + 1 (last reduction) = 3."""
    sim = run(THREE, device(bandwidth=THREE_BW), zdp=[1, 1, 1], window=2 * MB)
    assert sim.step_s == pytest.approx(13 * ms)
    assert sim.exposed_comm_s == pytest.approx(3 * ms)
    assert phases_ms(sim) == {"forward": 4, "backward": 8, "optimizer": 1}
    assert (sim.all_gathers, sim.reductions) == (6, 3)


def test_dp_units_are_kept_through_backward_and_do_not_fill_the_window():
    """Window 1 MB.  All dp: one gather per unit; a kept unit is not transient, so the
    next unit is prefetched although l0 is still gathered.

    forward:  AG l0 [0,1], F l0 [1,2], l0 kept, prefetch AG l1 [2,3] (fits: kept bytes
              do not count), F l1 [3,4], AG l2 [4,5], F l2 [5,6]             -> 6
    backward: no gathers. B l2 [6,8], RS l2 [8,9], B l1 [8,10], RS l1 [10,11], B l0
              [10,12], RS l0 [12,13], end waits                              -> 13
    optimizer [13,14]: step 14, 3 all-gathers (zdp: 19 ms and 6, see above).

    Mixed zdp / dp / zdp: forward as above (6). backward: AG l2 [6,7] (l1 gathered:
    skipped; l0 does not fit beside l2), B l2 [7,9], RS l2 [9,10], free l2, prefetch
    AG l0 [10,11] (l1 kept, so transient 0), B l1 [9,11] (l1 now computing: counts),
    RS l1 [11,12], B l0 [11,13], RS l0 [13,14] -> 14; optimizer -> 15; 3 + 2 gathers."""
    dev = device(bandwidth=THREE_BW)
    dp = run(THREE, dev, zdp=[0, 0, 0], window=MB)
    assert dp.step_s == pytest.approx(14 * ms)
    assert phases_ms(dp) == {"forward": 6, "backward": 7, "optimizer": 1}
    assert (dp.all_gathers, dp.reductions) == (3, 3)
    mixed = run(THREE, dev, zdp=[1, 0, 1], window=MB)
    assert mixed.step_s == pytest.approx(15 * ms)
    assert phases_ms(mixed) == {"forward": 6, "backward": 8, "optimizer": 1}
    assert mixed.all_gathers == 5


def test_reduce_scatter_wait_stalls_compute_when_comm_bound():
    """All dp, window 2 MB, gather 1 ms, reduction 5 ms (beta 1e-8), one in flight.

    forward:  AG l0 [0,1], prefetch AG l1 [1,2], F l0 [1,2], l0 kept, prefetch AG l2
              [2,3], F l1 [2,3], F l2 [3,4]                                  -> 4
    backward: B l2 [4,6], RS l2 [6,11]; B l1 [6,8], RS l1 issued at 8 runs [11,16]
              and, being the second in flight, waits for RS l2: compute stalls
              [8,11]; B l0 [11,13], RS l0 [16,21], stall [13,16]; end of backward
              waits [16,21]                                                  -> 21
    optimizer [21,22]: step 22, compute 10, comm 3 + 15 = 18, exposed 12 (1 in
    forward, 3 + 3 + 5 in backward)."""
    sim = run(THREE, device(rs=(0.0, 1e-8), bandwidth=THREE_BW), zdp=[0, 0, 0], window=2 * MB, timeline=True)
    assert sim.step_s == pytest.approx(22 * ms)
    assert sim.compute_busy_s == pytest.approx(10 * ms)
    assert sim.comm_busy_s == pytest.approx(18 * ms)
    assert sim.exposed_comm_s == pytest.approx(12 * ms)
    assert phases_ms(sim) == {"forward": 4, "backward": 17, "optimizer": 1}
    stalls = [(round(e.start_s / ms, 9), round(e.end_s / ms, 9)) for e in sim.timeline
              if e.kind == "wait" and e.phase == "backward"]
    assert stalls == [(8, 11), (13, 16), (16, 21)]


SMALL = ModelDesc("small", tuple(unit_op(f"s{i}", params=1024, kind="layernorm") for i in range(4)))
# optimizer: 4 x 512 shard params: 8192 B params + 16384 B state; 2*2*24576/bw = 1 ms
SMALL_BW = 9.8304e7


def test_coalesced_small_units_pay_one_latency():
    """Four 4096-byte units (<= 64 KiB / 4: small), all zdp, window 1 MB; every
    collective is pure latency: 2 ms (alpha 2e-3, beta 0).

    coalesced (the runtime's 64 KiB):
    forward:  ONE AG s0+s1+s2+s3 [0,2], F s0 [2,3] .. F s3 [5,6]            -> 6
    backward: ONE AG s3+s2+s1+s0 [6,8], B s3 [8,10] .. B s0 [14,16]; the four
              gradients (16 KiB < 64 KiB) wait for the end of backward: ONE RS [16,18]
                                                                            -> 18
    optimizer [18,19]: step 19, 2 all-gathers + 1 reduction = 6 ms of comm.

    coalesce_bytes=0 (one collective per unit):
    forward:  AG s0 [0,2], prefetch s1..s3 issued at 0: [2,4] [4,6] [6,8]; F s0
              [2,3], F s1 [4,5], F s2 [6,7], F s3 [8,9]                      -> 9
    backward: AG s3 [9,11], prefetch s2 s1 s0: [11,13] [13,15] [15,17]; B s3 [11,13],
              RS s3 [17,19]; B s2 [13,15], RS s2 [19,21] waits for RS s3: stall
              [15,19]; B s1 [19,21], RS s1 [21,23]; B s0 [21,23], RS s0 [23,25];
              end waits                                                     -> 25
    optimizer [25,26]: step 26, 8 all-gathers + 4 reductions."""
    dev = device(ag=(2e-3, 0.0), rs=(2e-3, 0.0), bandwidth=SMALL_BW)
    assert RUNTIME_COALESCE_BYTES == 64 * 1024
    together = run(SMALL, dev, zdp=[1] * 4, window=MB)
    assert together.step_s == pytest.approx(19 * ms)
    assert phases_ms(together) == {"forward": 6, "backward": 12, "optimizer": 1}
    assert (together.all_gathers, together.reductions) == (2, 1)
    assert together.comm_busy_s == pytest.approx(6 * ms)
    apart = run(SMALL, dev, zdp=[1] * 4, window=MB, coalesce_bytes=0)
    assert apart.step_s == pytest.approx(26 * ms)
    assert phases_ms(apart) == {"forward": 9, "backward": 16, "optimizer": 1}
    assert (apart.all_gathers, apart.reductions) == (8, 4)


EIGHT_SMALL = ModelDesc("eight", tuple(unit_op(f"s{i}", params=1024, flops=1e3) for i in range(8)))


@pytest.mark.parametrize("window,latencies", [(1e6, 3), (8192, 15)])
def test_coalesced_small_units_share_every_level_s_latency_as_the_window_groups_them(window, latencies):
    """Eight 4096-byte units, all zdp, on 2 nodes x 2 ranks where only the inter-node
    link has latency (2 ms, no bandwidth term). The simulation plays the runtime's
    walk: an unbounded window gathers all eight together, forward and backward, and one
    reduction takes every gradient (3 latencies); an 8 KiB window leaves room for a
    second unit only beside nothing in use, so 7 gathers each way (15). The cost model
    prices each small unit a share of a collective's latency ([Note: coalesced
    latency]): it left the inter-node latency whole (48 ms, 24 latencies, either
    window) and packed groups in an unbounded window (6 ms at 8 KiB)."""
    lat = 2e-3
    dev = DeviceInfo(name="2x2", world_size=4, memory_limit_bytes=1e12, all_gather=CollectiveCost(0.0, 0.0),
                     reduce_scatter=CollectiveCost(0.0, 0.0), inter_all_gather=CollectiveCost(lat, 0.0),
                     inter_reduce_scatter=CollectiveCost(lat, 0.0), node_size=2, flops_per_s=1e12,
                     op_overhead_s=0.0, slice_overhead_s=0.0, memory_bandwidth_bytes_per_s=1e30, constant_bytes=0)
    t = build_template(EIGHT_SMALL, dev, PlannerSettings(prefetch_bytes=window))
    choice = [option(t, i, 1, 1) for i in range(8)]
    sim = simulate_step(t, 1, choice, [0] * 8)
    assert sim.all_gathers + sim.reductions == latencies
    assert sim.step_s == pytest.approx(latencies * lat, rel=1e-5)
    assert evaluate(t, 1, choice, [0] * 8).step_s == pytest.approx(latencies * lat, rel=1e-9)


BLOCK = ModelDesc("block", tuple(unit_op(f"b.{i}", block="b") for i in range(2)),
                  (BlockDesc("b", 0, 2, 0.0),))
# optimizer: 2 x 125 000 shard params: 1 MB + 2 MB; 2*2*3e6/bw = 1 ms
BLOCK_BW = 1.2e10


def test_checkpointed_block_recomputes_and_gathers_a_zdp_unit_again():
    """Block b = (b.0, b.1), both zdp, checkpointed; gather 1, F 1, B 2, RS 1.

    window 1 MB:
    forward:  AG b.0 [0,1], F b.0 [1,2], AG b.1 [2,3], F b.1 [3,4]           -> 4
    backward: pre-backward b.1: AG b.1 [4,5] (b.0 does not fit beside it); the
              recompute: AG b.0 [5,6] exposed (no prefetch in a recompute), R b.0
              [6,7], b.0 freed (it gathered it), R b.1 [7,8]; B b.1 [8,10], RS b.1
              [10,11], prefetch AG b.0 [11,12] (a second time), B b.0 [12,14], RS
              b.0 [14,15]                                                   -> 15
    optimizer [15,16]: step 16, 2 + 3 all-gathers.

    window 2 MB:
    forward:  AG b.0 [0,1], prefetch AG b.1 [1,2], F b.0 [1,2], F b.1 [2,3]  -> 3
    backward: AG b.1 [3,4] and prefetch AG b.0 [4,5] both at 3; the recompute finds
              b.0 gathered: waits [4,5], R b.0 [5,6] (kept: not gathered by it), R b.1
              [6,7]; B b.1 [7,9], RS b.1 [9,10], B b.0 [9,11], RS b.0 [11,12] -> 12
    optimizer [12,13]: step 13, 2 + 2 all-gathers.

    not checkpointed, window 2 MB: forward 3; AG b.1 [3,4], AG b.0 [4,5], B b.1 [4,6],
    RS b.1 [6,7], B b.0 [6,8], RS b.0 [8,9] -> 9; step 10."""
    dev = device(bandwidth=BLOCK_BW)
    ckpt = PlannerSettings(checkpointing="all")
    narrow = run(BLOCK, dev, zdp=[1, 1], window=MB, settings=ckpt)
    assert narrow.step_s == pytest.approx(16 * ms)
    assert phases_ms(narrow) == {"forward": 4, "backward": 11, "optimizer": 1}
    assert narrow.all_gathers == 5
    assert narrow.compute_busy_s == pytest.approx((2 + 2 + 4 + 1) * ms)
    wide = run(BLOCK, dev, zdp=[1, 1], window=2 * MB, settings=ckpt)
    assert wide.step_s == pytest.approx(13 * ms)
    assert phases_ms(wide) == {"forward": 3, "backward": 9, "optimizer": 1}
    assert wide.all_gathers == 4
    plain = run(BLOCK, dev, zdp=[1, 1], window=2 * MB)
    assert plain.step_s == pytest.approx(10 * ms)


def test_split_slices_are_units_of_their_own():
    """One 2 MB linear (500 000 params, 2e9 FLOPs): unsplit its gather takes 2 ms and two
    copies do not fit a 2 MB window; in 2 zdp slices of 1 MB (F 1, B 2, AG 1, RS 1
    each) the second slice is gathered while the first computes.

    split:    AG s0 [0,1], prefetch AG s1 [1,2], F s0 [1,2], F s1 [2,3]      -> 3
              AG s1 [3,4], prefetch AG s0 [4,5], B s1 [4,6], RS s1 [6,7], B s0 [6,8],
              RS s0 [8,9]                                                    -> 9
    unsplit:  AG [0,2], F [2,4]; AG [4,6], B [6,10], RS [10,12]             -> 12
    optimizer (250 000 shard params: 1 MB + 2 MB; 2*2*3e6/bw) 1 ms: 10 vs 13."""
    desc = ModelDesc("one", (OpDesc("w", "linear", 500_000, 2_000_000, 0.0, 2e9, True, 1000),))
    dev = device(bandwidth=1.2e10)
    split = run(desc, dev, zdp=[2], slices=[2], window=2 * MB)
    assert split.step_s == pytest.approx(10 * ms)
    assert phases_ms(split) == {"forward": 3, "backward": 6, "optimizer": 1}
    assert (split.all_gathers, split.reductions) == (4, 2)
    whole = run(desc, dev, zdp=[1], window=2 * MB)
    assert whole.step_s == pytest.approx(13 * ms)


TIED = ModelDesc("tied", (unit_op("e", kind="embedding"), OpDesc("h", "linear", 0, 0, 0.0, 1e9, False, tied_to="e")))


def test_tied_second_use_regathers_a_zdp_owner_and_reuses_a_dp_one():
    """e (1 MB, F 1, B 2) and h using e's weights (F 1, B 2); window 1 MB.

    e zdp: AG e [0,1], F e [1,2], free, prefetch AG e [2,3] for h, F h [3,4]  -> 4
           AG e [4,5], B h [5,7] (not e's last use: no reduction), free, AG e [7,8],
           B e [8,10], RS e [10,11]                                         -> 11
    e dp:  AG e [0,1], F e [1,2], F h [2,3]; B h [3,5], B e [5,7], RS e [7,8] -> 8
    optimizer (125 000 shard params: 0.5 MB + 1 MB; 2*2*1.5e6/bw) 1 ms: 12 vs 9."""
    dev = device(bandwidth=6e9)
    zdp = run(TIED, dev, zdp=[1, 1], window=MB)
    assert zdp.step_s == pytest.approx(12 * ms)
    assert (zdp.all_gathers, zdp.reductions) == (4, 1)
    dp = run(TIED, dev, zdp=[0, 1], window=MB)
    assert dp.step_s == pytest.approx(9 * ms)
    assert (dp.all_gathers, dp.reductions) == (1, 1)


ONE = ModelDesc("one", (unit_op("u"),))


def test_gradient_accumulation_and_all_reduce():
    """One dp unit (AG 1, F 1, B 2, RS 1), window 1 MB, optimizer 1 ms (bw 6e9).

    2 micro-batches, gradients reduced after the last: [AG 0-1, F 1-2, B 2-4] (freed
    after its backward), [AG 4-5, F 5-6, B 6-8, RS 8-9], optimizer 9-10     -> 10
    reduced after every micro-batch: ..., B 2-4, RS 4-5 (waited at the end of the
    first backward), AG 5-6, F 6-7, B 7-9, RS 9-10, optimizer 10-11         -> 11
    one micro-batch, all-reduce priced as RS + AG of the buffer (2 ms):
    AG 0-1, F 1-2, B 2-4, all-reduce 4-6, optimizer 6-7                     -> 7"""
    dev = device(bandwidth=6e9)
    last = run(ONE, dev, zdp=[0], window=MB, settings=PlannerSettings(accumulation_steps=2))
    assert last.step_s == pytest.approx(10 * ms)
    assert phases_ms(last) == {"forward": 4, "backward": 5, "optimizer": 1}
    assert (last.all_gathers, last.reductions) == (2, 1)
    every = run(ONE, dev, zdp=[0], window=MB,
                settings=PlannerSettings(accumulation_steps=2, gradient_sync="every"))
    assert every.step_s == pytest.approx(11 * ms)
    assert every.reductions == 2
    assert run(ONE, dev, zdp=[0], window=MB).step_s == pytest.approx(6 * ms)
    assert run(ONE, dev, zdp=[0], window=MB, all_reduce=True).step_s == pytest.approx(7 * ms)


def test_without_prefetch_all_zdp_is_the_cost_models_serial_sum():
    """A consistency check, not a hand timeline: with window 0 every collective of an
    all-zdp plan is exposed and the FIFO comm stream serializes each reduction with
    the next gather, so the simulated step is the cost model's serial sum (the same
    compute and collective functions, added up)."""
    ops = tuple(OpDesc(f"o{i}", "linear", 1000 * (i + 1), 4000 * (i + 1), 0.0, 3e7 * (i + 2), False)
                for i in range(5))
    desc = ModelDesc("uneven", ops)
    dev = device(ag=(1e-4, 3e-9), rs=(2e-4, 5e-9), bandwidth=1e9)
    t = build_template(desc, dev, PlannerSettings(prefetch_bytes=0, coalesce_bytes=0))
    choice = [option(t, i, 1, 1) for i in range(5)]
    sim = simulate_step(t, 3, choice, [0] * 5)
    assert sim.step_s == pytest.approx(evaluate(t, 3, choice, [0] * 5).step_s, rel=1e-12)
    assert sim.comm_busy_s == pytest.approx(sim.exposed_comm_s, rel=1e-12)


def test_runtime_constants_agree():
    """The simulator prices the runtime's own rules (both read osdp.contract)."""
    from osdp.runtime.options import RuntimeOptions
    from osdp.runtime.scheduler import Scheduler

    assert RUNTIME_COALESCE_BYTES == RuntimeOptions.from_args().coalesce_bytes  # the wrapper's default
    sched = Scheduler([], SimpleNamespace(world_size=2), None, 0, 0)
    assert RUNTIME_MAX_INFLIGHT_REDUCTIONS == sched.reducer.max_inflight


def test_timeline_is_consistent():
    """Compute intervals never overlap, collectives never overlap, and the busy totals
    are the sums of the intervals."""
    sim = run(SMALL, device(ag=(2e-3, 0.0), rs=(2e-3, 0.0), bandwidth=SMALL_BW), zdp=[1, 0, 1, 0],
              window=MB, coalesce_bytes=16384, timeline=True)
    for resource in ("compute", "comm"):
        spans = sorted((e.start_s, e.end_s) for e in sim.timeline if e.resource == resource)
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
    busy = sum(e.end_s - e.start_s for e in sim.timeline if e.resource == "compute" and e.kind != "wait")
    assert busy == pytest.approx(sim.compute_busy_s)
    comm = sum(e.end_s - e.start_s for e in sim.timeline if e.resource == "comm")
    assert comm == pytest.approx(sim.comm_busy_s)
    assert max(e.end_s for e in sim.timeline) == pytest.approx(sim.step_s)
    assert math.isclose(sum(p.duration_s for p in sim.phases.values()), sim.step_s)
