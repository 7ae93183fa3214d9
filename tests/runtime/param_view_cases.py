"""Per-rank body of ``test_param_view_outputs.py``: a module whose forward returns a
view of its own parameter (stock Perceiver's latents: ``self.latents.expand(b, -1, -1)``),
read by the next module after the unit's weights were freed."""
from __future__ import annotations

import torch
import torch.nn as nn

import osdp

from .parity_cases import _mean_loss

LOCAL_BATCH, STEPS, LR = 2, 3, 0.05
OSDP_ARGS = {
    "zdp": {"default_mode": "zdp"},
    "dp": {"default_mode": "dp"},
    "checkpointed": {"default_mode": "zdp", "checkpoint_blocks": ("blocks.0",)},
}


class Latents(nn.Module):
    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(16, 32))

    def forward(self, batch_size: int) -> torch.Tensor:
        return self.latents.expand(batch_size, -1, -1)  # a view of the (gathered) parameter


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.mix = nn.Linear(32, 32)

    def forward(self, hidden, inputs):
        return hidden + self.mix(self.norm(hidden) * inputs.mean(1, keepdim=True).unsqueeze(1))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.latents = Latents()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 1)

    def forward(self, inputs):
        hidden = self.latents(inputs.shape[0])
        for block in self.blocks:
            hidden = block(hidden, inputs)
        return self.head(hidden).pow(2).mean()


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(LOCAL_BATCH * world, 32, generator=torch.Generator().manual_seed(step))


def train(model, rank: int | None, world: int) -> list[float]:
    """STEPS AdamW steps; ``rank`` None: one process on every rank's part (the mean)."""
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs = batch(step, world)
        parts = inputs.split(LOCAL_BATCH)
        loss = model(parts[rank]) if rank is not None else sum(model(p) for p in parts) / world
        loss.backward()
        optim.step()
        optim.zero_grad()
        # the mean over the ranks, as one process computes it
        losses.append(_mean_loss(loss, world) if rank is not None else loss.item())
    return losses


def run(rank: int, world: int, configs) -> dict:
    out = {}
    for config in configs:
        model = osdp.OSDP(build(), **OSDP_ARGS[config])
        losses = train(model, rank, world)
        out[config] = {"losses": losses, "state": {k: v.clone() for k, v in model.full_state_dict(False).items()}}
    return out
