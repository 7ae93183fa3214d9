"""``ProblemTemplate``: the batch-independent option tables of a model on a device under
settings (``build_template``), and restricting it to some options. ``problem(b)`` is
problem.py's. docs/design/cost_model.md's notes explain every table."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..model_desc import ModelDesc
from ..device import DeviceInfo
from ..search_problem import SearchProblem
from .options import OptionRow, _option_rows, _rep_row, _rows_key, pending_reduce_bytes, sharded_grads_after
from .prefetch import _ahead_bytes, _staged_ahead, prefetch_window
from .problem import _problem_at
from .replicate import rep_op_mask, replicate_reduce_s, replicated_grads_bytes
from .settings import PlannerSettings
from .end_of_backward import end_of_backward_bytes
from .static import optimizer_step_bytes, static_bytes
from .timing import _compute_fit, coalesced_latency_shares
from .unit_bytes import activation_scale, fused_logits_bytes
from .units import tied_grads_bytes, tied_groups


@dataclass
class _Segment:
    name: str
    ops: list[int]
    variants: tuple[bool, ...]  # per search variant: is the segment checkpointed
    input_bytes_per_sample: float


def _segments(desc: ModelDesc, settings: PlannerSettings) -> list[_Segment]:
    """Blocks as segments; every op outside a block is a segment of its own."""
    variants = {"none": (False,), "auto": (False, True), "all": (True,)}[settings.checkpointing]
    by_first = {b.first_op: b for b in desc.blocks}
    segments, i = [], 0
    while i < len(desc.ops):
        block = by_first.get(i)
        if block is not None and settings.checkpointing != "none":
            segments.append(_Segment(block.name, list(range(i, i + block.num_ops)), variants, block.input_bytes_per_sample))
            i += block.num_ops
        else:
            segments.append(_Segment(desc.ops[i].name, [i], (False,), 0.0))
            i += 1
    return segments


@dataclass
class ProblemTemplate:
    """Batch-independent option tables of a model on a device under settings."""

    desc: ModelDesc
    device: DeviceInfo
    settings: PlannerSettings
    window_bytes: float
    static: dict[str, float]
    quantum_bytes: float
    segments: list[_Segment]
    # flat per option (variant-1 options of a segment follow its variant-0 ones)
    opt_op: np.ndarray = field(repr=False, default=None)
    opt_variant: np.ndarray = field(repr=False, default=None)
    opt_checkpointed: np.ndarray = field(repr=False, default=None)
    opt_slices: np.ndarray = field(repr=False, default=None)
    opt_zdp: np.ndarray = field(repr=False, default=None)
    opt_hpz: np.ndarray = field(repr=False, default=None)  # hpz slices ([Note: hpz mode])
    opt_held_bytes: np.ndarray = field(repr=False, default=None)
    opt_transient_bytes: np.ndarray = field(repr=False, default=None)  # gathers + grad buffers
    opt_comm_f_s: np.ndarray = field(repr=False, default=None)
    opt_gather_b_s: np.ndarray = field(repr=False, default=None)  # backward all-gathers
    opt_reduce_b_s: np.ndarray = field(repr=False, default=None)  # backward reduce-scatters
    opt_overlap: np.ndarray = field(repr=False, default=None)
    opt_split_overhead_s: np.ndarray = field(repr=False, default=None)
    opt_split_eff: np.ndarray = field(repr=False, default=None)
    # per sample: a vocabulary head's saved logits, the loss's backward transients before
    # the head's backward and the logits gradients during it, under this option ([Note:
    # fused vocabulary-split loss]), apart from act_per_sample / act_grad_per_sample
    opt_logits_per_sample: np.ndarray = field(repr=False, default=None)
    opt_loss_grad_per_sample: np.ndarray = field(repr=False, default=None)
    opt_logits_grad_per_sample: np.ndarray = field(repr=False, default=None)
    # of the transient, the bytes the op's own saved activations offset ([Note: the hook moment])
    opt_release_bytes: np.ndarray = field(repr=False, default=None)
    opt_begin: np.ndarray = field(repr=False, default=None)
    opt_end: np.ndarray = field(repr=False, default=None)
    # per op
    fwd_intercept_s: np.ndarray = field(repr=False, default=None)
    fwd_per_sample_s: np.ndarray = field(repr=False, default=None)
    bwd_intercept_s: np.ndarray = field(repr=False, default=None)
    bwd_per_sample_s: np.ndarray = field(repr=False, default=None)
    act_per_sample: np.ndarray = field(repr=False, default=None)
    # of it, the block's input ([Note: checkpointed block input])
    act_block_input_per_sample: np.ndarray = field(repr=False, default=None)
    grads_after: np.ndarray = field(repr=False, default=None)  # sharded grads alive at each op
    tied_grads: np.ndarray = field(repr=False, default=None)  # tied units' unsharded grads at each op
    act_grad_per_sample: np.ndarray = field(repr=False, default=None)  # backward transients
    # [Note: rep mode]: per op, whether it uses a rep unit (the template's fixed rep set),
    # and the rep units' gradients alive there after their backward
    rep: np.ndarray = field(repr=False, default=None)
    rep_grads: np.ndarray = field(repr=False, default=None)
    # the optimizer step's bytes by category, static included ([Note: optimizer step moment])
    step_bytes: dict = field(repr=False, default_factory=dict)
    # the end of backward's, the same way ([Note: end of backward moment])
    end_bytes: dict = field(repr=False, default_factory=dict)

    @property
    def rep_units(self) -> tuple[str, ...]:
        """Names of the units this template runs ``rep``, sorted (as ``rep_units`` is)."""
        if self.rep is None:
            return ()
        return tuple(sorted(op.name for i, op in enumerate(self.desc.ops) if self.rep[i] and not op.tied_to))

    @property
    def budget_bytes(self) -> float:
        return self.device.memory_limit_bytes - sum(self.static.values())

    def shape(self, o: int) -> tuple[int, int, int]:
        """Option ``o``'s (slices, zdp slices, hpz slices): what the runtime runs of it."""
        return int(self.opt_slices[o]), int(self.opt_zdp[o]), int(self.opt_hpz[o])

    def problem(self, batch: int) -> SearchProblem:
        return _problem_at(self, batch)


def build_template(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings | None = None) -> ProblemTemplate:
    settings = settings or PlannerSettings()
    static = static_bytes(desc, device, settings)
    budget = device.memory_limit_bytes - sum(static.values())
    window = prefetch_window(desc, settings, budget)
    segments = _segments(desc, settings)
    after, before = _ahead_bytes(desc, window, settings)
    staged_f, staged_b = _staged_ahead(desc, window, settings, device.world_size)
    shares = coalesced_latency_shares(desc, settings, window)
    rep = rep_op_mask(desc, settings)  # [Note: rep mode]: a fixed set per template
    rep_reduce = replicate_reduce_s(desc, device, settings, rep) if rep.any() else {}
    pending, issued, flight_out = pending_reduce_bytes(desc, device, settings, rep)
    # [Note: memory quantization] in search_problem.py: enough buckets that rounding
    # up every accumulating term costs at most memory_tolerance of the budget.
    terms = len(desc.ops) + len(segments)
    buckets = min(settings.max_buckets, max(settings.min_buckets, math.ceil(terms / settings.memory_tolerance)))
    quantum = max(budget, 1.0) / buckets

    begin = np.zeros((len(desc.ops), 2), dtype=np.int64)
    end = np.zeros((len(desc.ops), 2), dtype=np.int64)
    blocks: list[np.ndarray] = []  # option rows (OptionRow's fields) per distinct key
    block_of: dict[tuple, int] = {}  # identical layers share their option rows
    runs = []  # per (op, variant) in option order: (op, variant, checkpointed, block)
    count = 0
    owners = {group[0] for group in tied_groups(desc)}
    for seg in segments:
        for variant, checkpointed in enumerate(seg.variants):
            for i in seg.ops:
                staged = (staged_f[i], staged_b[i])
                key = _rows_key(desc, i, owners, checkpointed, after[i], before[i], pending[i], issued[i],
                                flight_out[i], staged)
                if rep[i]:
                    key += ("rep", rep_reduce.get(i, 0.0))
                b = block_of.get(key)
                if b is None:
                    if rep[i]:
                        rows = [_rep_row(desc, i, settings, window, after[i], before[i], rep_reduce.get(i, 0.0),
                                         pending[i], staged)]
                    else:
                        rows = _option_rows(desc, i, device, settings, checkpointed, window, after[i], before[i],
                                            shares, pending[i], issued[i], flight_out[i], staged=staged)
                    b = block_of[key] = len(blocks)
                    blocks.append(np.array(rows, dtype=np.float64).reshape(len(rows), len(OptionRow._fields)))
                begin[i, variant] = count
                count += len(blocks[b])
                end[i, variant] = count
                runs.append((i, variant, checkpointed, b))
    # one array per field, as the rows would give them (small ints and bools are exact as floats)
    table = np.concatenate([blocks[b] for *_, b in runs] + [np.zeros((0, len(OptionRow._fields)))])
    col = {name: table[:, j].copy() for j, name in enumerate(OptionRow._fields)}
    sizes = np.array([len(blocks[b]) for *_, b in runs], dtype=np.int64)
    per_run = np.array([r[:3] for r in runs], dtype=np.int64).reshape(-1, 3)

    fits = [_compute_fit(op, device, settings) for op in desc.ops]
    return ProblemTemplate(
        desc=desc,
        device=device,
        settings=settings,
        window_bytes=window,
        static=static,
        quantum_bytes=quantum,
        segments=segments,
        opt_op=np.repeat(per_run[:, 0], sizes),
        opt_variant=np.repeat(per_run[:, 1], sizes),
        opt_checkpointed=np.repeat(per_run[:, 2], sizes).astype(bool),
        opt_slices=col["slices"].astype(np.int64),
        opt_zdp=col["zdp"].astype(np.int64),
        opt_hpz=col["hpz"].astype(np.int64),
        opt_held_bytes=col["held_bytes"],
        opt_transient_bytes=col["transient_bytes"],
        opt_comm_f_s=col["comm_f_s"],
        opt_gather_b_s=col["gather_b_s"],
        opt_reduce_b_s=col["reduce_b_s"],
        opt_overlap=col["overlap"].astype(bool),
        opt_split_overhead_s=col["split_overhead_s"],
        opt_split_eff=col["split_eff"],
        opt_logits_per_sample=col["logits_per_sample"],
        opt_loss_grad_per_sample=col["loss_grad_per_sample"],
        opt_logits_grad_per_sample=col["logits_grad_per_sample"],
        opt_release_bytes=col["release_bytes"],
        opt_begin=begin,
        opt_end=end,
        fwd_intercept_s=np.array([f[0] for f in fits]),
        fwd_per_sample_s=np.array([f[1] for f in fits]),
        bwd_intercept_s=np.array([f[2] for f in fits]),
        bwd_per_sample_s=np.array([f[3] for f in fits]),
        # a fused head's logits (saved, and their gradients) are its options' own terms
        act_per_sample=np.array([op.act_bytes_per_sample - fused_logits_bytes(desc, i)
                                 for i, op in enumerate(desc.ops)]) * activation_scale(desc, settings),
        act_block_input_per_sample=np.array([op.block_input_bytes_per_sample for op in desc.ops])
        * activation_scale(desc, settings),
        act_grad_per_sample=np.array([max((op.act_grad_bytes_per_sample or op.act_bytes_per_sample)
                                          - 2.0 * fused_logits_bytes(desc, i), 0.0)
                                      for i, op in enumerate(desc.ops)]) * activation_scale(desc, settings),
        grads_after=sharded_grads_after(desc, device, settings),
        tied_grads=tied_grads_bytes(desc, settings),
        rep=rep,
        rep_grads=replicated_grads_bytes(desc, settings, rep),
        step_bytes=optimizer_step_bytes(desc, device, settings),
        end_bytes=end_of_backward_bytes(desc, device, settings),
    )


_COST_FIELDS = ("opt_held_bytes", "opt_transient_bytes", "opt_comm_f_s", "opt_gather_b_s", "opt_reduce_b_s",
                "opt_overlap", "opt_split_overhead_s", "opt_split_eff", "opt_logits_per_sample",
                "opt_loss_grad_per_sample", "opt_logits_grad_per_sample", "opt_release_bytes")
_OPTION_FIELDS = ("opt_op", "opt_variant", "opt_checkpointed", "opt_slices", "opt_zdp", "opt_hpz") + _COST_FIELDS


def restrict_template(t: ProblemTemplate, keep: np.ndarray) -> ProblemTemplate:
    """``t`` with only the options where ``keep`` is True (per-op ranges recomputed)."""
    keep = np.asarray(keep, dtype=bool)
    kept_before = np.concatenate(([0], np.cumsum(keep))).astype(np.int64)
    return replace(t, opt_begin=kept_before[t.opt_begin], opt_end=kept_before[t.opt_end],
                   **{name: getattr(t, name)[keep] for name in _OPTION_FIELDS})
