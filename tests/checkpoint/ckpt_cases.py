"""Per-rank scenarios of the checkpoint tests (run inside one spawn per world size).

Everything trains a small tied-embedding GPT whose units have numels not divisible by
2 or 4 (padded shards), with split units, on a fixed global batch of 4 samples per
step (2 per rank at world size 2, 1 at world size 4), AdamW. The functions return raw
tensors and flags; the assertions live in ``test_checkpoint.py``.

References: the original unwrapped model's state (exact), an uninterrupted run of the
same world size and plan (exact) and of another world size or plan (losses and
parameters within the parity tests' tolerances, rtol 1e-5), and an independent
gather of the optimizer state through each split op's ``merge`` (exact).
"""
from __future__ import annotations

import functools
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from osdp.errors import OSDPError, PlanMismatchError
from osdp.models import GPT, GPTConfig, example_batch

CFG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2, tie_embeddings=True)
OTHER = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=12, heads=2, tie_embeddings=True)
UNTIED = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)
GLOBAL_BATCH = 4
STEPS = 6
SAVE_AT = 3
LR = 1e-2
EPS = 1e-5  # as in the parity tests: rounding is not amplified by tiny second moments
SEED = 1234

# PLAN_A: zdp with a 4-way split c_fc (in_features 10: slices 3,3,2,2) and some dp units
PLAN_A = dict(
    default_mode="zdp",
    modes={"blocks.0.mlp.c_fc": ("zdp", "dp", "zdp", "dp"), "blocks.1.attn.c_attn": "dp", "ln_f": "dp"},
    splits={"blocks.0.mlp.c_fc": 4},
)
# PLAN_B: other modes, other splits (3-way c_fc, c_attn, c_proj, and the wpe embedding by rows)
PLAN_B = dict(
    default_mode="dp",
    modes={"blocks.0.attn.c_proj": "zdp", "blocks.1.attn.c_attn": ("zdp", "dp")},
    splits={"blocks.0.mlp.c_fc": 3, "blocks.1.mlp.c_proj": 2, "wpe": 2},
)


def make(cfg=CFG, seed=SEED):
    torch.manual_seed(seed)
    return GPT(cfg)


def wrap(plan, seed=SEED, cfg=CFG, group=None):
    import osdp

    model = osdp.OSDP(make(cfg, seed), process_group=group, **plan)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def train(model, opt, steps, cfg=CFG):
    """Steps ``steps`` (global step numbers) on this rank's part of the global batch;
    returns the global mean losses."""
    comm = model._comm
    n = GLOBAL_BATCH // comm.world_size
    losses = []
    for step in steps:
        idx, tgt = example_batch(cfg, GLOBAL_BATCH, seed=step)
        loss = model(idx[comm.rank * n : (comm.rank + 1) * n], tgt[comm.rank * n : (comm.rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=comm.group)
        losses.append(value.item() / comm.world_size)
    return losses


def unit_state(model, opt):
    """Per unit: (local shard, {optimizer state}) clones: comparable within one plan."""
    return [
        (u.shard.detach().clone(), [{k: v.clone() for k, v in opt.state.get(p, {}).items()} for p in u.params])
        for u in model._built.units
    ]


def optim_reference(model, opt):
    """AdamW state per original parameter, gathered independently of osdp.checkpoint:
    unit slots for unsplit units, the split op's ``merge`` for split ones."""
    built, comm, out = model._built, model._comm, {}
    split_units = {id(u) for _, units in built.splits.values() for u in units}

    def full(unit, key):
        flat = unit.flatten_local([opt.state[p][key] for p in unit.params])  # this rank's pieces, shard layout
        return comm.all_gather_sync(flat)[: unit.numel]

    for key in ("exp_avg", "exp_avg_sq"):
        for unit in built.units:
            if id(unit) in split_units:
                continue
            flat = full(unit, key)
            for slot in unit.slots:
                out[f"optim.{slot.fqns[0]}.{key}"] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        for path, (module, units) in built.splits.items():
            merged = type(module).merge([u.unflatten(full(u, key)) for u in units])
            for attr, tensor in merged.items():
                out[f"optim.{path}.{attr}.{key}"] = tensor.clone()
    steps = {float(s["step"]) for s in opt.state.values()}
    return out, steps


def read_plain_dcp(path, shapes: dict):
    """Read keys of a checkpoint with plain DCP into plain full tensors (one process)."""
    state = {k: torch.zeros(shape) for k, shape in shapes.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


class _FailingWriter(dcp.FileSystemWriter):
    """Writes this rank's files, then fails: a crash in the middle of a save."""

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            raise RuntimeError("simulated crash while writing")
        return result


def _expect(fn, exc_type):
    try:
        fn()
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _expect_any(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ---- world size 2 ------------------------------------------------------------------------
def run_w2(rank, world_size, root):
    import osdp.checkpoint as ck
    from osdp.checkpoint import _atomic

    out = {}
    path3 = os.path.join(root, "w2_step3")

    # full state dicts against the original model (exact)
    model, opt = wrap(PLAN_A)
    out["original"] = make().state_dict()
    out["full_initial"] = ck.full_state_dict(model)
    out["full_all_ranks"] = ck.full_state_dict(model, rank0_only=False)
    if rank == 0:
        plain = make(seed=0)
        plain.load_state_dict(out["full_initial"], strict=True)
        out["plain_after_load"] = plain.state_dict()
    target = make(seed=77).state_dict()  # another model's weights
    out["full_target"] = target
    ck.load_full_state_dict(model, target if rank == 0 else None)  # broadcast from rank 0
    out["full_after_broadcast_load"] = ck.full_state_dict(model)
    ck.load_full_state_dict(model, out["original"])  # every rank passes it
    out["full_after_local_load"] = ck.full_state_dict(model)
    full_file = os.path.join(root, "full.pt")
    ck.save_full(model, full_file)
    ck.load_full_state_dict(model, target)
    ck.load_full(model, full_file)
    out["full_after_load_full"] = ck.full_state_dict(model)
    if rank == 0:
        out["full_file"] = torch.load(full_file, weights_only=True)
    del model, opt

    # under bf16 mixed precision: the fp32 master weights, not their bf16 compute copy
    import osdp

    model, opt = wrap({**PLAN_A, "mixed_precision": osdp.MixedPrecision(param_dtype=torch.bfloat16)})
    out["mp_full_initial"] = ck.full_state_dict(model)
    ck.load_full_state_dict(model, target)
    out["mp_full_after_load"] = ck.full_state_dict(model)
    ck.save_full(model, full_file)
    if rank == 0:
        out["mp_full_file"] = torch.load(full_file, weights_only=True)
    del model, opt

    # uninterrupted run
    model, opt = wrap(PLAN_A)
    out["losses_uninterrupted"] = train(model, opt, range(STEPS))
    out["full_uninterrupted"] = ck.full_state_dict(model)
    out["units_uninterrupted"] = unit_state(model, opt)
    del model, opt

    # interrupted at SAVE_AT, resumed in a fresh model (other init) and optimizer
    model, opt = wrap(PLAN_A)
    out["losses_before_save"] = train(model, opt, range(SAVE_AT))
    out["full_step3"] = ck.full_state_dict(model)
    out["units_step3"] = unit_state(model, opt)
    out["optim_reference_step3"] = optim_reference(model, opt)
    ck.save(model, opt, path3, step=SAVE_AT, extra={"note": "resume here", "rng": torch.arange(3)})
    del model, opt
    model, opt = wrap(PLAN_A, seed=99)
    out["load_info"] = ck.load(model, opt, path3)
    out["units_after_load"] = unit_state(model, opt)
    out["losses_resumed"] = train(model, opt, range(SAVE_AT, STEPS))
    out["full_resumed"] = ck.full_state_dict(model)
    out["units_resumed"] = unit_state(model, opt)
    del model, opt

    # what the checkpoint holds, read with plain DCP in one process: original names/shapes
    if rank == 0:
        ref, _ = out["optim_reference_step3"]
        shapes = {f"model.{k}": v.shape for k, v in out["full_step3"].items() if k != "lm_head.weight"}
        shapes.update({k: v.shape for k, v in ref.items() if ".lm_head." not in k})
        shapes.update({f"optim.{k}.step": () for k in out["full_step3"] if k != "lm_head.weight"})
        out["plain_dcp"] = read_plain_dcp(path3, shapes)
    dist.barrier()

    # another plan (modes and splits): exact parameters, optimizer state round trip, training
    model, opt = wrap(PLAN_B, seed=5)
    ck.load(model, opt, path3)
    out["full_plan_b"] = ck.full_state_dict(model)
    path_b = os.path.join(root, "w2_step3_plan_b")
    ck.save(model, opt, path_b, step=SAVE_AT)
    back, back_opt = wrap(PLAN_A, seed=6)
    ck.load(back, back_opt, path_b)
    out["units_round_trip"] = unit_state(back, back_opt)
    del back, back_opt
    out["losses_plan_b"] = train(model, opt, range(SAVE_AT, STEPS))
    out["full_plan_b_end"] = ck.full_state_dict(model)

    out.update(_mismatch_checks(rank, root, path3))
    out.update(_atomic_checks(rank, root, ck, _atomic))
    return out


def _mismatch_checks(rank, root, path3):
    import osdp.checkpoint as ck

    out = {}
    model, opt = wrap(PLAN_A, seed=41)
    train(model, opt, range(1))  # optimizer has state: it must survive failed loads
    before_full, before_units = ck.full_state_dict(model), unit_state(model, opt)

    other, other_opt = wrap({"default_mode": "zdp"}, cfg=OTHER)
    train(other, other_opt, range(1), cfg=OTHER)
    path_other = os.path.join(root, "other_model")
    ck.save(other, other_opt, path_other)
    out["err_other_model"] = _expect(lambda: ck.load(model, opt, path_other), PlanMismatchError)
    del other, other_opt

    untied, untied_opt = wrap({"default_mode": "zdp"}, cfg=UNTIED)
    out["err_untied"] = _expect(functools.partial(ck.load, untied, untied_opt, path3), PlanMismatchError)
    del untied, untied_opt

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["err_optimizer_class"] = _expect(lambda: ck.load(model, sgd, path3), PlanMismatchError)

    path_no_opt = os.path.join(root, "no_optimizer")
    fresh, _ = wrap(PLAN_B, seed=3)
    ck.save(fresh, None, path_no_opt)
    out["err_no_optimizer_state"] = _expect(lambda: ck.load(model, opt, path_no_opt), PlanMismatchError)

    bad = make().state_dict()
    bad["blocks.0.mlp.c_fc.weight"] = torch.zeros(41, 10)
    bad["extra.weight"] = torch.zeros(1)
    out["err_full_bad"] = _expect(lambda: ck.load_full_state_dict(model, bad if rank == 0 else None), PlanMismatchError)

    # a checkpoint with a data file missing: DCP fails while reading, nothing changed
    broken = os.path.join(root, "broken")
    if rank == 0:
        shutil.copytree(path3, broken)
        data = sorted(f for f in os.listdir(broken) if f.endswith(".distcp"))
        os.remove(os.path.join(broken, data[-1]))
    dist.barrier()
    out["err_broken"] = _expect_any(lambda: ck.load(model, opt, broken))

    out["unchanged_full"] = (before_full, ck.full_state_dict(model))
    out["unchanged_units"] = (before_units, unit_state(model, opt))
    # and the model still works with a good checkpoint afterwards
    fresh_no_opt, _ = wrap(PLAN_A, seed=8)
    out["load_without_optimizer"] = ck.load(fresh_no_opt, None, path_no_opt)
    return out


def _atomic_checks(rank, root, ck, _atomic):
    out = {}
    model, opt = wrap(PLAN_A, seed=21)
    path = os.path.join(root, "atomic")
    ck.save(model, opt, path, step=1)
    out["v1"] = ck.full_state_dict(model)
    v1_files = sorted(os.listdir(path))
    train(model, opt, range(1))
    out["v2"] = ck.full_state_dict(model)

    def after_crash(name):
        listing = sorted(os.listdir(root))
        probe, probe_opt = wrap(PLAN_B, seed=22)
        info = ck.load(probe, probe_opt, path)
        out[name] = dict(
            files=sorted(os.listdir(path)) == v1_files,
            partial_left=[f for f in listing if "osdp-partial" in f or "osdp-old" in f],
            step=info["step"],
            full=ck.full_state_dict(probe),
        )

    # crash while DCP writes the data files (rank 1 fails after writing)
    original_writer = ck._writer
    ck._writer = lambda p: _FailingWriter(p, sync_files=False)
    try:
        out["err_crash_write"] = _expect_any(lambda: ck.save(model, opt, path, step=2))
    finally:
        ck._writer = original_writer
    after_crash("after_crash_write")

    # crash after all data and the metadata are written, before the rename
    original_replace = _atomic.replace_dir

    def crash_replace(tmp, target):
        raise RuntimeError("simulated crash before rename")

    _atomic.replace_dir = crash_replace
    try:
        out["err_crash_rename"] = _expect_any(lambda: ck.save(model, opt, path, step=2))
    finally:
        _atomic.replace_dir = original_replace
    after_crash("after_crash_rename")

    # replacing works, with the atomic exchange and with the two-rename fallback
    ck.save(model, opt, path, step=2)
    probe, probe_opt = wrap(PLAN_A, seed=23)
    out["after_replace"] = (ck.load(probe, probe_opt, path)["step"], ck.full_state_dict(probe))
    train(model, opt, range(1, 2))
    out["v3"] = ck.full_state_dict(model)
    original_exchange = _atomic.exchange_dirs
    _atomic.exchange_dirs = lambda a, b: False
    try:
        ck.save(model, opt, path, step=3)
    finally:
        _atomic.exchange_dirs = original_exchange
    out["after_fallback_replace"] = (ck.load(probe, probe_opt, path)["step"], ck.full_state_dict(probe))
    out["listing_after_replace"] = sorted(os.listdir(root))

    # single-file full checkpoint: a crash while writing keeps the previous file
    full_path = os.path.join(root, "atomic_full.pt")
    ck.save_full(model, full_path)
    out["full_file_v3"] = torch.load(full_path, weights_only=True) if rank == 0 else None
    original_save = torch.save

    def partial_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise RuntimeError("simulated crash in torch.save")

    train(model, opt, range(2, 3))
    torch.save = partial_save
    try:
        out["err_crash_full"] = _expect_any(lambda: ck.save_full(model, full_path))
    finally:
        torch.save = original_save
    out["full_file_after_crash"] = torch.load(full_path, weights_only=True) if rank == 0 else None
    out["listing_after_full_crash"] = sorted(os.listdir(root))

    # never replace something that is not a checkpoint
    precious = os.path.join(root, "precious")
    if rank == 0:
        os.makedirs(precious)
        with open(os.path.join(precious, "notes.txt"), "w") as f:
            f.write("keep me")
    dist.barrier()
    out["err_precious"] = _expect(lambda: ck.save(model, opt, precious), OSDPError)
    out["precious_files"] = sorted(os.listdir(precious))
    return out


# ---- world size 4 ------------------------------------------------------------------------
def run_w4(rank, world_size, root):
    import osdp.checkpoint as ck

    out = {}
    path3 = os.path.join(root, "w2_step3")  # written by the world-size-2 run
    # 2 -> 4, same plan: exact parameters, then training on 4 ranks
    model, opt = wrap(PLAN_A, seed=11)
    out["load_info"] = ck.load(model, opt, path3)
    out["full_loaded_a"] = ck.full_state_dict(model)
    out["losses_a"] = train(model, opt, range(SAVE_AT, STEPS))
    out["full_end_a"] = ck.full_state_dict(model)
    del model, opt
    # 2 -> 4, other plan
    model, opt = wrap(PLAN_B, seed=12)
    ck.load(model, opt, path3)
    out["full_loaded_b"] = ck.full_state_dict(model)
    out["losses_b"] = train(model, opt, range(SAVE_AT, STEPS))
    del model, opt

    # 4 -> 2: four ranks train and save, a 2-rank group (other plan) loads and trains on
    model, opt = wrap(PLAN_A)
    out["losses_w4_before_save"] = train(model, opt, range(SAVE_AT))
    out["full_w4_step3"] = ck.full_state_dict(model)
    path4 = os.path.join(root, "w4_step3")
    ck.save(model, opt, path4, step=SAVE_AT)
    del model, opt
    pair = dist.new_group([0, 1])
    if rank < 2:
        model, opt = wrap(PLAN_B, seed=13, group=pair)
        out["pair_load_info"] = ck.load(model, opt, path4)
        out["pair_full_loaded"] = ck.full_state_dict(model)
        out["pair_losses"] = train(model, opt, range(SAVE_AT, STEPS))
        out["pair_full_end"] = ck.full_state_dict(model)
        del model, opt
    dist.barrier()
    return out
