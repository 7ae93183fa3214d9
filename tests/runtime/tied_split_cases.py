"""Per-rank bodies of the tied row split tests (``test_tied_split.py``): a tiny GPT whose
vocabulary is much larger than its hidden size, its embedding table split by rows into
slices with mixed modes, tied to the LM head (one weight, one set of slices) or not.

References: single-process training of the same model on the whole global batch (mean
loss, AdamW), and for checkpoints the saving model's own full state (exact).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from osdp.models import GPT, GPTConfig, example_batch

TIED = GPTConfig(vocab_size=211, seq_len=8, num_layers=2, hidden=16, heads=2, tie_embeddings=True)
UNTIED = GPTConfig(vocab_size=211, seq_len=8, num_layers=2, hidden=16, heads=2)
STEPS = 5
LOCAL_BATCH = 2
LR = 1e-2
EPS = 1e-5  # as in the parity tests: rounding is not amplified by tiny second moments
SEED = 4321

CASES = {  # name -> (model key, OSDP keyword arguments)
    # the tied weight split in 4, mixed modes; every other unit alternates
    "tied_g4": ("tied", dict(default_mode="dp", modes={"wte": ("dp", "zdp", "zdp", "dp"), "blocks.0.mlp.c_fc": "zdp",
                                                        "blocks.1.attn.c_attn": "zdp"})),
    # the same pair split through the head's name, 3 slices, per-slice keys of the head
    "tied_g3_by_head": ("tied", dict(default_mode="zdp", splits={"lm_head": 3},
                                     modes={"lm_head[0]": "zdp", "lm_head[1]": "dp", "lm_head[2]": "zdp"},
                                     prefetch_bytes=0)),
    # untied: the embedding by rows and the head along vocabulary (out_features)
    "untied": ("untied", dict(default_mode="zdp", modes={"wte": ("zdp", "dp", "dp", "zdp"), "lm_head": ("dp", "zdp", "dp")},
                              split_ops={"lm_head": "linear_out_features"})),
}


def make(key: str, seed: int = SEED):
    torch.manual_seed(seed)
    return GPT(TIED if key == "tied" else UNTIED)


def _batch(key: str, step: int, world: int):
    return example_batch(TIED if key == "tied" else UNTIED, LOCAL_BATCH * world, seed=step)


def _local(batch, rank):
    return tuple(t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for t in batch)


def train_reference(key: str, world: int):
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


def _mean(loss, group=None):
    value = loss.detach().clone()
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def train_osdp(name: str, rank: int, world: int):
    import osdp

    key, kwargs = CASES[name]
    model = osdp.OSDP(make(key), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, probe = [], {}
    for step in range(STEPS):
        if step == 1:
            model.reset_memory_stats()
        loss = model(*_local(_batch(key, step, world), rank))
        if step == 1:
            probe["gathered_after_forward"] = sorted(model.gathered_units())
        loss.backward()
        if step == 1:
            stats = model.memory_stats()
            probe.update(all_gathers=stats["all_gathers"], reduce_scatters=stats["reduce_scatters"],
                         gathered_after_backward=stats["gathered_units"],
                         grad_bytes_after_backward=stats["current_grad_bytes"])
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
    probe["unit_modes"] = model.unit_modes()
    probe["tied"] = model.tied_modules()
    probe["param_names"] = [n for n, _ in model.named_parameters()]
    probe["local_keys"] = list(model.state_dict())
    return losses, model.full_state_dict(), probe


def checkpoints(rank: int, world: int, root: str):
    """Split tied model -> sharded checkpoint -> unsplit model (same ranks, and 1 rank)
    and back; full state dicts of each side."""
    import osdp
    import osdp.checkpoint as ck

    out = {}
    split_kwargs = CASES["tied_g4"][1]
    model = osdp.OSDP(make("tied"), **split_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(3):
        model(*_local(_batch("tied", step, world), rank)).backward()
        opt.step()
        opt.zero_grad()
    path = os.path.join(root, f"tied_split_w{world}")
    ck.save(model, opt, path, step=3)
    out["saved"] = ck.full_state_dict(model)
    # the optimizer state moves with the weights: one more step on each side must agree
    model(*_local(_batch("tied", 3, world), rank)).backward()
    opt.step()
    out["saved_next"] = ck.full_state_dict(model)
    del model, opt

    unsplit = osdp.OSDP(make("tied", seed=99), default_mode="zdp")
    opt = torch.optim.AdamW(unsplit.parameters(), lr=LR, eps=EPS)
    out["info"] = ck.load(unsplit, opt, path)
    out["unsplit_loaded"] = ck.full_state_dict(unsplit)
    unsplit(*_local(_batch("tied", 3, world), rank)).backward()
    opt.step()
    opt.zero_grad()
    out["unsplit_next"] = ck.full_state_dict(unsplit)
    back = os.path.join(root, f"tied_unsplit_w{world}")
    ck.save(unsplit, opt, back, step=4)
    del unsplit, opt
    # and back into a split model (another split: 3 slices, other modes)
    resplit = osdp.OSDP(make("tied", seed=98), default_mode="dp", modes={"wte": ("zdp", "dp", "zdp")})
    opt = torch.optim.AdamW(resplit.parameters(), lr=LR, eps=EPS)
    ck.load(resplit, opt, back)
    out["resplit_loaded"] = ck.full_state_dict(resplit)
    del resplit, opt

    one = dist.new_group([0])  # every rank takes part in creating it
    if rank == 0:
        single = osdp.OSDP(make("tied", seed=97), default_mode="dp", process_group=one)
        opt = torch.optim.AdamW(single.parameters(), lr=LR, eps=EPS)
        ck.load(single, opt, path)
        out["one_rank_loaded"] = ck.full_state_dict(single)
        # the full state dict of the split model loads into the plain (unwrapped) model
        plain = make("tied", seed=96)
        plain.load_state_dict(out["saved"], strict=True)
        out["plain_loaded"] = {k: v.clone() for k, v in plain.state_dict().items()}
        out["plain_tied"] = plain.lm_head.weight is plain.wte.weight
    dist.barrier()
    return out


def run_all(rank: int, world: int, root: str):
    out = {"osdp": {name: train_osdp(name, rank, world) for name in CASES}}
    if rank == 0:
        out["ref"] = {key: train_reference(key, world) for key in ("tied", "untied")}
    out["ckpt"] = checkpoints(rank, world, root)
    return out
