"""head_ce: one vocabulary slice of an LM head fused with cross-entropy, so the
[tokens, vocab] logits never exist.

The head `logits = x @ W.T` is cut along vocabulary rows into slices W[r0:r0+rs]. The
loss `logsumexp_v(x . W_v) - x . W_target` is gathered slice by slice:

    head_ce_forward_slice_(x, w_slice, row0, targets, m, s, target_logit)
        forward of one slice: folds the slice's logits into the per-token running max
        `m` and sum `s` (fp32, in place: logsumexp = m + log(s) once every slice was
        seen) and writes `target_logit` for the tokens whose target lies in the slice.
        One program per token tile loops over the slice's rows: no logits are stored.
    head_ce_backward_slice(x, w_slice, row0, targets, lse, row_scale, dx_out=None,
                           dw_out=None, accumulate_dw=False, chunk_tokens=None)
        backward of one slice: recomputes the slice's logits, forms
        `g = (exp(z - lse) - onehot(target)) * row_scale` and returns
        `dx_out += g @ w_slice` (fp32) and `dW = g.T @ x` (fp32 accumulation, one cast).

[Note: backward chunk] dX = G @ W_i and dW_i = G.T @ X contract the slice's grad-logits
G [tokens, rs] along different axes, so no tile of G can be finished and dropped inside
one program without holding a [tile, hidden] accumulator of the other product (hidden
is 4096-16384 for the heads this is for) or adding into dX/dW with atomics. As in
Liger-Kernel's fused linear cross-entropy, G is therefore written for a chunk of tokens
at a time by one fused kernel (matmul recompute + softmax gradient + one-hot + scale +
cast) and the two products run as the split-matmul kernels (`addmm_slice_` into the fp32
dX accumulator, `slice_dw`, fp32 accumulation). The buffer is [chunk_tokens, rs] in x's
dtype, never [tokens, vocab]; callers bound it with `chunk_tokens`.

backend: "triton" (default for CUDA tensors, and on CPU under TRITON_INTERPRET=1) or
"torch" (the references below: fp32 accumulation, same contracts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from . import _configs
from .addmm_slice import addmm_slice_
from .slice_dw import slice_dw

INDEX_DTYPES = (torch.int64, torch.int32)


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------
@triton.jit
def _head_ce_fwd_kernel(
    x_ptr, w_ptr, t_ptr, m_ptr, s_ptr, tgt_ptr, part_m_ptr, part_s_ptr,
    M, N, K, row0, NSPLIT,  # x [M, K], w_slice [N, K]: vocabulary rows row0..row0+N, in NSPLIT column ranges
    stride_xm, stride_xk, stride_wn, stride_wk, stride_t,
    IN_PLACE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Program (pid_m, pid_s) owns BLOCK_M tokens and the pid_s-th of NSPLIT ranges of the
    # slice's rows ([Note: forward split]). With IN_PLACE (NSPLIT == 1) it folds its result
    # into m/s itself (a plain read-modify-write: no other program has these tokens);
    # otherwise it writes its partial max/sum to row pid_s of part_m/part_s.
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NSPLIT)
    b0 = pid_s * per_split
    b1 = tl.minimum(b0 + per_split, n_blocks)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    rows = offs_m.to(tl.int64)
    t = tl.load(t_ptr + rows * stride_t, mask=row_ok, other=-1).to(tl.int64)
    col = t - row0  # the target's column in this slice (outside [0, N): not here)
    m_run = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_run = tl.zeros((BLOCK_M,), tl.float32)
    tgt = tl.zeros((BLOCK_M,), tl.float32)
    for pid_n in range(b0, b1):
        # B[k, n] = w[n, k]: the transpose is a swap of strides.
        z = C.tile_matmul(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                          pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        z = tl.where(offs_n[None, :] < N, z, float("-inf"))  # wrapped columns count for nothing
        m_new = tl.maximum(m_run, tl.max(z, axis=1))  # finite: every block has a real column
        s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_run = m_new
        tgt += tl.sum(tl.where(offs_n[None, :].to(tl.int64) == col[:, None], z, 0.0), axis=1)
    here = row_ok & (col >= b0 * BLOCK_N) & (col < tl.minimum(b1 * BLOCK_N, N))
    tl.store(tgt_ptr + offs_m, tgt, mask=here)
    if IN_PLACE:
        # fold this slice into the state of the slices seen before (m = -inf, s = 0 at start)
        m_old = tl.load(m_ptr + offs_m, mask=row_ok, other=float("-inf"))
        s_old = tl.load(s_ptr + offs_m, mask=row_ok, other=0.0)
        m_new = tl.maximum(m_old, m_run)
        s_new = s_old * tl.exp(m_old - m_new) + s_run * tl.exp(m_run - m_new)
        tl.store(m_ptr + offs_m, m_new, mask=row_ok)
        tl.store(s_ptr + offs_m, s_new, mask=row_ok)
    else:  # an empty range leaves m = -inf, s = 0: it adds nothing when folded in
        part = pid_s.to(tl.int64) * M + offs_m
        tl.store(part_m_ptr + part, m_run, mask=row_ok)
        tl.store(part_s_ptr + part, s_run, mask=row_ok)


@triton.jit
def _head_ce_grad_kernel(
    g_ptr, x_ptr, w_ptr, t_ptr, lse_ptr, scale_ptr,
    M, N, K, row0,  # g [M, N] = grad of the slice's logits for M tokens
    stride_gm, stride_gn, stride_xm, stride_xk, stride_wn, stride_wk, stride_t,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, RTNE_FIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = C.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    z = C.tile_matmul(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                      pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    rows = offs_m.to(tl.int64)
    lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
    scale = tl.load(scale_ptr + offs_m, mask=row_ok, other=0.0)
    t = tl.load(t_ptr + rows * stride_t, mask=row_ok, other=-1).to(tl.int64)
    p = tl.exp(z - lse[:, None])
    p = tl.where(offs_n[None, :].to(tl.int64) == (t - row0)[:, None], p - 1.0, p)
    g = p * scale[:, None]
    mask = row_ok[:, None] & (offs_n[None, :] < N)
    g_ptrs = g_ptr + rows[:, None] * stride_gm + offs_n[None, :] * stride_gn
    tl.store(g_ptrs, C.cast_to(g, g_ptr, RTNE_FIX), mask=mask)


# m/s/target_logit are read-modify-written: restore them between tuning runs. The list is
# pruned per architecture and dtype at launch (_configs.py); epilogue_tiles=1: besides the
# logits tile, exp(z - m) is a second fp32 tile of the same shape live in each step.
_head_ce_fwd_tuned = triton.autotune(
    configs=_configs.autotune_configs(), key=["M", "N", "K", "NSPLIT"],
    restore_value=["m_ptr", "s_ptr", "tgt_ptr"],
    prune_configs_by={"early_config_prune": _configs.ArchPruner("x_ptr", epilogue_tiles=1)},
)(_head_ce_fwd_kernel)

# g is write-only. epilogue_tiles=1: p = exp(z - lse) is a second fp32 tile.
_head_ce_grad_tuned = triton.autotune(
    configs=_configs.autotune_configs(), key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": _configs.ArchPruner("x_ptr", epilogue_tiles=1)},
)(_head_ce_grad_kernel)


# ---------------------------------------------------------------------------------------
# Torch references (fp32 accumulation, no validation, same contracts)
# ---------------------------------------------------------------------------------------
def reference_forward_slice(x, w_slice, row0, targets, m, s, target_logit):
    """Fold `x @ w_slice.T` (the logits of vocabulary rows row0..row0+rs) into m, s and
    target_logit (fp32 [M], in place)."""
    rs = w_slice.shape[0]
    z = x.float() @ w_slice.float().t()
    m_new = torch.maximum(m, z.max(dim=1).values)
    s.mul_(torch.exp(m - m_new)).add_(torch.exp(z - m_new[:, None]).sum(dim=1))
    m.copy_(m_new)
    col = targets.long() - row0
    here = (col >= 0) & (col < rs)
    picked = z.gather(1, col.clamp(0, rs - 1)[:, None]).squeeze(1)
    target_logit.copy_(torch.where(here, picked, target_logit))


def reference_grad_logits(x, w_slice, row0, targets, lse, row_scale, out_dtype):
    """(exp(x @ w_slice.T - lse) - onehot(targets - row0)) * row_scale, cast once."""
    rs = w_slice.shape[0]
    p = torch.exp(x.float() @ w_slice.float().t() - lse[:, None])
    col = targets.long() - row0
    here = (col >= 0) & (col < rs)
    p[here, col[here]] -= 1.0
    return (p * row_scale[:, None]).to(out_dtype)


def reference_backward_slice(x, w_slice, row0, targets, lse, row_scale, dx_out, dw_out, accumulate_dw):
    """dx_out += g @ w_slice (fp32); dW = g.T @ x written to / added into dw_out."""
    g = reference_grad_logits(x, w_slice, row0, targets, lse, row_scale, torch.float32)
    dx_out.add_(g @ w_slice.float())
    dw = g.t() @ x.float()
    if accumulate_dw:
        dw_out.add_(dw)
    else:
        dw_out.copy_(dw)
    return dx_out, dw_out


# ---------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------
def _fwd_triton_args(x, w_slice, row0, targets, m, s, target_logit, part_m=None, part_s=None):
    """(positional args, constexpr flags) of one forward launch (also what `aot` compiles).
    part_m/part_s: [n_split, M] fp32 partials when the slice's rows are split."""
    M, K = x.shape
    N = w_slice.shape[0]
    n_split = 1 if part_m is None else part_m.shape[0]
    args = (x, w_slice, targets, m, s, target_logit, m if part_m is None else part_m,
            s if part_s is None else part_s, M, N, K, row0, n_split,
            *x.stride(), *w_slice.stride(), targets.stride(0))
    flags = dict(IN_PLACE=part_m is None, UPCAST=C.needs_upcast(x.dtype), PRECISION=C.dot_precision(x.dtype))
    return args, flags


# [Note: forward split] One program per token tile walks all of the slice's rows, so a
# batch of M tokens gives only cdiv(M, BLOCK_M) programs: 64 for 8192 tokens at
# BLOCK_M=128, half an H100. The slice's rows are then cut into n_split ranges, one
# program each, whose partial (max, sum) land in an [n_split, M] fp32 scratch and are
# folded into m/s by a few [n_split, M] torch ops; the target logit is written by the
# one program whose range holds it. n_split aims at two programs per SM at BLOCK_M=128.
def default_n_split(M: int, N: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    m_tiles = triton.cdiv(M, 128)
    return max(1, min(triton.cdiv(N, 128), triton.cdiv(2 * sms, m_tiles)))


def _grad_triton_args(g, x, w_slice, row0, targets, lse, row_scale):
    """(positional args, constexpr flags) of one grad-logits launch (also what `aot` compiles)."""
    M, N = g.shape
    K = x.shape[1]
    args = (g, x, w_slice, targets, lse, row_scale, M, N, K, row0,
            *g.stride(), *x.stride(), *w_slice.stride(), targets.stride(0))
    flags = dict(UPCAST=C.needs_upcast(x.dtype), PRECISION=C.dot_precision(x.dtype),
                 RTNE_FIX=C.needs_rtne_fix(g.dtype))
    return args, flags


def _launch_fwd(x, w_slice, row0, targets, m, s, target_logit, n_split):
    M = x.shape[0]
    part_m = part_s = None
    if n_split > 1:
        part_m = torch.empty((n_split, M), dtype=torch.float32, device=x.device)
        part_s = torch.empty((n_split, M), dtype=torch.float32, device=x.device)
    args, flags = _fwd_triton_args(x, w_slice, row0, targets, m, s, target_logit, part_m, part_s)
    if C.INTERPRET:
        cfg = C.INTERPRET_CONFIG
        _head_ce_fwd_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), n_split)](*args, **flags, **cfg)
    else:
        _head_ce_fwd_tuned[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), n_split)](*args, **flags)
    if n_split > 1:  # fold the partials in: [n_split, M] vectors, m/s updated in place
        m_new = torch.maximum(m, part_m.max(dim=0).values)
        s.mul_(torch.exp(m - m_new)).add_((part_s * torch.exp(part_m - m_new)).sum(dim=0))
        m.copy_(m_new)


def _launch_grad(g, x, w_slice, row0, targets, lse, row_scale):
    M, N = g.shape
    args, flags = _grad_triton_args(g, x, w_slice, row0, targets, lse, row_scale)
    if C.INTERPRET:
        cfg = C.INTERPRET_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _head_ce_grad_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _head_ce_grad_tuned[grid](*args, **flags)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------
def _check_vector(name, t, M, dtypes=(torch.float32,)):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != M:
        raise ValueError(f"{name} must have shape ({M},) (one entry per token), got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_head(x, w_slice, row0, targets):
    C.check_matrix("x", x)
    C.check_matrix("w_slice", w_slice)
    if w_slice.dtype != x.dtype:
        raise TypeError(f"w_slice dtype {w_slice.dtype} must match x dtype {x.dtype}")
    if w_slice.shape[1] != x.shape[1]:
        raise ValueError(f"w_slice has {w_slice.shape[1]} columns but x has {x.shape[1]} "
                         "(x: [tokens, hidden], w_slice: [slice_rows, hidden], rows of the vocabulary)")
    if isinstance(row0, bool) or not isinstance(row0, int) or row0 < 0:
        raise ValueError(f"row0 must be a non-negative int (the slice's first vocabulary row), got {row0!r}")
    _check_vector("targets", targets, x.shape[0], INDEX_DTYPES)


# ---------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------
def head_ce_forward_slice_(x: torch.Tensor, w_slice: torch.Tensor, row0: int, targets: torch.Tensor,
                           m: torch.Tensor, s: torch.Tensor, target_logit: torch.Tensor, *,
                           n_split: int | None = None, backend: str | None = None) -> None:
    """Fold one vocabulary slice into the online log-sum-exp state, in place.

    Args:
        x: [M, H] hidden states (fp32/fp16/bf16), any strides.
        w_slice: [rs, H] rows row0..row0+rs of the head weight, same dtype as x.
        row0: vocabulary index of the slice's first row.
        targets: [M] int64/int32 target ids (ignored tokens hold any value outside the
            slice, e.g. -100: they are never picked up).
        m, s: fp32 [M] running max and running sum of exp(logit - m); start at -inf and 0.
        target_logit: fp32 [M]; entries whose target lies in this slice are written
            (fp32 accumulated logit), the others are left untouched.
        n_split: ranges the slice's rows are cut into, one program each per token tile
            ([Note: forward split]); None: `default_n_split` (1 off CUDA).
        backend: "triton" | "torch" | None (auto, see `_common.resolve_backend`).
    """
    _check_head(x, w_slice, row0, targets)
    M = x.shape[0]
    if n_split is not None and (isinstance(n_split, bool) or not isinstance(n_split, int) or n_split < 1):
        raise ValueError(f"n_split must be a positive int or None, got {n_split!r}")
    for name, t in (("m", m), ("s", s), ("target_logit", target_logit)):
        _check_vector(name, t, M)
    device = C.check_same_device(x=x, w_slice=w_slice, targets=targets, m=m, s=s, target_logit=target_logit)
    backend = C.resolve_backend(backend, device)
    if backend == "cuda":
        raise ValueError("head_ce has no csrc/cuda kernel; use backend='triton' or 'torch'")
    if M == 0 or w_slice.shape[0] == 0:
        return
    if backend == "torch":
        reference_forward_slice(x, w_slice, row0, targets, m, s, target_logit)
    else:
        _launch_fwd(x, w_slice, row0, targets, m, s, target_logit,
                    n_split or default_n_split(M, w_slice.shape[0], x.device))


def head_ce_grad_logits(x: torch.Tensor, w_slice: torch.Tensor, row0: int, targets: torch.Tensor,
                        lse: torch.Tensor, row_scale: torch.Tensor, out: torch.Tensor | None = None, *,
                        backend: str | None = None) -> torch.Tensor:
    """`(exp(x @ w_slice.T - lse) - onehot(targets - row0)) * row_scale` -> [M, rs],
    recomputed from x and the slice in one pass (fp32 math, one cast to out's dtype, x's
    dtype by default). The caller keeps M small enough (see [Note: backward chunk])."""
    _check_head(x, w_slice, row0, targets)
    M, rs = x.shape[0], w_slice.shape[0]
    _check_vector("lse", lse, M)
    _check_vector("row_scale", row_scale, M)
    if out is None:
        out = torch.empty((M, rs), dtype=x.dtype, device=x.device)
    else:
        C.check_matrix("out", out)
        if tuple(out.shape) != (M, rs):
            raise ValueError(f"out shape {tuple(out.shape)} must be (tokens, slice_rows) = ({M}, {rs})")
    device = C.check_same_device(x=x, w_slice=w_slice, targets=targets, lse=lse, row_scale=row_scale, out=out)
    backend = C.resolve_backend(backend, device)
    if backend == "cuda":
        raise ValueError("head_ce has no csrc/cuda kernel; use backend='triton' or 'torch'")
    if M == 0 or rs == 0:
        return out
    if backend == "torch":
        out.copy_(reference_grad_logits(x, w_slice, row0, targets, lse, row_scale, torch.float32))
    else:
        _launch_grad(out, x, w_slice, row0, targets, lse, row_scale)
    return out


def head_ce_backward_slice(x: torch.Tensor, w_slice: torch.Tensor, row0: int, targets: torch.Tensor,
                           lse: torch.Tensor, row_scale: torch.Tensor, dx_out: torch.Tensor | None = None,
                           dw_out: torch.Tensor | None = None, accumulate_dw: bool = False, *,
                           chunk_tokens: int | None = None,
                           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of one slice: `dx_out += g @ w_slice` and `dW = g.T @ x` with
    `g = (softmax - onehot) * row_scale` of the slice's logits, recomputed.

    Args:
        x, w_slice, row0, targets: as in `head_ce_forward_slice_`.
        lse: fp32 [M] log-sum-exp over the whole vocabulary (from the forward).
        row_scale: fp32 [M] d loss / d loss_token: grad_out / n_valid for "mean",
            grad_out for "sum", 0 for ignored tokens.
        dx_out: fp32 [M, H] accumulator the slice's dX is added into (a new zeroed one
            when None); sum it over the slices, cast once.
        dw_out: [rs, H] destination of dW. accumulate_dw=False: overwritten (any float
            dtype, w_slice's when None); accumulate_dw=True: fp32 (a main-grad buffer),
            added into.
        chunk_tokens: tokens per grad-logits chunk (see [Note: backward chunk]); the
            transient buffer is [chunk_tokens, rs] in x's dtype. None: all M at once.
        backend: "triton" | "torch" | None (auto).

    Returns:
        (dx_out, dw_out).
    """
    _check_head(x, w_slice, row0, targets)
    (M, H), rs = x.shape, w_slice.shape[0]
    _check_vector("lse", lse, M)
    _check_vector("row_scale", row_scale, M)
    if dx_out is None:
        dx_out = torch.zeros((M, H), dtype=torch.float32, device=x.device)
    else:
        C.check_matrix("dx_out", dx_out, (torch.float32,))
        if tuple(dx_out.shape) != (M, H):
            raise ValueError(f"dx_out shape {tuple(dx_out.shape)} must be x's ({M}, {H}) (an fp32 accumulator)")
    dw_out = C.grad_out_buffer(dw_out, (rs, H), w_slice.dtype, x.device, accumulate_dw, out_name="dw_out",
                               flag_name="accumulate_dw", shape_is="w_slice's ")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    device = C.check_same_device(x=x, w_slice=w_slice, targets=targets, lse=lse, row_scale=row_scale,
                                 dx_out=dx_out, dw_out=dw_out)
    backend = C.resolve_backend(backend, device)
    if backend == "cuda":
        raise ValueError("head_ce has no csrc/cuda kernel; use backend='triton' or 'torch'")
    if rs == 0:
        return dx_out, dw_out
    if M == 0:
        if not accumulate_dw:
            dw_out.zero_()
        return dx_out, dw_out
    if backend == "torch":
        return reference_backward_slice(x, w_slice, row0, targets, lse, row_scale, dx_out, dw_out, accumulate_dw)

    chunk = min(M, chunk_tokens or M)
    n_chunks = triton.cdiv(M, chunk)
    # dW over several chunks is summed in fp32 and cast once (into dw_out's dtype)
    if accumulate_dw or (n_chunks == 1):
        dw_acc = dw_out
    else:
        dw_acc = torch.zeros((rs, H), dtype=torch.float32, device=x.device)
    g = torch.empty((chunk, rs), dtype=x.dtype, device=x.device)
    for c in range(n_chunks):
        r0, r1 = c * chunk, min(M, (c + 1) * chunk)
        gc, xc = g[: r1 - r0], x[r0:r1]  # views: no copies
        _launch_grad(gc, xc, w_slice, row0, targets[r0:r1], lse[r0:r1], row_scale[r0:r1])
        # dx[r0:r1] += g @ w_slice: addmm_slice_ with w_slice.T ([H, rs], a view) as its weight
        addmm_slice_(dx_out[r0:r1], gc, w_slice.t(), 0, backend="triton")
        slice_dw(gc, xc, 0, H, out=dw_acc, accumulate=accumulate_dw or c > 0, backend="triton")
    if dw_acc is not dw_out:
        dw_out.copy_(dw_acc)
    return dx_out, dw_out
