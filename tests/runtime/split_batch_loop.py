"""The training loop several parity tests share (Hugging Face models, LoRA, a user's
mixture of experts): AdamW steps on a global batch split evenly between the ranks,
against one process that takes the mean of the parts' losses (the same gradient)."""
from __future__ import annotations

import torch
import torch.distributed as dist

LR, EPS = 1e-2, 1e-5  # eps: keeps rounding from being amplified (tests/runtime/parity_cases.py)


def hf_loss(model, part: dict):
    """A Hugging Face model's own loss: ``part`` holds its keyword inputs, labels too."""
    return model(**part).loss


def train(model, global_batch, steps: int, world: int, rank: int | None, loss_of=hf_loss,
          zero_grad_of=()) -> list[float]:
    """``steps`` AdamW steps on the trainable parameters; ``global_batch(step)``: a dict
    of all ranks' inputs, split along dim 0 (values that are not tensors passed to every
    part); ``loss_of(model, part)``: the loss of one part; ``rank`` None: single
    process. ``zero_grad_of``: parameters given a zero gradient where the backward gave
    them none (a leaf module's, as OSDP reduces them: [Note: leaf modules])."""
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        parts = [_part(global_batch(step), r, world) for r in range(world)]
        if rank is None:
            loss = sum(loss_of(model, part) for part in parts) / world
        else:
            loss = loss_of(model, parts[rank])
        loss.backward()
        for p in zero_grad_of:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
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
