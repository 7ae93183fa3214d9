"""The gradient norm of a sharded model, over every rank's shards.

[Note: global gradient norm]
Every element of every original parameter lives on exactly one rank (padding belongs to
no parameter, tied weights are one unit), so the p-norm of the whole model's gradient is
``(sum over ranks of sum |g|^p) ^ (1/p)``: one all-reduce of this rank's ``sum |g|^p``
(in fp64, so that the sum over ranks does not depend on how the elements are split),
and ``max`` for the inf-norm. Every rank gets the same value, equal to the norm a single
process computes over the unsharded gradients (within the rounding of the fp32 local
norms). torch's ``clip_grad_norm_`` sees only the local shards and would clip each
rank by a different norm (a silent wrong result). So once an OSDP model exists, torch's
total-norm helper (behind ``clip_grad_norm_`` and ``get_total_norm``), handed
OSDP-sharded gradients (``p.grad._osdp_sharded``, set by the runtime when it writes a
reduced gradient, with ``_osdp_group``, the model's shard group), computes this global
norm instead: a collective, as FSDP2's DTensor gradients make torch's own helper do.
Code that clips through torch (Hugging Face's Trainer through accelerate, Lightning)
then clips as ``model.clip_grad_norm_`` does; every rank must call it, with the
gradients of the same parameters. Gradients of models on different groups in one call
are refused (``model.clip_grad_norm_`` per model); any other call goes to torch
unchanged.

A ``rep`` unit's gradient is whole and the same on every rank (contract.py [Note:
replicated units]): summing it over ranks would count it N times, so its ``sum |g|^p``
is added after the all-reduce, once (for the inf-norm: the max with it). It is marked
``_osdp_replicated``, not ``_osdp_sharded``: torch's helper gives the right norm for a
model whose units are all ``rep`` (as under DDP) and is refused only where sharded
gradients are among those it is handed.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _torch_clip

from ..errors import OSDPError

_torch_total_norm = _torch_clip._get_total_norm


def mark_sharded(grad: torch.Tensor, group) -> None:
    """Mark ``grad`` as this rank's shard of a gradient whose norm is taken over ``group``."""
    grad._osdp_sharded = True
    grad._osdp_group = group


def check_norm_args(max_norm, norm_type) -> float:
    """``norm_type`` as a float; OSDPError for values that are not a usable norm."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0 or math.isinf(max_norm):
        raise OSDPError(f"max_norm must be a finite number >= 0, got {max_norm!r}")
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        norm_type = math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise OSDPError(f"norm_type must be a number > 0 or 'inf' (2.0: the Euclidean norm), got {norm_type!r}")
    return float(norm_type)


def _local_norm(grads, norm_type: float, device: torch.device, foreach) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return _torch_total_norm(grads, norm_type, False, foreach).to(device=device, dtype=torch.float64)


def global_grad_norm(params, norm_type: float, group, device: torch.device, foreach=None,
                     replicated=()) -> torch.Tensor:
    """The ``norm_type``-norm of all ranks' gradients of ``params`` (a collective);
    see [Note: global gradient norm]. ``replicated``: those of ``params`` whose
    gradients are whole on every rank (rep units), counted once. Returns an fp32 scalar
    on ``device``."""
    whole = {id(p) for p in replicated}
    held = [p for p in params if p.grad is not None and p.grad.numel() > 0]
    return _norm_over_ranks([p.grad for p in held if id(p) not in whole], [p.grad for p in held if id(p) in whole],
                            norm_type, group, device, foreach)


def _norm_over_ranks(sharded, whole, norm_type: float, group, device: torch.device, foreach) -> torch.Tensor:
    """The norm of ``sharded`` gradients over every rank of ``group``, with ``whole``
    ones (the same on every rank) counted once."""
    local = _local_norm(sharded, norm_type, device, foreach)
    once = _local_norm(whole, norm_type, device, foreach)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(local, once)
    else:
        local = local.pow(norm_type)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = (local + once.pow(norm_type)).pow(1.0 / norm_type)
    return total.to(torch.float32)


def _guarded_total_norm(tensors, norm_type=2.0, error_if_nonfinite: bool = False, foreach=None):
    """torch's ``_get_total_norm``; over every rank for OSDP-sharded gradients."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    sharded = [t for t in tensors if getattr(t, "_osdp_sharded", False)]
    if not sharded:
        return _torch_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    groups = {id(g): g for g in (getattr(t, "_osdp_group", None) for t in sharded)}
    if len(groups) != 1 or None in groups.values():
        raise OSDPError(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm got the gradients of OSDP models on different "
            "process groups in one call: clip each with model.clip_grad_norm_(max_norm, norm_type)")
    norm_type = float(norm_type)
    held = {id(t) for t in sharded}
    total = _norm_over_ranks([t for t in sharded if t.numel() > 0],
                             [t for t in tensors if id(t) not in held and t.numel() > 0],
                             norm_type, next(iter(groups.values())), sharded[0].device, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    return total


def install_torch_clip_guard() -> None:
    """Route torch's total-norm helper through the OSDP check (idempotent)."""
    import torch.nn.utils as utils

    _torch_clip._get_total_norm = _guarded_total_norm
    if getattr(utils, "get_total_norm", None) is _torch_total_norm:
        utils.get_total_norm = _guarded_total_norm
