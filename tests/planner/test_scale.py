"""Planning across nodes (issue 12): two-level collectives, the hpz mode, the HSDP
layout, the Llama description and ``osdp simulate --scale``."""
from __future__ import annotations

import math

import pytest

from osdp.cli import main
from osdp.errors import OSDPError
from osdp.planner.collective_cost import Collectives
from osdp.planner.cost_model import PlannerSettings, build_template, evaluate
from osdp.planner.description import ModelDesc, OpDesc
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.llama_desc import LlamaConfig, describe_llama, llama_preset
from osdp.planner.batch_sweep import schedule

MiB = 2**20
GiB = 2**30

# intra: 8 us + 1/200 GB/s per byte; inter: 20 us + 1/5 GB/s (all-gather), other numbers
# for the reduce-scatters so a mix-up of the two shows
AG_A, AG_E = CollectiveCost(8e-6, 5e-12), CollectiveCost(20e-6, 2e-10)
RS_A, RS_E = CollectiveCost(9e-6, 6e-12), CollectiveCost(30e-6, 3e-10)


def _device(world=32, node=8, limit=64 * GiB, inter=True, flops=1e14):
    return DeviceInfo(name="two-level", world_size=world, memory_limit_bytes=limit, all_gather=AG_A,
                      reduce_scatter=RS_A, flops_per_s=flops, node_size=node,
                      inter_all_gather=AG_E if inter else None, inter_reduce_scatter=RS_E if inter else None)


# ---- [Note: two-level collective cost], by hand in fp64 -----------------------------------
def test_two_level_gather_and_reduce_scatter_by_hand():
    S = 96 * MiB
    n, m = 4, 8  # 32 ranks
    c = Collectives(_device(world=32), "full")
    # across: 4-rank ring over the rail, each rank's rail carries S/8
    across = 3 * 20e-6 + 3 / 4 * (S / 8) * 2e-10
    within = 7 * 8e-6 + 7 / 8 * S * 5e-12
    assert c.gather_s(S) == pytest.approx(across + within, rel=1e-12)
    across_rs = 3 * 30e-6 + 3 / 4 * (S / 8) * 3e-10
    within_rs = 7 * 9e-6 + 7 / 8 * S * 6e-12
    assert c.grad_s(S) == pytest.approx(across_rs + within_rs, rel=1e-12)
    assert c.node_gather_s(S) == pytest.approx(within, rel=1e-12)
    assert (c.shard_ranks, c.nodes, c.per_node) == (32, n, m)


def test_hsdp_gathers_within_the_node_and_all_reduces_the_shard_across_replicas():
    S = 96 * MiB
    c = Collectives(_device(world=32), "hsdp")
    assert c.gather_s(S) == pytest.approx(7 * 8e-6 + 7 / 8 * S * 5e-12, rel=1e-12)
    rs_within = 7 * 9e-6 + 7 / 8 * S * 6e-12
    piece = S / 8  # each rank all-reduces its 1/8 with the 3 other replicas: RS + AG ring
    all_reduce = (3 * 30e-6 + 3 / 4 * piece * 3e-10) + (3 * 20e-6 + 3 / 4 * piece * 2e-10)
    assert c.grad_s(S) == pytest.approx(rs_within + all_reduce, rel=1e-12)
    assert c.shard_ranks == 8


def test_one_node_and_flat_profiles_keep_the_flat_ring():
    S = 10 * MiB
    one_node = Collectives(_device(world=8), "full")
    assert one_node.gather_s(S) == pytest.approx(7 * 8e-6 + 7 / 8 * S * 5e-12, rel=1e-12)
    assert not one_node.hpz_available
    flat = Collectives(_device(world=32, inter=False), "full")  # no inter link: one flat network
    assert flat.gather_s(S) == pytest.approx(31 * 8e-6 + 31 / 32 * S * 5e-12, rel=1e-12)
    with pytest.raises(OSDPError, match="world_size 12 is not a whole number of nodes of 8 ranks"):
        Collectives(_device(world=12), "full")


def test_the_shipped_h100_profile_reproduces_the_public_256_gpu_all_gather():
    # NVIDIA/nccl issue 1218: all_gather_perf, 32 nodes x 8 H100, 8x400 Gb/s, 2 GiB: ~200 GB/s busbw
    from osdp.planner.cluster import load_cluster
    from osdp.planner.run import RunSettings

    c = Collectives(load_cluster("h100-ib-ndr").for_run(RunSettings(world_size=256)))
    S = 2 * GiB
    busbw = 255 / 256 * S / c.gather_s(S)
    assert 170e9 < busbw < 230e9


# ---- [Note: hpz mode]: one op's option row by hand ----------------------------------------
def _linear(name, params, flops=1e6):
    return OpDesc(name, "linear", params, params * 4, 1024.0, flops, False)


def test_hpz_option_memory_and_time_by_hand():
    P = 64 * MiB  # bytes of the one op (fp32)
    desc = ModelDesc("one", (_linear("fc", P // 4),))
    device = _device(world=32)
    t = build_template(desc, device, PlannerSettings(max_slices=1, rerank=False))
    rows = {(int(t.opt_zdp[o]), int(t.opt_hpz[o])): o for o in range(len(t.opt_op))}
    assert set(rows) == {(0, 0), (1, 0), (0, 1)}  # dp, zdp, hpz
    o = rows[(0, 1)]
    ag2 = (3 * 20e-6 + 3 / 4 * (P / 8) * 2e-10) + (7 * 8e-6 + 7 / 8 * P * 5e-12)
    ag_node = 7 * 8e-6 + 7 / 8 * P * 5e-12
    rs2 = (3 * 30e-6 + 3 / 4 * (P / 8) * 3e-10) + (7 * 9e-6 + 7 / 8 * P * 6e-12)
    assert t.opt_held_bytes[o] == pytest.approx(P / 8)  # the copy sharded within the node
    assert t.opt_comm_f_s[o] == pytest.approx(ag2, rel=1e-12)
    assert t.opt_gather_b_s[o] == pytest.approx(ag_node, rel=1e-12)
    assert t.opt_reduce_b_s[o] == pytest.approx(rs2, rel=1e-12)
    # zdp gathers again over all 32 ranks; dp keeps P
    assert t.opt_gather_b_s[rows[(1, 0)]] == pytest.approx(ag2, rel=1e-12)
    assert (t.opt_held_bytes[rows[(1, 0)]], t.opt_held_bytes[rows[(0, 0)]]) == (0.0, P)
    # within one node hpz is zdp: not offered
    one = build_template(desc, _device(world=8), PlannerSettings(max_slices=1, rerank=False))
    assert int(one.opt_hpz.sum()) == 0


# ---- the planner chooses hpz or dp (constructed cases) ------------------------------------
def _modes(s):
    t = s.template
    return [("zdp", "hpz", "dp")[0 if t.opt_zdp[o] else 1 if t.opt_hpz[o] else 2] for o in s.result.option_index]


def test_planner_picks_hpz_when_the_network_is_slow_and_memory_moderate_and_dp_when_plentiful():
    P = 256 * MiB
    desc = ModelDesc("four", tuple(_linear(f"fc{i}", P // 4) for i in range(4)))
    settings = PlannerSettings(max_slices=1, rerank=False, prefetch_bytes=2 * P)
    plenty = schedule(desc, _device(world=32, limit=64 * GiB), settings, batch=1)
    assert _modes(plenty) == ["dp"] * 4  # dp: one gather per step, no re-gather at all
    # the limit: all-hpz's peak plus a quarter of one op, so one more dp unit (7/8 P more)
    # cannot fit where the peak is: fc2's backward, beside fc3's gradient still reducing
    # ([Note: pending reduction]). fc3 runs backward first and frees its weights before
    # that, so it alone can be dp
    t = build_template(desc, _device(world=32, limit=64 * GiB), settings)
    hpz = [next(o for o in range(t.opt_begin[i, 0], t.opt_end[i, 0]) if t.opt_hpz[o]) for i in range(4)]
    peak = evaluate(t, 1, hpz, [0] * len(t.segments)).peak_bytes
    moderate = schedule(desc, _device(world=32, limit=peak + P / 4), settings, batch=1)
    assert _modes(moderate) == ["hpz"] * 3 + ["dp"]
    assert evaluate(moderate.template, 1, moderate.result.option_index, moderate.result.variant).peak_op == "fc2"
    # the same memory with a fast inter-node link: zdp's second gather is cheap, and one
    # unit can be dp where hpz copies left room (the choice follows the bandwidth)
    fast = DeviceInfo(**{**_device(world=32, limit=peak + P / 4).__dict__,
                         "inter_all_gather": AG_A, "inter_reduce_scatter": RS_A})
    assert schedule(desc, fast, settings, batch=1).result.time_s < moderate.result.time_s


def test_layout_auto_keeps_the_faster_layout_and_hsdp_shards_within_the_node():
    P = 256 * MiB
    desc = ModelDesc("four", tuple(_linear(f"fc{i}", P // 4) for i in range(4)))
    device = _device(world=32, limit=64 * GiB)
    runs = {layout: schedule(desc, device, PlannerSettings(max_slices=1, rerank=False, layout=layout), batch=1)
            for layout in ("full", "hsdp", "auto")}
    assert runs["auto"].result.time_s == min(runs["full"].result.time_s, runs["hsdp"].result.time_s)
    # HSDP: parameters and optimizer state sharded over the node's 8 ranks, not 32
    static = runs["hsdp"].template.static
    assert static["sharded_params"] == pytest.approx(4 * P / 8)
    assert runs["full"].template.static["sharded_params"] == pytest.approx(4 * P / 32)


# ---- the Llama description --------------------------------------------------------------
def _llama_params(V, h, L, a, c, f):
    d = h // a
    return 2 * V * h + L * (2 * h * h + 2 * h * c * d + 3 * h * f + 2 * h) + h


@pytest.mark.parametrize("name, shape, published", [
    ("llama2-7b", (32000, 4096, 32, 32, 32, 11008), 6.74e9),
    ("llama2-13b", (32000, 5120, 40, 40, 40, 13824), 13.0e9),
    ("llama2-70b", (32000, 8192, 80, 64, 8, 28672), 69.0e9),
])
def test_llama_parameter_counts_match_the_published_totals(name, shape, published):
    by_hand = _llama_params(*shape)
    assert round(by_hand / 1e9, 2 if published < 1e10 else 1) == published / 1e9
    assert describe_llama(llama_preset(name)).param_count == by_hand
    V, h, L, a, c, f = shape
    assert by_hand == {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320,
                       "llama2-70b": 68_976_648_192}[name]


def test_llama_activation_bytes_are_linear_in_seq_and_tied_head_has_no_own_weights():
    def act(seq):
        return sum(op.act_bytes_per_sample for op in describe_llama(llama_preset("llama2-70b", seq)).ops)

    a1, a2, a4, a8 = act(1024), act(2048), act(4096), act(8192)
    assert a4 - a2 == pytest.approx(2 * (a2 - a1), rel=1e-12)  # f(s) = alpha s: no s^2 term
    assert a8 == pytest.approx(8 * a1, rel=1e-12)
    # one layer by hand ([Note: Llama activations]), e = 4 bytes
    s, h, f, a, cd, e = 4096, 8192, 28672, 64, 8 * 128, 4
    layer = [op for op in describe_llama(llama_preset("llama2-70b", s)).ops if op.block == "model.layers.3"]
    assert sum(op.act_bytes_per_sample for op in layer) == (6 * s * h + 2 * s * cd + 4 * s * f) * e + (a + 2) * s * 4
    tied = describe_llama(LlamaConfig(vocab_size=1000, hidden=64, intermediate=176, num_layers=2, heads=4,
                                      kv_heads=2, seq_len=32, tie_embeddings=True))
    head = tied.ops[-1]
    assert (head.name, head.tied_to, head.param_count) == ("lm_head", "model.embed_tokens", 0)


# ---- osdp simulate --scale ---------------------------------------------------------------
def test_simulate_scale_small_grid_has_every_peer_and_osdp_is_never_below_them(tmp_path, capsys):
    from osdp.cli.scale import OSDP, PEERS, simulate_scale

    rows = simulate_scale(profiles=("pcie-100gbe",), models=("llama2-7b",), worlds=(16,))
    (_, _, _, runs), = rows
    assert set(runs) == {OSDP, *PEERS}
    # OSDP's search space holds every peer's fixed plan (zdp or hpz everywhere, either layout)
    for name in PEERS:
        assert runs[OSDP].samples_per_s_per_gpu >= runs[name].samples_per_s_per_gpu * (1 - 1e-9)
        assert math.isclose(runs[name].tokens_per_s_per_gpu, runs[name].samples_per_s_per_gpu * 4096)

    assert main(["simulate", "--scale", "--scale-clusters", "pcie-100gbe", "--scale-models", "llama2-7b",
                 "--scale-worlds", "16", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "scale_pcie-100gbe.txt").read_text()
    for name in (OSDP, *PEERS):
        assert name in table
    assert "llama2-7b" in table and " vs " not in table.splitlines()[0]
    assert (tmp_path / "scale_pcie-100gbe.svg").read_text().startswith("<svg")
    assert "beats" in table or "ties" in table
