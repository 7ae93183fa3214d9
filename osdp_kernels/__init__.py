"""Fused split-matmul kernels for OSDP's input-split Linear.

A Linear split along in_features into slices [k0, k0+ks) computes
`Y = sum_i X[:, k_i] @ W[:, k_i].T`. These ops do one slice each, reading the slice of
X through strides (no copy) and accumulating in fp32:

    addmm_slice_(out, x, w_slice, k0, bias=None, cast_to=None, *, cast_out=None, backend=None)
    slice_dx(dy, w_slice, dx, k0, *, backend=None)
    slice_dw(dy, x, k0, ks, out=None, accumulate=False, *, backend=None)

and one vocabulary slice of an LM head fused with cross-entropy (head_ce.py):

    head_ce_forward_slice_(x, w_slice, row0, targets, m, s, target_logit, *, backend=None)
    head_ce_grad_logits(x, w_slice, row0, targets, lse, row_scale, out=None, *, backend=None)
    head_ce_backward_slice(x, w_slice, row0, targets, lse, row_scale, dx_out=None, dw_out=None,
                           accumulate_dw=False, *, chunk_tokens=None, backend=None)

backend: "triton" (default for CUDA tensors), "cuda" (the csrc/cuda tensor-core
kernels, when built), "torch" (the references; default for CPU tensors unless
TRITON_INTERPRET=1 was set before import, then Triton runs in its interpreter).
"""
from . import reference
from ._common import BACKENDS, INTERPRET
from .addmm_slice import addmm_slice_
from .head_ce import head_ce_backward_slice, head_ce_forward_slice_, head_ce_grad_logits
from .slice_dw import slice_dw
from .slice_dx import slice_dx


def cuda_available() -> bool:
    """True when the compiled `osdp_kernels._cuda` module imports (CUDA build present)."""
    from . import _cuda_ops
    return _cuda_ops.available()


__all__ = ["addmm_slice_", "slice_dx", "slice_dw", "head_ce_forward_slice_", "head_ce_grad_logits",
           "head_ce_backward_slice", "reference", "cuda_available", "BACKENDS", "INTERPRET"]
