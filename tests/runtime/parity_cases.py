"""Models, OSDP configurations and the per-rank training loop of the parity tests.

Each case trains 20 AdamW steps on its slice of the global batch; the references are
single-process training on the whole global batch (mean loss) and FSDP2
``fully_shard`` on the same ranks. Everything runs inside one spawn per world size.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from osdp.errors import PlanMismatchError
from osdp.models import GPT, GPTConfig, example_batch
from osdp.runtime.config import mode_names

STEPS = 20
LOCAL_BATCH = 2
LR = 1e-2
EPS = float(__import__("os").environ.get("OSDP_TEST_EPS", "1e-5"))

# numel of most units (330, 110, 410, 970, ...) is not divisible by 2 or 4: padded shards
UNEVEN = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)
TIED = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2, tie_embeddings=True)
IC = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden=8, heads=2, block_hidden=(8, 12))
TWICE_VOCAB = 50


class TwiceNet(nn.Module):
    """A module called twice per forward, one never called, one whose output is unused."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(TWICE_VOCAB, 12)
        self.shared = nn.Linear(12, 12)
        self.dead = nn.Linear(12, 12)  # called, output not in the loss
        self.unused = nn.Linear(12, 12)  # never called
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, TWICE_VOCAB)

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = F.gelu(self.shared(x))
        self.dead(x)
        x = x + self.shared(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(key: str) -> nn.Module:
    torch.manual_seed(1234)
    if key == "uneven":
        return GPT(UNEVEN)
    if key == "tied":
        return GPT(TIED)
    if key == "ic":
        return GPT(IC)
    if key == "frozen":
        model = GPT(UNEVEN)
        for p in list(model.blocks[0].parameters()) + list(model.wpe.parameters()):
            p.requires_grad_(False)
        return model
    if key == "twice":
        return TwiceNet()
    raise KeyError(key)


def global_batch(key: str, step: int, world_size: int):
    batch = LOCAL_BATCH * world_size
    if key == "twice":
        gen = torch.Generator().manual_seed(step)
        idx = torch.randint(0, TWICE_VOCAB, (batch, 9), generator=gen)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    cfg = {"uneven": UNEVEN, "frozen": UNEVEN, "tied": TIED, "ic": IC}[key]
    return example_batch(cfg, batch, seed=step)


def global_batch_sized(key: str, step: int, batch: int):
    """Like :func:`global_batch` with an explicit global batch size (GPT models)."""
    cfg = {"uneven": UNEVEN, "frozen": UNEVEN, "tied": TIED, "ic": IC}[key]
    return example_batch(cfg, batch, seed=step)


def _alternating(model):
    return {name: ("dp", "zdp")[i % 2] for i, name in enumerate(mode_names(model))}


def _random(model, seed=7):
    rng = random.Random(seed)  # same on every rank
    return {name: rng.choice(("dp", "zdp")) for name in mode_names(model)}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    kwargs: object  # model -> OSDP keyword arguments
    checkpointed: tuple[str, ...] = field(default=())


def _split_kwargs(model, window=None):
    modes = _random(model, seed=3)
    modes["blocks.0.mlp.c_fc"] = ("zdp", "dp", "zdp", "dp")  # in_features 10: slices 3,3,2,2
    modes["blocks.1.mlp.c_proj"] = ("dp", "zdp")
    modes["wte"] = ("zdp", "dp", "zdp")  # embedding split by rows
    kwargs = {"modes": modes, "splits": {"blocks.1.attn.c_attn": 2}}
    if window is not None:
        kwargs["prefetch_bytes"] = window
    return kwargs


CASES = [
    Case("all_dp", "uneven", lambda m: {"default_mode": "dp"}),
    Case("all_zdp", "uneven", lambda m: {"default_mode": "zdp"}),
    Case("alternating", "uneven", lambda m: {"modes": _alternating(m)}),
    Case("random", "uneven", lambda m: {"modes": _random(m)}),
    Case("random_no_prefetch", "uneven", lambda m: {"modes": _random(m, seed=11), "prefetch_bytes": 0}),
    # the same modes as "random", every collective on its own (no coalesced small units)
    Case("random_no_coalesce", "uneven", lambda m: {"modes": _random(m), "coalesce_bytes": 0}),
    Case("split_mixed", "uneven", _split_kwargs),
    Case("split_mixed_no_prefetch", "uneven", lambda m: _split_kwargs(m, window=0)),
    Case(
        "checkpoint_split",
        "uneven",
        lambda m: {
            "modes": {**_random(m, seed=5), "blocks.1.mlp.c_fc": ("zdp", "dp")},
            "checkpoint_blocks": ("blocks.0", "blocks.1"),
        },
        checkpointed=("blocks.0", "blocks.1"),
    ),
    Case("tied_random", "tied", lambda m: {"modes": _random(m, seed=2)}),
    Case("tied_zdp_split", "tied", lambda m: {"default_mode": "zdp", "modes": {"lm_head": "zdp"}, "splits": {"blocks.0.attn.c_attn": 2}}),
    Case("tied_dp", "tied", lambda m: {"default_mode": "dp"}),
    Case("ic_random_split", "ic", lambda m: {"modes": _random(m, seed=4), "splits": {"bridges.1": 2, "blocks.1.mlp.c_fc": 4}}),
    Case("frozen_random", "frozen", lambda m: {"modes": _random(m, seed=6)}),
    Case(
        "frozen_zdp_checkpoint",
        "frozen",
        lambda m: {"default_mode": "zdp", "checkpoint_blocks": ("blocks.0", "blocks.1")},
        checkpointed=("blocks.0", "blocks.1"),
    ),
    Case("twice_dp", "twice", lambda m: {"default_mode": "dp"}),
    Case("twice_zdp", "twice", lambda m: {"default_mode": "zdp", "prefetch_bytes": 10**6}),
]


def _local(batch, rank):
    return tuple(t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for t in batch)


def train_reference(key: str, world_size: int):
    """Single process, whole global batch, mean loss."""
    model = make_model(key)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(key, step, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _mean_loss(loss, world_size):
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world_size


def train_fsdp2(key: str, rank: int, world_size: int):
    from torch.distributed.fsdp import fully_shard

    model = make_model(key)
    for module in model.modules():
        if module is not model and type(module).__name__ == "Block":
            fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        loss = model(*_local(global_batch(key, step, world_size), rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_loss(loss, world_size))
    state = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        state[k] = full.detach().clone()
    return losses, state if rank == 0 else None


def _count_collectives(comm) -> dict:
    """Count the collectives ``comm`` issues, by method (instance attributes shadow them)."""
    calls: dict[str, int] = {}
    for name in ("all_gather", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_coalesced"):
        method = getattr(comm, name)

        def counted(*args, _m=method, _n=name, **kwargs):
            calls[_n] = calls.get(_n, 0) + 1
            return _m(*args, **kwargs)

        setattr(comm, name, counted)
    return calls


def train_osdp(case: Case, rank: int, world_size: int):
    import osdp

    model = make_model(case.model)
    wrapped = osdp.OSDP(model, **case.kwargs(model))
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=LR, eps=EPS)
    losses, probe = [], {}
    calls = _count_collectives(wrapped._comm)
    for step in range(STEPS):
        if step == 1:
            wrapped.reset_memory_stats()
            calls.clear()
        loss = wrapped(*_local(global_batch(case.model, step, world_size), rank))
        if step == 1:
            probe["gathered_after_forward"] = wrapped.gathered_units()
        loss.backward()
        if step == 1:
            stats = wrapped.memory_stats()
            probe.update(
                all_gathers=stats["all_gathers"],
                reduce_scatters=stats["reduce_scatters"],
                gathered_after_backward=stats["gathered_units"],
                grad_bytes_after_backward=stats["current_grad_bytes"],
                has_grad={n: (p._osdp_unit_name, p.grad is not None) for n, p in wrapped.named_parameters()},
                collectives=dict(calls),
            )
        opt.step()
        opt.zero_grad()
        losses.append(_mean_loss(loss, world_size))
    state = wrapped.full_state_dict()
    probe["unit_modes"] = wrapped.unit_modes()
    probe["tied"] = wrapped.tied_modules()
    probe["forward_order"] = wrapped.forward_order()
    probe["param_names"] = [n for n, _ in wrapped.named_parameters()]
    probe["param_numels"] = {n: p.numel() for n, p in wrapped.named_parameters()}
    probe["shard_numels"] = {u.name: u.shard_numel for u in wrapped._built.units}
    return losses, (state if rank == 0 else None), probe


def split_window_probe(rank: int, world_size: int):
    """A lone Linear split into 4 zdp slices: peak gathered bytes for several windows,
    and outputs / input grads against the unsplit Linear."""
    import osdp

    results = []
    x_full = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    for window_slices in (0, 1, 2, 3, 100):
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(64, 48))
        torch.manual_seed(0)
        model = osdp.OSDP(nn.Sequential(nn.Linear(64, 48)), splits={"0": 4}, default_mode="zdp", prefetch_bytes=0)
        slice_bytes = [u.gathered_bytes for u in model._built.units]
        model._scheduler.prefetch_bytes = window_slices * max(slice_bytes)
        x = x_full.clone().requires_grad_(True)
        for _ in range(2):  # the second step runs with the recorded order (prefetch)
            model.reset_memory_stats()
            out = model(x)
            out.square().mean().backward()
        x_ref = x_full.clone().requires_grad_(True)
        out_ref = ref(x_ref)
        out_ref.square().mean().backward()
        stats = model.memory_stats()
        results.append(
            dict(
                window=model.prefetch_bytes,
                slice_bytes=slice_bytes,
                peak_gathered=stats["peak_gathered_bytes"],
                peak_grad=stats["peak_grad_bytes"],
                out_err=(out - out_ref).abs().max().item(),
                dx_err=(x.grad / 2 - x_ref.grad).abs().max().item(),
            )
        )
    return results


def mismatch_probe(rank: int, world_size: int):
    """Ranks given different modes must all raise, not hang."""
    import osdp

    model = GPT(UNEVEN)
    try:
        osdp.OSDP(model, default_mode="dp" if rank == 0 else "zdp")
    except PlanMismatchError as exc:
        return str(exc)
    return None


def run_all(rank: int, world_size: int, case_names):
    out = {"osdp": {}, "fsdp2": {}, "ref": {}}
    cases = [c for c in CASES if c.name in case_names]
    models = sorted({c.model for c in cases})
    for case in cases:
        out["osdp"][case.name] = train_osdp(case, rank, world_size)
    for key in models:
        out["fsdp2"][key] = train_fsdp2(key, rank, world_size)
    if rank == 0:
        for key in models:
            out["ref"][key] = train_reference(key, world_size)
    out["split_window"] = split_window_probe(rank, world_size)
    out["mismatch"] = mismatch_probe(rank, world_size)
    return out
