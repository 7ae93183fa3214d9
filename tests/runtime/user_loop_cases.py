"""Per-rank body of ``test_user_loops.py``: idioms of users' own training loops, each
run on the wrapped model and on the plain one in the same process (the plain one on the
whole global batch), which must agree.

- a metric forward with grad on between ``backward`` and ``step``, never backpropagated
  ([Note: outdated gathers] in osdp/runtime/scheduler.py);
- a backward through a forward taken before the step: refused, as plain PyTorch does;
- a forward before ``osdp.checkpoint.load``: the load's weights are the next forward's;
- param groups built in another order than when saved: each takes its own saved
  hyperparameters ([Note: param groups by their parameters] in osdp/checkpoint);
- a micro-batch under ``no_sync`` discarded with ``model.zero_grad()``, and a step while
  gradients are held ([Note: held gradients at a step] in optimizer_steps.py);
- torch's DCP of the local state and shape-reading optimizers: refused ([Note: no torch
  DCP of the local state] in osdp/api.py, [Note: optimizers that read shapes]);
- an input's gradient by ``torch.autograd.grad`` through split ops (adversarial
  examples), which leaves ``.grad`` alone ([Note: weight gradients a backward wants] in
  osdp/ops/registry.py).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

import osdp
import osdp.checkpoint as ckpt
from osdp.errors import OSDPError

from . import parity_cases as pc

STEPS = 3
LR = 1e-2


def _gpt_configs(model) -> dict:
    return {"dp": {"default_mode": "dp"}, "zdp": {"default_mode": "zdp"}, "random": {"modes": pc._random(model)},
            "split": pc._split_kwargs(model)}


def _compare(plain: nn.Module, wrapped: osdp.OSDP) -> float:
    """Largest difference of the two models' parameters."""
    mine, theirs = wrapped.full_state_dict(rank0_only=False), plain.state_dict()
    return max((mine[k] - theirs[k]).abs().max().item() for k in theirs)


# ---- a metric forward between backward and step ---------------------------------------

def _metric_loop(model, batches, mean_loss) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=pc.EPS)
    losses = []
    for step in range(STEPS):
        loss = model(*batches(step))
        loss.backward()
        model(*batches(100 + step)).item()  # a train metric, grad on, never backpropagated
        opt.step()
        opt.zero_grad()
        losses.append(mean_loss(loss))
    return losses


def _each_config_against_plain(rank: int, world: int, loop) -> dict:
    """``loop(model, batches, mean_loss)`` on the plain model (the whole global batch)
    and on each wrapped configuration (this rank's part): losses and parameters."""
    plain = pc.make_model("uneven")
    expected = loop(plain, lambda s: pc.global_batch("uneven", s, world), lambda loss: loss.item())
    out = {}
    for name, kwargs in _gpt_configs(pc.make_model("uneven")).items():
        wrapped = osdp.OSDP(pc.make_model("uneven"), **kwargs)
        losses = loop(wrapped, lambda s: pc._local(pc.global_batch("uneven", s, world), rank),
                      lambda loss: pc._mean_loss(loss, world))
        out[name] = {"losses": losses, "expected": expected, "params": _compare(plain, wrapped)}
    return out


def metric_forward(rank: int, world: int) -> dict:
    return _each_config_against_plain(rank, world, _metric_loop)


# ---- a backward through a forward taken before the step ---------------------------------

def _late_backward(model, batches) -> str:
    """A forward, the step, then that forward's backward; what it raised."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model(*batches(0)).backward()
    late = model(*batches(1))
    opt.step()
    try:
        late.backward()
    except (RuntimeError, OSDPError) as exc:
        raised = f"{type(exc).__name__}: {exc}"
    else:
        raised = ""
    opt.zero_grad()  # a failed backward may have left some gradients (plain PyTorch too)
    model(*batches(2)).backward()  # the loop goes on
    opt.step()
    return raised


def late_backward(rank: int, world: int) -> dict:
    plain = pc.make_model("uneven")
    out = {"plain": _late_backward(plain, lambda s: pc.global_batch("uneven", s, world))}
    for name in ("dp", "zdp"):
        wrapped = osdp.OSDP(pc.make_model("uneven"), default_mode=name)
        raised = _late_backward(wrapped, lambda s: pc._local(pc.global_batch("uneven", s, world), rank))
        out[name] = {"raised": raised, "params": _compare(plain, wrapped)}
    return out


# ---- a forward before a checkpoint load ------------------------------------------------

def forward_before_load(rank: int, world: int, directory: str) -> dict:
    x, _ = pc.global_batch("uneven", 0, world)
    out = {}
    for name in ("dp", "zdp", "split"):
        kwargs = _gpt_configs(pc.make_model("uneven"))[name]
        trained = osdp.OSDP(pc.make_model("uneven"), **kwargs)
        opt = torch.optim.SGD(trained.parameters(), lr=1.0)
        trained(*pc.global_batch("uneven", 1, world)).backward()
        opt.step()
        path = f"{directory}/{name}"
        ckpt.save(trained, None, path)
        model = osdp.OSDP(pc.make_model("uneven"), **kwargs)
        model(x).sum().item()  # a check before loading, grad on: dp units stay gathered
        ckpt.load(model, None, path)
        with torch.no_grad():
            logits = model(x)
        plain = pc.make_model("uneven")
        plain.load_state_dict(trained.full_state_dict(rank0_only=False))
        with torch.no_grad():
            out[name] = (logits - plain(x)).abs().max().item()
    return out


# ---- param groups built in another order than saved ------------------------------------

def _grouped(model, reverse: bool = False, moved: int = 0) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, the two groups in either order;
    ``moved``: that many vectors moved into the decay group (other groups than saved)."""
    named = list(model.named_parameters())
    rest = [p for _, p in named if p.dim() < 2]
    decay = [p for _, p in named if p.dim() >= 2] + rest[:moved]
    groups = [{"params": decay, "weight_decay": 0.1, "name": "decay"},
              {"params": rest[moved:], "weight_decay": 0.0, "name": "no_decay"}]
    return torch.optim.AdamW(groups[::-1] if reverse else groups, lr=LR, eps=pc.EPS)


def _train(model, opt, steps, batches, mean_loss) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*batches(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_loss(loss))
    return losses


def groups_reordered(rank: int, world: int, directory: str) -> dict:
    """Saved with the decay group first (one plan), resumed with it last (another plan):
    each group keeps its own weight decay, and training goes on as uninterrupted."""
    plain = pc.make_model("uneven")
    expected = _train(plain, _grouped(plain), range(4), lambda s: pc.global_batch("uneven", s, world),
                      lambda loss: loss.item())
    local = lambda s: pc._local(pc.global_batch("uneven", s, world), rank)  # noqa: E731
    mean = lambda loss: pc._mean_loss(loss, world)  # noqa: E731
    saved = osdp.OSDP(pc.make_model("uneven"), **_gpt_configs(pc.make_model("uneven"))["random"])
    opt = _grouped(saved)
    losses = _train(saved, opt, range(2), local, mean)
    path = f"{directory}/groups"
    ckpt.save(saved, opt, path)
    resumed = osdp.OSDP(pc.make_model("uneven"), **_gpt_configs(pc.make_model("uneven"))["split"])
    resumed_opt = _grouped(resumed, reverse=True)
    ckpt.load(resumed, resumed_opt, path)
    groups = [(g["name"], g["weight_decay"], len(g["params"])) for g in resumed_opt.param_groups]
    losses += _train(resumed, resumed_opt, range(2, 4), local, mean)
    other = osdp.OSDP(pc.make_model("uneven"), default_mode="zdp")
    try:
        ckpt.load(other, _grouped(other, moved=1), path)
        refused = ""
    except OSDPError as exc:
        refused = str(exc)
    return {"losses": losses, "expected": expected, "params": _compare(plain, resumed), "groups": groups,
            "refused": refused}


# ---- torch's DCP and optimizers that read shapes ------------------------------------------

def refused_tools(rank: int, world: int, directory: str) -> dict:
    """What OSDP's pieces would silently break: torch's DCP of the local state (saved once
    as if replicated) and optimizers that step a parameter as a whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = osdp.OSDP(pc.make_model("uneven"), default_mode="zdp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {}
    calls = {"get_state_dict": lambda: get_state_dict(model, opt),
             "dcp.save(Stateful)": lambda: dcp.save({"model": model}, checkpoint_id=f"{directory}/dcp")}
    for optimizer in ("Adafactor", "LBFGS"):
        shaped = getattr(torch.optim, optimizer)(model.parameters(), lr=LR)
        calls[optimizer] = lambda shaped=shaped: shaped.step(lambda: model(*pc.global_batch("uneven", 0, world)))
    model(*pc.global_batch("uneven", 0, world)).backward()
    for name, call in calls.items():
        try:
            call()
            out[name] = ""
        except OSDPError as exc:
            out[name] = str(exc)
    rep = osdp.OSDP(pc.make_model("uneven"), default_mode="rep")  # whole on every rank: Adafactor may step it
    factored = torch.optim.Adafactor(rep.parameters(), lr=LR)
    rep(*pc.global_batch("uneven", 0, world)).backward()
    factored.step()
    out["Adafactor on rep units"] = "stepped"
    return out


# ---- micro-batches under no_sync -------------------------------------------------------

def _discard_loop(model, batches, mean_loss) -> list[float]:
    """Each step: a micro-batch under no_sync discarded by model.zero_grad(), then one
    kept (plain: a plain backward discarded)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=pc.EPS)
    losses = []
    for step in range(STEPS):
        with model.no_sync() if isinstance(model, osdp.OSDP) else contextlib.nullcontext():
            (100.0 * model(*batches(100 + step))).backward()  # a bad micro-batch ...
        model.zero_grad()  # ... dropped
        losses += _train(model, opt, [step], batches, mean_loss)
    return losses


def no_sync_discarded(rank: int, world: int) -> dict:
    return _each_config_against_plain(rank, world, _discard_loop)


def step_while_held(rank: int, world: int) -> dict:
    """Every micro-batch under no_sync, then step: refused; model.zero_grad() drops the
    held gradients and the loop goes on as the plain one does without that batch."""
    plain = pc.make_model("uneven")
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR)
    plain(*pc.global_batch("uneven", 1, world)).backward()
    plain_opt.step()
    out = {}
    for name, kwargs in _gpt_configs(pc.make_model("uneven")).items():
        wrapped = osdp.OSDP(pc.make_model("uneven"), **kwargs)
        opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
        with wrapped.no_sync():
            wrapped(*pc._local(pc.global_batch("uneven", 0, world), rank)).backward()
        try:
            opt.step()
            raised = ""
        except OSDPError as exc:
            raised = str(exc)
        wrapped.zero_grad()
        wrapped(*pc._local(pc.global_batch("uneven", 1, world), rank)).backward()
        opt.step()
        out[name] = {"raised": raised, "params": _compare(plain, wrapped)}
    return out


# ---- an input's gradient through split ops ---------------------------------------------

def _mlp() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 12), nn.GELU(), nn.Linear(12, 4))


def _adversarial_loop(model, inputs) -> list[torch.Tensor]:
    """FGSM: each step takes the input's gradient, then trains on the perturbed input."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=pc.EPS)
    losses = []
    for step in range(STEPS):
        x = inputs(step).requires_grad_()
        (gx,) = torch.autograd.grad(model(x).pow(2).mean(), x)
        loss = model(x.detach() + 0.1 * gx.sign()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _inputs(step: int, world: int) -> torch.Tensor:
    return torch.randn(2 * world, 16, generator=torch.Generator().manual_seed(step))


def input_gradient(rank: int, world: int) -> dict:
    plain = _mlp()
    expected = _adversarial_loop(plain, lambda s: _inputs(s, world))
    configs = {
        "split_in": {"splits": {"0": 2, "2": 3}, "modes": {"0": ("dp", "zdp"), "2": ("zdp", "dp", "zdp")}},
        "split_out": {"splits": {"4": 2}, "split_ops": {"4": "linear_out_features"}, "modes": {"4": ("dp", "zdp")}},
    }
    out = {}
    for name, kwargs in configs.items():
        wrapped = osdp.OSDP(_mlp(), **kwargs)
        grads_after = _input_grad_leaves_grad(wrapped, _inputs(0, world)[2 * rank: 2 * rank + 2])
        losses = _adversarial_loop(wrapped, lambda s: _inputs(s, world)[2 * rank: 2 * rank + 2])
        out[name] = {"losses": [pc._mean_loss(loss, world) for loss in losses],
                     "expected": [loss.item() for loss in expected], "params": _compare(plain, wrapped),
                     "grads_after_input_grad": grads_after}
    return out


def _input_grad_leaves_grad(model, x) -> list[str]:
    """The parameters holding a gradient after only an input's gradient was taken."""
    x = x.clone().requires_grad_()
    torch.autograd.grad(model(x).pow(2).mean(), x)
    held = [name for name, p in model.named_parameters() if p.grad is not None]
    model.zero_grad()
    return held


def run_all(rank: int, world: int, directory: str) -> dict:
    return {"metric_forward": metric_forward(rank, world), "late_backward": late_backward(rank, world),
            "forward_before_load": forward_before_load(rank, world, directory),
            "groups_reordered": groups_reordered(rank, world, directory),
            "refused_tools": refused_tools(rank, world, directory),
            "no_sync_discarded": no_sync_discarded(rank, world), "step_while_held": step_while_held(rank, world),
            "input_gradient": input_gradient(rank, world)}
