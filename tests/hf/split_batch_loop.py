"""The training loop the Hugging Face tests of other models and of LoRA share: AdamW
steps on a global batch split evenly between the ranks, against one process that takes
the mean of the parts' losses (the same gradient)."""
from __future__ import annotations

import torch
import torch.distributed as dist

LR, EPS = 1e-2, 1e-5  # eps: keeps rounding from being amplified (tests/runtime/parity_cases.py)


def train(model, global_batch, steps: int, world: int, rank: int | None) -> list[float]:
    """``steps`` AdamW steps on the trainable parameters; ``global_batch(step)``: the
    keyword inputs (``labels`` among them) of all ranks, split along dim 0 (values that
    are not tensors passed to every part); ``rank`` None: single process."""
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        parts = [_part(global_batch(step), r, world) for r in range(world)]
        if rank is None:
            loss = sum(model(**part).loss for part in parts) / world
        else:
            loss = model(**parts[rank]).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def _part(batch: dict, rank: int, world: int) -> dict:
    def cut(value):
        if not torch.is_tensor(value):
            return value
        size = value.shape[0] // world
        return value[rank * size:(rank + 1) * size]

    return {key: cut(value) for key, value in batch.items()}
