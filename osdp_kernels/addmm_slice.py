"""addmm_slice_: `out += x[:, k0:k0+ks] @ w_slice.T (+ bias)`, the forward of one slice
of an input-split Linear, with an optional fused cast of the finished sum."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from . import _configs


@triton.jit
def _addmm_slice_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr, cast_ptr,
    M, N, K,
    stride_om, stride_on, stride_xm, stride_xk, stride_wn, stride_wk, stride_cm, stride_cn, stride_b,
    HAS_BIAS: tl.constexpr, HAS_CAST: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, RTNE_FIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = C.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # B[k, n] = w[n, k]: the transpose is only a swap of strides.
    acc = C.tile_matmul(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                        pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = offs_m.to(tl.int64)[:, None]
    out_ptrs = out_ptr + rows * stride_om + offs_n[None, :] * stride_on
    acc += tl.load(out_ptrs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n * stride_b, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc, mask=mask)
    if HAS_CAST:
        cast_ptrs = cast_ptr + rows * stride_cm + offs_n[None, :] * stride_cn
        tl.store(cast_ptrs, C.cast_to(acc, cast_ptr, RTNE_FIX), mask=mask)


# `out` is read-modify-written: every tuning run must start from the caller's values.
# The list is pruned per GPU architecture and dtype at launch (see _configs.py);
# epilogue_tiles=1: the fp32 `out` tile is read back in the epilogue.
_addmm_slice_tuned = triton.autotune(
    configs=_configs.autotune_configs(), key=["M", "N", "K"], restore_value=["out_ptr"],
    prune_configs_by={"early_config_prune": _configs.ArchPruner("x_ptr", epilogue_tiles=1)},
)(_addmm_slice_kernel)


def reference(out, x, w_slice, k0, bias=None, cast_out=None):
    """Torch reference: fp32 accumulation, same contract as the kernel."""
    ks = w_slice.shape[1]
    out.addmm_(x[:, k0:k0 + ks].float(), w_slice.float().t())
    if bias is not None:
        out.add_(bias.float())
    if cast_out is not None:
        cast_out.copy_(out)
    return out


def _triton_args(out, xs, w_slice, bias, cast_out):
    """(positional args, constexpr flags) of one kernel launch; `osdp_kernels.aot`
    compiles from the same tuple, so what it checks is what runs."""
    M, N = out.shape
    K = xs.shape[1]
    args = (out, xs, w_slice, bias if bias is not None else out, cast_out if cast_out is not None else out,
            M, N, K, *out.stride(), *xs.stride(), *w_slice.stride(),
            *(cast_out.stride() if cast_out is not None else out.stride()),
            bias.stride(0) if bias is not None else 0)
    flags = dict(HAS_BIAS=bias is not None, HAS_CAST=cast_out is not None,
                 RTNE_FIX=cast_out is not None and C.needs_rtne_fix(cast_out.dtype),
                 UPCAST=C.needs_upcast(xs.dtype), PRECISION=C.dot_precision(xs.dtype))
    return args, flags


def _launch_triton(out, xs, w_slice, bias, cast_out):
    M, N = out.shape
    args, flags = _triton_args(out, xs, w_slice, bias, cast_out)
    if C.INTERPRET:
        cfg = C.INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _addmm_slice_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _addmm_slice_tuned[grid](*args, **flags)


def addmm_slice_(out: torch.Tensor, x: torch.Tensor, w_slice: torch.Tensor, k0: int,
                 bias: torch.Tensor | None = None, cast_to: torch.dtype | None = None, *,
                 cast_out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """`out += x[:, k0:k0+ks] @ w_slice.T (+ bias)` in place, in one pass.

    Args:
        out: fp32 accumulator [M, N], updated in place.
        x: full input [M, K_total] (fp32/fp16/bf16); the slice is read through strides,
            never copied.
        w_slice: [N, ks] weight slice in nn.Linear layout, same dtype as x.
        k0: first input column of the slice; ks = w_slice.shape[1].
        bias: optional [N] bias added in the same pass (pass it with one slice only).
        cast_to: dtype of a cast copy of the finished sum (use on the last slice);
            a new [M, N] tensor is allocated for it unless `cast_out` is given.
        cast_out: preallocated [M, N] tensor receiving `out` cast to its dtype.
        backend: "triton" | "cuda" | "torch" | None (auto, see `_common.resolve_backend`).

    Returns:
        `out`, or the cast tensor when `cast_to` or `cast_out` is given (`out` still
        holds the fp32 sum).
    """
    C.check_matrix("out", out, (torch.float32, torch.float16, torch.bfloat16))
    if out.dtype != torch.float32:
        raise TypeError(f"out must be the fp32 accumulator, got {out.dtype}; allocate it as "
                        "torch.zeros(M, N, dtype=torch.float32) and pass cast_to for the output dtype")
    C.check_matrix("x", x)
    C.check_matrix("w_slice", w_slice)
    if w_slice.dtype != x.dtype:
        raise TypeError(f"w_slice dtype {w_slice.dtype} must match x dtype {x.dtype}")
    (M, N), ks = out.shape, w_slice.shape[1]
    if x.shape[0] != M:
        raise ValueError(f"x has {x.shape[0]} rows but out has {M} (x: [M, K_total], out: [M, N])")
    if w_slice.shape[0] != N:
        raise ValueError(f"w_slice has {w_slice.shape[0]} rows but out has {N} columns "
                         "(w_slice: [N, ks] in nn.Linear layout)")
    C.check_slice(k0, ks, x.shape[1], "x.shape[1]")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (N,) or bias.dtype not in C.FLOAT_DTYPES:
            raise ValueError(f"bias must be a float tensor of shape ({N},), got "
                             f"{getattr(bias, 'shape', type(bias).__name__)} {getattr(bias, 'dtype', '')}")
    if cast_out is not None:
        C.check_matrix("cast_out", cast_out)
        if cast_out.shape != out.shape:
            raise ValueError(f"cast_out shape {tuple(cast_out.shape)} must equal out shape {tuple(out.shape)}")
        if cast_to is not None and cast_to != cast_out.dtype:
            raise ValueError(f"cast_to={cast_to} disagrees with cast_out.dtype={cast_out.dtype}")
    elif cast_to is not None:
        if cast_to not in C.FLOAT_DTYPES:
            raise TypeError(f"cast_to must be one of {[str(d) for d in C.FLOAT_DTYPES]}, got {cast_to}")
        cast_out = torch.empty(out.shape, dtype=cast_to, device=out.device)
    device = C.check_same_device(out=out, x=x, w_slice=w_slice, bias=bias, cast_out=cast_out)
    backend = C.resolve_backend(backend, device)

    xs = x[:, k0:k0 + ks]  # a view: no copy
    if M == 0 or N == 0:
        pass
    elif backend == "torch":
        reference(out, x, w_slice, k0, bias, cast_out)
    elif backend == "cuda":
        from . import _cuda_ops
        C.check_inner_contiguous(out=out, x=x, w_slice=w_slice, cast_out=cast_out)
        _cuda_ops.addmm_slice(out, xs, w_slice, bias, cast_out)
    else:
        _launch_triton(out, xs, w_slice, bias, cast_out)
    return out if cast_out is None else cast_out
