"""Hugging Face ``Conv1D`` (GPT-2's projections) split along its input axis.

``Conv1D(nf, nx)`` computes ``y = x @ W + b`` with ``W`` of shape ``[nx, nf]``: a Linear
with the weight stored transposed. Split along ``nx`` into ``g`` slices, slice ``i``
owns the rows ``W[k_i:k_i+ks_i, :]`` (contiguous in memory) and
``y = sum_i X[:, k_i:k_i+ks_i] @ W_i + b``; slice 0 also owns the bias.

The schedule is the one of [Note: split linear schedule] in ``split_linear.py``, and
the math goes through the same slice kernels (``osdp.ops.kernels``): ``W_i.t()`` is a
``[nf, ks_i]`` Linear-layout slice, so ``x_s @ W_i`` is ``addmm_slice_`` with that
view, ``dX_s = dY @ W_i^T`` is ``slice_dx``, and ``dW_i = (dY^T @ x_s)^T`` is ``slice_dw``
written through the transposed view of the slice's gradient buffer. Every transpose is
a stride swap, never a copy.

Importing this module imports ``transformers`` (the op is keyed by its ``Conv1D``
type); ``osdp.ops`` registers it on first use when ``transformers`` is loaded.
"""
from __future__ import annotations

import torch

from ..errors import OSDPError
from . import kernels
from .registry import SplitModule, register_split_op, split_sizes

try:
    from transformers.pytorch_utils import Conv1D
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "osdp.ops.split_conv1d splits transformers' Conv1D and needs the `transformers` "
        "package: pip install transformers"
    ) from exc


class _SplitConv1DFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expects_backward: bool, module: "SplitConv1D", *shards):
        sched, units = module.scheduler, module.units
        x2 = x.reshape(-1, module.nx)
        # [Note: split linear schedule]: one fp32 accumulator, cast once at the end
        out = torch.zeros(x2.shape[0], module.nf, dtype=torch.float32, device=x.device)
        uses = []
        for i, unit in enumerate(units):
            use = sched.pre_forward(unit)
            views = unit.views
            bias = views[1] if i == 0 and module.has_bias else None
            # views[0] is W_i [ks, nf]; its transpose is the Linear-layout slice
            kernels.addmm_slice_(out, x2, views[0].t(), module.offsets[i], bias)
            sched.post_forward(use, expects_backward)
            uses.append(use)
        ctx.module, ctx.uses = module, uses
        ctx.save_for_backward(x)
        return out.to(x.dtype).view(*x.shape[:-1], module.nf)

    @staticmethod
    def backward(ctx, dy):
        module, uses = ctx.module, ctx.uses
        sched = module.scheduler
        (x,) = ctx.saved_tensors
        x2 = x.reshape(-1, module.nx)
        dy2 = dy.reshape(-1, module.nf)
        need_dx = ctx.needs_input_grad[0]
        dx = torch.empty_like(x2) if need_dx else None
        for i in reversed(range(module.g)):
            unit, use = module.units[i], uses[i]
            sched.pre_backward(use)
            weight_t = unit.views[0].t()  # [nf, ks]
            if need_dx:
                kernels.slice_dx(dy2, weight_t, dx, module.offsets[i])
            if unit.requires_grad:
                grads, accumulate = sched.grad_buffer(unit)
                # dW_i^T = dY^T @ X_s, written through the transposed gradient view
                kernels.slice_dw(dy2, x2, module.offsets[i], module.sizes[i], out=grads[0].t(), accumulate=accumulate)
                if i == 0 and module.has_bias:
                    db = dy2.sum(0)
                    grads[1].add_(db) if accumulate else grads[1].copy_(db)
            sched.post_backward(use, None)
        dx = dx.view_as(x) if need_dx else None
        return (dx, None, None) + (None,) * module.g


@register_split_op
class SplitConv1D(SplitModule):
    """transformers' ``Conv1D`` cut into ``g`` slices along ``nx`` (its input features,
    ``weight.shape[0]``); uneven sizes allowed, the first ``nx % g`` slices one larger."""

    module_type = Conv1D
    op_name = "conv1d_nx"

    def __init__(self, module: Conv1D, g: int):
        super().__init__(g)
        self.nx, self.nf = module.weight.shape
        self.has_bias = module.bias is not None
        self.sizes = split_sizes(self.nx, g)
        self.offsets = [sum(self.sizes[:i]) for i in range(g)]

    @classmethod
    def check(cls, module: Conv1D, g: int, name: str) -> None:
        nx = module.weight.shape[0]
        if not 1 <= g <= nx:
            raise OSDPError(f"cannot split {name!r} (Conv1D, nx={nx}) into {g} slices: use 1 <= g <= {nx}")

    @classmethod
    def slice_tensors(cls, module: Conv1D, g: int) -> list[dict[str, torch.Tensor]]:
        weight = module.weight.detach()
        result, k0 = [], 0
        for i, ks in enumerate(split_sizes(weight.shape[0], g)):
            tensors = {"weight": weight[k0 : k0 + ks]}
            if i == 0 and module.bias is not None:
                tensors["bias"] = module.bias.detach()
            result.append(tensors)
            k0 += ks
        return result

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        merged = {"weight": torch.cat([s["weight"] for s in slices], dim=0)}
        if "bias" in slices[0]:
            merged["bias"] = slices[0]["bias"]
        return merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decided here: inside Function.forward grad mode is always off
        expects_backward = torch.is_grad_enabled() and (x.requires_grad or any(s.requires_grad for s in self.flat_shards))
        return _SplitConv1DFn.apply(x, expects_backward, self, *self.flat_shards)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, g={self.g}, bias={self.has_bias}"
