"""Asynchronous all-gather / reduce-scatter with one code path for NCCL and gloo.

[Note: comm ordering]
Compute never does a device-wide sync. A collective returns a :class:`Pending`; compute
calls ``wait()`` right before it reads the result:

- CUDA: the collective runs on its own stream (all-gather stream / reduce-scatter
  stream) after that stream waited for the compute stream (so buffers allocated and
  gradients produced on the compute stream are ready); ``wait()`` makes the compute
  stream wait on an event recorded after the collective. Buffers are allocated and
  freed on the compute stream, and freed only after the compute stream waited on the
  event, so no ``record_stream`` is needed. Streams and events are behind the small
  interface of ``streams.py``, whose CPU simulation runs this same path on gloo
  (see [Note: simulated streams]).
- CPU (gloo): the collective is issued with ``async_op=True``; ``wait()`` waits on
  the Work, at most ``timeout_s`` (see [Note: collective timeouts]).

[Note: collectives per level]
A CommContext issues on the levels of its :class:`~osdp.runtime.mesh.ShardLayout`
(see [Note: shard layout]): gathers on the shard group (or, for an ``hpz`` unit's
backward, on the node group: ``level="node"``); a gradient is reduced on the shard
group and then, when the layout has replicas (HSDP), all-reduced across the replicate
group, in the reduce dtype, before it is cast into the shard's dtype: one collective
per level, issued by the same ``Pending`` (on CUDA both on the reduce-scatter stream,
in order; on gloo the replicate all-reduce is issued when the shard-level one is
waited on). Every collective goes through one of the module-level entry points
``all_gather_flat``, ``reduce_scatter_flat``, ``all_reduce_flat`` (tests count calls
per group by wrapping them). ``rep`` units' gradient buckets are all-reduced over the
world level in one step (every rank holds them whole), never through the shard level.

Every rank issues the same collectives in the same order (the scheduler's decisions
depend only on the plan, the unit sizes and the recorded order, equal on all ranks).

[Note: collective timeouts]
Every wait on a collective is bounded by ``timeout_s``: a rank that died or hangs makes
the others raise :class:`CollectiveTimeoutError` (an ``OSDPError``) naming the
collective and the unit(s) it was for, instead of blocking forever. On gloo this is
``Work.wait(timeout)``; a peer whose process exited is usually reported sooner, as a
closed connection, which is turned into the same error. On CUDA the wait is an event
on the compute stream (no CPU block); NCCL's own watchdog timeout applies there. The
compiled path's collectives are bounded on a group of their own ([Note: compiled
collective timeouts] in compiled_collectives.py); a compiled forward's failure is the
same error (:func:`is_collective_failure`), a compiled backward's the backend's own.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..contract import gradient_collective
from ..errors import CollectiveTimeoutError
from ..torch_names import all_gather_flat, reduce_scatter_flat  # the current torch names
from .lockstep_check import IssueLog
from .mesh import ShardLayout
from .streams import streams_for

DEFAULT_TIMEOUT_S = 300.0


def all_reduce_flat(tensor: torch.Tensor, group, async_op: bool):
    """Sum ``tensor`` in place over ``group`` (an entry point: see [Note: collectives per level])."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


NAMED_UNITS = 4  # a coalesced collective's description names this many of its units


def named_units(units) -> str:
    """``'a', 'b', 'c', 'd', ...``: the first ``NAMED_UNITS`` units' names, for a
    coalesced collective's description."""
    names = [repr(u.name) for u in units]
    return ", ".join(names[:NAMED_UNITS]) + (", ..." if len(names) > NAMED_UNITS else "")


class Pending(NamedTuple):
    """A collective in flight; ``wait()`` orders the caller's compute after it: blocks
    on the gloo Work (bounded by the timeout) or makes the compute stream wait on the
    CUDA event. ``keep_alive`` holds every temporary the collective reads or writes (a
    cast shard, staging buffers) until then, so the caching allocator cannot hand them
    out while a comm stream still uses them."""

    handle: object  # gloo Work, CUDA Event, an inner Pending, or None (done at issue)
    keep_alive: tuple
    finish: Callable[[], None]

    def wait(self) -> None:
        self.finish()


def _done() -> None:
    return None


DONE = Pending(None, (), _done)


def reduces_with_all_reduce(device: torch.device) -> bool:
    """Whether gradients are all-reduced (then sliced) instead of reduce-scattered
    (``contract.gradient_collective``); see [Note: gloo reduce-scatter]."""
    return gradient_collective(device.type) == "all_reduce"


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's report of a collective that failed or timed out:
    a ``DistError`` (NCCL), or gloo's ``RuntimeError`` naming its transport."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport" in str(exc))


class CommContext:
    """Issues the runtime's collectives on the levels of a layout (``layout``, or the
    1-D layout of ``group``); one instance per OSDP model. ``group``, ``rank`` and
    ``world_size`` are the shard level's (what units are sharded over);
    ``data_parallel_size`` counts every rank of the layout (what gradients are averaged
    over)."""

    def __init__(self, group, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, streams=None,
                 layout: ShardLayout | None = None):
        self.layout = layout if layout is not None else ShardLayout.flat(group)
        self.group = self.layout.shard.group
        self.device = device
        self.world_size = self.layout.shard.size
        self.rank = self.layout.shard.rank
        self.data_parallel_size = self.layout.world.size
        self.timeout_s = float(timeout_s)
        self._timeout = timedelta(seconds=self.timeout_s)
        self.streams = streams if streams is not None else streams_for(device, self.timeout_s)
        self.use_streams = self.streams is not None
        if self.use_streams:
            self.all_gather_stream = self.streams.new_stream("all-gather")
            self.reduce_scatter_stream = self.streams.new_stream("reduce-scatter")
        # see [Note: gloo reduce-scatter]
        self.reduce_with_all_reduce = reduces_with_all_reduce(device)
        # what this rank issued since the last lockstep check (None: no check)
        self.issued: IssueLog | None = None

    def _note(self, what: str, numel: int, members: tuple[str, ...] = ()) -> None:
        """Log a collective for the lockstep check ([Note: lockstep check] in
        lockstep_check.py), with its units' names where ``what`` names only some."""
        if self.issued is not None:
            self.issued.note(what, numel, members if len(members) > NAMED_UNITS else ())

    # ---- waiting ------------------------------------------------------------------
    def wait_work(self, work, what: str) -> None:
        """Wait on a gloo Work for at most ``timeout_s``; see [Note: collective timeouts]."""
        if work is None:
            return
        try:
            work.wait(self._timeout)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
            raise self.failure(what, exc) from exc

    def _start(self, fn, what: str):
        """Issue an async collective; a peer already gone can fail the issue itself."""
        try:
            return fn(async_op=True)
        except Exception as exc:  # noqa: BLE001
            raise self.failure(what, exc) from exc

    def failure(self, what: str, exc: BaseException) -> CollectiveTimeoutError:
        """The error for ``what`` failing with ``exc`` (a backend's error)."""
        text = str(exc).strip()
        return CollectiveTimeoutError(
            f"rank {self.rank}: {what} failed or did not complete within timeout_s={self.timeout_s:g} "
            f"(a peer rank died, hangs, or runs a different step; in generate(), ranks that finish at other "
            f"lengths: pass synced_gpus=True): {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        )

    def _issue(self, stream, fn, output: torch.Tensor, what: str, after: Callable[[], None] | None = None) -> Pending:
        # Writes into ``output`` must not bump its autograd version counter (gloo may
        # copy into it on a worker thread, any time before wait() returns): restore the
        # version it had at issue, after waiting. See [Note: freeing gathered storage]
        # in shard_unit.py.
        if not self.use_streams:
            version = output._version
            work = self._start(fn, what)
            torch._C._autograd._unsafe_set_version_counter((output,), (version,))

            def wait():
                self.wait_work(work, what)
                if after is not None:
                    after()
                torch._C._autograd._unsafe_set_version_counter((output,), (version,))

            return Pending(work, (output,), wait)
        version = output._version

        def work():
            try:
                fn(async_op=False)
            except Exception as exc:  # noqa: BLE001 - a peer gone, a freed buffer, ...
                raise self.failure(what, exc) from exc
            if after is not None:
                after()
            torch._C._autograd._unsafe_set_version_counter((output,), (version,))

        self.streams.wait_for_compute(stream)
        event = self.streams.run(stream, work)
        torch._C._autograd._unsafe_set_version_counter((output,), (version,))
        # keep_alive holds every temporary the collective reads or writes (a cast
        # shard, staging buffers): freed only after the compute stream waited on the
        # event, so the caching allocator cannot hand them out while the comm stream
        # still uses them
        return Pending(event, (output, fn, after), lambda: self.streams.wait(event))

    # ---- gathers ------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, what: str = "all-gather",
                   level: str = "shard") -> Pending:
        """``output`` (level size * shard numel) <- the shards of all ranks of ``level``
        ("shard", or "node" for an hpz unit's backward), in rank order. ``shard`` may
        have another dtype than ``output`` (mixed precision): it is cast first, so the
        collective moves ``output``'s dtype."""
        self._note(what, output.numel())
        shard = shard.detach()
        group, size = self._group(level)
        if output.numel() == 0:
            return DONE
        if size == 1 and not self.use_streams:  # CUDA keeps the stream path
            with torch.autograd._unsafe_preserve_version_counter(output):
                output.copy_(shard)
            return DONE
        if shard.dtype != output.dtype:
            shard = shard.to(output.dtype)

        def fn(async_op):
            return all_gather_flat(output, shard, group=group, async_op=async_op)

        return self._issue(self.all_gather_stream if self.use_streams else None, fn, output, what)

    def _group(self, level: str):
        lv = self.layout.level(level)
        return lv.group, lv.size

    def all_gather_coalesced(self, outputs: list[torch.Tensor], shards: list[torch.Tensor], what: str,
                             level: str = "shard", members: tuple[str, ...] = ()) -> Pending:
        """One collective for several units: ``outputs[i]`` (level size * ``shards[i]``
        numel, one dtype for all) <- the shards of all ranks of ``level``. The shards are
        copied into one input, gathered into one rank-major buffer and copied out on
        ``wait()``; see [Note: coalesced small units] in prefetch.py. ``members``: the
        units' names (``what`` names the first ``NAMED_UNITS``: :func:`named_units`)."""
        self._note(what, sum(o.numel() for o in outputs), members)
        group, size = self._group(level)
        if size == 1 and not self.use_streams:
            for out, shard in zip(outputs, shards):
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(shard.detach())
            return DONE
        dtype = outputs[0].dtype
        sizes = [s.numel() for s in shards]
        flat_in = torch.cat([s.detach().reshape(-1).to(dtype) for s in shards])
        flat_out = torch.empty(size * flat_in.numel(), dtype=dtype, device=flat_in.device)

        def copy_out():
            rows = flat_out.view(size, -1)
            for out, part in zip(outputs, rows.split(sizes, dim=1)):
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.view(size, -1).copy_(part)

        def fn(async_op):
            return all_gather_flat(flat_out, flat_in, group=group, async_op=async_op)

        return self._issue(self.all_gather_stream if self.use_streams else None, fn, flat_out, what, after=copy_out)

    # ---- reductions -----------------------------------------------------------------
    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, what: str = "reduce-scatter") -> Pending:
        """``output`` (shard numel) <- this rank's chunk of the sum of ``full`` over ranks
        (``output`` may have another dtype: the chunk is cast into it). ``full`` is
        clobbered."""
        self._note(what, full.numel())
        return self._reduce(output, full, what)

    def _reduce(self, output: torch.Tensor, full: torch.Tensor, what: str) -> Pending:
        """Shard level, then the replicas; see [Note: collectives per level]."""
        if full.numel() == 0:
            return DONE
        if self.layout.replicate.size == 1:
            return self._reduce_shard(output, full, what)
        # the shard-level result stays in the reduce dtype for the replicate all-reduce
        chunk = output if output.dtype == full.dtype else torch.empty(output.shape, dtype=full.dtype, device=full.device)
        inner = self._reduce_shard(chunk, full, what)
        return self._all_reduce_replicas(output, chunk, inner, what)

    def _all_reduce_replicas(self, output: torch.Tensor, chunk: torch.Tensor, inner: Pending, what: str) -> Pending:
        """``chunk`` (after ``inner``) summed across the replicate group, cast into ``output``."""
        group = self.layout.replicate.group
        what = f"{what}, all-reduce across replicas"

        def finish():
            if chunk is not output:
                output.copy_(chunk)

        def fn(async_op):
            return all_reduce_flat(chunk, group, async_op)

        if self.use_streams:
            # after the shard-level collective on the same stream (issue order)
            return self._issue(self.reduce_scatter_stream, fn, chunk, what, after=finish)._replace(
                keep_alive=(inner, chunk, output))

        def wait():
            inner.wait()
            work = self._start(fn, what)
            self.wait_work(work, what)
            finish()

        return Pending(inner, (chunk, output), wait)

    def _reduce_shard(self, output: torch.Tensor, full: torch.Tensor, what: str) -> Pending:
        if self.world_size == 1 and not self.use_streams:
            output.copy_(full)
            return DONE
        if self.reduce_with_all_reduce:
            return self._reduce_by_all_reduce(output, full, what)
        target = output if output.dtype == full.dtype else torch.empty(output.shape, dtype=full.dtype, device=full.device)

        def fn(async_op):
            return reduce_scatter_flat(target, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

        after = None if target is output else (lambda: output.copy_(target))
        return self._issue(self.reduce_scatter_stream if self.use_streams else None, fn, target, what, after=after)

    def reduce_scatter_coalesced(self, outputs: list[torch.Tensor], fulls: list[torch.Tensor], what: str,
                                 members: tuple[str, ...] = ()) -> Pending:
        """One collective for several units' unsharded gradients (one dtype):
        ``outputs[i]`` <- this rank's chunk of the sum of ``fulls[i]``; ``members``: as
        in :meth:`all_gather_coalesced`."""
        self._note(what, sum(f.numel() for f in fulls), members)
        if self.world_size == 1 and not self.use_streams:
            for out, full in zip(outputs, fulls):
                out.copy_(full)
            return DONE
        sizes = [o.numel() for o in outputs]
        # rank-major: row r = [chunk r of unit 0 | chunk r of unit 1 | ...]
        full = torch.cat([f.view(self.world_size, -1) for f in fulls], dim=1).view(-1)
        reduced = torch.empty(sum(sizes), dtype=full.dtype, device=full.device)

        def copy_out():
            for out, part in zip(outputs, reduced.split(sizes)):
                out.copy_(part)

        return self._coalesced_reduce(reduced, full, what, copy_out)

    def _coalesced_reduce(self, reduced, full, what, copy_out) -> Pending:
        inner = self._reduce(reduced, full, what)
        if self.use_streams:
            # ordered after the collective on the same stream
            event = self.streams.run(self.reduce_scatter_stream, copy_out)
            return Pending(event, (inner, copy_out), lambda: self.streams.wait(event))

        def wait():
            inner.wait()
            copy_out()

        return Pending(inner, (reduced, full), wait)

    def _reduce_by_all_reduce(self, output: torch.Tensor, full: torch.Tensor, what: str) -> Pending:
        """[Note: gloo reduce-scatter]
        gloo's reduce-scatter of one flat tensor is 1.5-2x slower than its all-reduce of
        the same tensor at the sizes units have (measured on CPU: 66K floats 0.9 vs 0.55
        ms, 200K floats 2.2 vs 1.2 ms), so on gloo the unsharded gradient is all-reduced
        in place and this rank's chunk copied out. The memory is the same: the full
        buffer is live until the collective is done either way."""
        chunk = full.narrow(0, self.rank * output.numel(), output.numel())

        def fn(async_op):
            return all_reduce_flat(full, self.group, async_op)

        if self.use_streams:
            return self._issue(self.reduce_scatter_stream, fn, full, what, after=lambda: output.copy_(chunk))
        work = self._start(fn, what)

        def wait():
            self.wait_work(work, what)
            output.copy_(chunk)

        return Pending(work, (full,), wait)

    def all_reduce_replicated(self, tensor: torch.Tensor, what: str, members: tuple[str, ...] = ()) -> Pending:
        """Sum ``tensor`` in place over EVERY rank of the layout (replicas included): the
        staging copy of a bucket of ``rep`` units' gradients (contract.py [Note:
        replicated units]), on the reduction stream; ``members``: as in
        :meth:`all_gather_coalesced`."""
        self._note(what, tensor.numel(), members)
        world = self.layout.world
        if tensor.numel() == 0 or (world.size == 1 and not self.use_streams):
            return DONE

        def fn(async_op):
            return all_reduce_flat(tensor, world.group, async_op)

        return self._issue(self.reduce_scatter_stream if self.use_streams else None, fn, tensor, what)

    # ---- blocking helpers (not the training path) --------------------------------------
    def all_gather_sync(self, shard: torch.Tensor) -> torch.Tensor:
        """Blocking gather of a full flat buffer (state dicts, not the training path)."""
        output = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        self.all_gather(output, shard, "all-gather (state dict)").wait()
        if self.use_streams:
            self.streams.synchronize()
        return output

    def all_gather_object_hash(self, value: int, what: str) -> list[int]:
        """Every rank's int64 ``value`` (configuration checks) over the whole layout,
        bounded by the timeout."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        every = torch.empty(self.layout.world.size, dtype=torch.int64, device=self.device)
        self.all_gather(every, mine, what, level="world").wait()
        if self.use_streams:
            self.streams.synchronize()
        return every.tolist()
