"""nn.Linear split along ``out_features``: ``Y[:, n_i] = X @ W[n_i, :]^T + b[n_i]``.

Slice ``i`` owns the rows ``W[n_i:n_i+ns_i, :]`` (contiguous), slice 0 also the whole
bias (``matmul_split.py``), so each slice computes its own block of output columns and
no slice's product is summed with another's. Suited to fused projections (a GPT QKV ``c_attn``: out = 3 x
in) and wide heads, where the K-split's fp32 accumulator would be the whole output.
Not the default for nn.Linear: chosen by name (``split_ops={name:
"linear_out_features"}``). Schedule: [Note: split matmul schedule] in
``matmul_split.py``. It is also the op of a tied LM head whose weight is a row-split
embedding's (the slices are the embedding's units; see [Note: tied row split] in
``osdp/contract.py``); a per-slice consumer (a fused loss) drives it through
``forward_slices`` / ``backward_slices``: :meth:`SplitLinearOut.cross_entropy`, see
[Note: fused head on split slices] in ``fused_head.py``.
"""
from __future__ import annotations

import warnings

import torch.nn as nn

from .fused_head import fused_head_cross_entropy, fuses_loss, head_hooks
from .matmul_split import MatmulSplit
from .registry import register_split_op


@register_split_op
class SplitLinearOut(MatmulSplit):
    """nn.Linear cut into ``g`` slices along ``out_features``."""

    module_type = nn.Linear
    op_name = "linear_out_features"
    axis = "out_features"
    cut = "out"
    default_for_type = False
    # an Embedding tied to the split weight looks up the same rows, slice for slice
    tied_use_op = "embedding_rows"

    def fuses_loss(self) -> bool:
        """Whether a model's forward should compute its loss with :meth:`cross_entropy`:
        bias-free and no hooks of its own, which only a call of the head runs (with such
        hooks the logits are built, once warned: the plan assumed they never exist)."""
        hooks = head_hooks(self)
        if hooks and not getattr(self, "_warned_hooks", False):
            self._warned_hooks = True
            warnings.warn(f"the vocabulary-split head has {' and '.join(hooks)}s of its own: its loss runs on whole "
                          "logits so that they run, above the plan's memory (it assumed the fused loss, which "
                          "builds no logits)", stacklevel=3)
        return fuses_loss(self)

    def cross_entropy(self, x, targets, *, ignore_index: int = -100, reduction: str = "mean",
                      label_smoothing: float = 0.0):
        """``F.cross_entropy`` of this head's logits without building them: see [Note:
        fused head on split slices] in ``fused_head.py``."""
        return fused_head_cross_entropy(self, x, targets, ignore_index=ignore_index, reduction=reduction,
                                        label_smoothing=label_smoothing)
