"""The grouped matmul of mixture-of-experts layers, as describe sees it: its FLOPs and,
on fake tensors, its output shape.

[Note: grouped matmul]
Stock Hugging Face MoE models (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 in transformers
5) keep their experts in one module with 3-D weights and run them with
``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``): the tokens sorted by expert,
``offs`` marking where each expert's rows end. Two gaps in torch 2.13 would make
describe wrong or fail on them:

- ``FlopCounterMode`` has no formula for it, so the experts unit (most of an MoE's
  compute) was described with 0 FLOPs and the cost model took its matmuls as free.
  ``flop_formulas()`` counts 2 * rows * K * N over the groups: every routed row is
  multiplied by its expert's K x N matrix (2-D x 2-D, the weight gradient's layout, sums
  its per-group K slices to the whole K). The rows past ``offs[-1]``, if any, are
  counted too: their number depends on values, which a fake run does not have.
  Transformers' own fallback op (``transformers::grouped_mm_fallback``, which it uses
  under ``torch.compile`` for dtypes other than bf16 and on older torch) has the
  2-D x 3-D layout and is counted the same way when it is registered.
- Its meta kernel accepts bf16 only (the CUDA kernel's restriction), while the CPU
  kernel, which an fp32 model on CPU runs, takes any float dtype; a fake describe of
  an fp32 model raised. ``any_dtype_on_fake()`` gives the op an output of the shape
  the meta kernel would give (``_create_grouped_mm_output_tensor``'s rules) in the
  input's dtype for other dtypes, and leaves bf16 to the meta kernel.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of ``_grouped_mm(a, b, offs)``; see [Note: grouped matmul]."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # (M, K) x (K, N), K cut into groups
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]  # each output element contracts K


def flop_formulas() -> dict:
    """``FlopCounterMode(custom_mapping=...)`` for the grouped matmuls, read when a
    description starts (transformers registers its fallback op when it is imported)."""
    formulas = {_aten._grouped_mm: grouped_mm_flops}
    fallback = getattr(torch.ops.transformers, "grouped_mm_fallback", None)  # (S, K) x (G, K, N)
    if fallback is not None:
        formulas[fallback] = grouped_mm_flops
    return formulas


def grouped_mm_output_shape(a: torch.Tensor, b: torch.Tensor, offs) -> list[int]:
    """The output shape of ``_grouped_mm(a, b, offs)`` (2-D or 3-D operands)."""
    if a.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    return [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]


class _AnyDtypeGroupedMM(TorchDispatchMode):
    """Entered above a FakeTensorMode: see [Note: grouped matmul]."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._grouped_mm.default:
            a, b = args[0], args[1]
            if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
                offs = args[2] if len(args) > 2 else kwargs.get("offs")
                if a.dim() not in (2, 3) or b.dim() not in (2, 3) or (offs is None) == (2 in (a.dim(), b.dim())):
                    # not a layout the op takes: the meta kernel says why (it checks the dtype first)
                    return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
                out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
                return torch.empty(grouped_mm_output_shape(a, b, offs), dtype=out_dtype, device=a.device)
        return func(*args, **kwargs)


def any_dtype_on_fake() -> TorchDispatchMode:
    """A mode to enter inside ``FakeTensorMode`` (see [Note: grouped matmul])."""
    return _AnyDtypeGroupedMM()
