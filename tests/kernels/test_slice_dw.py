import pytest
import torch

import osdp_kernels as K
from kernel_testutil import DEVICE, DTYPES, assert_within_2x_torch, randn

SHAPES = [(1, 233, 96, 17, 50), (37, 233, 200, 0, 200), (70, 64, 130, 64, 66), (33, 97, 300, 150, 129)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slice_dw_new_tensor(dtype, shape):
    M, N, Kt, k0, ks = shape
    dy, x = randn(M, N, dtype=dtype, seed=1), randn(M, Kt, dtype=dtype, seed=2)
    g = K.slice_dw(dy, x, k0, ks)
    assert g.dtype == dtype and g.shape == (N, ks)
    xs = x[:, k0:k0 + ks]
    assert_within_2x_torch(g, dy.double().T @ xs.double(), dy.T @ xs, "dW")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slice_dw_accumulates_into_main_grad(dtype, shape):
    M, N, Kt, k0, ks = shape
    dy, x = randn(M, N, dtype=dtype, seed=1), randn(M, Kt, dtype=dtype, seed=2)
    main0 = randn(N, ks, dtype=torch.float32, seed=3)
    main = main0.clone()
    ret = K.slice_dw(dy, x, k0, ks, out=main, accumulate=True)
    assert ret is main
    xs = x[:, k0:k0 + ks]
    ref = main0.double() + dy.double().T @ xs.double()
    assert_within_2x_torch(main, ref, main0 + (dy.T @ xs).float(), "main grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_slice_dw_overwrites_poisoned_out(dtype, out_dtype):
    M, N, Kt, k0, ks = 70, 64, 130, 64, 66
    dy, x = randn(M, N, dtype=dtype, seed=1), randn(M, Kt, dtype=dtype, seed=2)
    out = torch.full((N, ks), float("nan"), dtype=out_dtype, device=DEVICE)
    K.slice_dw(dy, x, k0, ks, out=out)
    xs = x[:, k0:k0 + ks]
    assert_within_2x_torch(out, dy.double().T @ xs.double(), (dy.T @ xs).to(out_dtype), "dW")


def test_micro_batches_accumulate_like_the_full_batch():
    """Two accumulate=True calls over halves of the tokens == one call over all of them."""
    M, N, Kt, k0, ks = 64, 97, 150, 30, 100
    dy, x = randn(M, N, dtype=torch.bfloat16, seed=4), randn(M, Kt, dtype=torch.bfloat16, seed=5)
    main = torch.zeros(N, ks, device=DEVICE)
    for rows in (slice(0, 40), slice(40, M)):
        K.slice_dw(dy[rows], x[rows], k0, ks, out=main, accumulate=True)
    xs = x[:, k0:k0 + ks]
    assert_within_2x_torch(main, dy.double().T @ xs.double(), (dy.T @ xs).float(), "main grad")
