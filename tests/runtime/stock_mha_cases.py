"""Per-rank body of ``test_stock_mha.py``: stock ``nn.TransformerEncoder`` layers (their
``nn.MultiheadAttention`` reads ``out_proj.weight`` itself) wrapped with no
``leaf_modules``, by hand, compiled and from a plan the planner made for them; then
evaluated under no_grad."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import osdp
from osdp.planner import PlannerSettings, make_plan
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
from osdp.planner.description import describe
from osdp.planner.run import RunSettings

from .parity_cases import _mean_loss

LOCAL_BATCH, SEQ, VOCAB, WIDTH, STEPS, LR = 2, 8, 40, 32, 3, 0.02


class Encoder(nn.Module):
    """Embedding, 2 stock encoder layers, head; ``batch_first`` as users pick it."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        hidden = self.embed(tokens if self.batch_first else tokens.t())
        hidden = self.encoder(hidden)
        return self.head(hidden if self.batch_first else hidden.transpose(0, 1))


def build(batch_first: bool) -> Encoder:
    torch.manual_seed(0)
    return Encoder(batch_first)


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ), generator=gen)
    return tokens, tokens.roll(-1, dims=1)


def train(model, rank: int | None, world: int) -> list[float]:
    """STEPS AdamW steps of the user's own loss; ``rank`` None: one process on every
    rank's part (the mean)."""
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step, world)
        parts = list(zip(tokens.split(LOCAL_BATCH), targets.split(LOCAL_BATCH)))
        mine = parts if rank is None else [parts[rank]]
        loss = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in mine) / len(mine)
        loss.backward()
        optim.step()
        optim.zero_grad()
        # the mean over the ranks, as one process computes it
        losses.append(_mean_loss(loss, world) if rank is not None else loss.item())
    return losses


def planned(model: nn.Module, world: int):
    """The planner's plan for ``model`` (describe's measured activations, a loose limit)."""
    tokens, _ = batch(0, 1)
    desc = describe(model, (tokens,))
    device = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0).for_run(
        RunSettings(world_size=world, memory_limit_bytes=64 << 20))
    return make_plan(desc, device, PlannerSettings(), batch=LOCAL_BATCH)


def evaluated(model) -> torch.Tensor:
    """The output in eval mode under no_grad, where torch's encoder layers take their
    fused fast path ([Note: fused layer fast path] in osdp/runtime/compiled.py)."""
    model.eval()
    with torch.no_grad():
        return model(batch(STEPS, 1)[0])


def run(rank: int, world: int, configs: list[str]) -> dict:
    out = {}
    for config in configs:
        batch_first = config.endswith("batch_first")
        model = build(batch_first)
        if config.startswith("planned"):
            plan = planned(model, world)
            wrapped = osdp.OSDP(build(batch_first), plan=plan)
        elif config.startswith("compiled"):
            wrapped = osdp.OSDP(model, default_mode="zdp", compile={"backend": "aot_eager"})
        else:
            wrapped = osdp.OSDP(model, default_mode=config.split("_")[0])
        out[config] = {"losses": train(wrapped, rank, world), "state": wrapped.full_state_dict(rank0_only=False),
                       "units": wrapped.unit_names(), "eval": evaluated(wrapped)}
    return out
