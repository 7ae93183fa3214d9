"""An op's option rows: per (slices, zdp, hpz) choice its kept and transient bytes, its
collective seconds and its per-sample logits terms (``OptionRow``), and the gradient
reductions pending beside each op's backward. Explained by docs/design/cost_model.md's
[Note: memory model], [Note: time model], [Note: hpz mode], [Note: tied weights],
[Note: the hook moment], [Note: fused vocabulary-split loss] and [Note: rep mode];
[Note: pending reduction] and [Note: split backward moments] are here."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ...contract import is_small_unit
from ..model_desc import ModelDesc
from ..device import DeviceInfo
from .prefetch import _forward_prefetch
from .replicate import rep_is_direct, rep_op_mask
from .settings import PlannerSettings, _accumulators_static, layout_collectives, reshard_choices, slice_choices
from .timing import _shared_latency_s, split_efficiency
from .unit_bytes import element_bytes, fused_logits_bytes, gathered_bytes, reduced_bytes, trained_params
from .units import _group_of, backward_needs_weights, tied_groups


class OptionRow(NamedTuple):
    """One option of one op: its entry in each of the template's ``opt_<field>`` arrays."""

    slices: int  # g: the unit cut into g slices
    zdp: int  # k of them resharded after forward, gathered again in backward
    hpz: int  # h of them keeping a copy sharded within the node ([Note: hpz mode])
    held_bytes: float  # kept weights, from its forward to its backward
    transient_bytes: float  # its gathers and gradient buffers at its busiest moment
    comm_f_s: float  # forward all-gathers
    gather_b_s: float  # backward all-gathers, a checkpoint's recompute included
    reduce_b_s: float  # backward gradient reductions
    overlap: bool  # its slice and the next unit both fit in the window: comm hides behind compute
    split_overhead_s: float  # (g - 1) extra slice launches
    split_eff: float  # split compute relative to unsplit
    # per sample, a vocabulary head's terms ([Note: fused vocabulary-split loss]): saved
    # logits, the loss's backward transients before the head's, logits grads inside it
    logits_per_sample: float
    loss_grad_per_sample: float
    logits_grad_per_sample: float
    release_bytes: float  # of the transient, what its own saved activations offset ([Note: the hook moment])


def _rep_row(desc, i, settings, window, after_i, before_i, reduce_s, pending, staged=(0.0, 0.0)) -> OptionRow:
    """The one option of an op using a ``rep`` unit ([Note: rep mode]): unsplit, nothing
    gathered or kept; ``reduce_s`` its share of its bucket's all-reduce (charged at the
    owner, the last use in backward; a tied use's: its own bias's, if any); ``pending``:
    a sharded unit's gradient that may still be reduce-scattering beside it."""
    group = _group_of(desc, i)
    owner = desc.ops[group[0]]
    logits = fused_logits_bytes(desc, i)
    own_buffer = len(group) == 1 and not _accumulators_static(settings) and not rep_is_direct(owner, settings)
    own_grad = reduced_bytes(owner, settings) if own_buffer else 0.0
    # others' gathers prefetched around it; its own gradient buffer (a tied unit's:
    # tied_grads) and one pending reduce-scatter
    # unsplit: autograd's gradient is live while the hook copies it in (_grads_live); a
    # direct unit's is not copied, it becomes .grad
    ahead_f, ahead_b = min(window, after_i), min(window, before_i)  # plus their staging (_staged_ahead)
    transient = max(ahead_f + min(ahead_f, staged[0]),
                    ahead_b + min(ahead_b, staged[1]) + own_grad + gathered_bytes(owner, settings) + pending)
    return OptionRow(slices=1, zdp=0, hpz=0, held_bytes=0.0, transient_bytes=transient, comm_f_s=0.0, gather_b_s=0.0,
                     reduce_b_s=reduce_s, overlap=True, split_overhead_s=0.0, split_eff=1.0, logits_per_sample=logits,
                     loss_grad_per_sample=2.0 * logits, logits_grad_per_sample=logits, release_bytes=0.0)


def pending_reduce_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings,
                         rep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[Note: pending reduction] Per op, (the unsharded gradient bytes of other units that
    are live while the op's backward runs, the sharded outputs the reduce-scatter issued
    at its backward allocates).
    Pending: the one reduction the runtime keeps in flight (MAX_INFLIGHT_REDUCE_SCATTERS
    = 1; runtime/reduce.py's [Note: unsharded gradients]), the last issued before this
    op's backward, and the small units' gradients waiting to be reduced together ([Note:
    coalesced reductions]). Played in backward order as the runtime groups them: a unit
    that reduces alone is in flight whole (its slices, if split, are no larger); a small
    one (a tied one too, at its owner's use) waits until the waiting ones reach
    ``coalesce_bytes``, then they are in flight as one group. The search never splits a
    small unit (``slice_choices``), so the groups are the same for every plan it prices;
    a plan made by hand that splits one is priced as if it were whole (its slices would
    reduce alone and the groups close later). Rep units reduce in their own buckets.
    Outputs: ``GradReducer._issue`` allocates every output of the reduce-scatter it
    issues, then waits for the one in flight, with the op's own gradient and autograd's
    still live: its own shard (unsplit; a split op's slices are priced by
    ``_split_backward_bytes``), and when it completes a group of small units, theirs too
    (measured: three 4 MiB Linears in zdp on 2 ranks peaked 2 MiB, one shard, over the
    model without it). Where gradients persist between steps (``grads_set_to_none``
    False) an output is added into ``.grad`` and freed when its reduction is waited
    for, so the one in flight is counted too; set to None, it becomes the sharded
    gradient ``sharded_grads_after`` counts. A group's reduce-scatter makes two copies
    beside its gradients when it is issued and holds them, not the gradients, until it is
    waited for (``_coalesced_copies``); the small units still waiting when backward ends
    are reduced then ([Note: end of backward moment] in end_of_backward.py).
    Returns (pending, outputs, in-flight outputs not counted elsewhere: a split op's
    first slice meets them)."""
    walk = reduction_walk(desc, device, settings, rep)
    return walk.pending, walk.outputs, walk.flight_out


class ReductionsAtEnd(NamedTuple):
    """The sharded units' reductions when backward's last op is done: the one in flight
    (its gradients and copies, and its sharded outputs) at its smallest, its op split
    into the most slices it may have (only its last slice is then in flight), and the
    small units' gradients still waiting with their sharded outputs
    (``pending_reduce_bytes``)."""

    in_flight: float
    in_flight_out: float
    waiting: float
    waiting_out: float


class ReductionWalk(NamedTuple):
    pending: np.ndarray  # pending_reduce_bytes's three
    outputs: np.ndarray
    flight_out: np.ndarray
    sharded_outputs: np.ndarray  # per op, the sharded outputs its backward's reduction allocates (a group's all)
    end: ReductionsAtEnd


def reduction_walk(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings, rep: np.ndarray) -> ReductionWalk:
    """The reductions of the sharded units' gradients played in backward order
    ([Note: pending reduction])."""
    n = layout_collectives(device, settings).shard_ranks
    persist = not settings.grads_set_to_none
    pending, outputs, flight_out, sharded_outputs = (np.zeros(len(desc.ops)) for _ in range(4))
    owners = {group[0] for group in tied_groups(desc)}
    in_flight, in_flight_out, waiting, waiting_out = 0.0, 0.0, 0.0, 0.0
    least = 1  # the slices the op of the reduction in flight may have at most
    for i in range(len(desc.ops) - 1, -1, -1):
        pending[i] = in_flight + waiting
        flight_out[i] = in_flight_out if persist else 0.0
        op = desc.ops[i]
        if not trained_params(op) or rep[i] or (op.tied_to and i not in owners):
            continue  # no reduction of its own issued here (a frozen unit has none)
        grad = reduced_bytes(op, settings)
        out = math.ceil(op.param_count / n) * element_bytes(op)
        copies, slices = 0.0, 1 if i in owners else max(slice_choices(op, settings))
        # a small tied unit joins the group too: the runtime coalesces every whole small
        # unit (prefetch.mark_coalescible), and the search leaves small units whole
        if is_small_unit(gathered_bytes(op, settings), settings.coalesce_bytes, is_slice=False):
            waiting, waiting_out = waiting + grad, waiting_out + out
            if waiting < settings.coalesce_bytes:
                continue
            grad, out, waiting, waiting_out = waiting, waiting_out, 0.0, 0.0
            copies, slices = _coalesced_copies(grad, out, n), 1
        outputs[i] = out + flight_out[i] + copies
        sharded_outputs[i] = out
        # a group in flight holds its copies, its gradients dropped once they are made
        in_flight, in_flight_out, least = copies or grad, out, slices
    end = ReductionsAtEnd(in_flight / least, in_flight_out / least, waiting, waiting_out)
    return ReductionWalk(pending, outputs, flight_out, sharded_outputs, end)


def sharded_grads_after(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> np.ndarray:
    """Per op i, bytes of the sharded gradients alive while op i runs: with gradients
    set to None between steps, the outputs of the reductions issued before its backward,
    by the ops after it (a small unit's once its group is issued: before, its
    gradient waits unsharded, which ``pending`` counts)."""
    if not settings.grads_set_to_none:
        return np.zeros(len(desc.ops))
    issued = reduction_walk(desc, device, settings, rep_op_mask(desc, settings)).sharded_outputs
    return np.concatenate((np.cumsum(issued[::-1])[::-1][1:], [0.0]))


def _coalesced_copies(grads: float, outputs: float, shard_ranks: int) -> float:
    """Bytes a coalesced reduce-scatter of ``grads`` (sharded outputs ``outputs``) makes
    beside the gradients and holds until it is waited for: their rank-major
    concatenation and the collective's output, copied into each unit's afterwards
    (``CommContext.reduce_scatter_coalesced``); nothing on one rank."""
    return grads + outputs if shard_ranks > 1 else 0.0


def _option_rows(desc, i, device, settings, checkpointed, window, after_i, before_i,
                 shares=(1.0, 1.0), pending=0.0, issued=0.0, flight_out=0.0, exact=None,
                 only=None, staged=(0.0, 0.0)) -> list[OptionRow]:
    """The ``OptionRow`` of every option of op ``i`` (docs/design/cost_model.md's [Note:
    time model], [Note: memory model], [Note: hpz mode] and [Note: tied weights]). ``shares``: the latency
    shares of small units ([Note: coalesced latency]); ``pending``: the gradient bytes
    that may still be reducing beside its backward, ``issued``: the sharded outputs its
    unsplit backward's reduce-scatter allocates, ``flight_out``: those of the one in
    flight before it where nothing else counts them ([Note: pending reduction]).
    ``exact``: a concrete plan's gathered bytes beyond the kept prefix, ``(forward,
    [backward per slice j])``, in place of the window's bound ([Note: exact gathers]).
    ``only``: a (g, k, h) whose row alone is wanted (pricing one plan: the other rows'
    slice-by-slice backward made ``exact_transients`` the planner's largest cost).
    ``staged``: the staging buffers of coalesced gathers ahead, forward and backward
    (``prefetch._staged_ahead``), which the bound adds to its prefetches."""
    coll = layout_collectives(device, settings)
    group = _group_of(desc, i)
    owner = desc.ops[group[0]]
    last = i == len(desc.ops) - 1
    full_grad = reduced_bytes(owner, settings)
    logits = fused_logits_bytes(desc, i)
    rows = []
    splittable = all(desc.ops[j].splittable for j in group)
    for g in slice_choices(owner, settings) if splittable else (1,):
        if only is not None and g != only[0]:
            continue
        ex = exact if exact is not None and len(exact[1]) == g else None  # the plan's g only
        needs = [backward_needs_weights(desc.ops[j], g) for j in group]
        # dp slices are kept by the first use that reads them in backward, until the end
        keeper = next((j for j, need in zip(group, needs) if need), None)
        weights_b = needs[group.index(i)]
        s = gathered_bytes(owner, settings) / g
        ag, ag_node = coll.gather_s(s), coll.node_gather_s(s)
        grad = full_grad / g
        # one slice's sharded gradient: its reduce-scatter's output
        reduced_slice = math.ceil(trained_params(owner) / g / coll.shard_ranks) * element_bytes(owner)
        grad_s = coll.grad_s(grad)
        if len(group) == 1 and is_small_unit(s, settings.coalesce_bytes, is_slice=g > 1):
            ag = _shared_latency_s(coll.gather_s, s, shares[0])
            ag_node = _shared_latency_s(coll.node_gather_s, s, shares[0])  # an hpz unit's, grouped per level
            grad_s = _shared_latency_s(coll.grad_s, grad, shares[1])
        # hpz needs a backward that reads the weights; a tied unit's uses share plain
        # dp/zdp modes (tied_choices enumerates (g, k) only)
        choices = reshard_choices(g, settings, coll.hpz_available and len(group) == 1 and weights_b)
        if len(group) == 1 and not weights_b:
            choices = ((g, 0),)  # no weights in backward: dp and zdp slices are both freed after forward
        for k, h in choices:
            if only is not None and (k, h) != only[1:]:
                continue
            held = ((g - k - h) * s + h * s / coll.per_node) if keeper == i else 0.0
            # a use gathers what no earlier use keeps; in backward, its zdp / hpz slices
            gathered_f = k if keeper is not None and keeper < i else g
            regather_b = (k * ag + h * ag_node) if weights_b else 0.0
            recompute = (regather_b if weights_b else g * ag) if checkpointed else 0.0
            comm_f = gathered_f * ag
            gather_b = regather_b + recompute
            # gradients are reduced after the last use in backward: the first in op order
            reduce_b = g * grad_s if i == group[0] and owner.trainable else 0.0
            # forward: its gathered slice, unless the prefix holds it already (a dp slice
            # of this keeper: then only a zdp / hpz slice's moment adds it)
            own_f = s if gathered_f and (keeper != i or k + h > 0) else 0.0
            # the window also prefetches its own later slices (whole units of their own)
            prefetch_f = _forward_prefetch(s, window, after_i + (gathered_f - 1) * s * (gathered_f > 0))
            gathers_f = own_f + prefetch_f + min(prefetch_f, staged[0]) if ex is None else ex[0]
            if g > 1 and len(group) == 1:
                backward = _split_backward_bytes(s, g, k + h, weights_b, window, before_i, grad, pending,
                                                 reduced_slice, None if settings.grads_set_to_none else flight_out,
                                                 None if ex is None else ex[1], staged[1])
            else:
                own_b = s if (weights_b and k + h > 0) else 0.0
                gathers_b = _backward_gathers(own_b, 0.0, window, before_i, staged[1])
                if ex is not None:
                    gathers_b = ex[1][0]
                backward = gathers_b + _grads_live(grad, untied=len(group) == 1, pending=pending,
                                                   autograd=s if g == 1 and owner.trainable else 0.0) + issued
            transient = max(gathers_f, backward)
            release = 0.0
            if g == 1 and len(group) == 1 and logits == 0 and not _accumulators_static(settings):
                # [Note: the hook moment]: the buffer and the reduce-scatter's output
                # come after autograd's node, whose saved activations are gone by then;
                # after the copy autograd's dW (s) is gone too
                release = max(0.0, min(grad + issued, s, backward - gathers_f))
            # [Note: fused vocabulary-split loss]: split, the head never holds the logits;
            # unsplit, the loss's backward (3 L) comes before the head's (L of it left)
            fused = g > 1 and logits > 0
            logits_saved = 0.0 if fused else logits
            loss_grads = 0.0 if fused else 2.0 * logits
            if not fused and last:  # the loss's moment as describe measured it ([Note: the loss's moment])
                loss_grads = max(loss_grads, desc.loss_bytes_per_sample - logits_saved)
            logits_grads = 2.0 * logits / g if fused else logits
            rows.append(OptionRow(slices=g, zdp=k, hpz=h, held_bytes=held, transient_bytes=transient, comm_f_s=comm_f,
                                  gather_b_s=gather_b, reduce_b_s=reduce_b, overlap=2 * s <= window,
                                  split_overhead_s=(g - 1) * device.slice_overhead_s,
                                  split_eff=split_efficiency(g, device), logits_per_sample=logits_saved,
                                  loss_grad_per_sample=loss_grads, logits_grad_per_sample=logits_grads,
                                  release_bytes=release))
    return rows


def _backward_gathers(own: float, ahead: float, window: float, before_i: float, staged: float) -> float:
    """The window's bound on the gathered bytes beside a backward use that gathers
    ``own`` ([Note: prefetch bounds]), the larger of two moments, both with its
    gradient live: its compute, where the window was filled at the previous use's
    release, so only a gather of its own larger than the window leaves no room (a kept
    dp weight is not in the window, whatever its size: measured by the step simulation,
    a 2-slice dp head over a 1760 B window prefetched 1720 B beside its second slice,
    which a bound of nothing let the search count 1.6 KB short); and its own release,
    which refills the window. ``ahead``: its own slices it reaches next, ``before_i``
    the ops before it, ``staged`` the staging buffers of coalesced gathers among them
    (``prefetch._staged_ahead``), live beside their gathers until the first wait."""
    at_compute = own if own > window else min(window, own + ahead + before_i)
    after_release = min(window, ahead + before_i)
    return max(at_compute + min(at_compute - own, staged), after_release + min(after_release, staged))


def _grads_live(grad: float, untied: bool, pending: float, autograd: float) -> float:
    """Unsharded gradient bytes live during the backward of an unsplit op or of a tied
    unit's use, ``grad`` being its gradient ([Note: pending reduction]): the unit's buffer
    (a tied unit's is summed over its uses first: ``tied_grads_bytes``), the one
    reduction in flight and ``autograd``: unsplit, the gradient autograd made (in the
    compute dtype), which the runtime's hook copies into that buffer, both live during
    the copy."""
    return autograd + (grad if untied else 0.0) + pending


def _split_backward_bytes(s: float, g: int, resharded: int, weights_b: bool, window: float,
                          before_i: float, grad: float, pending: float, reduced_slice: float,
                          persist_flight_out: float | None = None, exact_gathers=None, staged: float = 0.0) -> float:
    """[Note: split backward moments] Bytes a split (untied) op adds at its busiest
    backward moment, beyond the prefix, the larger over its slices j = g-1 .. 0 in the
    order backward runs them, each at the issue of its reduce-scatter (the runtime
    allocates the output, then waits for the one in flight: runtime/reduce.py):
      gathers    its weights if slice j is resharded (the first ``resharded`` slices:
                 planner.py orders a unit's modes zdp, hpz, dp) and backward reads them,
                 and the window's prefetch around it (as unsplit)
      gradients  slice j's buffer, the reduction in flight (``pending`` for the first
                 slice, else slice j+1's buffer) and the op's sharded gradient, all g
                 slices' outputs (``reduced_slice`` each): the first reduction allocates
                 it whole, each slice's writes its part ([Note: split parameters] in
                 runtime/split_params.py);
                 where gradients persist (``persist_flight_out`` given) an output is
                 freed once reduced: its own and the one in flight (slice j+1's, or
                 ``persist_flight_out`` before the first)
    ``exact_gathers[j]``: a concrete plan's gathered bytes beyond the kept prefix at
    slice j's backward ([Note: exact gathers]), released dp slices included; ``staged``:
    as for ``_backward_gathers``.
    It writes its dW into the buffer itself (osdp/ops/matmul_split.py): no autograd
    copy. Measured (I&C 6x128-512 at batch 14, a 4 MiB c_proj in 4 zdp slices on 2
    ranks): 2 MiB of outputs beside the two 1 MiB buffers, predicted to 0.02%.
    Not subtracted, a known over-bound: the dp slices after j, which the runtime frees
    after their backward while the prefix still counts them (W&S 2x768, 2 dp + 2 zdp
    slices: +2.6%). Subtracting them let the search pick plans where the window's
    fractional fill (the runtime prefetches whole units and stops at the first that
    does not fit) over-counts a further 1 MiB, 5.4% over at a small GPT's split head
    (tests/runtime/test_peak.py): both need the neighbours' choices, which the per-op
    search does not see."""
    worst = 0.0
    for j in range(g - 1, -1, -1):
        own = s if weights_b and j < resharded else 0.0
        # what backward reaches next: its resharded slices below j, then the ops before
        ahead = min(j, resharded) * s if weights_b else 0.0
        gathers = _backward_gathers(own, ahead, window, before_i, staged)
        in_flight = pending if j == g - 1 else grad
        if persist_flight_out is None:
            outputs = g * reduced_slice
        else:
            outputs = reduced_slice + (persist_flight_out if j == g - 1 else reduced_slice)
        # its dp slices after j were freed after their own backward (the prefix holds them)
        released = max(0, g - max(j + 1, resharded)) * s if weights_b else 0.0
        if exact_gathers is not None:
            gathers, released = exact_gathers[j], 0.0
        worst = max(worst, gathers + grad + in_flight + outputs - released)
    return worst


def _rows_key(desc: ModelDesc, i: int, owners, checkpointed, *moment_terms) -> tuple:
    """What op ``i``'s option rows depend on besides the template's own settings: its
    sizes and split op (its name when it is tied, owns a tied unit or is a fused head),
    whether it is checkpointed, and its ``_option_rows`` byte terms (``moment_terms``).
    Identical layers share one key, so their rows are computed once."""
    op = desc.ops[i]
    special = op.tied_to or i in owners or fused_logits_bytes(desc, i) > 0 or i == len(desc.ops) - 1
    sizes = (op.name,) if special else (op.param_count, op.param_bytes, op.splittable, op.in_features, op.split_op)
    return sizes + (checkpointed,) + tuple(moment_terms)
