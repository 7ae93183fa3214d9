"""Activation checkpointing of whole modules (``plan.checkpoint_blocks``).

Non-reentrant ``torch.utils.checkpoint`` around the module's forward. The recompute
runs the module's forward again inside backward; the scheduler sees it as a recompute
(see [Note: activation checkpointing]) and gathers ``zdp`` units again for it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_checkpointing(model: nn.Module, blocks: tuple[str, ...]) -> None:
    for path in blocks:
        module = model.get_submodule(path)
        inner = module.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
