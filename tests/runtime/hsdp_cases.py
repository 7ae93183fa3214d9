"""Per-rank scenarios of the hierarchical-sharding tests: 4 gloo ranks as 2 "nodes" x 2.

Layouts: (a) HSDP, a DeviceMesh ("replicate", "shard") of 2 x 2 (shard groups {0,1} and
{2,3}, replicate groups {0,2} and {1,3}); (b) full shard over the 4 ranks with hpz
re-gathering within 2-rank nodes ({0,1}, {2,3}); (c) HSDP 2 x 2 with node_size=1.
Every rank trains on its own slice of the global batch (global rank order), so the
reference is one process training on the whole global batch (mean loss), AdamW.

The functions return raw losses, states, collective counts and byte counts; the
expectations are written in ``test_hsdp.py`` from the mode table ([Note: modes per
level] in osdp/contract.py), not read off the runtime.
"""
from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

from osdp.runtime.config import mode_names

from .parity_cases import EPS, LOCAL_BATCH, LR, global_batch, make_model

STEPS = 6
MODEL = "uneven"  # GPT whose units' numels are not divisible by 2 or 4 (padded shards)
MODES = ("dp", "zdp", "hpz")


def _random_modes(model, seed):
    rng = random.Random(seed)  # the same on every rank
    return {name: rng.choice(MODES) for name in mode_names(model)}


def mix_kwargs(model):
    """Every mode, and split ops whose slices run in different modes (a Linear cut along
    in_features, a Linear cut in 2, an Embedding cut by rows)."""
    modes = _random_modes(model, seed=3)
    modes["blocks.0.mlp.c_fc"] = ("hpz", "dp", "zdp", "hpz")
    modes["blocks.1.attn.c_attn"] = ("hpz", "zdp")
    modes["wte"] = ("zdp", "hpz", "dp")
    return {"modes": modes}


def all_hpz_kwargs(model):
    return {"default_mode": "hpz"}


def hpz_checkpoint_kwargs(model):
    """Checkpoint recomputes in backward gather hpz units again (from their node copies)."""
    modes = _random_modes(model, seed=5)
    modes["blocks.1.mlp.c_fc"] = ("hpz", "dp")
    return {"modes": modes, "checkpoint_blocks": ("blocks.0", "blocks.1")}


CASES = {"mix": mix_kwargs, "all_hpz": all_hpz_kwargs, "hpz_checkpoint": hpz_checkpoint_kwargs}


def layout_kwargs(layout: str):
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        return {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
    if layout == "hsdp_node1":
        from torch.distributed.device_mesh import init_device_mesh

        return {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), "node_size": 1}
    if layout == "full_node2":
        return {"node_size": 2}
    raise KeyError(layout)


def _local(batch, rank):
    return tuple(t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for t in batch)


def _mean_loss(loss, world_size):
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world_size


def train_reference(steps: int = STEPS, world_size: int = 4):
    model = make_model(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        loss = model(*global_batch(MODEL, step, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


class CollectiveCounter:
    """Counts calls of the collectives module's entry points per (op, group members)."""

    NAMES = ("all_gather_flat", "reduce_scatter_flat", "all_reduce_flat")

    def __init__(self):
        from osdp.runtime import collectives

        self.module = collectives
        self.counts: dict[tuple, int] = {}
        self.saved = {name: getattr(collectives, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            setattr(collectives, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[1]
            key = (name.replace("_flat", ""), tuple(dist.get_process_group_ranks(group)))
            self.counts[key] = self.counts.get(key, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def restore(self):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)


def train_case(layout: str, case: str, rank: int, world_size: int, coalesce_bytes=None):
    import osdp

    model = make_model(MODEL)
    kwargs = dict(CASES[case](model))
    if coalesce_bytes is not None:
        kwargs["coalesce_bytes"] = coalesce_bytes
    wrapped = osdp.OSDP(model, **kwargs, **layout_kwargs(layout))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, eps=EPS)
    counter = CollectiveCounter()
    losses, probe = [], {}
    try:
        for step in range(STEPS):
            if step == 1:
                counter.counts.clear()
            loss = wrapped(*_local(global_batch(MODEL, step, world_size), rank))
            if step == 1:
                life = wrapped._scheduler.lifecycle
                probe["node_copy_bytes_after_forward"] = life.node_copy_bytes
                probe["node_copy_units_after_forward"] = sorted(u.name for u in life.node_copy_units())
                probe["gathered_after_forward"] = wrapped.gathered_units()
            loss.backward()
            if step == 2:  # torch's own norm helper over the layout ([Note: global gradient norm])
                grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
                probe["norms"] = (torch.nn.utils.get_total_norm(grads).item(), wrapped.clip_grad_norm_(1e30).item())
            if step == 1:
                probe["counts"] = dict(counter.counts)
                probe["node_copy_bytes_after_backward"] = wrapped._scheduler.lifecycle.node_copy_bytes
                probe["gathered_after_backward"] = wrapped.gathered_units()
            opt.step()
            opt.zero_grad()
            losses.append(_mean_loss(loss, world_size))
    finally:
        counter.restore()
    probe["unit_modes"] = wrapped.unit_modes()
    probe["gathered_bytes"] = {u.name: u.gathered_bytes for u in wrapped._built.units}
    probe["forward_order"] = wrapped.forward_order()
    probe["checkpointed"] = tuple(kwargs.get("checkpoint_blocks", ()))
    state = wrapped.full_state_dict(rank0_only=False)
    return losses, state, probe


# ---- checkpoints -----------------------------------------------------------------------
def _train(model, opt, steps, start, rank, world_size, local=True):
    for step in range(start, start + steps):
        batch = global_batch(MODEL, step, world_size)
        loss = model(*(_local(batch, rank) if local else batch))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _wrap(layout_kw, modes_kw, group=None):
    import osdp

    kw = dict(layout_kw)
    if group is not None:
        kw["process_group"] = group
    model = osdp.OSDP(make_model(MODEL), **modes_kw, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def checkpoint_scenario(rank: int, world_size: int, root: str):
    """2-D save -> 1-D (4 ranks) load -> 1-D save -> 2-D load; 2-D save -> 1-rank load."""
    from osdp import checkpoint

    out = {}
    one = dist.new_group([0])  # every rank creates it; only rank 0 uses it
    probe_model = make_model(MODEL)
    a, opt_a = _wrap(layout_kwargs("hsdp"), mix_kwargs(probe_model))
    _train(a, opt_a, 3, 0, rank, world_size)
    path_2d = os.path.join(root, "ckpt_2d")
    checkpoint.save(a, opt_a, path_2d, step=3)
    out["saved_2d"] = a.full_state_dict(rank0_only=False)

    # into a 1-D layout over the same 4 ranks, other modes (hpz regathering in 2-rank nodes)
    b, opt_b = _wrap({"node_size": 2}, {"default_mode": "hpz", "modes": {"lm_head": "dp", "wpe": "zdp"}})
    meta = checkpoint.load(b, opt_b, path_2d)
    out["step"] = meta["step"]
    out["loaded_1d"] = b.full_state_dict(rank0_only=False)
    # both go on training: equal only if the optimizer state came through
    _train(a, opt_a, 2, 3, rank, world_size)
    _train(b, opt_b, 2, 3, rank, world_size)
    out["continued_2d"] = a.full_state_dict(rank0_only=False)
    out["continued_1d"] = b.full_state_dict(rank0_only=False)

    # 1-D -> 2-D
    path_1d = os.path.join(root, "ckpt_1d")
    checkpoint.save(b, opt_b, path_1d, step=5)
    c, opt_c = _wrap(layout_kwargs("hsdp"), {"default_mode": "dp", "modes": {"blocks.0.mlp.c_fc": ("zdp", "hpz")}})
    checkpoint.load(c, opt_c, path_1d)
    out["loaded_2d_from_1d"] = c.full_state_dict(rank0_only=False)
    _train(c, opt_c, 1, 5, rank, world_size)
    _train(b, opt_b, 1, 5, rank, world_size)
    out["continued_2d_from_1d"] = c.full_state_dict(rank0_only=False)
    out["continued_1d_again"] = b.full_state_dict(rank0_only=False)

    # 2-D -> one rank (rank 0 alone; it trains on the whole global batch)
    if rank == 0:
        d, opt_d = _wrap({}, {"default_mode": "zdp"}, group=one)
        checkpoint.load(d, opt_d, path_2d)
        out["loaded_1rank"] = d.full_state_dict()
        _train(d, opt_d, 2, 3, rank, world_size, local=False)
        out["continued_1rank"] = d.full_state_dict()
    dist.barrier()
    return out


def run_all(rank: int, world_size: int, root: str, runs):
    out = {"train": {}}
    for layout, case, coalesce in runs:
        out["train"][(layout, case, coalesce)] = train_case(layout, case, rank, world_size, coalesce)
    if root:
        out["checkpoint"] = checkpoint_scenario(rank, world_size, root)
    if rank == 0:
        out["ref"] = train_reference()
    return out
