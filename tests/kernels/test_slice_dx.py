import pytest
import torch

import osdp_kernels as K
from kernel_testutil import DEVICE, DTYPES, assert_within_2x_torch, randn, torch_rows

SHAPES = [(1, 233, 96, 17, 50), (37, 233, 200, 0, 200), (70, 64, 130, 64, 66), (33, 97, 300, 150, 129)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slice_dx_writes_only_its_columns(dtype, shape):
    M, N, Kt, k0, ks = shape
    dy, w = randn(M, N, dtype=dtype, seed=1), randn(N, ks, dtype=dtype, seed=2)
    dx = torch.full((M, Kt), float("nan"), dtype=dtype, device=DEVICE)
    sentinel = randn(M, Kt, dtype=dtype, seed=3)
    outside = torch.ones(Kt, dtype=torch.bool)
    outside[k0:k0 + ks] = False
    dx[:, outside] = sentinel[:, outside]  # NaN inside the block (poison), values outside

    ret = K.slice_dx(dy, w, dx, k0)

    assert ret is dx
    assert torch.equal(dx[:, outside], sentinel[:, outside]), "columns outside [k0, k0+ks) changed"
    ref = dy.double() @ w.double()
    assert_within_2x_torch(dx[:, k0:k0 + ks], ref, torch_rows(lambda a: a @ w, dy), "dx block")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dx_dtype", DTYPES, ids=str)
def test_slice_dx_any_output_dtype(dtype, dx_dtype):
    M, N, Kt, k0, ks = 33, 97, 300, 150, 129
    dy, w = randn(M, N, dtype=dtype, seed=1), randn(N, ks, dtype=dtype, seed=2)
    dx = torch.full((M, Kt), float("nan"), dtype=dx_dtype, device=DEVICE)
    K.slice_dx(dy, w, dx, k0)
    assert dx[:, :k0].isnan().all() and dx[:, k0 + ks:].isnan().all()
    ref = dy.double() @ w.double()
    assert_within_2x_torch(dx[:, k0:k0 + ks], ref, (dy @ w).to(dx_dtype), "dx block")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [[200], [64, 64, 72], [12] * 16], ids=["g1", "g3", "g16"])
def test_slices_assemble_full_dx(dtype, splits):
    M, N = 19, 233
    Kt = sum(splits)
    dy, W = randn(M, N, dtype=dtype, seed=4), randn(N, Kt, dtype=dtype, seed=5)
    dx = torch.full((M, Kt), float("nan"), dtype=dtype, device=DEVICE)
    k0 = 0
    for ks in splits:
        K.slice_dx(dy, W[:, k0:k0 + ks], dx, k0)  # W slice as a strided view
        k0 += ks
    assert_within_2x_torch(dx, dy.double() @ W.double(), dy @ W, "dx")
