"""A concrete plan's live bytes at every op, with the gathers the runtime really holds
there (``exact_transients``: [Note: exact gathers], here; docs/design/cost_model.md's
[Note: memory model] and [Note: the hook moment])."""
from __future__ import annotations

import math

import numpy as np

from ...errors import OSDPError
from ..step_sim import gathered_at_compute
from .options import _option_rows, _rows_key, pending_reduce_bytes
from .prefetch import _ahead_bytes, _staged_ahead
from .problem import _local_moments
from .settings import layout_collectives
from .template import ProblemTemplate
from .timing import coalesced_latency_shares
from .unit_bytes import element_bytes, gathered_bytes, reduced_bytes, trained_params
from .units import _group_of, tied_groups


def exact_transients(t: ProblemTemplate, batch: int, option_index, variant) -> tuple[np.ndarray, np.ndarray]:
    """[Note: exact gathers] Per op, its chosen option's transient bytes (the larger of
    its forward and backward moments beyond the prefix) with the gathers the runtime
    really holds there, for this one plan, and the part of them its own released
    activations offset ([Note: the hook moment]).
    The search prices every op's gathers by the window's bound, the same for any choice
    of the ops around it: ``min(window, own + the bytes the next ops could gather)``.
    The runtime prefetches whole units, skips the ones kept (``dp``) or replicated, and
    stops at the first that does not fit, so a plan's neighbours can leave the window
    nearly empty: all-dp plans measured 5.4-6% under that bound (bench/fidelity.py), a
    small GPT's head 1 MiB under it at a 28 MiB budget (tests/runtime/test_peak.py).
    A concrete plan's gathers are known: ``step_sim.gathered_at_compute`` plays the
    runtime's prefetch rules (window, skips, coalesced riders, recompute) and gives the
    gathered bytes at every op's (slice's) forward and backward compute; less the dp
    bytes the prefix already holds there, they replace the bound in the same moment
    formulas (``_option_rows``). A backward moment takes the larger of the gathers at
    its compute and those right after it: the hook that frees the op's weights
    prefetches the next units while the op's dW, its buffer and the reduction's output
    are still live (64 fake ranks, a small GPT's head under a 3 MiB window: 2.4 MB of
    prefetches beside its 4 MiB of gradients, 0.56% over the prediction when only the
    compute moment was priced: tests/runtime/test_peak.py). The search keeps the bound
    (it cannot see the neighbours), so a plan it calls feasible is feasible here too;
    ``evaluate`` prices the plan it returns with these."""
    at = gathered_at_compute(t, batch, option_index, variant)
    desc, device, settings = t.desc, t.device, t.settings
    window = t.window_bytes
    after, before = _ahead_bytes(desc, window, settings)
    staged_f, staged_b = _staged_ahead(desc, window, settings, device.world_size)
    shares = coalesced_latency_shares(desc, settings, window)
    pending, issued, flight_out = pending_reduce_bytes(desc, device, settings, t.rep)
    per_node = layout_collectives(device, settings).per_node
    checkpointed_at = {}  # per op, whether its segment runs checkpointed in this plan
    for s, seg in enumerate(t.segments):
        for i in seg.ops:
            checkpointed_at.setdefault(i, seg.variants[int(variant[s])])
    out = np.array([t.opt_transient_bytes[o] for o in option_index], dtype=float)
    release = np.array([t.opt_release_bytes[o] for o in option_index], dtype=float)
    kept = 0.0  # dp bytes the prefix holds (an hpz slice's node copy is not a gather)
    owners = {group[0] for group in tied_groups(desc)}
    rows_of: dict[tuple, tuple] = {}  # identical layers with the same gathers: one row
    for i, o in enumerate(option_index):
        g, k, h = t.shape(o)
        owner = desc.ops[_group_of(desc, i)[0]]
        kept += t.opt_held_bytes[o] - (h * gathered_bytes(owner, settings) / g / per_node if h else 0.0)
        if t.rep is not None and t.rep[i]:
            continue  # never gathered
        steps = g if ("forward", i, g - 1) in at and g > 1 else 1
        fwd = max(at.get(("forward", i, j), 0.0) for j in range(steps)) - kept
        bwd = [max(at.get((phase, i, min(j, steps - 1)), 0.0) for phase in ("backward", "after backward")) - kept
               for j in range(g)]
        staged = (staged_f[i], staged_b[i])
        key = _rows_key(desc, i, owners, checkpointed_at[i], after[i], before[i], pending[i], issued[i],
                        flight_out[i], staged) + (g, k, h, fwd, tuple(bwd))
        row = rows_of.get(key)
        if row is None:
            rows = _option_rows(desc, i, device, settings, checkpointed_at[i], window, after[i], before[i], shares,
                                pending[i], issued[i], flight_out[i], exact=(fwd, bwd), only=(g, k, h),
                                staged=staged)
            row = rows_of[key] = next(row for row in rows if (row.slices, row.zdp, row.hpz) == (g, k, h))
        out[i], release[i] = row.transient_bytes, row.release_bytes
    return out, release


def live_memory(template: ProblemTemplate, batch: int, option_index, variant,
                exact: bool = True) -> list[tuple[int, dict]]:
    """Per op, the live bytes by category at that op (the larger of its forward and
    backward, as the model counts them), in exact bytes. Validates the assignment.
    ``exact``: the plan's own gathers ([Note: exact gathers]); False: the window's bound,
    as the search prices them."""
    t = template
    act = t.act_per_sample * batch
    static_parts = {
        "sharded_states": sum(t.static.get(k, 0.0) for k in ("sharded_params", "sharded_grads", "optimizer_state")),
        "constant": t.static["constant"],
    }
    if "buffers" in t.static:
        static_parts["buffers"] = t.static["buffers"]
    replicated = [k for k in t.static if k.startswith("replicated_")]
    if replicated:  # [Note: rep mode]
        static_parts["replicated_states"] = sum(t.static[k] for k in replicated)
    if "grad_accumulators" in t.static:
        static_parts["grad_accumulators"] = t.static["grad_accumulators"]
    held_prefix = act_prefix = 0.0
    own_bytes, loss_bytes = _local_moments(t, batch)
    option_index = [int(o) for o in option_index]
    variant_of = {}  # per op, its segment's variant (the first segment holding it)
    for s, seg in enumerate(t.segments):
        for i in seg.ops:
            variant_of.setdefault(i, int(variant[s]))
    for i, o in enumerate(option_index):
        v = variant_of[i]
        if not (t.opt_begin[i, v] <= o < t.opt_end[i, v]):
            raise OSDPError(f"option {o} is not an option of op {t.desc.ops[i].name!r} in variant {v}")
    bound, bound_release = t.opt_transient_bytes[option_index], t.opt_release_bytes[option_index]
    transient, release = exact_transients(t, batch, option_index, variant) if exact else (bound, bound_release)
    # its own activations released at the hook ([Note: the hook moment])
    own_released = np.minimum(release, act)
    # the exact gathers change the op's own moment, not the loss's before it
    own_bytes = own_bytes[option_index] + (transient - bound) - (own_released - np.minimum(bound_release, act))
    loss_bytes = loss_bytes[option_index]
    rows = []
    for s, seg in enumerate(t.segments):
        v = variant[s]
        checkpointed = seg.variants[v]
        inside = 0.0
        kept = seg.input_bytes_per_sample * batch if checkpointed else 0.0
        for i in seg.ops:
            o = option_index[i]
            if not (t.opt_begin[i, v] <= o < t.opt_end[i, v]):
                raise OSDPError(f"option {o} is not an option of op {t.desc.ops[i].name!r} in variant {v}")
            held_prefix += t.opt_held_bytes[o]
            # [Note: checkpointed block input]
            inside += act[i] - (t.act_block_input_per_sample[i] * batch if checkpointed else 0.0)
            # [Note: the hook moment]: at the hook, its activations are gone and the
            # buffers all there; if they outweigh what the hook adds, the peak is in the
            # node, before the hook's buffers
            at_hook = own_released[i] < release[i]
            parts = {
                **static_parts,
                "kept_dp_weights": float(held_prefix),
                "saved_activations": float(act_prefix + kept + inside - (own_released[i] if at_hook else 0.0)),
                "in_flight_and_grad_buffers": float(transient[i] - (0.0 if at_hook else own_released[i])),
                "activation_grads": float(t.act_grad_per_sample[i] * batch),
                "sharded_grads_so_far": float(t.grads_after[i]),
            }
            if t.tied_grads[i]:
                parts["tied_unsharded_grads"] = float(t.tied_grads[i])
            if t.rep_grads is not None and t.rep_grads[i]:
                parts["replicated_grads"] = float(t.rep_grads[i])
            logits_grads = float(t.opt_logits_grad_per_sample[o] * batch)
            if logits_grads and exact and t.opt_slices[o] == 1 and len(_group_of(t.desc, i)) == 1:
                # an unsplit head's logits gradient is released with its backward node,
                # before the hook copies dW into the unit's buffer and issues its
                # reduce-scatter: the two are live at different moments (measured: 64
                # ranks, a 2 MiB dp head, 1 MiB over without this)
                op = t.desc.ops[i]
                n = layout_collectives(t.device, t.settings).shard_ranks
                buffer = reduced_bytes(op, t.settings) + math.ceil(trained_params(op) / n) * element_bytes(op)
                released = min(logits_grads, buffer)
                logits_grads -= released
                own_bytes[i] -= released
            # the larger moment is picked after the release: compared before it, the
            # head's own moment hid a larger loss moment (N&D 12x128 all zdp at batch 4:
            # measured 45.51 MiB at nll_loss_backward, predicted 44.79 at the head)
            if loss_bytes[i] > own_bytes[i]:  # the loss's backward, before the head's: nothing of the op's own
                parts.update(in_flight_and_grad_buffers=0.0, activation_grads=0.0,
                             saved_activations=float(act_prefix + kept + inside))
                parts["logits_and_grads"] = float(loss_bytes[i])
            elif logits_grads:
                parts["logits_and_grads"] = logits_grads
            rows.append((i, parts))
        act_prefix += kept if checkpointed else inside
    return rows


# [Note: checkpointed block input]
# A checkpointed block keeps its input through the step (``input_bytes_per_sample``) and
# recomputes its saved activations in its backward. The first op of a transformer block
# (its LayerNorm) saves the block's input itself: the recompute saves the SAME tensor the
# checkpoint kept, so within a checkpointed block an op's activations count without the
# bytes that are its block's input (``OpDesc.block_input_bytes_per_sample``, measured by
# describe as saved storages that are the block's input). Not checkpointed, that tensor is
# the op's own saved input and counts as before. Measured (N&D 12x128, all zdp, every
# block checkpointed, batch 12, fake 2-rank group): the peak at blocks.11.mlp.c_proj's
# backward was predicted 31734112 B against 31157340 measured (+1.85%) counting it twice.
