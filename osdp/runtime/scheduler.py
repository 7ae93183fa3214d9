"""The stream scheduler: when each unit is all-gathered, freed and reduce-scattered.

Module hooks (``hooks.py``) and split ops (``osdp.ops``) drive it with one protocol::

    use = sched.pre_forward(unit)         # gathered (and later units prefetched)
    ... compute with unit.views ...
    sched.post_forward(use, expects_backward)
    # backward
    sched.pre_backward(use)               # gathered again if it was freed
    grads, accumulate = sched.grad_buffer(unit)   # optional: write dW in place
    sched.post_backward(use, grads_or_None)       # reduce-scatter when the last use is done

[Note: unit lifetime]
A unit's gathered weights are freed when no use of it is computing (``n_active == 0``)
and, for a ``dp`` unit, no use still waits for its backward (``n_await == 0``). So a
``zdp`` unit is freed after each forward use and each backward use; a ``dp`` unit is
kept from its first forward to its last backward use; with no grad (eval) both free
right after forward. A unit's unsharded gradient is reduce-scattered when its last
awaited use finished backward. At the end of a backward pass (autograd final callback)
uses that never got a backward (outputs not in the loss) are dropped, partial
gradients are reduce-scattered, all reduce-scatters are waited on and every gathered
buffer is freed, on every rank alike (the graph is the same on every rank).

[Note: prefetch window]
The order of unit uses is recorded in the first forward with grad enabled and assumed
to stay; backward prefetches in reverse order (the first backward uses the reversed
forward order, later ones the order the first backward actually took, which leaves out
uses whose backward never comes). Before computing a unit the scheduler issues its gather (always), then issues
gathers of the next units in that order (reversed, for backward) while the transient
gathered bytes (every gathered unit except ``dp`` units that finished forward and wait
for backward) plus the next unit's bytes stay <= ``prefetch_bytes``. Prefetch stops at
the first unit that does not fit, so gathers are issued in use order on every rank.

[Note: unsharded gradients]
A unit's unsharded gradient buffer lives from its first backward use until its
reduce-scatter is waited on. At most ``max_inflight_reduce_scatters`` (1) reduce-scatters
are in flight: issuing one more waits for the oldest, so at most two units' unsharded
gradients are live at once (the one being computed and the one being reduced), plus
partial gradients of units used more than once whose last use is still to come.

[Note: coalesced small units]
Every collective has a fixed cost (on gloo/CPU about 0.3-0.5 ms of latency and CPU per
call, whatever its size), and OSDP's units are per leaf module, so a model has many
tiny units (LayerNorms: 2 x hidden parameters) next to its big ones. A unit is *small*
when it is a whole module (not a split slice: those are cut to bound the peak) and its
gathered bytes are <= ``coalesce_bytes // 4``. When the scheduler gathers a small unit
while it knows the order of the phase (forward or backward, from the second step on),
it gathers with it, in ONE collective, the next small units of that order that are
still sharded, up to ``coalesce_bytes`` in total and only while the transient gathered
bytes stay within the prefetch window (they are prefetches: they count as transient
until used). Small units' unsharded gradients wait (up to ``coalesce_bytes`` in total)
and are reduce-scattered together, at the latest at the end of the backward pass.
Memory model: the window bound is unchanged; the unsharded-gradient peak may grow by at
most ``coalesce_bytes`` (a constant; default 64 KiB) and the coalesced collective's
staging buffers are at most 2 x ``coalesce_bytes``. ``coalesce_bytes=0`` turns it off.
Big units are never coalesced: that would need a copy out of a rank-major staging
buffer, i.e. twice their bytes.

[Note: gradient accumulation]
With ``sync_gradients`` off (``OSDP.no_sync()`` / ``set_requires_gradient_sync(False)``)
a unit's unsharded gradient is not reduce-scattered after its last use: it stays, in
fp32 (the shards' dtype), and the next micro-batches add into it. The micro-batch whose
backward runs with sync on adds its gradient and reduce-scatters the sum (in
``reduce_dtype``); the result is added into the sharded ``.grad`` like any step. With
sync on for every micro-batch, each reduce-scatter adds into ``.grad``.

[Note: recovery after an exception]
An exception inside forward or backward (an out-of-range token id, an OOM, a user
error) stops the step between a unit's pre- and post-hook: use counts stay raised, so
that unit would never be freed or reduced again. ``recover()`` puts the scheduler back
to the state of a fresh step: it waits for every collective already issued (each was
issued on every rank, so waiting keeps the ranks' collective sequences aligned), frees
every gathered buffer, drops the failed step's gradients that had not reached
``.grad`` (unsharded ones, and reduce-scatters still in flight: waited for, their
result dropped; as in plain PyTorch, a failed backward may have left earlier units'
gradients in ``.grad``: call ``zero_grad`` after catching it),
forgets uses in flight and any order it was recording, and keeps orders recorded by
completed steps. ``OSDP.forward`` calls it when the module raises; a backward that
raised never runs the autograd final callback, so the next ``begin_forward`` outside
autograd finds ``_in_backward`` still set (or a use still computing) and recovers
first. An exception on only some ranks leaves the others inside a collective: they
fail with ``CollectiveTimeoutError`` after ``timeout_s``; that step cannot be saved.

[Note: activation checkpointing]
A forward that runs inside backward is a checkpoint recompute. It gathers what it needs
(a ``zdp`` unit is gathered again), frees only what it gathered itself, and registers
no backward uses: the backward of the original forward's uses does that.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd import Variable

from .collectives import CommContext
from .ledger import MemoryLedger
from .modes import GatherState, Mode, UseState
from .shard_unit import ShardUnit


@dataclass(eq=False)
class Use:
    """One forward call's use of a unit (the handle that backward refers to)."""

    unit: ShardUnit
    state: UseState = UseState.FORWARD
    recompute: bool = False
    gathered_here: bool = False  # recompute only: this use gathered the unit, so frees it
    abandoned: bool = False  # dropped by the end of a backward pass before its backward
    entry: list | None = field(default=None, repr=False)  # its slot in the recorded order


def _in_autograd_engine() -> bool:
    return torch._C._current_graph_task_id() != -1


class Scheduler:
    def __init__(
        self,
        units: list[ShardUnit],
        comm: CommContext,
        ledger: MemoryLedger,
        prefetch_bytes: int,
        coalesce_bytes: int = 0,
    ):
        self.units = units
        self.comm = comm
        self.ledger = ledger
        self.prefetch_bytes = int(prefetch_bytes)
        # see [Note: coalesced small units]
        self.coalesce_bytes = int(coalesce_bytes) if comm.world_size > 1 else 0
        self._deferred: dict[ShardUnit, None] = {}  # small units whose reduce-scatter waits
        self._deferred_bytes = 0
        # see [Note: gradient accumulation]
        self.sync_gradients = True
        # see [Note: unsharded gradients]
        self.max_inflight_reduce_scatters = 1
        self._recording: list[list] | None = None  # [unit, expects_backward] per use
        self._fwd_order: list[ShardUnit] | None = None
        self._bwd_order: list[ShardUnit] | None = None
        self._bwd_recording: list[ShardUnit] | None = None  # first backward's real order
        self._fwd_cursor = 0
        self._bwd_cursor = 0
        self._in_forward = False
        self._in_backward = False
        self._live: dict[ShardUnit, None] = {}  # units not SHARDED, in gather order
        self._live_bytes = 0  # their gathered bytes
        self._kept_bytes = 0  # of those, the kept ones' (see _kept)
        self._awaiting: dict[Use, None] = {}
        self._reduce_scatters: deque = deque()
        self._grad_bytes: dict[ShardUnit, int] = {}  # ledger bytes of gradients in flight
        self.recover_listeners: list = []  # called by recover() (module hooks drop their stacks)

    def mark_coalescible(self, units) -> None:
        """``units``: the whole-module units that may be coalesced when small."""
        limit = self.coalesce_bytes // 4
        for unit in units:
            unit.coalescible = self.coalesce_bytes > 0 and unit.gathered_bytes <= limit

    # ---- forward order ------------------------------------------------------------
    def begin_forward(self) -> None:
        if not _in_autograd_engine() and (self._in_backward or any(u.n_active for u in self.units)):
            self.recover()  # the previous step died inside backward; see [Note: recovery after an exception]
        self._in_forward = True
        self._fwd_cursor = 0
        if self._fwd_order is None and torch.is_grad_enabled():
            self._recording = []

    def end_forward(self) -> None:
        self._in_forward = False
        # prefetched (or coalesced) units this forward did not use: nothing waits for them
        for unit in list(self._live):
            if unit.n_active == 0 and unit.n_await == 0:
                self._free(unit)
        rec, self._recording = self._recording, None
        if rec and any(expects for _, expects in rec):
            self._fwd_order = [unit for unit, _ in rec]
            # until the first backward shows the real order: reversed forward order
            self._bwd_order = [u for u, expects in reversed(rec) if expects and u.backward_needs_weights]
            self._bwd_recording = []

    @property
    def forward_order(self) -> list[str] | None:
        return None if self._fwd_order is None else [u.name for u in self._fwd_order]

    # ---- the protocol ---------------------------------------------------------------
    def pre_forward(self, unit: ShardUnit) -> Use:
        if self._in_backward or _in_autograd_engine():
            # no n_active pin: checkpoint may stop the recompute early, inside a
            # module's forward, so a matching post_forward is not guaranteed; nothing
            # frees this unit before it is used (frees happen on its own events)
            was_gathered = unit.state is not GatherState.SHARDED
            self._issue(unit)
            self._wait(unit)
            return Use(unit, recompute=True, gathered_here=not was_gathered)
        if (
            unit.state is GatherState.GATHERED
            and unit.n_active == 0
            and unit.n_await == 0
            and unit.gathered_version != unit.shard._version
        ):
            self._free(unit)  # weights were updated since this copy was gathered
        pos = None
        if self._in_forward and self._fwd_order is not None:
            pos = _find(self._fwd_order, unit, self._fwd_cursor)
        if pos is not None:
            self._issue(unit, self._fwd_order, pos)
            self._fwd_cursor = pos + 1
            self._count(unit, active=1)  # counts as transient while prefetching
            self._prefetch(self._fwd_order, pos + 1)
            self._count(unit, active=-1)
        else:
            self._issue(unit)
        self._wait(unit)
        self._count(unit, active=1)
        use = Use(unit)
        if self._recording is not None and self._in_forward:
            use.entry = [unit, False]
            self._recording.append(use.entry)
        return use

    def post_forward(self, use: Use, expects_backward: bool) -> None:
        unit = use.unit
        if use.recompute:
            use.state = UseState.DONE
            if use.gathered_here:
                self._maybe_free(unit)
            return
        if expects_backward:
            self._count(unit, active=-1, awaiting=1)
            use.state = UseState.AWAIT_BACKWARD
            self._awaiting[use] = None
            if use.entry is not None:
                use.entry[1] = True
        else:
            self._count(unit, active=-1)
            use.state = UseState.DONE
        self._maybe_free(unit)
        if self._in_forward and self._fwd_order is not None:
            self._prefetch(self._fwd_order, self._fwd_cursor)

    def pre_backward(self, use: Use) -> None:
        if use.recompute or use.state is UseState.BACKWARD:
            return
        if use.state is UseState.DONE and not use.abandoned:
            return
        self._enter_backward()
        unit = use.unit
        self._take_await(use)
        use.state = UseState.BACKWARD
        self._count(unit, active=1)
        if self._bwd_recording is not None:
            self._bwd_recording.append(unit)
        pos = None if self._bwd_order is None else _find(self._bwd_order, unit, self._bwd_cursor)
        if pos is not None:
            self._issue(unit, self._bwd_order, pos)
            self._bwd_cursor = pos + 1
            self._prefetch(self._bwd_order, pos + 1)
        else:
            self._issue(unit)
        self._wait(unit)

    def grad_buffer(self, unit: ShardUnit) -> tuple[list[torch.Tensor], bool]:
        """Views of ``unit``'s unsharded gradient (one per slot) and whether they already
        hold a gradient to add to (``False``: overwrite every view)."""
        if unit.grad_flat is not None:
            return unit.grad_views(unit.grad_flat), True
        # reduce_dtype, or fp32 (the shards' dtype) while accumulating micro-batches
        dtype = unit.reduce_dtype if self.sync_gradients else unit.shard_dtype
        flat = torch.empty(unit.padded_numel, dtype=dtype, device=unit.gathered.device)
        flat[unit.numel :].zero_()  # padding: see [Note: flat shard layout]
        unit.grad_flat = flat
        self.ledger.grad_alloc(unit.name, flat.numel() * flat.element_size())
        return unit.grad_views(flat), False

    def post_backward(self, use: Use, grads) -> None:
        """``grads``: one gradient (or None) per slot, or None when the caller wrote them
        through :meth:`grad_buffer` (or the unit is frozen)."""
        if use.recompute:
            return
        unit = use.unit
        self._enter_backward()
        if use.state is UseState.BACKWARD:
            self._count(unit, active=-1)
        else:  # backward without pre_backward: a split op that needs no weights
            self._take_await(use)
        use.state = UseState.DONE
        use.abandoned = False
        if grads is not None and unit.requires_grad:
            views, accumulate = self.grad_buffer(unit)
            for view, grad in zip(views, grads):
                if grad is None:
                    if not accumulate:
                        view.zero_()
                elif accumulate:
                    view.add_(grad)
                else:
                    view.copy_(grad)
        if unit.n_await == 0 and unit.n_active == 0 and unit.grad_flat is not None and self.sync_gradients:
            self._reduce_scatter(unit)
        self._maybe_free(unit)
        if self._bwd_order is not None:
            self._prefetch(self._bwd_order, self._bwd_cursor)

    # ---- gathers ------------------------------------------------------------------
    def _issue(self, unit: ShardUnit, order: list[ShardUnit] | None = None, pos: int = 0) -> None:
        """Gather ``unit``; a small one takes the next small units of ``order`` (after
        ``pos``) along, see [Note: coalesced small units]."""
        if unit.state is not GatherState.SHARDED:
            return
        if unit.coalescible and order is not None:
            riders = self._riders(unit, order, pos)
            if riders:
                group = [unit] + riders
                for u in group:
                    self._start_gather(u)
                names = ", ".join(repr(u.name) for u in group[:4]) + (", ..." if len(group) > 4 else "")
                pending = self.comm.all_gather_coalesced(
                    [u.gathered for u in group], [u.shard for u in group],
                    f"coalesced all-gather of {len(group)} units ({names})",
                )
                shared = _Once(pending.wait)
                for u in group:
                    u.pending = shared
                return
        self._start_gather(unit)
        unit.pending = self.comm.all_gather(unit.gathered, unit.shard, f"all-gather of unit {unit.name!r}")

    def _start_gather(self, unit: ShardUnit) -> None:
        unit.alloc_gathered()
        self.ledger.gather(unit.name, unit.gathered_bytes)
        unit.state = GatherState.GATHERING
        unit.gathered_version = unit.shard._version
        self._live[unit] = None
        self._live_bytes += unit.gathered_bytes
        if self._kept(unit):
            self._kept_bytes += unit.gathered_bytes

    def _riders(self, unit: ShardUnit, order: list[ShardUnit], pos: int) -> list[ShardUnit]:
        budget = self.coalesce_bytes - unit.gathered_bytes
        room = self.prefetch_bytes - self.transient_bytes() - unit.gathered_bytes
        riders, seen = [], {unit}
        for other in order[pos + 1 :]:
            if not other.coalescible or other.state is not GatherState.SHARDED or other in seen:
                continue
            if other.dtype != unit.dtype or other.gathered_bytes > min(budget, room):
                break
            riders.append(other)
            seen.add(other)
            budget -= other.gathered_bytes
            room -= other.gathered_bytes
        return riders

    def _wait(self, unit: ShardUnit) -> None:
        if unit.state is GatherState.GATHERING:
            unit.pending.wait()
            unit.pending = None
            unit.state = GatherState.GATHERED

    def _free(self, unit: ShardUnit) -> None:
        if unit.state is GatherState.SHARDED:
            return
        self._wait(unit)  # never release memory a collective still writes
        unit.free_gathered()
        self.ledger.free(unit.name)
        del self._live[unit]
        self._live_bytes -= unit.gathered_bytes
        if self._kept(unit):
            self._kept_bytes -= unit.gathered_bytes

    def _maybe_free(self, unit: ShardUnit) -> None:
        """See [Note: unit lifetime]."""
        if unit.state is GatherState.SHARDED or unit.n_active > 0:
            return
        if unit.mode is Mode.DP and unit.n_await > 0 and unit.backward_needs_weights:
            return
        self._free(unit)

    def _kept(self, unit: ShardUnit) -> bool:
        return unit.mode is Mode.DP and unit.n_active == 0 and unit.n_await > 0

    def _count(self, unit: ShardUnit, active: int = 0, awaiting: int = 0) -> None:
        """Change a unit's use counts, keeping the kept-bytes total (see transient_bytes)."""
        live = unit in self._live
        if live and self._kept(unit):
            self._kept_bytes -= unit.gathered_bytes
        unit.n_active += active
        unit.n_await += awaiting
        if live and self._kept(unit):
            self._kept_bytes += unit.gathered_bytes

    def transient_bytes(self) -> int:
        """Gathered bytes that count against the prefetch window: every live unit but
        ``dp`` units that finished forward and wait for backward (kept). O(1): the
        totals move with every gather, free and use-count change."""
        return self._live_bytes - self._kept_bytes

    def _prefetch(self, order: list[ShardUnit], start: int) -> None:
        """See [Note: prefetch window]."""
        if self.prefetch_bytes <= 0:
            return
        transient = None
        for pos in range(start, len(order)):
            unit = order[pos]
            if unit.state is not GatherState.SHARDED:
                continue
            if transient is None:
                transient = self.transient_bytes()
            if transient + unit.gathered_bytes > self.prefetch_bytes:
                return
            self._issue(unit, order, pos)
            transient = None  # riders may have come along

    # ---- gradients ----------------------------------------------------------------
    def _take_await(self, use: Use) -> None:
        if use.state is UseState.AWAIT_BACKWARD:
            self._count(use.unit, awaiting=-1)
            self._awaiting.pop(use, None)

    def _reduce_scatter(self, unit: ShardUnit) -> None:
        if unit.coalescible and self.coalesce_bytes > 0:
            # see [Note: coalesced small units]
            if unit in self._deferred:
                return
            self._deferred[unit] = None
            self._deferred_bytes += unit.grad_flat.numel() * unit.grad_flat.element_size()
            if self._deferred_bytes >= self.coalesce_bytes:
                self._flush_deferred()
            return
        flat, unit.grad_flat = unit.grad_flat, None
        self._grad_bytes[unit] = flat.numel() * flat.element_size()
        if flat.dtype != unit.reduce_dtype:  # accumulated in fp32, reduced in reduce_dtype
            flat = flat.to(unit.reduce_dtype)
        out = torch.empty(unit.shard_numel, dtype=unit.shard_dtype, device=flat.device)
        pending = self.comm.reduce_scatter(out, flat, f"reduce-scatter of unit {unit.name!r}")
        self.ledger.reduce_scattered(unit.name)
        # (units, sharded outputs, unsharded inputs kept alive until done, pending)
        self._reduce_scatters.append(((unit,), (out,), (flat,), pending))
        while len(self._reduce_scatters) > self.max_inflight_reduce_scatters:
            self._finish_reduce_scatter()

    def _flush_deferred(self) -> None:
        units, self._deferred, self._deferred_bytes = list(self._deferred), {}, 0
        if not units:
            return
        by_dtype: dict[torch.dtype, list[ShardUnit]] = {}
        for unit in units:
            by_dtype.setdefault(unit.reduce_dtype, []).append(unit)
        for dtype, group in by_dtype.items():
            flats, outs = [], []
            for unit in group:
                flat, unit.grad_flat = unit.grad_flat, None
                self._grad_bytes[unit] = flat.numel() * flat.element_size()
                flats.append(flat if flat.dtype == dtype else flat.to(dtype))
                outs.append(torch.empty(unit.shard_numel, dtype=unit.shard_dtype, device=flat.device))
                self.ledger.reduce_scattered(unit.name)
            if len(group) == 1:
                pending = self.comm.reduce_scatter(outs[0], flats[0], f"reduce-scatter of unit {group[0].name!r}")
            else:
                names = ", ".join(repr(u.name) for u in group[:4]) + (", ..." if len(group) > 4 else "")
                pending = self.comm.reduce_scatter_coalesced(
                    outs, flats, f"coalesced reduce-scatter of {len(group)} units ({names})"
                )
            self._reduce_scatters.append((tuple(group), tuple(outs), tuple(flats), pending))
            while len(self._reduce_scatters) > self.max_inflight_reduce_scatters:
                self._finish_reduce_scatter()

    def _finish_reduce_scatter(self, keep: bool = True) -> None:
        """Wait for the oldest reduce-scatter; ``keep=False`` drops its result."""
        units, outs, _inputs, pending = self._reduce_scatters.popleft()
        pending.wait()
        for unit, out in zip(units, outs):
            if keep:
                out.div_(self.comm.world_size)  # average over ranks (each rank's loss is a local mean)
                unit.accumulate_sharded_grad(out)
            self.ledger.grad_free(unit.name, self._grad_bytes.pop(unit))

    # ---- end of backward --------------------------------------------------------------
    def _enter_backward(self) -> None:
        if not self._in_backward and _in_autograd_engine():
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """See [Note: unit lifetime]: the same on every rank."""
        for use in list(self._awaiting):
            self._take_await(use)
            use.state = UseState.DONE
            use.abandoned = True
        if self.sync_gradients:
            for unit in self.units:
                if unit.grad_flat is not None and unit.n_active == 0:
                    self._reduce_scatter(unit)
        self.wait_reduce_scatters()
        for unit in list(self._live):
            if unit.n_active == 0:
                self._free(unit)
        if self._bwd_recording is not None:
            # uses whose backward never came (outputs not in the loss) drop out
            self._bwd_order, self._bwd_recording = self._bwd_recording, None
        self._in_backward = False
        self._bwd_cursor = 0

    def recover(self) -> None:
        """Back to the state of a fresh step; see [Note: recovery after an exception]."""
        for use in list(self._awaiting):
            use.state = UseState.DONE
            use.abandoned = True
        self._awaiting.clear()
        for unit in self.units:
            unit.n_active = unit.n_await = 0
        self._kept_bytes = 0
        for unit in list(self._live):
            self._free(unit)  # waits for its gather first
        while self._reduce_scatters:  # a failed step's gradients: waited for, dropped
            self._finish_reduce_scatter(keep=False)
        self._deferred, self._deferred_bytes = {}, 0
        for unit in self.units:
            if unit.grad_flat is not None:
                flat, unit.grad_flat = unit.grad_flat, None
                self.ledger.grad_free(unit.name, flat.numel() * flat.element_size())
        self._recording = None
        if self._bwd_recording:  # the first backward died: record it again next time
            self._bwd_recording = []
        self._in_forward = self._in_backward = False
        self._fwd_cursor = self._bwd_cursor = 0
        for listener in self.recover_listeners:
            listener()

    def wait_reduce_scatters(self) -> None:
        self._flush_deferred()
        while self._reduce_scatters:
            self._finish_reduce_scatter()

    def gathered_units(self) -> list[str]:
        return [u.name for u in self._live]


class _Once:
    """A shared wait (coalesced gather): the first caller waits, later ones return."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def wait(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def _find(order: list[ShardUnit], unit: ShardUnit, start: int) -> int | None:
    for i in range(start, len(order)):
        if order[i] is unit:
            return i
    return None
