"""Where a model's repeated blocks are: read by the planner (checkpointable blocks) and
by the compiled runtime (the regions it compiles one by one)."""
from __future__ import annotations

import torch.nn as nn


def transformer_blocks(model: nn.Module) -> list[str]:
    """The children of every ``nn.ModuleList`` (transformer layers), by path."""
    return [
        f"{name}.{i}" if name else str(i)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for i, _ in enumerate(module)
    ]
