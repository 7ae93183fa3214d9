"""Bridge to the csrc/cuda kernels (`osdp_kernels._cuda`, built without torch): passes
raw pointers, shapes, strides, dtype codes and the current stream. Validation of the
public contract happens in the op wrappers; this module checks what the CUDA side
additionally assumes."""
from __future__ import annotations

import torch

try:
    from . import _cuda as _C
    _IMPORT_ERROR: Exception | None = None
except ImportError as e:  # not built (no nvcc, OSDP_SKIP_CUDA) or built for another Python
    _C, _IMPORT_ERROR = None, e

# Must match `enum DType` in csrc/cuda/split_matmul.cuh.
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available() -> bool:
    return _C is not None


def _module():
    if _C is None:
        raise RuntimeError(
            "backend='cuda' needs the compiled osdp_kernels._cuda module, which failed to import "
            f"({_IMPORT_ERROR}); build it with `pip install -e .` on a machine with nvcc "
            "(OSDP_SKIP_CUDA unset), or use backend='triton'")
    return _C


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _strides(t: torch.Tensor | None) -> tuple[int, int]:
    """Element strides, with 1 for size-1 dims (their stride is arbitrary in torch and
    never used, but the kernel picks each operand's layout by which stride is 1)."""
    if t is None:
        return (0, 0)
    return tuple(st if n > 1 else 1 for n, st in zip(t.shape, t.stride()))


def addmm_slice(out, xs, w, bias, cast_out):
    C = _module()
    M, N = out.shape
    with torch.cuda.device(out.device):
        C.addmm_slice(_ptr(out), *_strides(out), _ptr(xs), *_strides(xs), _ptr(w), *_strides(w),
                      M, N, xs.shape[1], DTYPE_CODE[xs.dtype],
                      _ptr(bias), bias.stride(0) if bias is not None else 0,
                      DTYPE_CODE[bias.dtype] if bias is not None else 0,
                      _ptr(cast_out), *_strides(cast_out),
                      DTYPE_CODE[cast_out.dtype] if cast_out is not None else 0,
                      _stream(out))


def slice_dx(dxs, dy, w):
    C = _module()
    M, N = dxs.shape
    with torch.cuda.device(dxs.device):
        C.slice_dx(_ptr(dxs), *_strides(dxs), DTYPE_CODE[dxs.dtype], _ptr(dy), *_strides(dy),
                   _ptr(w), *_strides(w), M, N, dy.shape[1], DTYPE_CODE[dy.dtype], _stream(dxs))


def slice_dw(out, dy, xs, accumulate):
    C = _module()
    M, N = out.shape
    with torch.cuda.device(out.device):
        C.slice_dw(_ptr(out), *_strides(out), DTYPE_CODE[out.dtype], bool(accumulate),
                   _ptr(dy), *_strides(dy), _ptr(xs), *_strides(xs), M, N, dy.shape[0],
                   DTYPE_CODE[dy.dtype], _stream(out))
