"""Shared helpers: the device the Triton kernels run on, and the error criterion."""
import torch

import osdp_kernels

# Interpreter on CPU without a GPU, compiled kernels on the GPU otherwise (conftest.py).
DEVICE = "cpu" if osdp_kernels.INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape, dtype, device=DEVICE, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def assert_within_2x_torch(got, ref64, torch_res, what=""):
    """Error of `got` against the fp64 reference must be <= 2x the error PyTorch makes
    computing the same thing in the same dtype. Every element must have been written."""
    assert got.shape == ref64.shape, (got.shape, ref64.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite (unwritten/poisoned) elements remain"
    err = (got.double() - ref64).abs().max().item()
    err_pt = (torch_res.double() - ref64).abs().max().item()
    assert err <= 2 * err_pt, f"{what}: max error {err:.3e} > 2 x torch's {err_pt:.3e}"


def torch_rows(fn, a, min_rows=16):
    """PyTorch's result of `fn(a)` (row-wise in a), computed with `a` padded by zero rows.

    [Note: gemv baseline] For a single row MKL switches to a gemv whose summation order
    is more accurate than its own gemm (measured: gemm/gemv max error 2.2x on average,
    up to 5x, on N(0,1) data). The kernels are matrix-matrix products that accumulate
    along K like torch's gemm and cuBLAS, so the "error of PyTorch" is that of its gemm:
    padding only changes which algorithm torch picks, never the values of real rows.
    """
    m = a.shape[0]
    if m >= min_rows:
        return fn(a)
    pad = torch.zeros(min_rows - m, *a.shape[1:], dtype=a.dtype, device=a.device)
    return fn(torch.cat([a, pad]))[:m]
