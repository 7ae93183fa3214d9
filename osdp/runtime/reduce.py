"""GradReducer: unsharded gradient buffers, the reduce-scatter queue, coalesced
reductions of small units, the replicated buckets of ``rep`` units, and accumulation
across micro-batches. When a group or bucket is issued and how many stay in flight are
``osdp.schedule_rules``' decisions (``group_full``, ``by_key``, ``waits_after_issue``,
``waits_before_issue``), shared with the planner's step simulation.

[Note: unsharded gradients]
A unit's unsharded gradient buffer lives from its first backward use until its
reduce-scatter is waited on. At most ``max_inflight`` (1) reduce-scatters are in
flight: issuing one more waits for the oldest, so at most two units' unsharded
gradients are live at once (the one being computed and the one being reduced), plus
partial gradients of units used more than once whose last use is still to come. A
finished reduce-scatter is averaged over ranks and handed to the original parameters
(``ShardUnit.accumulate_sharded_grad``). With replicas (HSDP) one reduction is both
collectives of [Note: collectives per level] in collectives.py: the shard-level
reduce-scatter and the all-reduce across replicas; "in flight" counts them as one, and
the average is over every rank of the layout.

[Note: coalesced reductions]
Small units (see [Note: coalesced small units] in prefetch.py) do not reduce alone:
their unsharded gradients wait, up to ``coalesce_bytes`` in total, and are reduced in
one collective, at the latest at the end of the backward pass. The unsharded-gradient
peak may grow by at most ``coalesce_bytes`` (a constant; default 64 KiB), and a group in
flight holds two copies of its own (the rank-major concatenation and the collective's
output, ``CommContext.reduce_scatter_coalesced``), made while its gradients are still
there, which are dropped once they are: the planner prices both moments ([Note: pending
reduction], [Note: end of backward moment]).

[Note: replicated buckets]
A ``rep`` unit's gradient (contract.py [Note: replicated units]) is not
reduce-scattered: after its last backward use its unsharded buffer (G, kept on the
unit) joins the bucket. The bucket is issued once it holds >= REPLICATE_BUCKET_BYTES
(counted as G in reduce_dtype, whatever dtype an accumulator has) and at the end of
the backward pass: the buffers are copied into one flat staging tensor in reduce_dtype
(concatenated in join order) and divided by the ranks of the layout before the
collective (as torch DDP does: no pass over the bucket after it), and that is
all-reduced over every rank of the layout (``CommContext.all_reduce_replicated``, one
collective); issuing beyond MAX_INFLIGHT_REPLICATE_BUCKETS waits for the oldest first,
before the new staging copy is made.
Finished, the staging copy (cast into the parameters' dtype where that differs) is the
mean, and each unit's
range of it is handed to ``.grad`` (``accumulate_replicated_grad``: it BECOMES ``.grad``
where that was None, no copy; added otherwise); then the G buffers are freed. So G and
the staging copy are both live while the bucket is in flight (the ledger counts both
under each unit's name), as the contract prices it, and afterwards the staging copy is
the ``.grad`` a rep unit keeps between steps (the same bytes as the buffer it replaces).
A bucket holds one (reduce dtype, parameter dtype) pair; units of another pair fill
their own bucket. A direct rep unit's G is its parameters' own ``.grad`` (direct.py
[Note: direct replicated units]); it joins and is staged the same way, and the result
replaces its ``.grad``. Sharded units' reductions never carry rep units and the other way
round, and each has its own in-flight queue.

[Note: gradient accumulation]
With ``sync_gradients`` off (``OSDP.no_sync()`` / ``set_requires_gradient_sync(False)``)
a unit's unsharded gradient is not reduce-scattered after its last use: it stays, in
fp32 (the shards' dtype), and the next micro-batches add into it. The micro-batch whose
backward runs with sync on adds its gradient and reduce-scatters the sum (in
``reduce_dtype``); the result is added into ``.grad`` like any step. With sync on for
every micro-batch, each reduce-scatter adds into ``.grad``.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from ..contract import MAX_INFLIGHT_REDUCE_SCATTERS, MAX_INFLIGHT_REPLICATE_BUCKETS, REPLICATE_BUCKET_BYTES
from ..schedule_rules import by_key, group_full, waits_after_issue, waits_before_issue
from .collectives import CommContext, Pending, named_units
from .direct import drop_local_grads, local_grad_pieces
from .ledger import MemoryLedger
from .mixed_precision import average_factors
from .shard_unit import ShardUnit


class InflightReduce(NamedTuple):
    """One reduce-scatter in flight: what it reduces into and what it keeps alive."""

    units: tuple[ShardUnit, ...]
    outputs: tuple[torch.Tensor, ...]  # sharded results, one per unit
    inputs: tuple[torch.Tensor, ...]  # unsharded gradients: alive until waited
    pending: Pending
    post: float  # what the sums are divided by for the mean ([Note: fp16 gradient average])


class InflightBucket(NamedTuple):
    """One replicated bucket's all-reduce in flight ([Note: replicated buckets])."""

    units: tuple[ShardUnit, ...]
    staging: torch.Tensor  # the units' gradients, concatenated, in reduce_dtype
    # the units' gradient buffers (G): freed when finished (None: a direct unit's .grad)
    buffers: tuple[torch.Tensor | None, ...]
    pending: Pending


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _local_grad_bytes(unit: ShardUnit) -> int:
    """A direct unit's G: its parameters' ``.grad``, in the parameters' dtype."""
    return unit.numel * unit.shard.element_size()


class GradReducer:
    def __init__(self, comm: CommContext, ledger: MemoryLedger, coalesce_bytes: int):
        self.comm = comm
        self.ledger = ledger
        self.coalesce_bytes = int(coalesce_bytes)
        self.sync_gradients = True  # see [Note: gradient accumulation]
        self.max_inflight = MAX_INFLIGHT_REDUCE_SCATTERS  # see [Note: unsharded gradients]
        self._inflight: deque[InflightReduce] = deque()
        self._deferred: dict[ShardUnit, None] = {}  # small units whose reduction waits
        self._deferred_bytes = 0
        self._grad_bytes: dict[ShardUnit, int] = {}  # ledger bytes of gradients in flight
        # rep units, see [Note: replicated buckets]: the filling buckets, by dtype pair
        self.bucket_bytes = REPLICATE_BUCKET_BYTES
        self.max_inflight_buckets = MAX_INFLIGHT_REPLICATE_BUCKETS
        self._buckets: dict[tuple[torch.dtype, torch.dtype], dict[ShardUnit, None]] = {}
        self._bucket_fill: dict[tuple[torch.dtype, torch.dtype], int] = {}
        self._inflight_buckets: deque[InflightBucket] = deque()

    # ---- unsharded gradients -------------------------------------------------------------
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

    def add_grads(self, unit: ShardUnit, grads) -> None:
        """Write (or add) one gradient per slot (None: no gradient for that slot)."""
        views, accumulate = self.grad_buffer(unit)
        for view, grad in zip(views, grads):
            if grad is None:
                if not accumulate:
                    view.zero_()
            elif accumulate:
                view.add_(grad)
            else:
                view.copy_(grad)

    def local_grad(self, unit: ShardUnit) -> None:
        """A direct unit's parameter accumulated a gradient into ``.grad``: its G exists
        ([Note: direct replicated units]), counted from now until its bucket finished."""
        if not unit.grad_local:
            unit.grad_local = True
            self.ledger.grad_alloc(unit.name, _local_grad_bytes(unit))

    def has_grad(self, unit: ShardUnit) -> bool:
        """An unsharded gradient waits to be reduced (a buffer, or a direct unit's .grad)."""
        return unit.grad_flat is not None or unit.grad_local

    # ---- reduce-scatters -----------------------------------------------------------------
    def reduce(self, unit: ShardUnit) -> None:
        """Reduce ``unit``'s unsharded gradient (its last use finished backward)."""
        if unit.replicated:
            self._join_bucket(unit)
            return
        if unit.coalescible and self.coalesce_bytes > 0:
            if unit in self._deferred:
                return
            self._deferred[unit] = None
            self._deferred_bytes += unit.grad_flat.numel() * unit.grad_flat.element_size()
            if group_full(self._deferred_bytes, self.coalesce_bytes):
                self.flush()
            return
        self._issue([unit], unit.reduce_dtype)

    def flush(self) -> None:
        """Reduce the waiting small units' gradients (one collective per dtype)."""
        units, self._deferred, self._deferred_bytes = list(self._deferred), {}, 0
        for group in by_key(units, lambda u: u.reduce_dtype):
            self._issue(group, group[0].reduce_dtype)

    def _issue(self, units: list[ShardUnit], dtype: torch.dtype) -> None:
        flats, outs = [], []
        pre, post = average_factors(self.comm.data_parallel_size, dtype)  # [Note: fp16 gradient average]
        for unit in units:
            flat, unit.grad_flat = unit.grad_flat, None
            self._grad_bytes[unit] = flat.numel() * flat.element_size()
            if pre != 1:
                flat.div_(pre)  # before the cast: an fp32 accumulator's sum may not fit fp16
            flats.append(flat if flat.dtype == dtype else flat.to(dtype))  # fp32 accumulators
            outs.append(unit.reduce_output())
            self.ledger.reduce_scattered(unit.name)
        if len(units) == 1:
            pending = self.comm.reduce_scatter(outs[0], flats[0], f"reduce-scatter of unit {units[0].name!r}")
        else:
            pending = self.comm.reduce_scatter_coalesced(
                outs, flats, f"coalesced reduce-scatter of {len(units)} units ({named_units(units)})",
                members=tuple(u.name for u in units),
            )
        # a group's collective reduces its own concatenated copy (which its Pending keeps):
        # the gradients themselves can go now
        inputs = tuple(flats) if len(units) == 1 else ()
        self._inflight.append(InflightReduce(tuple(units), tuple(outs), inputs, pending, post))
        for _ in range(waits_after_issue(len(self._inflight), self.max_inflight)):
            self._finish_oldest()

    def _finish_oldest(self, keep: bool = True) -> None:
        """Wait for the oldest reduce-scatter; ``keep=False`` drops its result."""
        done = self._inflight.popleft()
        done.pending.wait()
        for unit, out in zip(done.units, done.outputs):
            if keep:
                # average over every rank of the layout, replicas included (each rank's
                # loss is a local mean); see [Note: shard layout] in mesh.py; in fp16,
                # part of it before the sum ([Note: fp16 gradient average])
                out.div_(done.post)
                unit.accumulate_sharded_grad(out)
            self.ledger.grad_free(unit.name, self._grad_bytes.pop(unit))

    # ---- replicated buckets (rep units) -----------------------------------------------------
    def _join_bucket(self, unit: ShardUnit) -> None:
        """See [Note: replicated buckets]."""
        key = (unit.reduce_dtype, unit.shard_dtype)
        bucket = self._buckets.setdefault(key, {})
        if unit in bucket:
            return  # used again before its bucket left: its buffer already holds the sum
        bucket[unit] = None
        fill = self._bucket_fill.get(key, 0) + unit.numel * key[0].itemsize
        self._bucket_fill[key] = fill
        if group_full(fill, self.bucket_bytes):
            self._issue_bucket(key)

    def flush_buckets(self) -> None:
        """All-reduce every filling bucket (end of the backward pass)."""
        for key in list(self._buckets):
            self._issue_bucket(key)

    def _issue_bucket(self, key) -> None:
        units = list(self._buckets.pop(key))
        self._bucket_fill.pop(key, None)
        # the oldest first, then this one's staging: otherwise two buckets' buffers and
        # stagings are live at once for the copy (measured, W&S 2x768's all-rep plan: the
        # step's peak, 2.3% above the model's one bucket in flight). Collectives of one
        # group run in issue order anyway, so nothing overlaps less but this copy
        for _ in range(waits_before_issue(len(self._inflight_buckets), self.max_inflight_buckets)):
            self._finish_oldest_bucket()
        dtype = key[0]
        staging = torch.empty(sum(u.numel for u in units), dtype=dtype, device=units[0].shard.device)
        pieces, buffers = [], []
        for unit in units:
            if unit.direct:
                pieces += local_grad_pieces(unit)
                unit.grad_local = False  # a later backward's gradient is counted anew
                buffers.append(None)
            else:
                # off the unit: a later use of it (another backward) starts a new buffer
                flat, unit.grad_flat = unit.grad_flat, None
                buffers.append(flat)
                pieces.append(flat[: unit.numel])
            self.ledger.grad_alloc(unit.name, unit.numel * staging.element_size())
            self.ledger.all_reduced(unit.name)
        # the mean over every rank of the layout (each rank's loss is a local mean)
        world = self.comm.data_parallel_size
        if all(piece.dtype == dtype for piece in pieces):
            # one copy and one division: a division per piece into the staging costs a
            # dispatch per parameter (measured on N&D 12x128's 149 parameters, 1 thread:
            # 6.1 ms per step, this 3.0 ms)
            torch.cat(pieces, out=staging)
            if world != 1:
                staging.div_(world)
        else:  # an fp32 accumulator: divided in its casting copy
            offset = 0
            for piece in pieces:
                torch.div(piece, world, out=staging.narrow(0, offset, piece.numel()))
                offset += piece.numel()
        pending = self.comm.all_reduce_replicated(
            staging, f"all-reduce of the replicated bucket of {len(units)} unit(s) ({named_units(units)})",
            members=tuple(u.name for u in units))
        self._inflight_buckets.append(InflightBucket(tuple(units), staging, tuple(buffers), pending))

    def _finish_oldest_bucket(self, keep: bool = True) -> None:
        """Wait for the oldest bucket; hand it to ``.grad`` (``keep=False``: drop it), then
        free the units' gradient buffers."""
        done = self._inflight_buckets.popleft()
        done.pending.wait()
        result = done.staging  # already divided: the mean once summed
        if keep and result.dtype != done.units[0].shard_dtype:
            result = result.to(done.units[0].shard_dtype)
        offset = 0
        for unit, flat in zip(done.units, done.buffers):
            if keep:
                unit.accumulate_replicated_grad(result.narrow(0, offset, unit.numel))
            elif unit.direct:
                drop_local_grads(unit)
            offset += unit.numel
            grad_bytes = _nbytes(flat) if flat is not None else _local_grad_bytes(unit)
            self.ledger.grad_free(unit.name, unit.numel * done.staging.element_size() + grad_bytes)

    def _free_grad(self, unit: ShardUnit) -> None:
        if unit.grad_flat is not None:
            flat, unit.grad_flat = unit.grad_flat, None
            self.ledger.grad_free(unit.name, _nbytes(flat))
        if unit.grad_local:
            unit.grad_local = False
            drop_local_grads(unit)
            self.ledger.grad_free(unit.name, _local_grad_bytes(unit))

    # ---- end of a step ---------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce what waits and wait for every reduction in flight."""
        self.flush()
        self.flush_buckets()
        while self._inflight:
            self._finish_oldest()
        while self._inflight_buckets:
            self._finish_oldest_bucket()

    def drop(self, units: list[ShardUnit]) -> None:
        """A failed step: wait for what was issued (every rank issued it), drop every
        result and every unsharded gradient (rep units' in filling buckets too)."""
        while self._inflight:
            self._finish_oldest(keep=False)
        while self._inflight_buckets:
            self._finish_oldest_bucket(keep=False)
        self._deferred, self._deferred_bytes = {}, 0
        self._buckets, self._bucket_fill = {}, {}
        for unit in units:
            self._free_grad(unit)
            if unit.split_params is not None:
                unit.split_params.abandon()
