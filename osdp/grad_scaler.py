"""``osdp.GradScaler(model)``: loss scaling for fp16 training of an OSDP model.

``torch.amp.GradScaler`` decides from this rank's gradients whether to skip the step;
an OSDP rank holds shards of the gradients, so an overflow in one rank's shards made
that rank alone skip its step and halve its scale ([Note: optimizer steps in lockstep]
in runtime/optimizer_steps.py). This one agrees on the overflow over every rank of the
model's layout (an all-reduce of the found-inf flag per ``unscale_``), so every rank
skips or steps alike and keeps the same scale: FSDP's ``ShardedGradScaler``, given the
model's device and process group. Use it as ``torch.amp.GradScaler``::

    scaler = osdp.GradScaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_(optim)             # before clipping
    model.clip_grad_norm_(1.0)
    scaler.step(optim)
    scaler.update()
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from .api import ShardedModel
from .errors import OSDPError


class GradScaler(ShardedGradScaler):
    """``torch.amp.GradScaler``'s arguments after the OSDP-wrapped ``model`` (also one
    under ``torch.compile``); the found inf is all-reduced over the model's ranks."""

    def __init__(self, model: nn.Module, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        wrapped = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
        if not isinstance(wrapped, ShardedModel):
            raise OSDPError(
                f"osdp.GradScaler(model) takes a model wrapped by osdp.OSDP, got {type(model).__name__}: wrap it "
                "first (osdp.GradScaler(osdp.OSDP(model, ...))), or use torch.amp.GradScaler for a model that is "
                "not sharded"
            )
        super().__init__(wrapped.device.type, init_scale=init_scale, backoff_factor=backoff_factor,
                         growth_factor=growth_factor, growth_interval=growth_interval, enabled=enabled,
                         process_group=wrapped.layout.world.group)
