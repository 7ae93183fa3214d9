"""The search's problem at one batch size: per option its time and the bytes it adds at
its busiest moment, and the activations each segment holds (search_problem.py's [Note:
the memory constraint]; docs/design/cost_model.md's [Note: memory model])."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import OSDPError
from ..search_problem import SearchProblem
from .end_of_backward import after_ops_moments
from .timing import option_times, template_optimizer_s

if TYPE_CHECKING:  # annotations only: template.py imports this module
    from .template import ProblemTemplate


def _local_moments(t: ProblemTemplate, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per option, bytes local to its op at its own busiest moment (gathers, gradient
    buffers, activation gradients, logits gradients inside the head's backward) and in
    the loss's backward before it (saved log-probabilities and their gradients: [Note:
    fused vocabulary-split loss]; 0 for every op but an unsplit head). At the backward
    hook of an unsplit op its own saved activations are released ([Note: the hook
    moment]): they offset up to ``opt_release_bytes`` of its transient."""
    released = np.minimum(t.opt_release_bytes, t.act_per_sample[t.opt_op] * batch)
    own = t.opt_transient_bytes - released + (t.act_grad_per_sample[t.opt_op] + t.opt_logits_grad_per_sample) * batch
    loss = (t.opt_logits_per_sample + t.opt_loss_grad_per_sample) * batch
    return own, loss


def option_local_bytes(t: ProblemTemplate, batch: int) -> np.ndarray:
    """Per option, the bytes its op adds on top of the kept prefix at its peak moment."""
    return np.maximum(*_local_moments(t, batch))


def _segment_layout(t: ProblemTemplate):
    """The template's segments grouped by length (once per template): per group the
    segment indices, their ops (rows), which variants exist and which are checkpointed,
    and their input bytes per sample; so ``_problem_at`` sums each segment's activations
    row by row, in the same order as one segment at a time."""
    layout = t.__dict__.get("_segment_layout")
    if layout is None:
        by_length: dict[int, list[int]] = {}
        for s, seg in enumerate(t.segments):
            by_length.setdefault(len(seg.ops), []).append(s)
        groups = []
        for segs in by_length.values():
            has = np.zeros((len(segs), 2), dtype=bool)
            ckpt = np.zeros((len(segs), 2), dtype=bool)
            for r, s in enumerate(segs):
                for v, checkpointed in enumerate(t.segments[s].variants):
                    has[r, v], ckpt[r, v] = True, checkpointed
            groups.append((np.array(segs, dtype=np.int64), np.array([t.segments[s].ops for s in segs], dtype=np.int64),
                           has, ckpt, np.array([t.segments[s].input_bytes_per_sample for s in segs])))
        layout = t.__dict__["_segment_layout"] = groups
    return layout


def _problem_at(t: ProblemTemplate, batch: int) -> SearchProblem:
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise OSDPError(f"batch size must be a positive integer, got {batch!r}")
    q = t.quantum_bytes
    act = t.act_per_sample * batch
    n_ops, n_seg = len(t.desc.ops), len(t.segments)
    act_in = np.zeros((n_ops, 2))
    carry = np.zeros((n_seg, 2), dtype=np.int64)
    rep_grads = t.rep_grads if t.rep_grads is not None and t.rep_grads.any() else None
    recomputed = act - t.act_block_input_per_sample * batch  # [Note: checkpointed block input]
    for segs, ops, has, ckpt, inputs in _segment_layout(t):
        inside = np.cumsum(act[ops], axis=1)  # within each segment (row), in op order
        inside_recomputed = np.cumsum(recomputed[ops], axis=1)
        for v in range(2):
            rows = has[:, v]
            if not rows.any():
                continue
            checkpointed = ckpt[rows, v]
            kept = np.where(checkpointed, inputs[rows] * batch, 0.0)
            # the per-op exact term also holds the sharded grads already reduced (and
            # the rep units' gradients: [Note: rep mode])
            within = np.where(checkpointed[:, None], inside_recomputed[rows], inside[rows])
            value = kept[:, None] + within + t.grads_after[ops[rows]] + t.tied_grads[ops[rows]]
            if rep_grads is not None:
                value = value + rep_grads[ops[rows]]
            act_in[ops[rows], v] = value
            carried = np.where(checkpointed, kept, inside[rows, -1])
            carry[segs[rows], v] = np.where(carried > 0, np.ceil(carried / q - 1e-9), 0.0).astype(np.int64)
    held_q = np.ceil(t.opt_held_bytes / q - 1e-9).astype(np.int64)
    held_q[t.opt_held_bytes <= 0] = 0
    return SearchProblem(
        seg_first_op=np.array([seg.ops[0] for seg in t.segments], dtype=np.int64),
        seg_num_ops=np.array([len(seg.ops) for seg in t.segments], dtype=np.int64),
        seg_num_variants=np.array([len(seg.variants) for seg in t.segments], dtype=np.int64),
        seg_carry_act_q=carry,
        seg_extra_time_s=np.zeros((n_seg, 2)),
        act_in_segment_bytes=act_in,
        opt_begin=t.opt_begin,
        opt_end=t.opt_end,
        opt_slices=t.opt_slices,
        opt_zdp_slices=t.opt_zdp,
        opt_held_q=held_q,
        opt_local_bytes=option_local_bytes(t, batch),
        opt_time_s=option_times(t, batch),
        quantum_bytes=q,
        limit_bytes=float(t.device.memory_limit_bytes),
        static_bytes=float(sum(t.static.values())),
        step_bytes=float(max(sum(parts.values()) for parts in after_ops_moments(t, batch))),  # the fixed moments
        constant_time_s=template_optimizer_s(t),
        seg_names=tuple(seg.name for seg in t.segments),
    )
