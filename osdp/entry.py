"""``osdp.OSDP``: the wrapper users call, the runtime (``ShardedModel``) with auto mode in
front of it. Imports run one way: this module -> ``osdp.auto`` -> ``osdp.profiler`` ->
``osdp.api`` (the runtime); the runtime never imports auto mode."""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from .api import ShardedModel, check_wrappable
from .auto import plan_with_values, value_holder
from .errors import ConfigError
from .planner.cost_model import PlannerSettings
from .planner.inputs import as_example_inputs, sample_shapes
from .planner.plan import plan_from_arg
from .runtime.materialize import ValuesFrom, has_meta
from .runtime.mesh import ShardLayout
from .runtime.options import OPTION_KEYWORDS, RuntimeOptions
from .runtime.state_dict import ShardValues


class OSDP(ShardedModel):
    """Optimal Sharded Data Parallel: ``OSDP(module, plan)``, ``OSDP(module,
    default_mode="zdp", modes={...}, splits={...})``, or auto mode, ``OSDP(module,
    memory_limit=..., example_inputs=...)``. Everything but auto mode is
    :class:`osdp.api.ShardedModel`'s (see there: units, modes, splits, layouts, memory
    check, gradient accumulation, models built on the meta device).

    Auto mode: with no plan and no ``modes``/``splits``, ``memory_limit`` and
    ``example_inputs`` make OSDP plan first (every rank: it profiles, plans on rank 0 and
    broadcasts, measures on the runtime: :func:`osdp.auto.auto_plan`; ``settings``,
    ``loss_fn`` and ``auto_kwargs`` such as ``batch``/``global_batch`` are passed on).
    ``model.plan`` is the plan and ``model.batch_size`` the per-device batch the training
    loop must use. ``example_inputs`` is one forward's arguments: a tuple (positional), a
    dict (keyword: a stock Hugging Face model takes ``{"input_ids": x, "labels": y}``) or
    ``osdp.ExampleInputs(args, kwargs)`` (with ``at_batch=fn`` for packed inputs, see
    :func:`osdp.auto.auto_plan`); the batch is dim 0 of the first tensor (in a dict,
    list or tuple argument too). The profiler runs backward on ``loss_fn(output)``
    when given (a scalar tensor, for any batch), else on ``output.loss`` (a
    ``ModelOutput`` given labels) or on the output tensor: a scalar itself, logits (also
    a ``ModelOutput``'s without a loss) a cross-entropy over their last dimension
    (assumed: logged once, kept as ``plan.assumed_loss``, named by the memory check), else
    the sum; tuple outputs need ``loss_fn``. See [Note: example inputs and the loss] in
    ``osdp/planner/inputs.py``. A model built on the meta device
    is initialized first (``param_init_fn``, as without auto mode: the same values for the
    same seed), measured one trial at a time ([Note: one trial at a time] in
    ``osdp/profiler/plans.py``), and built with the plan from the last trial's values.
    ``example_inputs``, ``settings``, ``loss_fn`` and ``auto_kwargs`` given with a plan,
    ``modes`` or ``splits`` would be ignored and are refused (:class:`ConfigError`);
    ``memory_limit`` there is the limit of the per-step memory check.
    """

    def __init__(self, module: nn.Module, plan=None, *, memory_limit=None, example_inputs=None, settings=None,
                 auto_kwargs: dict | None = None, loss_fn=None, param_init_fn=None, **runtime):
        plan = plan_from_arg(plan)  # a Plan, or the path of a plan file (loaded), or a dict
        auto = (plan is None and not runtime.get("modes") and not runtime.get("splits")
                and (memory_limit is not None or example_inputs is not None))
        _check_auto_only_args(auto, {"example_inputs": example_inputs, "loss_fn": loss_fn, "settings": settings,
                                     "auto_kwargs": auto_kwargs})
        if not auto:
            super().__init__(module, plan, memory_limit=memory_limit, param_init_fn=param_init_fn, **runtime)
            return
        if example_inputs is None:
            raise ConfigError("auto mode needs example_inputs= (one forward's arguments: a tuple, or a dict of "
                              "keyword arguments) beside memory_limit=")
        check_wrappable(module)
        # checked before minutes of profiling, not after
        options = RuntimeOptions.from_args(**{k: v for k, v in runtime.items() if k in OPTION_KEYWORDS})
        layout = ShardLayout.from_arg(runtime.get("process_group"), runtime.get("mesh"), runtime.get("node_size"))
        mixed_precision = options.mixed_precision
        # a model on meta is initialized now, drawing what a build without auto mode draws
        on_meta = has_meta(module)
        _check_auto_kwargs(auto_kwargs)
        auto_options = {**dict(auto_kwargs or {}), **({"loss_fn": loss_fn} if loss_fn is not None else {})}
        if runtime.get("leaf_modules"):  # described as the runtime will run them
            auto_options["leaf_modules"] = runtime["leaf_modules"]
        plan, values = plan_with_values(module, example_inputs, memory_limit,
                                        holder=value_holder(module, runtime.get("process_group"), layout,
                                                            mixed_precision, param_init_fn) if on_meta else None,
                                    process_group=runtime.get("process_group"), layout=layout,
                                    settings=_with_precision(settings, mixed_precision),
                                    mixed_precision=mixed_precision, compile=options.compile, **auto_options)
        try:
            if not on_meta:
                values.close()  # a real model's values are its own: no trial is needed beside it
            init = ValuesFrom(module, ShardValues(values.holder(), release=True)) if on_meta else None
            super().__init__(module, plan, memory_limit=memory_limit, param_init_fn=init, **runtime)
            inputs = as_example_inputs(example_inputs)
            self.planned_sample_shapes = sample_shapes(self._forward_signature, inputs.args, inputs.kwargs)
        finally:
            values.close()  # the last trial (a meta model's values) goes, collected at once


def _check_auto_only_args(auto: bool, auto_only: dict) -> None:
    """Arguments only auto mode reads, given where it does not run, are refused rather
    than ignored. (``memory_limit`` is not among them: with a plan or modes it is the
    limit every step's measured peak is checked against.)"""
    unused = [name for name, value in auto_only.items() if value is not None]
    if not auto and unused:
        one = len(unused) == 1
        raise ConfigError(
            f"{', '.join(f'{n}=' for n in unused)} {'is' if one else 'are'} read by auto mode only (memory_limit= "
            f"and example_inputs= with no plan=, modes= or splits=): here {'it' if one else 'they'} would be "
            f"ignored; drop {'it' if one else 'them'}, or plan in auto mode"
        )


# what OSDP itself passes to auto mode: in auto_kwargs they would collide (a TypeError
# naming plan_with_values) or be overridden
_OWN_AUTO_ARGS = ("settings", "mixed_precision", "compile", "process_group", "layout", "holder", "memory_limit",
                  "example_inputs", "model", "leaf_modules")


def _check_auto_kwargs(auto_kwargs) -> None:
    """``auto_kwargs`` is auto_plan's other options: not a mapping, or one of OSDP's own
    arguments in it, is refused naming the argument to use instead."""
    if auto_kwargs is None:
        return
    if not isinstance(auto_kwargs, Mapping):
        raise ConfigError(f"auto_kwargs must be a dict of osdp.auto_plan's options, got {auto_kwargs!r}")
    own = [k for k in auto_kwargs if k in _OWN_AUTO_ARGS]
    if own:
        raise ConfigError(f"auto_kwargs={{{', '.join(repr(k) for k in own)}: ...}}: pass "
                          f"{', '.join(f'{k}=' for k in own)} to osdp.OSDP itself (auto_kwargs holds auto_plan's "
                          "other options: cache_dir, budget_s, progress, ...)")


def _with_precision(settings: PlannerSettings | None, mixed_precision) -> PlannerSettings:
    """``settings`` with the runtime's mixed-precision dtypes (gathered, reduced), unless
    they name their own."""
    settings = settings if settings is not None else PlannerSettings()
    if mixed_precision is None or mixed_precision.param_dtype is None:
        return settings
    if settings.param_dtype_bytes is not None or settings.reduce_dtype_bytes is not None:
        return settings
    param_bytes = torch.empty((), dtype=mixed_precision.param_dtype).element_size()
    reduce_bytes = torch.empty((), dtype=mixed_precision.effective_reduce_dtype).element_size()
    return settings.with_(param_dtype_bytes=param_bytes, reduce_dtype_bytes=reduce_bytes)
