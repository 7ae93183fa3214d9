"""osdp_kernels.head_ce (vocabulary slice of an LM head + cross-entropy) against fp64
references, in the Triton interpreter without a GPU: odd shapes (tokens and slice rows
not multiples of the blocks, uneven slices, a one-row slice), ignore_index, an
all-ignored batch, fp32 within 1e-6 of `F.cross_entropy(x @ W.T, t)` against fp64, and
fp16/bf16 within 2x PyTorch's own error in that dtype (both against fp64)."""
import pytest
import torch
import torch.nn.functional as F

import osdp_kernels as K
from kernel_testutil import DEVICE, DTYPES, assert_within_2x_torch, randn, torch_rows
from osdp.ops import split_head_cross_entropy

IGNORE = -100
# (tokens, hidden, slice sizes): tokens past a 32-row tile, vocab rows past a 64-row
# block, uneven slices, a 1-row slice, one token
SHAPES = [(37, 96, [110, 100, 90]), (70, 130, [65, 64]), (33, 72, [97, 1, 50]), (1, 50, [233])]


def _case(M, H, sizes, dtype, seed=0, ignore_every=5):
    V = sum(sizes)
    x = randn(M, H, dtype=dtype, seed=seed)
    W = (randn(V, H, dtype=torch.float64, seed=seed + 1) / H**0.5).to(dtype)  # logits ~ N(0, 1)
    g = torch.Generator().manual_seed(seed + 2)
    t = torch.randint(0, V, (M,), generator=g)
    if M > 1:
        t[::ignore_every] = IGNORE
        if len(sizes) > 1:
            t[1] = sizes[0]  # a target on a slice boundary
    return x, W, t.to(DEVICE)


def _bounds(sizes):
    r0 = 0
    for rs in sizes:
        yield r0, rs
        r0 += rs


def _fp64_head(x, W, t):
    """lse, target logit, and the grads of the mean loss, all fp64."""
    x64 = x.double().requires_grad_()
    W64 = W.double().requires_grad_()
    z = x64 @ W64.T
    loss = F.cross_entropy(z, t, ignore_index=IGNORE)
    loss.backward()
    tl = z.detach().gather(1, t.clamp(min=0)[:, None]).squeeze(1)
    return torch.logsumexp(z.detach(), dim=1), tl, loss.detach(), x64.grad, W64.grad


def _forward(x, W, t, sizes, order=None, backend=None, n_split=None):
    M = x.shape[0]
    m = torch.full((M,), float("-inf"), device=DEVICE)
    s = torch.zeros(M, device=DEVICE)
    tgt = torch.full((M,), float("nan"), device=DEVICE)
    bounds = list(_bounds(sizes))
    for i in (order or range(len(bounds))):
        r0, rs = bounds[i]
        K.head_ce_forward_slice_(x, W[r0:r0 + rs], r0, t, m, s, tgt, n_split=n_split, backend=backend)
    return m, s, tgt


def _scale(t):
    valid = t != IGNORE
    return torch.where(valid, 1.0 / valid.sum().float(), torch.zeros((), device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_lse_and_target_logit(dtype, shape):
    M, H, sizes = shape
    x, W, t = _case(M, H, sizes, dtype)
    m, s, tgt = _forward(x, W, t, sizes)
    lse64, tl64, *_ = _fp64_head(x, W, t)
    z_pt = torch_rows(lambda a: a @ W.T, x)  # PyTorch in this dtype (its gemm, see the Note there)
    assert_within_2x_torch(m + torch.log(s), lse64, torch.logsumexp(z_pt.float(), dim=1), "lse")
    valid = t != IGNORE
    pt_tl = z_pt.float().gather(1, t.clamp(min=0)[:, None]).squeeze(1)
    assert_within_2x_torch(tgt[valid], tl64[valid], pt_tl[valid], "target logit")
    assert torch.isnan(tgt[~valid]).all()  # ignored targets are never picked up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_split", [2, 4])
def test_forward_split_rows_match_one_range(dtype, n_split):
    """[Note: forward split]: the slice's rows cut into ranges (some empty: 4 ranges of a
    2-block slice) give the same state as one program walking them all."""
    M, H, sizes = 70, 130, [65, 64]
    x, W, t = _case(M, H, sizes, dtype)
    one = _forward(x, W, t, sizes, n_split=1)
    split = _forward(x, W, t, sizes, n_split=n_split)
    torch.testing.assert_close(split[0], one[0], rtol=0, atol=0)  # max is exact
    torch.testing.assert_close(split[1], one[1], rtol=1e-6, atol=0)
    valid = t != IGNORE
    torch.testing.assert_close(split[2][valid], one[2][valid], rtol=0, atol=0)  # the same dot, written once
    assert torch.isnan(split[2][~valid]).all()
    lse64, *_ = _fp64_head(x, W, t)
    pt = torch.logsumexp((x @ W.T).float(), dim=1)
    assert_within_2x_torch(split[0] + torch.log(split[1]), lse64, pt, "lse")


def test_slices_fold_in_any_order():
    M, H, sizes = 37, 96, [110, 100, 90]
    x, W, t = _case(M, H, sizes, torch.float32)
    fwd = _forward(x, W, t, sizes)
    rev = _forward(x, W, t, sizes, order=[2, 0, 1])
    lse64, tl64, *_ = _fp64_head(x, W, t)
    for a, b in zip(fwd, rev):
        torch.testing.assert_close(a[t != IGNORE], b[t != IGNORE], rtol=1e-6, atol=1e-6)
    assert ((rev[0] + torch.log(rev[1])).double() - lse64).abs().max() < 1e-6


def test_forward_leaves_other_targets_untouched():
    """target_logit is written only where the target lies in the slice."""
    M, H = 40, 64
    x, W, t = _case(M, H, [150], torch.float32)
    m, s = torch.full((M,), float("-inf"), device=DEVICE), torch.zeros(M, device=DEVICE)
    tgt = torch.full((M,), 7.0, device=DEVICE)
    K.head_ce_forward_slice_(x, W[50:100], 50, t, m, s, tgt)
    here = (t >= 50) & (t < 100)
    assert (tgt[~here] == 7.0).all() and here.any()
    ref = (x.double() @ W.double().T).gather(1, t.clamp(min=0)[:, None]).squeeze(1)
    assert (tgt[here].double() - ref[here]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_grad_logits(dtype, shape):
    M, H, sizes = shape
    x, W, t = _case(M, H, sizes, dtype)
    lse64, *_ = _fp64_head(x, W, t)
    scale = _scale(t)
    r0, rs = sizes[0], sizes[1]  # the second slice
    g = K.head_ce_grad_logits(x, W[r0:r0 + rs], r0, t, lse64.float(), scale)
    assert g.dtype == dtype and g.shape == (M, rs)
    z64 = x.double() @ W[r0:r0 + rs].double().T
    onehot = F.one_hot((t - r0).clamp(0, rs), rs + 1)[:, :rs].double() * ((t >= r0) & (t < r0 + rs))[:, None]
    ref = (torch.exp(z64 - lse64[:, None]) - onehot) * scale.double()[:, None]
    pt_z = x @ W[r0:r0 + rs].T  # PyTorch's logits in this dtype, softmax gradient in this dtype
    pt = ((torch.exp(pt_z - lse64.to(dtype)[:, None]) - onehot.to(dtype)) * scale.to(dtype)[:, None])
    assert_within_2x_torch(g, ref, pt, "grad logits")


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_backward_fp32_within_1e6_of_cross_entropy(shape):
    M, H, sizes = shape
    x, W, t = _case(M, H, sizes, torch.float32)
    m, s, tgt = _forward(x, W, t, sizes)
    lse = m + torch.log(s)
    scale = _scale(t)
    dx = torch.zeros(M, H, device=DEVICE)
    dws = []
    for r0, rs in _bounds(sizes):
        _, dw = K.head_ce_backward_slice(x, W[r0:r0 + rs], r0, t, lse, scale, dx_out=dx, chunk_tokens=16)
        dws.append(dw)
    # per-token loss from the kernels' fp32 state, reduced as OnlineLSE.finish does (fp64 mean)
    loss = (((m - tgt) + torch.log(s))[t != IGNORE]).double().mean().float()
    _, _, loss64, dx64, dw64 = _fp64_head(x, W, t)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss_pt = F.cross_entropy(xr @ Wr.T, t, ignore_index=IGNORE)
    loss_pt.backward()
    for got, pt, ref, what in [(loss, loss_pt.detach(), loss64, "loss"), (dx, xr.grad, dx64, "dX"),
                               (torch.cat(dws), Wr.grad, dw64, "dW")]:
        # against fp64, not torch's fp32 result (its own loss error can pass 1e-6)
        err = (got.double() - ref).abs().max().item()
        assert err <= 1e-6, f"{what}: {err:.2e} from fp64"
        assert_within_2x_torch(got, ref, pt, what)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_backward_16bit_within_2x_torch(dtype, shape):
    M, H, sizes = shape
    x, W, t = _case(M, H, sizes, dtype)
    m, s, _ = _forward(x, W, t, sizes)
    lse = m + torch.log(s)
    dx = torch.zeros(M, H, device=DEVICE)
    dws = [K.head_ce_backward_slice(x, W[r0:r0 + rs], r0, t, lse, _scale(t), dx_out=dx)[1]
           for r0, rs in _bounds(sizes)]
    _, _, _, dx64, dw64 = _fp64_head(x, W, t)
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    F.cross_entropy(xr @ Wr.T, t, ignore_index=IGNORE).backward()  # PyTorch in this dtype
    assert all(d.dtype == dtype for d in dws)
    assert_within_2x_torch(dx.to(dtype), dx64, xr.grad, "dX")
    assert_within_2x_torch(torch.cat(dws), dw64, Wr.grad, "dW")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunks_and_main_grad_accumulation(dtype):
    """Token chunks sum like one pass; accumulate_dw adds into an fp32 main grad."""
    M, H, V = 70, 130, 129
    x, W, t = _case(M, H, [V], dtype)
    lse64, *_ = _fp64_head(x, W, t)
    lse, scale = lse64.float(), _scale(t)
    dx1, dw1 = K.head_ce_backward_slice(x, W, 0, t, lse, scale, dw_out=torch.empty(V, H, device=DEVICE))
    dx2, dw2 = K.head_ce_backward_slice(x, W, 0, t, lse, scale, dw_out=torch.empty(V, H, device=DEVICE), chunk_tokens=32)
    torch.testing.assert_close(dx1, dx2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw1, dw2, rtol=1e-5, atol=1e-6)
    main0 = randn(V, H, dtype=torch.float32, seed=9)
    main = main0.clone()
    ret = K.head_ce_backward_slice(x, W, 0, t, lse, scale, dw_out=main, accumulate_dw=True, chunk_tokens=32)[1]
    assert ret is main
    torch.testing.assert_close(main, main0 + dw1, rtol=1e-5, atol=1e-6)


def test_all_ignored_gives_zero_grads_and_nan_mean():
    M, H, sizes = 37, 96, [110, 100, 90]
    x, W, t = _case(M, H, sizes, torch.float32)
    t[:] = IGNORE
    m, s, tgt = _forward(x, W, t, sizes)
    assert torch.isnan(tgt).all() and torch.isfinite(m + torch.log(s)).all()
    valid = t != IGNORE
    ours = torch.where(valid, m + torch.log(s) - tgt, torch.zeros((), device=DEVICE)).sum() / valid.sum()
    xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
    ref = F.cross_entropy(xr @ Wr.T, t, ignore_index=IGNORE)
    ref.backward()
    assert torch.isnan(ours) and torch.isnan(ref)  # torch: 0 / 0 for "mean"
    dx, dw = K.head_ce_backward_slice(x, W, 0, t, m + torch.log(s), _scale(t))
    assert torch.equal(dx, xr.grad) and torch.equal(dw, Wr.grad) and not dx.any()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_function_on_the_kernels(reduction):
    """osdp.ops.split_head_cross_entropy with backend='triton' (here: the interpreter):
    within 2x PyTorch's fp32 error against fp64 for every reduction, and within 1e-6 of
    fp64 for "mean" (the sum's gradients are n_valid times larger)."""
    M, H, sizes = 33, 72, [97, 1, 50]
    x, W, t = _case(M, H, sizes, torch.float32)
    x = x.reshape(3, 11, H)
    t = t.reshape(3, 11)
    grad = torch.rand(t.shape if reduction == "none" else (), dtype=torch.float64, device=DEVICE) + 0.5
    results = {}
    for who, dtype in [("ours", torch.float32), ("torch", torch.float32), ("fp64", torch.float64)]:
        xr, Wr = x.to(dtype).clone().requires_grad_(), W.to(dtype).clone().requires_grad_()
        if who == "ours":
            loss = split_head_cross_entropy(xr, Wr, t, slice_sizes=sizes, reduction=reduction, backend="triton")
        else:
            loss = F.cross_entropy((xr @ Wr.T).reshape(-1, sum(sizes)), t.reshape(-1), reduction=reduction)
            loss = loss.reshape(t.shape) if reduction == "none" else loss
        (loss * grad.to(dtype)).sum().backward()
        results[who] = (loss.detach(), xr.grad, Wr.grad)
    for i, what in enumerate(["loss", "dX", "dW"]):
        ours, pt, ref = (results[w][i] for w in ("ours", "torch", "fp64"))
        assert_within_2x_torch(ours, ref, pt, what)
        if reduction == "mean":
            assert (ours.double() - ref).abs().max() <= 1e-6, what


def test_torch_backend_is_the_reference():
    x, W, t = _case(37, 96, [300], torch.float32)
    a = _forward(x, W, t, [300], backend="torch")
    b = [torch.full((37,), float("-inf"), device=DEVICE), torch.zeros(37, device=DEVICE),
         torch.full((37,), float("nan"), device=DEVICE)]
    K.head_ce.reference_forward_slice(x, W, 0, t, *b)
    for u, v in zip(a, b):
        assert torch.equal(u.nan_to_num(), v.nan_to_num())


def test_errors_say_what_is_wrong():
    x, W, t = _case(8, 16, [20], torch.float32)
    m, s, tgt = (torch.zeros(8, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="w_slice has 15 columns but x has 16"):
        K.head_ce_forward_slice_(x, W[:, :15], 0, t, m, s, tgt)
    with pytest.raises(TypeError, match="w_slice dtype torch.float16 must match x dtype torch.float32"):
        K.head_ce_forward_slice_(x, W.half(), 0, t, m, s, tgt)
    with pytest.raises(TypeError, match="targets dtype must be one of"):
        K.head_ce_forward_slice_(x, W, 0, t.float(), m, s, tgt)
    with pytest.raises(ValueError, match=r"m must have shape \(8,\)"):
        K.head_ce_forward_slice_(x, W, 0, t, torch.zeros(9, device=DEVICE), s, tgt)
    with pytest.raises(ValueError, match="n_split must be a positive int or None, got 0"):
        K.head_ce_forward_slice_(x, W, 0, t, m, s, tgt, n_split=0)
    with pytest.raises(ValueError, match="row0 must be a non-negative int"):
        K.head_ce_forward_slice_(x, W, -1, t, m, s, tgt)
    with pytest.raises(ValueError, match="accumulate_dw=True needs dw_out="):
        K.head_ce_backward_slice(x, W, 0, t, m, s, accumulate_dw=True)
    with pytest.raises(TypeError, match="accumulate_dw=True needs an fp32 dw_out"):
        K.head_ce_backward_slice(x, W, 0, t, m, s, dw_out=torch.zeros(20, 16, dtype=torch.float16, device=DEVICE),
                                 accumulate_dw=True)
    with pytest.raises(ValueError, match="head_ce has no csrc/cuda kernel|backend='cuda' needs CUDA tensors"):
        K.head_ce_backward_slice(x, W, 0, t, m, s, backend="cuda")
