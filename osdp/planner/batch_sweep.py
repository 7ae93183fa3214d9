"""Batch scheduler: the batch size and plan with the most samples per second.

[Note: exact batch sweep]
Memory grows with the batch for every plan, so feasibility is monotone in b: the largest
feasible batch is found by doubling then bisection (from a first guess read off the
least-memory plan's bytes per sample), each probe an exact feasibility test over the
least-memory options only (``least_memory_problem``; ``search.feasible``, one pass
without a DP); at most ~2 log2(MAX_BATCH) probes.
The batches below it are then searched from the largest down while their throughput
bound b / (least possible step time at b, memory ignored) can beat the best plan found
so far; each search is told the step time it must beat (``search``'s ``time_bound``):
it drops the states that cannot, and returns no plan where the walk would have
discarded the one it found. That bound never decreases with b: every option's time is
a sum of terms max(intercept + slope * b, comm) and constants, with intercepts and
comm >= 0 (device.py checks them), so time / b never increases. Hence the walk stops at the first
batch whose bound cannot win: the result is the exact maximum of samples/s over all
batch sizes, at a few searches instead of one per batch. When even MAX_BATCH fits
(a huge memory limit), the sweep stops there and says so (``Scheduled.batch_capped``).

[Note: rep family]
Making a unit ``rep`` (replicated, DDP per unit: docs/design/cost_model.md's [Note: rep mode])
changes the static bytes (its whole parameters, optimizer state, maybe its ``.grad`` and
a param_dtype copy) and adds choice-independent per-op gradient bytes; the search takes
both as given. So the rep set is fixed per search problem, and under policy "osdp"
without ``rep_units`` the scheduler plans a family of rep sets and keeps the plan with
the most samples/s (``rep_family``):
    {}  and  R(tau) = {units whose parameter bytes <= tau}  for tau over the distinct
                                                             unit sizes, smallest first
(sizes in the model's dtype; a tied unit is one unit, its uses all rep; the largest tau
is every unit: DDP). Within each set every other unit keeps all its options (splits,
dp / zdp / hpz) and every rep unit has its one, and the batch sweep is exact, so the
result is the exact optimum over the union of these search spaces; it is not over all
2^units subsets. Why by size: replicating costs memory in proportion to the unit
(whole states instead of 1/N), while what it saves is the unit's gathers, whose latency
is the same for every unit and whose bandwidth part grows with it: per byte of memory
the small units save the most. (How much of a gather compute hides does not follow
size; a family ordered by time saved per byte would follow it, but that order depends
on the batch, which the sweep chooses: left out.) A set whose static
bytes alone exceed the limit is skipped, and so are the larger ones (static bytes grow
with tau). Sets are planned in that order, the empty set first (today's plan), and a
set replaces the best so far only when strictly faster (ties keep fewer rep units).
The bound that ends a batch sweep ([Note: exact batch sweep]) is shared across the
sets: a set is swept only while its bound can beat the best plan of the sets before
it, so a set that cannot win costs its feasibility probes only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InfeasiblePlanError, OSDPError
from ..sizes import format_bytes
from .collective_cost import LAYOUTS, spans_nodes
from .cost_model import (Estimate, PlannerSettings, ProblemTemplate, option_times, align_tied, build_template, evaluate,
                         option_local_bytes, static_bytes, template_optimizer_s, tied_choices, unit_indices)
from .model_desc import ModelDesc
from .device import DeviceInfo
from .search import feasible, search
from .search_problem import SearchProblem, SearchResult

MAX_BATCH = 1 << 20  # a sweep never goes past this (a model with nothing batch-dependent)


@dataclass(frozen=True)
class Scheduled:
    template: ProblemTemplate
    batch: int
    result: SearchResult
    estimate: Estimate | None  # exact bytes of the chosen plan (None: a losing rep set's, never priced)
    searches: int  # exact searches run (feasibility probes included)
    search_s: float  # wall time of the whole sweep
    batch_capped: bool = False  # the sweep stopped at max_batch, which fits: larger batches may too

    @property
    def accumulation_steps(self) -> int:
        return self.template.settings.accumulation_steps

    @property
    def samples_per_s(self) -> float:
        """Global samples per second: every micro-batch of every rank."""
        return self.batch * self.accumulation_steps * self.template.device.world_size / self.result.time_s


def _time_lower_bound(t: ProblemTemplate, batch: int) -> float:
    times = option_times(t, batch)
    best = np.full(len(t.desc.ops), np.inf)
    np.minimum.at(best, t.opt_op, times)
    return float(best.sum())


def _cannot_beat(t: ProblemTemplate, batch: int, time_s: float) -> bool:
    """Whether no plan of ``t`` at ``batch`` can be strictly faster than ``time_s``, even
    ignoring memory (a margin of 1e-12 for the bound's own rounding)."""
    return _time_lower_bound(t, batch) + template_optimizer_s(t) >= time_s * (1 + 1e-12)


def rep_family(desc: ModelDesc, settings: PlannerSettings) -> list[PlannerSettings]:
    """The settings of each rep set the scheduler plans ([Note: rep family]), in order:
    policy "osdp" without ``rep_units``: no rep unit, then the units of at most tau
    bytes for each distinct unit size tau; otherwise ``settings`` alone."""
    if settings.policy != "osdp" or settings.rep_units is not None:
        return [settings]
    units = [(desc.ops[i].param_bytes, desc.ops[i].name) for i in unit_indices(desc)]
    family = [settings.with_(rep_units=())]
    for tau in sorted({size for size, _ in units}):
        family.append(settings.with_(rep_units=tuple(name for size, name in units if size <= tau)))
    return family


def _templates(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings):
    """Every template ``schedule`` searches: per rep set of the family whose static
    bytes fit (none after the first that does not: they only grow), one per joint choice
    of tied units (cost_model.tied_choices)."""
    for i, member in enumerate(rep_family(desc, settings)):
        # the template's own static bytes, read before building the rest of it
        if i > 0 and sum(static_bytes(desc, device, member).values()) > device.memory_limit_bytes:
            return
        yield from tied_choices(build_template(desc, device, member))


def search_batch(t: ProblemTemplate, batch: int, backend: str = "auto", time_bound: float = math.inf) -> SearchResult:
    """The best plan of ``t`` at ``batch`` (``time_bound``: only one faster than that,
    else a result that is not feasible; see ``search``)."""
    result = search(t.problem(batch), backend=backend, time_bound=time_bound)
    if result.feasible:  # every use of a tied unit on one (g, k): cost_model.align_tied
        result = replace(result, option_index=align_tied(t, result.option_index, result.variant))
    return result


def memory_pareto_options(t: ProblemTemplate, batch: int) -> np.ndarray:
    """Indices of each op's memory-Pareto options at ``batch``: those no other option of
    the same op and variant beats in both kept and local bytes (time ignored). Per batch:
    a vocabulary head's options differ in how their bytes grow with it ([Note: fused
    vocabulary-split loss]). Cached on the template.
    All ops in one pass: options sorted by (op, variant), kept bytes, local bytes (a
    stable sort: exact ties keep the lower index first); one is kept where its local
    bytes are below those of every earlier option of its (op, variant): a running
    minimum over local-byte ranks shifted down group by group, so that no group sees
    the ones before it."""
    cache = t.__dict__.setdefault("_memory_pareto", {})
    if batch in cache:
        return cache[batch]
    local = option_local_bytes(t, batch)
    group = t.opt_op * 2 + t.opt_variant
    order = np.lexsort((local, t.opt_held_bytes, group))
    rank = np.unique(local, return_inverse=True)[1].reshape(-1).astype(np.int64)  # compared as ints
    shifted = rank[order] - (len(local) + 1) * group[order]
    keep = np.ones(len(order), dtype=bool)  # the first of each group always
    later = group[order][1:] == group[order][:-1]
    keep[1:] = ~later | (shifted[1:] < np.minimum.accumulate(shifted)[:-1])
    cache[batch] = np.sort(order[keep]).astype(np.int64)
    return cache[batch]


def least_memory_problem(t: ProblemTemplate, batch: int) -> SearchProblem:
    """``t``'s problem at ``batch`` with each op reduced to its memory-Pareto options.

    Every memory constraint is monotone in held and local bytes, so any feasible plan
    stays feasible when each op takes a memory-Pareto option that dominates its own: the
    reduced problem is feasible exactly when the full one is, and it searches in a
    fraction of the time (a few options per op instead of dozens)."""
    problem = t.problem(batch)
    chosen = memory_pareto_options(t, batch)
    counts = np.zeros(problem.opt_begin.size, dtype=np.int64)  # per (op, variant), row-major
    slot = t.opt_op[chosen] * 2 + t.opt_variant[chosen]
    np.add.at(counts, slot, 1)
    begin = np.concatenate(([0], np.cumsum(counts)[:-1])).reshape(-1, 2)
    end = begin + counts.reshape(-1, 2)
    return replace(
        problem,
        opt_begin=begin,
        opt_end=end,
        opt_slices=problem.opt_slices[chosen],
        opt_zdp_slices=problem.opt_zdp_slices[chosen],
        opt_held_q=problem.opt_held_q[chosen],
        opt_local_bytes=problem.opt_local_bytes[chosen],
        opt_time_s=problem.opt_time_s[chosen],
    )


def fits_at(t: ProblemTemplate, batch: int, backend: str = "auto") -> bool:
    """Whether any plan fits at ``batch``: the least-memory problem's feasibility, by the
    one-pass test ([Note: feasibility] in search.py), which answers as its search did."""
    return feasible(least_memory_problem(t, batch), backend=backend)


def beat_bound(batch: int, rate: float) -> float:
    """The step time a plan at ``batch`` must be under to beat ``rate`` (batch / step
    seconds), with a margin of 1e-9 so that no plan the caller's own ``batch / time_s >
    rate`` accepts is cut off by rounding; +inf when there is nothing to beat."""
    return batch / rate * (1 + 1e-9) if rate > 0 else math.inf


def finish_schedule(t, batch, result, searches, started, batch_capped=False, priced=True) -> Scheduled:
    """The Scheduled of ``result``, its exact bytes priced unless ``priced`` is False
    (a rep set's best, which another set may beat: ``schedule`` prices the winner)."""
    estimate = evaluate(t, batch, result.option_index, result.variant) if priced else None
    return Scheduled(t, batch, result, estimate, searches, time.perf_counter() - started, batch_capped)


def _priced(s: Scheduled) -> Scheduled:
    """``s`` with its estimate (exact bytes: [Note: exact gathers]), computed if missing."""
    if s.estimate is not None:
        return s
    return replace(s, estimate=evaluate(s.template, s.batch, s.result.option_index, s.result.variant))


def schedule(
    desc: ModelDesc,
    device: DeviceInfo,
    settings: PlannerSettings | None = None,
    batch: int | None = None,
    backend: str = "auto",
    max_batch: int = MAX_BATCH,
    global_batch: int | None = None,
) -> Scheduled:
    """Plan at a fixed ``batch``, or sweep batch sizes (``batch=None``) for the most
    samples per second, or reach ``global_batch`` samples per optimizer step with the
    fastest micro-batch size and gradient accumulation. Raises ``InfeasiblePlanError``
    when nothing fits at batch 1 (or at the requested batch)."""
    started = time.perf_counter()
    settings = settings or PlannerSettings()
    if settings.layout == "auto":
        return _schedule_layouts(desc, device, settings, batch, backend, max_batch, global_batch)
    if global_batch is not None:
        return _schedule_global(desc, device, settings or PlannerSettings(), global_batch, backend, started)
    best, errors, searches = None, [], 0
    # one template per rep set of the family ([Note: rep family]) and joint choice of tied
    # units (cost_model.tied_choices)
    # (the rep sets' bests are priced in exact bytes only once one has won: the pricing
    # plays the plan's gathers, and the sweep picks by time alone)
    for t in _templates(desc, device, settings):
        try:
            s = _schedule_template(t, batch, backend, max_batch, started, beat=best, priced=False)
        except InfeasiblePlanError as exc:
            errors.append(exc)
            continue
        searches += s.searches
        if s.result.feasible and (best is None or s.samples_per_s > best.samples_per_s):
            best = s
    if best is None:
        raise min(errors, key=lambda e: getattr(e, "min_bytes", math.inf) or math.inf)
    return replace(_priced(best), searches=searches, search_s=time.perf_counter() - started)


def _schedule_template(t: ProblemTemplate, batch, backend, max_batch, started,
                       beat: Scheduled | None = None, priced: bool = True) -> Scheduled:
    """``schedule`` on one template (see [Note: exact batch sweep]). ``beat``: the best
    plan of the templates searched before (same accumulation and world size): the sweep
    stops where its bound cannot beat it, and returns a Scheduled whose result is not
    feasible when no batch did. ``priced``: as in ``finish_schedule``."""
    if batch is not None:
        if beat is not None and _cannot_beat(t, batch, beat.result.time_s):
            # cannot be strictly faster at this batch, even ignoring memory
            return Scheduled(t, batch, SearchResult(feasible=False), beat.estimate, 0, time.perf_counter() - started)
        if beat is None:
            result = search_batch(t, batch, backend)
        elif not feasible(t.problem(batch), backend=backend):
            raise _infeasible(t, batch)
        else:  # it fits: only a plan faster than beat's is searched for (none: nothing to keep)
            result = search_batch(t, batch, backend, time_bound=beat_bound(batch, batch / beat.result.time_s))
            if not result.feasible:
                return Scheduled(t, batch, result, beat.estimate, 1, time.perf_counter() - started)
        if not result.feasible:
            raise _infeasible(t, batch)
        return finish_schedule(t, batch, result, 1, started, priced=priced)

    searches = 0
    results: dict[int, SearchResult] = {}

    def probe(b: int, rate: float) -> SearchResult:
        nonlocal searches
        searches += 1
        results[b] = search_batch(t, b, backend, time_bound=beat_bound(b, rate))
        return results[b]

    def fits(b: int) -> bool:
        nonlocal searches
        searches += 1  # counted as the search it replaced, so plans report the same count
        return fits_at(t, b, backend)

    if not fits(1):
        raise _infeasible(t, 1)
    lo, hi = 1, None  # lo feasible, hi infeasible
    # start the bracket at the batch where one least-memory plan (an upper bound on the
    # least memory, grown linearly in the batch) reaches the limit: usually 2 probes
    guess = _batch_guess(t, max_batch)
    if guess > 1:
        if fits(guess):
            lo = guess
        else:
            hi = guess
    while hi is None:
        nxt = min(lo * 2 if lo != guess else lo + 1, max_batch)
        if nxt == lo:
            break
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid

    constant_s = t.problem(1).constant_time_s
    best_b, best_rate = 0, -1.0 if beat is None else beat.batch / beat.result.time_s
    for b in range(lo, 0, -1):
        bound = b / (_time_lower_bound(t, b) + constant_s)
        if bound <= best_rate:
            break  # the bound never grows as b falls: no smaller batch can win
        r = probe(b, best_rate)  # not feasible: nothing at b beats best_rate
        if r.feasible and b / r.time_s > best_rate:
            best_b, best_rate = b, b / r.time_s
    if best_b == 0:  # nothing beats ``beat``
        return Scheduled(t, lo, SearchResult(feasible=False), beat.estimate, searches, time.perf_counter() - started)
    return finish_schedule(t, best_b, results[best_b], searches, started, batch_capped=hi is None and lo >= max_batch,
                           priced=priced)


def _schedule_layouts(desc, device, settings, batch, backend, max_batch, global_batch) -> Scheduled:
    """Layout "auto": plan every layout the run offers ("hsdp" only across nodes) and
    keep the one with the most samples/s ([Note: sharding layouts] in collective_cost.py)."""
    layouts = LAYOUTS if spans_nodes(device) else ("full",)
    best, error = None, None
    for layout in layouts:
        try:
            s = schedule(desc, device, settings.with_(layout=layout), batch=batch, backend=backend,
                         max_batch=max_batch, global_batch=global_batch)
        except InfeasiblePlanError as exc:
            error = exc
            continue
        if best is None or s.samples_per_s > best.samples_per_s:
            best = s
    if best is None:
        raise error
    return best


def _batch_guess(t: ProblemTemplate, max_batch: int) -> int:
    one, two = min_memory_estimate(t, 1).peak_bytes, min_memory_estimate(t, 2).peak_bytes
    per_sample = two - one
    if per_sample <= 0:
        return 1
    return int(max(1, min(max_batch, 1 + (t.device.memory_limit_bytes - one) // per_sample)))


def _schedule_global(desc, device, settings, global_batch, backend, started) -> Scheduled:
    """Every micro-batch size m that divides the per-device share of ``global_batch``
    (a = share / m micro-batches per step) is tried; the fastest step wins."""
    world = device.world_size
    if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) or global_batch < 1 \
            or global_batch % world:
        raise OSDPError(
            f"global batch {global_batch!r} must be a positive multiple of the world size {world}"
        )
    share = global_batch // world
    best, searches, smallest = None, 0, None
    for micro in _divisors(share)[::-1]:
        for t in _templates(desc, device, settings.with_(accumulation_steps=share // micro)):
            # the error names the smallest micro-batch's last template, one without rep units if any
            if smallest is None or (micro, bool(t.rep.any())) <= (smallest[1], bool(smallest[0].rep.any())):
                smallest = (t, micro)
            if best is not None and _cannot_beat(t, micro, best[1].time_s):
                continue
            searches += 1
            if not fits_at(t, micro, backend):
                continue
            searches += 1
            result = search_batch(t, micro, backend)
            if best is None or result.time_s < best[1].time_s:
                best = (t, result, micro)
    if best is None:
        raise _infeasible(*smallest)
    t, result, micro = best
    return finish_schedule(t, micro, result, searches, started)


def _divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (sqrt(n) steps: a huge global batch stays fast)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _infeasible(t: ProblemTemplate, batch: int) -> InfeasiblePlanError:
    """The error for 'nothing fits', with the smallest plan's exact memory and what to
    change: when gradient accumulators kept across micro-batches are part of the peak,
    first of all reducing after every micro-batch (which frees them)."""
    smallest, fits_at = least_memory_limit(t, batch)
    limit = t.device.memory_limit_bytes
    lines = ", ".join(f"{k} {format_bytes(v)}" for k, v in smallest.breakdown.items())
    advice = "raise the memory limit, add devices, or allow splitting/checkpointing"
    accumulators = smallest.breakdown.get("grad_accumulators", 0.0)
    if accumulators > 0:
        every = min_memory_estimate(build_template(t.desc, t.device, t.settings.with_(gradient_sync="every")), batch)
        switch = (f"reduce gradients after every micro-batch (--gradient-sync every; in the API "
                  f"PlannerSettings(gradient_sync='every')), which frees the {format_bytes(accumulators)} of unsharded "
                  f"gradient accumulators that gradient_sync='last' keeps across the "
                  f"{t.settings.accumulation_steps} micro-batches; with that the least-memory plan needs "
                  f"{format_bytes(every.peak_bytes)}")
        advice = switch + (f", within the {format_bytes(limit)} limit" if every.peak_bytes <= limit
                           else f", still over the {format_bytes(limit)} limit: also {advice}")
    return InfeasiblePlanError(
        f"no plan fits in {format_bytes(limit)} per device at batch {batch}: "
        f"the least-memory plan found (per op the option with the least kept plus transient bytes"
        f"{', with every block checkpointed or none, the lower' if t.settings.checkpointing != 'none' else ''}) "
        f"needs {format_bytes(smallest.peak_bytes)}, peaking at {smallest.peak_op} ({lines}), and fits in a limit "
        f"of {format_bytes(fits_at)}; {advice}",
        min_bytes=fits_at,
        breakdown=smallest.breakdown,
    )


def least_memory_limit(t: ProblemTemplate, batch: int) -> tuple[Estimate, float]:
    """The least-memory plan as the planner sees it at the limit that holds it, and that
    limit (``InfeasiblePlanError.min_bytes``): its peak plus the quantization's worst
    case (one quantum per op and per segment, [Note: memory quantization]), at that
    limit's prefetch window and quanta, which grow with the budget. Its peak at the limit
    asked for, where the window was smaller, was no limit that fits (found by a helper:
    stock Llama, a second run at the stated minimum was infeasible again, needing 1%
    more)."""
    estimate = min_memory_estimate(t, batch)
    limit = estimate.peak_bytes
    for _ in range(8):  # the window is capped by a share of the budget: a few rounds settle it
        at = build_template(t.desc, t.device.with_(memory_limit_bytes=limit), t.settings)
        estimate = min_memory_estimate(at, batch)
        need = estimate.peak_bytes + (len(at.desc.ops) + len(at.segments)) * at.quantum_bytes
        if need <= limit:
            break
        limit = need
    return estimate, limit


def min_memory_estimate(t: ProblemTemplate, batch: int) -> Estimate:
    """A least-memory plan: per op the option with the least kept plus transient bytes,
    with every block checkpointed when allowed or with none, whichever peaks lower
    (a checkpointed block keeps its input and recomputes: in a small block that can
    cost more than it saves). Its peak is what the error message states: a limit that
    holds it (plus quantization) fits, so it is counted as the search counts (the
    window's bound, not the plan's own gathers: cost_model's [Note: exact gathers])."""
    problem = t.problem(batch)
    # the two extremes' variants, once each (without checkpointed variants they are one)
    extremes = dict.fromkeys(tuple(max(range(len(seg.variants)), key=lambda v: seg.variants[v] == checkpointed)
                                   for seg in t.segments) for checkpointed in (True, False))
    estimates = [evaluate(t, batch, _least_memory_options(t, problem, variant), variant, exact=False)
                 for variant in extremes]
    return min(estimates, key=lambda e: e.peak_bytes)  # ties keep the checkpointed one


def _least_memory_options(t: ProblemTemplate, problem, variant) -> list[int]:
    """Per op, under its segment's ``variant``, the option with the least kept plus
    transient bytes; of equal ones the one that keeps least (a dp op's kept weights are
    its zdp twin's transient at its own moment, but are held at every op in between)."""
    seg_of = {i: s for s, seg in enumerate(t.segments) for i in seg.ops}
    option_index = []
    for i in range(len(t.desc.ops)):
        v = variant[seg_of[i]]
        idx = np.arange(t.opt_begin[i, v], t.opt_end[i, v])
        held = t.opt_held_bytes[idx]
        option_index.append(int(idx[np.lexsort((held, held + problem.opt_local_bytes[idx]))[0]]))
    return option_index


def check_batch(batch, name: str = "batch size") -> int | None:
    if batch is None:
        return None
    if not isinstance(batch, (int, np.integer)) or isinstance(batch, bool) or batch < 1:
        raise OSDPError(f"{name} must be a positive integer, got {batch!r}")
    return int(batch)
