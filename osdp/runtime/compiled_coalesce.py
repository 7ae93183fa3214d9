"""The compiled path's coalescing: small units' gathers, and their gradients' reductions,
go out together, as eagerly.

[Note: compiled small units coalesced]
Eager OSDP gathers a small unit (a LayerNorm, a bias-only module: gathered bytes <=
``coalesce_bytes // 4``) together with the next small units of the use order, up to
``coalesce_bytes`` in one collective ([Note: coalesced small units] in prefetch.py).
The compiled path traces one all-gather per unit, so a model with many small units pays
a collective's fixed cost (on gloo about 0.3-0.6 ms of latency a call) for each of them
in every forward and, for ``zdp`` units, again in backward. Measured (N&D 12x128 GPT,
every unit ``zdp``, batch 3, 2 gloo ranks, one profiled step): eager issued 104 gathers
for 152 unit uses, compiled 150, and the compiled forward took 90 ms against eager's 71.
Measured (``python bench/compile_phases.py``: that model and plan, 2 gloo ranks on a
2-core CPU, 11 interleaved rounds, medians, the slowest rank; eager keeps its own
coalescing throughout), eager step / compiled step at ``scope="model"``:

  gathers only (two runs)        0.92x -> 1.02x    0.90x -> 1.11x
  gathers and reductions         0.85x -> 1.06x    (forward 93.3 -> 67.6 ms, backward
                                                    183.4 -> 135.9; eager 68.4, 151.9)

(left: ``--no-compiled-coalescing``, right: with the pass). At ``scope="blocks"`` a
block's graph holds two small units (its norms): 0.94x -> 0.94x, 0.83x -> 0.88x.

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

Reductions, the same way ([Note: coalesced reductions] in reduce.py): in graph order
(the backward's), a small gradient reduction (its input <= ``coalesce_bytes // 4``)
leads and the next small ones of its kind (all-reduce or reduce-scatter), reduce op,
group and dtype ride, up to ``coalesce_bytes``; one collective stands where the
bucket's last member was (every member's gradient exists there), and the readers of the
earlier members' results move after it. So a small gradient waits, unreduced, for the
bucket's last (at most ``coalesce_bytes`` of them, eager's bound). A reduce-scatter's
inputs are laid out rank by rank, so that each rank's part holds its shard of every
member. A gradient that reads a reduced one of the bucket ends it.

Every decision reads only the collectives' order, kinds, sizes, dtypes and groups, and
whether a rider's input reads a collective (a gather's rebuild) or a member's result (a
gradient): the same on every rank (a shard's rebuild is not: [Note: compiled prefetch]
in compiled_prefetch.py), so every rank merges the same collectives and issues them in
the same order. A first version told a
unit's second use by the parameters its shard reads, which differ per rank: on stock
HF GPT-2 with split ops the ranks merged different gathers and gloo aborted ("Received
data size doesn't match expected size"); tests/runtime/test_compiled_coalesce.py
rebuilds shards two ways and asserts the same buckets.

``OSDP(..., coalesce_bytes=0)`` turns it off, with eager's coalescing; a
``post_grad_custom_post_pass`` of the user's own in ``CompileConfig.options`` takes its
place (inductor has one such slot).
"""
from __future__ import annotations

import itertools
import operator

import torch
import torch.distributed.distributed_c10d as c10d
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import contract, schedule_rules
from ..contract import SMALL_UNIT_FRACTION
from ..schedule_rules import riders

_C10D = torch.ops._c10d_functional
_ALL_GATHER = _C10D.all_gather_into_tensor.default
_WAIT = _C10D.wait_tensor.default
_ALL_REDUCE = _C10D.all_reduce.default
_REDUCE_SCATTER = _C10D.reduce_scatter_tensor.default
_REDUCTIONS = (_ALL_REDUCE, _REDUCE_SCATTER)
_ATEN = torch.ops.aten
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")  # what a rider's rebuild may not read
# inductor's graph cache keys on uuid(): a hash of the code that decides the buckets (this
# file, the eager rule and the small-unit threshold), so that no edit can leave graphs
# coalesced by older rules in use (a version number bumped by hand was the key before)
RULES_HASH = get_hash_for_files((__file__, schedule_rules.__file__, contract.__file__)).hex()[:16]


class SmallUnitCoalescing(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass``: merges small units' gathers and
    gradient reductions ([Note: compiled small units coalesced])."""

    def __init__(self, coalesce_bytes: int):
        self.coalesce_bytes = int(coalesce_bytes)

    def uuid(self) -> str:
        return f"osdp.SmallUnitCoalescing({RULES_HASH}, coalesce_bytes={self.coalesce_bytes})"

    def __repr__(self) -> str:
        return self.uuid()

    def __eq__(self, other) -> bool:
        return isinstance(other, SmallUnitCoalescing) and other.coalesce_bytes == self.coalesce_bytes

    def __hash__(self) -> int:
        return hash((SmallUnitCoalescing, self.coalesce_bytes))

    def __call__(self, graph: torch.fx.Graph) -> None:
        for bucket in self.gather_buckets(graph):
            _merge(graph, bucket)
        reductions = self.reduction_buckets(graph)
        for bucket in reductions:
            _merge_reductions(graph, bucket)
        if reductions:
            # an earlier member's reduced gradient is read after the merged collective,
            # which stands where the bucket's last member was: its readers move after it
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(graph)

    def gather_buckets(self, graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
        """The gathers to merge, each bucket in graph order, its lead first; a small
        gather whose rebuild cannot move ahead of the lead ends the walk."""
        position = {n: i for i, n in enumerate(graph.nodes)}

        def blocks(lead):
            return lambda other: _movable_before(other, lead, position) is None

        return self._buckets(_waited(graph, (_ALL_GATHER,)), _bytes, _key, blocks)

    def reduction_buckets(self, graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
        """The gradient reductions to merge, each bucket in graph order: eager's rule for
        small units' reductions ([Note: coalesced reductions] in reduce.py); a small
        reduction whose gradient reads a reduced one of the walk ends it (it could not
        wait for the merged collective)."""
        position = {n: i for i, n in enumerate(graph.nodes)}

        def blocks(lead):
            waits = {_wait_of(lead)}

            def blocked(other) -> bool:
                if any(n in waits for n in _upstream(other.args[0], position[lead], position)):
                    return True
                waits.add(_wait_of(other))
                return False
            return blocked

        return self._buckets(_waited(graph, _REDUCTIONS), lambda r: _bytes(r.args[0]), _reduction_key, blocks)

    def _buckets(self, collectives: list, size, key, blocks) -> list[list[torch.fx.Node]]:
        """Eager's rider rule over ``collectives`` (graph order): each small one not yet
        in a bucket leads, and ``schedule_rules.riders`` picks from the ones after it up
        to the first small one that ``blocks(lead)`` refuses."""
        if self.coalesce_bytes <= 0 or len(collectives) < 2:
            return []
        small = {c for c in collectives if size(c) <= self.coalesce_bytes // SMALL_UNIT_FRACTION}
        taken: set[torch.fx.Node] = set()
        out = []

        def candidate(c) -> bool:
            return c in small and c not in taken

        for k, lead in enumerate(collectives):
            if not candidate(lead):
                continue
            blocked = blocks(lead)
            following = list(itertools.takewhile(lambda c: not (candidate(c) and blocked(c)), collectives[k + 1:]))
            bucket = [lead] + riders(lead, following, self.coalesce_bytes, room=float("inf"), size=size, key=key,
                                     eligible=candidate)
            if len(bucket) > 1:
                taken.update(bucket)
                out.append(bucket)
        return out


def _waited(graph: torch.fx.Graph, targets: tuple) -> list[torch.fx.Node]:
    """The graph's collectives of ``targets`` whose one reader is their wait, in order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets
            and len(n.users) == 1 and _wait_of(n).target is _WAIT]


def _wait_of(collective: torch.fx.Node) -> torch.fx.Node:
    return next(iter(collective.users))


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _reduction_key(reduction: torch.fx.Node) -> tuple:
    """Reductions that may share a collective: one kind (all-reduce or reduce-scatter),
    reduce op and process group (by its own name), of one dtype and device."""
    val = reduction.args[0].meta["val"]
    group = c10d._resolve_process_group(reduction.args[-1])
    return (reduction.target, *reduction.args[1:-1], group.group_name, val.dtype, val.device)


def _key(gather: torch.fx.Node) -> tuple:
    """Gathers that may share a collective: over one process group (by its own name:
    a gather may name it by an alias, [Note: a unit used twice in one graph] in
    compiled_collectives.py), of one dtype and device."""
    val = gather.meta["val"]
    group = c10d._resolve_process_group(gather.args[2])
    return (gather.args[1], group.group_name, val.dtype, val.device)


def _upstream(node, start: int, position: dict):
    """``node`` and what it reads, transitively, among the nodes from graph position
    ``start`` on (each once)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if not isinstance(current, torch.fx.Node) or current in seen or position[current] < start:
            continue
        seen.add(current)
        yield current
        stack.extend(current.all_input_nodes)


def _movable_before(gather: torch.fx.Node, lead: torch.fx.Node, position: dict) -> list | None:
    """The nodes ``gather``'s input needs that come after ``lead``, in graph order (they
    move ahead of it with the gather); None if one of them cannot move: a collective, a
    wait, or anything impure."""
    needed = list(_upstream(gather.args[0], position[lead], position))
    if any(node.op != "call_function" or node.is_impure()
           or getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES for node in needed):
        return None
    return sorted(needed, key=position.__getitem__)


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
    waits = [_wait_of(g) for g in bucket]
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


def _merge_reductions(graph: torch.fx.Graph, bucket: list[torch.fx.Node]) -> None:
    """One reduction for ``bucket`` where its last member was; each old wait's users
    read that unit's part of the result. A reduce-scatter's inputs are laid out rank by
    rank (each input's rows for rank r, then the next input's), so that every rank's
    part of the result holds its shard of each."""
    last = bucket[-1]
    inputs = [r.args[0] for r in bucket]
    waits = [_wait_of(r) for r in bucket]
    sizes = [i.meta["val"].numel() for i in inputs]
    args = last.args[1:]  # (reduce op, [group size,] group name)
    with graph.inserting_before(last):
        if last.target is _REDUCE_SCATTER:
            world = args[1]
            pieces = [_call(graph, _ATEN.view.default, i, [world, n // world],
                            val=lambda i=i, n=n: i.meta["val"].view(world, n // world)) for i, n in zip(inputs, sizes)]
            cat = _call(graph, _ATEN.cat.default, pieces, 1, val=lambda: torch.cat([p.meta["val"] for p in pieces], 1))
            flat = _call(graph, _ATEN.view.default, cat, [-1], val=lambda: cat.meta["val"].view(-1))
            reduced = _call(graph, _REDUCE_SCATTER, flat, *args, val=lambda: flat.meta["val"].new_empty(
                flat.meta["val"].numel() // world))
            part_sizes = [n // world for n in sizes]
        else:
            flats = [_call(graph, _ATEN.view.default, i, [-1], val=lambda i=i: i.meta["val"].view(-1)) for i in inputs]
            flat = _call(graph, _ATEN.cat.default, flats, val=lambda: torch.cat([f.meta["val"] for f in flats]))
            reduced = _call(graph, _ALL_REDUCE, flat, *args, val=lambda: torch.empty_like(flat.meta["val"]))
            part_sizes = sizes
        waited = _call(graph, _WAIT, reduced, val=lambda: reduced.meta["val"])
        parts = _call(graph, _ATEN.split_with_sizes.default, waited, part_sizes,
                      val=lambda: list(waited.meta["val"].split(part_sizes)))
        for i, wait in enumerate(waits):
            part = _call(graph, operator.getitem, parts, i, val=lambda: parts.meta["val"][i])
            shape = list(wait.meta["val"].shape)
            wait.replace_all_uses_with(_call(graph, _ATEN.view.default, part, shape,
                                             val=lambda: part.meta["val"].view(shape)))
    for reduction, wait in zip(bucket, waits):
        graph.erase_node(wait)
        graph.erase_node(reduction)


def _call(graph: torch.fx.Graph, target, *args, val, **kwargs) -> torch.fx.Node:
    """A new node computing ``target``, with its fake value ``val()`` in ``meta["val"]``
    (what inductor lowers from), made in the inputs' fake mode."""
    from torch._guards import detect_fake_mode

    node = graph.call_function(target, args, kwargs)
    with detect_fake_mode([n.meta["val"] for n in node.all_input_nodes]):
        node.meta["val"] = val()
    return node
