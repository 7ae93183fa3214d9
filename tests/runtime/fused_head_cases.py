"""Per-rank bodies of ``test_fused_head.py``: a GPT whose head is split along the
vocabulary (untied, mixed per-slice modes) or tied to a row-split embedding, trained
with the fused head + loss on 2 gloo ranks; the reference is single-process training of
the same model on the whole global batch (``F.cross_entropy`` of the whole logits)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from osdp.models import GPT, GPTConfig, example_batch

UNTIED = GPTConfig(vocab_size=1031, seq_len=8, num_layers=2, hidden=16, heads=2)
TIED = GPTConfig(vocab_size=1031, seq_len=8, num_layers=2, hidden=16, heads=2, tie_embeddings=True)
STEPS, LOCAL_BATCH, LR, EPS, SEED = 4, 2, 1e-2, 1e-5, 777
IGNORED = 2  # the first tokens of every sample are ignore_index: equal counts per rank

CASES = {
    "untied": ("untied", dict(default_mode="zdp", modes={"lm_head": ("dp", "zdp", "zdp", "dp"), "wte": ("zdp", "dp")},
                              split_ops={"lm_head": "linear_out_features"})),
    "tied": ("tied", dict(default_mode="dp", modes={"wte": ("zdp", "dp", "zdp")}, prefetch_bytes=0)),
}


def make(key):
    torch.manual_seed(SEED)
    return GPT(TIED if key == "tied" else UNTIED)


def _batch(key, step, world):
    idx, targets = example_batch(TIED if key == "tied" else UNTIED, LOCAL_BATCH * world, seed=step)
    targets[:, :IGNORED] = -100
    return idx, targets


def reference(key, world):
    model = make(key)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        loss = model(*_batch(key, step, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def train(name, rank, world):
    import osdp

    key, kwargs = CASES[name]
    model = osdp.OSDP(make(key), **kwargs)
    fused_calls = []
    head = model.module.lm_head
    original = type(head).cross_entropy
    head.cross_entropy = lambda *a, **k: fused_calls.append(1) or original(head, *a, **k)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        idx, targets = (t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in _batch(key, step, world))
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses, model.full_state_dict(), len(fused_calls)


def run_all(rank, world):
    out = {"osdp": {name: train(name, rank, world) for name in CASES}}
    if rank == 0:
        out["ref"] = {key: reference(key, world) for key in ("tied", "untied")}
    return out
