"""One example module per registered split op, and the per-rank body of the 2-rank
parity check. A new split op adds its example here (the conformance suite fails for an
op without one)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import osdp
from osdp.ops import registered_split_ops

try:  # registers the Conv1D split op
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = None

IN, OUT, TOKENS = 11, 7, 5  # odd sizes: uneven slices


def _float_input(gen, batch=2):
    return torch.randn(batch, TOKENS, IN, generator=gen)


def _ids(gen, batch=2):
    return torch.randint(0, OUT + 6, (batch, TOKENS), generator=gen)


def _seeded(factory):
    torch.manual_seed(0)
    return factory()


EXAMPLES = {  # op name -> (module factory, input factory)
    "linear_in_features": (lambda: nn.Linear(IN, OUT), _float_input),
    "linear_out_features": (lambda: nn.Linear(IN, OUT), _float_input),
    "embedding_rows": (lambda: nn.Embedding(OUT + 6, IN), _ids),
}
if Conv1D is not None:
    EXAMPLES["conv1d_nx"] = (lambda: Conv1D(OUT, IN), _float_input)


def op_names() -> list[str]:
    return sorted(registered_split_ops())


def example(op_name: str):
    factory, inputs = EXAMPLES[op_name]
    return _seeded(factory), inputs


def wrap(module: nn.Module, op_name: str, g: int, modes=None, **kwargs):
    modes = modes or tuple(("zdp", "dp")[i % 2] for i in range(g))
    return osdp.OSDP(nn.Sequential(module), modes={"0": modes}, split_ops={"0": op_name}, **kwargs)


STEPS, G = 3, 3


def parity_run(rank: int, world: int, op_name: str):
    """OSDP on ``world`` ranks (each a slice of the global batch) vs the losses and
    final parameters of single-process SGD on the whole batch (computed on rank 0)."""
    module, inputs = example(op_name)
    reference = nn.Sequential(example(op_name)[0])
    wrapped = wrap(module, op_name, G)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, ref_losses = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        batch = inputs(gen, batch=2 * world)
        local = batch[rank * 2 : (rank + 1) * 2]
        loss = wrapped(local).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        ref_loss = reference(batch).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    state = wrapped.full_state_dict()
    ref_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    return losses, ref_losses, (state if rank == 0 else None), ref_state
