"""Measurements on this machine, the two things the planner's numbers come from:
``hardware`` (``profile``: collectives' α/β and per-op compute fits, the micro-benchmark
a ``DeviceInfo`` is made from) and ``plans`` (``measure_plans``: a copy of the model
wrapped by ``osdp.OSDP`` with a plan, trained for a few steps; see [Note: what the
profiler fits] in ``osdp/planner/calibration.py``). The planner stays pure (it never
runs torch collectives or the runtime); this package is where its numbers meet the
machine."""
from .hardware import compute_device, profile
from .plans import TrialPool, measure_plan, measure_plans

__all__ = ["TrialPool", "compute_device", "measure_plan", "measure_plans", "profile"]
