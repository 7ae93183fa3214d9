"""The planner: describe a model, price choices with the cost model, search for the
plan with the most samples per second that fits, and store it.

    desc = osdp.planner.describe(model, example_inputs)        # or describe_gpt(config)
    cluster = osdp.planner.load_cluster()                    # hardware (the default profile)
    device = cluster.for_run(osdp.planner.RunSettings(world_size=8, memory_limit_bytes=8 * 2**30))
    plan = osdp.planner.make_plan(desc, device, osdp.planner.PlannerSettings())

"""
from __future__ import annotations

# (the module is description.py, so that no submodule shadows the function of the same
# name)
from .cost_model import PlannerSettings, evaluate
from .description import ModelDesc, OpDesc, describe
from .cluster import ClusterProfile, load_cluster
from .device import DeviceInfo
from .run import RunSettings
from .gpt_desc import describe_gpt
from .plan import Plan
from .planner import make_plan

__all__ = [
    "ClusterProfile", "DeviceInfo", "ModelDesc", "OpDesc", "Plan", "PlannerSettings", "RunSettings", "describe",
    "describe_gpt", "evaluate", "load_cluster", "make_plan",
]


def __getattr__(name: str):
    # osdp.planner.profile, the hardware micro-benchmark, moved to osdp.profiler.profile:
    # it runs torch collectives and compute, which the pure planner never does. The old
    # name resolves lazily (importing it here would make the planner import the profiler).
    if name == "profile":
        import importlib
        import warnings

        warnings.warn("osdp.planner.profile moved to osdp.profiler.profile", DeprecationWarning, stacklevel=2)
        return importlib.import_module("osdp.profiler").profile
    raise AttributeError(f"module 'osdp.planner' has no attribute {name!r}")
