"""Per-rank bodies of the ``rep`` mode tests (``test_rep.py``): replicated units
(contract.py [Note: replicated units]) alone and mixed with dp / zdp / split units.

Everything of one world size runs in one spawn; the functions return raw losses,
states, collective logs and ledger numbers, the expectations are written in
``test_rep.py`` (from the contract's bucket rule, by hand), never read off the runtime.
References: single-process training on the whole global batch (``parity_cases``), torch
DDP for the all-rep model, FSDP2 / autocast for mixed precision (``feature_cases``),
one big batch for gradient accumulation.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp.errors import OSDPError

from . import feature_cases as fc
from . import parity_cases as pc
from . import training_loop_cases as tc

# ---- the plans ---------------------------------------------------------------------------
# GPT "uneven" (numels not divisible by 2 or 4): rep next to dp and zdp, small rep units
# (LayerNorms) next to small sharded ones (which coalesce), a Linear split in 4 along
# in_features with zdp/dp slices and one split in 2
MIX = {
    "wte": "rep", "wpe": "dp",
    "blocks.0.ln_1": "rep", "blocks.0.attn.c_attn": "zdp", "blocks.0.attn.c_proj": "rep", "blocks.0.ln_2": "zdp",
    "blocks.0.mlp.c_fc": ("zdp", "dp", "zdp", "dp"), "blocks.0.mlp.c_proj": "dp",
    "blocks.1.ln_1": "dp", "blocks.1.attn.c_attn": "rep", "blocks.1.attn.c_proj": "zdp", "blocks.1.ln_2": "rep",
    "blocks.1.mlp.c_fc": "rep", "blocks.1.mlp.c_proj": ("dp", "zdp"), "ln_f": "zdp", "lm_head": "rep",
}
# GPT "tied": the tied embedding / head pair is one rep unit used twice per step
TIED_MIX = {"wte": "rep", "wpe": "zdp", "blocks.0.ln_1": "rep", "blocks.0.mlp.c_fc": ("dp", "zdp"),
            "blocks.1.attn.c_attn": "rep", "ln_f": "rep"}

CASES = {
    # name: (model key, OSDP kwargs)
    "all_rep": ("uneven", {"default_mode": "rep"}),
    "mix": ("uneven", {"modes": MIX}),
    "mix_no_coalesce": ("uneven", {"modes": MIX, "coalesce_bytes": 0}),
    "mix_checkpoint": ("uneven", {"modes": MIX, "checkpoint_blocks": ("blocks.0", "blocks.1")}),
    "tied_mix": ("tied", {"default_mode": "dp", "modes": TIED_MIX}),
    "mix_streams": ("uneven", {"modes": MIX}),  # through SimulatedStreams (the CUDA-stream path)
    # blocks.0 and wpe frozen (parity_cases): frozen rep units compute, get no gradient
    "frozen_mix": ("frozen", {"default_mode": "rep", "modes": {"blocks.0.attn.c_attn": "zdp", "blocks.1.ln_1": "dp"}}),
}
FROZEN = {"frozen": lambda unit: unit == "wpe" or unit.startswith("blocks.0.")}


class CollectiveLog:
    """Every call of the collectives module's entry points: (op, group members, numel)."""

    NAMES = ("all_gather_flat", "reduce_scatter_flat", "all_reduce_flat")

    def __init__(self):
        from osdp.runtime import collectives

        self.module = collectives
        self.calls: list[tuple] = []
        self.saved = {name: getattr(collectives, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            setattr(collectives, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def logged(*args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[1]
            self.calls.append((name.replace("_flat", ""), tuple(dist.get_process_group_ranks(group)), args[0].numel()))
            return fn(*args, **kwargs)

        return logged

    def restore(self):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)


def _rep_probe(wrapped) -> dict:
    units = wrapped._built.units
    return {
        "unit_modes": wrapped.unit_modes(),
        "numels": {u.name: u.numel for u in units},
        "padded": {u.name: u.padded_numel for u in units},
        "rep_shards": {u.name: u.shard.detach().clone() for u in units if u.replicated},
        "param_shapes": {n: tuple(p.shape) for n, p in wrapped.named_parameters()},
    }


def train_osdp(name: str, rank: int, world_size: int):
    import osdp

    key, kwargs = CASES[name]
    model = pc.make_model(key)
    streams = name.endswith("_streams")
    if streams:
        os.environ["OSDP_SIMULATE_STREAMS"] = "4"  # at most 4 ms of delay per comm work item
        os.environ["OSDP_SIMULATE_SEED"] = str(rank)
    try:
        wrapped = osdp.OSDP(model, **kwargs)
    finally:
        os.environ.pop("OSDP_SIMULATE_STREAMS", None)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=pc.LR, eps=pc.EPS)
    probe = _rep_probe(wrapped)
    log = CollectiveLog()
    losses = []
    try:
        for step in range(pc.STEPS):
            if step == 1:
                wrapped.reset_memory_stats()
                log.calls.clear()
            loss = wrapped(*pc._local(pc.global_batch(key, step, world_size), rank))
            if step == 1:
                probe["gathered_after_forward"] = wrapped.gathered_units()
            loss.backward()
            if step == 1:
                stats = wrapped.memory_stats()
                probe.update(calls=list(log.calls), all_gathers=stats["all_gathers"],
                             reduce_scatters=stats["reduce_scatters"], all_reduces=stats["all_reduces"],
                             grad_bytes_after_backward=stats["current_grad_bytes"],
                             gathered_after_backward=stats["gathered_units"],
                             grad_flags={n: (getattr(p.grad, "_osdp_replicated", False),
                                             getattr(p.grad, "_osdp_sharded", False))
                                         for n, p in wrapped.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            losses.append(pc._mean_loss(loss, world_size))
    finally:
        log.restore()
    probe["rep_shards_end"] = {u.name: u.shard.detach().clone() for u in wrapped._built.units if u.replicated}
    return losses, wrapped.full_state_dict(rank0_only=False), probe


def train_ddp(key: str, rank: int, world_size: int):
    """torch DDP on the same ranks and local batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(pc.make_model(key))
    opt = torch.optim.AdamW(model.parameters(), lr=pc.LR, eps=pc.EPS)
    losses = []
    for step in range(pc.STEPS):
        loss = model(*pc._local(pc.global_batch(key, step, world_size), rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(pc._mean_loss(loss, world_size))
    return losses, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


# ---- the bucket rule: a stack of 10 Linear(512, 512) ---------------------------------------
STACK_LAYERS, STACK_WIDTH, STACK_STEPS, STACK_FAIL_STEP, STACK_LOCAL = 10, 512, 4, 2, 2


class Stack(nn.Module):
    """A LayerNorm then 10 Linear(512, 512) (262,656 parameters, 1,050,624 fp32 bytes each)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(STACK_WIDTH)
        self.layers = nn.ModuleList(nn.Linear(STACK_WIDTH, STACK_WIDTH) for _ in range(STACK_LAYERS))

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def make_stack() -> Stack:
    torch.manual_seed(99)
    return Stack()


def stack_batch(step: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(STACK_LOCAL * world_size, STACK_WIDTH, generator=gen)


def _stack_loop(model, layers, batch_of, opt):
    """STACK_STEPS steps; in step STACK_FAIL_STEP a first backward fails in the middle
    (an exception raised on reaching ``layers[1]``), then zero_grad and the step again.
    Returns the losses."""
    losses = []
    for step in range(STACK_STEPS):
        if step == STACK_FAIL_STEP:
            tc.fail_one_backward(layers[1], lambda: model(batch_of(step)), opt)
        loss = model(batch_of(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def stack_reference(world_size: int):
    model = make_stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=pc.EPS)
    losses = _stack_loop(model, model.layers, lambda s: stack_batch(s, world_size), opt)
    return [x.item() for x in losses], {k: v.clone() for k, v in model.state_dict().items()}


def stack_osdp(rank: int, world_size: int):
    import osdp

    wrapped = osdp.OSDP(make_stack(), default_mode="rep")
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, eps=pc.EPS)
    log = CollectiveLog()
    per_step, peaks, after, before, storages = [], [], [], [], []
    original_backward = torch.Tensor.backward

    def batch_of(step):
        # one collective log and ledger window per backward (the failed one included)
        per_step.append(log.calls[:])
        log.calls.clear()
        wrapped.reset_memory_stats()
        return stack_batch(step, world_size)[rank * STACK_LOCAL : (rank + 1) * STACK_LOCAL]

    def backward(tensor, *args, **kwargs):
        before.append(wrapped.memory_stats()["current_grad_bytes"])
        try:
            return original_backward(tensor, *args, **kwargs)
        finally:
            stats = wrapped.memory_stats()
            peaks.append(stats["peak_grad_bytes"])
            after.append(stats["current_grad_bytes"])
            storages.append([None if u.params[0].grad is None else u.params[0].grad.untyped_storage().data_ptr()
                             for u in wrapped._built.units])

    try:
        torch.Tensor.backward = backward
        losses = _stack_loop(wrapped, wrapped.module.layers, batch_of, opt)
    finally:
        torch.Tensor.backward = original_backward
        per_step.append(log.calls[:])
        log.restore()
    mean = []
    for loss in losses:
        dist.all_reduce(loss)
        mean.append(loss.item() / world_size)
    return {
        "losses": mean,
        "calls": per_step[1:],  # the calls made by each forward+backward (the failed one included)
        "peak_grad_bytes": peaks,
        "grad_bytes_after": after,
        "state": wrapped.full_state_dict(rank0_only=False),
        "shards": [u.shard.detach().clone() for u in wrapped._built.units],
        "grad_bytes_before": before,
        "grad_storages": storages,  # per backward: per unit, the storage of its weight's .grad
        "unit_names": [u.name for u in wrapped._built.units],
    }


def _accumulator(unit):
    """Where a rep unit's unreduced gradient waits: its buffer, or (a direct unit, [Note:
    direct replicated units]) its parameters' .grad; None once reduced."""
    if unit.grad_flat is not None:
        return f"buffer {unit.grad_flat.dtype}"
    if unit.grad_local:
        return f".grad {unit.params[0].grad.dtype}"
    return None


# ---- gradient clipping, param groups, failures (training_loop_cases' loop) ------------------
def loop_run(rank: int, world_size: int, kwargs: dict):
    """``training_loop_cases``' loop (param groups by name, clipping by the 2-, 1- and
    inf-norm every step, a failing forward and a failing backward) on a rep plan."""
    import osdp
    from torch.nn.utils import clip_grad_norm_ as torch_clip

    model = pc.make_model("uneven")
    wrapped = osdp.OSDP(model, **kwargs)
    out = {"ndim_rule_agrees": all((p.dim() < 2) == tc._no_decay(n) for n, p in wrapped.named_parameters())}
    opt = tc._optimizer(wrapped.named_parameters())
    norms: list = []

    def clip(step):
        if step == 1:
            try:
                out["torch_clip"] = torch_clip([p for p in wrapped.parameters()], 1e30).item()
            except OSDPError as exc:
                out["torch_clip"] = str(exc)
            out["osdp_clip_same_step"] = wrapped.clip_grad_norm_(1e30).item()
        extra = [wrapped.clip_grad_norm_(1e30, norm_type=norm).item() for norm in (1.0, math.inf)]
        return [wrapped.clip_grad_norm_(tc.MAX_NORM).item()] + extra

    local = lambda s: pc._local(pc.global_batch("uneven", s, world_size), rank)  # noqa: E731
    evals: list = []
    losses = tc._train(wrapped, wrapped.module.blocks, local, clip, norms, opt, evals)
    stats = wrapped.memory_stats()
    out.update(losses=tc.mean_over_ranks(losses, world_size), evals=tc.mean_over_ranks(evals, world_size),
               norms=norms, state=wrapped.full_state_dict(), gathered_after=stats["gathered_units"],
               grad_bytes_after=stats["current_grad_bytes"])
    return out


# ---- gradient accumulation ------------------------------------------------------------------
def acc_run(rank: int, world_size: int, sync: str, path: str):
    """fc.MICRO micro-batches per optimizer step on the MIX plan: "last" (no_sync until
    the last micro-batch) or "every" (sync on each). ``path``: "direct" (these fp32 rep
    units' own, [Note: direct replicated units]) or "hooked" (every rep unit kept on the
    per-use hook path, as a cast one runs)."""
    from unittest import mock

    import osdp
    import osdp.api

    hooked = mock.patch.object(osdp.api, "direct_units", side_effect=lambda bindings: set())
    with hooked if path == "hooked" else contextlib.nullcontext():
        wrapped = osdp.OSDP(pc.make_model("uneven"), modes=MIX)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR, eps=pc.EPS)
    local = pc.LOCAL_BATCH * fc.MICRO
    losses, probe = [], {}
    rep_units = [u for u in wrapped._built.units if u.replicated]
    for step in range(fc.ACC_STEPS):
        batch = fc._local(pc.global_batch_sized("uneven", step, world_size * local), rank, local)
        total = 0.0
        wrapped.reset_memory_stats()
        for i in range(fc.MICRO):
            micro = tuple(t[i * pc.LOCAL_BATCH : (i + 1) * pc.LOCAL_BATCH] for t in batch)
            ctx = wrapped.no_sync() if sync == "last" and i < fc.MICRO - 1 else fc._null()
            with ctx:
                loss = wrapped(*micro) / fc.MICRO
                loss.backward()
            total += loss.item()
            if step == 0 and i == 0:
                probe["rep_accumulators"] = {u.name: _accumulator(u) for u in rep_units}
                probe["rep_has_grad_after_first_micro"] = any(p.grad is not None for u in rep_units for p in u.params)
        if step == 0:
            stats = wrapped.memory_stats()
            probe.update(all_reduces=stats["all_reduces"], reduce_scatters=stats["reduce_scatters"],
                         grad_bytes_after_step=stats["current_grad_bytes"])
        opt.step()
        opt.zero_grad()
        value = torch.tensor([total])
        dist.all_reduce(value)
        losses.append(value.item() / world_size)
    return losses, wrapped.full_state_dict(), probe


# ---- mixed precision --------------------------------------------------------------------------
MP_MODES_SEED = 9


def mp_modes():
    import random

    from osdp.runtime.config import mode_names

    rng = random.Random(MP_MODES_SEED)
    modes = {name: rng.choice(("rep", "dp", "zdp")) for name in mode_names(pc.make_model("uneven"))}
    modes["wte"] = modes["lm_head"] = "rep"
    return modes


def mp_run(rank: int, world_size: int):
    """``feature_cases._mp_osdp`` on a rep mix (bf16 compute, fp32 reduction and
    master), plus what a rep unit's compute copy holds around optimizer steps."""
    import osdp
    from osdp.runtime.mixed_precision import MixedPrecision

    wrapped = osdp.OSDP(pc.make_model("uneven"), modes=mp_modes(),
                        mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR, eps=pc.EPS)
    rep_units = [u for u in wrapped._built.units if u.replicated]
    losses, probe, copies = [], {}, []

    def copy_matches():
        return all(torch.equal(u.gathered, u.shard.detach().to(torch.bfloat16)) for u in rep_units)

    for step in range(fc.MP_STEPS):
        loss = wrapped(*pc._local(pc.global_batch("uneven", step, world_size), rank))
        after_forward = copy_matches()
        loss.backward()
        if step == 0:
            stats = wrapped.memory_stats()
            probe["gathered_bytes"] = stats["unit_peak_gathered_bytes"]
            probe["replica_copy_bytes"] = stats["replica_copy_bytes"]
            probe["first_grads"] = fc.wrapped_grads(wrapped)
            probe["grad_dtypes"] = sorted({str(p.grad.dtype) for p in wrapped.parameters() if p.grad is not None})
        opt.step()
        # after the step the copy is stale until the next forward casts it again
        copies.append((after_forward, copy_matches()))
        opt.zero_grad()
        losses.append(pc._mean_loss(loss.float(), world_size))
    probe["copies"] = copies
    probe["rep_units"] = [u.name for u in rep_units]
    probe["numels"] = {u.name: u.numel for u in wrapped._built.units}
    probe["padded"] = {u.name: u.padded_numel for u in wrapped._built.units}
    probe["copy_dtypes"] = sorted({str(u.gathered.dtype) for u in rep_units})
    return losses, wrapped.full_state_dict(), probe


# ---- checkpoints ----------------------------------------------------------------------------
def ckpt_scenario(rank: int, world_size: int, root: str):
    """zdp+split plan -> rep plan -> another split plan and back, sharded (DCP, with
    AdamW state) and full state dicts; see test_rep.py for what must hold."""
    from checkpoint import ckpt_cases as cc
    from osdp import checkpoint

    rep_plan = dict(default_mode="rep", modes={"blocks.0.mlp.c_fc": "zdp", "blocks.1.attn.c_attn": "dp",
                                                "blocks.1.mlp.c_proj": ("dp", "zdp")})
    out = {}
    a, opt_a = cc.wrap(cc.PLAN_A)
    cc.train(a, opt_a, range(0, cc.SAVE_AT))
    path_a = os.path.join(root, "ckpt_a")
    checkpoint.save(a, opt_a, path_a, step=cc.SAVE_AT)
    out["full_a"] = a.full_state_dict(rank0_only=False)
    out["optim_a"] = cc.optim_reference(a, opt_a)
    out["unit_state_a"] = cc.unit_state(a, opt_a)

    # sharded plan -> rep plan
    r, opt_r = cc.wrap(rep_plan)
    out["rep_modes"] = r.unit_modes()
    meta = checkpoint.load(r, opt_r, path_a)
    out["step_r"] = meta["step"]
    out["full_r"] = r.full_state_dict(rank0_only=False)
    out["optim_r"] = cc.optim_reference(r, opt_r)
    out["rep_param_shapes"] = {n: tuple(p.shape) for n, p in r.named_parameters()}
    out["rep_local_state_shapes"] = {k: tuple(v.shape) for k, v in r.state_dict().items()}
    # ... and back: plan A -> checkpoint -> rep plan -> checkpoint -> plan A, exactly
    path_back = os.path.join(root, "ckpt_back")
    checkpoint.save(r, opt_r, path_back, step=cc.SAVE_AT)
    a2, opt_a2 = cc.wrap(cc.PLAN_A, seed=cc.SEED + 7)
    checkpoint.load(a2, opt_a2, path_back)
    out["unit_state_a2"] = cc.unit_state(a2, opt_a2)
    out["losses_a"] = cc.train(a, opt_a, range(cc.SAVE_AT, cc.STEPS))
    out["losses_r"] = cc.train(r, opt_r, range(cc.SAVE_AT, cc.STEPS))
    out["continued_a"] = a.full_state_dict(rank0_only=False)
    out["continued_r"] = r.full_state_dict(rank0_only=False)

    # rep plan -> its checkpoint -> the same plan (bit-identical) and another plan
    path_r = os.path.join(root, "ckpt_r")
    checkpoint.save(r, opt_r, path_r, step=cc.STEPS)
    out["saved_r"] = r.full_state_dict(rank0_only=False)
    out["saved_optim_r"] = cc.optim_reference(r, opt_r)
    r2, opt_r2 = cc.wrap(rep_plan, seed=cc.SEED + 1)
    checkpoint.load(r2, opt_r2, path_r)
    out["unit_state_r"], out["unit_state_r2"] = cc.unit_state(r, opt_r), cc.unit_state(r2, opt_r2)
    b, opt_b = cc.wrap(cc.PLAN_B, seed=cc.SEED + 2)
    checkpoint.load(b, opt_b, path_r)
    out["full_b"] = b.full_state_dict(rank0_only=False)
    out["optim_b"] = cc.optim_reference(b, opt_b)
    more = range(cc.STEPS, cc.STEPS + 2)
    out["losses_more"] = {"r": cc.train(r, opt_r, more), "r2": cc.train(r2, opt_r2, more), "b": cc.train(b, opt_b, more)}
    out["more"] = {"r": r.full_state_dict(rank0_only=False), "r2": r2.full_state_dict(rank0_only=False),
                   "b": b.full_state_dict(rank0_only=False)}

    # full state dicts: rep -> all-rep and rep -> sharded, and the plain model's state in
    path_full = os.path.join(root, "full_r.pt")
    checkpoint.save_full(r, path_full)
    out["full_saved"] = r.full_state_dict(rank0_only=False)
    f, _ = cc.wrap({"default_mode": "rep"}, seed=cc.SEED + 3)
    checkpoint.load_full(f, path_full)
    out["full_into_rep"] = f.full_state_dict(rank0_only=False)
    z, _ = cc.wrap(cc.PLAN_A, seed=cc.SEED + 4)
    checkpoint.load_full(z, path_full)
    out["full_into_a"] = z.full_state_dict(rank0_only=False)
    plain = cc.make(seed=cc.SEED + 5)
    g, _ = cc.wrap(rep_plan, seed=cc.SEED + 6)
    checkpoint.load_full_state_dict(g, plain.state_dict())
    out["plain_state"] = {k: v.clone() for k, v in plain.state_dict().items()}
    out["plain_into_rep"] = g.full_state_dict(rank0_only=False)
    out["paths"] = {"a": path_a, "r": path_r}
    dist.barrier()
    return out


# ---- everything of one world size in one spawn ---------------------------------------------------
def run_all(rank: int, world_size: int, root: str):
    out = {"osdp": {}, "ref": {}}
    for name in CASES:
        out["osdp"][name] = train_osdp(name, rank, world_size)
    out["ddp"] = train_ddp("uneven", rank, world_size)
    out["stack"] = stack_osdp(rank, world_size)
    out["loop"] = {"mix": loop_run(rank, world_size, {"modes": MIX}),
                   "all_rep": loop_run(rank, world_size, {"default_mode": "rep"})}
    out["acc"] = {(sync, path): acc_run(rank, world_size, sync, path)
                  for sync in ("last", "every") for path in ("direct", "hooked")}
    out["mp"] = mp_run(rank, world_size)
    out["mp_fsdp2"] = fc._mp_fsdp2(rank, world_size)
    out["ckpt"] = ckpt_scenario(rank, world_size, root)
    if rank == 0:
        for key in ("uneven", "tied", "frozen"):
            out["ref"][key] = pc.train_reference(key, world_size)
        out["stack_ref"] = stack_reference(world_size)
        out["loop_ref"] = tc.reference(world_size)
        out["acc_ref"] = fc._acc_reference(world_size)
        out["mp_ref"] = fc._mp_reference(world_size)
    return out


# ---- 4 ranks: HSDP (2 x 2 mesh) and a full shard with hpz nodes ------------------------------
def hsdp_rep_kwargs(model):
    """hsdp_cases' mix (dp, zdp, hpz, split slices of each) with four whole units rep."""
    from . import hsdp_cases as hc

    modes = dict(hc.mix_kwargs(model)["modes"])
    for unit in ("wpe", "blocks.0.ln_1", "blocks.1.mlp.c_fc", "lm_head"):
        modes[unit] = "rep"
    return {"modes": modes}


def hsdp_train(layout: str, rank: int, world_size: int):
    import osdp

    from . import hsdp_cases as hc

    model = pc.make_model(hc.MODEL)
    wrapped = osdp.OSDP(model, **hsdp_rep_kwargs(model), **hc.layout_kwargs(layout))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR, eps=pc.EPS)
    probe = _rep_probe(wrapped)
    log = CollectiveLog()
    losses = []
    try:
        for step in range(hc.STEPS):
            if step == 1:
                wrapped.reset_memory_stats()
                log.calls.clear()
            loss = wrapped(*hc._local(pc.global_batch(hc.MODEL, step, world_size), rank))
            loss.backward()
            if step == 1:
                stats = wrapped.memory_stats()
                probe.update(calls=list(log.calls), all_gathers=stats["all_gathers"],
                             reduce_scatters=stats["reduce_scatters"], all_reduces=stats["all_reduces"])
            opt.step()
            opt.zero_grad()
            losses.append(hc._mean_loss(loss, world_size))
    finally:
        log.restore()
    probe["rep_shards_end"] = {u.name: u.shard.detach().clone() for u in wrapped._built.units if u.replicated}
    return losses, wrapped.full_state_dict(rank0_only=False), probe


def hsdp_checkpoint(rank: int, world_size: int, root: str):
    """2-D rep mix -> checkpoint -> 1-D all-zdp (4 ranks) -> checkpoint -> 2-D rep mix."""
    from checkpoint import ckpt_cases as cc
    from osdp import checkpoint

    from . import hsdp_cases as hc

    out = {}
    a, opt_a = hc._wrap(hc.layout_kwargs("hsdp"), hsdp_rep_kwargs(pc.make_model(hc.MODEL)))
    hc._train(a, opt_a, 3, 0, rank, world_size)
    path_2d = os.path.join(root, "rep_2d")
    checkpoint.save(a, opt_a, path_2d, step=3)
    out["saved_2d"] = a.full_state_dict(rank0_only=False)
    out["optim_2d"] = cc.optim_reference(a, opt_a)
    b, opt_b = hc._wrap({}, {"default_mode": "zdp"})
    checkpoint.load(b, opt_b, path_2d)
    out["loaded_1d"] = b.full_state_dict(rank0_only=False)
    out["optim_1d"] = cc.optim_reference(b, opt_b)
    hc._train(a, opt_a, 2, 3, rank, world_size)
    hc._train(b, opt_b, 2, 3, rank, world_size)
    out["continued_2d"] = a.full_state_dict(rank0_only=False)
    out["continued_1d"] = b.full_state_dict(rank0_only=False)
    path_1d = os.path.join(root, "zdp_1d")
    checkpoint.save(b, opt_b, path_1d, step=5)
    c, opt_c = hc._wrap(hc.layout_kwargs("hsdp"), hsdp_rep_kwargs(pc.make_model(hc.MODEL)))
    checkpoint.load(c, opt_c, path_1d)
    out["saved_1d"] = b.full_state_dict(rank0_only=False)
    out["loaded_2d"] = c.full_state_dict(rank0_only=False)
    out["optim_1d_end"], out["optim_2d_loaded"] = cc.optim_reference(b, opt_b), cc.optim_reference(c, opt_c)
    out["path_2d"] = path_2d
    dist.barrier()
    return out


def run_hsdp(rank: int, world_size: int, root: str):
    from . import hsdp_cases as hc

    out = {"train": {layout: hsdp_train(layout, rank, world_size) for layout in ("hsdp", "full_node2")}}
    out["ckpt"] = hsdp_checkpoint(rank, world_size, root)
    if rank == 0:
        out["ref"] = hc.train_reference()
    return out
