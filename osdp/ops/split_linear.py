"""nn.Linear split along ``in_features``: ``Y = sum_i X[:, k_i] @ W[:, k_i]^T + b``.

Slice ``i`` owns the columns ``W[:, k_i:k_i+ks_i]``; slice 0 also owns the bias, which is
added once (with slice 0's partial product). See [Note: split linear schedule].
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import OSDPError
from . import kernels
from .registry import SplitModule, register_split_op, split_sizes

# [Note: split linear schedule]
# Forward, slice by slice in order 0..g-1: acquire the slice (all-gathered, ahead of use
# within the prefetch window), accumulate its partial product into ONE fp32 buffer,
# release it (a zdp slice is freed right away, a dp slice is kept for backward). The
# output is cast to the input's dtype once, at the end. Only X is saved for backward;
# the X slice is a strided view of it, never a copy.
# Backward walks the slices in reverse (the order the scheduler prefetches in): acquire
# (gather again if zdp), dX slice, dW slice written straight into the unit's unsharded
# gradient buffer, release (reduce-scatter issued asynchronously, weights freed).


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expects_backward: bool, module: "SplitLinear", *shards):
        sched, units = module.scheduler, module.units
        x2 = x.reshape(-1, module.in_features)
        out = torch.zeros(x2.shape[0], module.out_features, dtype=torch.float32, device=x.device)
        uses = []
        for i, unit in enumerate(units):
            use = sched.pre_forward(unit)
            views = unit.views
            bias = views[1] if i == 0 and module.has_bias else None
            kernels.addmm_slice_(out, x2, views[0], module.offsets[i], bias)
            sched.post_forward(use, expects_backward)
            uses.append(use)
        ctx.module, ctx.uses = module, uses
        ctx.save_for_backward(x)
        return out.to(x.dtype).view(*x.shape[:-1], module.out_features)

    @staticmethod
    def backward(ctx, dy):
        module, uses = ctx.module, ctx.uses
        sched = module.scheduler
        (x,) = ctx.saved_tensors
        x2 = x.reshape(-1, module.in_features)
        dy2 = dy.reshape(-1, module.out_features)
        need_dx = ctx.needs_input_grad[0]
        dx = torch.empty_like(x2) if need_dx else None
        for i in reversed(range(module.g)):
            unit, use = module.units[i], uses[i]
            sched.pre_backward(use)
            weight = unit.views[0]
            if need_dx:
                kernels.slice_dx(dy2, weight, dx, module.offsets[i])
            if unit.requires_grad:
                grads, accumulate = sched.grad_buffer(unit)
                kernels.slice_dw(dy2, x2, module.offsets[i], weight.shape[1], out=grads[0], accumulate=accumulate)
                if i == 0 and module.has_bias:
                    if not accumulate and grads[1].dtype == dy2.dtype:
                        torch.sum(dy2, 0, out=grads[1])
                    else:
                        db = dy2.sum(0)
                        grads[1].add_(db) if accumulate else grads[1].copy_(db)
            sched.post_backward(use, None)
        dx = dx.view_as(x) if need_dx else None
        return (dx, None, None) + (None,) * module.g


@register_split_op
class SplitLinear(SplitModule):
    """nn.Linear cut into ``g`` slices along ``in_features`` (uneven sizes allowed:
    the first ``in_features % g`` slices get one more column)."""

    module_type = nn.Linear
    op_name = "linear_in_features"

    def __init__(self, module: nn.Linear, g: int):
        super().__init__(g)
        self.in_features = module.in_features
        self.out_features = module.out_features
        self.has_bias = module.bias is not None
        sizes = split_sizes(module.in_features, g)
        self.sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(g)]

    @classmethod
    def check(cls, module: nn.Linear, g: int, name: str) -> None:
        if not 1 <= g <= module.in_features:
            raise OSDPError(
                f"cannot split {name!r} (Linear, in_features={module.in_features}) into {g} slices: "
                f"use 1 <= g <= {module.in_features}"
            )

    @classmethod
    def slice_tensors(cls, module: nn.Linear, g: int) -> list[dict[str, torch.Tensor]]:
        weight = module.weight.detach()
        result, k0 = [], 0
        for i, ks in enumerate(split_sizes(module.in_features, g)):
            tensors = {"weight": weight[:, k0 : k0 + ks]}
            if i == 0 and module.bias is not None:
                tensors["bias"] = module.bias.detach()
            result.append(tensors)
            k0 += ks
        return result

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        merged = {"weight": torch.cat([s["weight"] for s in slices], dim=1)}
        if "bias" in slices[0]:
            merged["bias"] = slices[0]["bias"]
        return merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decided here: inside Function.forward grad mode is always off
        expects_backward = torch.is_grad_enabled() and (x.requires_grad or any(s.requires_grad for s in self.flat_shards))
        return _SplitLinearFn.apply(x, expects_backward, self, *self.flat_shards)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, g={self.g}, bias={self.has_bias}"
