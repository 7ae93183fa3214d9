"""Per-rank body of ``test_lockstep.py``: ranks that skip different layers of the same
shape (a user's own LayerDrop), so that their collectives match in size and differ only
in which unit they carry ([Note: lockstep check] in osdp/runtime/lockstep_check.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

import osdp

LR = 0.1


class Stack(nn.Module):
    """Four layers of one shape; ``skip``: the layer this forward leaves out (None: none)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.skip = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x))
        return x


def build() -> Stack:
    torch.manual_seed(0)
    return Stack()


def inputs(step: int, rank: int | None) -> torch.Tensor:
    """Rank ``rank``'s batch of step ``step`` (None: both ranks' rows)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
    return x if rank is None else x[2 * rank:2 * rank + 2]


def step(model, optim, x) -> float:
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def run(rank: int, world: int, check: bool, wrap: dict | None = None) -> dict:
    """Step 0 in lockstep; step 1 with rank 0 skipping layer 1 and rank 1 layer 2 (the
    error expected, the optimizer not stepped); step 2 in lockstep again."""
    model = osdp.OSDP(build(), lockstep_check=check, **(wrap or {}))
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"error": None}
    step(model, optim, inputs(0, rank))
    model.unwrapped.skip = 1 + rank
    try:
        step(model, optim, inputs(1, rank))
    except osdp.RanksOutOfStepError as exc:
        out["error"] = str(exc)
        optim.zero_grad()
    model.unwrapped.skip = None
    step(model, optim, inputs(2, rank))
    out["state"] = model.full_state_dict(rank0_only=False)
    return out


def reference() -> dict:
    """One process, steps 0 and 2 on both ranks' rows (the out-of-step step dropped)."""
    model = build()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    for s in (0, 2):
        step(model, optim, inputs(s, None))
    return model.state_dict()
