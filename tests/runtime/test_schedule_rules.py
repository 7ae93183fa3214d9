"""The runtime's scheduling decisions and the planner's step simulation are the same
decisions (issue 34): ``osdp/schedule_rules.py`` writes them once and both call it.

- replay: a real ``osdp.models.GPT`` wrapped on a fake process group of 8 (or 16)
  ranks (``torch.testing._internal.distributed.fake_pg``: real compute, collectives that
  move no data) records, in a steady step (the use order recorded), every gather with
  its riders, every gradient reduction (alone or a coalesced group) and every
  replicated bucket, in issue order; the same plan through ``step_sim.simulate_step``
  (its timeline) must issue the very same collectives in the same order.
- unit tests of the pure rules.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import osdp
from osdp import schedule_rules as rules
from osdp.contract import DEFAULT_COALESCE_BYTES
from osdp.models import GPT, example_batch, get_preset
from osdp.planner import make_plan, step_sim
from osdp.planner.calibration import assignment_of
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
from osdp.planner.cost_model import PlannerSettings
from osdp.planner.description import describe
from osdp.planner.run import RunSettings
from osdp.planner.uniform_plan import uniform_plan

MiB = 1 << 20


def _runtime_collectives(wrapped, config, batch, steps=3):
    """(kind, unit names) of every collective the last of ``steps`` training steps
    issued: "gather" (a unit and its riders, one collective), "reduce" (a reduce-scatter,
    alone or coalesced), "bucket" (a replicated bucket's all-reduce), in issue order."""
    s = wrapped._scheduler
    log: list = []
    gather, issue, bucket = s.lifecycle._gather, s.reducer._issue, s.reducer._issue_bucket

    def spy_gather(units, level, source):
        if units:
            log.append(("gather", tuple(u.name for u in units)))
        return gather(units, level, source)

    def spy_issue(units, dtype):
        log.append(("reduce", tuple(u.name for u in units)))
        return issue(units, dtype)

    def spy_bucket(key):
        log.append(("bucket", tuple(u.name for u in s.reducer._buckets[key])))
        return bucket(key)

    s.lifecycle._gather, s.reducer._issue, s.reducer._issue_bucket = spy_gather, spy_issue, spy_bucket
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    for seed in range(steps):  # from the second step on, the order is recorded (riders)
        log.clear()
        idx, targets = example_batch(config, batch, seed=seed)
        wrapped(idx, targets).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return log


def _simulated_collectives(desc, device, plan, coalesce_bytes):
    """The same list from the step simulation's timeline of ``plan``."""
    a = assignment_of(desc, device, plan)
    sim = step_sim.simulate_step(a.template, a.batch, a.option_index, a.variant, timeline=True,
                                 coalesce_bytes=coalesce_bytes)
    kinds = {"all_gather": "gather", "reduce_scatter": "reduce"}
    rep = {u.name for u in plan.units if u.modes == ("rep",)}
    out = []
    for e in sim.timeline:
        if e.resource != "comm":
            continue
        names = tuple(e.what.split(", "))
        kind = kinds.get(e.kind) or ("bucket" if set(names) <= rep else "reduce")
        out.append((kind, names))
    return out


def _setup(world, preset="small", limit_mib=40):
    config = get_preset(preset)
    torch.manual_seed(0)
    desc = describe(GPT(config), example_batch(config, 2))
    cluster = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0)  # a CPU process: no allocator slack
    device = cluster.for_run(RunSettings(world_size=world, memory_limit_bytes=limit_mib * MiB))
    return config, desc, device


def _replay(config, desc, device, plan, coalesce_bytes=DEFAULT_COALESCE_BYTES):
    torch.manual_seed(0)
    wrapped = osdp.OSDP(GPT(config), plan=plan, node_size=plan.node_size, coalesce_bytes=coalesce_bytes)
    runtime = _runtime_collectives(wrapped, config, plan.batch_size)
    simulated = _simulated_collectives(desc, device, plan, coalesce_bytes)
    return runtime, simulated


def _assert_same(runtime, simulated):
    assert len(runtime) == len(simulated), (len(runtime), len(simulated))
    for i, (r, s) in enumerate(zip(runtime, simulated)):
        assert r == s, f"collective {i}: the runtime issued {r}, the simulation {s}"


# planner plans: with the planner's rep set (its small units rep: one bucket), with none
# (small units sharded: coalesced gathers and reductions), and a smaller coalesce_bytes
# (several groups, deferred reductions flushed before the end of backward)
@pytest.mark.parametrize("fake_world", [8], indirect=True)
@pytest.mark.parametrize("rep_units, coalesce_bytes", [
    (None, DEFAULT_COALESCE_BYTES),
    ((), DEFAULT_COALESCE_BYTES),
    ((), 8 * 1024),
])
def test_runtime_and_simulation_issue_the_same_collectives(fake_world, rep_units, coalesce_bytes):
    config, desc, device = _setup(fake_world)
    settings = PlannerSettings(max_slices=4, rep_units=rep_units, coalesce_bytes=coalesce_bytes)
    plan = make_plan(desc, device, settings)
    runtime, simulated = _replay(config, desc, device, plan, coalesce_bytes)
    _assert_same(runtime, simulated)
    gathers = [names for kind, names in runtime if kind == "gather"]
    if rep_units == ():
        assert any(len(names) > 1 for names in gathers), "no gather carried riders: the case tests nothing"
        assert any(len(names) > 1 for kind, names in runtime if kind == "reduce")
    else:
        assert any(kind == "bucket" for kind, _ in runtime)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_replicated_buckets_flush_at_the_same_units(fake_world, monkeypatch):
    """Buckets of 256 KiB (both sides' constant, patched): several flushes mid-backward."""
    config, desc, device = _setup(fake_world, limit_mib=200)  # every unit whole on every rank
    plan = make_plan(desc, device, PlannerSettings(max_slices=4, policy="rep"))
    monkeypatch.setattr(step_sim, "RUNTIME_REPLICATE_BUCKET_BYTES", 256 * 1024)
    monkeypatch.setattr("osdp.runtime.reduce.REPLICATE_BUCKET_BYTES", 256 * 1024)
    runtime, simulated = _replay(config, desc, device, plan)
    _assert_same(runtime, simulated)
    assert sum(kind == "bucket" for kind, _ in runtime) >= 3


@pytest.mark.parametrize("fake_world", [8], indirect=True)
@pytest.mark.parametrize("zdp_slices, checkpointed", [(1, False), (0, False), (1, True)])
def test_uniform_plans_issue_the_same_collectives(fake_world, zdp_slices, checkpointed):
    """Every unit zdp (gathered again in backward, riders there too) or dp (kept), and
    every block checkpointed (the recompute gathers what is not gathered, no riders)."""
    config, desc, device = _setup(fake_world, limit_mib=200)  # not fitted to a budget: room for it
    plan = uniform_plan(desc, device, PlannerSettings(max_slices=4), 2, zdp_slices=zdp_slices,
                        checkpointed=checkpointed)
    runtime, simulated = _replay(config, desc, device, plan)
    _assert_same(runtime, simulated)
    assert any(kind == "gather" and len(names) > 1 for kind, names in runtime)


@pytest.mark.parametrize("fake_world", [16], indirect=True)
def test_riders_stop_where_the_gather_level_changes(fake_world):
    """Two nodes of 8: the LayerNorms alternate hpz (ln_1: gathered again from node
    copies in backward) and zdp (ln_2: from the shards). Forward gathers them all in one
    collective (all from shards); backward cannot mix levels, so each gathers alone. The
    simulation before schedule_rules grouped the backward ones as in forward."""
    config, desc, device = _setup(fake_world)
    plan = make_plan(desc, device, PlannerSettings(max_slices=4, rep_units=()))
    assert plan.node_size == 8
    plan = replace(plan, units=tuple(
        replace(u, modes=("hpz",) if u.name.endswith("ln_1") else ("zdp",)) if ".ln_" in u.name else u
        for u in plan.units))
    runtime, simulated = _replay(config, desc, device, plan)
    _assert_same(runtime, simulated)
    ln_gathers = [names for kind, names in runtime if kind == "gather" and any(".ln_" in n for n in names)]
    assert len(ln_gathers[0]) == 9  # forward: every LayerNorm in one all-gather
    assert ln_gathers[1:] == [(f"blocks.{b}.{ln}",) for b in (3, 2, 1, 0) for ln in ("ln_2", "ln_1")]


# ---- the pure rules ---------------------------------------------------------------------
class _U:
    """A unit as the rules see it."""

    def __init__(self, name, nbytes, key="f32", ok=True):
        self.name, self.nbytes, self.key, self.ok = name, nbytes, key, ok

    def __repr__(self):
        return self.name


def _riders(lead, following, coalesce=100, room=float("inf")):
    return rules.riders(lead, following, coalesce, room, size=lambda u: u.nbytes, key=lambda u: u.key,
                        eligible=lambda u: u.ok)


def test_riders_take_the_next_eligible_units_up_to_the_budget():
    a, b, c, d = _U("a", 30), _U("b", 30), _U("c", 30), _U("d", 5)
    assert _riders(a, [b, c, d]) == [b, c, d]  # 30 + 30 + 30 + 5 <= 100
    assert _riders(a, [b, c, d], coalesce=90) == [b, c]  # d: over the 0 bytes left: stop
    big = _U("big", 1000, ok=False)  # not eligible (big, or already gathered): skipped
    assert _riders(a, [big, b]) == [b]
    assert _riders(a, [b, a, c]) == [b, c]  # the lead again (a unit used twice): skipped
    assert _riders(a, [b, b, c]) == [b, c]


def test_riders_stop_at_a_key_change_the_budget_or_the_room():
    a, b = _U("a", 30), _U("b", 30)
    assert _riders(a, [_U("bf16", 10, key="bf16"), b]) == []  # another dtype / level: stop
    assert _riders(a, [_U("x", 80), b]) == []  # over what is left of coalesce_bytes: stop
    assert _riders(a, [b, _U("c", 30)], room=70) == [b]  # the window beside the lead's gather
    assert _riders(a, [b], room=40) == []


def test_prefetch_walk_window_and_stop():
    def walk(sizes, window, skip=()):
        live, out = [0.0], []
        for pos in rules.prefetch_walk(enumerate(sizes), window, size=lambda s: s, transient=lambda: live[0],
                                       skip=lambda p, _: p in skip):
            out.append(pos)
            live[0] += sizes[pos]
        return out

    assert walk([10, 20, 30, 5], 45, skip={1}) == [0, 2, 3]  # 10 + 30 + 5 = 45 <= 45
    assert walk([10, 40, 5], 45) == [0]  # 40 does not fit: stop, 5 is not looked at
    assert walk([10, 20], 0) == []  # no window: no prefetch
    assert walk([50], 45) == []


def test_coalesced_groups_and_buckets():
    assert rules.coalesced_groups([30, 30, 30, 30, 50, 60], 100) == [[0, 1, 2], [3, 4], [5]]
    assert rules.coalesced_groups([], 100) == []
    assert rules.pack_buckets([3, 1, 4, 1, 5], 4) == [[0, 1], [2], [3, 4]]  # full at >= 4
    assert rules.pack_buckets([1, 1], 4) == [[0, 1]]  # the rest: at the end of backward
    assert rules.group_full(4, 4) and not rules.group_full(3.9, 4)
    units = [_U("a", 1, "f32"), _U("b", 1, "bf16"), _U("c", 1, "f32")]
    assert rules.by_key(units, lambda u: u.key) == [[units[0], units[2]], [units[1]]]


def test_in_flight_queues():
    # reduce-scatters: issue, then wait for the oldest beyond the limit
    assert [rules.waits_after_issue(n, 1) for n in (1, 2, 3)] == [0, 1, 2]
    # replicated buckets: wait first, so that one bucket (and its staging) is in flight
    assert [rules.waits_before_issue(n, 1) for n in (0, 1, 2)] == [0, 1, 2]
    assert rules.waits_before_issue(1, 2) == 0


def test_the_rules_import_nothing_but_the_standard_library():
    code = "import sys, osdp.schedule_rules; print(sorted(m for m in sys.modules if m.startswith(('osdp', 'torch', 'numpy'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['osdp', 'osdp.schedule_rules']"
