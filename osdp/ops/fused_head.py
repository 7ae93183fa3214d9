"""The fused head + loss of a vocabulary-cut split op: ``head.cross_entropy(x, targets)``
equals ``F.cross_entropy(head(x).flatten(0, -2), targets.flatten())`` without ever
building the [tokens, vocab] logits.

[Note: fused head on split slices]
A head split along vocabulary (``linear_out_features``: an untied LM head, or the tied
use of a row-split embedding, [Note: tied row split] in ``osdp/contract.py``) holds one
gathered slice at a time. Its cross-entropy runs the slice loop of [Note: split matmul
schedule] with another consumer: forward, ``MatmulSplit.forward_slices`` hands each
gathered slice ``W_i`` (rows ``[n0, n0 + ns_i)``) to ``OnlineLSE.update`` ([Note: online
log-sum-exp over vocabulary slices] in ``head_cross_entropy.py``); the loss and the
per-token log-sum-exp come out of ``finish``. Kept for backward: X, the targets, lse
([tokens] fp32) and the slice uses; nothing of vocabulary size. Backward,
``backward_slices`` hands each slice again (gathered again if ``zdp``) with its
unsharded gradient buffer; ``slice_backward`` recomputes the slice's logits chunk by
chunk, adds ``G_i W_i`` into one fp32 dX accumulator (cast once after the last slice)
and writes ``dW_i = G_i^T X`` straight into the buffer (Linear layout through
``linear_view``; added when the buffer already holds a gradient: a second use of the
slice, an accumulated micro-batch). The slice is released after, so its reduce-scatter
follows its last use as for the op's own backward; for a tied slice the lookup's
backward adds its rows after the head's, as before.

What the planner assumes of it (docs/design/cost_model.md's [Note: fused vocabulary-split
loss]): a split head holds no logits; the peak transient is one [chunk, ns_i] block of
``slice_backward`` (sized about like X by ``chunk_tokens_for``).

Limits: no bias (LM heads are bias-free; a biased head raises ConfigError), label
smoothing 0 only, the same ``ignore_index`` / ``reduction`` as ``F.cross_entropy``.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .head_cross_entropy import REDUCTIONS, OnlineLSE, row_scale, slice_backward
from .kernels import accumulator_dtype


class _FusedHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, targets, expects_backward: bool, module, opts, *shards):
        reduction, ignore_index = opts
        x2 = x.reshape(-1, module.in_features)
        t2 = targets.reshape(-1)
        state = None

        def consume(i, weight, bias, n0):
            nonlocal state
            if state is None:  # the gathered (compute) dtype: param_dtype under mixed precision
                state = OnlineLSE.start(x2.to(weight.dtype), t2, ignore_index=ignore_index)
            state.update(weight, n0)

        ctx.uses = module.forward_slices(consume, expects_backward)
        res = state.finish(reduction, vocab_size=module.out_features)
        ctx.module, ctx.opts, ctx.x_dtype, ctx.x_shape = module, opts, x.dtype, x.shape
        ctx.save_for_backward(state.x, state.targets, res.lse, res.n_valid)
        return res.loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        module, (reduction, ignore_index) = ctx.module, ctx.opts
        x2, t2, lse, n_valid = ctx.saved_tensors
        acc = accumulator_dtype(x2.dtype)
        scale = row_scale(t2, grad_out, n_valid, reduction=reduction, ignore_index=ignore_index, dtype=acc)
        need_dx = ctx.needs_input_grad[0]
        dx = torch.zeros(x2.shape, dtype=acc, device=x2.device)

        def grads_of(i, weight, grads, accumulate, n0):
            if grads is None:  # a frozen slice, or no weight gradient wanted: only its part of dX
                if need_dx:
                    slice_backward(x2, weight, n0, lse, t2, scale, dx_out=dx)
                return
            dw = module.linear_view(grads[0])  # [ns_i, K], a view of the unsharded gradient
            direct = dw.is_contiguous() and (not accumulate or dw.dtype == acc)
            if direct:
                slice_backward(x2, weight, n0, lse, t2, scale, dx_out=dx, dw_out=dw, accumulate_dw=accumulate)
                return
            _, dw_i = slice_backward(x2, weight, n0, lse, t2, scale, dx_out=dx,
                                     dw_out=torch.empty(dw.shape, dtype=acc, device=dw.device))
            dw.add_(dw_i) if accumulate else dw.copy_(dw_i)

        module.backward_slices(ctx.uses, grads_of, module.wanted_grads(ctx))
        dx = dx.to(ctx.x_dtype).view(*ctx.x_shape) if need_dx else None
        return (dx, None, None, None, None) + (None,) * module.g


def head_hooks(head) -> list[str]:
    """The kinds of hooks registered on ``head`` itself, which a call of the module runs
    and the fused loss cannot (it never builds the output they would see)."""
    kinds = {"forward pre-hook": head._forward_pre_hooks, "forward hook": head._forward_hooks,
             "backward hook": head._backward_hooks, "backward pre-hook": head._backward_pre_hooks}
    return [kind for kind, hooks in kinds.items() if hooks]


def fuses_loss(head) -> bool:
    """Whether a model's forward should take ``head.cross_entropy`` (the fused loss) over
    ``head(x)`` and a loss on the logits: a vocabulary-cut split op, bias-free, with no
    hooks of its own that the fused loss would bypass."""
    return (getattr(head, "cut", None) == "out" and hasattr(head, "cross_entropy") and not head.has_bias
            and not head_hooks(head) and "_osdp_compiled" not in head.__dict__)  # compiled: logits + loss


def fused_head_cross_entropy(head, x: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                             reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of ``head(x)`` (``head`` a vocabulary-cut :class:`MatmulSplit`)
    against ``targets`` (shape ``x.shape[:-1]``), slice by slice: see [Note: fused head on
    split slices]. ``reduction`` "mean" / "sum" / "none" and ``ignore_index`` as in
    ``F.cross_entropy``; "none" returns ``targets.shape``."""
    if head.cut != "out":
        raise ConfigError(f"{type(head).__name__} cuts {head.axis}: the fused loss needs a head cut along its "
                          "output features (the vocabulary, op 'linear_out_features')")
    if head.has_bias:
        raise ConfigError("the fused head loss supports bias-free heads only (LM heads are bias-free); this head "
                          "has a bias: call the head and F.cross_entropy on its logits instead")
    if head_hooks(head):
        raise ConfigError(f"the head has {' and '.join(head_hooks(head))}s of its own, which the fused loss would "
                          "not run (it never builds the logits they see): call the head and F.cross_entropy on "
                          "its logits instead, or remove the hooks")
    if label_smoothing != 0.0:
        raise ConfigError(f"label_smoothing={label_smoothing!r} is not supported by the fused head loss: only 0.0")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction={reduction!r} is not supported; use one of {REDUCTIONS}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != head.in_features:
        raise ConfigError(f"x must be [..., {head.in_features}] (the head's in_features), got "
                          f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ConfigError(f"targets must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got "
                          f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    # decided here: inside Function.forward grad mode is always off
    expects_backward = torch.is_grad_enabled() and (x.requires_grad or any(s.requires_grad for s in head.flat_shards))
    loss = _FusedHeadCrossEntropy.apply(x, targets, expects_backward, head, (reduction, ignore_index),
                                        *head.shard_inputs())
    return loss.reshape(targets.shape) if reduction == "none" else loss


__all__ = ["fused_head_cross_entropy", "fuses_loss", "head_hooks"]
