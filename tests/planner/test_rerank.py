"""Re-ranking the planner's candidates by their simulated step, and its Plan fields."""
import json
from dataclasses import replace

import pytest

from osdp.models import GPTConfig
from osdp.planner.cluster import load_cluster
from osdp.planner.cost_model import PlannerSettings, build_template, evaluate
from osdp.planner.description import ModelDesc, OpDesc
from osdp.planner.device import CollectiveCost, DeviceInfo
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.plan import Plan
from osdp.planner.planner import make_plan
from osdp.planner.rerank import rerank, with_window, within
from osdp.planner.run import RunSettings
from osdp.planner.batch_sweep import Scheduled, schedule
from osdp.planner.search_problem import SearchResult
from osdp.planner.step_sim import simulate_scheduled

ms = 1e-3
MB = 1e6
TINY = GPTConfig(vocab_size=256, seq_len=32, num_layers=3, hidden=64, heads=4)
# as in test_step_sim: three 1 MB units (gather = reduction = 1 ms at world size 2),
# forward 1 ms, backward 2 ms, optimizer 1 ms
THREE = ModelDesc("three", tuple(OpDesc(f"l{i}", "linear", 250_000, 10**6, 0.0, 1e9, False) for i in range(3)))
THREE_DEVICE = DeviceInfo(
    name="hand", world_size=2, memory_limit_bytes=1e12,
    all_gather=CollectiveCost(0.0, 2e-9), reduce_scatter=CollectiveCost(0.0, 2e-9),
    flops_per_s=1e12, op_overhead_s=0.0, slice_overhead_s=0.0,
    memory_bandwidth_bytes_per_s=1.8e10, constant_bytes=0,
)


def option(t, i, g, k):
    return next(o for o in range(t.opt_begin[i, 0], t.opt_end[i, 0]) if t.opt_slices[o] == g and t.opt_zdp[o] == k)


def test_configurations_never_widen_the_users_settings():
    osdp_none = PlannerSettings()
    assert within(osdp_none, dict(policy="zdp", checkpointing="none"))
    assert within(osdp_none, dict(policy="dp", checkpointing="none"))
    assert not within(osdp_none, dict(policy="zdp", checkpointing="all"))  # the user said no checkpointing
    assert within(osdp_none, dict(max_slices=1))
    auto = PlannerSettings(checkpointing="auto")
    assert within(auto, dict(policy="zdp", checkpointing="all"))
    assert within(auto, dict(policy="zdp", checkpointing="none"))
    zdp = PlannerSettings(policy="zdp", checkpointing="all")
    assert not within(zdp, dict(policy="dp", checkpointing="all"))
    assert not within(zdp, dict(policy="zdp", checkpointing="none"))
    assert not within(PlannerSettings(max_slices=1), dict(max_slices=2))


def _all_dp_in_a_two_unit_window(settings, dev, fits):
    """All dp on THREE with a 2 MB window (the search's template has 1 MB), as if a
    baseline sweep had found it, with its memory verdict forced to ``fits``."""
    t = build_template(THREE, dev, settings.with_(prefetch_bytes=2 * MB))
    choice = [option(t, i, 1, 0) for i in range(3)]
    estimate = replace(evaluate(t, 1, choice, [0] * 3), fits=fits)
    result = SearchResult(True, estimate.step_s, estimate.peak_bytes, estimate.peak_op, tuple(choice), (0, 0, 0))
    return Scheduled(t, 1, result, estimate, 1, 0.0)


@pytest.mark.parametrize("fits", [False, True])
def test_the_fastest_simulated_candidate_that_fits_is_picked(fits):
    """THREE (1 MB units, gather = reduction = 1 ms, F 1, B 2, optimizer 1), batch 1,
    window 1 MB. Cost model: two copies never fit the window, so every op is serial:
    dp 1+1+2+1 = 5 per op, zdp 6: the search picks all dp (cost model 16 ms).
    Simulated (test_step_sim): all dp 14 ms, all zdp ("fsdp") 19 ms. A candidate all-dp
    plan with a 2 MB window simulates at 12 ms: forward AG l0 [0,1], AG l1 [1,2], F l0
    [1,2], AG l2 [2,3], F l1 [2,3], F l2 [3,4]; backward B l2 [4,6], RS [6,7], B l1
    [6,8], RS [8,9], B l0 [8,10], RS [10,11]; optimizer [11,12]. It is picked only when
    it fits; otherwise the search's plan (14) beats fsdp (19). Without rep units
    (``rep_units=()``): with its loose limit the search would replicate all three
    ([Note: rep family]), and this is about the sharded candidates."""
    dev = THREE_DEVICE
    settings = PlannerSettings(prefetch_bytes=MB, rep_units=())
    best = schedule(THREE, dev, settings, batch=1, backend="python")
    assert [best.template.opt_zdp[o] for o in best.result.option_index] == [0, 0, 0]
    assert best.result.time_s == pytest.approx(16 * ms)
    wide = _all_dp_in_a_two_unit_window(settings, dev, fits)
    ranked = rerank(THREE, dev, settings, best, batch=1, backend="python", known={"shard_grad_op": wide})
    sims = {c.name: round(c.sim.step_s / ms, 9) for c in ranked.candidates}
    # osdp_unsplit (max_slices=1) finds the same all-dp plan as the search: simulated once
    assert sims == {"search": 14, "fsdp": 19, "shard_grad_op": 12}
    assert ranked.picked.name == ("shard_grad_op" if fits else "search")
    report = ranked.report()
    assert report["picked"] == ranked.picked.name
    assert [c["name"] for c in report["candidates"]] == ["search", "fsdp", "shard_grad_op"]


# THREE's ops splittable (in 2 slices at most), a slice costing 5 ms more: the rule's
# window (cost_model.prefetch_window) is sized for 0.5 MB slices, 1 MB, while no plan
# worth having splits
SPLITTABLE = ModelDesc("three", tuple(replace(op, splittable=True, in_features=500) for op in THREE.ops))


def _zdp_zdp_dp(dev, settings=PlannerSettings(rep_units=(), max_slices=2)):
    """l0 and l1 zdp, l2 dp, whole, batch 1, under the rule's window (1 MB): as if the
    search had found it."""
    t = build_template(SPLITTABLE, dev, settings)
    assert t.window_bytes == MB
    choice = [option(t, 0, 1, 1), option(t, 1, 1, 1), option(t, 2, 1, 0)]
    estimate = evaluate(t, 1, choice, [0] * 3)
    result = SearchResult(True, estimate.step_s, estimate.peak_bytes, estimate.peak_op, tuple(choice), (0, 0, 0))
    return settings, Scheduled(t, 1, result, estimate, 1, 0.0)


def test_a_wider_window_prices_the_same_assignment_under_it():
    """``with_window`` keeps every op's slices and modes, the batch and the variants, and
    prices them as a template built with that window does. Simulated at 2 MB (two
    copies fit): forward AG l0 [0,1], AG l1 [1,2], F l0 [1,2], AG l2 [2,3], F l1 [2,3],
    F l2 [3,4]; backward B l2 [4,6] while the zdp l1 and l0 are gathered again (AG l1
    [4,5], AG l0 [5,6]), RS l2 [6,7], B l1 [6,8], RS l1 [8,9], B l0 [8,10], RS l0
    [10,11]; optimizer [11,12]: 12 ms. Under 1 MB no gather runs beside compute's use
    of another gathered unit, so it is slower."""
    dev = replace(THREE_DEVICE, memory_limit_bytes=40 * MB, slice_overhead_s=5 * ms)
    settings, narrow = _zdp_zdp_dp(dev)
    wide = with_window(narrow, 2 * MB)
    t = wide.template
    assert t.window_bytes == 2 * MB
    shapes = [(int(t.opt_slices[o]), int(t.opt_zdp[o])) for o in wide.result.option_index]
    assert shapes == [(1, 1), (1, 1), (1, 0)] and wide.batch == 1 and wide.result.variant == (0, 0, 0)
    built = build_template(SPLITTABLE, dev, settings.with_(prefetch_bytes=2 * MB))
    direct = evaluate(built, 1, [option(built, 0, 1, 1), option(built, 1, 1, 1), option(built, 2, 1, 0)], [0] * 3)
    assert wide.estimate == direct and wide.result.time_s == pytest.approx(direct.step_s, rel=1e-12)
    assert simulate_scheduled(wide).step_s == pytest.approx(12 * ms, rel=1e-9)
    assert simulate_scheduled(narrow).step_s > 12 * ms


@pytest.mark.parametrize("fits", [True, False])
def test_each_candidate_is_priced_under_its_wider_window_and_kept_only_if_it_fits(fits):
    """[Note: window choice]: the search's plan (zdp, zdp, dp under the rule's 1 MB
    window) is also priced under twice its widest slice, 2 MB, where it simulates at
    12 ms (test above). With the memory limit between the two windows' exact peaks it
    is a candidate that does not fit, and another is picked; a window the user gave is
    never widened."""
    dev = replace(THREE_DEVICE, memory_limit_bytes=40 * MB, slice_overhead_s=5 * ms)
    _, probe = _zdp_zdp_dp(dev)
    narrow_peak, wide_peak = probe.estimate.peak_bytes, with_window(probe, 2 * MB).estimate.peak_bytes
    assert narrow_peak < wide_peak
    if not fits:  # the rule's window stays 1 MB under this limit (its slices only get finer)
        dev = replace(dev, memory_limit_bytes=(narrow_peak + wide_peak) / 2)
    settings, best = _zdp_zdp_dp(dev)
    ranked = rerank(SPLITTABLE, dev, settings, best, batch=1, backend="python")
    rows = {c.name: c for c in ranked.candidates}
    wide = rows["search+window"]
    assert wide.scheduled.template.window_bytes == 2 * MB and wide.fits == fits
    assert wide.sim.step_s == pytest.approx(12 * ms, rel=1e-9)
    # the fastest that fits, ties keeping the earlier
    fastest = min(c.sim.step_s for c in ranked.candidates if c.fits)
    assert ranked.picked is next(c for c in ranked.candidates if c.fits and c.sim.step_s == fastest)
    user_settings, user_best = _zdp_zdp_dp(dev, settings.with_(prefetch_bytes=MB))
    user = rerank(SPLITTABLE, dev, user_settings, user_best, batch=1, backend="python")
    assert [c.name for c in user.candidates if c.name.endswith("+window")] == []


def test_make_plan_reports_the_simulated_step_and_picks_the_fastest_fitting():
    desc = describe_gpt(TINY)
    cluster = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0)
    dev = cluster.for_run(RunSettings(world_size=4, memory_limit_bytes=24 * 2**20))
    settings = PlannerSettings(max_slices=4, checkpointing="auto")
    plan = make_plan(desc, dev, settings, backend="python")
    rows = plan.rerank["candidates"]
    names = [r["name"] for r in rows]
    assert names[0] == "search" and len(names) == len(set(names)) >= 2
    fitting = [r for r in rows if r["fits"]]
    top = max(r["simulated_samples_per_s"] for r in fitting)
    picked = next(r for r in rows if r["name"] == plan.rerank["picked"])
    assert picked["fits"] and picked["simulated_samples_per_s"] == top
    assert plan.batch_size == picked["batch_size"]
    assert plan.predicted.simulated_step_s == pytest.approx(picked["simulated_step_s"], rel=1e-12)
    assert plan.predicted.simulated_samples_per_s == pytest.approx(
        plan.batch_size * dev.world_size / plan.predicted.simulated_step_s, rel=1e-12)
    assert plan.predicted.peak_bytes <= dev.memory_limit_bytes
    # the baselines carry their simulated steps too
    assert all(b is None or b.simulated_step_s > 0 for b in plan.baselines.values())
    assert "simulated as the runtime schedules it" in str(plan)
    # without re-ranking: the search's own plan, nothing simulated
    plain = make_plan(desc, dev, settings.with_(rerank=False), backend="python")
    best = schedule(desc, dev, settings, backend="python")
    assert plain.batch_size == best.batch and plain.predicted.simulated_step_s is None and plain.rerank == {}
    search_row = rows[0]
    assert search_row["batch_size"] == best.batch
    assert search_row["simulated_step_s"] == pytest.approx(simulate_scheduled(best).step_s, rel=1e-12)


def test_plans_with_and_without_simulation_round_trip_and_old_files_load(tmp_path):
    desc = describe_gpt(TINY)
    cluster = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0)
    dev = cluster.for_run(RunSettings(world_size=4, memory_limit_bytes=48 * 2**20))
    plan = make_plan(desc, dev, PlannerSettings(max_slices=4), backend="python")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    # a plan file written before re-ranking existed: no simulated fields, no rerank
    data = json.loads(path.read_text())
    del data["rerank"]
    for p in [data["predicted"], *[b for b in data["baselines"].values() if b]]:
        del p["simulated_step_s"], p["simulated_samples_per_s"]
    for key in ("rerank", "rerank_batches"):
        del data["settings"][key]
    path.write_text(json.dumps(data))
    old = Plan.load(path, fingerprint=desc.fingerprint())
    assert old.predicted.simulated_step_s is None and old.rerank == {}
    assert old.plan_hash() == plan.plan_hash()
    assert "simulated" not in str(old)
