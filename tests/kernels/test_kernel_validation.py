"""Input validation names what is wrong and what would be right; dispatch rules."""
import pytest
import torch

import osdp_kernels as K
from osdp_kernels import _common
from kernel_testutil import DEVICE


def t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: K.addmm_slice_(t(4, 8), t(4, 16), t(8, 16), 0), TypeError, "out must be the fp32 accumulator"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(8, 16, dtype=torch.bfloat16), 0),
     TypeError, "w_slice dtype torch.bfloat16 must match x dtype torch.float16"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(5, 16), t(8, 16), 0), ValueError, "x has 5 rows"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(9, 16), 0), ValueError, "nn.Linear layout"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(8, 10), 8), ValueError,
     r"\[8, 18\) must lie within \[0, 16\)"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(8, 10), -1), ValueError, "must lie within"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(8, 16), 0, bias=t(9)), ValueError,
     r"bias must be a float tensor of shape \(8,\)"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(8, 16), 0, cast_out=t(4, 9)), ValueError,
     "cast_out shape"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16), t(8, 16), 0, cast_to=torch.float16,
                            cast_out=t(4, 8, dtype=torch.bfloat16)), ValueError, "disagrees"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16, dtype=torch.int32),
                            t(8, 16, dtype=torch.int32), 0), TypeError, "x dtype must be one of"),
    (lambda: K.addmm_slice_(t(4, 8, dtype=torch.float32), t(4, 16, 1), t(8, 16), 0), ValueError, "x must be 2-D"),
    (lambda: K.slice_dx(t(4, 8), t(8, 6), t(4, 10), 5), ValueError, r"\[5, 11\) must lie within \[0, 10\)"),
    (lambda: K.slice_dx(t(4, 8), t(7, 6), t(4, 10), 0), ValueError, "w_slice has 7 rows but dy has 8 columns"),
    (lambda: K.slice_dx(t(4, 8), t(8, 6), t(3, 10), 0), ValueError, "dx has 3 rows"),
    (lambda: K.slice_dw(t(4, 8), t(4, 10), 0, 6, out=t(8, 6), accumulate=True), TypeError,
     "accumulate=True needs an fp32 out"),
    (lambda: K.slice_dw(t(4, 8), t(4, 10), 0, 6, accumulate=True), ValueError, "needs out="),
    (lambda: K.slice_dw(t(4, 8), t(4, 10), 0, 6, out=t(6, 8, dtype=torch.float32)), ValueError,
     r"must be \(N, ks\) = \(8, 6\)"),
    (lambda: K.slice_dw(t(4, 8), t(4, 10), 6, 6), ValueError, "must lie within"),
    (lambda: K.slice_dw(t(4, 8), t(4, 10, dtype=torch.float32), 0, 6), TypeError, "must match dy dtype"),
    (lambda: K.slice_dx(t(4, 8), t(8, 6), t(4, 10), 0, backend="cublas"), ValueError, "backend must be one of"),
])
def test_errors_name_the_problem(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_cuda_backend_needs_cuda_tensors():
    cpu = lambda *s, dtype=torch.float16: torch.zeros(*s, dtype=dtype)
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        K.slice_dw(cpu(4, 8), cpu(4, 10), 0, 6, backend="cuda")


def test_default_dispatch(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _common.resolve_backend(None, cuda) == "triton"
    monkeypatch.setattr(_common, "INTERPRET", False)
    assert _common.resolve_backend(None, cpu) == "torch"
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 before importing"):
        _common.resolve_backend("triton", cpu)
    monkeypatch.setattr(_common, "INTERPRET", True)
    assert _common.resolve_backend(None, cpu) == "triton"


def test_cuda_path_rejects_non_unit_inner_stride():
    x = torch.zeros(10, 4).t()  # strides (1, 4)
    with pytest.raises(ValueError, match="unit stride along dim 1"):
        _common.check_inner_contiguous(x=x)
    _common.check_inner_contiguous(x=torch.zeros(4, 10)[:, 2:7])  # leading stride is free
