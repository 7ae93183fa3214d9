"""Slice matmuls: ``osdp_kernels`` on CUDA when it is importable, torch otherwise.

The torch versions are the reference semantics the kernels must match:

- ``addmm_slice_(out, x, w_slice, k0, bias=None)``: ``out += x[:, k0:k0+ks] @ w_slice.T
  (+ bias)``, ``out`` an fp32 accumulator;
- ``slice_dx(dy, w_slice, dx, k0)``: ``dx[:, k0:k0+ks] = dy @ w_slice``;
- ``slice_dw(dy, x, k0, ks, out=None, accumulate=False)``: ``dy.T @ x[:, k0:k0+ks]``,
  written to (or added into) ``out`` when given.

The slice of ``x`` is always a strided view, never a copy.
"""
from __future__ import annotations

import torch

def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype slice sums accumulate in: fp32, or the input's where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


_NOT_LOADED = object()
_kernels = _NOT_LOADED  # imported at the first CUDA call: Triton costs the planner and CPU runs ~80 MiB


def kernels_module():
    """``osdp_kernels`` when it imports (it needs triton), else None; imported on first
    use (the vocabulary-split head loss, ``head_cross_entropy.py``, dispatches through
    it too)."""
    global _kernels
    if _kernels is _NOT_LOADED:
        try:  # another package; the runtime must work without it
            import osdp_kernels as module
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            module = None
        _kernels = module
    return _kernels


def _kernel(name: str, tensor: torch.Tensor):
    if not tensor.is_cuda:
        return None
    return getattr(kernels_module(), name, None)


def ref_addmm_slice_(out, x, w_slice, k0, bias=None):
    xs = x[:, k0 : k0 + w_slice.shape[1]]
    if xs.dtype == out.dtype and w_slice.dtype == out.dtype:
        out.addmm_(xs, w_slice.t())
    else:  # in x's dtype (autocast's, when the split op runs under it), added up in out's
        out.add_(torch.mm(xs, w_slice.t().to(xs.dtype)).to(out.dtype))
    if bias is not None:
        out.add_(bias.to(out.dtype))
    return out


def ref_slice_dx(dy, w_slice, dx, k0):
    block = dx[:, k0 : k0 + w_slice.shape[1]]
    if dx.dtype == dy.dtype:
        # straight into dX's column block: a row-major block with leading dimension K is a
        # valid GEMM output, so no (M, ks) temporary (it was one slice of dX more at the
        # peak of a K-split op's backward, which the memory model does not count)
        torch.mm(dy, w_slice.to(dy.dtype), out=block)
    else:
        block.copy_(torch.mm(dy, w_slice.to(dy.dtype)))
    return dx


def ref_slice_dw(dy, x, k0, ks, out=None, accumulate=False):
    xs = x[:, k0 : k0 + ks]
    if out is not None and out.dtype == dy.dtype == x.dtype:
        # straight into (or onto) the gradient buffer: no temporary, no copy
        if accumulate:
            return out.addmm_(dy.t(), xs)
        return torch.mm(dy.t(), xs, out=out)
    dw = torch.mm(dy.t(), xs)
    if out is None:
        return dw
    if accumulate:
        out.add_(dw.to(out.dtype))
    else:
        out.copy_(dw)
    return out


def addmm_slice_(out, x, w_slice, k0, bias=None):
    # the fused kernels take one input dtype; under autocast x is in its dtype, the
    # weights in theirs
    fn = _kernel("addmm_slice_", out) if x.dtype == w_slice.dtype else None
    return (fn or ref_addmm_slice_)(out, x, w_slice, k0, bias)


def slice_dx(dy, w_slice, dx, k0):
    fn = _kernel("slice_dx", dy) if dy.dtype == w_slice.dtype else None
    return (fn or ref_slice_dx)(dy, w_slice, dx, k0)


def slice_dw(dy, x, k0, ks, out=None, accumulate=False):
    fn = _kernel("slice_dw", dy)
    if fn is None:
        return ref_slice_dw(dy, x, k0, ks, out=out, accumulate=accumulate)
    return fn(dy, x, k0, ks, out=out, accumulate=accumulate)
