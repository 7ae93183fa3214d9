import pytest
import torch
import torch.nn.functional as F

import osdp_kernels as K
from kernel_testutil import DEVICE, DTYPES, assert_within_2x_torch, randn, torch_rows

# (M, N, K_total, k0, ks): M=1, N=233, K not a multiple of the block, odd offsets,
# a slice covering all of K, several row tiles.
SHAPES = [(1, 233, 96, 17, 50), (37, 233, 200, 0, 200), (70, 64, 130, 64, 66), (33, 97, 300, 150, 129)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_addmm_slice_accumulates(dtype, shape, with_bias):
    M, N, Kt, k0, ks = shape
    x, w = randn(M, Kt, dtype=dtype, seed=1), randn(N, ks, dtype=dtype, seed=2)
    b = randn(N, dtype=dtype, seed=3) if with_bias else None
    out0 = randn(M, N, dtype=torch.float32, seed=4)  # a partial sum already in the accumulator
    out = out0.clone()
    xs = x[:, k0:k0 + ks]

    ret = K.addmm_slice_(out, x, w, k0, b)

    assert ret is out
    ref = out0.double() + xs.double() @ w.double().T + (b.double() if with_bias else 0)
    pt = out0 + torch_rows(lambda a: F.linear(a, w, b), xs).float()  # torch in this dtype
    assert_within_2x_torch(out, ref, pt, "out")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cast_dtype", DTYPES, ids=str)
def test_fused_cast_writes_every_element(dtype, cast_dtype):
    M, N, Kt, k0, ks = 33, 97, 300, 150, 129
    x, w, b = randn(M, Kt, dtype=dtype, seed=1), randn(N, ks, dtype=dtype, seed=2), randn(N, dtype=dtype, seed=3)
    out0 = randn(M, N, dtype=torch.float32, seed=4)
    out = out0.clone()
    y = torch.full((M, N), float("nan"), dtype=cast_dtype, device=DEVICE)  # poison

    ret = K.addmm_slice_(out, x, w, k0, b, cast_out=y)

    assert ret is y
    ref = out0.double() + x[:, k0:k0 + ks].double() @ w.double().T + b.double()
    pt = (out0 + F.linear(x[:, k0:k0 + ks], w, b).float()).to(cast_dtype)
    assert_within_2x_torch(y, ref, pt, "cast_out")
    # The cast is of the finished fp32 sum, exactly.
    torch.testing.assert_close(y, out.to(cast_dtype), rtol=0, atol=0)


def test_cast_to_allocates():
    x, w = randn(5, 40, dtype=torch.float16), randn(24, 40, dtype=torch.float16)
    out = torch.zeros(5, 24, device=DEVICE)
    y = K.addmm_slice_(out, x, w, 0, cast_to=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 24)
    torch.testing.assert_close(y, out.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [[200], [64, 64, 72], [12] * 16], ids=["g1", "g3", "g16"])
@pytest.mark.parametrize("strided_x", [False, True], ids=["rowmajor", "colmajor"])
def test_sum_of_slices_is_the_linear(dtype, splits, strided_x):
    M, N = 19, 233
    Kt = sum(splits)
    x = randn(M, Kt, dtype=dtype, seed=5)
    if strided_x:  # same values, column-major storage: slices are read through strides
        x = x.t().contiguous().t()
    W, b = randn(N, Kt, dtype=dtype, seed=6), randn(N, dtype=dtype, seed=7)
    out = torch.zeros(M, N, device=DEVICE)
    k0, y = 0, None
    for i, ks in enumerate(splits):
        last = i == len(splits) - 1
        # bias on the first slice, cast on the last: the runtime's pattern
        y = K.addmm_slice_(out, x, W[:, k0:k0 + ks], k0, b if i == 0 else None,
                           cast_to=dtype if last else None)
        k0 += ks
    ref = x.double() @ W.double().T + b.double()
    pt = F.linear(x, W, b)
    assert_within_2x_torch(y, ref, pt, "y")
    assert_within_2x_torch(out, ref, pt, "fp32 accumulator")


def test_torch_backend_matches_reference_module():
    x, w, b = randn(6, 50, dtype=torch.float32), randn(7, 20, dtype=torch.float32), randn(7, dtype=torch.float32)
    a, r = torch.ones(6, 7, device=DEVICE), torch.ones(6, 7, device=DEVICE)
    K.addmm_slice_(a, x, w, 30, b, backend="torch")
    K.reference.addmm_slice_(r, x, w, 30, b)
    assert torch.equal(a, r)
