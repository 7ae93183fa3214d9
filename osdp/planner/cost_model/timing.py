"""Seconds: per-op compute fits, small units' shared collective latency, and per option
the compute and step time at a batch; the optimizer step's time
(docs/design/cost_model.md's [Note: time model]; [Note: coalesced latency] here)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...contract import is_small_unit
from ...schedule_rules import coalesced_groups
from ..collective_cost import latency_s
from ..model_desc import ModelDesc, OpDesc
from ..device import DeviceInfo
from .replicate import rep_is_direct, rep_op_mask
from .settings import PlannerSettings
from .static import local_trained_bytes, static_bytes
from .unit_bytes import gathered_bytes, reduced_bytes

if TYPE_CHECKING:  # annotations only: template.py imports this module
    from .template import ProblemTemplate


def shape_key(op: OpDesc) -> str:
    """Ops with equal keys cost the same compute (identical layers share a fit); a frozen
    op's backward computes less or nothing ([Note: frozen units]), so it has a key of its
    own (a trained op's key is as it was before ops could be frozen)."""
    key = f"{op.kind}:{op.param_count}:{op.flops_per_sample:.6g}:{op.act_bytes_per_sample:.6g}"
    return key if op.trainable else key + (":frozen" if op.in_backward else ":no-backward")


def split_efficiency(g: int, device: DeviceInfo) -> float:
    """Compute of a split matmul relative to the unsplit one: measured by the profiler
    (``DeviceInfo.split_efficiency``), else 1 (a fused accumulate keeps it near 1 and
    ``slice_overhead_s`` charges each extra slice's launch)."""
    if g == 1:
        return 1.0
    return float(device.split_efficiency.get(str(g), 1.0))


def _compute_fit(op: OpDesc, device: DeviceInfo, settings: PlannerSettings):
    """(forward intercept, forward per sample, backward intercept, backward per sample)
    seconds: the profile's fit, else the FLOPs at the device's rate; a backward the fit
    lacks is ``backward_compute_ratio`` forwards, half that for a frozen op (the input's
    gradient only) and none where no backward reaches ([Note: frozen units])."""
    ratio = settings.backward_compute_ratio if op.trainable else settings.backward_compute_ratio / 2
    fit = device.op_compute.get(shape_key(op))
    if fit is not None:
        f_intercept, f_slope = fit.fwd_intercept_s, fit.fwd_per_sample_s
        bi = fit.bwd_intercept_s if fit.bwd_intercept_s is not None else ratio * f_intercept
        bs = fit.bwd_per_sample_s if fit.bwd_per_sample_s is not None else ratio * f_slope
    else:
        f_intercept, f_slope = device.op_overhead_s, op.flops_per_sample / device.flops_per_s
        bi, bs = ratio * f_intercept, ratio * f_slope
    if not op.in_backward:
        bi = bs = 0.0
    return f_intercept, f_slope, bi, bs


def coalesced_latency_shares(desc: ModelDesc, settings: PlannerSettings,
                             window_bytes: float = float("inf")) -> tuple[float, float]:
    """[Note: coalesced latency] The runtime gathers small whole-module units together
    (``contract.is_small_unit``; [Note: coalesced small units] in runtime/prefetch.py):
    the next small units of the use order ride along in ONE all-gather of up to
    ``coalesce_bytes``, and their gradients are reduced together in ONE collective of up
    to ``coalesce_bytes``. So the small units share one latency per group, not one each.
    The additive model charges each small unit the fraction (groups / small units) of
    one collective's latency, groups packed in use order as the runtime packs them
    (greedy, each group closed when the next unit would overflow ``coalesce_bytes``:
    ``schedule_rules.coalesced_groups``, the runtime's ``riders`` rule with every small
    unit sharded, one dtype and level). A gather's group also fits in what the prefetch
    window ``window_bytes`` leaves beside the unit before its lead, in use while the
    group is prefetched, or in the whole window where the lead does not fit beside it
    (gathered on demand once that unit is freed); more prefetched ahead, a dtype change
    or an hpz unit's node copy only cut the runtime's groups shorter. Measured against
    the step simulation, which plays the runtime's walk: eight 4 KiB units all zdp in an
    8 KiB window gather in 7 groups each way there, where an unbounded window counted 1
    (tests/planner/test_step_sim.py). The bandwidth term stays per unit
    (``settings.coalesce_bytes``: the runtime's). Returns (gather share, reduction
    share); 1.0 when nothing is small. The share does not depend on the plan (which
    units are ``zdp`` changes which ones gather again in backward; the forward packing
    stands for both), so the objective stays additive. Splitting a unit makes its slices
    not small."""
    def share(sizes, rooms=None):
        if not sizes:
            return 1.0
        return len(coalesced_groups(sizes, coalesce_bytes, rooms)) / len(sizes)

    coalesce_bytes = settings.coalesce_bytes
    rep = rep_op_mask(desc, settings)  # rep units are never gathered: no group holds them
    gathered = [op for i, op in enumerate(desc.ops) if not op.tied_to and op.param_count and not rep[i]]
    small, rooms, in_use = [], [], 0.0
    for op in gathered:
        nbytes = gathered_bytes(op, settings)
        if is_small_unit(nbytes, coalesce_bytes, is_slice=False):
            small.append(op)
            # prefetched beside the unit in use, or (no room there) gathered on demand
            rooms.append(window_bytes - in_use if in_use + nbytes <= window_bytes else window_bytes)
        in_use = nbytes
    # a frozen unit reduces nothing: its gradient joins no group ([Note: frozen units])
    return (share([gathered_bytes(op, settings) for op in small], rooms),
            share([reduced_bytes(op, settings) for op in small if op.trainable]))


def _shared_latency_s(seconds_for, nbytes: float, latency_share: float) -> float:
    """A collective of ``nbytes`` (``seconds_for(nbytes)`` seconds) with only
    ``latency_share`` of its latency ([Note: coalesced latency]): all of it, every
    level's (a coalesced group is one collective over the shard group, across nodes
    and, under HSDP, the replicas' all-reduce of its output too). The inter-node part
    used to be left whole, "conservative": on 2 nodes of 2 ranks whose units all
    coalesce that priced an all-zdp step at 2.3x what the step simulation, which
    coalesces as the runtime does, gives it (49.1 vs 21.3 ms)."""
    seconds = seconds_for(nbytes)
    if seconds <= 0:
        return 0.0
    return max(0.0, seconds - (1.0 - latency_share) * latency_s(seconds_for))


def option_unit_uses(t: ProblemTemplate) -> np.ndarray:
    """Unit uses per option and phase: its slice count for an op that is a unit or uses
    one (a tied second use: its owner's), 0 for an op without parameters or using a
    direct rep unit (no per-use hooks, [Note: rep mode]). Once per template: every
    batch's option times read it."""
    uses = t.__dict__.get("_unit_uses")
    if uses is None:
        ops = t.desc.ops
        by_name = {op.name: op for op in ops}
        rep = t.rep if t.rep is not None else np.zeros(len(ops), dtype=bool)
        is_unit = np.array([bool(op.param_count or op.tied_to)
                            and not (rep[i] and rep_is_direct(by_name.get(op.tied_to, op), t.settings))
                            for i, op in enumerate(ops)])
        uses = t.__dict__["_unit_uses"] = np.where(is_unit[t.opt_op], t.opt_slices, 0)
        uses.setflags(write=False)  # shared by every caller
    return uses


def option_compute_s(t: ProblemTemplate, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward compute seconds of one micro-batch per option, all slices
    of the op together (the backward without a checkpoint's recompute): the fits scaled
    by the calibration's ``compute_scale`` (forward) and ``backward_compute_scale``,
    plus its ``unit_overhead_s`` per unit use (``DeviceInfo.calibration``; the defaults
    add nothing)."""
    op = t.opt_op
    cal = t.device.calibration
    comp_f = (t.fwd_intercept_s[op] + t.fwd_per_sample_s[op] * batch) * t.opt_split_eff + t.opt_split_overhead_s
    comp_b = (t.bwd_intercept_s[op] + t.bwd_per_sample_s[op] * batch) * t.opt_split_eff + t.opt_split_overhead_s
    if cal.compute_scale != 1.0 or cal.backward_compute_scale != 1.0 or cal.unit_overhead_s:
        runtime = cal.unit_overhead_s * option_unit_uses(t)
        comp_f = comp_f * cal.compute_scale + runtime
        comp_b = comp_b * cal.backward_compute_scale + runtime
    return comp_f, comp_b


def _phase_times(t: ProblemTemplate, batch: int, reduce: bool) -> np.ndarray:
    """Forward + backward time of one micro-batch per option, with or without the
    reduce-scatter of its gradients. Overlapped, a phase costs max(compute, comm) plus
    the part (1 - overlap_efficiency) of the smaller one that is not really hidden."""
    comp_f, comp_b = option_compute_s(t, batch)
    comp_b = comp_b + comp_f * t.opt_checkpointed  # recompute of a checkpointed block
    comm_b = t.opt_gather_b_s + (t.opt_reduce_b_s if reduce else 0.0)
    lost = 1.0 - t.device.calibration.overlap_efficiency
    overlapped = np.maximum(comp_f, t.opt_comm_f_s) + np.maximum(comp_b, comm_b)
    if lost:
        overlapped = overlapped + lost * (np.minimum(comp_f, t.opt_comm_f_s) + np.minimum(comp_b, comm_b))
    serial = comp_f + t.opt_comm_f_s + comp_b + comm_b
    return np.where(t.opt_overlap, overlapped, serial)


def option_times(t: ProblemTemplate, batch: int) -> np.ndarray:
    """Time of one optimizer step per option: every micro-batch of the accumulation,
    reduce-scattering after each one or only after the last (``gradient_sync``)."""
    steps = t.settings.accumulation_steps
    full = _phase_times(t, batch, reduce=True)
    if steps == 1:
        return full
    if t.settings.gradient_sync == "every":
        return steps * full
    return (steps - 1) * _phase_times(t, batch, reduce=False) + full


def optimizer_step_s(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> float:
    """AdamW reads and writes param, moments and reads grad: bandwidth bound."""
    static = static_bytes(desc, device, settings)
    # grads: as big as the params stepped (a rep unit's whole; a frozen unit's none)
    stepped = sum(local_trained_bytes(desc, device, settings))
    state = 2.0 * (stepped + static["optimizer_state"] + static.get("replicated_optimizer_state", 0.0))
    return 2.0 * state / device.memory_bandwidth_bytes_per_s


def template_optimizer_s(t: ProblemTemplate) -> float:
    """``optimizer_step_s`` of the template's model, device and settings, computed once
    per template (the batch sweep builds a problem per probe)."""
    cached = t.__dict__.get("_optimizer_step_s")
    if cached is None:
        cached = t.__dict__["_optimizer_step_s"] = optimizer_step_s(t.desc, t.device, t.settings)
    return cached
