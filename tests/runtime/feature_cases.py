"""Per-rank bodies of the feature tests (mixed precision, gradient accumulation, plan
and model checks, edge models, faults), run inside one spawn per world size; see
``test_features.py``."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from osdp.contract import RuntimeConfig
from osdp.errors import OSDPError, PlanMismatchError
from osdp.models import GPT, GPTConfig, example_batch

from . import parity_cases as pc

MP_STEPS = 6
ACC_STEPS = 3  # optimizer steps
MICRO = 3  # micro-batches per optimizer step


def FakePlan(modes, world_size, batch_size=1000, **kw):
    """A plan made by hand: the typed RuntimeConfig the runtime executes."""
    return RuntimeConfig(unit_modes=dict(modes), world_size=world_size, batch_size=batch_size,
                         fingerprint="fake", model_name="fake", **kw)


def _local(batch, rank, local):
    return tuple(t[rank * local : (rank + 1) * local] for t in batch)


# ---- mixed precision -------------------------------------------------------------------
def rel_err(grads, ref) -> float:
    """||grads - ref|| / ||ref|| over every tensor of ``ref`` (as fp32)."""
    num = sum(((grads[k].float() - ref[k].float()).norm() ** 2).item() for k in ref) ** 0.5
    den = sum((ref[k].float().norm() ** 2).item() for k in ref) ** 0.5
    return num / den


def max_rel(a, b) -> float:
    """The largest |a_i - b_i| / |b_i| (e.g. losses against reference losses)."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _mp_reference(world_size):
    """Single process, whole global batch, torch.autocast(bfloat16)."""
    model = pc.make_model("uneven")
    opt = torch.optim.AdamW(model.parameters(), lr=pc.LR, eps=pc.EPS)
    losses, first_grads = [], None
    for step in range(MP_STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*pc.global_batch("uneven", step, world_size))
        loss.backward()
        if step == 0:
            first_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads, {k: v.clone() for k, v in model.state_dict().items()}


def _mp_fsdp2(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = pc.make_model("uneven")
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=pc.LR, eps=pc.EPS)
    losses = []
    for step in range(MP_STEPS):
        loss = model(*pc._local(pc.global_batch("uneven", step, world_size), rank))
        loss.backward()
        if step == 0:
            first_grads = {k: p.grad.full_tensor().detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(pc._mean_loss(loss.float(), world_size))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
    return losses, state, first_grads


def _mp_osdp(rank, world_size, kwargs):
    import osdp
    from osdp.runtime.mixed_precision import MixedPrecision

    model = pc.make_model("uneven")
    wrapped = osdp.OSDP(model, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32), **kwargs)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR, eps=pc.EPS)
    losses, probe = [], {}
    for step in range(MP_STEPS):
        loss = wrapped(*pc._local(pc.global_batch("uneven", step, world_size), rank))
        probe.setdefault("loss_dtype", str(loss.dtype))
        loss.backward()
        if step == 0:
            stats = wrapped.memory_stats()
            probe["gathered_bytes"] = stats["unit_peak_gathered_bytes"]
            probe["padded"] = {u.name: u.padded_numel for u in wrapped._built.units}
            probe["shard_dtypes"] = sorted({str(p.dtype) for p in wrapped.parameters()})
            probe["grad_dtypes"] = sorted({str(p.grad.dtype) for p in wrapped.parameters() if p.grad is not None})
            probe["first_grads"] = wrapped_grads(wrapped)
        opt.step()
        opt.zero_grad()
        losses.append(pc._mean_loss(loss.float(), world_size))
    return losses, wrapped.full_state_dict(), probe


def wrapped_grads(wrapped):
    """The full gradient of every original parameter (gathers the sharded .grad)."""
    grads, full = {}, {}
    split_units = {id(u) for _, units in wrapped._built.splits.values() for u in units}
    for unit in wrapped._built.units:
        full[unit.name] = wrapped._comm.all_gather_sync(unit.sharded_grad())[: unit.numel]
        if id(unit) in split_units:
            continue  # merged below (a slice's slots are named ``name[i]``)
        for slot in unit.slots:
            for fqn in slot.fqns:
                grads[fqn] = full[unit.name][slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    for path, (module, units) in wrapped._built.splits.items():
        merged = type(module).merge([u.unflatten(full[u.name]) for u in units])
        grads.update({f"{path}.{attr}": t.clone() for attr, t in merged.items()})
    return grads


# ---- gradient accumulation -------------------------------------------------------------
def _acc_reference(world_size):
    """One big batch per optimizer step (MICRO x the local batch on every rank)."""
    model = pc.make_model("uneven")
    opt = torch.optim.AdamW(model.parameters(), lr=pc.LR, eps=pc.EPS)
    losses = []
    for step in range(ACC_STEPS):
        loss = model(*pc.global_batch_sized("uneven", step, world_size * pc.LOCAL_BATCH * MICRO))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _acc_osdp(rank, world_size, sync, kwargs):
    """MICRO micro-batches per step; ``sync``: "last" (no_sync until the last),
    "every", or "plan_last" / "plan_every" (model.micro_batch with the plan's policy)."""
    import osdp

    model = pc.make_model("uneven")
    plan = None
    if sync.startswith("plan_"):
        modes = dict(kwargs.pop("modes"))
        for name, g in kwargs.pop("splits", {}).items():  # a plan names slices by their modes
            mode = modes.get(name, "zdp")
            modes[name] = (mode,) * g if isinstance(mode, str) else tuple(mode)
        plan = FakePlan(modes, world_size, accumulation_steps=MICRO, gradient_sync=sync[5:])
    wrapped = osdp.OSDP(model, plan, **kwargs)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR, eps=pc.EPS)
    local = pc.LOCAL_BATCH * MICRO
    losses, probe = [], {"accumulation_steps": wrapped.accumulation_steps, "gradient_sync": wrapped.gradient_sync}
    for step in range(ACC_STEPS):
        batch = _local(pc.global_batch_sized("uneven", step, world_size * local), rank, local)
        total = 0.0
        wrapped.reset_memory_stats()
        for i in range(MICRO):
            micro = tuple(t[i * pc.LOCAL_BATCH : (i + 1) * pc.LOCAL_BATCH] for t in batch)
            if sync.startswith("plan_"):
                ctx = wrapped.micro_batch(i)
            elif sync == "last" and i < MICRO - 1:
                ctx = wrapped.no_sync()
            else:
                ctx = _null()
            with ctx:
                loss = wrapped(*micro) / MICRO
                loss.backward()
            total += loss.item()
            if step == 0 and i == 0:
                probe["grad_bytes_after_first_micro"] = wrapped.memory_stats()["current_grad_bytes"]
                probe["has_grad_after_first_micro"] = any(p.grad is not None for p in wrapped.parameters())
        if step == 0:
            probe["reduce_scatters"] = wrapped.memory_stats()["reduce_scatters"]
            probe["grad_bytes_after_step"] = wrapped.memory_stats()["current_grad_bytes"]
        opt.step()
        opt.zero_grad()
        value = torch.tensor([total])
        dist.all_reduce(value)
        losses.append(value.item() / world_size)
    return losses, wrapped.full_state_dict(), probe


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- edge models -----------------------------------------------------------------------
class Zero(nn.Module):
    """A unit of zero elements."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return x + self.p.sum()


class Tiny(nn.Module):
    """A zero-size unit, a one-element unit (the root's scale) and an ordinary Linear."""

    def __init__(self):
        super().__init__()
        self.zero = Zero()
        self.scale = nn.Parameter(torch.tensor([1.5]))
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        return self.zero(self.lin(x)) * self.scale


def _edge_models(rank, world_size):
    import osdp

    out = {}
    # zero-size and one-element parameters, trained against a single process
    torch.manual_seed(0)
    ref = Tiny()
    torch.manual_seed(0)
    wrapped = osdp.OSDP(Tiny(), modes={"": "dp", "lin": "zdp", "zero": "zdp"})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2 * world_size, 5, generator=gen)
        ref(x).square().mean().backward()
        wrapped(x[rank * 2 : (rank + 1) * 2]).square().mean().backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    out["tiny"] = (wrapped.full_state_dict(), {k: v.clone() for k, v in ref.state_dict().items()})

    # everything frozen: forward and input gradients like the plain model, no gathers left
    from osdp.models.gpt import Block

    torch.manual_seed(0)
    ref = nn.Sequential(Block(10, 2, 4), Block(10, 2, 4))
    model = nn.Sequential(Block(10, 2, 4), Block(10, 2, 4))
    model.load_state_dict(ref.state_dict())
    for p in list(model.parameters()) + list(ref.parameters()):
        p.requires_grad_(False)
    wrapped = osdp.OSDP(model, default_mode="zdp")
    results = []
    for m in (wrapped, ref):
        for _ in range(2):  # the second step runs with the recorded order
            emb = torch.randn(2, 8, 10, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            y = m(emb)
            y.square().sum().backward()
        results.append((y.detach(), emb.grad.clone()))
    out["frozen"] = results
    out["frozen_gathered_after"] = wrapped.gathered_units()
    out["frozen_has_trainable"] = any(p.requires_grad for p in wrapped.parameters())

    # ranks wrapping different models (same names, different widths) fail before training
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10 if rank == 0 else 12, heads=2)
    try:
        osdp.OSDP(GPT(cfg))
        out["different_models"] = None
    except PlanMismatchError as exc:
        out["different_models"] = str(exc)
    return out


# ---- auto mode -------------------------------------------------------------------------
def _auto(rank, world_size, cache_dir):
    import osdp
    from osdp.models import get_preset

    torch.manual_seed(0)
    config = get_preset("tiny")
    model = GPT(config)
    inputs = example_batch(config, 4)
    kwargs = dict(cache_dir=cache_dir, comm_sizes=(4096, 65536), repeats=1, progress=False)
    wrapped = osdp.OSDP(model, memory_limit="64MiB", example_inputs=inputs, auto_kwargs=kwargs)
    out = {"batch_size": wrapped.batch_size, "plan_hash": wrapped.plan.plan_hash(),
           "unit_modes": wrapped.unit_modes(), "plan_units": {u.name: list(u.modes) for u in wrapped.plan.units}}
    # auto mode trains exactly as the same plan handed over by hand
    torch.manual_seed(0)
    by_hand = osdp.OSDP(GPT(config), plan=wrapped.plan)
    for name, model_ in (("auto", wrapped), ("by_hand", by_hand)):
        opt = torch.optim.AdamW(model_.parameters(), lr=1e-3)
        losses = []
        for step in range(3):
            loss = model_(*example_batch(config, wrapped.batch_size, seed=10 * step + rank))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[f"losses_{name}"] = losses
        out[f"params_{name}"] = [p.detach().clone() for p in model_.parameters()]
    out["loss"] = out["losses_auto"][0]
    try:
        wrapped(*example_batch(config, wrapped.batch_size + 1, seed=rank))
        out["too_big"] = None
    except OSDPError as exc:
        out["too_big"] = str(exc)
    # the plan made for this model does not fit another one
    other = GPT(GPTConfig(**{**config.__dict__, "hidden": config.hidden * 2}))
    try:
        osdp.OSDP(other, wrapped.plan)
        out["other_model"] = None
    except PlanMismatchError as exc:
        out["other_model"] = str(exc)
    return out


# ---- everything in one spawn -------------------------------------------------------------
def mp_kwargs(model_factory=pc.make_model):
    model = model_factory("uneven")
    return {
        "random": {"modes": pc._random(model, seed=9)},
        "split": pc._split_kwargs(model),
    }


def run_features(rank, world_size, cache_dir):
    out = {"mp": {}, "acc": {}}
    kw = mp_kwargs()
    for name, kwargs in kw.items():
        out["mp"][name] = _mp_osdp(rank, world_size, kwargs)
    out["mp_fsdp2"] = _mp_fsdp2(rank, world_size)
    if rank == 0:
        out["mp_ref"] = _mp_reference(world_size)
        out["acc_ref"] = _acc_reference(world_size)
    for sync in ("last", "every", "plan_last", "plan_every"):
        kwargs = dict(pc._split_kwargs(pc.make_model("uneven")))
        out["acc"][sync] = _acc_osdp(rank, world_size, sync, kwargs)
    out["edge"] = _edge_models(rank, world_size)
    out["auto"] = _auto(rank, world_size, cache_dir)
    return out


# ---- faults -----------------------------------------------------------------------------
def fault_worker(rank, world_size, port, out_dir, mode, timeout_s, compile=None):
    """Own worker (not dist_harness): a rank that dies leaves the group broken, so no
    destroy_process_group; every process exits with os._exit after saving its result."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = {"ok": True}
    try:
        import osdp

        model = pc.make_model("uneven")
        wrapped = osdp.OSDP(model, default_mode="zdp", timeout_s=timeout_s, compile=compile)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR)
        bad = rank == world_size - 1
        for step in range(3):
            if bad and step == 1:
                if mode == "exit":
                    torch.save({"ok": True, "result": "exited"}, os.path.join(out_dir, f"{rank}.pt"))
                    os._exit(0)
                time.sleep(timeout_s * 20)  # hang (killed once the others gave up): they must give up first
                torch.save({"ok": True, "result": "slept"}, os.path.join(out_dir, f"{rank}.pt"))
                os._exit(0)
            start = time.perf_counter()
            try:
                loss = wrapped(*pc._local(pc.global_batch("uneven", step, world_size), rank))
                loss.backward()
                opt.step()
                opt.zero_grad()
            except (OSDPError, RuntimeError) as exc:
                result["result"] = (type(exc).__name__, str(exc), time.perf_counter() - start, step)
                break
        else:
            result["result"] = None
    except BaseException as exc:  # noqa: BLE001
        result = {"ok": False, "error": repr(exc)}
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    os._exit(0)
