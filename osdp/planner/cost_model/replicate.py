"""Replicated (``rep``) units: which ops use them, their all-reduce buckets, each unit's
share of its bucket's time and the bytes of their gradients by op
(docs/design/cost_model.md's [Note: rep mode])."""
from __future__ import annotations

import numpy as np

from ...contract import MAX_INFLIGHT_REPLICATE_BUCKETS, REPLICATE_BUCKET_BYTES
from ...errors import OSDPError
from ...schedule_rules import group_full, pack_buckets
from ..model_desc import ModelDesc, OpDesc
from ..device import DeviceInfo
from .settings import PlannerSettings, _accumulators_static, _grad_persists, layout_collectives
from .unit_bytes import element_bytes, reduced_bytes
from .units import unit_indices


def rep_unit_names(desc: ModelDesc, settings: PlannerSettings) -> tuple[str, ...]:
    """The units a plan under ``settings`` runs ``rep`` ([Note: rep mode]): every unit for
    policy "rep", ``settings.rep_units`` for "osdp" (checked against the model), none
    otherwise (and for "osdp" without a set: the scheduler's family fixes one per
    template)."""
    if settings.policy == "rep":
        return tuple(sorted(desc.ops[i].name for i in unit_indices(desc)))
    if settings.policy != "osdp" or not settings.rep_units:
        return ()
    units = {desc.ops[i].name for i in unit_indices(desc)}
    for name in settings.rep_units:
        if name not in units:
            op = next((o for o in desc.ops if o.name == name), None)
            why = (f"it uses the weights of {op.tied_to!r}: name that unit" if op is not None and op.tied_to else
                   "it has no parameters" if op is not None else f"model {desc.name!r} has no unit of that name")
            raise OSDPError(f"rep_units names {name!r}, which is not a unit: {why}")
    return settings.rep_units


def rep_op_mask(desc: ModelDesc, settings: PlannerSettings) -> np.ndarray:
    """Per op, whether it uses a ``rep`` unit (a tied use: its owner's)."""
    names = set(rep_unit_names(desc, settings))
    return np.array([bool(names) and (op.tied_to or op.name) in names and bool(op.param_count or op.tied_to)
                     for op in desc.ops], dtype=bool)


def rep_is_direct(op: OpDesc, settings: PlannerSettings) -> bool:
    """Whether a rep unit of ``op`` (its owner) runs direct: it computes and reduces in
    the model's dtype ([Note: direct replicated units] in osdp/runtime/direct.py)."""
    e = element_bytes(op)
    return settings.param_dtype_bytes in (None, e) and settings.reduce_dtype_bytes in (None, e)


def _rep_owner(desc: ModelDesc, rep: np.ndarray, i: int) -> bool:
    """Whether op i owns parameters of a ``rep`` unit: its own, or a tied use's bias,
    which runs its owner's mode (``plan_from_schedule``)."""
    return bool(rep[i]) and bool(desc.ops[i].param_count)


def replicate_buckets(desc: ModelDesc, settings: PlannerSettings, rep: np.ndarray) -> list[list[int]]:
    """The rep units (owner op indices) per all-reduce bucket, in issue order, as the
    runtime fills them ([Note: replicated units] in osdp/contract.py): a unit joins after
    its last use in backward (its owner op: the first in op order), a bucket is issued
    once it holds >= REPLICATE_BUCKET_BYTES; the last one at the end of backward. The
    rule is the runtime's own, ``schedule_rules.pack_buckets`` (``group_full``); the join
    order here is exact for a model whose ops run once each in op order (one bucket key:
    the planner prices one dtype pair)."""
    # a frozen unit has no gradient to all-reduce ([Note: frozen units])
    owners = [i for i in range(len(desc.ops) - 1, -1, -1) if _rep_owner(desc, rep, i) and desc.ops[i].trainable]
    return [[owners[k] for k in bucket]
            for bucket in pack_buckets([reduced_bytes(desc.ops[i], settings) for i in owners], REPLICATE_BUCKET_BYTES)]


def replicate_reduce_s(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings,
                       rep: np.ndarray) -> dict[int, float]:
    """Per rep unit (owner op index), its share of its bucket's all-reduce: its bytes at
    the all-reduce's rate plus the bucket's latency divided among the bucket's units, so
    that the shares of a bucket add up to its ``all_reduce_s`` ([Note: rep mode])."""
    latency, rate = layout_collectives(device, settings).all_reduce_terms()
    share = {}
    for bucket in replicate_buckets(desc, settings, rep):
        for i in bucket:
            share[i] = rate * reduced_bytes(desc.ops[i], settings) + latency / len(bucket)
    return share


def replicated_grads_bytes(desc: ModelDesc, settings: PlannerSettings, rep: np.ndarray) -> np.ndarray:
    """Per op j, bytes of the rep units' gradients alive there after their backward
    (their last use after j): the buffers of the bucket being filled, those of the
    buckets in flight with their staging copies (and a ``.grad`` made at the end when it
    is not the buffer itself), the ``.grad`` of finished buckets; see [Note: rep mode]."""
    alive = np.zeros(len(desc.ops))
    buckets = replicate_buckets(desc, settings, rep)
    if not buckets:
        return alive
    per = {i: _rep_grad_sizes(desc.ops[i], settings) for bucket in buckets for i in bucket}
    # a full bucket is issued after the backward of its last unit; the rest at the end
    full = [group_full(sum(reduced_bytes(desc.ops[i], settings) for i in b), REPLICATE_BUCKET_BYTES) for b in buckets]
    done = np.concatenate(([0.0], np.cumsum([sum(per[i][2] for i in b) for b in buckets])))
    flight = np.concatenate(([0.0], np.cumsum([sum(per[i][1] for i in b) for b in buckets])))
    bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
    issued, filling = 0, 0.0  # buckets issued before op j's backward; buffers of the one filling
    for j in range(len(desc.ops) - 1, -1, -1):
        u = j + 1  # its backward done before op j's: joined
        if u in bucket_of:
            k = bucket_of[u]
            filling += per[u][0]
            if full[k] and buckets[k][-1] == u:
                issued, filling = k + 1, 0.0
        oldest = max(0, issued - MAX_INFLIGHT_REPLICATE_BUCKETS)
        alive[j] = done[oldest] + (flight[issued] - flight[oldest]) + filling
    return alive


def replicated_grads_at_end(desc: ModelDesc, settings: PlannerSettings, rep: np.ndarray) -> tuple[float, float]:
    """The rep units' gradient bytes when backward ends ([Note: end of backward moment] in
    end_of_backward.py), as ``replicated_grads_bytes`` counts them: before the last bucket is
    issued (its buffers filling unless it filled up at its last unit's backward) and
    once it is (issuing waits for the oldest beyond MAX_INFLIGHT_REPLICATE_BUCKETS,
    then the staging copy is made)."""
    buckets = replicate_buckets(desc, settings, rep)
    if not buckets:
        return 0.0, 0.0
    per = {i: _rep_grad_sizes(desc.ops[i], settings) for bucket in buckets for i in bucket}
    sizes = [[sum(per[i][f] for i in bucket) for f in range(3)] for bucket in buckets]  # buffer, flight, done

    def alive(issued: int, filling: float) -> float:
        oldest = max(0, issued - MAX_INFLIGHT_REPLICATE_BUCKETS)
        return sum(s[2] for s in sizes[:oldest]) + sum(s[1] for s in sizes[oldest:issued]) + filling

    last_full = group_full(sum(reduced_bytes(desc.ops[i], settings) for i in buckets[-1]), REPLICATE_BUCKET_BYTES)
    before = alive(len(buckets), 0.0) if last_full else alive(len(buckets) - 1, sizes[-1][0])
    return before, alive(len(buckets), 0.0)


def _rep_grad_sizes(op: OpDesc, settings: PlannerSettings) -> tuple[float, float, float]:
    """A rep unit's gradient bytes: (its buffer while the bucket fills, buffer + staging
    + a new ``.grad`` while the bucket is in flight, its ``.grad`` once the bucket is done)."""
    persists, static_buffers = _grad_persists(settings), _accumulators_static(settings)
    grad, param = reduced_bytes(op, settings), float(op.param_bytes)
    # a direct unit's buffer is .grad: static where .grad persists (autograd adds into it)
    buffer = 0.0 if static_buffers or (persists and rep_is_direct(op, settings)) else grad
    new_grad = param if not persists and grad != param else 0.0  # .grad apart from the buffer
    done = 0.0 if persists else (param if grad != param else buffer)
    return buffer, buffer + grad + new_grad, done
