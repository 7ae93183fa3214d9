"""Measure the runtime as it really runs: a copy of the model wrapped by ``osdp.OSDP``
with a plan, trained for a few steps (see [Note: what the profiler fits] in
``osdp/planner/calibration.py``). The planner stays pure; this package is where the
planner's numbers meet the runtime."""
from .runtime import TrialPool, measure_plan, measure_plans

__all__ = ["TrialPool", "measure_plan", "measure_plans"]
