"""Exact plan search over a ``SearchProblem`` (see ``search_problem.py`` for the problem).

    search(problem, backend="auto") -> SearchResult     the optimum (C++ core or reference)
    search_python(problem)          -> SearchResult     numpy reference, same result bit for bit
    feasible(problem, backend)      -> bool             whether any plan fits (one pass, no DP)
    evaluate_assignment(problem, option_index, variant) -> (feasible, time_s, peak_bytes, peak_op)
    brute_force(problem)            -> SearchResult     enumeration, for tests on small problems
    validate_problem(problem)                            clear ValueErrors for malformed tables

[Note: exact search]
The objective is a sum of per-op and per-segment terms, and the only coupling between
ops is the held prefix: the memory at op i depends on the choices before it only through
``prefix_q`` = buckets held by ``dp`` slices of earlier ops + activations carried by
earlier segments. So a dynamic program over ops in order, with state = ``prefix_q``
(0..B) and value = least time so far, is exact:

  * B is the largest integer with ``B * quantum_bytes <= budget_bytes`` evaluated in floats.
    A state above B can never become feasible again, because every memory term is
    non-negative and nothing accumulated is ever given back during forward.
  * op i (segment s, variant v), option o, from state x to y = x + held_q[o]: allowed iff
        (float(y) * quantum_bytes + act_in_segment_bytes[i, v]) + local_bytes[o] <= budget_bytes
    evaluated in exactly this order everywhere (here, the C++ core, evaluate_assignment),
    without any epsilon, so all three agree on every plan.
  * at the end of segment s under v: y += carry_act_q[s, v] (states > B dropped, except
    after the last segment, whose carry no op ever sees) and time += extra_time_s[s, v];
    then the min over variants per state.
  * time is accumulated in one canonical order, ``constant_time_s``, then per segment the
    op times followed by the segment's extra time, as ``evaluate_assignment`` does.
    Float addition is monotone, so min over predecessors of fl(t + c) = fl(min t + c):
    the DP optimum equals the least float sum over all plans bit for bit, not just
    to a tolerance.
Ties: the value is the pair (time, running peak) compared lexicographically, so among
equal-time plans the lower peak wins (exact whenever time sums are exact, e.g. equal
option times; with rounding the peak is only a tie-break). Remaining exact ties go to the
first candidate: options in index order, variant 0 before 1, the lowest end state.
An option with held_q, local_bytes and time_s all >= those of another option of the same
op and variant (ties: the higher index) is dropped first: it can never be strictly better.

The moments after the ops (``step_bytes``: the larger of the end of backward's and the
optimizer step's) are the same for every plan: a problem where they do not fit has no
feasible plan, checked once before the DP (``_step_fits``), and a plan's peak is the
larger of its ops' and theirs.

Work is (ops x variants x reachable states x options); only the reachable range
[lo, hi] of states is scanned, less the states above the largest one from which the rest
of the plan can still fit ([Note: dead states] in csrc/search/search.cpp) and, given a
``time_bound``, the ends too slow to beat it ([Note: time bound] there). Per op and variant the winning option per end state is
kept (uint16, relative to ``opt_begin``) and per segment the winning variant per state,
for backtracking. The reference pushes option by option over all states; the C++ core
pulls, per end state, over the options (see [Note: relax kernel] in
csrc/search/search.cpp). Each end state sees the same candidates in the same order with
the same strict comparison, so both return the same plan, not only the same optimum.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math
import warnings

import numpy as np

from osdp.planner.search_problem import SearchProblem, SearchResult

__all__ = [
    "search",
    "search_python",
    "search_cpp",
    "feasible",
    "feasible_python",
    "feasible_cpp",
    "cannot_beat",
    "brute_force",
    "evaluate_assignment",
    "validate_problem",
    "num_buckets",
]

# The states array has B + 1 entries; beyond this the quantum is too fine for the model.
MAX_BUCKETS = 1 << 24
# uint16 choice tables in the backtracking store.
MAX_OPTIONS_PER_OP = 65535
BRUTE_FORCE_LIMIT = 200_000

_INT_FIELDS = ("seg_first_op", "seg_num_ops", "seg_num_variants", "seg_carry_act_q",
               "opt_begin", "opt_end", "opt_slices", "opt_zdp_slices", "opt_held_q")
_FLOAT_FIELDS = ("seg_extra_time_s", "act_in_segment_bytes", "opt_local_bytes", "opt_time_s")


def validate_problem(problem: SearchProblem) -> None:
    """Raise ValueError, naming the field, unless the tables are well formed.

    Checks dtypes, shapes, segment contiguity, option ranges, finiteness and the
    non-negativity of every memory term (the exactness argument relies on it)."""
    if not isinstance(problem, SearchProblem):
        raise ValueError(f"expected a SearchProblem, got {type(problem).__name__}")
    for name in _INT_FIELDS + _FLOAT_FIELDS:
        a = getattr(problem, name)
        if not isinstance(a, np.ndarray):
            raise ValueError(f"SearchProblem.{name} must be a numpy array, got {type(a).__name__}")
        want = np.int64 if name in _INT_FIELDS else np.float64
        if a.dtype != want:
            raise ValueError(f"SearchProblem.{name} must have dtype {np.dtype(want)}, got {a.dtype}")
    S = problem.seg_first_op.shape[0] if problem.seg_first_op.ndim == 1 else -1
    n = problem.act_in_segment_bytes.shape[0] if problem.act_in_segment_bytes.ndim == 2 else -1
    P = problem.opt_held_q.shape[0] if problem.opt_held_q.ndim == 1 else -1
    shapes = {
        "seg_first_op": (S,), "seg_num_ops": (S,), "seg_num_variants": (S,),
        "seg_carry_act_q": (S, 2), "seg_extra_time_s": (S, 2),
        "act_in_segment_bytes": (n, 2), "opt_begin": (n, 2), "opt_end": (n, 2),
        "opt_slices": (P,), "opt_zdp_slices": (P,), "opt_held_q": (P,),
        "opt_local_bytes": (P,), "opt_time_s": (P,),
    }
    for name, shape in shapes.items():
        got = getattr(problem, name).shape
        if -1 in shape or got != shape:
            raise ValueError(f"SearchProblem.{name} has shape {got}, expected {shape} "
                             f"(S={S} segments, n={n} ops, P={P} options)")
    if S < 1 or n < 1:
        raise ValueError(f"SearchProblem needs at least one segment and one op (S={S}, n={n})")
    for name in ("quantum_bytes", "limit_bytes", "static_bytes", "step_bytes", "constant_time_s"):
        x = getattr(problem, name)
        if not isinstance(x, (int, float, np.integer, np.floating)) or not math.isfinite(x):
            raise ValueError(f"SearchProblem.{name} must be a finite number, got {x!r}")
    if not problem.quantum_bytes > 0:
        raise ValueError(f"SearchProblem.quantum_bytes must be > 0, got {problem.quantum_bytes}")

    first, count, nv = problem.seg_first_op, problem.seg_num_ops, problem.seg_num_variants
    if np.any(count < 1):
        raise ValueError(f"SearchProblem.seg_num_ops must be >= 1, got {count.tolist()}")
    expect_first = np.concatenate(([0], np.cumsum(count)[:-1]))
    if not np.array_equal(first, expect_first) or int(count.sum()) != n:
        raise ValueError("segments must be contiguous and cover ops 0..n-1 in order: "
                         f"seg_first_op={first.tolist()}, seg_num_ops={count.tolist()}, n={n}")
    if not np.all((nv == 1) | (nv == 2)):
        raise ValueError(f"SearchProblem.seg_num_variants must be 1 or 2, got {nv.tolist()}")
    if np.any(problem.seg_carry_act_q < 0):
        raise ValueError("SearchProblem.seg_carry_act_q must be >= 0")
    if np.any(problem.opt_held_q < 0):
        raise ValueError("SearchProblem.opt_held_q must be >= 0")
    for name in _FLOAT_FIELDS:
        if not np.all(np.isfinite(getattr(problem, name))):
            raise ValueError(f"SearchProblem.{name} must be finite")
    for name in ("act_in_segment_bytes", "opt_local_bytes"):
        if np.any(getattr(problem, name) < 0):
            raise ValueError(f"SearchProblem.{name} must be >= 0")
    seg_of_op = np.repeat(np.arange(S), count)
    used = np.arange(2)[None, :] < nv[seg_of_op][:, None]  # (n, 2): variant exists
    b, e = problem.opt_begin, problem.opt_end
    bad = used & ((b < 0) | (e < b) | (e > P))
    if np.any(bad):
        i, v = map(int, np.argwhere(bad)[0])
        raise ValueError(f"option range of op {i} variant {v} is [{b[i, v]}, {e[i, v]}), "
                         f"not inside [0, {P})")
    if np.any(used & (e - b > MAX_OPTIONS_PER_OP)):
        raise ValueError(f"an op has more than {MAX_OPTIONS_PER_OP} options under one variant")


def _max_reach(p: SearchProblem) -> int:
    """Upper bound of any reachable state: the most every op and carry could hold."""
    S = p.num_segments
    total = 0
    for s in range(S):
        nv = int(p.seg_num_variants[s])
        best = 0
        for v in range(nv):
            acc = 0
            for i in range(int(p.seg_first_op[s]), int(p.seg_first_op[s] + p.seg_num_ops[s])):
                b, e = int(p.opt_begin[i, v]), int(p.opt_end[i, v])
                acc += int(p.opt_held_q[b:e].max()) if e > b else 0
            if s + 1 < S:
                acc += int(p.seg_carry_act_q[s, v])
            best = max(best, acc)
        total += best
    return total


def num_buckets(problem: SearchProblem) -> int:
    """B: the largest state worth tracking (-1: not even an empty prefix fits).

    The largest integer with float(B) * quantum_bytes <= budget_bytes, capped by the
    largest state any plan can reach. Mirrors ``num_buckets`` in csrc/search/search.cpp."""
    q, budget = float(problem.quantum_bytes), float(problem.budget_bytes)
    cap = _max_reach(problem)
    if not budget >= 0:
        return -1
    b = int(min(math.floor(budget / q), float(cap + 1)))
    while b >= 0 and float(b) * q > budget:
        b -= 1
    while b < cap and float(b + 1) * q <= budget:
        b += 1
    b = min(b, cap)
    if b + 1 > MAX_BUCKETS:
        raise ValueError(f"{b + 1} memory buckets exceed the limit of {MAX_BUCKETS}; "
                         f"use a larger quantum_bytes (now {q})")
    return b


def evaluate_assignment(problem: SearchProblem, option_index, variant):
    """Cost of one plan: ``(feasible, time_s, peak_bytes, peak_op)``.

    ``option_index[i]`` is a flat option index for op i, ``variant[s]`` the variant of
    segment s. Peak and time are reported for infeasible plans too; the peak is the
    larger of the ops' and the optimizer step's (``step_bytes``, peak_op -1). Raises
    ValueError if an option is not in its op's range under the segment's variant."""
    feasible, time_s, ops_peak, peak_op = _ops_cost(problem, option_index, variant)
    if float(problem.step_bytes) > ops_peak:  # the optimizer step's moment, the same for every plan
        return feasible and _step_fits(problem), time_s, float(problem.step_bytes), -1
    return feasible and _step_fits(problem), time_s, ops_peak, peak_op


def _ops_cost(problem: SearchProblem, option_index, variant):
    """``evaluate_assignment`` over the ops alone: the terms the DP compares (its
    tie-break is the ops' peak)."""
    p = problem
    S, n = p.num_segments, p.num_ops
    option_index, variant = list(option_index), list(variant)
    if len(option_index) != n or len(variant) != S:
        raise ValueError(f"need {n} option indices and {S} variants, got "
                         f"{len(option_index)} and {len(variant)}")
    q, budget = float(p.quantum_bytes), float(p.budget_bytes)
    time_s = float(p.constant_time_s)
    prefix = 0
    feasible = True
    peak, peak_op = -math.inf, -1
    for s in range(S):
        v = int(variant[s])
        if not 0 <= v < int(p.seg_num_variants[s]):
            raise ValueError(f"segment {s} has no variant {v}")
        first = int(p.seg_first_op[s])
        for i in range(first, first + int(p.seg_num_ops[s])):
            o = int(option_index[i])
            if not int(p.opt_begin[i, v]) <= o < int(p.opt_end[i, v]):
                raise ValueError(f"option {o} is not an option of op {i} under variant {v}")
            prefix += int(p.opt_held_q[o])
            # [Note: exact search] the one memory test, same expression in the DPs
            mem = (float(prefix) * q + float(p.act_in_segment_bytes[i, v])) + float(p.opt_local_bytes[o])
            feasible = feasible and mem <= budget
            if mem > peak:
                peak, peak_op = mem, i
            time_s += float(p.opt_time_s[o])
        time_s += float(p.seg_extra_time_s[s, v])
        prefix += int(p.seg_carry_act_q[s, v])
    return feasible, time_s, float(p.static_bytes) + peak, peak_op


def _kept_options(p: SearchProblem, i: int, v: int) -> np.ndarray:
    """Flat indices of the options of op i under v that no other option dominates."""
    b, e = int(p.opt_begin[i, v]), int(p.opt_end[i, v])
    idx = np.arange(b, e)
    h, l, t = p.opt_held_q[b:e], p.opt_local_bytes[b:e], p.opt_time_s[b:e]
    # weak[j, k]: option j is no worse than option k in every term
    weak = (h[:, None] <= h[None, :]) & (l[:, None] <= l[None, :]) & (t[:, None] <= t[None, :])
    strict = (h[:, None] < h[None, :]) | (l[:, None] < l[None, :]) | (t[:, None] < t[None, :])
    earlier = idx[:, None] < idx[None, :]
    dominated = np.any(weak & (strict | earlier), axis=0)
    return idx[~dominated]


def feasible_python(problem: SearchProblem) -> bool:
    """Whether any plan fits: ``search(problem).feasible``, in one pass over the options.

    [Note: feasibility] Every memory test is monotone in the prefix state (a smaller
    prefix passes whatever a larger one passes), so a plan can be finished from a state
    whenever it can from a larger one, and only the least state reachable after each op
    matters: from it, each option that fits gives its least next state. The least over
    the options (over the variants, carry added, at a segment's end) is the least state
    of every plan so far, and some plan fits iff that walk never runs out of options.
    The memory test is the DP's own expression, so the answer is the DP's. The C++ core
    runs the same walk (``feasible``)."""
    validate_problem(problem)
    p = problem
    if not _step_fits(p) or num_buckets(p) < 0:
        return False
    q, budget = float(p.quantum_bytes), float(p.budget_bytes)
    least = 0  # the least state entering the segment
    for s in range(p.num_segments):
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        after = None
        for v in range(int(p.seg_num_variants[s])):
            y = least
            for i in range(first, first + count):
                b, e = int(p.opt_begin[i, v]), int(p.opt_end[i, v])
                ys = y + p.opt_held_q[b:e]
                ok = (ys.astype(np.float64) * q + float(p.act_in_segment_bytes[i, v])) + p.opt_local_bytes[b:e] \
                    <= budget
                if not ok.any():
                    y = None
                    break
                y = int(ys[ok].min())
            if y is not None:
                y += 0 if s + 1 == p.num_segments else int(p.seg_carry_act_q[s, v])
                after = y if after is None else min(after, y)
        if after is None:
            return False
        least = after
    return True


def _step_fits(p: SearchProblem) -> bool:
    """Whether the optimizer step's moment fits: it does for every plan or for none."""
    return float(p.step_bytes) <= float(p.limit_bytes)


def _max_fitting_state(qy: np.ndarray, B: int, q: float, act: float, local: float, budget: float) -> int:
    """Largest state y <= B whose memory test passes with ``act`` and ``local`` (-1:
    none). The test is monotone in y: a guess from the division, corrected by steps.
    Mirrors ``max_fitting_state`` in csrc/search/search.cpp."""
    g = math.floor((budget - act - local) / q)
    y = -1 if g < -1 else (B if g > B else int(g))
    while y >= 0 and not (float(qy[y]) + act) + local <= budget:
        y -= 1
    while y < B and (float(qy[y + 1]) + act) + local <= budget:
        y += 1
    return y


def _live_bounds(p: SearchProblem, B: int, qy: np.ndarray, kept: dict) -> dict:
    """[Note: dead states] in csrc/search/search.cpp: per (op, variant), the largest state
    after the op from which the rest of the plan can still fit (-1: none)."""
    out = {}
    next_in = B
    for s in reversed(range(p.num_segments)):
        last_seg = s + 1 == p.num_segments
        seg_in = -1
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        for v in range(int(p.seg_num_variants[s])):
            c = 0 if last_seg else int(p.seg_carry_act_q[s, v])
            bound = max(next_in - c, -1)
            for i in reversed(range(first, first + count)):
                out[i, v] = bound
                act = float(p.act_in_segment_bytes[i, v])
                before = -1
                for o in kept[i, v] if bound >= 0 else ():
                    ymax = _max_fitting_state(qy, B, float(p.quantum_bytes), act, float(p.opt_local_bytes[o]),
                                              float(p.budget_bytes))
                    before = max(before, min(ymax, bound) - int(p.opt_held_q[o]))
                bound = max(before, -1)
            seg_in = max(seg_in, bound)
        next_in = seg_in
    return out


def _time_rest(p: SearchProblem, kept: dict, time_bound: float):
    """[Note: time bound] in csrc/search/search.cpp: per (op, variant) the least time still
    to come after it, and the limit a state's time plus that may not exceed; (None,
    inf) without a bound. The same float sums, in the same order, as the C++ core."""
    if not time_bound < math.inf:
        return None, math.inf
    rest = {}
    tail, scale = 0.0, abs(float(p.constant_time_s))
    for s in reversed(range(p.num_segments)):
        seg_least, seg_abs = math.inf, 0.0
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        for v in range(int(p.seg_num_variants[s])):
            within = float(p.seg_extra_time_s[s, v])
            abs_sum = abs(within)
            for i in reversed(range(first, first + count)):
                rest[i, v] = within + tail
                times = [float(p.opt_time_s[o]) for o in kept[i, v]]
                within += min(times, default=math.inf)
                abs_sum += max((abs(t) for t in times), default=0.0)
            seg_least = min(seg_least, within)
            seg_abs = max(seg_abs, abs_sum)
        tail += seg_least
        scale += seg_abs
    return rest, time_bound + 1e-9 * (abs(time_bound) + scale)


def search_python(problem: SearchProblem, time_bound: float = math.inf) -> SearchResult:
    """The numpy reference of [Note: exact search]. Same plan as the C++ core.
    ``time_bound``: only a plan faster than it is wanted (else: not feasible), see
    [Note: time bound] in csrc/search/search.cpp."""
    validate_problem(problem)
    p = problem
    if not _step_fits(p):
        return SearchResult(feasible=False)
    S = p.num_segments
    q, budget = float(p.quantum_bytes), float(p.budget_bytes)
    B = num_buckets(p)
    if B < 0:
        return SearchResult(feasible=False)
    nstates = B + 1
    qy = np.arange(nstates, dtype=np.float64) * q  # fl(float(y) * q), as in evaluate_assignment
    inf = math.inf
    kept = {(i, v): _kept_options(p, i, v) for s in range(S) for v in range(int(p.seg_num_variants[s]))
            for i in range(int(p.seg_first_op[s]), int(p.seg_first_op[s] + p.seg_num_ops[s]))}
    live = _live_bounds(p, B, qy, kept)
    rest, limit = _time_rest(p, kept, float(time_bound))
    # distribution entering the current segment
    in_t = np.full(nstates, inf)
    in_p = np.full(nstates, -inf)
    in_t[0] = float(p.constant_time_s)
    lo, hi = 0, 0
    op_choice = {}  # (i, v) -> (first state, uint16 options relative to opt_begin)
    seg_choice = []  # s -> (first state, int8 variant)
    visited = 0
    for s in range(S):
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        last_seg = s + 1 == S
        seg_t = np.full(nstates, inf)
        seg_p = np.full(nstates, -inf)
        seg_v = np.full(nstates, -1, dtype=np.int8)
        slo, shi = nstates, -1
        for v in range(int(p.seg_num_variants[s])):
            cur_t, cur_p, clo, chi = in_t, in_p, lo, hi
            for i in range(first, first + count):
                if clo > chi:
                    break
                visited += chi - clo + 1
                act = float(p.act_in_segment_bytes[i, v])
                nxt_t = np.full(nstates, inf)
                nxt_p = np.full(nstates, -inf)
                choice = np.zeros(nstates, dtype=np.uint16)
                base = int(p.opt_begin[i, v])
                for o in kept[i, v]:
                    h = int(p.opt_held_q[o])
                    ylo, yhi = clo + h, min(chi + h, B)
                    if ylo > yhi:
                        continue
                    ys = slice(ylo, yhi + 1)
                    xs = slice(clo, clo + yhi + 1 - ylo)
                    mem = (qy[ys] + act) + float(p.opt_local_bytes[o])
                    t = cur_t[xs] + float(p.opt_time_s[o])
                    pk = np.maximum(cur_p[xs], mem)
                    ot, op_ = nxt_t[ys], nxt_p[ys]
                    better = (mem <= budget) & ((t < ot) | ((t == ot) & (pk < op_)))
                    ot[better] = t[better]
                    op_[better] = pk[better]
                    choice[ys][better] = o - base
                nxt_t[live[i, v] + 1:] = inf  # [Note: dead states]: none of them can finish
                reach = np.flatnonzero(nxt_t < inf)
                if rest is not None and reach.size:  # [Note: time bound]: trim the slow ends
                    fast = np.flatnonzero(nxt_t[reach[0]:reach[-1] + 1] + rest[i, v] <= limit)
                    reach = reach[0] + fast
                if reach.size == 0:
                    clo, chi = 1, 0
                    break
                clo, chi = int(reach[0]), int(reach[-1])
                op_choice[(i, v)] = (clo, choice[clo:chi + 1].copy())
                cur_t, cur_p = nxt_t, nxt_p
            if clo > chi:
                continue
            # segment end: carry the saved activations, add the variant's extra time
            c = 0 if last_seg else int(p.seg_carry_act_q[s, v])
            ylo, yhi = clo + c, min(chi + c, B)
            if ylo > yhi:
                continue
            ys, xs = slice(ylo, yhi + 1), slice(clo, clo + yhi + 1 - ylo)
            t = cur_t[xs] + float(p.seg_extra_time_s[s, v])
            pk = cur_p[xs]
            ot, op_ = seg_t[ys], seg_p[ys]
            better = (t < ot) | ((t == ot) & (pk < op_))
            ot[better] = t[better]
            op_[better] = pk[better]
            seg_v[ys][better] = v
            slo, shi = min(slo, ylo), max(shi, yhi)
        if slo > shi or not np.any(seg_t[slo:shi + 1] < inf):
            return SearchResult(feasible=False, states_visited=visited)
        reach = np.flatnonzero(seg_t < inf)
        lo, hi = int(reach[0]), int(reach[-1])
        seg_choice.append((lo, seg_v[lo:hi + 1].copy()))
        in_t, in_p = seg_t, seg_p

    # best end state: least time, then least peak, then lowest state
    t_end = in_t[lo:hi + 1]
    cand = np.flatnonzero(t_end == t_end.min())
    y = lo + int(cand[np.argmin(in_p[lo:hi + 1][cand])])  # argmin: first of equal peaks
    time_s, peak_inner = float(in_t[y]), float(in_p[y])
    if not time_s < time_bound:  # [Note: time bound]: no plan faster
        return SearchResult(feasible=False, states_visited=visited)

    option_index = [0] * p.num_ops
    variant = [0] * S
    for s in reversed(range(S)):
        slo_s, sv = seg_choice[s]
        v = int(sv[y - slo_s])
        variant[s] = v
        if s + 1 < S:
            y -= int(p.seg_carry_act_q[s, v])
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        for i in reversed(range(first, first + count)):
            clo, ch = op_choice[(i, v)]
            o = int(p.opt_begin[i, v]) + int(ch[y - clo])
            option_index[i] = o
            y -= int(p.opt_held_q[o])
    assert y == 0, "backtracking must end in the empty prefix"
    return _result(p, time_s, peak_inner, option_index, variant, visited)


def _result(p, time_s, peak_inner, option_index, variant, visited) -> SearchResult:
    # peak_op: the first op at the plan's peak (the DP tracks only the value).
    _, _, _, peak_op = evaluate_assignment(p, option_index, variant)
    return SearchResult(
        feasible=True,
        time_s=float(time_s),
        peak_bytes=max(float(p.static_bytes) + float(peak_inner), float(p.step_bytes)),
        peak_op=int(peak_op),
        option_index=tuple(int(o) for o in option_index),
        variant=tuple(int(v) for v in variant),
        states_visited=int(visited),
    )


def brute_force(problem: SearchProblem, limit: int = BRUTE_FORCE_LIMIT) -> SearchResult:
    """Enumerate every plan (for tests). Lexicographic (time, peak); first plan wins ties.

    Raises ValueError when the problem has more than ``limit`` plans."""
    validate_problem(problem)
    p = problem
    per_seg = []  # per segment: list of (variant, options of its ops)
    total = 1
    for s in range(p.num_segments):
        first, count = int(p.seg_first_op[s]), int(p.seg_num_ops[s])
        combos = []
        for v in range(int(p.seg_num_variants[s])):
            ranges = [range(int(p.opt_begin[i, v]), int(p.opt_end[i, v]))
                      for i in range(first, first + count)]
            combos.extend((v, opts) for opts in itertools.product(*ranges))
        per_seg.append(combos)
        total *= len(combos)
        if total > limit:
            raise ValueError(f"brute_force: more than {limit} plans; it is meant for small problems")
    best = None
    for plan in itertools.product(*per_seg):
        variant = [v for v, _ in plan]
        option_index = [o for _, opts in plan for o in opts]
        ok, t, ops_peak, _ = _ops_cost(p, option_index, variant)
        if ok and (best is None or t < best[0] or (t == best[0] and ops_peak < best[1])):
            best = (t, ops_peak, option_index, variant)
    if best is None or not _step_fits(p):
        return SearchResult(feasible=False, states_visited=total)
    t, _, option_index, variant = best
    _, _, peak, peak_op = evaluate_assignment(p, option_index, variant)
    return SearchResult(True, t, peak, peak_op, tuple(option_index), tuple(variant), total)


@functools.lru_cache(maxsize=None)
def _native():
    try:
        return importlib.import_module("osdp._C")
    except ImportError as err:
        raise ImportError(
            "the C++ search core osdp._C is not built; build it with "
            "`OSDP_SKIP_CUDA=1 python setup.py build_ext --inplace` (or `pip install -e .`) "
            f"from the repository root ({err})") from err


def search_cpp(problem: SearchProblem, isa: str = "auto", time_bound: float = math.inf) -> SearchResult:
    """The C++ core (osdp._C). Same plan as ``search_python``.

    ``isa`` picks the relax kernel ("auto": the widest the CPU runs; see
    ``osdp._C.available_isas()``); every kernel gives the same result. ``time_bound``:
    as in ``search``."""
    validate_problem(problem)
    C = _native()
    p = problem
    if not _step_fits(p):
        return SearchResult(feasible=False)
    r = C.search(**_native_arrays(p), isa=isa, time_bound=float(time_bound))
    if not r["feasible"]:
        return SearchResult(feasible=False, states_visited=int(r["states_visited"]))
    return _result(p, r["time_s"], r["peak_inner_bytes"], r["option_index"].tolist(),
                   r["variant"].tolist(), r["states_visited"])


_warned_fallback = False


def feasible_cpp(problem: SearchProblem) -> bool:
    """``feasible_python`` in the C++ core (osdp._C)."""
    validate_problem(problem)
    if not _step_fits(problem):
        return False
    return bool(_native().feasible(**_native_arrays(problem)))


def _native_arrays(p: SearchProblem) -> dict:
    """The keyword arguments osdp._C's functions take for ``p``."""
    arrays = {name: np.ascontiguousarray(getattr(p, name)) for name in (
        "seg_first_op", "seg_num_ops", "seg_num_variants", "seg_carry_act_q",
        "seg_extra_time_s", "act_in_segment_bytes", "opt_begin", "opt_end", "opt_held_q",
        "opt_local_bytes", "opt_time_s")}
    return dict(arrays, quantum_bytes=float(p.quantum_bytes), budget_bytes=float(p.budget_bytes),
                constant_time_s=float(p.constant_time_s), max_buckets=MAX_BUCKETS)


def _native_backend(backend: str) -> bool:
    """Whether ``backend`` ("cpp", "python" or "auto") runs the C++ core: "auto" does
    when it is built (else the reference, with a one-time warning)."""
    global _warned_fallback
    if backend not in ("auto", "cpp", "python"):
        raise ValueError(f"backend must be 'auto', 'cpp' or 'python', got {backend!r}")
    if backend != "auto":
        return backend == "cpp"
    try:
        _native()
    except ImportError as err:
        if not _warned_fallback:
            warnings.warn(f"{err}; using the (slower) Python search", RuntimeWarning, stacklevel=3)
            _warned_fallback = True
        return False
    return True


# [Note: Lagrangian bound]
# Whether a problem has a plan faster than a time bound is often settled before any DP:
# keep one memory constraint, "the state entering op J+1 is at most L_J" (J the last op
# of a segment; L_J the largest last fitting state of op J+1's options less their held
# buckets, +1 against the division's rounding: every feasible plan meets it), and move
# it into the objective at a price lam >= 0 per bucket. For every such J and lam,
#     constant - lam * L_J
#     + sum over the segments up to J's of the least over variants of
#         (extra + lam * carry + sum over its ops of the least (time + lam * held_q))
#     + sum over the later segments of the least over variants of (extra + sum of least time)
# is at most the time of every feasible plan (the priced term is <= 0 for one), so when
# one (J, lam) puts it above the bound, no plan beats the bound and no DP is run. The
# batch sweep's searches at batches that cannot win stop here (a 96x12288 GPT's DP only
# ruled them out near its last ops, its memory-blind time bound being too loose). The
# sums are floats in another order than a plan's: the bound must exceed time_bound by
# 1e-9 of the largest magnitude the terms could sum to (rounding is ~1e-13 of it).
def cannot_beat(problem: SearchProblem, time_bound: float) -> bool:
    """Whether the Lagrangian bound ([Note: Lagrangian bound]) shows that no plan of
    ``problem`` is faster than ``time_bound``; False: not shown (the search decides).
    ``problem`` is taken as validated. Prices: a coarse decade grid, then a finer one
    around the decade that came closest."""
    p = problem
    if not time_bound < math.inf or p.num_segments < 2:
        return False
    margin = _bound_margin(p, time_bound)
    unit = margin.unit
    coarse = [unit * 10.0 ** k for k in range(-4, 3)]
    margins = [margin(price) for price in coarse]
    if max(margins) > 0:
        return True
    best = coarse[int(np.argmax(margins))]
    return any(margin(best * 10.0 ** (k / 6)) > 0 for k in (-5, -4, -3, -2, -1, 1, 2, 3, 4, 5))


class _bound_margin:
    """``margin(price)``: the largest over J of the Lagrangian bound less time_bound and
    the rounding slack; > 0 proves that no plan beats time_bound."""

    def __init__(self, p: SearchProblem, time_bound: float):
        begin, end = p.opt_begin.reshape(-1), p.opt_end.reshape(-1)
        self.p, self.time_bound = p, time_bound
        self.runs = np.flatnonzero(end > begin)  # (op, variant) ranges with options, row-major
        lengths = end[self.runs] - begin[self.runs]
        self.starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        idx = np.repeat(begin[self.runs] - self.starts, lengths) + np.arange(lengths.sum(), dtype=np.int64)
        self.time, self.held = p.opt_time_s[idx], p.opt_held_q[idx].astype(np.float64)
        self.largest_time = self._per_run(np.abs(self.time), np.maximum, 0.0)
        self.largest_held = self._per_run(self.held, np.maximum, 0.0)
        self.carry = p.seg_carry_act_q.astype(np.float64)
        self.carry[-1] = 0.0  # the last segment's carry is never held
        self.limit = self._entry_limits(idx, lengths)  # L_J per segment but the last
        free, free_size = self._segments(0.0)
        self.tail = np.cumsum(free[::-1])[::-1][1:]  # the segments after J's, unpriced
        self.tail_size = free_size.sum()
        self.unit = max(abs(float(p.constant_time_s) + free.sum()), 1e-300) / max(
            float(p.budget_bytes) / float(p.quantum_bytes), 1.0)

    def __call__(self, price: float) -> float:
        p = self.p
        least, size = self._segments(price)
        with np.errstate(invalid="ignore"):  # inf - inf where an op fits nowhere: not shown
            bound = float(p.constant_time_s) - price * self.limit + np.cumsum(least)[:-1] + self.tail
            slack = 1e-9 * (abs(float(p.constant_time_s)) + abs(self.time_bound) + price * np.abs(self.limit)
                            + size.sum() + self.tail_size)
            margin = bound - (self.time_bound + slack)
        return float(np.nanmax(margin)) if np.any(~np.isnan(margin)) else -math.inf

    def _per_run(self, values: np.ndarray, ufunc, empty: float) -> np.ndarray:
        out = np.full(2 * self.p.num_ops, empty)
        if len(self.runs):
            out[self.runs] = ufunc.reduceat(values, self.starts)
        return out

    def _segments(self, price: float):
        """Per segment: the least over its variants of extra + price * carry + its ops'
        least time + price * held_q; and a bound of the magnitude of that sum."""
        p = self.p
        least = self._per_run(self.time + price * self.held, np.minimum, np.inf)
        size = self.largest_time + price * self.largest_held
        out, mag = np.full(p.num_segments, np.inf), np.zeros(p.num_segments)
        for v in range(2):
            total = p.seg_extra_time_s[:, v] + price * self.carry[:, v] + np.add.reduceat(least[v::2], p.seg_first_op)
            out = np.where(p.seg_num_variants > v, np.minimum(out, total), out)
            mag = np.maximum(mag, np.abs(p.seg_extra_time_s[:, v]) + price * self.carry[:, v]
                             + np.add.reduceat(size[v::2], p.seg_first_op))
        return out, mag

    def _entry_limits(self, idx: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """L_J ([Note: Lagrangian bound]) per segment but the last: the largest state a
        feasible plan enters the next segment's first op with (-inf: no option fits)."""
        p = self.p
        q, budget = float(p.quantum_bytes), float(p.budget_bytes)
        act = p.act_in_segment_bytes.reshape(-1)[np.repeat(self.runs, lengths)]
        last = np.floor((budget - act - p.opt_local_bytes[idx]) / q) + 1 - self.held
        per_run = self._per_run(last, np.maximum, -np.inf)
        first = p.seg_first_op[1:]
        return np.maximum(per_run[2 * first], np.where(p.seg_num_variants[1:] > 1, per_run[2 * first + 1], -np.inf))


def search(problem: SearchProblem, backend: str = "auto", time_bound: float = math.inf) -> SearchResult:
    """The exact optimum of ``problem``. backend: "cpp", "python" or "auto"
    (the C++ core if it is built, else the reference, with a one-time warning).
    ``time_bound``: only a plan faster than it is wanted: the optimum when its time is
    below it, else a result that is not feasible (faster to find: a bound may settle it
    before the search, [Note: Lagrangian bound], and the DP drops the states that cannot
    beat it, [Note: time bound] in csrc/search/search.cpp)."""
    if time_bound < math.inf:
        validate_problem(problem)
        if cannot_beat(problem, time_bound):
            return SearchResult(feasible=False)
    if _native_backend(backend):
        return search_cpp(problem, time_bound=time_bound)
    return search_python(problem, time_bound)


def feasible(problem: SearchProblem, backend: str = "auto") -> bool:
    """Whether any plan of ``problem`` fits: ``search(problem).feasible`` without the
    search ([Note: feasibility]). backend: as in ``search``."""
    if _native_backend(backend):
        return feasible_cpp(problem)
    return feasible_python(problem)
