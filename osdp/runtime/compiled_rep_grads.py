"""The compiled path's replicated gradients: ``rep`` units' gradients all-reduced in
eager OSDP's buckets, by hooks outside the compiled graphs ([Note: rep gradients
bucketed])."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn

from ..contract import MAX_INFLIGHT_REPLICATE_BUCKETS, REPLICATE_BUCKET_BYTES
from ..schedule_rules import pack_buckets, waits_before_issue
from .mixed_precision import average_factors

if TYPE_CHECKING:
    from .compiled import CompiledUnit


class ReplicaGradBucket:
    """[Note: rep gradients bucketed] The gradients of ``rep`` units, all-reduced in
    buckets of REPLICATE_BUCKET_BYTES as eager OSDP's are ([Note: replicated units] in
    contract.py), by hooks outside the compiled graphs instead of one all-reduce per
    unit inside them (each a blocking gloo round trip: measured, 26 rep units of the
    N&D GPT cost the compiled step more than inductor gained).

    Each parameter's tensor hook takes this pass's local gradient (autograd goes on with
    it unchanged) and sets the accumulated ``.grad`` aside; its post-accumulate hook,
    which autograd runs once per backward pass, after the last contribution, says the
    gradient is final. The buckets are fixed when the model is wrapped (the parameters
    in reverse order of the units' first use, packed by the eager rule,
    ``schedule_rules.pack_buckets``, one set per reduce dtype), so that every rank
    reduces the same parameters in each collective, and they are issued in that fixed
    order, each as soon as all of its parameters are final and the ones before it are
    issued: the same collectives in the same order on every rank, whatever order
    autograd finishes parameters in. At most MAX_INFLIGHT_REPLICATE_BUCKETS are in
    flight (issuing one more waits for the oldest), as eagerly. A callback queued on the
    autograd engine, run once the backward pass is done, issues what is left (a bucket
    whose parameters did not all get a gradient goes out with those that did), waits,
    and makes each ``.grad`` the set-aside gradient plus the average. The sum and the
    average are the per-unit path's (elementwise, in the reduce dtype), so ``.grad`` is
    bit-identical; accumulation over backward passes adds each pass's average, as
    eagerly. ``torch.autograd.grad`` accumulates nothing: it gets the local gradient and
    ``.grad`` stays as it was, as eagerly. Only for parameters of ``rep`` units alone (a
    split op's parameter shared with sharded slices keeps the per-unit all-reduce).

    A compiled backward hands autograd all of its graph's gradients at its end, so a
    bucket goes out before backward is done only where a graph ends first: after each
    block at ``scope="blocks"``, never at ``scope="model"``, where eager OSDP's buckets
    go out during backward. Until 2026-11-28 all the gradients went out in one
    collective after backward: one staging copy of every ``rep`` gradient at once (W&S
    2x768 all ``rep``: 63 MB), where the memory model prices one bucket in flight
    ([Note: rep mode] in docs/design/cost_model.md). Measured with the buckets (W&S
    2x768 all ``rep``, batch 9, 2 gloo ranks, 2-core CPU, 15 interleaved rounds,
    medians, backward phase): model scope 661 ms, blocks 663, eager 620; the one
    collective, same day: 646, 650, eager 596; neither overlaps on this machine, where
    the two ranks' compute already fills both cores.

    Tried and not kept (2026-11-28, same model and setup, 21 rounds): cutting the
    model-scope graph where the buckets fill, as dynamo's DDPOptimizer does for DDP
    (torch/_dynamo/backends/distributed.py; a subclass counting only these parameters),
    so that each piece's backward hands its gradients out while the earlier pieces'
    runs: the buckets did go out during backward (7 pieces at 16 MiB), but backward
    took 656 ms (16 MiB pieces) and 673 ms (4 MiB) against 645 ms uncut, eager 614: on
    two shared cores gloo's all-reduce takes the cycles compute needs, and each cut is
    a boundary for fusion and for the overlap pass. On a GPU, where NCCL runs beside
    compute, it is the known fix (DDP's); untried there (one GPU lent at a time, and a
    ``rep`` bucket needs two ranks).

    Tried and not kept (2026-11-27, W&S 2x768 every unit ``rep``, batch 9, 2 gloo ranks,
    2-core CPU, 21 interleaved rounds, two orders): the all-reduce inside the backward
    graph, each bucketed parameter computing through an autograd function whose
    backward hands the parameter its local gradient and a side leaf (an expanded zero,
    no memory) the gradient all-reduced in the graph, with inductor's
    ``bucket_all_reduces_fx`` in eager's 4 MiB buckets: 673 / 666 ms against 689 / 683
    for the then after-backward bucket, eager 649 / 635; on N&D all ``rep`` no gain and a
    cold first step of 36.7 s against 27.3 s (a function per parameter for dynamo to
    trace). Without inductor's bucketing the graph's per-parameter all-reduces cost 288
    ms on N&D (gloo's latency per call)."""

    def __init__(self, group, entries: list[tuple[nn.Parameter, CompiledUnit]]):
        self.group = group
        self.entries = entries
        self.buckets = _fixed_buckets(entries)
        self.bucket_of = {i: k for k, bucket in enumerate(self.buckets) for i in bucket}
        self.pending: dict[int, torch.Tensor] = {}  # this pass's local gradients
        self.set_aside: dict[int, torch.Tensor | None] = {}  # .grad before this pass
        self.accumulated: set[int] = set()
        self.issued = 0  # buckets issued this pass, in order
        self.in_flight: list[tuple[object, torch.Tensor, list[int]]] = []  # (work, flat sum, indices)
        self.queued = False
        for index, (param, _) in enumerate(entries):
            param.register_hook(functools.partial(self._take, index))
            param.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def _take(self, index: int, grad: torch.Tensor) -> None:
        if index in self.pending:  # the same parameter twice in one pass (should not happen: summed)
            self.pending[index] = self.pending[index] + grad
        else:
            self.pending[index] = grad
            param = self.entries[index][0]
            # autograd accumulates this pass alone into .grad: the average replaces it
            self.set_aside[index], param.grad = param.grad, None
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _accumulated(self, index: int, param: torch.Tensor) -> None:
        self.accumulated.add(index)
        while self.issued < len(self.buckets) and all(i in self.accumulated for i in self.buckets[self.issued]):
            self._issue(self.buckets[self.issued])

    def _issue(self, bucket: list[int]) -> None:
        """All-reduce (async) the local gradients of ``bucket``'s accumulated parameters;
        the next bucket in order is the one after it."""
        self.issued += 1
        indices = [i for i in bucket if i in self.accumulated]
        if not indices:
            return
        for _ in range(waits_before_issue(len(self.in_flight), MAX_INFLIGHT_REPLICATE_BUCKETS)):
            self._finish(*self.in_flight.pop(0))  # first: two staging copies are never live at once
        cunit = self.entries[indices[0]][1]
        flat = torch.cat([self.pending[i].reshape(-1).to(cunit.reduce_dtype) for i in indices])
        pre, _ = average_factors(cunit.world, cunit.reduce_dtype)  # [Note: fp16 gradient average]
        if pre != 1:
            flat.div_(pre)
        self.in_flight.append((c10d.all_reduce(flat, group=self.group, async_op=True), flat, indices))

    def _finish(self, work, flat: torch.Tensor, indices: list[int]) -> None:
        """Wait for a bucket and make each of its ``.grad`` the set-aside gradient plus
        the average."""
        work.wait()
        cunit = self.entries[indices[0]][1]
        flat = flat / average_factors(cunit.world, cunit.reduce_dtype)[1]
        offset = 0
        for i in indices:
            param, grad, before = self.entries[i][0], self.pending.pop(i), self.set_aside.pop(i)
            avg = flat.narrow(0, offset, grad.numel()).view(grad.shape).to(param.dtype)
            offset += grad.numel()
            # in place: the tensor autograd accumulated (or the set-aside one) keeps
            # the replicated marker mark_sharded_grads put on it
            param.grad = param.grad.copy_(avg) if before is None else before.add_(avg)

    def _flush(self) -> None:
        self.queued = False
        while self.issued < len(self.buckets):
            self._issue(self.buckets[self.issued])
        while self.in_flight:
            self._finish(*self.in_flight.pop(0))
        for index in self.pending.keys() - self.accumulated:  # torch.autograd.grad: .grad as it was
            self.entries[index][0].grad = self.set_aside[index]
        self.pending, self.set_aside, self.accumulated, self.issued = {}, {}, set(), 0


def _fixed_buckets(entries: list[tuple[nn.Parameter, CompiledUnit]]) -> list[list[int]]:
    """Indices of ``entries`` per bucket, in issue order: the parameters in reverse
    order (``entries`` is in the units' first-use order, so this is the order backward
    finishes them), packed by ``pack_buckets`` per (reduce dtype, world); a reduce
    dtype's buckets go out as they fill, its last, partly full one at the end."""
    order = list(range(len(entries)))[::-1]
    keys: dict[tuple, list[int]] = {}
    for i in order:
        cunit = entries[i][1]
        keys.setdefault((cunit.reduce_dtype, cunit.world), []).append(i)
    full, last = [], []
    for indices in keys.values():
        sizes = [entries[i][0].numel() * entries[i][1].reduce_dtype.itemsize for i in indices]
        packed = [[indices[k] for k in bucket] for bucket in pack_buckets(sizes, REPLICATE_BUCKET_BYTES)]
        full += packed[:-1]
        last.append(packed[-1])
    # the full buckets in the order their last parameter finishes; the partial ones last
    rank = {i: n for n, i in enumerate(order)}
    return sorted(full, key=lambda b: max(rank[i] for i in b)) + last

