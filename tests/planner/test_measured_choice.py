"""[Note: measured choice] in osdp/measured_choice.py: which alternatives are measured beside the
calibrated plan, and which plan is kept, driven by measurements made up per plan."""
from dataclasses import replace

import pytest

from osdp.measured_choice import (checkpointed_fsdp, checkpointed_fsdp_alternative, checkpointing_alternative, faster_within_limit,
                                  measured_choice, memory_corrected, replication_alternative, same_schedule,
                                  sharded_alternative)
from osdp.models import GPTConfig
from osdp.planner.calibration import Measurement
from osdp.planner.cluster import load_cluster
from osdp.planner.cost_model import PlannerSettings
from osdp.planner.gpt_desc import describe_gpt
from osdp.planner.planner import make_plan
from osdp.planner.run import RunSettings

CONFIG = GPTConfig(vocab_size=512, seq_len=64, num_layers=4, hidden=128, heads=4)
LIMIT = 24 * 2**20


def _setup(checkpointing="auto"):
    desc = describe_gpt(CONFIG)
    device = load_cluster("titan-rtx-pcie3").with_(constant_bytes=0).for_run(
        RunSettings(world_size=4, memory_limit_bytes=LIMIT))
    settings = PlannerSettings(max_slices=4, checkpointing=checkpointing)
    plan = make_plan(desc, device, settings, backend="python", baselines=False)
    return desc, device, settings, plan


def _measured(plan, step_s, peak_bytes):
    return Measurement(step_s, step_s / 3, step_s / 2, step_s / 6, peak_bytes, plan.batch_size)


def test_memory_corrected_plans_for_the_room_or_the_shortfall_the_measurement_showed():
    desc, device, settings, plan = _setup()
    over = 0.1 * LIMIT  # the model predicted 10% of the limit more than was measured
    roomy = memory_corrected(desc, device, plan, _measured(plan, 0.1, plan.predicted.peak_bytes - over), settings,
                             backend="python")
    assert roomy is not None and roomy.memory_limit_bytes == LIMIT  # runs (and is checked) at the real limit
    assert "kept only if its own measured peak fits" in roomy.notes[-1]
    assert roomy.batch_size >= plan.batch_size and roomy.predicted.peak_bytes > LIMIT
    assert roomy.predicted.peak_bytes <= LIMIT + over
    short = memory_corrected(desc, device, plan, _measured(plan, 0.1, plan.predicted.peak_bytes + over), settings,
                             backend="python")
    assert short is not None and short.predicted.peak_bytes <= LIMIT - over
    assert short.batch_size <= plan.batch_size
    # the model within a quarter of the tolerance: nothing to correct
    assert memory_corrected(desc, device, plan, _measured(plan, 0.1, plan.predicted.peak_bytes), settings,
                            backend="python") is None


def test_a_plan_measured_just_over_its_limit_is_corrected_however_small_the_model_error():
    desc, device, settings, plan = _setup()
    overrun = 0.002 * LIMIT  # well within a quarter of the tolerance of the prediction
    at_limit = replace(plan, predicted=replace(plan.predicted, peak_bytes=LIMIT - overrun / 2))
    measured = _measured(plan, 0.1, LIMIT + overrun)
    assert measured.peak_bytes - at_limit.predicted.peak_bytes <= settings.memory_tolerance / 4 * LIMIT
    smaller = memory_corrected(desc, device, at_limit, measured, settings, backend="python")
    assert smaller is not None and smaller.memory_limit_bytes == LIMIT
    # planned below the plan's own prediction less its overrun: never the same plan again
    assert smaller.predicted.peak_bytes <= at_limit.predicted.peak_bytes - overrun
    # a plan that fits, measured as predicted: nothing to correct
    fits = _measured(plan, 0.1, at_limit.predicted.peak_bytes)
    assert memory_corrected(desc, device, at_limit, fits, settings, backend="python") is None


def test_the_checkpointing_alternative_only_when_checkpointing_is_allowed():
    desc, device, settings, plan = _setup("auto")
    other = checkpointing_alternative(desc, device, plan, settings, backend="python")
    assert other is not None and bool(other.checkpoint_blocks) != bool(plan.checkpoint_blocks)
    assert other.memory_limit_bytes == LIMIT and other.predicted.peak_bytes <= LIMIT
    desc, device, settings, plan = _setup("none")
    assert checkpointing_alternative(desc, device, plan, settings, backend="python") is None


def test_fsdp_with_every_block_checkpointed_is_an_alternative_where_checkpointing_is_allowed():
    for checkpointing in ("auto", "all"):
        desc, device, settings, plan = _setup(checkpointing)
        peer = checkpointed_fsdp_alternative(desc, device, plan, settings, backend="python")
        assert peer is not None and peer.memory_limit_bytes == LIMIT and peer.predicted.peak_bytes <= LIMIT
        assert all(m == "zdp" for u in peer.units for m in u.modes) and all(u.slices == 1 for u in peer.units)
        assert sorted(peer.checkpoint_blocks) == [f"blocks.{i}" for i in range(CONFIG.num_layers)]
    desc, device, settings, plan = _setup("none")
    assert checkpointed_fsdp_alternative(desc, device, plan, settings, backend="python") is None
    desc, device, settings, plan = _setup("auto")
    assert checkpointed_fsdp_alternative(desc, device, plan, settings.with_(policy="zdp"), backend="python") is None


def test_fsdp_with_checkpointing_is_corrected_for_memory_as_itself():
    desc, device, settings, plan = _setup("auto")
    peer = checkpointed_fsdp_alternative(desc, device, plan, settings, backend="python")
    roomy = _measured(peer, 0.1, peer.predicted.peak_bytes - 0.1 * LIMIT)
    corrected = memory_corrected(desc, device, peer, roomy, settings, planned_with=checkpointed_fsdp(settings),
                                 backend="python")
    assert corrected is not None and corrected.batch_size > peer.batch_size
    assert all(m == "zdp" for u in corrected.units for m in u.modes)
    assert corrected.checkpoint_blocks == peer.checkpoint_blocks
    # with the user's settings, a plan "like it" may mix modes: the peer's configuration is lost
    mixed = memory_corrected(desc, device, peer, roomy, settings, backend="python")
    assert mixed is not None and mixed.plan_hash() != corrected.plan_hash()


def test_the_replication_alternative_is_ddp_where_the_planner_chose_the_rep_set():
    desc, device, settings, _ = _setup("none")
    # at this roomy limit the planner's own pick is already DDP: take a sharded plan
    plan = make_plan(desc, device, settings.with_(rep_units=()), backend="python", baselines=False)
    assert "rep" not in {m for u in plan.units for m in u.modes}
    ddp = replication_alternative(desc, device, plan, settings, backend="python")
    assert ddp is not None and ddp.memory_limit_bytes == LIMIT and ddp.predicted.peak_bytes <= LIMIT
    assert all(m == "rep" for u in ddp.units for m in u.modes)
    assert replication_alternative(desc, device, ddp, settings, backend="python") is None  # already DDP
    fixed = settings.with_(rep_units=())  # the user fixed the rep set: nothing to try
    assert replication_alternative(desc, device, plan, fixed, backend="python") is None
    # DDP does not fit: whole weights and optimizer state on every rank exceed the limit
    small = device.with_(memory_limit_bytes=ddp.predicted.peak_bytes / 2)
    low = make_plan(desc, small, settings, backend="python", baselines=False)
    assert replication_alternative(desc, small, low, settings, backend="python") is None


def test_the_sharded_alternative_has_no_rep_unit_where_the_planner_chose_rep_units():
    desc, device, settings, plan = _setup("none")
    assert all(m == "rep" for u in plan.units for m in u.modes)  # this roomy limit: DDP
    sharded = sharded_alternative(desc, device, plan, settings, backend="python")
    assert sharded is not None and sharded.memory_limit_bytes == LIMIT and sharded.predicted.peak_bytes <= LIMIT
    assert "rep" not in {m for u in sharded.units for m in u.modes}
    # the same as planning without rep units from the start
    unrepped = make_plan(desc, device, settings.with_(rep_units=()), backend="python", baselines=False)
    assert sharded.plan_hash() == unrepped.plan_hash()
    assert sharded_alternative(desc, device, sharded, settings, backend="python") is None  # no rep unit
    assert sharded_alternative(desc, device, plan, settings.with_(rep_units=()), backend="python") is None
    assert sharded_alternative(desc, device, plan, settings.with_(policy="rep"), backend="python") is None


def _choose(measure_of):
    desc, device, settings, plan = _setup()
    first = _measured(plan, 0.1, plan.predicted.peak_bytes - 0.1 * LIMIT)
    plan = replace(plan, measured=first.to_dict(), calibration={"decision": "kept"})
    seen = []

    def measure(plans):
        seen.append([p.plan_hash() for p in plans])
        return [measure_of(p, i) for i, p in enumerate(plans)]

    chosen = measured_choice(desc, device, plan, measure, settings=settings, backend="python")
    return plan, chosen, seen


def test_a_faster_alternative_that_fits_by_measurement_is_kept():
    plan, chosen, seen = _choose(lambda p, i: _measured(p, 0.1 if i == 0 else 0.05, 0.8 * LIMIT))
    # round 1: the plan, its checkpointing alternative, the best plan without rep units
    # and FSDP with every block checkpointed (the pick is already all rep: no
    # replication alternative); round 2:
    # the best so far and the memory-corrected plans; then, when another schedule measured
    # as fast, the two best schedules' tiebreak (two more measurements of the pair)
    assert all(m == "rep" for u in plan.units for m in u.modes)
    assert seen[0][0] == plan.plan_hash() and len(seen[0]) == 4 and len(seen[1]) >= 2
    tiebreak = seen[2:]
    assert tiebreak == [] or (len(tiebreak) == 2 and tiebreak[0] == tiebreak[1] and len(tiebreak[0]) == 2)
    # every alternative measured twice as fast as the plan: the one with the most samples/s
    record = chosen.calibration.measured_choice
    best = max(record["candidates"][1:], key=lambda c: c["samples_per_s"])
    assert chosen.plan_hash() == best["plan"] != plan.plan_hash()
    assert best["samples_per_s"] > record["candidates"][0]["samples_per_s"]
    assert chosen.memory_limit_bytes == LIMIT
    assert Measurement.from_dict(chosen.measured).step_s == 0.05
    assert record["kept"] == chosen.plan_hash()
    assert len(record["candidates"]) == 1 + len(seen[0]) - 1 + len(seen[1]) - 1
    assert chosen.calibration.decision == "kept"  # what calibration said stays
    # the predictions the report sets beside that measurement are the kept plan's own
    from osdp.measured_choice import calibrated_device
    from osdp.planner import calibration as cal

    desc, device, _, _ = _setup()
    device = calibrated_device(device, plan)
    assert chosen.calibration.predicted_step_s == cal.simulate(cal.assignment_of(desc, device, chosen), device).step_s
    assert "measured choice: kept another plan" in cal.format_report(chosen)


def test_an_alternative_over_the_limit_by_measurement_is_never_kept():
    plan, chosen, _ = _choose(lambda p, i: _measured(p, 0.1, 0.8 * LIMIT) if i == 0
                              else _measured(p, 0.01, 1.01 * LIMIT))
    assert chosen.plan_hash() == plan.plan_hash()
    assert Measurement.from_dict(chosen.measured).step_s == pytest.approx(0.1)  # its measurement of this round


def test_a_plan_measured_over_the_limit_gives_way_to_a_slower_one_within_it():
    plan, chosen, _ = _choose(lambda p, i: _measured(p, 0.01, 1.01 * LIMIT) if p.notes == () and i == 0
                              else _measured(p, 0.1, 0.9 * LIMIT))
    assert chosen.plan_hash() != plan.plan_hash()
    assert Measurement.from_dict(chosen.measured).peak_bytes <= LIMIT


def test_of_two_runs_of_one_schedule_that_fit_the_larger_batch_wins_whatever_the_timing_noise():
    _, _, _, plan = _setup()
    larger = replace(plan, batch_size=plan.batch_size + 1)
    assert same_schedule(plan, larger) and larger.plan_hash() != plan.plan_hash()
    small = (plan, _measured(plan, 0.100, 0.8 * LIMIT))
    # b + 1 timed 10% slower per sample: a few steps' noise, not the schedule
    big = (larger, _measured(larger, 0.100 * (plan.batch_size + 1) / plan.batch_size * 1.1, 0.85 * LIMIT))
    assert big[1].samples_per_s(4) < small[1].samples_per_s(4)
    assert faster_within_limit(small, big) is big and faster_within_limit(big, small) is big
    # the larger batch measured over the limit never wins
    over = (larger, _measured(larger, 0.05, 1.01 * LIMIT))
    assert faster_within_limit(small, over) is small
    # another schedule: samples/s decides
    other = replace(larger, units=tuple(replace(u, modes=tuple("zdp" if m != "zdp" else "dp" for m in u.modes))
                                        for u in plan.units))
    assert not same_schedule(plan, other)
    assert faster_within_limit(small, (other, big[1])) is small


def test_two_schedules_measured_close_are_timed_again_and_the_faster_over_those_wins():
    """Per sample, every checkpointed plan measured 0.100/13 s and every plan without
    checkpointing 0.098/13 s (2% apart: within CLOSE_MARGIN). The best without
    checkpointing and the best checkpointed one are then measured TIEBREAK_REPEATS more
    times, interleaved, where checkpointing is the faster (0.090 against 0.100): the
    checkpointed plan is kept, and the tiebreak is recorded."""
    from osdp.measured_choice import CLOSE_MARGIN, TIEBREAK_REPEATS, close_runner_up

    desc, device, settings, plan = _setup()
    plan = replace(plan, measured=_measured(plan, 0.1, 0.8 * LIMIT).to_dict(), calibration={"decision": "kept"})
    assert plan.checkpoint_blocks
    calls = []

    def measure(plans):
        calls.append(plans)
        tiebreak = len(calls) > 2
        per_sample = {True: 0.090 if tiebreak else 0.100, False: 0.100 if tiebreak else 0.098}
        return [_measured(p, per_sample[bool(p.checkpoint_blocks)] * p.batch_size / 13, 0.8 * LIMIT) for p in plans]

    chosen = measured_choice(desc, device, plan, measure, settings=settings, backend="python")
    assert len(calls) == 2 + TIEBREAK_REPEATS
    pairs = [[bool(p.checkpoint_blocks) for p in c] for c in calls[2:]]
    assert all(sorted(pair) == [False, True] for pair in pairs)  # one of each side, again and again
    assert chosen.checkpoint_blocks
    record = chosen.calibration.measured_choice["tiebreak"]
    assert record["kept"] == chosen.plan_hash() and record["repeats"] == TIEBREAK_REPEATS
    # without the tiebreak the plan without checkpointing would have been kept (2% more samples/s)
    assert Measurement.from_dict(chosen.measured).step_s == pytest.approx(0.090 * chosen.batch_size / 13)
    # far apart: no runner-up to time again; close: it is; over its limit: never
    other = checkpointing_alternative(desc, device, plan, settings, backend="python")
    ratio = other.batch_size / plan.batch_size
    best = (plan, _measured(plan, 0.1, 0.8 * LIMIT))
    assert close_runner_up(best, [best, (other, _measured(other, 0.1 * ratio / (1 - 2 * CLOSE_MARGIN), 0.8 * LIMIT))]) \
        is None
    close = (other, _measured(other, 0.1 * ratio * 1.02, 0.8 * LIMIT))
    assert close_runner_up(best, [best, close]) is close
    assert close_runner_up(best, [best, (other, _measured(other, 0.1 * ratio, 1.01 * LIMIT))]) is None
