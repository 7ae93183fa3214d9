"""Asynchronous all-gather / reduce-scatter with one code path for NCCL and gloo.

[Note: comm ordering]
Compute never does a device-wide sync. A collective returns a :class:`Pending`; compute
calls ``wait()`` right before it reads the result:

- CUDA: the collective runs on its own stream (all-gather stream / reduce-scatter
  stream) after that stream waited for the compute stream (so buffers allocated and
  gradients produced on the compute stream are ready); ``wait()`` makes the compute
  stream wait on an event recorded after the collective. Buffers are allocated and
  freed on the compute stream, and freed only after the compute stream waited on the
  event, so no ``record_stream`` is needed.
- CPU (gloo): the collective is issued with ``async_op=True``; ``wait()`` waits on
  the Work.

Every rank issues the same collectives in the same order (the scheduler's decisions
depend only on the plan, the unit sizes and the recorded order, equal on all ranks).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist


# torch >= 2.13 names them *_single and deprecates the *_into_tensor / *_tensor names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending(NamedTuple):
    """A collective in flight; ``wait()`` orders the caller's compute after it."""

    wait: Callable[[], None]


def _done() -> None:
    return None


class CommContext:
    """Issues the runtime's collectives on ``group``; one instance per OSDP model."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.use_streams = device.type == "cuda"
        if self.use_streams:
            # own streams, high priority so comm kernels are not queued behind compute
            self.all_gather_stream = torch.cuda.Stream(device=device, priority=-1)
            self.reduce_scatter_stream = torch.cuda.Stream(device=device, priority=-1)

    def _issue(self, stream, fn, output: torch.Tensor) -> Pending:
        # Writes into ``output`` must not bump its autograd version counter (gloo may
        # copy into it on a worker thread, any time before wait() returns): restore the
        # version it had at issue, after issuing and after waiting. See
        # [Note: freeing gathered storage] in shard_unit.py.
        version = output._version

        def restore():
            torch._C._autograd._unsafe_set_version_counter((output,), (version,))

        if not self.use_streams:
            work = fn(async_op=True)
            restore()

            def wait():
                if work is not None:
                    work.wait()
                restore()

            return Pending(wait)
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            fn(async_op=False)
            event = torch.cuda.Event()
            event.record(stream)
        restore()
        return Pending(lambda: compute.wait_event(event))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> Pending:
        """``output`` (world * shard numel) <- the shards of all ranks, in rank order."""
        if self.world_size == 1 and not self.use_streams:  # CUDA keeps the stream path
            with torch.autograd._unsafe_preserve_version_counter(output):
                output.copy_(shard.detach())
            return Pending(_done)

        def fn(async_op):
            return _all_gather(output, shard.detach(), group=self.group, async_op=async_op)

        return self._issue(self.all_gather_stream if self.use_streams else None, fn, output)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> Pending:
        """``output`` (shard numel) <- this rank's chunk of the sum of ``full`` over ranks."""
        if self.world_size == 1 and not self.use_streams:
            output.copy_(full)
            return Pending(_done)

        def fn(async_op):
            return _reduce_scatter(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

        return self._issue(self.reduce_scatter_stream if self.use_streams else None, fn, output)

    def all_gather_sync(self, shard: torch.Tensor) -> torch.Tensor:
        """Blocking gather of a full flat buffer (state dicts, not the training path)."""
        output = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        self.all_gather(output, shard).wait()
        if self.use_streams:
            torch.cuda.current_stream(self.device).synchronize()
        return output
