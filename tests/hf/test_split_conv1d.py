"""The Conv1D split op alone, on a 1-rank gloo group in this process: forward and
backward against fp64 math, the registry, errors, and the X-is-saved-once invariant."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import osdp  # noqa: E402
from osdp.errors import OSDPError  # noqa: E402
from osdp.ops import get_split_op, registered_split_ops  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _conv(nx, nf, seed=0):
    torch.manual_seed(seed)
    conv = Conv1D(nf, nx)
    with torch.no_grad():
        conv.bias.normal_()  # zero-initialized otherwise: test it for real
        conv.weight.normal_()
    return conv


def _err(got, ref64):
    return (got.double() - ref64).abs().max().item()


def _check(got, ref64, unsplit32, what):
    """Split error <= 2x the unsplit fp32 Conv1D's error (both against fp64), with
    a floor at the rounding of the result itself (one fp32 ulp of the largest value)."""
    bound = max(2 * _err(unsplit32, ref64), EPS32 * ref64.abs().max().item())
    assert _err(got, ref64) <= bound, f"{what}: error {_err(got, ref64):.3e} > {bound:.3e}"


CASES = [
    # nx, nf, x shape prefix, modes per slice
    (12, 36, (3, 5), ("zdp", "dp", "zdp", "dp", "zdp")),  # uneven slices 3,3,2,2,2
    (48, 12, (7,), ("dp", "dp", "dp")),
    (7, 5, (2, 3), ("zdp",) * 7),  # one row per slice
    (33, 20, (4, 2), ("dp", "zdp")),  # 17, 16
]


@pytest.mark.parametrize("nx,nf,lead,modes", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_split_conv1d_matches_fp64_math(nx, nf, lead, modes):
    conv = _conv(nx, nf)
    w64, b64 = conv.weight.detach().double(), conv.bias.detach().double()
    ref_conv = _conv(nx, nf)  # the unsplit fp32 module, same weights
    x = torch.randn(*lead, nx, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(*lead, nf, generator=torch.Generator().manual_seed(2))

    model = osdp.OSDP(nn.Sequential(conv), modes={"0": modes}, device="cpu")
    assert type(model.unwrapped[0]).__name__ == "SplitConv1D"
    assert model.unit_names() == [f"0[{i}]" for i in range(len(modes))]
    xs = x.clone().requires_grad_(True)
    y = model(xs)
    y.backward(dy)

    x64 = x.double().requires_grad_(True)
    w64r, b64r = w64.clone().requires_grad_(True), b64.clone().requires_grad_(True)
    y64 = x64 @ w64r + b64r
    y64.backward(dy.double())
    xr = x.clone().requires_grad_(True)
    yr = ref_conv(xr)
    yr.backward(dy)

    assert y.shape == yr.shape and y.dtype == torch.float32
    _check(y, y64, yr, "forward")
    _check(xs.grad, x64.grad, xr.grad, "dX")
    # world size 1: the shards are the whole flat buffers; full_state_dict merges slices
    state = model.full_state_dict()
    assert list(state) == ["0.weight", "0.bias"]
    grads = {}
    offset = 0
    for unit in model._built.units:
        parts = unit.unflatten(unit.sharded_grad())
        grads.setdefault("weight", []).append(parts["weight"])
        if "bias" in parts:
            grads["bias"] = parts["bias"]
        offset += parts["weight"].shape[0]
    assert offset == nx
    _check(torch.cat(grads["weight"], 0), w64r.grad, ref_conv.weight.grad, "dW")
    _check(grads["bias"], b64r.grad, ref_conv.bias.grad, "db")
    assert torch.equal(state["0.weight"], ref_conv.weight.detach()) and torch.equal(state["0.bias"], ref_conv.bias.detach())


def test_called_twice_accumulates_and_input_without_grad():
    """Two uses per step (the accumulate path of dW, written through the transposed
    gradient view) and an input that needs no gradient (no dX)."""
    nx, nf = 10, 6
    conv, ref = _conv(nx, nf), _conv(nx, nf)
    x1 = torch.randn(4, nx, generator=torch.Generator().manual_seed(3))
    x2 = torch.randn(4, nx, generator=torch.Generator().manual_seed(4))
    model = osdp.OSDP(nn.Sequential(conv), modes={"0": ("dp", "zdp", "zdp")}, device="cpu")
    split = model.unwrapped[0]
    (split(x1) * split(x2)).sum().backward()
    (ref(x1) * ref(x2)).sum().backward()
    w64, b64 = ref.weight.detach().double().requires_grad_(True), ref.bias.detach().double().requires_grad_(True)
    ((x1.double() @ w64 + b64) * (x2.double() @ w64 + b64)).sum().backward()
    dw = torch.cat([u.unflatten(u.sharded_grad())["weight"] for u in model._built.units], 0)
    db = model._built.units[0].unflatten(model._built.units[0].sharded_grad())["bias"]
    _check(dw, w64.grad, ref.weight.grad, "dW (two uses)")
    _check(db, b64.grad, ref.bias.grad, "db (two uses)")


def test_only_x_is_saved_and_slices_are_views():
    """[Note: split linear schedule]: backward keeps X itself, never copies of its slices."""
    model = osdp.OSDP(nn.Sequential(_conv(12, 8)), splits={"0": 4}, device="cpu")
    x = torch.randn(3, 12, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    split_saved = [t for t in saved if t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()]
    assert len(split_saved) == 1 and split_saved[0].shape == x.shape
    assert all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved), [t.shape for t in saved]
    y.sum().backward()


def test_registry_and_errors():
    conv = Conv1D(6, 5)
    op = get_split_op(conv)
    assert op.__name__ == "SplitConv1D" and op.op_name == "conv1d_nx"
    assert registered_split_ops()["conv1d_nx"] is op and op.module_type is Conv1D
    assert [s["weight"].shape[0] for s in op.slice_tensors(conv, 3)] == [2, 2, 1]
    assert all(s["weight"].is_contiguous() for s in op.slice_tensors(conv, 3))  # rows: no copies needed
    merged = op.merge(op.slice_tensors(conv, 3))
    assert torch.equal(merged["weight"], conv.weight) and torch.equal(merged["bias"], conv.bias)
    with pytest.raises(OSDPError, match=r"cannot split '0' \(Conv1D, in_features=5\) into 6 slices: use 1 <= g <= 5"):
        osdp.OSDP(nn.Sequential(Conv1D(6, 5)), splits={"0": 6}, device="cpu")


def test_registered_when_transformers_is_imported_after_osdp():
    """[Note: lazily registered ops]: osdp.ops first, transformers later."""
    code = (
        "import sys, osdp.ops as ops\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers.pytorch_utils import Conv1D\n"
        "print(ops.get_split_op(Conv1D(4, 3)).__name__)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(osdp.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "SplitConv1D"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_slice_kernels_read_conv1d_layout_through_strides(dtype):
    """On CUDA the op runs the osdp_kernels Triton kernels on transposed views (a
    Conv1D slice W_i [ks, nf] passed as W_i.t(), its gradient written through
    grad.t()). Run them here (Triton's interpreter on CPU, compiled on a GPU) against
    fp64, within 2x of torch's own error in the same dtype."""
    K = pytest.importorskip("osdp_kernels", reason="osdp_kernels (Triton) not importable")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not K.INTERPRET:
        pytest.skip("osdp_kernels was imported without TRITON_INTERPRET=1 and there is no GPU")
    gen = torch.Generator().manual_seed(0)
    M, nx, nf, k0, ks = 37, 40, 24, 13, 11
    W = torch.randn(nx, nf, generator=gen, dtype=torch.float64)
    x, dy, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((M, nx), (M, nf), (nf,)))
    x_, dy_, W_, b_ = (t.to(dtype=dtype, device=device) for t in (x, dy, W, b))
    Wi = W_[k0 : k0 + ks]  # rows of the gathered Conv1D weight: the slice's own storage
    xs, xs64 = x_[:, k0 : k0 + ks], x[:, k0 : k0 + ks]

    def check(got, ref64, torch_res, what):
        err = (got.double().cpu() - ref64).abs().max().item()
        err_pt = (torch_res.double().cpu() - ref64).abs().max().item()
        assert err <= 2 * err_pt, f"{what}: {err:.3e} > 2 x torch's {err_pt:.3e}"

    out = torch.zeros(M, nf, device=device)
    K.addmm_slice_(out, x_, Wi.t(), k0, b_, backend="triton")
    check(out, xs64 @ W[k0 : k0 + ks] + b, (xs @ Wi + b_).float(), "forward")
    dx = torch.full((M, nx), float("nan"), dtype=dtype, device=device)
    K.slice_dx(dy_, Wi.t(), dx, k0, backend="triton")
    check(dx[:, k0 : k0 + ks], dy @ W[k0 : k0 + ks].t(), dy_ @ Wi.t(), "dX")
    grad = torch.full((ks, nf), float("nan"), device=device)  # fp32 gradient buffer
    K.slice_dw(dy_, x_, k0, ks, out=grad.t(), backend="triton")
    check(grad, xs64.t() @ dy, (xs.t() @ dy_).float(), "dW")
    first = grad.clone()
    K.slice_dw(dy_, x_, k0, ks, out=grad.t(), accumulate=True, backend="triton")
    check(grad, 2 * (xs64.t() @ dy), first + (xs.t() @ dy_).float(), "dW accumulated")
