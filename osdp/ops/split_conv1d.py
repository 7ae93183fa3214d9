"""Hugging Face ``Conv1D`` (GPT-2's projections) split along its input axis.

``Conv1D(nf, nx)`` computes ``y = x @ W + b`` with ``W`` of shape ``[nx, nf]``: a Linear
with the weight stored transposed. Split along ``nx`` into ``g`` slices, slice ``i``
owns the rows ``W[k_i:k_i+ks_i, :]`` (contiguous in memory) and
``y = sum_i X[:, k_i:k_i+ks_i] @ W_i + b``; slice 0 also owns the bias.

It is the in-features split of ``matmul_split.py`` with a transposed layout: ``W_i.t()``
is a ``[nf, ks_i]`` Linear-layout slice and ``dW_i`` is written through the transposed
view of the slice's gradient buffer. Every transpose is a stride swap, never a copy.

Importing this module imports ``transformers`` (the op is keyed by its ``Conv1D``
type); ``osdp.ops`` registers it on first use when ``transformers`` is loaded.
"""
from __future__ import annotations

from .matmul_split import MatmulSplit
from .registry import register_split_op

try:
    from transformers.pytorch_utils import Conv1D
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "osdp.ops.split_conv1d splits transformers' Conv1D and needs the `transformers` "
        "package: pip install transformers"
    ) from exc


@register_split_op
class SplitConv1D(MatmulSplit):
    """transformers' ``Conv1D`` cut into ``g`` slices along ``nx`` (its input features,
    ``weight.shape[0]``); uneven sizes allowed, the first ``nx % g`` slices one larger."""

    module_type = Conv1D
    op_name = "conv1d_nx"
    axis = "in_features"
    cut = "in"
    transposed = True  # Conv1D stores W^T: [nx, nf]
