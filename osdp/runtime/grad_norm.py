"""The gradient norm of a sharded model, over every rank's shards.

[Note: global gradient norm]
Every element of every original parameter lives on exactly one rank (padding belongs to
no parameter, tied weights are one unit), so the p-norm of the whole model's gradient is
``(sum over ranks of sum |g|^p) ^ (1/p)``: one all-reduce of this rank's ``sum |g|^p``
(in fp64, so that the sum over ranks does not depend on how the elements are split),
and ``max`` for the inf-norm. Every rank gets the same value, equal to the norm a single
process computes over the unsharded gradients (within the rounding of the fp32 local
norms). torch's ``clip_grad_norm_`` sees only the local shards and would clip each
rank by a different norm (a silent wrong result), so OSDP refuses it: once an OSDP model
exists, torch's total-norm helper raises when it is handed OSDP-sharded gradients
(``p.grad._osdp_sharded``, set by the runtime when it writes a reduced gradient) and
names ``model.clip_grad_norm_`` instead. Any other call goes to torch unchanged.

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
    local = _local_norm([p.grad for p in held if id(p) not in whole], norm_type, device, foreach)
    once = _local_norm([p.grad for p in held if id(p) in whole], norm_type, device, foreach)
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(local, once)
    else:
        local = local.pow(norm_type)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = (local + once.pow(norm_type)).pow(1.0 / norm_type)
    return total.to(torch.float32)


def _guarded_total_norm(tensors, *args, **kwargs):
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    else:
        tensors = list(tensors)
    if any(getattr(t, "_osdp_sharded", False) for t in tensors):
        raise OSDPError(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm got the gradients of an OSDP model: they "
            "are this rank's shards only, so the norm would differ per rank; use "
            "model.clip_grad_norm_(max_norm, norm_type) (the global norm over all ranks)"
        )
    return _torch_total_norm(tensors, *args, **kwargs)


def install_torch_clip_guard() -> None:
    """Route torch's total-norm helper through the OSDP check (idempotent)."""
    import torch.nn.utils as utils

    _torch_clip._get_total_norm = _guarded_total_norm
    if getattr(utils, "get_total_norm", None) is _torch_total_norm:
        utils.get_total_norm = _guarded_total_norm
