"""Mixed precision: ``OSDP(..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))``.

[Note: mixed precision]
Like FSDP2's ``MixedPrecisionPolicy``:

- the sharded parameters stay in their own dtype (fp32): the master copy the optimizer
  steps, with its state;
- a gather casts the local shard to ``param_dtype`` first and all-gathers that (half
  the bytes for bf16), into a gathered buffer of ``param_dtype``; modules compute with
  views of it, so compute runs in ``param_dtype``;
- floating-point tensors passed to the wrapped model's forward are cast to
  ``param_dtype`` (``cast_forward_inputs``), so activations are in ``param_dtype`` too;
- each unit's unsharded gradient is collected in ``reduce_dtype`` (default:
  ``param_dtype``), reduce-scattered in that dtype and cast into the fp32 sharded
  ``.grad``; gradients accumulated over micro-batches without sync are kept in fp32;
- ``output_dtype``: when set, floating-point outputs of the wrapped model's forward are
  cast to it (e.g. fp32 logits for the loss).

Integer parameters/buffers are left alone. The plan's ``settings["param_dtype_bytes"]``
and ``settings["reduce_dtype_bytes"]`` (what the planner priced) must agree with the
policy: see :func:`check_plan_dtypes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from ..errors import OSDPError, PlanMismatchError


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of gathered parameters / compute (``param_dtype``), of gradient reduction
    (``reduce_dtype``, default ``param_dtype``) and of the model's outputs
    (``output_dtype``, default: left as computed). ``None`` keeps the parameters' own
    dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise OSDPError(f"MixedPrecision.{name} must be a floating-point torch.dtype or None, got {value!r}")

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def cast_inputs(self, args, kwargs):
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        dtype = self.param_dtype

        def cast(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                return t.to(dtype)
            return t

        return tree_map(cast, args), tree_map(cast, kwargs)

    def cast_output(self, output):
        if self.output_dtype is None:
            return output
        dtype = self.output_dtype

        def cast(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                return t.to(dtype)
            return t

        return tree_map(cast, output)


def average_factors(world: int, dtype: torch.dtype) -> tuple[int, float]:
    """[Note: fp16 gradient average] The gradient average over ``world`` ranks is a sum
    then a division. In fp16 (largest 65504) the sum overflows where the mean would not:
    a gradient of 40000 on each of 2 ranks gave inf, where FSDP2 gave 40000, so a loss
    scaler skipped steps FSDP2 takes and kept half its scale. So in fp16 (as FSDP does)
    the gradient is divided by ``pre`` before the sum and the sum by ``post`` after:
    ``pre`` about the square root of ``world``, a power of two dividing it (FSDP's
    factor: 2 for 2 or 4 ranks, 4 for 8 or 16).
    Other dtypes have fp32's range: divided once, after (``pre`` 1). Returns ``(pre,
    post)``, ``pre * post == world``."""
    pre = 1
    if dtype == torch.float16:
        while world % (2 * pre) == 0 and world / pre > pre:
            pre *= 2
    return pre, world / pre


def _bytes(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else torch.empty((), dtype=dtype).element_size()


def check_plan_dtypes(plan, policy: MixedPrecision | None, param_bytes: int) -> None:
    """The plan (an ``osdp.contract.RuntimeConfig``) priced parameters / gradients at
    ``param_dtype_bytes`` / ``reduce_dtype_bytes`` bytes per element (``None``: the model's own dtype,
    ``param_bytes``); the runtime's policy must give the same, or the memory and time
    predictions do not hold."""
    planned_p, planned_r = plan.param_dtype_bytes, plan.reduce_dtype_bytes
    planned_p = param_bytes if planned_p is None else int(planned_p)
    planned_r = planned_p if planned_r is None else int(planned_r)
    policy = policy or MixedPrecision()
    actual_p = _bytes(policy.param_dtype, param_bytes)
    actual_r = _bytes(policy.effective_reduce_dtype, actual_p)
    if (planned_p, planned_r) != (actual_p, actual_r):
        hint = (
            f"pass mixed_precision=osdp.MixedPrecision(param_dtype=<{planned_p}-byte dtype>, "
            f"reduce_dtype=<{planned_r}-byte dtype>)"
            if planned_p != param_bytes or planned_r != param_bytes
            else "drop mixed_precision= (the plan is for the model's own dtype) or plan again with it"
        )
        raise PlanMismatchError(
            f"the plan assumed {planned_p}-byte parameters and {planned_r}-byte gradient reduction, "
            f"the runtime would use {actual_p}-byte parameters and {actual_r}-byte reduction "
            f"(mixed_precision={policy if policy != MixedPrecision() else None}): {hint}"
        )
