"""Fused split-matmul kernels for OSDP's input-split Linear.

A Linear split along in_features into slices [k0, k0+ks) computes
`Y = sum_i X[:, k_i] @ W[:, k_i].T`. These ops do one slice each, reading the slice of
X through strides (no copy) and accumulating in fp32:

    addmm_slice_(out, x, w_slice, k0, bias=None, cast_to=None, *, cast_out=None, backend=None)
    slice_dx(dy, w_slice, dx, k0, *, backend=None)
    slice_dw(dy, x, k0, ks, out=None, accumulate=False, *, backend=None)

backend: "triton" (default for CUDA tensors), "cuda" (the csrc/cuda tensor-core
kernels, when built), "torch" (the references; default for CPU tensors unless
TRITON_INTERPRET=1 was set before import, then Triton runs in its interpreter).
"""
from . import reference
from ._common import BACKENDS, INTERPRET
from .addmm_slice import addmm_slice_
from .slice_dw import slice_dw
from .slice_dx import slice_dx


def cuda_available() -> bool:
    """True when the compiled `osdp_kernels._cuda` module imports (CUDA build present)."""
    from . import _cuda_ops
    return _cuda_ops.available()


__all__ = ["addmm_slice_", "slice_dx", "slice_dw", "reference", "cuda_available", "BACKENDS", "INTERPRET"]
