"""The compiled path's overlap: an inductor scheduling pass that issues each unit's
all-gather while the unit before it computes, and lets each gradient reduction run
while the backward pass goes on, within the eager runtime's bounds.

[Note: compiled prefetch]
Inductor emits each functional collective where the unit that uses it was traced and
waits for it at once, so on the compiled path every gather and every reduction was
exposed (eager OSDP overlaps both: [Note: prefetch window] in prefetch.py, [Note:
unsharded gradients] in reduce.py). Inductor's own ``raise_comms`` lifts every gather
to the top of its graph: all of a block's gathered weights live at once, a peak the plan
never priced. This pass is the eager rules cut to what one graph sees:

- Gathers: the graph's first collective, if a gather that fits ``window_bytes``, is
  issued at the graph's start (nothing of the graph is gathered before it); every later
  gather right after the previous gather's wait (unit k computes while k+1 gathers), if
  the two units' gathered bytes fit ``window_bytes`` together (the eager walk's own
  test, ``schedule_rules.prefetch_walk``, with one candidate; the window is twice the
  largest gathered unit by default, so they do). One gather in flight beside the unit
  in use, as eagerly; only what the gather reads moves with it (its shard's rebuild and
  cast). In a backward graph that puts a re-gather ahead of the reduction before it.
- Reductions: the wait of a reduction (a gradient's reduce-scatter or all-reduce), and
  what reads its result (the average, the cast), are held back until the next collective
  is issued or the graph ends, so the reduction runs under the backward compute that
  follows. At most one reduction in flight beside the gradient being computed, as
  eagerly (MAX_INFLIGHT_REDUCE_SCATTERS).

Every rank issues the same collectives in the same order. Inductor chains them (each
collective has an ordering-only dependency on the previous one's wait,
``comms.decide_global_ordering_of_comms``); the pass drops that dependency only for a
gather it raises, and every decision reads only the collectives, their waits, their
order and their sizes, which are the same on every rank (a shard's rebuild is not: one
parameter's view on one rank, pieces and padding on another). A gather that reads a
reduction's result for real stays behind it. Units in different graphs (blocks compiled
one by one) do not prefetch across the boundary: ``scope="model"`` is one graph. The
order the pass returns is checked against every other dependency; if one were broken,
or the pass failed (inductor's scheduler IR is internal), the graph keeps inductor's
order, with a warning.

Measured (N&D 12x128 GPT, the bench's plan: 50 rep, 19 zdp, 7 dp units, batch 3, 2 gloo
ranks on a 2-core CPU, 21 interleaved steps, medians, two runs): compiled without the
pass 0.88x and 0.94x eager's speed, with it 0.94x and 0.96x. Two ranks' compute and
gloo threads share two cores here; on a GPU, where NCCL runs beside compute, it is
unmeasured.
"""
from __future__ import annotations

import itertools
import logging

import torch
from torch._inductor.custom_graph_pass import get_hash_for_files

from .. import schedule_rules
from ..schedule_rules import prefetch_walk

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default  # also compiled.py's
log = logging.getLogger(__name__)
# inductor's graph cache keys on the passes' reprs: a hash of the code that decides the
# order (this file and the eager rules it applies), so that no edit can leave graphs
# ordered by older rules in use (a version number bumped by hand was the key before)
RULES_HASH = get_hash_for_files((__file__, schedule_rules.__file__)).hex()[:16]


class WindowPrefetch:
    """A ``reorder_for_compute_comm_overlap_passes`` entry: inductor's scheduler nodes in,
    the same nodes in the overlapping order out ([Note: compiled prefetch])."""

    def __init__(self, window_bytes: int):
        self.window_bytes = int(window_bytes)

    def __repr__(self) -> str:
        return f"osdp.WindowPrefetch({RULES_HASH}, window_bytes={self.window_bytes})"

    def __eq__(self, other) -> bool:
        return isinstance(other, WindowPrefetch) and other.window_bytes == self.window_bytes

    def __hash__(self) -> int:
        return hash((WindowPrefetch, self.window_bytes))

    def __call__(self, snodes: list) -> list:
        try:
            return self._order(snodes)
        except Exception as exc:  # noqa: BLE001  (inductor's scheduler IR is internal and changes between releases)
            log.warning("osdp: the compiled prefetch pass failed (%s: %s); keeping inductor's order",
                        type(exc).__name__, exc)
            return snodes

    def _fits(self, gather, in_use_bytes: int) -> bool:
        """Whether the eager prefetch walk (``schedule_rules.prefetch_walk``, [Note:
        prefetch window]) issues ``gather`` beside ``in_use_bytes`` gathered: the pass
        prefetches one unit ahead, so the walk has one candidate."""
        return any(True for _ in prefetch_walk([(0, gather)], self.window_bytes, size=_gathered_bytes,
                                               transient=lambda: in_use_bytes, skip=lambda pos, unit: False))

    def _order(self, snodes: list) -> list:
        from torch._inductor.utils import contains_collective, contains_wait

        comms = [s for s in snodes if contains_collective(s)]
        if not comms:
            return snodes
        producer = {}  # buffer name -> the node that writes it
        for s in snodes:
            for name in s.get_buffer_names():
                producer[name] = s
        comm_set = set(comms)
        wait_of = {}
        for s in snodes:
            if contains_wait(s):
                for comm in {producer.get(d.name) for d in s.unmet_dependencies} & comm_set:
                    wait_of.setdefault(comm, s)
        gather_after = {}  # a gather's wait -> the next gather, issued right after it
        for before, after in itertools.pairwise([c for c in comms if _is_gather(c)]):
            if before in wait_of and self._fits(after, in_use_bytes=_gathered_bytes(before)):
                gather_after[wait_of[before]] = after
        comm_or_wait = comm_set | set(wait_of.values())
        reduction_waits = {wait_of[c] for c in comms if not _is_gather(c) and c in wait_of}
        position = {n: i for i, n in enumerate(snodes)}

        order, emitted = [], set()
        held, held_set = [], set()  # reduction waits and what reads them, not emitted yet
        raised = set()  # gathers issued early

        def emit(node) -> None:
            order.append(node)
            emitted.add(node)

        def release() -> None:
            for node in held:
                emit(node)
            held.clear()
            held_set.clear()

        def issue_early(gather) -> None:
            # a gather reads a shard; the collective order (a fake dependency on the
            # previous collective) is the pass's to keep: a gather raised before a
            # reduction lands before it on every rank (the rules read collectives only)
            needed = [n for n in _ancestors(gather, producer, skip=comm_or_wait) if n not in emitted]
            if not any(n in held_set or contains_collective(n) or contains_wait(n) for n in needed):
                release()
                for node in sorted(needed, key=position.__getitem__) + [gather]:
                    emit(node)
                raised.add(gather)

        if _is_gather(comms[0]) and self._fits(comms[0], in_use_bytes=0):
            issue_early(comms[0])  # nothing of this graph is gathered before it
        for s in snodes:
            if s in emitted:
                continue
            if held and contains_collective(s):
                release()  # the reduction in flight is waited for before the next collective
            if s in reduction_waits or any(producer.get(d.name) in held_set for d in s.unmet_dependencies):
                held.append(s)
                held_set.add(s)
                continue
            emit(s)
            gather = gather_after.get(s)
            if gather is not None and gather not in emitted:
                issue_early(gather)
        release()
        if len(order) != len(snodes) or not _respects_dependencies(order, producer, raised, comm_or_wait):
            log.warning("osdp: the compiled prefetch order broke a dependency; keeping inductor's order")
            return snodes
        return order


def _is_gather(snode) -> bool:
    return getattr(snode.node, "op_overload", None) is _ALL_GATHER


def _gathered_bytes(snode) -> int:
    layout = snode.node.get_layout()
    numel = 1
    for dim in layout.size:
        numel *= _hint(dim)
    return numel * layout.dtype.itemsize


def _hint(dim) -> int:
    """A size as an int: parameters' are static; a symbolic one (dynamic shapes) by
    inductor's hint (``optimization_hint`` in newer torch, ``size_hint`` in older)."""
    try:
        return int(dim)
    except TypeError:
        from torch._inductor.virtualized import V

        sizevars = V.graph.sizevars
        hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint
        return int(hint(dim))


def _ordering_only(dep, producer: dict, comm_or_wait: set) -> bool:
    """``dep`` only orders collectives: inductor's fake dependency on the previous
    collective (``comms.decide_global_ordering_of_comms``)."""
    return getattr(dep, "is_fake", False) and producer.get(dep.name) in comm_or_wait


def _ancestors(snode, producer: dict, skip: set) -> list:
    """Every node ``snode`` depends on, transitively, besides its collective-ordering
    dependencies (``skip``: the collectives and their waits)."""
    seen, stack = set(), [snode]
    while stack:
        node = stack.pop()
        for dep in node.unmet_dependencies:
            if node is snode and _ordering_only(dep, producer, skip):
                continue
            source = producer.get(dep.name)
            if source is not None and source not in seen:
                seen.add(source)
                stack.append(source)
    return list(seen)


def _respects_dependencies(order: list, producer: dict, raised: set, comm_or_wait: set) -> bool:
    """Every node after what it reads; a raised gather may precede the collective its
    ordering-only dependency names."""
    done = set()
    for node in order:
        for dep in node.unmet_dependencies:
            if node in raised and _ordering_only(dep, producer, comm_or_wait):
                continue
            source = producer.get(dep.name)
            if source is not None and source is not node and source not in done:
                return False
        done.add(node)
    return True
