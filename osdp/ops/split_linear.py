"""nn.Linear split along ``in_features``: ``Y = sum_i X[:, k_i] @ W[:, k_i]^T + b``.

Slice ``i`` owns the columns ``W[:, k_i:k_i+ks_i]``; slice 0 also owns the bias, added
once. The schedule is [Note: split matmul schedule] in ``matmul_split.py``.
"""
from __future__ import annotations

import torch.nn as nn

from .matmul_split import MatmulSplit
from .registry import register_split_op


@register_split_op
class SplitLinear(MatmulSplit):
    """nn.Linear cut into ``g`` slices along ``in_features`` (uneven sizes allowed:
    the first ``in_features % g`` slices get one more column)."""

    module_type = nn.Linear
    op_name = "linear_in_features"
    axis = "in_features"
    cut = "in"
