"""Models built on the meta device against the same models built on the CPU
(``test_meta_build.py``): plain Embedding/Linear/LayerNorm stacks whose construction
order is their ``modules()`` order, tied, split and rep units; the per-rank body of the
2- and 3-rank runs."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, SEQ = 61, 12, 6
STEPS = 3


class Net(nn.Module):
    """Plain modules in construction order = ``modules()`` order; the head tied to the
    embedding (the tie after construction, as GPT-2 does)."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.ln = nn.LayerNorm(3 * HIDDEN)
        self.fc2 = nn.Linear(3 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        logits = self.head(self.fc2(F.gelu(self.ln(self.fc1(self.emb(idx))))))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# tied + split (the embedding by rows, the head follows) + rep; an in-features split
CONFIGS = {
    "split_tied_rep": dict(modes={"emb": ("zdp", "dp", "zdp"), "ln": "rep", "fc2": "dp"}),
    "split_in_rep": dict(modes={"fc1": ("dp", "zdp"), "fc2": "rep"}, splits={"fc1": 2}),
}


def build(meta: bool, tie: bool = True) -> nn.Module:
    if meta:
        with torch.device("meta"):
            return Net(tie)
    return Net(tie)


def batch(step: int, size: int):
    gen = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def run(rank: int, world_size: int):
    """Per config: wrap a CPU-built and a meta-built model with the same seed, compare
    their initial full state dicts, then train both 3 AdamW steps on this rank's batch."""
    import osdp

    out = {}
    for name, kwargs in CONFIGS.items():
        results = []
        for meta in (False, True):
            model = build(True) if meta else None
            torch.manual_seed(0)  # the same on every rank: a meta model is initialized when wrapped
            wrapped = osdp.OSDP(model if meta else build(False), **kwargs)
            init = wrapped.full_state_dict(rank0_only=False)
            optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
            losses = []
            for step in range(STEPS):
                idx, tgt = batch(step, 2 * world_size)
                loss = wrapped(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2])
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.item())
            results.append({"init": init, "losses": losses, "final": wrapped.full_state_dict(rank0_only=False),
                            "names": [n for n, _ in wrapped.named_parameters()]})
        out[name] = results
    dist.barrier()
    return out
