"""How long auto mode may measure, what it cut to fit, and the lines it prints.

[Note: planning budget]
Auto mode measures on the machine it plans for (the profile, then plans wrapped and
trained for a few steps), and a measured step at the batch the planner likes best can
take seconds (a CPU run at a 20 GiB limit picked batches in the hundreds). So it works
within ``budget_s`` (default a minute; ``auto_kwargs={"budget_s": ...}``), counted from
its start (the profile included), and cuts, in this order, each time saying so (``plan.calibration.budget``
and a progress line):

0. the profile's compute timing (a real model's units, at the example batch and smaller
   ones, largest first): no further batch once two are timed and ``PROFILE_SHARE`` of
   the budget is spent;
1. calibration's reference plans: FSDP at the example batch is always measured, FSDP at
   half of it and the split reference only when their estimated cost (a rebuild and
   their steps at their predicted time) fits in what is left less ``MIN_SHARE`` of the
   budget, kept for the first plan's own measurement (101M GPT on 2 CPU ranks at 20 GiB:
   three reference plans took about 38 s of the 60);
2. the batch: when the first plan's predicted step, times the steps its measurement
   and about one more take (``STEPS_AFTER_PLAN``), is more than the budget left (at
   least a quarter of it, ``MIN_SHARE``: a spent budget still measures the plan it
   hands out), the plan is made again at the batch that fits (steps grow about in
   proportion to the batch), but never below the example batch (the profile ran it;
   101M GPT on 2 CPU ranks: a 60 s budget capped the batch at 1);
3. timed steps: a measurement whose steps do not fit in what is left times 1 step;
4. candidates: an alternative plan (calibration's re-plan, measured choice's candidates,
   its tiebreak) whose estimated cost is more than what is left is not measured.

With ``compile=`` all of the above is eager, as without it; the compiled choice's
finalists ([Note: compiled plans] in osdp/compiled_choice.py: at most two compiles, each
a trial's first step) are measured after it, outside the budget.

Every decision is rank 0's, broadcast (the ranks' clocks differ; their collectives must
not). The budget is a target, not a deadline: a measurement that started runs to its
end, and the first plan is always measured.
"""
from __future__ import annotations

import logging
import math
import sys
import time

from .errors import ConfigError
from .planner.calibration import predicted_step_s
from .rank_agreement import decide_on_rank0, is_rank0

log = logging.getLogger("osdp.auto")

DEFAULT_BUDGET_S = 60.0
# the batch is capped so that the first plan's own measurement and about one more (a
# rebuild, 2 warm-up and 3 timed steps each) fit: a capped batch costs every training
# step, a candidate left unmeasured only the chance that it was better
STEPS_AFTER_PLAN = 12
REBUILD_STEPS = 1.0  # a trial's build (every unit gathered once), in steps of its plan
MIN_SHARE = 0.25  # of the budget: the least the measurements after the first plan get
PROFILE_SHARE = 0.25  # of the budget: the compute timing stops after it, once two batches are timed


def show_progress(enabled: bool, group=None) -> None:
    """Progress lines on rank 0 go to stderr when nothing else handles ``osdp``'s logs
    (a script that configured logging keeps its own); ``enabled=False``: none."""
    logger = logging.getLogger("osdp")
    if not enabled or not is_rank0(group):
        log.setLevel(logging.WARNING)
        return
    log.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("osdp: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def predicted_optimizer_step_s(plan) -> float:
    """A plan's predicted seconds per optimizer step: its (simulated) step times its
    micro-batches."""
    return float(predicted_step_s(plan)) * max(1, getattr(plan, "accumulation_steps", 1))


def measurement_s(plan, warmup: int, steps: int) -> float:
    """The estimated seconds of measuring ``plan``: a rebuild, ``warmup`` and ``steps``."""
    return predicted_optimizer_step_s(plan) * (REBUILD_STEPS + warmup + steps)


class PlanningBudget:
    """The seconds auto mode may take, what is left, and what was cut (rank 0 decides)."""

    def __init__(self, seconds: float | None = DEFAULT_BUDGET_S, group=None):
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds > 0):
            raise ConfigError(f"budget_s must be a number of seconds > 0 (or None: no budget), got {seconds!r}")
        self.seconds = math.inf if seconds is None else float(seconds)
        self.group = group
        self.started = time.perf_counter()
        self.cuts: list[str] = []

    def spent(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.seconds - self.spent()

    def cut(self, what: str) -> None:
        self.cuts.append(what)
        log.info("budget: %s", what)

    def batch_cap(self, plan, floor: int = 1) -> int | None:
        """The batch to plan at instead of ``plan``'s (None: it fits), rank 0's; never
        below ``floor`` (auto mode: the example batch, which the profile already ran: a
        model whose steps are slow at it is planned there, over the budget, rather than
        trained at a batch too small to use the device)."""
        def cap_on_rank0():
            step = predicted_optimizer_step_s(plan)
            need = step * STEPS_AFTER_PLAN
            # a spent budget still measures the first plan: at the batch a quarter of it allows
            room = max(self.left(), MIN_SHARE * self.seconds)
            lowest = min(floor, plan.batch_size)
            if need <= room or plan.batch_size <= lowest:
                return None
            cap = max(lowest, int(plan.batch_size * room / need))
            self.cut(f"batch capped at {cap}: the uncapped pick (batch {plan.batch_size}) steps in "
                     f"{step * 1e3:.0f} ms predicted, and the ~{STEPS_AFTER_PLAN} steps measured after it "
                     f"would take {need:.0f} s, {room:.0f} s are left")
            return cap

        return decide_on_rank0(cap_on_rank0, self.group)

    def steps(self, plans, steps: int, warmup: int) -> int:
        """Timed steps for measuring ``plans`` (rank 0's): ``steps``, or 1 when they
        would not fit in what is left."""
        def steps_on_rank0():
            if steps <= 1:
                return steps
            cost = sum(measurement_s(p, warmup, steps) for p in plans)
            if cost <= self.left():
                return steps
            self.cut(f"1 timed step instead of {steps} for {len(plans)} plan(s): "
                     f"{cost:.1f} s estimated, {max(self.left(), 0):.1f} s left")
            return 1

        return decide_on_rank0(steps_on_rank0, self.group)

    def affordable(self, plans, what: str, warmup: int = 2, steps: int = 1, reserve_s: float = 0.0) -> list:
        """The prefix of ``plans`` whose measurement fits in what is left (at least
        ``steps`` timed steps each), less ``reserve_s`` kept for later measurements; the
        rest is cut, said once. Call on rank 0 (the callers broadcast the plans they
        measure)."""
        room = self.left() - reserve_s if math.isfinite(self.seconds) else math.inf
        kept, cost = [], 0.0
        for plan in plans:
            cost += measurement_s(plan, warmup, steps)
            if cost > room:
                break
            kept.append(plan)
        if len(kept) < len(plans):
            kept_back = f", {reserve_s:.0f} s of it kept for later" if reserve_s else ""
            self.cut(f"{what}: {len(plans) - len(kept)} of {len(plans)} not measured (estimated "
                     f"{cost:.1f} s, {max(self.left(), 0):.1f} s left{kept_back})")
        return kept

    def record(self) -> dict:
        """What the plan says about the budget: rank 0's (the cuts are its decisions and
        every rank's clock differs), on every rank (collective)."""
        return decide_on_rank0(lambda: {"budget_s": None if math.isinf(self.seconds) else self.seconds,
                                        "spent_s": round(self.spent(), 3), "cuts": list(self.cuts)}, self.group)
