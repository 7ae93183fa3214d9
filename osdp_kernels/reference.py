"""Torch references of the split-matmul ops (fp32 accumulation, same contracts as the
kernels, no validation): what the CPU path runs and what the tests compare against."""
from .addmm_slice import reference as _addmm_ref
from .slice_dw import reference as _dw_ref
from .slice_dx import reference as _dx_ref


def addmm_slice_(out, x, w_slice, k0, bias=None, cast_out=None):
    """out += x[:, k0:k0+ks] @ w_slice.T (+ bias); cast_out (if given) <- out."""
    return _addmm_ref(out, x, w_slice, k0, bias, cast_out)


def slice_dx(dy, w_slice, dx, k0):
    """dx[:, k0:k0+ks] = dy @ w_slice."""
    return _dx_ref(dy, w_slice, dx, k0)


def slice_dw(dy, x, k0, ks, out=None, accumulate=False):
    """dy.T @ x[:, k0:k0+ks], written into / added to out (new tensor if None)."""
    if out is None:
        out = dy.new_empty((dy.shape[1], ks))
    return _dw_ref(dy, x, k0, ks, out, accumulate)


__all__ = ["addmm_slice_", "slice_dx", "slice_dw"]
