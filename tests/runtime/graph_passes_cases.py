"""Per-rank body of ``test_graph_passes.py``: a forward's graph walked by more than one
backward pass ([Note: backward passes through one graph] in osdp/runtime/scheduler.py),
against one process on the whole global batch."""
from __future__ import annotations

import torch
import torch.distributed as dist

import osdp
from osdp.errors import OSDPError
from osdp.models import GPT, GPTConfig, example_batch

from . import split_batch_loop

CONFIG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)
LOCAL_BATCH, STEPS, PENALTY = 2, 3, 0.5
OSDP_ARGS = {
    "zdp": {"default_mode": "zdp"},
    "dp": {"default_mode": "dp"},
    "mixed": {"default_mode": "zdp", "modes": {"blocks.1.mlp.c_fc": "dp", "ln_f": "rep"}},
    "checkpointed": {"default_mode": "zdp", "checkpoint_blocks": ("blocks.0", "blocks.1")},
    "split": {"default_mode": "dp", "splits": {"blocks.1.mlp.c_fc": 2, "wte": 2}},
}


def retained_loss(model, idx, tgt, scale: float) -> torch.Tensor:
    """Two backward passes through one graph: the gradient of 1.5 x the loss (times
    ``scale``)."""
    loss = model(idx, tgt)
    (scale * loss).backward(retain_graph=True)
    (0.5 * scale * loss).backward()
    return loss


def penalized_loss(model, idx, tgt, scale: float) -> torch.Tensor:
    """A gradient penalty on the first block's output (``create_graph=True``), then the
    backward of (loss + penalty) x ``scale``, which walks the first backward's graph too."""
    out = {}
    handle = _blocks(model)[0].register_forward_hook(lambda _m, _a, y: out.setdefault("y", y))
    loss = model(idx, tgt)
    handle.remove()
    (grad,) = torch.autograd.grad(loss, out["y"], create_graph=True)
    (scale * (loss + PENALTY * grad.pow(2).sum())).backward()
    return loss


IDIOMS = {"retained": retained_loss, "penalized": penalized_loss}


def _blocks(model):
    return (model.module if isinstance(model, osdp.OSDP) else model).blocks


def train(model, idiom: str, rank: int | None, world: int) -> list[float]:
    """STEPS AdamW steps; ``rank`` None: one process, the mean over the ranks' parts (each
    part's penalty on its own gradient, as each rank's is)."""
    optim = torch.optim.AdamW(model.parameters(), lr=split_batch_loop.LR, eps=split_batch_loop.EPS)
    losses = []
    for step in range(STEPS):
        idx, tgt = example_batch(CONFIG, LOCAL_BATCH * world, seed=step)
        parts = range(world) if rank is None else (rank,)
        scale = 1.0 / world if rank is None else 1.0
        loss = sum(IDIOMS[idiom](model, idx[p * LOCAL_BATCH:(p + 1) * LOCAL_BATCH],
                                 tgt[p * LOCAL_BATCH:(p + 1) * LOCAL_BATCH], scale).item() * scale for p in parts)
        optim.step()
        optim.zero_grad()
        if rank is not None:
            total = torch.tensor(loss)
            dist.all_reduce(total)
            loss = total.item() / world
        losses.append(loss)
    return losses


def reference(idiom: str, world: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return {"losses": train(model, idiom, None, world), "state": model.state_dict()}


def run(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """Per case: the losses, the full state after training and the units still gathered;
    or the OSDPError it raised, then whether a plain step works after it."""
    out = {}
    for idiom, config in cases:
        torch.manual_seed(0)
        model = osdp.OSDP(GPT(CONFIG), **OSDP_ARGS[config])
        try:
            losses = train(model, idiom, rank, world)
        except OSDPError as exc:
            model.zero_grad()
            train(model, "retained", rank, world)
            out[(idiom, config)] = {"error": str(exc)}
            continue
        out[(idiom, config)] = {"losses": losses, "state": model.full_state_dict(rank0_only=False),
                                "gathered": model._scheduler.gathered_units()}
    return out
