"""Per-rank bodies of the training-loop tests (``test_training_loop.py``): global
gradient clipping, optimizer param groups by original name, recovery after exceptions
in forward and backward, refusal of a second wrapper. Each OSDP run is compared with
single-process training of the same model on the whole global batch."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import clip_grad_norm_ as torch_clip_grad_norm_  # bound before any OSDP model exists

from osdp.errors import OSDPError

from . import parity_cases as pc

STEPS = 6
MAX_NORM = 0.05  # small enough that every step clips
WEIGHT_DECAY = 0.1
FAIL_FORWARD_STEP, FAIL_BACKWARD_STEP = 0, 3


def _no_decay(name: str) -> bool:
    """The usual rule by name: no weight decay for biases and norms."""
    return name.endswith(".bias") or ".ln_" in name or name.startswith("ln_")


def _optimizer(named_params):
    named = [(n, p) for n, p in named_params if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if not _no_decay(n)], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=pc.LR, eps=pc.EPS)


class _RaiseInBackward(torch.autograd.Function):
    """Identity whose backward raises: a failure in the middle of the backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


def fail_one_backward(layer: nn.Module, forward, opt) -> None:
    """A step whose backward raises on reaching ``layer`` (injected), then zero_grad: as
    in plain PyTorch, a failed backward leaves partial ``.grad``. ``forward()`` returns
    the loss."""
    handle = layer.register_forward_hook(lambda mod, args, out: _RaiseInBackward.apply(out))
    loss = forward()
    handle.remove()
    try:
        loss.backward()
        raise AssertionError("the injected backward failure did not raise")
    except RuntimeError as exc:
        assert "injected failure" in str(exc), exc
    opt.zero_grad()


def _bad_batch(batch):
    idx, tgt = batch
    idx = idx.clone()
    idx[0, 0] = 10_000  # out of the vocabulary: the embedding raises inside forward
    return idx, tgt


def _train(model, blocks, step_batch, clip, norms_out, opt, evals_out):
    """The shared training loop: a failing forward before step FAIL_FORWARD_STEP, a
    backward failing in ``blocks[0]`` at step FAIL_BACKWARD_STEP (then zero_grad and the
    step again), clipping every step, an evaluation under ``torch.inference_mode()``
    before each step ([Note: inference mode] in osdp/runtime/scheduler.py: its gathers
    made inference tensors and raised). Returns the losses."""
    losses = []
    for step in range(STEPS):
        with torch.inference_mode():
            evals_out.append(model(*step_batch(step)))
        if step == FAIL_FORWARD_STEP:
            try:
                model(*_bad_batch(step_batch(step)))
                raise AssertionError("the out-of-range token id did not raise")
            except IndexError:
                pass
        if step == FAIL_BACKWARD_STEP:
            fail_one_backward(blocks[0], lambda: model(*step_batch(step)), opt)
        loss = model(*step_batch(step))
        loss.backward()
        norms_out.append(clip(step))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def mean_over_ranks(values, world_size: int) -> list[float]:
    """Each loss's mean over the ranks: the single process's loss on the whole batch."""
    out = []
    for value in values:
        value = value.clone()  # an inference tensor allows no in-place all_reduce
        dist.all_reduce(value)
        out.append(value.item() / world_size)
    return out


def reference(world_size: int):
    model = pc.make_model("uneven")
    opt = _optimizer(model.named_parameters())
    norms: list = []

    def clip(step):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        extra = [torch.nn.utils.get_total_norm(grads, norm).item() for norm in (1.0, math.inf)]
        return [torch_clip_grad_norm_(model.parameters(), MAX_NORM).item()] + extra

    evals: list = []
    losses = _train(model, model.blocks, lambda s: pc.global_batch("uneven", s, world_size), clip, norms, opt, evals)
    return [x.item() for x in losses], norms, {k: v.clone() for k, v in model.state_dict().items()}, \
        [x.item() for x in evals]


def osdp_run(rank: int, world_size: int):
    import osdp

    model = pc.make_model("uneven")
    wrapped = osdp.OSDP(model, **pc._split_kwargs(model))
    out = {"refused": _second_wrappers(model, wrapped)}
    names = [n for n, _ in wrapped.named_parameters()]
    out["names"] = names
    # the ndim rule for weight decay partitions the same way as the name rule
    out["ndim_rule_agrees"] = all((p.dim() < 2) == _no_decay(n) for n, p in wrapped.named_parameters())
    opt = _optimizer(wrapped.named_parameters())
    norms: list = []

    def clip(step):
        if step == 1:  # torch's own helpers, as accelerate (Hugging Face's Trainer) calls them: the global norm
            grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
            out["torch_clip"] = [torch_clip_grad_norm_(wrapped.parameters(), 1e30).item()] + [
                torch.nn.utils.get_total_norm(grads, norm).item() for norm in (1.0, math.inf)]
        extra = [wrapped.clip_grad_norm_(1e30, norm_type=norm).item() for norm in (1.0, math.inf)]
        return [wrapped.clip_grad_norm_(MAX_NORM).item()] + extra

    local = lambda s: pc._local(pc.global_batch("uneven", s, world_size), rank)  # noqa: E731
    evals: list = []
    losses = _train(wrapped, wrapped.module.blocks, local, clip, norms, opt, evals)
    out["stats_after"] = wrapped.memory_stats()["gathered_units"]
    out.update(losses=mean_over_ranks(losses, world_size), evals=mean_over_ranks(evals, world_size), norms=norms,
               state=wrapped.full_state_dict())
    return out


def _second_wrappers(model, wrapped) -> list[str]:
    """Every way of wrapping modules the first wrapper owns must be refused."""
    import osdp

    messages = []
    for target in (model, wrapped, model.blocks[0], nn.Sequential(model.blocks[1])):
        try:
            osdp.OSDP(target)
            messages.append("accepted")
        except OSDPError as exc:
            messages.append(str(exc))
    return messages
