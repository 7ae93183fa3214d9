"""slice_dw: `dy.T @ x[:, k0:k0+ks]`, the weight gradient of one slice of an input-split
Linear, optionally accumulated into an fp32 main-grad buffer in the same pass."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from . import _configs


@triton.jit
def _slice_dw_kernel(
    out_ptr, dy_ptr, x_ptr,
    M, N, K,  # out is [M=out_features, N=ks], reduced over K = tokens
    stride_om, stride_on, stride_ym, stride_yk, stride_xk, stride_xn,
    ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, RTNE_FIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = C.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # A[m, k] = dy[k, m]: dy.T is a swap of strides.
    acc = C.tile_matmul(dy_ptr, x_ptr, M, N, K, stride_ym, stride_yk, stride_xk, stride_xn,
                        pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    if ACCUMULATE:  # fp32 main grad: read-add-write in the same pass, no temp
        acc += tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, C.cast_to(acc, out_ptr, RTNE_FIX), mask=mask)


# With ACCUMULATE the output is read-modify-written: restore it between tuning runs.
# The list is pruned per GPU architecture and dtype at launch (see _configs.py);
# epilogue_tiles=1: with ACCUMULATE the fp32 main-grad tile is read back (counted always).
_slice_dw_tuned = triton.autotune(
    configs=_configs.autotune_configs(), key=["M", "N", "K"], restore_value=["out_ptr"],
    prune_configs_by={"early_config_prune": _configs.ArchPruner("dy_ptr", epilogue_tiles=1)},
)(_slice_dw_kernel)


def reference(dy, x, k0, ks, out, accumulate):
    """Torch reference: fp32 accumulation, one cast (or an fp32 add) into `out`."""
    g = dy.float().t() @ x[:, k0:k0 + ks].float()
    if accumulate:
        out.add_(g)
    else:
        out.copy_(g)
    return out


def _triton_args(out, dy, xs, accumulate):
    """(positional args, constexpr flags) of one kernel launch (also what `aot` compiles)."""
    M, N = out.shape
    K = dy.shape[0]
    # strides of A = dy.T and B = xs
    args = (out, dy, xs, M, N, K, *out.stride(), dy.stride(1), dy.stride(0), *xs.stride())
    flags = dict(ACCUMULATE=accumulate, RTNE_FIX=C.needs_rtne_fix(out.dtype),
                 UPCAST=C.needs_upcast(dy.dtype), PRECISION=C.dot_precision(dy.dtype))
    return args, flags


def _launch_triton(out, dy, xs, accumulate):
    M, N = out.shape
    args, flags = _triton_args(out, dy, xs, accumulate)
    if C.INTERPRET:
        cfg = C.INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _slice_dw_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _slice_dw_tuned[grid](*args, **flags)


def slice_dw(dy: torch.Tensor, x: torch.Tensor, k0: int, ks: int, out: torch.Tensor | None = None,
             accumulate: bool = False, *, backend: str | None = None) -> torch.Tensor:
    """`dy.T @ x[:, k0:k0+ks]` -> [N, ks] (fp32 accumulation).

    Args:
        dy: output gradient [M, N] (fp32/fp16/bf16).
        x: full input [M, K_total], same dtype as dy; the slice is read through strides.
        k0, ks: the slice's first column and width.
        out: optional [N, ks] destination. With accumulate=False it is overwritten (any
            float dtype); with accumulate=True it must be fp32 (a main-grad buffer) and
            the product is added to it in the same pass.
        accumulate: add into `out` instead of overwriting it.
        backend: "triton" | "cuda" | "torch" | None (auto).

    Returns:
        out, or a new [N, ks] tensor of dy's dtype when out is None.
    """
    C.check_matrix("dy", dy)
    C.check_matrix("x", x)
    if x.dtype != dy.dtype:
        raise TypeError(f"x dtype {x.dtype} must match dy dtype {dy.dtype}")
    M, N = dy.shape
    if x.shape[0] != M:
        raise ValueError(f"x has {x.shape[0]} rows but dy has {M} (both are [tokens, features])")
    if isinstance(ks, bool) or not isinstance(ks, int):
        raise TypeError(f"ks must be an int, got {type(ks).__name__}")
    C.check_slice(k0, ks, x.shape[1], "x.shape[1]")
    out = C.grad_out_buffer(out, (N, ks), dy.dtype, dy.device, accumulate, out_name="out", flag_name="accumulate",
                            shape_is="(N, ks) = ")
    device = C.check_same_device(dy=dy, x=x, out=out)
    backend = C.resolve_backend(backend, device)

    xs = x[:, k0:k0 + ks]  # a view: no copy
    if N == 0:
        pass
    elif M == 0:
        if not accumulate:
            out.zero_()
    elif backend == "torch":
        reference(dy, x, k0, ks, out, accumulate)
    elif backend == "cuda":
        from . import _cuda_ops
        C.check_inner_contiguous(dy=dy, x=x, out=out)
        _cuda_ops.slice_dw(out, dy, xs, accumulate)
    else:
        _launch_triton(out, dy, xs, bool(accumulate))
    return out
