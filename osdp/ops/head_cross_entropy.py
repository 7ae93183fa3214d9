"""Cross-entropy of an LM head cut along vocabulary rows, computed slice by slice so the
[tokens, vocab] logits never exist, forward or backward.

Two layers:

- the per-slice pieces a runtime calls with one gathered slice at a time:
  :class:`OnlineLSE` (``start`` / ``update`` / ``finish``) for the forward,
  :func:`row_scale` and :func:`slice_backward` for the backward;
- :func:`split_head_cross_entropy`, the user-facing loss (a ``torch.autograd.Function``
  over those pieces), exported as ``osdp.ops.split_head_cross_entropy``.

Backends: ``"triton"`` (``osdp_kernels.head_ce``; the default for CUDA tensors when
``osdp_kernels`` imports) and ``"torch"`` (this file; the default on CPU, and the only
one for fp64). ``backend="torch"`` or ``OSDP_HEAD_CE_BACKEND=torch`` forces the torch
path; ``backend="triton"`` on CPU tensors runs the kernels in the Triton interpreter
when ``TRITON_INTERPRET=1`` was set before ``osdp_kernels`` was imported.

[Note: online log-sum-exp over vocabulary slices]
For token n with hidden state x_n and target t_n, over vocabulary rows v:

    loss_n = lse_n - z_n,t_n,   lse_n = log sum_v exp(z_n,v),   z_n,v = x_n . W_v

Slice i holds rows [r_i, r_i + rs_i). ``OnlineLSE`` keeps per token (fp32, or fp64 for
fp64 inputs) a running max m_n and a running sum s_n = sum_seen exp(z_n,v - m_n), with
m = -inf, s = 0 before any slice. ``update(w_i, r_i)`` folds slice i in:

    m' = max(m, max_v z_n,v),   s' = s exp(m - m') + sum_v exp(z_n,v - m')

and the slice holding t_n writes target_logit_n = z_n,t_n (NaN until then).
``finish()`` returns lse = m + log s and the reduced loss. The fold is associative and
commutative (up to rounding), so slices may come in any order, each exactly once:
``finish`` checks that the slices seen tile [0, V) without gap or overlap.

Backward, per slice, with lse from the forward and a per-token weight c_n
(:func:`row_scale`: grad_out / n_valid for "mean", grad_out for "sum", grad_out[n] for
"none", and 0 for ignored tokens):

    G_i = (exp(X W_i^T - lse) - onehot(t - r_i)) * c,   dX += G_i W_i,   dW_i = G_i^T X

:func:`slice_backward` recomputes the slice's logits instead of keeping them; G_i exists
only for a chunk of tokens at a time ([Note: backward chunk] in osdp_kernels/head_ce.py),
sized by :func:`chunk_tokens_for` to about the bytes of X (at least 2**23 elements). dX is summed over the slices
in an fp32 accumulator and cast once; dW_i is accumulated in fp32 and cast once.

What the runtime keeps between forward and backward: X, the targets and lse ([tokens]
fp32), nothing of size vocab. Ignored tokens (``ignore_index``) count neither in the
loss nor in n_valid; with every token ignored "mean" is 0/0 = NaN and the gradients are
0, as in ``F.cross_entropy``.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import torch

from ..contract import split_sizes
from ..errors import ConfigError, a_type
from .kernels import accumulator_dtype, kernels_module

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("triton", "torch")
BACKEND_ENV = "OSDP_HEAD_CE_BACKEND"
MIN_CHUNK_TOKENS = 64
# Floor of a chunk's logits, in elements (32 MiB in fp32): on a narrow head (hidden much
# smaller than vocab) the "as large as X" rule gives chunks so thin that dW's rank-chunk
# updates dominate (CPU, 1024 x 256 x 32768: 64-token chunks 3x slower than 256).
MIN_CHUNK_ELEMENTS = 2**23


def _kernels():
    return kernels_module()  # another package (needs triton); the torch path works without it


def resolve_backend(backend: str | None, x: torch.Tensor) -> str:
    """``backend`` if given, else ``$OSDP_HEAD_CE_BACKEND`` if set, else "triton" for
    CUDA fp32/fp16/bf16 tensors when ``osdp_kernels`` imports, else "torch"."""
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
        where = f"${BACKEND_ENV}"
    else:
        where = "backend"
    if backend is None:
        if x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and _kernels() is not None:
            return "triton"
        return "torch"
    if backend not in BACKENDS:
        raise ConfigError(f"{where}={backend!r} is not a head cross-entropy backend; use one of {BACKENDS}")
    if backend == "triton" and _kernels() is None:
        raise ConfigError(f"{where}='triton' needs osdp_kernels (and triton) importable; use 'torch'")
    return backend


def chunk_tokens_for(tokens: int, hidden: int, slice_rows: int) -> int:
    """Tokens per chunk: the chunk's [chunk, slice_rows] logits hold at most as many
    elements as X [tokens, hidden], or MIN_CHUNK_ELEMENTS if more (a multiple of
    MIN_CHUNK_TOKENS, at least that many tokens, at most all)."""
    chunk = max(tokens * hidden, MIN_CHUNK_ELEMENTS) // max(slice_rows, 1)
    chunk = chunk // MIN_CHUNK_TOKENS * MIN_CHUNK_TOKENS  # whole multiples of 64 rows, within the budget
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, chunk)))


# ---------------------------------------------------------------------------------------
# torch path (chunked over tokens: [chunk, rs] at most)
# ---------------------------------------------------------------------------------------
def _torch_update(x, w, row0, targets, m, s, target_logit, chunk):
    rs = w.shape[0]
    wf = w.to(m.dtype)
    for r0 in range(0, x.shape[0], chunk):
        r1 = min(x.shape[0], r0 + chunk)
        z = x[r0:r1].to(m.dtype) @ wf.t()
        mc, sc = m[r0:r1], s[r0:r1]
        col = targets[r0:r1] - row0
        here = (col >= 0) & (col < rs)
        picked = z.gather(1, col.clamp(0, rs - 1)[:, None]).squeeze(1)
        target_logit[r0:r1] = torch.where(here, picked, target_logit[r0:r1])
        m_new = torch.maximum(mc, z.max(dim=1).values)
        z.sub_(m_new[:, None])
        sc.mul_(torch.exp(mc - m_new)).add_(z.exp_().sum(dim=1))
        mc.copy_(m_new)
        del z  # before the next chunk's logits exist: one chunk alive at a time


def _torch_backward(x, w, row0, targets, lse, scale, dx_out, dw_out, accumulate_dw, chunk):
    rs = w.shape[0]
    acc = dx_out.dtype
    wf = w.to(acc)
    dw_acc = dw_out if (accumulate_dw or dw_out.dtype == acc) else torch.empty(dw_out.shape, dtype=acc,
                                                                               device=dw_out.device)
    for i, r0 in enumerate(range(0, x.shape[0], chunk)):
        r1 = min(x.shape[0], r0 + chunk)
        xc = x[r0:r1].to(acc)
        g = (xc @ wf.t()).sub_(lse[r0:r1, None]).exp_()
        col = targets[r0:r1] - row0
        here = (col >= 0) & (col < rs)
        rows = here.nonzero().squeeze(1)
        g[rows, col[rows]] -= 1.0
        g.mul_(scale[r0:r1, None])
        dx_out[r0:r1].addmm_(g, wf)
        if accumulate_dw or i > 0:
            dw_acc.addmm_(g.t(), xc)
        else:
            torch.mm(g.t(), xc, out=dw_acc)
        del g, xc  # one chunk alive at a time
    if dw_acc is not dw_out:
        dw_out.copy_(dw_acc)
    return dx_out, dw_out


# ---------------------------------------------------------------------------------------
# Per-slice API (what a runtime calls with one gathered slice at a time)
# ---------------------------------------------------------------------------------------
class HeadCEResult(NamedTuple):
    """``loss``: reduced as asked (a 0-d tensor, or [tokens] for "none");
    ``lse``: [tokens] log-sum-exp over the whole vocabulary (fp32; fp64 for fp64 x),
    what the backward needs; ``n_valid``: 0-d int64 tensor, tokens not ignored."""

    loss: torch.Tensor
    lse: torch.Tensor
    n_valid: torch.Tensor


def _check_x_targets(x, targets, ignore_index):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ConfigError(f"x must be a 2-D float tensor [tokens, hidden], got "
                          f"{tuple(x.shape) if isinstance(x, torch.Tensor) else a_type(x)}")
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1 or targets.shape[0] != x.shape[0] \
            or targets.is_floating_point() or targets.dtype == torch.bool:
        raise ConfigError(f"targets must be an integer tensor of shape ({x.shape[0]},) (one class id per token), "
                          f"got {tuple(targets.shape) if isinstance(targets, torch.Tensor) else a_type(targets)}"
                          f"{' ' + str(targets.dtype) if isinstance(targets, torch.Tensor) else ''}")
    if targets.device != x.device:
        raise ConfigError(f"targets are on {targets.device} but x is on {x.device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index must be an int, got {ignore_index!r}")


def _check_slice(x, w_slice, row0):
    if not isinstance(w_slice, torch.Tensor) or w_slice.dim() != 2 or w_slice.shape[1] != x.shape[1]:
        raise ConfigError(f"w_slice must be [slice_rows, hidden={x.shape[1]}] (rows of the vocabulary), got "
                          f"{tuple(w_slice.shape) if isinstance(w_slice, torch.Tensor) else a_type(w_slice)}")
    if w_slice.dtype != x.dtype or w_slice.device != x.device:
        raise ConfigError(f"w_slice ({w_slice.dtype}, {w_slice.device}) must match x ({x.dtype}, {x.device})")
    if isinstance(row0, bool) or not isinstance(row0, int) or row0 < 0:
        raise ConfigError(f"row0 must be a non-negative int (the slice's first vocabulary row), got {row0!r}")


class OnlineLSE:
    """Running log-sum-exp of the head's logits for a batch of tokens, folded in one
    vocabulary slice at a time (see [Note: online log-sum-exp over vocabulary slices]).

        state = OnlineLSE.start(x, targets)          # x [tokens, hidden], targets [tokens]
        for row0, w_slice in slices:                  # any order, each slice once
            state.update(w_slice, row0)               # w_slice [rs, hidden], gathered
        loss, lse, n_valid = state.finish("mean")

    Holds x (a reference), the targets and three [tokens] vectors; nothing of vocab size.
    """

    def __init__(self, x, targets, m, s, target_logit, ignore_index, backend, chunk_tokens):
        self.x, self.targets = x, targets
        self.m, self.s, self.target_logit = m, s, target_logit
        self.ignore_index, self.backend, self.chunk_tokens = ignore_index, backend, chunk_tokens
        self.slices: list[tuple[int, int]] = []  # (row0, rows) in the order seen

    @classmethod
    def start(cls, x: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
              backend: str | None = None, chunk_tokens: int | None = None) -> "OnlineLSE":
        """Empty state for ``x`` [tokens, hidden] and integer ``targets`` [tokens].
        ``chunk_tokens`` bounds the torch path's transient [chunk, rs] logits (default
        :func:`chunk_tokens_for`); the Triton forward keeps no logits at all."""
        _check_x_targets(x, targets, ignore_index)
        backend = resolve_backend(backend, x)
        acc = accumulator_dtype(x.dtype)
        if backend == "triton" and acc != torch.float32:
            raise ConfigError(f"backend='triton' runs fp32/fp16/bf16, got x of {x.dtype}; use backend='torch'")
        M = x.shape[0]
        m = torch.full((M,), float("-inf"), dtype=acc, device=x.device)
        s = torch.zeros(M, dtype=acc, device=x.device)
        tgt = torch.full((M,), float("nan"), dtype=acc, device=x.device)  # NaN: no slice held the target
        if backend == "torch" or targets.dtype not in (torch.int64, torch.int32):
            targets = targets.long()  # the kernels read int64 or int32 ids
        return cls(x, targets, m, s, tgt, ignore_index, backend, chunk_tokens)

    @property
    def rows_seen(self) -> int:
        return sum(r for _, r in self.slices)

    def update(self, w_slice: torch.Tensor, row0: int) -> None:
        """Fold the logits of vocabulary rows [row0, row0 + w_slice.shape[0]) in."""
        _check_slice(self.x, w_slice, row0)
        rs = w_slice.shape[0]
        if rs == 0:
            return
        self.slices.append((row0, rs))
        if self.backend == "torch":
            chunk = self.chunk_tokens or chunk_tokens_for(self.x.shape[0], self.x.shape[1], rs)
            _torch_update(self.x, w_slice, row0, self.targets, self.m, self.s, self.target_logit, chunk)
        else:
            _kernels().head_ce_forward_slice_(self.x, w_slice, row0, self.targets, self.m, self.s,
                                              self.target_logit, backend="triton")

    def _check_tiling(self, vocab_size):
        end = 0
        for row0, rs in sorted(self.slices):
            if row0 != end:
                what = "overlap" if row0 < end else "gap"
                raise ConfigError(f"the slices seen leave a {what} at vocabulary row {min(row0, end)}: rows "
                                  f"{sorted(self.slices)} (row0, rows) must tile [0, V) exactly once")
            end = row0 + rs
        if vocab_size is not None and end != vocab_size:
            raise ConfigError(f"the slices seen cover rows [0, {end}) but vocab_size is {vocab_size}")
        return end

    def finish(self, reduction: str = "mean", *, vocab_size: int | None = None,
               check_targets: bool | None = None) -> HeadCEResult:
        """The loss once every slice was folded in.

        reduction: "mean" (over tokens not ignored; NaN when all are), "sum" or "none"
        ([tokens], 0 for ignored tokens), as ``F.cross_entropy``. vocab_size: checked
        against the rows seen. check_targets: raise IndexError for a target outside
        [0, V) that is not ignore_index (default: on CPU; on CUDA it would synchronize,
        and such a token's loss is NaN instead, its target logit never written)."""
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}")
        V = self._check_tiling(vocab_size)
        t = self.targets
        valid = t != self.ignore_index
        if check_targets if check_targets is not None else not t.is_cuda:
            bad = valid & ((t < 0) | (t >= V))
            if bool(bad.any()):
                raise IndexError(f"Target {int(t[bad][0])} is out of bounds: targets must lie in [0, {V}) "
                                 f"or equal ignore_index={self.ignore_index}")
        log_s = torch.log(self.s)
        lse = self.m + log_s
        # (m - target) + log s: the two logits are subtracted before the O(log V) term is
        # added, and the [tokens] reduction runs in fp64 (a vector, so it costs nothing):
        # the loss then carries the rounding of one fp32 token loss, not of their sum.
        per_token = torch.where(valid, (self.m - self.target_logit) + log_s, torch.zeros_like(lse))
        n_valid = valid.sum()
        if reduction == "none":
            loss = per_token
        elif reduction == "sum":
            loss = per_token.double().sum()
        else:
            loss = per_token.double().sum() / n_valid
        return HeadCEResult(loss.to(self.x.dtype), lse, n_valid)


def row_scale(targets: torch.Tensor, grad_out: torch.Tensor, n_valid: torch.Tensor, *, reduction: str = "mean",
              ignore_index: int = -100, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """d loss / d loss_token per token ([tokens], ``dtype``): grad_out / n_valid for
    "mean", grad_out for "sum", grad_out[n] for "none"; 0 for ignored tokens (so an
    all-ignored "mean" has zero gradients, as in ``F.cross_entropy``)."""
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}")
    valid = targets != ignore_index
    g = grad_out.to(dtype)
    if reduction == "mean":
        g = g / n_valid.to(dtype)
    g = g.expand(targets.shape) if g.dim() == 0 else g.reshape(targets.shape)
    return torch.where(valid, g, torch.zeros((), dtype=dtype, device=g.device))


def slice_backward(x: torch.Tensor, w_slice: torch.Tensor, row0: int, lse: torch.Tensor, targets: torch.Tensor,
                   scale: torch.Tensor, *, dx_out: torch.Tensor | None = None, dw_out: torch.Tensor | None = None,
                   accumulate_dw: bool = False, backend: str | None = None,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of vocabulary slice [row0, row0 + rs): returns ``(dx_out, dw_slice)`` with
    ``dx_out += G @ w_slice`` and ``dw_slice = G.T @ x``, G as in [Note: online
    log-sum-exp over vocabulary slices].

    x [tokens, hidden], w_slice [rs, hidden], lse [tokens] (``HeadCEResult.lse``),
    targets [tokens] (ignored ones must have scale 0), scale [tokens] (:func:`row_scale`).
    dx_out: the fp32 (fp64 for fp64 x) accumulator shared by all slices, zeros when None;
    cast it to x's dtype once after the last slice. dw_out: destination of dW (w_slice's
    dtype when None); with accumulate_dw=True an fp32 main-grad buffer added into.
    chunk_tokens: tokens per transient [chunk, rs] block of G (default
    :func:`chunk_tokens_for`)."""
    _check_x_targets(x, targets, -100)
    _check_slice(x, w_slice, row0)
    backend = resolve_backend(backend, x)
    (M, H), rs = x.shape, w_slice.shape[0]
    acc = accumulator_dtype(x.dtype)
    chunk = chunk_tokens or chunk_tokens_for(M, H, rs)
    if backend == "triton":
        if targets.dtype not in (torch.int64, torch.int32):
            targets = targets.long()
        return _kernels().head_ce_backward_slice(x, w_slice, row0, targets, lse.float(), scale.float(), dx_out,
                                                 dw_out, accumulate_dw, chunk_tokens=chunk, backend="triton")
    if dx_out is None:
        dx_out = torch.zeros((M, H), dtype=acc, device=x.device)
    elif dx_out.dtype != acc or tuple(dx_out.shape) != (M, H):
        raise ConfigError(f"dx_out must be a {acc} accumulator of shape ({M}, {H}), got "
                          f"{dx_out.dtype} {tuple(dx_out.shape)}")
    if dw_out is None:
        if accumulate_dw:
            raise ConfigError("accumulate_dw=True needs dw_out= (the fp32 main-grad buffer to add into)")
        dw_out = torch.empty((rs, H), dtype=w_slice.dtype, device=x.device)
    elif tuple(dw_out.shape) != (rs, H) or (accumulate_dw and dw_out.dtype != acc):
        raise ConfigError(f"dw_out must have shape ({rs}, {H}){f' and dtype {acc}' if accumulate_dw else ''}, "
                          f"got {dw_out.dtype} {tuple(dw_out.shape)}")
    if M == 0 or rs == 0:
        if not accumulate_dw:
            dw_out.zero_()
        return dx_out, dw_out
    return _torch_backward(x, w_slice, row0, targets.long(), lse.to(acc), scale.to(acc), dx_out, dw_out,
                           accumulate_dw, chunk)


# ---------------------------------------------------------------------------------------
# The user-facing loss
# ---------------------------------------------------------------------------------------
class _SplitHeadCrossEntropy(torch.autograd.Function):
    """forward(x [M, H], targets [M], opts, *weights): ``weights`` is either the whole
    head weight [V, H] with ``opts.sizes`` its slice rows (its gradient is then written
    slice by slice into one [V, H] tensor, no concatenation), or the slice tensors."""

    @staticmethod
    def forward(ctx, x, targets, opts, *weights):
        reduction, ignore_index, backend, chunk_tokens, sizes = opts
        slices = weights[0].split(sizes, dim=0) if sizes is not None else weights
        state = OnlineLSE.start(x, targets, ignore_index=ignore_index, backend=backend, chunk_tokens=chunk_tokens)
        row0 = 0
        for w in slices:
            state.update(w, row0)
            row0 += w.shape[0]
        res = state.finish(reduction, vocab_size=row0)
        ctx.save_for_backward(x, targets, res.lse, res.n_valid, *weights)
        ctx.opts = (reduction, ignore_index, state.backend, chunk_tokens, sizes)
        return res.loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, targets, lse, n_valid, *weights = ctx.saved_tensors
        reduction, ignore_index, backend, chunk_tokens, sizes = ctx.opts
        scale = row_scale(targets, grad_out, n_valid, reduction=reduction, ignore_index=ignore_index,
                          dtype=accumulator_dtype(x.dtype))
        if sizes is not None:
            slices = weights[0].split(sizes, dim=0)
            dweight = torch.empty_like(weights[0], memory_format=torch.contiguous_format)
            dw_outs = dweight.split(sizes, dim=0)  # row blocks of one tensor: written in place
        else:
            slices, dw_outs = weights, [None] * len(weights)
        dx = None
        dws, row0 = [], 0
        for w, dw_out in zip(slices, dw_outs):
            dx, dw = slice_backward(x, w, row0, lse, targets, scale, dx_out=dx, dw_out=dw_out, backend=backend,
                                    chunk_tokens=chunk_tokens)
            dws.append(dw)
            row0 += w.shape[0]
        if sizes is not None:
            dws = [dweight]
        return (dx.to(x.dtype) if ctx.needs_input_grad[0] else None), None, None, *dws


def split_head_cross_entropy(x: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor,
                             *, num_slices: int | None = None, slice_sizes: Sequence[int] | None = None,
                             ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                             bias: torch.Tensor | None = None, backend: str | None = None,
                             chunk_tokens: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(x @ weight.T, targets)`` without the [tokens, vocab] logits.

    Args:
        x: [..., hidden] hidden states (fp32/fp16/bf16/fp64).
        weight: the head weight [V, hidden] (nn.Linear / tied-embedding layout), cut
            into slices by ``osdp.contract.split_sizes`` (or ``slice_sizes``); or a
            list/tuple of slice tensors [rs_i, hidden] in vocabulary order (gradients
            flow to each).
        targets: integer class ids of shape x.shape[:-1].
        num_slices: slices to cut ``weight`` into (default 1: memory is bounded without
            cutting, see [Note: online log-sum-exp over vocabulary slices]).
        slice_sizes: explicit row counts summing to V (instead of num_slices).
        ignore_index, reduction: as in ``F.cross_entropy`` ("mean", "sum", "none").
        label_smoothing: only 0.0 is supported.
        bias: not supported (LM heads are bias-free).
        backend: "triton" | "torch" | None (auto; ``$OSDP_HEAD_CE_BACKEND`` overrides).
        chunk_tokens: tokens per transient logits chunk of the torch path and of the
            backward (default :func:`chunk_tokens_for`).
    """
    if label_smoothing != 0.0:
        raise ConfigError(f"label_smoothing={label_smoothing!r} is not supported by split_head_cross_entropy: "
                          "only label_smoothing=0.0 is; use F.cross_entropy(x @ W.T, ..., label_smoothing=...) "
                          "if the full logits fit")
    if bias is not None:
        raise ConfigError("bias is not supported by split_head_cross_entropy: only bias-free LM heads are "
                          "(bias=None); use F.cross_entropy(F.linear(x, weight, bias), targets) for a biased head")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ConfigError(f"x must be a tensor [..., hidden], got {a_type(x)}")
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ConfigError(f"targets must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got "
                          f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else a_type(targets)}")
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 2:
            raise ConfigError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
        V = weight.shape[0]
        if slice_sizes is not None:
            if num_slices is not None:
                raise ConfigError("pass num_slices or slice_sizes, not both")
            sizes = [int(r) for r in slice_sizes]
            if sum(sizes) != V or any(r < 1 for r in sizes):
                raise ConfigError(f"slice_sizes {sizes} must be positive and sum to the vocabulary size {V}")
        else:
            g = 1 if num_slices is None else num_slices
            if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= V:
                raise ConfigError(f"num_slices must be an int in [1, {V}] (the vocabulary size), got {num_slices!r}")
            sizes = split_sizes(V, g)
        weights = (weight,)
    elif isinstance(weight, (list, tuple)) and weight and all(isinstance(w, torch.Tensor) for w in weight):
        if num_slices is not None or slice_sizes is not None:
            raise ConfigError("weight is already a list of slices; do not pass num_slices / slice_sizes")
        weights, sizes = tuple(weight), None
    else:
        raise ConfigError(f"weight must be a [vocab, hidden] tensor or a non-empty list of slice tensors, "
                          f"got {a_type(weight)}")
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    t2 = targets.reshape(-1)
    loss = _SplitHeadCrossEntropy.apply(x2, t2, (reduction, ignore_index, backend, chunk_tokens, sizes), *weights)
    return loss.reshape(targets.shape) if reduction == "none" else loss


__all__ = ["HeadCEResult", "OnlineLSE", "chunk_tokens_for", "resolve_backend", "row_scale", "slice_backward",
           "split_head_cross_entropy"]
