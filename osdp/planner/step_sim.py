"""Price a plan as it will run: an event-driven simulation of one training step.

``simulate_step(template, batch, option_index, variant)`` plays one optimizer step of a
plan (every micro-batch, then the optimizer) on two resources, the compute stream and
the comm stream, following the rules of the runtime's stream scheduler
(``osdp/runtime/scheduler.py``), and says how long it takes, how busy each stream was
and how much communication compute had to wait for. The exact search keeps its additive
model (docs/design/cost_model.md's [Note: time model]); ``rerank.py`` uses this simulation to choose
among a few of the search's plans.

[Note: step simulation]
Every number comes from the cost model: per-op forward/backward compute from
``option_compute_s`` (a split op's compute divided evenly over its slices), gathered and
gradient bytes from ``gathered_bytes`` / ``reduced_bytes``, collective times from the
device's ``CollectiveCost.time_s``, the optimizer from ``optimizer_step_s``. What is
simulated is the runtime's ORDER of things, from the second step on (the use order is
recorded; small units are coalesced). The decisions themselves (the prefetch walk, the
riders of a gather, when deferred gradients and replicated buckets are reduced, how many
reductions stay in flight) are ``osdp.schedule_rules``' functions, the very ones the
runtime calls (tests/runtime/test_schedule_rules.py replays a real run against this):

- units: an unsplit op is one unit, a split op's g slices are g units (slices 0..k-1
  ``zdp``, the next h ``hpz``, the rest ``dp``, as ``plan_from_schedule`` writes them;
  an ``hpz`` unit runs as a ``zdp`` one whose gathers after forward take
  ``node_gather_s``), collective seconds from collective_cost.py, a tied second use
  uses its owner's unit(s). Forward uses run in op order, backward in reverse.
- the hook protocol, step by step as the runtime calls it: pre_forward (issue the unit's
  gather, prefetch, wait), compute, post_forward (a ``zdp`` unit is freed, a ``dp`` unit
  kept, prefetch); pre_backward (gather again if freed, prefetch, wait), compute,
  post_backward (gradient reduction when the unit's last use is done, free, prefetch).
- prefetch window in bytes ([Note: prefetch window]): walk the order from the next use,
  skip units already gathered, issue while transient bytes + the unit's bytes <= window,
  stop at the first that does not fit. Transient = every gathered unit except ``dp``
  units waiting for their backward (kept). The window is ``template.window_bytes``
  truncated to an integer, as ``Plan.prefetch_bytes`` hands it to the runtime.
- coalesced small units ([Note: coalesced small units]): a whole-module unit (not a
  slice) with gathered bytes <= coalesce_bytes // 4, issued with a known order, takes
  the next small still-sharded units of the order along (skipping big ones) up to
  coalesce_bytes in total and while the window has room, stopping at a unit of another
  gathered dtype (bytes per element) or level (an ``hpz`` unit after its forward gathers
  from its node copy): ONE all-gather of their summed bytes, one latency. Small units'
  gradients wait until coalesce_bytes of them are pending, or the end of backward, and
  are reduced in one collective per reduce dtype.
- replicated units ([Note: replicated units] in osdp/contract.py; the template's rep
  set): never gathered, no unit of the gather order (prefetch and coalescing skip them);
  after a rep unit's last use in backward its gradient joins the replicated bucket, which
  is all-reduced (collective_cost.py's ``all_reduce_s``, over every rank, one latency)
  once it holds >= REPLICATE_BUCKET_BYTES and at the end of backward (after the sharded
  units' last reductions), on the comm stream, one bucket per (reduce, parameter) dtype
  pair; at most MAX_INFLIGHT_REPLICATE_BUCKETS in flight, issuing one more waits for the
  oldest first (the compute stream stalls), a queue of its own apart from the
  reduce-scatters'.
- gradient reduction: at most one in flight (``max_inflight_reduce_scatters``); issuing
  one more waits for the oldest, and that wait blocks the compute stream. The end of
  backward waits for all. With ``all_reduce=True`` the gradient collective is an
  all-reduce priced as reduce-scatter + all-gather of the full buffer (the ring
  decomposition); leave it False when the device's ``reduce_scatter`` entry already
  measures the runtime's collective (``osdp.profiler.profile`` times the all-reduce on gloo:
  ``reduces_with_all_reduce``).
- activation checkpointing ([Note: activation checkpointing]): a checkpointed block's
  forward runs again in backward when its last op's backward starts (after that op's
  pre_backward for a hooked module, before it for a split op, whose autograd Function
  unpacks its input first). The recompute gathers units that are not gathered (a
  ``zdp`` unit not yet prefetched; no prefetch, no coalescing), waits, and frees what
  it gathered itself; a ``zdp`` unit the backward prefetch already gathered is reused.
- streams: compute runs its ops in program order; collectives run on ONE comm stream in
  issue order, one at a time. A collective starts no earlier than the compute issued
  before it (CUDA: the comm stream waits for the compute stream; gloo: the CPU issues
  it after the preceding compute ran). Compute waits for the gathers it reads and for
  the reductions it is made to wait for.
- gradient accumulation: ``accumulation_steps`` micro-batches; with gradient_sync
  "last" only the last one reduces (the others keep unsharded gradients), with "every"
  each does. Every micro-batch starts with every unit sharded (the end of backward
  frees all). Then the optimizer step runs on the compute stream.

- calibration (``DeviceInfo.calibration``): compute and the runtime's per-unit overhead
  come in through ``option_compute_s``; a phase's comm that ran beside compute is
  hidden only to ``overlap_efficiency``: (1 - it) x min(hidden comm, compute busy) is
  added to the phase ([Note: imperfect overlap]).

Not modelled: the first step (order not yet recorded: no coalescing), host-side launch
or Python overhead and CPU contention between compute and gloo's threads, NCCL's two
comm streams (all-gather and reduce-scatter can overlap on CUDA; here they share one),
bandwidth sharing between concurrent collectives, unit padding to a multiple of the
world size, uneven split slices, checkpoint early stop (the whole block is recomputed),
frozen units, and memory:
whether a plan fits is the cost model's ``evaluate``.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..contract import (DEFAULT_COALESCE_BYTES, MAX_INFLIGHT_REDUCE_SCATTERS, MAX_INFLIGHT_REPLICATE_BUCKETS,
                        REPLICATE_BUCKET_BYTES, is_small_unit)
from ..schedule_rules import by_key, group_full, prefetch_walk, riders, waits_after_issue, waits_before_issue
# the cost model's modules below memory.py, which imports this one ([Note: exact gathers])
from .cost_model.settings import layout_collectives
from .cost_model.template import ProblemTemplate
from .cost_model.timing import option_compute_s, template_optimizer_s
from .cost_model.unit_bytes import element_bytes, gathered_bytes, reduced_bytes
from .cost_model.units import backward_needs_weights

# the runtime's rules, from the contract both sides import
RUNTIME_COALESCE_BYTES = DEFAULT_COALESCE_BYTES
RUNTIME_MAX_INFLIGHT_REDUCTIONS = MAX_INFLIGHT_REDUCE_SCATTERS
RUNTIME_REPLICATE_BUCKET_BYTES = REPLICATE_BUCKET_BYTES
RUNTIME_MAX_INFLIGHT_REPLICATE_BUCKETS = MAX_INFLIGHT_REPLICATE_BUCKETS

PHASES = ("forward", "backward", "optimizer")
_F, _B = 0, 1  # the two use orders


class Event(NamedTuple):
    """One interval on a stream: compute (forward, backward, recompute, optimizer, wait)
    or comm (all_gather, reduce_scatter, all_reduce)."""

    resource: str
    kind: str
    what: str
    start_s: float
    end_s: float
    phase: str
    micro_batch: int


@dataclass(frozen=True)
class PhaseTime:
    duration_s: float  # wall time of the phase on the compute stream
    compute_s: float  # compute-busy seconds inside it
    comm_s: float  # comm-busy seconds of the collectives issued in it
    exposed_s: float  # duration - compute: compute waiting for communication


@dataclass(frozen=True)
class StepSim:
    step_s: float
    compute_busy_s: float
    comm_busy_s: float
    exposed_comm_s: float  # step - compute busy: the compute stream waiting on comm
    phases: dict  # "forward" / "backward" / "optimizer" -> PhaseTime (summed over micro-batches)
    all_gathers: int  # all-gather collectives issued (a coalesced group counts once)
    reductions: int  # gradient collectives issued
    timeline: tuple | None = None  # Events in issue order, when asked for

    def samples_per_s(self, batch: int, world_size: int, accumulation_steps: int = 1) -> float:
        return batch * accumulation_steps * world_size / self.step_s


class _Unit:
    __slots__ = ("name", "nbytes", "grad_bytes", "dp", "small", "gather_s", "regather_s", "sharded", "ready_s",
                 "n_active", "n_await", "n_grad", "has_grad", "deferred", "fpos", "bpos", "hpz", "dtype", "rdtype",
                 "staging")

    def __init__(self, name, nbytes, grad_bytes, dp, small, gather_s, regather_s=None, hpz=False, dtype=0.0,
                 rdtype=0.0):
        self.name, self.nbytes, self.grad_bytes = name, nbytes, grad_bytes
        self.dp, self.small, self.gather_s = dp, small, gather_s
        # a gather after forward: within the node for an hpz unit ([Note: hpz mode])
        self.regather_s = gather_s if regather_s is None else regather_s
        # an hpz unit gathers from its node copy after its forward ([Note: node copies]
        # in runtime/lifecycle.py); gathered and reduced bytes per element stand for the
        # runtime's dtypes (schedule_rules.riders / by_key group by them)
        self.hpz, self.dtype, self.rdtype = hpz, dtype, rdtype
        self.sharded, self.ready_s = True, 0.0
        self.n_active = self.n_await = 0
        self.n_grad = 0  # uses whose backward has not run yet (the gradient is reduced after the last)
        self.has_grad = self.deferred = False
        self.fpos: list[int] = []
        self.bpos: list[int] = []
        self.staging: list[float] | None = None  # its coalesced gather's buffer, shared by the group


class _RepUnit:
    """A replicated unit: nothing to gather; its gradient joins the replicated bucket
    after its last use in backward."""

    __slots__ = ("name", "grad_bytes", "n_grad", "key")

    def __init__(self, name, grad_bytes, key=None):
        self.name, self.grad_bytes, self.n_grad = name, grad_bytes, 0
        self.key = key  # its bucket: (reduce, parameter) bytes per element, as the runtime's dtype pair


class _Step:
    """One compute of the program: the units it reads, its forward / backward seconds."""

    __slots__ = ("name", "uses", "fwd_s", "bwd_s", "fpos", "bpos", "recompute", "recompute_first", "bwd_weights",
                 "reps", "op", "slice")

    def __init__(self, name, uses, fwd_s, bwd_s, bwd_weights=True, reps=()):
        self.name, self.uses, self.fwd_s, self.bwd_s = name, uses, fwd_s, bwd_s
        self.reps = reps  # rep units it reads (never gathered)
        self.bwd_weights = bwd_weights  # its backward reads the weights (gathers them)
        self.fpos: list[int] = []
        self.bpos: list[int] = []
        self.recompute: list[_Step] | None = None  # a checkpointed block's forward, replayed here
        self.recompute_first = False  # before this step's pre_backward (split op) or after
        self.op, self.slice = -1, 0  # the op it computes, and which of its slices


def _program(t: ProblemTemplate, batch: int, option_index, variant, coalesce_bytes: int):
    desc, dev, settings = t.desc, t.device, t.settings
    chosen = np.asarray(option_index, dtype=np.int64)
    comp_f, comp_b = option_compute_s(t, batch)
    comp_f, comp_b = comp_f[chosen].tolist(), comp_b[chosen].tolist()
    slices, zdp, hpz = t.opt_slices[chosen].tolist(), t.opt_zdp[chosen].tolist(), t.opt_hpz[chosen].tolist()
    coll = layout_collectives(dev, settings)
    rep = t.rep if t.rep is not None else np.zeros(len(desc.ops), dtype=bool)
    units_of: dict[int, list[_Unit]] = {}
    reps_of: dict[int, _RepUnit] = {}
    for i, op in enumerate(desc.ops):
        if rep[i] and op.param_count:  # a tied use's bias too: it runs its owner's mode
            e = element_bytes(op)
            reps_of[i] = _RepUnit(op.name, reduced_bytes(op, settings), (settings.reduce_dtype_bytes or e, e))
            continue
        if op.tied_to or not op.param_count:  # (a sharded tied use's bias: not simulated)
            continue
        g, k, h = slices[i], zdp[i], hpz[i]
        s = gathered_bytes(op, settings) / g
        grad = reduced_bytes(op, settings) / g
        ag, node_ag = coll.gather_s(s), coll.node_gather_s(s)
        small = is_small_unit(s, coalesce_bytes, is_slice=g > 1)
        # slices 0..k-1 zdp, k..k+h-1 hpz, the rest dp (as plan_from_schedule writes them)
        dtype = gathered_bytes(op, settings) / op.param_count  # bytes per element, gathered
        rdtype = reduced_bytes(op, settings) / op.param_count
        units_of[i] = [_Unit(op.name if g == 1 else f"{op.name}[{j}]", s, grad, j >= k + h, small, ag,
                             node_ag if k <= j < k + h else ag, k <= j < k + h, dtype, rdtype) for j in range(g)]
    steps_of: dict[int, list[_Step]] = {}
    for i, op in enumerate(desc.ops):
        f, b = comp_f[i], comp_b[i]
        # a use whose op declares no weights in backward neither keeps nor regathers them
        weights = backward_needs_weights(op, slices[i])
        owner = desc.op_index(op.tied_to) if op.tied_to else i
        us = units_of.get(owner, ())
        if owner in reps_of:
            own = (reps_of[i],) if i != owner and i in reps_of else ()
            steps_of[i] = [_Step(op.name, (), f, b, reps=(reps_of[owner],) + own)]
        elif not us:
            steps_of[i] = [_Step(op.name, (), f, b)]
        elif len(us) == 1 or (op.tied_to and slices[i] == 1):
            steps_of[i] = [_Step(op.name, tuple(us), f, b, weights)]
        else:  # a split op (or a split tied unit's use): one step per slice
            steps_of[i] = [_Step(u.name if not op.tied_to else f"{op.name}[{j}]", (u,), f / len(us), b / len(us), weights)
                           for j, u in enumerate(us)]
    for i, op_steps in steps_of.items():
        for j, st in enumerate(op_steps):
            st.op, st.slice = i, j
    steps = [st for i in range(len(desc.ops)) for st in steps_of[i]]
    order: list[_Unit] = []
    for st in steps:
        for u in st.uses:
            st.fpos.append(len(order))
            u.fpos.append(len(order))
            order.append(u)
    last = len(order) - 1
    for st in steps:
        st.bpos = [last - p for p in st.fpos]
    for u in {id(u): u for u in order}.values():
        u.bpos = sorted(last - p for p in u.fpos)
    # backward positions of uses that read no weights: never gathered for, never prefetched
    no_weights_b = {p for st in steps if not st.bwd_weights for p in st.bpos}
    for s, seg in enumerate(t.segments):
        if seg.variants[int(variant[s])]:
            trigger = steps_of[seg.ops[-1]]
            trigger[-1].recompute = [st for i in seg.ops for st in steps_of[i]]
            trigger[-1].recompute_first = len(trigger) > 1 or not trigger[-1].uses
    return steps, order, no_weights_b


class _Sim:
    """The runtime scheduler's bookkeeping (see runtime/scheduler.py) with two clocks."""

    def __init__(self, t: ProblemTemplate, steps, order, coalesce_bytes, all_reduce, timeline, no_weights_b=()):
        dev = t.device
        self.n = dev.world_size
        self.dev = dev
        self.coll = layout_collectives(dev, t.settings)
        self.steps, self.order = steps, order
        self.no_weights_b = set(no_weights_b)
        self.units = list({id(u): u for u in order}.values())
        self.window = t.window_bytes if math.isinf(t.window_bytes) else float(int(t.window_bytes))
        self.coalesce = coalesce_bytes
        self.all_reduce = all_reduce
        self.events = [] if timeline else None
        self.compute_t = self.comm_t = 0.0
        self.live: dict[_Unit, None] = {}
        self.live_bytes = self.kept_bytes = 0.0
        self.staging_bytes = 0.0  # coalesced gathers' buffers not waited for yet ([Note: exact gathers])
        self.reductions: list[float] = []  # end times of reductions in flight, oldest first
        # replicated gradients waiting for their all-reduce, per bucket key (dtype pair)
        self.rep_buckets: dict[tuple, list[_RepUnit]] = {}
        self.rep_fill: dict[tuple, float] = {}
        self.rep_in_flight: list[float] = []  # end times of replicated buckets in flight
        self.deferred: list[_Unit] = []
        self.deferred_bytes = 0.0
        m = len(order)
        self.orders = (order, order[::-1])
        self.sharded = (list(range(m)), list(range(m)))
        small = [p for p in range(m) if order[p].small]
        self.small_sharded = (small, sorted(m - 1 - p for p in small))
        self.phase, self.mb = "forward", 0
        self.busy = dict.fromkeys(PHASES, 0.0)
        self.comm = dict.fromkeys(PHASES, 0.0)
        self.duration = dict.fromkeys(PHASES, 0.0)
        self.n_gathers = self.n_reductions = 0
        # (phase, op, slice) -> gathered bytes while it computes, and ("after backward",
        # op, slice) -> once its backward freed and prefetched ([Note: exact gathers])
        self.gathered_at: dict[tuple[str, int, int], float] = {}

    def _note_gathered(self, st, phase: str | None = None) -> None:
        key = (phase or self.phase, st.op, st.slice)
        self.gathered_at[key] = max(self.gathered_at.get(key, 0.0), self.live_bytes + self.staging_bytes)

    # ---- clocks ------------------------------------------------------------------------
    def compute(self, kind: str, what: str, seconds: float) -> None:
        start = self.compute_t
        self.compute_t = start + seconds
        self.busy[self.phase] += seconds
        if self.events is not None:
            self.events.append(Event("compute", kind, what, start, self.compute_t, self.phase, self.mb))

    def stall(self, until: float, what: str) -> None:
        if until > self.compute_t:
            if self.events is not None:
                self.events.append(Event("compute", "wait", what, self.compute_t, until, self.phase, self.mb))
            self.compute_t = until

    def collective(self, kind: str, what: str, seconds: float) -> float:
        start = max(self.comm_t, self.compute_t)
        self.comm_t = start + seconds
        self.comm[self.phase] += seconds
        if self.events is not None:
            self.events.append(Event("comm", kind, what, start, self.comm_t, self.phase, self.mb))
        return self.comm_t

    # ---- unit state ----------------------------------------------------------------------
    @staticmethod
    def _kept(u: _Unit) -> bool:
        return u.dp and u.n_active == 0 and u.n_await > 0

    def count(self, u: _Unit, active: int = 0, awaiting: int = 0) -> None:
        """Change a unit's use counts, keeping the kept-bytes total."""
        if u.sharded or not u.dp:
            u.n_active += active
            u.n_await += awaiting
            return
        was = u.n_active == 0 and u.n_await > 0
        u.n_active += active
        u.n_await += awaiting
        now = u.n_active == 0 and u.n_await > 0
        if was != now:
            self.kept_bytes += u.nbytes if now else -u.nbytes

    def _positions(self, u: _Unit, add: bool) -> None:
        """Keep the sorted positions of still-sharded units of both orders."""
        lists = ((self.sharded[_F], u.fpos), (self.sharded[_B], u.bpos))
        if u.small:
            lists += ((self.small_sharded[_F], u.fpos), (self.small_sharded[_B], u.bpos))
        for lst, positions in lists:
            for p in positions:
                if add:
                    insort(lst, p)
                else:
                    del lst[bisect_left(lst, p)]

    def start_gather(self, u: _Unit, ready_s: float) -> None:
        u.sharded = False
        u.ready_s = ready_s
        self.live[u] = None
        self.live_bytes += u.nbytes
        if self._kept(u):
            self.kept_bytes += u.nbytes
        self._positions(u, add=False)

    def wait(self, u: _Unit) -> None:
        if not u.sharded and u.ready_s > self.compute_t:
            self.stall(u.ready_s, f"all-gather of {u.name}")
        if u.staging is not None:  # the group's first wait copies every member out of it
            self.staging_bytes -= u.staging[0]
            u.staging[0] = 0.0
            u.staging = None

    def free(self, u: _Unit) -> None:
        if u.sharded:
            return
        self.wait(u)  # never release memory a collective still writes
        if self._kept(u):
            self.kept_bytes -= u.nbytes
        u.sharded = True
        del self.live[u]
        self.live_bytes -= u.nbytes
        self._positions(u, add=True)

    def maybe_free(self, u: _Unit) -> None:
        if u.sharded or u.n_active > 0 or (u.dp and u.n_await > 0):
            return
        self.free(u)

    # ---- gathers -------------------------------------------------------------------------
    def issue(self, u: _Unit, k: int | None = None, pos: int = 0) -> None:
        if not u.sharded:
            return
        group = [u]
        again = self.phase != "forward"
        if u.small and k is not None:  # schedule_rules.riders: small_sharded holds the eligible
            order, lst = self.orders[k], self.small_sharded[k]
            # the level it gathers from: an hpz unit's node copy after its forward
            key = (lambda g: (g.dtype, g.hpz)) if again else _dtype_of
            group += riders(u, (order[p] for p in lst[bisect_right(lst, pos):]), self.coalesce,
                            self.window - (self.live_bytes - self.kept_bytes), size=_nbytes_of, key=key,
                            eligible=_always)
        if len(group) == 1:
            seconds = u.regather_s if again else u.gather_s
        elif again and all(g.regather_s < g.gather_s for g in group):
            seconds = self.coll.node_gather_s(sum(g.nbytes for g in group))
        else:
            seconds = self.coll.gather_s(sum(g.nbytes for g in group))
        what = ", ".join(g.name for g in group) if self.events is not None else ""
        ready = self.collective("all_gather", what, seconds)
        self.n_gathers += 1
        staging = [float(sum(g.nbytes for g in group))] if len(group) > 1 else None
        if staging is not None:  # gathered rank-major into one buffer, copied out at the first wait
            self.staging_bytes += staging[0]
        for g in group:
            self.start_gather(g, ready)
            g.staging = staging

    def prefetch(self, k: int, start: int) -> None:
        """schedule_rules.prefetch_walk over the still-sharded units from ``start``."""
        if self.window <= 0:
            return
        order = self.orders[k]
        skip = self._skip_b if k == _B else _never
        for p in prefetch_walk(self._sharded_from(k, start), self.window, size=_nbytes_of,
                               transient=self._transient, skip=skip):
            self.issue(order[p], k, p)

    def _sharded_from(self, k: int, start: int):
        """(position, unit) of the still-sharded units of order k from ``start``, read
        lazily: an issue between two removes units from the list."""
        order, lst = self.orders[k], self.sharded[k]
        while True:
            i = bisect_left(lst, start)
            if i == len(lst):
                return
            p = lst[i]
            yield p, order[p]
            start = p + 1

    def _skip_b(self, p: int, u: _Unit) -> bool:
        return p in self.no_weights_b  # a backward use that gathers nothing

    def _transient(self) -> float:
        return self.live_bytes - self.kept_bytes

    # ---- gradients -----------------------------------------------------------------------
    def reduce(self, u: _Unit) -> None:
        if u.small:
            if u.deferred:
                return
            u.deferred = True
            self.deferred.append(u)
            self.deferred_bytes += u.grad_bytes
            if group_full(self.deferred_bytes, self.coalesce):
                self.flush()
            return
        u.has_grad = False
        self._reduce_group([u])

    def flush(self) -> None:
        group, self.deferred, self.deferred_bytes = self.deferred, [], 0.0
        if group:
            for u in group:
                u.has_grad = u.deferred = False
            for same_dtype in by_key(group, _rdtype_of):  # one collective per reduce dtype
                self._reduce_group(same_dtype)

    def _reduce_group(self, group: list[_Unit]) -> None:
        nbytes = sum(u.grad_bytes for u in group)
        seconds = self.coll.grad_s(nbytes)
        if self.all_reduce:
            seconds += self.coll.gather_s(nbytes)
        kind = "all_reduce" if self.all_reduce else "reduce_scatter"
        what = ", ".join(u.name for u in group) if self.events is not None else ""
        self.reductions.append(self.collective(kind, what, seconds))
        self.n_reductions += 1
        for _ in range(waits_after_issue(len(self.reductions), RUNTIME_MAX_INFLIGHT_REDUCTIONS)):
            self.stall(self.reductions.pop(0), "oldest gradient reduction")

    def rep_join(self, u: _RepUnit) -> None:
        """A rep unit's gradient after its last use in backward: into the bucket."""
        bucket = self.rep_buckets.setdefault(u.key, [])
        if u in bucket:
            return  # (the runtime's rule; a unit joins once per backward here)
        bucket.append(u)
        self.rep_fill[u.key] = self.rep_fill.get(u.key, 0.0) + u.grad_bytes
        if group_full(self.rep_fill[u.key], RUNTIME_REPLICATE_BUCKET_BYTES):
            self._rep_issue(u.key)

    def rep_flush(self) -> None:
        """All-reduce every filling replicated bucket (the end of backward)."""
        for key in list(self.rep_buckets):
            self._rep_issue(key)

    def _rep_issue(self, key) -> None:
        """All-reduce one replicated bucket (one collective over every rank); the oldest
        in flight beyond MAX_INFLIGHT_REPLICATE_BUCKETS is waited for first."""
        group, nbytes = self.rep_buckets.pop(key), self.rep_fill.pop(key)
        for _ in range(waits_before_issue(len(self.rep_in_flight), RUNTIME_MAX_INFLIGHT_REPLICATE_BUCKETS)):
            self.stall(self.rep_in_flight.pop(0), "oldest replicated bucket")
        what = ", ".join(u.name for u in group) if self.events is not None else ""
        self.rep_in_flight.append(self.collective("all_reduce", what, self.coll.all_reduce_s(nbytes)))
        self.n_reductions += 1

    # ---- one micro-batch -------------------------------------------------------------------
    def forward(self) -> None:
        self.phase = "forward"
        start = self.compute_t
        cursor = 0
        for st in self.steps:
            for u, p in zip(st.uses, st.fpos):
                self.issue(u, _F, p)
                cursor = p + 1
                self.count(u, active=1)  # counts as transient while prefetching
                self.prefetch(_F, cursor)
                self.count(u, active=-1)
                self.wait(u)
                self.count(u, active=1)
            self._note_gathered(st)
            self.compute("forward", st.name, st.fwd_s)
            for r in st.reps:
                r.n_grad += 1
            for u in st.uses:
                self.count(u, active=-1, awaiting=1 if st.bwd_weights else 0)
                u.n_grad += 1
                self.maybe_free(u)
                self.prefetch(_F, cursor)
        for u in list(self.live):  # prefetched and never used
            if u.n_active == 0 and u.n_await == 0:
                self.free(u)
        self.duration["forward"] += self.compute_t - start

    def _recompute(self, steps) -> None:
        for st in steps:
            here = []
            for u in st.uses:
                was_gathered = not u.sharded
                self.issue(u)  # no order: neither prefetch nor coalescing
                self.wait(u)
                here.append(not was_gathered)
            self.compute("recompute", st.name, st.fwd_s)
            for u, gathered_here in zip(st.uses, here):
                if gathered_here:
                    self.maybe_free(u)

    def backward(self, sync: bool) -> None:
        self.phase = "backward"
        start = self.compute_t
        cursor = 0
        for st in reversed(self.steps):
            if st.recompute is not None and st.recompute_first:
                self._recompute(st.recompute)
            for u, p in zip(st.uses, st.bpos):
                cursor = p + 1
                if not st.bwd_weights:  # only a gradient: nothing to gather or wait for
                    continue
                self.count(u, awaiting=-1)
                self.count(u, active=1)
                self.issue(u, _B, p)
                self.prefetch(_B, cursor)
                self.wait(u)
            if st.recompute is not None and not st.recompute_first:
                self._recompute(st.recompute)
            self._note_gathered(st)
            self.compute("backward", st.name, st.bwd_s)
            for r in st.reps:
                r.n_grad -= 1
                if sync and r.n_grad == 0 and r.grad_bytes:  # its last use in backward (a frozen unit: none)
                    self.rep_join(r)
            for u in st.uses:
                if st.bwd_weights:
                    self.count(u, active=-1)
                u.n_grad -= 1
                u.has_grad = u.grad_bytes > 0  # a frozen unit has no gradient to reduce
                # reduced once every use's gradient is in (a tied unit: summed over its uses)
                if sync and u.has_grad and u.n_grad == 0 and u.n_active == 0:
                    self.reduce(u)
                self.maybe_free(u)
                self.prefetch(_B, cursor)
            self._note_gathered(st, "after backward")
        # end of the backward pass: remaining gradients, wait for every reduction, free all
        if sync:
            for u in self.units:
                if u.has_grad and u.n_active == 0:
                    self.reduce(u)
        self.flush()
        self.rep_flush()
        while self.reductions:
            self.stall(self.reductions.pop(0), "gradient reductions at the end of backward")
        while self.rep_in_flight:
            self.stall(self.rep_in_flight.pop(0), "replicated buckets at the end of backward")
        for u in list(self.live):
            if u.n_active == 0:
                self.free(u)
        self.duration["backward"] += self.compute_t - start


def _nbytes_of(u: _Unit) -> float:
    return u.nbytes


def _dtype_of(u: _Unit):
    return u.dtype


def _rdtype_of(u: _Unit):
    return u.rdtype


def _always(u: _Unit) -> bool:
    return True


def _never(p: int, u: _Unit) -> bool:
    return False


def simulate_step(
    template: ProblemTemplate,
    batch: int,
    option_index,
    variant,
    *,
    coalesce_bytes: int | None = None,
    all_reduce: bool = False,
    timeline: bool = False,
) -> StepSim:
    """Simulate one optimizer step of the plan given as option indices (per op) and
    variants (per segment) of ``template`` at ``batch``; see [Note: step simulation].
    ``coalesce_bytes``: the runtime's (``OSDP(coalesce_bytes=...)``; 0: off); None: the
    template's ``settings.coalesce_bytes`` (default ``RUNTIME_COALESCE_BYTES``).
    ``timeline``: keep every interval (``StepSim.timeline``) for debugging and plots."""
    t = template
    plain = coalesce_bytes is None and not all_reduce and not timeline
    if plain:  # the run gathered_at_compute makes too: one per plan ([Note: one simulation per plan])
        return _plain_run(t, batch, option_index, variant)[0]
    return _simulate(t, batch, option_index, variant, coalesce_bytes, all_reduce, timeline)[0]


# [Note: one simulation per plan]
# Re-ranking prices each candidate in exact bytes (cost_model.evaluate: the gathers of
# gathered_at_compute) and then simulates its step (simulate_step); with the template's
# own coalescing, no all-reduce and one micro-batch, both play the very same simulation
# (a forward, a backward that syncs). So that run is made once per plan and kept on its
# template: its StepSim and its gathered bytes.
def _plain_run(t: ProblemTemplate, batch: int, option_index, variant) -> tuple:
    key = (int(batch), tuple(int(o) for o in option_index), tuple(int(v) for v in variant))
    runs = t.__dict__.setdefault("_plain_runs", {})
    if key not in runs:
        runs[key] = _simulate(t, batch, option_index, variant, None, False, False)
    return runs[key]


def _simulate(t: ProblemTemplate, batch: int, option_index, variant, coalesce_bytes, all_reduce: bool,
              timeline: bool) -> tuple:
    """``simulate_step``'s run: its StepSim and the gathered bytes its first micro-batch
    noted (``gathered_at_compute``'s when that is the only one)."""
    if coalesce_bytes is None:
        coalesce_bytes = getattr(t.settings, "coalesce_bytes", RUNTIME_COALESCE_BYTES)
    coalesce = int(coalesce_bytes) if t.device.world_size > 1 else 0
    steps, order, no_weights_b = _program(t, batch, option_index, variant, coalesce)
    sim = _Sim(t, steps, order, coalesce, all_reduce, timeline, no_weights_b)
    settings = t.settings
    micro = settings.accumulation_steps
    for mb in range(micro):
        sim.mb = mb
        sim.forward()
        sim.backward(sync=settings.gradient_sync == "every" or mb == micro - 1)
    sim.phase = "optimizer"
    start = sim.compute_t
    optimizer_s = template_optimizer_s(t)  # cached: one template, many candidates
    sim.compute("optimizer", "optimizer step", optimizer_s)
    sim.duration["optimizer"] += sim.compute_t - start
    # [Note: imperfect overlap] comm that ran beside compute is hidden only in part:
    # (1 - overlap_efficiency) of it is added to the phase (DeviceInfo.calibration)
    lost = 1.0 - t.device.calibration.overlap_efficiency
    for p in PHASES:
        hidden = max(0.0, sim.comm[p] - (sim.duration[p] - sim.busy[p]))
        sim.duration[p] += lost * min(hidden, sim.busy[p])
    phases = {
        p: PhaseTime(sim.duration[p], sim.busy[p], sim.comm[p], sim.duration[p] - sim.busy[p]) for p in PHASES
    }
    busy = sum(sim.busy.values())
    step_s = sum(sim.duration.values())
    return StepSim(
        step_s=step_s,
        compute_busy_s=busy,
        comm_busy_s=sum(sim.comm.values()),
        exposed_comm_s=step_s - busy,
        phases=phases,
        all_gathers=sim.n_gathers,
        reductions=sim.n_reductions,
        timeline=tuple(sim.events) if timeline else None,
    ), (sim.gathered_at if micro == 1 else None)


def gathered_at_compute(template: ProblemTemplate, batch: int, option_index, variant) -> dict:
    """``(phase, op, slice) -> bytes``: the gathered weights (kept ``dp`` ones included)
    while each op's (slice's) forward and backward compute, as the runtime's prefetch
    leaves them: whole units in use order, up to the window, skipping gathered ones,
    stopping at the first that does not fit ([Note: exact gathers] in cost_model/memory.py).
    Phase "after backward": once the op's backward hook freed its weights and
    prefetched the next units, while its gradient is still live."""
    t = template
    if t.settings.accumulation_steps == 1:  # simulate_step's own run ([Note: one simulation per plan])
        return _plain_run(t, batch, option_index, variant)[1]
    coalesce = int(t.settings.coalesce_bytes) if t.device.world_size > 1 else 0
    steps, order, no_weights_b = _program(t, batch, option_index, variant, coalesce)
    sim = _Sim(t, steps, order, coalesce, False, False, no_weights_b)
    sim.forward()
    sim.backward(sync=True)
    return sim.gathered_at


def simulate_scheduled(scheduled, **kwargs) -> StepSim:
    """``simulate_step`` of a ``scheduler.Scheduled`` plan."""
    s = scheduled
    return simulate_step(s.template, s.batch, s.result.option_index, s.result.variant, **kwargs)
