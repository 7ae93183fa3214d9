"""The compiled path with inductor (so OSDP's own inductor passes run: the prefetch
order and the small units' coalescing) on a model OSDP's authors did not write, torch's
test Transformer (tests/torch_transformer.py), in a loop written as users write theirs:
their own loss outside the model, weight-decay groups by parameter name, gradient
clipping, batches whose shapes change. References: single-process training on the whole
batch and eager OSDP on the same ranks. Run inside one spawn
(tests/runtime/test_compiled.py)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.profiler import profile
from torch_transformer import TiedTransformer

import osdp

from .compiled_cases import EPS, LR, mean_over_ranks, trained

VOCAB, SEQ = 101, 16


def _transformer() -> TiedTransformer:
    torch.manual_seed(0)
    return TiedTransformer(vocab=VOCAB, seq=SEQ, dim=64, layers=2, heads=4, p=0.0)  # no dropout: no RNG to match


def _decay_groups(model) -> list[dict]:
    """The loop's own groups: matrices decay; norms, biases and the (tied) embedding do not."""
    decay, rest = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and "embeddings" not in name else rest).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _train(model, rank, world, shapes, after_step=lambda step: None, profiled=None) -> list[float]:
    """An AdamW step per (local batch, sequence length) in ``shapes``, on this rank's slice
    of the global batch (``rank`` None: all of it); the per-step losses (mean over
    ranks). The last step runs under the profiler: ``profiled`` gets the calls of each
    functional collective."""
    opt = torch.optim.AdamW(_decay_groups(model), lr=LR, eps=EPS)
    losses = []
    for step, (batch, seq) in enumerate(shapes):
        tokens = torch.randint(0, VOCAB, (batch * world, seq + 1), generator=torch.Generator().manual_seed(step))
        if rank is not None:
            tokens = tokens[rank * batch:(rank + 1) * batch]
        with profile() if profiled is not None and step == len(shapes) - 1 else contextlib.nullcontext() as prof:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
        if prof is not None:
            profiled.update({e.key: e.count for e in prof.key_averages() if e.key.startswith("_c10d_functional::")})
        if rank is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if rank is None else mean_over_ranks(loss, world))
        after_step(step)
    return losses


def run_transformer_case(rank: int, world: int, scope: str, kwargs: dict, shapes: tuple) -> dict:
    torch._dynamo.reset()
    counters.clear()
    ref = _transformer()
    ref_losses = _train(ref, None, world, shapes)
    eager = osdp.OSDP(_transformer(), **kwargs)
    eager_losses = _train(eager, rank, world, shapes)
    eager_state = eager.full_state_dict(rank0_only=False)
    compiled = osdp.OSDP(_transformer(), compile={"scope": scope}, **kwargs)  # inductor
    graphs, collectives = [], {}
    losses = _train(compiled, rank, world, shapes, profiled=collectives,
                    after_step=lambda step: graphs.append(counters["stats"]["unique_graphs"]))
    return {"losses": losses, "eager_losses": eager_losses, "ref_losses": ref_losses, "graphs": graphs,
            "collectives": collectives, **trained(compiled, eager_state, ref)}


def run_transformer_cases(rank: int, world: int, cases: list[tuple]) -> dict:
    return {name: run_transformer_case(rank, world, *case) for name, *case in cases}
