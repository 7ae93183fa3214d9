"""The planner's row split of embeddings, tied or not, and the vocabulary head's fused
loss: option costs against fp64 formulas worked out here from the op's sizes, one choice
for a tied pair (against enumerating every consistent plan), the paper's W&S model at
16 GiB, the event simulator's per-use backward gathers, and `osdp simulate --paper`."""
import contextlib
import math
import io
import itertools

import numpy as np
import pytest

from osdp.cli import main
from osdp.models import GPTConfig, get_preset
from osdp.planner.cluster import load_cluster
from osdp.planner.cost_model import PlannerSettings, build_template, evaluate, option_times, tied_choices
from osdp.planner.description import ModelDesc, OpDesc
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings
from osdp.planner.batch_sweep import schedule
from osdp.planner.step_sim import simulate_step

GiB = 2**30


def device(world=4, limit=1 << 30, overhead=1e-5, slice_overhead=3e-6):
    return DeviceInfo(
        name="test", world_size=world, memory_limit_bytes=limit,
        all_gather=CollectiveCost(alpha_s=1e-5, beta_s_per_byte=1e-9),
        reduce_scatter=CollectiveCost(alpha_s=2e-5, beta_s_per_byte=2e-9),
        flops_per_s=1e12, op_overhead_s=overhead, slice_overhead_s=slice_overhead,
        memory_bandwidth_bytes_per_s=1e11, constant_bytes=0,
    )


def ring(alpha, beta, nbytes, n):
    return (n - 1) * alpha + (n - 1) / n * nbytes * beta


def rows_of(t, i, variant=0):
    return [(int(t.opt_slices[o]), int(t.opt_zdp[o]), o) for o in range(t.opt_begin[i, variant], t.opt_end[i, variant])]


V, H, SEQ = 1000, 64, 16  # a tiny vocabulary table: 256 000 bytes in fp32


def embedding_op(name="emb", **kw):
    return OpDesc(name, "embedding", V * H, V * H * 4, SEQ * 8.0, 0.0, True, V,
                  act_grad_bytes_per_sample=SEQ * H * 4.0, split_op="embedding_rows", **kw)


@pytest.mark.parametrize("g", [2, 4, 16])
def test_row_split_embedding_option_is_priced_by_its_declaration(g):
    """A row-split embedding reads no weights in backward (its declaration): each of its
    g slices is gathered once in forward and freed after it in either mode (one option
    per g), and every slice's gradient is reduce-scattered; two slices' gradients live,
    and the g slices' reduce-scatter outputs."""
    desc = ModelDesc("emb", (embedding_op(),))
    n, window, b = 4, 1e12, 3
    # fused AdamW (no step temporaries): the optimizer step's moment stays below the
    # op's backward, which is what this test prices by hand
    t = build_template(desc, device(world=n), PlannerSettings(prefetch_bytes=window, optimizer_temporaries="none"))
    options = rows_of(t, 0)
    assert [(gg, k) for gg, k, _ in options if gg == g] == [(g, g)]
    o = next(o for gg, _, o in options if gg == g)
    P = float(V * H * 4)  # fp64 from here on
    s = P / g
    ag, rs = ring(1e-5, 1e-9, s, n), ring(2e-5, 2e-9, s, n)
    assert t.opt_held_bytes[o] == 0.0
    assert t.opt_comm_f_s[o] == pytest.approx(g * ag, rel=1e-12)
    assert t.opt_gather_b_s[o] == 0.0
    assert t.opt_reduce_b_s[o] == pytest.approx(g * rs, rel=1e-12)
    # forward: its slice and, the window being huge, its later slices prefetched (whole
    # units of their own): P at its first; backward: no gather, 2 grad slices and its g
    # slices' reduce-scatter outputs ([Note: pending reduction])
    out = math.ceil(V * H / g / n) * 4
    assert t.opt_transient_bytes[o] == pytest.approx(max(P, 2 * s + g * out), rel=1e-12)
    # no FLOPs: compute is the op overhead (backward 2x) and the extra slices' launches
    fwd = 1e-5 + (g - 1) * 3e-6
    bwd = 2e-5 + (g - 1) * 3e-6
    want_s = max(fwd, g * ag) + max(bwd, g * rs)
    assert option_times(t, b)[o] == pytest.approx(want_s, rel=1e-12)
    # the exact memory of that plan: shards (params, AdamW) + slice buffers + saved ids
    # + its backward transients, at its backward (its slices' sharded grads included)
    est = evaluate(t, b, [o], [0])
    shard = np.ceil(V * H / n)
    want_peak = shard * 4 + shard * 8 + max(P, 2 * s + g * out) + b * SEQ * 8.0 + b * SEQ * H * 4.0 + 8.0  # loss
    assert est.peak_bytes == pytest.approx(want_peak, rel=1e-12)


def test_unsplit_embedding_keeps_both_modes_and_its_backward_gather():
    desc = ModelDesc("emb", (embedding_op(),))
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12))
    by_gk = {(g, k): o for g, k, o in rows_of(t, 0)}
    P = float(V * H * 4)
    assert t.opt_held_bytes[by_gk[1, 0]] == P  # dp: kept for its backward
    assert t.opt_gather_b_s[by_gk[1, 1]] == pytest.approx(ring(1e-5, 1e-9, P, 4), rel=1e-12)


def test_fused_loss_head_drops_the_logits_when_split_along_the_vocabulary():
    """The GPT head (last op) declares L = s V e logits bytes. Unsplit it saves L, and
    the loss's backward holds 3 L before the head's backward starts (which then holds L
    of logits gradient beside its own gathers and buffers); split in g it saves none and
    holds 2 L / g inside its own backward."""
    cfg = GPTConfig(vocab_size=V, seq_len=SEQ, num_layers=1, hidden=H, heads=4)
    desc = describe_gpt(cfg)
    head = len(desc.ops) - 1
    L = float(SEQ * V * 4)
    op = desc.ops[head]
    assert op.name == "lm_head" and op.split_op == "linear_out_features" and op.in_features == V
    assert op.logits_bytes_per_sample == L
    t = build_template(desc, device(), PlannerSettings(prefetch_bytes=1e12))
    b = 5
    problem = t.problem(b)
    base_act = op.act_bytes_per_sample - L  # input + ids stay
    base_grad = op.act_grad_bytes_per_sample - 2 * L
    assert t.act_per_sample[head] == pytest.approx(base_act, rel=1e-12)
    for g, k, o in rows_of(t, head):
        if g == 1:
            want = max(t.opt_transient_bytes[o] + (base_grad + L) * b, 3 * L * b)
        else:
            want = t.opt_transient_bytes[o] + (base_grad + 2 * L / g) * b
        assert problem.opt_local_bytes[o] == pytest.approx(want, rel=1e-12), (g, k)


def tied_gpt(**kw):
    return GPTConfig(**{**dict(vocab_size=4096, seq_len=32, num_layers=2, hidden=256, heads=4,
                               tie_embeddings=True), **kw})


TIED3 = ModelDesc("tied3", (
    embedding_op("emb"),
    OpDesc("mid", "linear", H * H, H * H * 4, SEQ * H * 4.0, 2.0 * SEQ * H * H, True, H,
           act_grad_bytes_per_sample=2 * SEQ * H * 4.0, split_op="linear_in_features"),
    OpDesc("head", "linear", 0, 0, SEQ * H * 4.0 + SEQ * V * 4.0, 2.0 * SEQ * H * V, True, V, tied_to="emb",
           act_grad_bytes_per_sample=2 * SEQ * V * 4.0, split_op="linear_out_features",
           logits_bytes_per_sample=SEQ * V * 4.0),
))


@pytest.mark.parametrize("limit_mib", [0.6, 0.7, 0.85, 0.95, 1.1])
def test_tied_pair_gets_one_choice_and_the_best_consistent_one(limit_mib):
    """Every plan where emb and its tied head share (g, k), enumerated and priced by
    evaluate, against what the scheduler returns at that batch: the same least step
    time (up to the search's conservative rounding), and the plan itself consistent."""
    dev = device(world=4, limit=limit_mib * 2**20)
    settings = PlannerSettings(max_slices=4, prefetch_bytes=64 * 1024)
    b = 2
    got = schedule(TIED3, dev, settings, batch=b)
    t = got.template
    o_w, o_h = got.result.option_index[0], got.result.option_index[2]
    assert (t.opt_slices[o_w], t.opt_zdp[o_w]) == (t.opt_slices[o_h], t.opt_zdp[o_h])
    full = build_template(TIED3, dev, settings)
    assert len(tied_choices(full)) > 1
    best = np.inf
    for choice in itertools.product(*(rows_of(full, i) for i in range(3))):
        if choice[0][:2] != choice[2][:2]:
            continue
        # as the search counts (the window's bound): its optimum is exact in that count
        est = evaluate(full, b, [o for _, _, o in choice], [0] * len(full.segments), exact=False)
        if est.fits:
            best = min(best, est.step_s)
    assert got.estimate.fits
    assert got.estimate.step_s >= best * (1 - 1e-12)
    assert got.estimate.step_s == pytest.approx(best, rel=1e-3)


def test_tied_plan_splits_both_uses_and_the_simulator_gathers_the_embedding_in_forward_only():
    desc = describe_gpt(tied_gpt())
    dev = device(world=4, limit=40 * 2**20)
    plan = make_plan(desc, dev, PlannerSettings(max_slices=8))
    wte = next(u for u in plan.units if u.name == "wte")
    assert len(wte.modes) > 1 and wte.split_op == "embedding_rows"
    assert "lm_head" not in {u.name for u in plan.units}  # the head uses wte's slices


def test_untied_split_embedding_is_gathered_in_forward_only_by_the_simulator():
    desc = ModelDesc("emb", (embedding_op(),))
    dev = device(world=2)
    t = build_template(desc, dev, PlannerSettings(prefetch_bytes=1e12))
    o = next(o for g, _, o in rows_of(t, 0) if g == 4)
    sim = simulate_step(t, 1, [o], [0])
    assert (sim.all_gathers, sim.reductions) == (4, 4)
    o1 = next(o for g, k, o in rows_of(t, 0) if (g, k) == (1, 1))
    assert simulate_step(t, 1, [o1], [0]).all_gathers == 2  # unsplit zdp: forward and backward


def test_tied_split_pair_in_the_simulator_reduces_each_slice_once_after_the_embedding():
    desc = describe_gpt(tied_gpt(num_layers=1))
    dev = device(world=2)
    t = [s for s in tied_choices(build_template(desc, dev, PlannerSettings(max_slices=4, prefetch_bytes=1e12)))
         if 4 in set(s.opt_slices[s.opt_op == 0])][0]
    head = len(desc.ops) - 1
    choice = []
    for i in range(len(desc.ops)):
        rows = rows_of(t, i)
        if i in (0, head):
            choice.append(next(o for g, k, o in rows if (g, k) == (4, 4)))
        else:
            choice.append(rows[0][2])
    sim = simulate_step(t, 1, choice, [0] * len(t.segments), timeline=True)
    reduced = [e.what for e in sim.timeline if e.kind in ("reduce_scatter", "all_reduce")]
    wte_reductions = [w for w in reduced if "wte[" in w]
    assert len(wte_reductions) == 4  # once per slice, after both uses' gradients are in
    gathers = [e for e in sim.timeline if e.kind == "all_gather" and "wte[" in e.what]
    # forward: 4 for the embedding + 4 for the head; backward: the head's 4 zdp slices
    assert sum(e.what.count("wte[") for e in gathers) == 12


def test_ws_2x12288_fits_16_gib_with_its_embedding_and_head_split():
    desc = describe_gpt(get_preset("ws-2x12288"), name="ws-2x12288")
    dev = load_cluster().for_run(RunSettings(world_size=8, memory_limit_bytes=16 * GiB))
    plan = make_plan(desc, dev, PlannerSettings(max_slices=16))
    assert plan.predicted.peak_bytes <= 16 * GiB
    units = {u.name: u for u in plan.units}
    assert len(units["wte"].modes) > 1 and len(units["lm_head"].modes) > 1
    assert units["lm_head"].split_op == "linear_out_features"


def test_paper_presets_are_untied_like_mingpt():
    from osdp.cli.simulate import FAMILIES

    for presets in FAMILIES.values():
        for name in presets:
            assert not get_preset(name).tie_embeddings, name


@pytest.mark.slow  # the paper's whole grid, about 17 s; W&S 2x12288 at 16 GiB is checked above
def test_simulate_paper_prints_every_cell_and_every_16g_model_gets_a_plan():
    from osdp.cli.simulate import FAMILIES, LIMITS_GIB

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["simulate", "--paper"]) == 0
    text = out.getvalue()
    for family, presets in FAMILIES.items():
        for name in presets:
            for gib in LIMITS_GIB:
                row = [line for line in text.splitlines() if line.split()[:3] == [family, name, str(gib)]]
                assert len(row) == 1, (name, gib)
                assert row[0].count("x)") + row[0].count("(-)") == 4  # the paper's figure beside each
    assert "every model at 16G gets an OSDP+split plan" in text
    # a cell more than 10% off carries computed reasons
    notes = text.split("and why (computed from the cell):")[1]
    assert "ws-2x12288 16G OSDP+split" in notes and "FSDP does not fit" in notes
