"""The search problem: what the exact search sees of the cost model.

The cost model (``cost_model/``) turns a model description, a device and a batch
size into a ``SearchProblem``: for every operator, a table of options (one per slice
granularity g and number k of slices in ``zdp``), each with its time and its memory
terms. The search (``search.py``, and the C++ core ``osdp._C``) only reads these tables,
so both stay exact with respect to the cost model without re-deriving any cost.
The tables are flat numpy arrays so that the C++ core reads them without copies.

[Note: memory quantization]
Memory in the search is counted in integer *buckets* of ``quantum_bytes``. Every term
that accumulates along the model (weights kept by ``dp`` slices, activations carried past
a segment) is rounded *up* to whole buckets when it is created, so a plan the search
calls feasible is feasible in exact bytes too. Terms that never accumulate (the
in-flight ``local_bytes`` of one operator, the activations alive inside the current
segment) are kept exact. The worst-case over-estimate is one quantum per operator with
kept weights plus one per segment; ``Plan`` reports it.

[Note: the memory constraint]
Ops run in op order. Segments are contiguous runs of ops (a transformer block, or one
op outside any block); each segment runs in one of its variants (variant 0: activations
saved; variant 1, where present: activation checkpointing). At op i of segment s under
variant v the live memory is

    static_bytes
    + quantum_bytes * (sum of held_q of the chosen options of ops <= i
                       + sum of carry_act_q[s', v'] of the earlier segments s')
    + act_in_segment_bytes[i, v] + local_bytes(chosen option of op i)

(act_in_segment_bytes is the per-op exact, choice-independent term: the activations
alive inside the segment, plus whatever else the cost model knows to be alive at that
op regardless of the choices, such as the sharded gradients already reduced.)

and it must be <= limit_bytes for every op, as must ``step_bytes`` (the optimizer
step's moment, choice-independent). Weights kept by ``dp`` slices and activations
saved for backward only grow during forward and only shrink during backward, so the
largest live set at an op is its prefix plus its own transient buffers, and the peak of
the step is the max over ops. ``budget_bytes = limit_bytes - static_bytes``.

The objective is the least total time: constant_time_s + sum over segments of
extra_time_s[s, v] + sum over ops of time_s of the chosen option.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SearchProblem:
    """Flat option tables. Shapes: S segments, n ops, P options in all.

    seg_first_op[S]        int64   first op of each segment (segments are contiguous, in order)
    seg_num_ops[S]         int64
    seg_num_variants[S]    int64   1 (no checkpointing possible) or 2
    seg_carry_act_q[S, 2]  int64   buckets of activations alive after the segment, per variant
    seg_extra_time_s[S, 2] float64 option-independent time of the segment, per variant
    act_in_segment_bytes[n, 2] float64  activations alive inside the segment at each op
    opt_begin[n, 2], opt_end[n, 2]  int64  option range of op i under variant v
    opt_slices[P], opt_zdp_slices[P]  int64   the decision: g slices, k of them zdp
    opt_held_q[P]          int64   buckets kept from forward to backward (dp slices)
    opt_local_bytes[P]     float64 transient bytes while the op runs
    opt_time_s[P]          float64 forward + backward time of the op, overlap included
    Unused variant-1 entries of a 1-variant segment are zero / empty ranges.
    """

    seg_first_op: np.ndarray
    seg_num_ops: np.ndarray
    seg_num_variants: np.ndarray
    seg_carry_act_q: np.ndarray
    seg_extra_time_s: np.ndarray
    act_in_segment_bytes: np.ndarray
    opt_begin: np.ndarray
    opt_end: np.ndarray
    opt_slices: np.ndarray
    opt_zdp_slices: np.ndarray
    opt_held_q: np.ndarray
    opt_local_bytes: np.ndarray
    opt_time_s: np.ndarray
    quantum_bytes: float
    limit_bytes: float
    static_bytes: float  # sharded states + measured constant: paid whatever the plan
    constant_time_s: float  # optimizer step etc.: paid whatever the plan
    seg_names: tuple[str, ...] = ()
    # bytes live at the end of backward or at the optimizer step, the larger, static
    # included: the same for every plan, so a problem whose step_bytes exceed limit_bytes
    # has no feasible plan, and a plan's peak is at least step_bytes (cost_model/static.py's
    # [Note: end of backward moment] and [Note: optimizer step moment])
    step_bytes: float = 0.0

    @property
    def budget_bytes(self) -> float:
        return self.limit_bytes - self.static_bytes

    @property
    def num_ops(self) -> int:
        return int(self.act_in_segment_bytes.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.seg_first_op.shape[0])


@dataclass(frozen=True)
class SearchResult:
    """The optimum of one ``SearchProblem`` (``feasible`` False: nothing fits).

    ``option_index[i]`` is the index into the flat option arrays chosen for op i;
    ``variant[s]`` the variant chosen for segment s (1 = checkpointed)."""

    feasible: bool
    time_s: float = float("inf")  # the objective, constant_time_s included
    peak_bytes: float = float("inf")  # peak as the search counts it (quantized terms)
    peak_op: int = -1  # op where that peak happens; -1: the optimizer step (step_bytes)
    option_index: tuple[int, ...] = ()
    variant: tuple[int, ...] = ()
    states_visited: int = field(default=0, compare=False)  # work done, for benchmarks
