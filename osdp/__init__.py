"""OSDP: Optimal Sharded Data Parallel for PyTorch.

Per operator, OSDP keeps gathered weights through backward (``dp``) or frees them after
forward and gathers again (``zdp``), splits big matmuls into slices with their own
modes, and plans all of it (with the batch size) for the most samples per second that
fit in device memory.

    plan = osdp.auto_plan(model, example_inputs, memory_limit="8GiB")
    model = osdp.OSDP(model, plan=plan)

Names are loaded lazily so that ``import osdp`` stays cheap and the planner works
without the runtime's dependencies being exercised.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "OSDP": "osdp.api",
    "MixedPrecision": "osdp.runtime.mixed_precision",
    "describe": "osdp.planner.describe",
    "describe_gpt": "osdp.planner.gpt_desc",
    "ModelDesc": "osdp.planner.describe",
    "OpDesc": "osdp.planner.describe",
    "ClusterProfile": "osdp.planner.cluster",
    "load_cluster": "osdp.planner.cluster",
    "RunSettings": "osdp.planner.run",
    "DeviceInfo": "osdp.planner.device",
    "PlannerSettings": "osdp.planner.cost_model",
    "evaluate": "osdp.planner.cost_model",
    "Plan": "osdp.planner.plan",
    "make_plan": "osdp.planner.planner",
    "auto_plan": "osdp.auto",
    "profile": "osdp.planner.profile",
    "ExampleInputs": "osdp.planner.inputs",
    "InfeasiblePlanError": "osdp.errors",
    "PlanMismatchError": "osdp.errors",
    "OSDPError": "osdp.errors",
    "ConfigError": "osdp.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'osdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
