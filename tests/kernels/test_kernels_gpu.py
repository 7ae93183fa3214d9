"""Compiled kernels on a GPU: Triton (autotuned) and the csrc/cuda tensor-core kernels,
at shapes large enough to use several tiles and autotuned configs."""
import pytest
import torch
import torch.nn.functional as F

import osdp_kernels as K
from kernel_testutil import assert_within_2x_torch, torch_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = ["triton", pytest.param("cuda", marks=pytest.mark.skipif(
    not K.cuda_available(), reason="osdp_kernels._cuda not built"))]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (M, N, K_total, k0, ks): odd everything, one slice at an unaligned offset.
SHAPES = [(1, 233, 512, 17, 300), (515, 1000, 1536, 512, 512), (2048, 1024, 4096, 1000, 1023)]


def rnd(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_addmm_slice_gpu(backend, dtype, shape):
    M, N, Kt, k0, ks = shape
    x, w, b = rnd(M, Kt, dtype=dtype), rnd(N, ks, dtype=dtype), rnd(N, dtype=dtype)
    out0 = rnd(M, N, dtype=torch.float32)
    out = out0.clone()
    y = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
    K.addmm_slice_(out, x, w, k0, b, cast_out=y, backend=backend)
    xs = x[:, k0:k0 + ks]
    ref = out0.double() + xs.double() @ w.double().T + b.double()
    pt = out0 + torch_rows(lambda a: F.linear(a, w, b), xs).float()
    assert_within_2x_torch(out, ref, pt, "out")
    assert_within_2x_torch(y, ref, pt.to(dtype), "cast_out")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slice_dx_gpu(backend, dtype, shape):
    M, N, Kt, k0, ks = shape
    dy, w = rnd(M, N, dtype=dtype), rnd(N, ks, dtype=dtype)
    dx = torch.full((M, Kt), float("nan"), dtype=dtype, device="cuda")
    K.slice_dx(dy, w, dx, k0, backend=backend)
    assert dx[:, :k0].isnan().all() and dx[:, k0 + ks:].isnan().all()
    assert_within_2x_torch(dx[:, k0:k0 + ks], dy.double() @ w.double(), torch_rows(lambda a: a @ w, dy), "dx")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slice_dw_gpu(backend, dtype, shape):
    M, N, Kt, k0, ks = shape
    dy, x = rnd(M, N, dtype=dtype), rnd(M, Kt, dtype=dtype)
    xs = x[:, k0:k0 + ks]
    g = torch.full((N, ks), float("nan"), dtype=dtype, device="cuda")
    K.slice_dw(dy, x, k0, ks, out=g, backend=backend)
    assert_within_2x_torch(g, dy.double().T @ xs.double(), dy.T @ xs, "dW")
    main0 = rnd(N, ks, dtype=torch.float32)
    main = main0.clone()
    K.slice_dw(dy, x, k0, ks, out=main, accumulate=True, backend=backend)
    assert_within_2x_torch(main, main0.double() + dy.double().T @ xs.double(), main0 + (dy.T @ xs).float(), "main")


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_forward_allocates_nothing(backend):
    """The slice of x is a view: after warm-up (autotuning) a slice step allocates 0 bytes."""
    M, N, g, ks = 4096, 2048, 4, 512
    x, W = rnd(M, g * ks, dtype=torch.bfloat16), rnd(N, g * ks, dtype=torch.bfloat16)
    slices = [W[:, i * ks:(i + 1) * ks].contiguous() for i in range(g)]
    out = torch.zeros(M, N, device="cuda")
    for i in range(g):  # warm-up
        K.addmm_slice_(out, x, slices[i], i * ks, backend=backend)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(g):
        K.addmm_slice_(out, x, slices[i], i * ks, backend=backend)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == base
