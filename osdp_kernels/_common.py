"""Shared pieces of the split-matmul ops: mode detection, backend choice, input
validation, and the Triton tile loop every op's kernel is built on."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# [Note: interpreter mode is fixed at import]
# triton.jit decides between compiling and interpreting when the kernel is *decorated*,
# i.e. when this package is imported. We read the same knob at the same moment so the
# dispatch below agrees with what the kernels really are, even if TRITON_INTERPRET is
# changed afterwards (tests/kernels/conftest.py unsets it again after importing us).
INTERPRET: bool = bool(triton.knobs.runtime.interpret)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("triton", "cuda", "torch")

# Fixed launch config under the interpreter: an autotuned kernel cannot be called there,
# and interpreter cost grows with programs x K-steps, so blocks are large.
INTERPRET_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4)


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """`None` picks Triton for CUDA tensors, and for CPU tensors the Triton interpreter
    when TRITON_INTERPRET=1 was set before import, else the torch reference."""
    if backend is None:
        return "triton" if (device.type == "cuda" or INTERPRET) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device.type}); to run Triton on CPU "
            "set TRITON_INTERPRET=1 before importing osdp_kernels, or use backend='torch'")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs CUDA tensors, got tensors on {device.type}")
    return backend


def check_matrix(name: str, t, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def grad_out_buffer(out, shape: tuple, dtype: torch.dtype, device, accumulate: bool, *, out_name: str,
                    flag_name: str, shape_is: str):
    """The weight-gradient output of a dW kernel: ``out`` checked (2-D, ``shape``, fp32
    when ``accumulate``: the main-grad buffer added into), or a new ``dtype`` tensor.
    ``out_name`` / ``flag_name`` name the caller's arguments in the errors; ``shape_is``
    says where ``shape`` comes from (e.g. "w_slice's ")."""
    if out is None:
        if accumulate:
            raise ValueError(f"{flag_name}=True needs {out_name}= (the fp32 main-grad buffer to add into)")
        return torch.empty(shape, dtype=dtype, device=device)
    check_matrix(out_name, out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{out_name} shape {tuple(out.shape)} must be {shape_is}({shape[0]}, {shape[1]})")
    if accumulate and out.dtype != torch.float32:
        raise TypeError(f"{flag_name}=True needs an fp32 {out_name} (main grad), got {out.dtype}")
    return out


def check_same_device(**tensors) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"all tensors must be on one device, got {devices}")
    return first


def check_slice(k0, ks: int, k_total: int, what: str) -> None:
    if not isinstance(k0, int) or isinstance(k0, bool):
        raise TypeError(f"k0 must be an int, got {type(k0).__name__}")
    if ks < 1:
        raise ValueError(f"slice width ks must be >= 1, got {ks}")
    if k0 < 0 or k0 + ks > k_total:
        raise ValueError(
            f"slice [k0, k0+ks) = [{k0}, {k0 + ks}) must lie within [0, {k_total}) ({what})")


def check_inner_contiguous(**tensors) -> None:
    """The CUDA kernels read/write rows with unit inner stride (leading stride free)."""
    for name, t in tensors.items():
        if t is not None and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(
                f"backend='cuda' needs {name} with unit stride along dim 1, got strides "
                f"{tuple(t.stride())}; pass a row-major tensor (e.g. {name}.contiguous()) "
                "or use backend='triton'")


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's own matmul setting so "fp32" means the same thing in
    # both; the value is ignored for fp16/bf16 operands.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def needs_upcast(dtype: torch.dtype) -> bool:
    # [Note: bf16 in the interpreter] numpy has no bf16, and the interpreter's tl.dot on
    # bf16 operands returns garbage without an error; upcasting the tiles to fp32 first
    # is exact (bf16 -> fp32 is lossless), so results stay comparable to the GPU path.
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a linear program id to (pid_m, pid_n) walking GROUP_M row-tiles at a time, so
    consecutive programs reuse the same B column-tiles from L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_rows)
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def tile_matmul(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                pid_m, pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of A[M, K] @ B[K, N], both read through strides.

    Rows/cols past M/N wrap around (modulo) instead of being masked: they only feed
    output elements the caller's store masks off. K is masked (zeros add nothing)."""
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row/col bases: M * leading stride can pass 2**31 for long sequences.
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if PRECISION == "ieee":
            # [Note: fp32 two-level sum] each K tile sums into a fresh partial that is
            # then added to the accumulator, so rounding error grows with BLOCK_K +
            # K / BLOCK_K instead of K: cuBLAS splits K on small grids, and our one-level
            # chain had 2.8x-5.5x its error there (H200, bench/results/gpu_20261127).
            # The partial starts from a zero the compiler cannot see as a constant:
            # from `acc + dot(a, b, 0)` Triton's combine pass makes `dot(a, b, acc)`.
            fresh = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + k_left.to(tl.float32) * 0.0
            acc += tl.dot(a, b, fresh, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


def needs_rtne_fix(dtype: torch.dtype) -> bool:
    # [Note: bf16 rounding in the interpreter] the interpreter's fp32 -> bf16 cast
    # truncates (and its round-to-nearest variant can carry into the exponent bits), so
    # there we round to nearest-even by hand; GPUs round correctly in hardware.
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def cast_to(acc, dst_ptr, RTNE_FIX: tl.constexpr):
    """acc (fp32) cast to dst_ptr's element type, rounding to nearest-even."""
    if RTNE_FIX:  # bf16 = upper half of the fp32 bits after adding half an ulp (ties to even)
        bits = acc.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(dst_ptr.dtype.element_ty)
