"""slice_dx: `dx[:, k0:k0+ks] = dy @ w_slice`, the input gradient of one slice of an
input-split Linear, written straight into its column block of the full dx."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from . import _configs


@triton.jit
def _slice_dx_kernel(
    dx_ptr, dy_ptr, w_ptr,
    M, N, K,  # dx block is [M, N=ks], reduced over K = out_features
    stride_xm, stride_xn, stride_ym, stride_yk, stride_wk, stride_wn,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, RTNE_FIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = C.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = C.tile_matmul(dy_ptr, w_ptr, M, N, K, stride_ym, stride_yk, stride_wk, stride_wn,
                        pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # [Note: dx column block] the mask is the only thing keeping this program inside
    # [k0, k0+ks): dx_ptr points at column k0 and N is ks, so neighbouring slices'
    # columns (possibly written concurrently on another stream) are never touched.
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :] * stride_xn
    tl.store(dx_ptrs, C.cast_to(acc, dx_ptr, RTNE_FIX), mask=mask)


# dx is write-only here, so tuning runs need no restore. The list is pruned per GPU
# architecture and dtype at launch (see _configs.py); epilogue_tiles=0: the epilogue reads nothing back.
_slice_dx_tuned = triton.autotune(
    configs=_configs.autotune_configs(), key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": _configs.ArchPruner("dy_ptr", epilogue_tiles=0)},
)(_slice_dx_kernel)


def reference(dy, w_slice, dx, k0):
    """Torch reference: fp32 accumulation, one cast into the column block."""
    ks = w_slice.shape[1]
    dx[:, k0:k0 + ks].copy_(dy.float() @ w_slice.float())
    return dx


def _triton_args(dxs, dy, w_slice):
    """(positional args, constexpr flags) of one kernel launch (also what `aot` compiles)."""
    M, N = dxs.shape
    K = dy.shape[1]
    args = (dxs, dy, w_slice, M, N, K, *dxs.stride(), *dy.stride(), *w_slice.stride())
    flags = dict(RTNE_FIX=C.needs_rtne_fix(dxs.dtype), UPCAST=C.needs_upcast(dy.dtype),
                 PRECISION=C.dot_precision(dy.dtype))
    return args, flags


def _launch_triton(dxs, dy, w_slice):
    M, N = dxs.shape
    args, flags = _triton_args(dxs, dy, w_slice)
    if C.INTERPRET:
        cfg = C.INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _slice_dx_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _slice_dx_tuned[grid](*args, **flags)


def slice_dx(dy: torch.Tensor, w_slice: torch.Tensor, dx: torch.Tensor, k0: int, *,
             backend: str | None = None) -> torch.Tensor:
    """Write `dx[:, k0:k0+ks] = dy @ w_slice` (fp32 accumulation, one cast).

    Args:
        dy: output gradient [M, N] (fp32/fp16/bf16).
        w_slice: [N, ks] weight slice (nn.Linear layout), same dtype as dy.
        dx: full input gradient [M, K_total], any float dtype; only columns
            [k0, k0+ks) are written, the rest is left untouched.
        k0: first column of the slice.
        backend: "triton" | "cuda" | "torch" | None (auto).

    Returns:
        dx.
    """
    C.check_matrix("dy", dy)
    C.check_matrix("w_slice", w_slice)
    C.check_matrix("dx", dx)
    if w_slice.dtype != dy.dtype:
        raise TypeError(f"w_slice dtype {w_slice.dtype} must match dy dtype {dy.dtype}")
    (M, N), ks = dy.shape, w_slice.shape[1]
    if w_slice.shape[0] != N:
        raise ValueError(f"w_slice has {w_slice.shape[0]} rows but dy has {N} columns "
                         "(dy: [M, N], w_slice: [N, ks])")
    if dx.shape[0] != M:
        raise ValueError(f"dx has {dx.shape[0]} rows but dy has {M} (dx: [M, K_total])")
    C.check_slice(k0, ks, dx.shape[1], "dx.shape[1]")
    device = C.check_same_device(dy=dy, w_slice=w_slice, dx=dx)
    backend = C.resolve_backend(backend, device)

    dxs = dx[:, k0:k0 + ks]  # a view: writes land in dx itself
    if M == 0:
        pass
    elif N == 0:
        dxs.zero_()
    elif backend == "torch":
        reference(dy, w_slice, dx, k0)
    elif backend == "cuda":
        from . import _cuda_ops
        C.check_inner_contiguous(dy=dy, w_slice=w_slice, dx=dx)
        _cuda_ops.slice_dx(dxs, dy, w_slice)
    else:
        _launch_triton(dxs, dy, w_slice)
    return dx
