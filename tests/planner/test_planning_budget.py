"""[Note: planning budget]: what auto mode cuts when its measurements would not fit in
``budget_s``, decided from predicted step times (one process: rank 0 decides alone)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from osdp.errors import ConfigError
from osdp.planning_budget import MIN_SHARE, REBUILD_STEPS, STEPS_AFTER_PLAN, PlanningBudget


def _plan(batch: int, step_s: float, accumulation_steps: int = 1):
    return SimpleNamespace(batch_size=batch, accumulation_steps=accumulation_steps,
                           predicted=SimpleNamespace(step_s=step_s, simulated_step_s=None))


def _budget(seconds: float, spent: float, monkeypatch) -> PlanningBudget:
    budget = PlanningBudget(seconds)
    monkeypatch.setattr(budget, "spent", lambda: spent)
    return budget


def test_batch_cap_scales_the_batch_to_the_time_left(monkeypatch):
    budget = _budget(60.0, spent=30.0, monkeypatch=monkeypatch)
    # 40 samples at 0.5 s a step: 12 steps take 6 s, within the 30 s left
    assert budget.batch_cap(_plan(40, 0.5)) is None and budget.cuts == []
    # 200 samples at 5 s a step: 60 s needed for 30 left -> half the batch
    assert budget.batch_cap(_plan(200, 5.0)) == int(200 * 30.0 / (5.0 * STEPS_AFTER_PLAN))
    assert "batch capped at 100" in budget.cuts[-1]


def test_a_spent_budget_still_leaves_its_minimum_share(monkeypatch):
    budget = _budget(60.0, spent=100.0, monkeypatch=monkeypatch)
    room = MIN_SHARE * 60.0  # 15 s: 12 steps of 1 s fit, of 2 s do not
    assert budget.batch_cap(_plan(100, 1.0)) is None
    assert budget.batch_cap(_plan(100, 2.0)) == int(100 * room / (2.0 * STEPS_AFTER_PLAN))


def test_batch_cap_never_goes_below_the_example_batch(monkeypatch):
    """101M GPT on 2 CPU ranks: the profile spent the budget and the cap fell to batch 1
    (a step of batch 9 predicted 7.6 s); the example batch (4) had already run."""
    budget = _budget(60.0, spent=58.0, monkeypatch=monkeypatch)
    assert budget.batch_cap(_plan(9, 7.6), floor=4) == 4
    assert budget.batch_cap(_plan(9, 7.6)) == 1  # no floor given: down to one sample
    # a pick already at or below the floor is left alone
    assert budget.batch_cap(_plan(3, 7.6), floor=4) is None


def test_steps_cut_to_one_when_the_measurement_would_not_fit(monkeypatch):
    budget = _budget(60.0, spent=50.0, monkeypatch=monkeypatch)
    cheap, dear = _plan(8, 0.1), _plan(8, 1.0)
    assert budget.steps([cheap], steps=3, warmup=2) == 3  # 0.6 s of 10
    assert budget.steps([dear, dear], steps=3, warmup=2) == 1  # 2 x 6 s of 10
    assert "1 timed step instead of 3 for 2 plan(s)" in budget.cuts[-1]


def test_affordable_keeps_the_prefix_that_fits_and_says_what_it_cut(monkeypatch):
    budget = _budget(60.0, spent=50.0, monkeypatch=monkeypatch)
    per = REBUILD_STEPS + 2 + 1  # rebuild, 2 warm-up and 1 timed step
    plans = [_plan(8, 4.0 / per), _plan(8, 4.0 / per), _plan(8, 4.0 / per)]  # 4 s each, 10 s left
    assert budget.affordable(plans, "candidates") == plans[:2]
    assert budget.cuts == ["candidates: 1 of 3 not measured (estimated 12.0 s, 10.0 s left)"]


def test_affordable_keeps_a_reserve_for_later_measurements(monkeypatch):
    """Calibration's extra reference plans leave MIN_SHARE of the budget to the first
    plan's own measurement."""
    budget = _budget(60.0, spent=30.0, monkeypatch=monkeypatch)  # 30 s left, 15 s reserved
    per = REBUILD_STEPS + 2 + 1
    plans = [_plan(8, 10.0 / per), _plan(8, 10.0 / per)]  # 10 s each
    assert budget.affordable(plans, "extra", reserve_s=MIN_SHARE * 60.0) == plans[:1]
    assert budget.cuts == ["extra: 1 of 2 not measured (estimated 20.0 s, 30.0 s left, 15 s of it kept for later)"]
    assert PlanningBudget(None).affordable(plans, "extra", reserve_s=math.inf) == plans


def test_accumulation_steps_count_in_the_step(monkeypatch):
    budget = _budget(60.0, spent=0.0, monkeypatch=monkeypatch)
    assert budget.batch_cap(_plan(10, 1.0)) is None  # 12 s of 60
    assert budget.batch_cap(_plan(10, 1.0, accumulation_steps=8)) == int(10 * 60 / (8 * STEPS_AFTER_PLAN))


@pytest.mark.parametrize("bad", [0, -1, True, "60", float("nan")])
def test_bad_budget_is_refused(bad):
    with pytest.raises(ConfigError, match="budget_s must be a number of seconds > 0"):
        PlanningBudget(bad)


def test_no_budget_cuts_nothing():
    budget = PlanningBudget(None)
    assert budget.batch_cap(_plan(10_000, 100.0)) is None and budget.record()["budget_s"] is None
