"""The compiled path's coalescing: small units' gathers go out together, as eagerly.

[Note: compiled small units coalesced]
Eager OSDP gathers a small unit (a LayerNorm, a bias-only module: gathered bytes <=
``coalesce_bytes // 4``) together with the next small units of the use order, up to
``coalesce_bytes`` in one collective ([Note: coalesced small units] in prefetch.py).
The compiled path traces one all-gather per unit, so a model with many small units pays
a collective's fixed cost (on gloo about 0.3-0.6 ms of latency a call) for each of them
in every forward and, for ``zdp`` units, again in backward. Measured (N&D 12x128 GPT,
every unit ``zdp``, batch 3, 2 gloo ranks, one profiled step): eager issued 104 gathers
for 152 unit uses, compiled 150, and the compiled forward took 90 ms against eager's 71.
Measured with this pass (``python bench/compile_phases.py``: that model and plan, 2
gloo ranks on a 2-core CPU, 11 interleaved rounds, medians, the slowest rank; eager
keeps its coalescing in both): eager step / compiled step at ``scope="model"`` 0.92x
without the pass (``--no-compiled-coalescing``), 1.02x with it (forward 79.8 -> 71.7 ms,
backward 160.7 -> 148.2 ms; eager 71.8 and 153.2); an earlier scratch run of the same
setup, 0.90x -> 1.11x. At ``scope="blocks"`` a block's graph holds two small units (its
norms), and the step stayed at 0.94x eager's.

This pass, run on each graph after AOT autograd (inductor's
``post_grad_custom_post_pass``), applies eager's rule (``schedule_rules.riders``) to the
graph's gathers in graph order, which is the order of use in that graph (the forward's,
or the backward's recomputed gathers): a small gather leads, the next small gathers
with its group and dtype ride along (larger gathers between them are passed over, as
eagerly), up to ``coalesce_bytes``. A rider's shard rebuild (views, a concatenation of
pieces and padding, the cast) moves ahead of the lead; a rider whose input needs a
collective's result, or anything impure, ends the bucket. The merged gather
concatenates the shards, is issued where the lead was, and each unit gets its own
contiguous copy of its rows of the rank-major result, the buffer it had before.

Differences from eager, by design: the graph cannot tell a split op's slice from a
whole module, nor one unit's second use (a tied weight) from another unit, in a way
that is the same on every rank (a shard's rebuild reads other parameters on each rank),
so a small slice rides too, and so does a small unit's second gather, early; the
riders' bytes are not tested against the prefetch window. All of it stays within
``coalesce_bytes`` per bucket, which the memory model prices as the coalesced
collective's staging (twice ``coalesce_bytes``: the merged buffer and the copies).
Reductions are not coalesced here: a small sharded unit's gradient goes out alone.

Every decision reads only the gathers' order, sizes, dtypes and groups, and whether a
rider's rebuild reads a collective: the same on every rank (the rebuild itself is not:
[Note: compiled prefetch] in compiled_prefetch.py), so every rank merges the same
gathers and issues the same collectives in the same order. A first version told a
unit's second use by the parameters its shard reads, which differ per rank: on stock
HF GPT-2 with split ops the ranks merged different gathers and gloo aborted ("Received
data size doesn't match expected size"); tests/runtime/test_compiled_coalesce.py
rebuilds shards two ways and asserts the same buckets.

``OSDP(..., coalesce_bytes=0)`` turns it off, with eager's coalescing; a
``post_grad_custom_post_pass`` of the user's own in ``CompileConfig.options`` takes its
place (inductor has one such slot).
"""
from __future__ import annotations

import operator

import torch
import torch.distributed.distributed_c10d as c10d
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..contract import SMALL_UNIT_FRACTION
from ..schedule_rules import riders

_C10D = torch.ops._c10d_functional
_ALL_GATHER = _C10D.all_gather_into_tensor.default
_WAIT = _C10D.wait_tensor.default
_ATEN = torch.ops.aten
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")  # what a rider's rebuild may not read
VERSION = 2  # of the rules above: part of inductor's cache key (uuid)


class SmallGatherCoalescing(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: merges small units' gathers
    ([Note: compiled small units coalesced])."""

    def __init__(self, coalesce_bytes: int):
        self.coalesce_bytes = int(coalesce_bytes)

    def uuid(self) -> str:
        # inductor's graph cache keys on it: a change of the rules must change VERSION
        return f"osdp.SmallGatherCoalescing(v{VERSION}, coalesce_bytes={self.coalesce_bytes})"

    def __repr__(self) -> str:
        return self.uuid()

    def __eq__(self, other) -> bool:
        return isinstance(other, SmallGatherCoalescing) and other.coalesce_bytes == self.coalesce_bytes

    def __hash__(self) -> int:
        return hash((SmallGatherCoalescing, self.coalesce_bytes))

    def __call__(self, graph: torch.fx.Graph) -> None:
        for bucket in self.buckets(graph):
            _merge(graph, bucket)

    def buckets(self, graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
        """The gathers to merge, each bucket in graph order, its lead first."""
        gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is _ALL_GATHER
                   and len(n.users) == 1 and next(iter(n.users)).target is _WAIT]
        if self.coalesce_bytes <= 0 or len(gathers) < 2:
            return []
        position = {n: i for i, n in enumerate(graph.nodes)}
        small = {g for g in gathers if _bytes(g) <= self.coalesce_bytes // SMALL_UNIT_FRACTION}
        taken: set[torch.fx.Node] = set()
        out = []
        for k, lead in enumerate(gathers):
            if lead not in small or lead in taken:
                continue
            # the walk stops at a small gather whose rebuild cannot move ahead of the lead
            following = []
            for other in gathers[k + 1:]:
                if other in small and other not in taken and _movable_before(other, lead, position) is None:
                    break
                following.append(other)
            bucket = [lead] + riders(lead, following, self.coalesce_bytes, room=float("inf"), size=_bytes,
                                     key=_key, eligible=lambda g: g in small and g not in taken)
            if len(bucket) > 1:
                taken.update(bucket)
                out.append(bucket)
        return out


def _bytes(gather: torch.fx.Node) -> int:
    val = gather.meta["val"]
    return val.numel() * val.element_size()


def _key(gather: torch.fx.Node) -> tuple:
    """Gathers that may share a collective: over one process group (by its own name:
    a gather may name it by an alias, [Note: a unit used twice in one graph] in
    compiled_collectives.py), of one dtype and device."""
    val = gather.meta["val"]
    group = c10d._resolve_process_group(gather.args[2])
    return (gather.args[1], group.group_name, val.dtype, val.device)


def _movable_before(gather: torch.fx.Node, lead: torch.fx.Node, position: dict) -> list | None:
    """The nodes ``gather``'s input needs that come after ``lead``, in graph order (they
    move ahead of it with the gather); None if one of them cannot move: a collective, a
    wait, or anything impure."""
    start = position[lead]
    seen, stack = set(), [gather.args[0]]
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen or position[node] < start:
            continue
        if (node.op != "call_function" or node.is_impure()
                or getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES):
            return None
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(seen, key=position.__getitem__)


def _merge(graph: torch.fx.Graph, bucket: list[torch.fx.Node]) -> None:
    """One all-gather for ``bucket`` where its lead was; each old wait's users read a
    contiguous copy of that unit's rows of the rank-major result."""
    lead = bucket[0]
    position = {n: i for i, n in enumerate(graph.nodes)}
    moves = [_movable_before(gather, lead, position) for gather in bucket[1:]]
    if any(move is None for move in moves):  # not after an earlier merge: buckets() checked it
        return
    for node in sorted({n for move in moves for n in move}, key=position.__getitem__):
        lead.prepend(node)
    world, group_name = lead.args[1], lead.args[2]
    shards = [g.args[0] for g in bucket]
    sizes = [s.meta["val"].numel() for s in shards]
    total = sum(sizes)
    waits = [next(iter(g.users)) for g in bucket]
    with graph.inserting_before(lead):
        cat = _call(graph, _ATEN.cat.default, shards, val=lambda: torch.cat([s.meta["val"] for s in shards]))
        gathered = _call(graph, _ALL_GATHER, cat, world, group_name,
                         val=lambda: cat.meta["val"].new_empty(world * total))
        waited = _call(graph, _WAIT, gathered, val=lambda: gathered.meta["val"])
        rows = _call(graph, _ATEN.view.default, waited, [world, total],
                     val=lambda: waited.meta["val"].view(world, total))
        parts = _call(graph, _ATEN.split_with_sizes.default, rows, sizes, 1,
                      val=lambda: list(rows.meta["val"].split(sizes, 1)))
        for i, (wait, size) in enumerate(zip(waits, sizes)):
            part = _call(graph, operator.getitem, parts, i, val=lambda: parts.meta["val"][i])
            own = _call(graph, _ATEN.clone.default, part, memory_format=torch.contiguous_format,
                        val=lambda: part.meta["val"].clone(memory_format=torch.contiguous_format))
            flat = _call(graph, _ATEN.view.default, own, [world * size], val=lambda: own.meta["val"].view(-1))
            wait.replace_all_uses_with(flat)
    for gather, wait in zip(bucket, waits):
        graph.erase_node(wait)
        graph.erase_node(gather)


def _call(graph: torch.fx.Graph, target, *args, val, **kwargs) -> torch.fx.Node:
    """A new node computing ``target``, with its fake value ``val()`` in ``meta["val"]``
    (what inductor lowers from), made in the inputs' fake mode."""
    from torch._guards import detect_fake_mode

    node = graph.call_function(target, args, kwargs)
    with detect_fake_mode([n.meta["val"] for n in node.all_input_nodes]):
        node.meta["val"] = val()
    return node
