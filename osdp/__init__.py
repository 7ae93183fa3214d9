"""OSDP: Optimal Sharded Data Parallel for PyTorch.

Per operator, OSDP keeps gathered weights through backward (``dp``) or frees them after
forward and gathers again (``zdp``), splits big matmuls into slices with their own
modes, and plans all of it (with the batch size) for the most samples per second that
fit in device memory.

    plan = osdp.auto_plan(model, example_inputs, memory_limit="8GiB")
    model = osdp.OSDP(model, plan=plan)

The planner (describe, cost model, search, plans) is ``osdp.planner``.

Names are loaded lazily so that ``import osdp`` stays cheap and the planner works
without the runtime's dependencies being exercised.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it: the runtime (what a training script uses)
_EXPORTS = {
    "OSDP": "osdp.entry",
    "MixedPrecision": "osdp.runtime.mixed_precision",
    "GradScaler": "osdp.grad_scaler",
    "init_by_submodel": "osdp.runtime.materialize",
    "CompileConfig": "osdp.runtime.compile_config",
    "RuntimeOptions": "osdp.runtime.options",
    "RuntimeConfig": "osdp.contract",
    "auto_plan": "osdp.auto",
    "ExampleInputs": "osdp.planner.inputs",
    "InfeasiblePlanError": "osdp.errors",
    "PlanMismatchError": "osdp.errors",
    "OSDPError": "osdp.errors",
    "ConfigError": "osdp.errors",
    "CheckpointCorruptedError": "osdp.errors",
    "MemoryLimitExceeded": "osdp.errors",
    "RanksOutOfStepError": "osdp.errors",
    "UnverifiedCheckpointWarning": "osdp.errors",
}
# planner names live in osdp.planner; the old spelling osdp.<name> still resolves
_PLANNER_NAMES = frozenset({
    "describe", "describe_gpt", "ModelDesc", "OpDesc", "DeviceInfo", "load_cluster", "PlannerSettings",
    "evaluate", "Plan", "make_plan", "profile", "ClusterProfile", "RunSettings",
})

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _PLANNER_NAMES:
        import warnings

        home = "osdp.profiler" if name == "profile" else "osdp.planner"
        warnings.warn(f"osdp.{name} moved to {home}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'osdp' has no attribute {name!r}")


def __dir__():
    return __all__
