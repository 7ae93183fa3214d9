"""Bytes that do not depend on the search's choices: the static states every plan pays
and the optimizer step's moment
(docs/design/cost_model.md's [Note: memory model]; [Note: optimizer step moment] here;
the other moment after the ops' is end_of_backward.py's)."""
from __future__ import annotations

import math

from ..model_desc import ModelDesc
from ..device import DeviceInfo
from .replicate import _rep_grad_sizes, _rep_owner, rep_op_mask, replicate_buckets
from .settings import PlannerSettings, _grad_persists, layout_collectives
from .unit_bytes import activation_scale, element_bytes, reduced_bytes, trained_params, trained_tensors

LOSS_SCALARS_BYTES = 8.0  # the loss and the gradient backward starts from: two fp32 scalars


def static_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """Bytes every plan pays: the model's buffers (whole on every rank: ``buffers``, when
    it has any), 1/N shards of params, grads and optimizer state (padded),
    and with gradient accumulation synced only at the last micro-batch, the unsharded
    gradient accumulators of every unit (grads, optimizer state and accumulators of
    trained units only: [Note: frozen units]). Units that are ``rep`` under ``settings`` hold
    all of theirs instead ([Note: rep mode]): ``replicated_*``, present only when some are."""
    n = layout_collectives(device, settings).shard_ranks
    rep = rep_op_mask(desc, settings)
    params = grads = optim = accumulators = 0.0
    r_params = r_optim = r_grads = r_copies = 0.0
    for i, op in enumerate(desc.ops):
        e = element_bytes(op)
        accumulators += reduced_bytes(op, settings)
        trained = trained_params(op)  # [Note: frozen units]
        tensors = op.param_tensors if op.trainable else 0
        if _rep_owner(desc, rep, i):
            r_params += op.param_count * e
            r_optim += trained * settings.optimizer_state_bytes_per_param \
                + tensors * settings.optimizer_state_bytes_per_tensor
            r_grads += trained * e if _grad_persists(settings) else 0.0
            if settings.param_dtype_bytes is not None and settings.param_dtype_bytes != e:
                r_copies += op.param_count * settings.param_dtype_bytes  # the kept param_dtype copy
            continue
        params += math.ceil(op.param_count / n) * e
        shard = math.ceil(trained / n)
        grads += shard * e
        optim += shard * settings.optimizer_state_bytes_per_param + tensors * settings.optimizer_state_bytes_per_tensor
    result = {
        "sharded_params": params,
        "optimizer_state": optim,
        "constant": float(device.constant_bytes) + desc.act_constant_bytes * activation_scale(desc, settings)
        + LOSS_SCALARS_BYTES,
    }
    if desc.buffer_bytes:
        result["buffers"] = float(desc.buffer_bytes)  # whole on every rank
    if settings.accumulation_steps > 1 and settings.gradient_sync == "last":
        result["grad_accumulators"] = accumulators
    if not settings.grads_set_to_none:
        result["sharded_grads"] = grads
    if rep.any():
        result.update(replicated_params=r_params, replicated_optimizer_state=r_optim)
        if r_grads:
            result["replicated_grads"] = r_grads
        if r_copies:
            result["replicated_param_copies"] = r_copies
    return result


def after_backward_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """The bytes every moment after backward's last op holds, by category: the static
    states, the loss (the activations' batch-independent part is freed with the graph)
    and, set to None between steps, every unit's sharded gradient (the rep units' are
    each moment's own)."""
    parts = {k: v for k, v in static_bytes(desc, device, settings).items() if k != "constant"}
    parts["constant"] = float(device.constant_bytes) + LOSS_SCALARS_BYTES
    if settings.grads_set_to_none:
        n = layout_collectives(device, settings).shard_ranks
        rep = rep_op_mask(desc, settings)
        parts["sharded_grads"] = float(sum(math.ceil(trained_params(op) / n) * element_bytes(op)
                                           for i, op in enumerate(desc.ops) if not rep[i]))
    return parts


def local_trained_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> list[float]:
    """Per op, the bytes of its trained parameters on this rank, the ones the optimizer
    steps: a shard, a rep unit's whole, nothing of a frozen unit ([Note: frozen units])."""
    n = layout_collectives(device, settings).shard_ranks
    rep = rep_op_mask(desc, settings)
    return [trained_params(op) * element_bytes(op) if _rep_owner(desc, rep, i)
            else math.ceil(trained_params(op) / n) * element_bytes(op)
            for i, op in enumerate(desc.ops)]


def optimizer_step_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """[Note: optimizer step moment] The bytes live while the optimizer steps, by
    category. Backward is over: no gathered weight, activation or gradient buffer is
    left, every gradient is reduced (sharded, and the rep units' whole ``.grad``), and
    AdamW makes its temporaries beside the static states:
      per_tensor  torch's for-loop AdamW (its default off CUDA) steps one parameter
                  tensor at a time: ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds
                  two copies of it while ``denom`` still holds the previous tensor's:
                  the most of 2 x a local tensor + the one before it (OpDesc.tensors,
                  in registration order, taken to follow op order; measured: three
                  4 MiB tensors step with 12 MiB of temporaries, one with 8; W&S 2x768
                  all rep, 2 x c_fc's weight + a bias, to 2 KB)
      foreach     torch's default on CUDA: ``_foreach_sqrt`` of every exp_avg_sq at
                  once: one copy of every local tensor
      none        fused AdamW: one kernel, no temporaries
      auto        unresolved (no model device seen): the larger of the first two
    A local tensor is bounded by itself and by its unit's shard (a rep unit's: all of
    it); a split op is bounded unsplit, since its slices' shards are smaller (the moment
    stays the same for every choice of the search, which checks it once). Adam with an
    L2 weight decay (not AdamW) copies each gradient too: not priced."""
    n = layout_collectives(device, settings).shard_ranks
    rep = rep_op_mask(desc, settings)
    parts = after_backward_bytes(desc, device, settings)
    local = local_trained_bytes(desc, device, settings)
    # every parameter tensor the optimizer steps, in its order (registration order,
    # which follows op order in the models OSDP describes): a tensor's local piece is at
    # most the tensor and at most its unit's shard; a frozen unit's are not stepped
    pieces = [min(numel, math.ceil(op.param_count / n)) * element_bytes(op) if not _rep_owner(desc, rep, i)
              else numel * element_bytes(op)
              for i, op in enumerate(desc.ops) for numel in trained_tensors(op)]
    rep_done = sum(_rep_grad_sizes(desc.ops[i], settings)[2] for bucket in replicate_buckets(desc, settings, rep)
                   for i in bucket)
    if rep_done:
        parts["replicated_grads"] = float(rep_done)
    # two copies of each tensor beside the previous tensor's denom
    per_tensor = max((2.0 * x + (pieces[j - 1] if j else 0.0) for j, x in enumerate(pieces)), default=0.0)
    foreach = float(sum(local))
    parts["optimizer_temporaries"] = {"per_tensor": per_tensor, "foreach": foreach, "none": 0.0,
                                      "auto": max(per_tensor, foreach)}[settings.optimizer_temporaries]
    return parts
