"""Exact search: the C++ core and the numpy reference against brute-force enumeration.

Set OSDP_REQUIRE_NATIVE=1 to make a missing osdp._C a failure instead of a skip.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from osdp.planner import search as S
from osdp.planner.search_problem import SearchProblem, SearchResult


def build_problem(segments, *, quantum=1.0, limit=10.0, static=0.0, constant=0.0):
    """segments: list of dicts {"variants": [{"ops": [{"act": a, "options": [(held_q,
    local_bytes, time_s), ...]}, ...], "carry": c, "extra": e}, ...]}; every variant of a
    segment has the same number of ops."""
    nseg = len(segments)
    n = sum(len(seg["variants"][0]["ops"]) for seg in segments)
    first, count, nvar = [], [], []
    carry = np.zeros((nseg, 2), np.int64)
    extra = np.zeros((nseg, 2))
    act = np.zeros((n, 2))
    begin = np.zeros((n, 2), np.int64)
    end = np.zeros((n, 2), np.int64)
    held, local, time = [], [], []
    i0 = 0
    for s, seg in enumerate(segments):
        k = len(seg["variants"][0]["ops"])
        first.append(i0)
        count.append(k)
        nvar.append(len(seg["variants"]))
        for j in range(k):
            for v, var in enumerate(seg["variants"]):
                op = var["ops"][j]
                act[i0 + j, v] = op["act"]
                begin[i0 + j, v] = len(held)
                for h, l, t in op["options"]:
                    held.append(h)
                    local.append(l)
                    time.append(t)
                end[i0 + j, v] = len(held)
        for v, var in enumerate(seg["variants"]):
            carry[s, v] = var.get("carry", 0)
            extra[s, v] = var.get("extra", 0.0)
        i0 += k
    P = len(held)
    return SearchProblem(
        seg_first_op=np.array(first, np.int64), seg_num_ops=np.array(count, np.int64),
        seg_num_variants=np.array(nvar, np.int64), seg_carry_act_q=carry,
        seg_extra_time_s=extra, act_in_segment_bytes=act, opt_begin=begin, opt_end=end,
        opt_slices=np.ones(P, np.int64), opt_zdp_slices=np.zeros(P, np.int64),
        opt_held_q=np.array(held, np.int64), opt_local_bytes=np.array(local, np.float64),
        opt_time_s=np.array(time, np.float64), quantum_bytes=quantum, limit_bytes=limit,
        static_bytes=static, constant_time_s=constant)


def random_problem(rng: np.random.Generator, *, dyadic: bool, ties: bool = False,
                   max_plans: int = 4000):
    """Small random instance; dyadic=True makes every time a multiple of 1/8 so that
    time sums are exact and the peak tie-break is exact too; ties=True draws times and
    memory from a few values so that many plans tie exactly (tie-break order)."""
    while True:
        shape = [(int(rng.integers(1, 4)), int(rng.integers(1, 3)))
                 for _ in range(int(rng.integers(1, 5)))]  # (ops, variants) per segment
        nopts = [[[int(rng.integers(1, 7)) for _ in range(k)] for _ in range(nv)]
                 for k, nv in shape]
        plans = math.prod(sum(math.prod(o) for o in seg) for seg in nopts)
        if plans <= max_plans:
            break
    quantum = float(rng.choice([1.0, 0.1, 3.7e6, 2.0**20]))

    def rtime():
        if ties:
            return float(rng.integers(0, 2))
        if dyadic:
            return float(rng.integers(0, 24)) / 8
        return float(rng.choice([rng.uniform(0, 3), float(rng.integers(0, 4))]))

    options_pool = []  # to copy options from, for exact ties
    segments = []
    for (k, nv), seg_opts in zip(shape, nopts):
        variants = []
        for v in range(nv):
            ops = []
            for j in range(k):
                opts = []
                for _ in range(seg_opts[v][j]):
                    if options_pool and rng.random() < 0.15:
                        opt = options_pool[int(rng.integers(len(options_pool)))]
                    else:
                        local = float(rng.integers(0, 2)) if ties else float(rng.uniform(0, 4))
                        opt = (int(rng.integers(0, 3 if ties else 6)), local * quantum, rtime())
                    options_pool.append(opt)
                    opts.append(opt)
                act = 0.0 if ties or rng.random() < 0.3 else float(rng.uniform(0, 3)) * quantum
                ops.append({"act": act, "options": opts})
            variants.append({"ops": ops, "carry": int(rng.integers(0, 7)) if v == 0 else int(rng.integers(0, 3)),
                             "extra": rtime()})
        segments.append({"variants": variants})
    static = float(rng.choice([0.0, 1.5 * quantum, rng.uniform(0, 5) * quantum]))
    constant = rtime()
    p = build_problem(segments, quantum=quantum, limit=1.0, static=static, constant=constant)
    mode = rng.random()
    if mode < 0.1:  # static alone exceeds the limit
        limit = static * 0.5 - quantum
    elif mode < 0.4:  # exactly the peak of a random plan: the constraint is tight
        variant = [int(rng.integers(0, nv)) for _, nv in shape]
        opt = []
        for s, v in enumerate(variant):
            for i in range(int(p.seg_first_op[s]), int(p.seg_first_op[s] + p.seg_num_ops[s])):
                opt.append(int(rng.integers(p.opt_begin[i, v], p.opt_end[i, v])))
        limit = S.evaluate_assignment(p, opt, variant)[2]
    else:
        limit = static + float(rng.uniform(0, 25)) * quantum
    return build_problem(segments, quantum=quantum, limit=limit, static=static, constant=constant)


def native_or_skip():
    try:
        return S._native()
    except ImportError as err:
        if os.environ.get("OSDP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"OSDP_REQUIRE_NATIVE=1 but {err}")
        pytest.skip(f"osdp._C not built: {err}")


def native_isas():
    """Every relax kernel of osdp._C this CPU runs; [] (or a failure) without osdp._C."""
    try:
        return list(native_or_skip().available_isas())
    except pytest.skip.Exception:
        return []


BACKENDS = ["python", "cpp"]


def run(problem, backend):
    """search() with that backend; for "cpp", every kernel must agree."""
    if backend == "cpp":
        results = [S.search_cpp(problem, isa=isa) for isa in native_or_skip().available_isas()]
        assert all(r == results[0] for r in results)
    return S.search(problem, backend=backend)


def check_plan(problem, r: SearchResult):
    """The returned plan, re-evaluated, is feasible and costs what the search says."""
    ok, t, peak, peak_op = S.evaluate_assignment(problem, r.option_index, r.variant)
    assert ok
    assert t == r.time_s
    assert peak == r.peak_bytes and peak_op == r.peak_op
    assert peak <= problem.limit_bytes


@pytest.mark.parametrize("kind", ["float", "dyadic", "ties"])
@pytest.mark.parametrize("seed", range(6))
def test_random_against_brute_force(seed, kind):
    dyadic, ties = kind != "float", kind == "ties"
    rng = np.random.default_rng([seed, len(kind)])
    isas = native_isas()
    nfeasible = 0
    for _ in range(25):  # 3 x 6 x 25 = 450 instances
        p = random_problem(rng, dyadic=dyadic, ties=ties)
        bf = S.brute_force(p)
        py = S.search_python(p)
        assert py.feasible == bf.feasible
        if bf.feasible:
            nfeasible += 1
            # exact: the DP min of the float sums equals the enumerated min
            assert py.time_s == bf.time_s
            check_plan(p, py)
            if dyadic:  # time sums exact -> the lexicographic (time, peak) DP is exact
                assert py.peak_bytes == bf.peak_bytes
        for isa in isas:  # every kernel: same plan as the reference, not only the same optimum
            cpp = S.search_cpp(p, isa=isa)
            assert cpp == py and cpp.states_visited == py.states_visited
    assert nfeasible >= 5  # the generator must produce feasible instances too


def test_generator_covers_cases():
    rng = np.random.default_rng(7)
    kinds = set()
    for _ in range(200):
        p = random_problem(rng, dyadic=False)
        r = S.brute_force(p)
        kinds.add(("feasible", r.feasible))
        kinds.add(("variants", int(p.seg_num_variants.max())))
        kinds.add(("segments", p.num_segments))
    assert {("feasible", True), ("feasible", False), ("variants", 2), ("segments", 4)} <= kinds


def medium_problem(rng, nseg=20, ops=3, nopt=8, quantum=1.0):
    segments = []
    for _ in range(nseg):
        variants = []
        for v in range(2):
            ops_ = [{"act": float(rng.uniform(0, 50)),
                     "options": [(int(rng.integers(0, 40)), float(rng.uniform(0, 30)),
                                  float(rng.uniform(0, 1))) for _ in range(nopt)]}
                    for _ in range(ops)]
            variants.append({"ops": ops_, "carry": int(rng.integers(20, 60)) if v == 0 else 5,
                             "extra": 0.0 if v == 0 else float(rng.uniform(0, 1))})
        segments.append({"variants": variants})
    return build_problem(segments, quantum=quantum, limit=float(rng.uniform(600, 1500)),
                         static=10.0, constant=0.5)


@pytest.mark.parametrize("seed", range(4))
def test_cpp_matches_python_medium(seed):
    isas = native_or_skip().available_isas()
    assert "scalar" in isas
    p = medium_problem(np.random.default_rng(seed))
    py = S.search_python(p)
    for isa in isas:
        cpp = S.search_cpp(p, isa=isa)
        assert cpp == py and cpp.states_visited == py.states_visited
    if py.feasible:
        check_plan(p, py)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_states_are_dropped(backend):
    # op 0 may keep 5 buckets, but op 1 runs with 6 of act in a budget of 10: only a
    # prefix <= 4 - 0 can still finish, so op 0's state 5 is dead ([Note: dead states])
    ops = [{"act": 0.0, "options": [(5, 0.0, 1.0), (1, 0.0, 2.0), (0, 0.0, 3.0)]},
           {"act": 6.0, "options": [(0, 0.0, 1.0)]}]
    p = one_seg(ops, limit=10.0)
    r = run(p, backend)
    assert r == S.brute_force(p) and r.option_index == (1, 3)
    # visited: op 0 from state 0 (1), op 1 from states 0..1 (2); state 5 never entered
    assert r.states_visited == 3


@pytest.mark.parametrize("seed", range(4))
def test_time_bound_keeps_the_optimum(seed):
    """A bound above the optimum returns the very same plan, one at or below it none,
    and both backends drop the same states ([Note: time bound])."""
    rng = np.random.default_rng([seed, 35])
    isas = native_isas()
    for _ in range(60):
        p = random_problem(rng, dyadic=seed % 2 == 1, ties=seed == 2)
        full = S.search_python(p)
        bounds = [math.inf, 1e30, 0.5]
        if full.feasible:
            t = full.time_s
            bounds += [t, float(np.nextafter(t, math.inf)), t * 0.9 - 1e-3, t + 0.25, t * 2 + 1]
        for bound in bounds:
            py = S.search_python(p, time_bound=bound)
            assert py == (full if full.feasible and full.time_s < bound else SearchResult(feasible=False))
            for isa in isas:
                cpp = S.search_cpp(p, isa=isa, time_bound=bound)
                assert cpp == py and cpp.states_visited == py.states_visited


# seeds 2 and 3 of the two brute-force sweeps below (about 1.5 s each) with the slow tests
SEEDS_0_1_DEFAULT = [0, 1] + [pytest.param(seed, marks=pytest.mark.slow) for seed in (2, 3)]


@pytest.mark.parametrize("kind", ["float", "ties"])
@pytest.mark.parametrize("seed", SEEDS_0_1_DEFAULT)
def test_feasible_is_the_search_answer(seed, kind):
    """[Note: feasibility]: the one-pass walk says what the DP and enumeration say."""
    rng = np.random.default_rng([seed, 36, len(kind)])
    answers = set()
    for _ in range(150):
        p = random_problem(rng, dyadic=False, ties=kind == "ties")
        answer = S.feasible_python(p)
        assert answer == S.search_python(p).feasible == S.brute_force(p).feasible
        if native_isas():
            assert S.feasible_cpp(p) == answer
        answers.add(answer)
    for seed_ in range(3):
        p = medium_problem(np.random.default_rng([seed, seed_]))
        assert S.feasible(p, backend="python") == S.search_python(p).feasible == S.feasible(p)
    assert answers == {True, False}


@pytest.mark.parametrize("seed", SEEDS_0_1_DEFAULT)  # seeds 0 and 1: float and dyadic problems
def test_lagrangian_bound_never_hides_a_faster_plan(seed):
    """[Note: Lagrangian bound]: whatever it proves holds (no plan under the bound)."""
    rng = np.random.default_rng([seed, 37])
    proved = 0
    for _ in range(120):
        p = random_problem(rng, dyadic=seed % 2 == 1)
        full = S.search_python(p)
        bounds = [0.5, 2.0, 10.0] + ([full.time_s * f for f in (0.3, 0.6, 0.9, 0.99, 1.0)] +
                                     [float(np.nextafter(full.time_s, math.inf))] if full.feasible else [])
        for bound in bounds:
            if S.cannot_beat(p, bound):
                proved += 1
                assert not (full.feasible and full.time_s < bound)
                assert not S.search(p, time_bound=bound).feasible
    assert proved > 0


def test_lagrangian_bound_prices_memory():
    # op A keeps 10 buckets to run in 1 s, or none in 3 s; op B (next segment) runs
    # with 8 of act in a budget of 10: A cannot keep, the optimum is 3 + 1 = 4, and the
    # price of memory shows it though every op's fastest option sums to 2
    p = build_problem([{"variants": [{"ops": [{"act": 0.0, "options": [(10, 0.0, 1.0), (0, 0.0, 3.0)]}]}]},
                       {"variants": [{"ops": [{"act": 8.0, "options": [(0, 0.0, 1.0)]}]}]}], limit=10.0)
    assert S.search_python(p).time_s == 4.0
    assert S.cannot_beat(p, 3.3) and not S.cannot_beat(p, 4.0)
    assert not S.search(p, time_bound=3.3).feasible and S.search(p, time_bound=4.5).time_s == 4.0


@pytest.mark.parametrize("seed", range(2))
def test_time_bound_drops_slow_states(seed):
    p = medium_problem(np.random.default_rng(seed))
    full = S.search_python(p)
    assert full.feasible
    for backend in ("python",) + (("cpp",) if native_isas() else ()):
        near = S.search(p, backend=backend, time_bound=full.time_s * 1.01)
        below = S.search(p, backend=backend, time_bound=full.time_s * 0.9)
        assert near == full and not below.feasible
        assert below.states_visited < near.states_visited < full.states_visited


def one_seg(ops, variants_extra=None, **kw):
    return build_problem([{"variants": [{"ops": ops}]}], **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_infeasible(backend):
    # every option of the op needs more than the budget
    p = one_seg([{"act": 0.0, "options": [(11, 0.0, 1.0), (0, 11.0, 2.0)]}], limit=10.0)
    r = run(p, backend)
    assert not r.feasible and math.isinf(r.time_s) and r.option_index == ()
    assert not S.brute_force(p).feasible
    # static alone above the limit
    p = one_seg([{"act": 0.0, "options": [(0, 0.0, 1.0)]}], limit=10.0, static=11.0)
    assert not run(p, backend).feasible


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_op_picks_fastest_that_fits(backend):
    opts = [(9, 0.0, 1.0), (4, 1.0, 2.0), (0, 2.0, 3.0)]  # faster = holds more
    p = one_seg([{"act": 3.0, "options": opts}], limit=10.0, static=2.0, constant=0.25)
    r = run(p, backend)  # op memory 4 + 3 + 1 = 8 <= 8; 9 + 3 > 8
    assert r.feasible and r.option_index == (1,)
    assert r.time_s == 2.25 and r.peak_bytes == 10.0 and r.peak_op == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tight_bound_is_inclusive_and_float_exact(backend):
    # 3 * 0.1 = 0.30000000000000004 > 0.3: a state of 3 buckets does not fit 0.3 bytes
    opts = [(3, 0.0, 1.0), (2, 0.0, 2.0)]
    p = one_seg([{"act": 0.0, "options": opts}], quantum=0.1, limit=0.3)
    r = run(p, backend)
    assert r.option_index == (1,) and r == S.brute_force(p)
    p = one_seg([{"act": 0.0, "options": opts}], quantum=0.1, limit=3 * 0.1)
    assert run(p, backend).option_index == (0,)
    # B is not floor(budget / quantum): 3 * 0.7 fits in fl(3 * 0.7) though
    # floor(fl(3 * 0.7) / 0.7) == 2, and 5 * 0.7 does not fit in the next float below
    # although floor(that / 0.7) == 5
    p = one_seg([{"act": 0.0, "options": [(3, 0.0, 1.0), (2, 0.0, 2.0)]}], quantum=0.7, limit=3 * 0.7)
    assert math.floor(p.budget_bytes / 0.7) == 2 and S.num_buckets(p) == 3
    assert run(p, backend).option_index == (0,) == S.brute_force(p).option_index
    below = float(np.nextafter(5 * 0.7, 0))
    p = one_seg([{"act": 0.0, "options": [(5, 0.0, 1.0), (4, 0.0, 2.0)]}], quantum=0.7, limit=below)
    assert math.floor(p.budget_bytes / 0.7) == 5 and S.num_buckets(p) == 4
    assert run(p, backend).option_index == (1,) == S.brute_force(p).option_index


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties(backend):
    # exact duplicates: the lower index wins; equal time: the lower peak wins
    p = one_seg([{"act": 0.0, "options": [(2, 1.0, 1.0), (2, 1.0, 1.0), (1, 1.0, 1.0), (1, 0.5, 1.0)]}],
                limit=10.0)
    assert run(p, backend).option_index == (3,)
    p = one_seg([{"act": 0.0, "options": [(2, 1.0, 1.0), (2, 1.0, 1.0)]}], limit=10.0)
    assert run(p, backend).option_index == (0,)
    # the lower peak across ops: op 0 keeps 3 and op 1 keeps 0, or the other way round
    ops = [{"act": 0.0, "options": [(3, 0.0, 1.0), (0, 4.0, 1.0)]},
           {"act": 0.0, "options": [(0, 0.0, 1.0), (3, 2.0, 1.0)]}]
    p = one_seg(ops, limit=100.0)
    r = run(p, backend)
    assert r.time_s == 2.0 and r.peak_bytes == S.brute_force(p).peak_bytes == 3.0
    assert r.option_index == (0, 2)
    # equal (time, peak) reaching one state from two states: the first option wins
    # ((A, C) and (B, D) both cost 1 with peak 1; (A, D) would need 2 buckets)
    ops = [{"act": 0.0, "options": [(1, 0.0, 0.0), (0, 0.0, 1.0)]},
           {"act": 0.0, "options": [(0, 0.0, 1.0), (1, 0.0, 0.0)]}]
    r = run(one_seg(ops, limit=1.0), backend)
    assert r.option_index == (0, 2) and r.time_s == 1.0 and r.peak_bytes == 1.0
    # equal (time, peak) in two end states: the lower state wins
    r = run(one_seg([{"act": 0.0, "options": [(1, 0.0, 1.0), (0, 1.0, 1.0)]}], limit=5.0), backend)
    assert r.option_index == (1,)
    # equal variants: variant 0 wins
    var = {"ops": [{"act": 0.0, "options": [(0, 1.0, 1.0)]}], "carry": 0, "extra": 0.5}
    r = run(build_problem([{"variants": [var, dict(var)]}], limit=5.0), backend)
    assert r.variant == (0,) and r.time_s == 1.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpointing_required_to_fit(backend):
    # segment 0 saves 8 buckets without checkpointing; segment 1's op needs 5
    seg0 = {"variants": [
        {"ops": [{"act": 4.0, "options": [(0, 1.0, 1.0)]}], "carry": 8, "extra": 0.0},
        {"ops": [{"act": 4.0, "options": [(0, 1.0, 1.0)]}], "carry": 1, "extra": 0.5}]}
    seg1 = {"variants": [{"ops": [{"act": 0.0, "options": [(0, 5.0, 1.0)]}]}]}
    p = build_problem([seg0, seg1], limit=10.0)
    r = run(p, backend)
    assert r.feasible and r.variant == (1, 0) and r.time_s == 2.5
    assert r.peak_bytes == 6.0 and r.peak_op == 1
    # with room, no checkpointing
    p = build_problem([seg0, seg1], limit=13.0)
    assert run(p, backend).variant == (0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_constraint_binding_in_the_middle(backend):
    # op 1 has a big transient buffer: op 0 must not keep its weights (dp), though op 2
    # could afford keeping everything at the end
    ops = [{"act": 0.0, "options": [(4, 0.0, 1.0), (0, 0.0, 2.0)]},
           {"act": 0.0, "options": [(0, 7.0, 1.0)]},
           {"act": 0.0, "options": [(6, 0.0, 1.0), (0, 0.0, 2.0)]}]
    p = one_seg(ops, limit=10.0)
    r = run(p, backend)
    assert r.option_index == (1, 2, 3) and r.time_s == 4.0
    assert r.peak_op == 1 and r.peak_bytes == 7.0
    assert r == S.brute_force(p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_segment_carry_is_not_a_constraint(backend):
    # [Note: the memory constraint] is checked at ops only; nothing runs after the last
    # segment, so its carried activations cannot make the plan infeasible
    segs = [{"variants": [{"ops": [{"act": 1.0, "options": [(2, 0.0, 1.0)]}], "carry": 100}]}]
    p = build_problem(segs, limit=5.0)
    r = run(p, backend)
    assert r.feasible and r == S.brute_force(p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_option_range_makes_variant_infeasible(backend):
    seg = {"variants": [{"ops": [{"act": 0.0, "options": []}]},
                        {"ops": [{"act": 0.0, "options": [(0, 1.0, 3.0)]}], "extra": 1.0}]}
    p = build_problem([seg], limit=5.0)
    r = run(p, backend)
    assert r.variant == (1,) and r.time_s == 4.0


def _bad(p, **changes):
    import dataclasses
    return dataclasses.replace(p, **changes)


BAD_INPUTS = {
    "dtype": (lambda p: _bad(p, opt_held_q=p.opt_held_q.astype(np.int32)), "opt_held_q must have dtype int64"),
    "float dtype": (lambda p: _bad(p, opt_time_s=p.opt_time_s.astype(np.float32)), "opt_time_s must have dtype float64"),
    "not array": (lambda p: _bad(p, opt_time_s=list(p.opt_time_s)), "opt_time_s must be a numpy array"),
    "shape": (lambda p: _bad(p, act_in_segment_bytes=p.act_in_segment_bytes[:, :1].copy()), "act_in_segment_bytes has shape"),
    "segments": (lambda p: _bad(p, seg_first_op=np.array([0, 2], np.int64)), "contiguous"),
    "variants": (lambda p: _bad(p, seg_num_variants=np.array([3, 1], np.int64)), "seg_num_variants must be 1 or 2"),
    "range": (lambda p: _bad(p, opt_end=p.opt_end + 5), "not inside"),
    "negative held": (lambda p: _bad(p, opt_held_q=-p.opt_held_q - 1), "opt_held_q must be >= 0"),
    "negative local": (lambda p: _bad(p, opt_local_bytes=-p.opt_local_bytes - 1), "opt_local_bytes must be >= 0"),
    "nan": (lambda p: _bad(p, opt_time_s=p.opt_time_s * np.nan), "opt_time_s must be finite"),
    "quantum": (lambda p: _bad(p, quantum_bytes=0.0), "quantum_bytes must be > 0"),
    "limit": (lambda p: _bad(p, limit_bytes=math.inf), "limit_bytes must be a finite number"),
    "buckets": (lambda p: _bad(p, quantum_bytes=1e-9, opt_held_q=p.opt_held_q * 10**9), "use a larger quantum_bytes"),
}


def _small():
    seg0 = {"variants": [{"ops": [{"act": 1.0, "options": [(1, 1.0, 1.0), (0, 2.0, 2.0)]}], "carry": 1},
                         {"ops": [{"act": 0.5, "options": [(1, 1.0, 1.5)]}], "carry": 0}]}
    seg1 = {"variants": [{"ops": [{"act": 0.0, "options": [(2, 0.0, 1.0)]}]}]}
    return build_problem([seg0, seg1], limit=20.0)


@pytest.mark.parametrize("case,backend", [
    (case, backend) for case in sorted(BAD_INPUTS) for backend in BACKENDS + ["brute"]
    if not (case == "buckets" and backend == "brute")  # brute force has no buckets
])
def test_bad_inputs(case, backend):
    make, msg = BAD_INPUTS[case]
    p = make(_small())
    fn = S.brute_force if backend == "brute" else (lambda q: run(q, backend))
    with pytest.raises(ValueError, match=msg):
        fn(p)


def test_native_binding_checks_arrays():
    C = native_or_skip()
    p = _small()
    kw = dict(seg_first_op=p.seg_first_op, seg_num_ops=p.seg_num_ops,
              seg_num_variants=p.seg_num_variants, seg_carry_act_q=p.seg_carry_act_q,
              seg_extra_time_s=p.seg_extra_time_s, act_in_segment_bytes=p.act_in_segment_bytes,
              opt_begin=p.opt_begin, opt_end=p.opt_end, opt_held_q=p.opt_held_q,
              opt_local_bytes=p.opt_local_bytes, opt_time_s=p.opt_time_s,
              quantum_bytes=1.0, budget_bytes=20.0, constant_time_s=0.0, max_buckets=1 << 20)
    assert C.search(**kw)["feasible"]
    cases = {
        "opt_held_q": (p.opt_held_q.astype(np.int32), "dtype"),
        "opt_time_s": (np.ones(7), "shape"),
        "act_in_segment_bytes": (np.asfortranarray(np.ones((2, 3)))[:, :2], "contiguous"),
        "opt_end": (p.opt_end + 9, "range"),
        "seg_first_op": (np.array([0, 5], np.int64), "contiguous"),
    }
    for name, (value, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            C.search(**{**kw, name: value})
    with pytest.raises(ValueError, match="not available"):
        C.search(**kw, isa="sse9")


def test_evaluate_assignment_rejects_foreign_options():
    p = _small()
    assert S.evaluate_assignment(p, [0, 3], [0, 0])[0]
    with pytest.raises(ValueError, match="not an option of op 0 under variant 1"):
        S.evaluate_assignment(p, [0, 3], [1, 0])
    with pytest.raises(ValueError, match="need 2 option indices"):
        S.evaluate_assignment(p, [0], [0, 0])


def test_brute_force_refuses_large_problems():
    p = medium_problem(np.random.default_rng(0))
    with pytest.raises(ValueError, match="more than"):
        S.brute_force(p)


def test_backend_argument():
    with pytest.raises(ValueError, match="backend"):
        S.search(_small(), backend="fortran")
    assert S.search(_small(), backend="auto").feasible


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_arrays_are_accepted(backend):
    import dataclasses
    p = _small()
    wide = np.repeat(p.opt_time_s, 2)  # a non-contiguous view with the same values
    q = dataclasses.replace(p, opt_time_s=wide[::2])
    assert not q.opt_time_s.flags.c_contiguous
    assert run(q, backend) == S.search_python(p)
