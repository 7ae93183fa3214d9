"""UnitLifecycle: the only writer of a unit's gather state and use counts.

The order of a unit's life, as the methods below are laid out: ``unshard`` (allocate
and issue the all-gather) -> ``wait_for_unshard`` (compute may read it) -> uses
(``begin_forward_use`` .. ``end_forward_use``, ``begin_backward_use`` ..
``end_backward_use``) -> ``reshard`` (free) when no use needs it any more.

[Note: unit lifetime]
A unit's gathered weights are freed when no use of it is computing (``n_active == 0``)
and, for a ``dp`` unit, no use still waits for its backward (``n_await == 0``). So a
``zdp`` unit is freed after each forward use and each backward use; a ``dp`` unit is
kept from its first forward to its last backward use; with no grad (eval) both free
right after forward. A use whose backward reads no weights (an embedding row split's
lookup) does not keep a ``dp`` unit: only awaiting uses that need the weights do
(``n_await_weights``), so a tied slice used by a lookup and a head is kept from the
head's forward to the head's backward, not from the lookup on (see [Note: tied row
split] in contract.py). The mode that counts is the unit's *effective* mode on the
layout (``ShardLayout.effective_mode``: ``hpz`` is ``zdp`` or ``dp`` where the node cut
is trivial, see [Note: modes per level] in contract.py).

[Note: node copies]
An ``hpz`` unit is freed like a ``zdp`` unit, except that when it is freed while a use
still waits for its backward (one that reads the weights), this rank first keeps its
piece of the gathered buffer within the node: piece ``node rank`` of ``node_size`` equal
pieces of the padded flat buffer (``gathered_bytes / node_size``, in the gathered dtype;
the node group's all-gather of those pieces, in node-rank order, is the gathered buffer
again). The next gather of that unit (its backward, a checkpoint recompute, another
forward use before the backward) reads the node copy over the node group instead of the
shard over the shard group, as long as the copy is as new as the shard (an optimizer
step in between drops it). The copy is dropped with the gathered buffer when no use
awaits backward any more (its last backward use, the end of the backward pass, a failed
step). It is kept memory like a ``dp`` unit's weights, not transient: the prefetch
window does not count it.

[Note: replicated units in the lifecycle]
A ``rep`` unit (contract.py [Note: replicated units]) is always GATHERED and never in
the live set: it is never unsharded, resharded, kept in a node copy or counted as
transient, and the prefetch policy passes over it (prefetch continues with the units
after it). Its only event here is :meth:`refresh_replica`, the local cast of its compute
copy under mixed precision ([Note: replica compute copy] in shard_unit.py), done at a
forward use when no use of it is in flight, so a recompute or a second use before the
backward computes with the same weights as the first.

[Note: transient bytes]
The prefetch window bounds the *transient* gathered bytes: every gathered unit except
``dp`` units that finished forward and wait for backward (kept: the memory model
counts them as kept weights, not as in flight). The totals move with every gather,
free and use-count change, so reading them is O(1).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..contract import MODE_DP, MODE_HPZ
from .collectives import CommContext, named_units
from .ledger import MemoryLedger
from .modes import GatherState
from .shard_unit import ShardUnit


class NodeCopy(NamedTuple):
    """An hpz unit's piece of its gathered buffer within the node ([Note: node copies])."""

    tensor: torch.Tensor
    version: int  # the shard's version the gathered buffer was made from


class UnitLifecycle:
    def __init__(self, comm: CommContext, ledger: MemoryLedger):
        self.comm = comm
        self.ledger = ledger
        self._live: dict[ShardUnit, None] = {}  # units not SHARDED, in gather order
        self._live_bytes = 0  # their gathered bytes
        self._kept_bytes = 0  # of those, the kept ones' (see [Note: transient bytes])
        self._node_copies: dict[ShardUnit, NodeCopy] = {}  # see [Note: node copies]
        self.node_copy_bytes = 0
        self.peak_node_copy_bytes = 0
        self._modes: dict[ShardUnit, str] = {}

    def mode_of(self, unit: ShardUnit) -> str:
        """``unit``'s effective mode on this layout (see [Note: unit lifetime])."""
        mode = self._modes.get(unit)
        if mode is None:
            mode = self._modes[unit] = self.comm.layout.effective_mode(unit.mode.value)
        return mode

    # ---- unshard ------------------------------------------------------------------------
    def unshard(self, units: list[ShardUnit]) -> None:
        """Allocate and all-gather ``units`` (sharded ones), in ONE collective per
        level when there are several (see [Note: coalesced small units] in prefetch.py):
        from the shards over the shard group, or from node copies over the node group
        (see [Note: node copies])."""
        units = [u for u in units if u.state is GatherState.SHARDED and not u.replicated]
        if not units:
            return
        for unit in units:
            copy = self._node_copies.get(unit)
            if copy is not None and copy.version != unit.shard._version:
                self._drop_node_copy(unit)  # the weights were updated since
            unit.alloc_gathered()
            self.ledger.gather(unit.name, unit.gathered_bytes)
            unit.state = GatherState.GATHERING
            unit.gathered_version = unit.shard._version
            self._live[unit] = None
            self._live_bytes += unit.gathered_bytes
            if self._kept(unit):
                self._kept_bytes += unit.gathered_bytes
        self._gather([u for u in units if u not in self._node_copies], "shard", lambda u: u.shard)
        self._gather([u for u in units if u in self._node_copies], "node", lambda u: self._node_copies[u].tensor)

    def source_level(self, unit: ShardUnit) -> str:
        """Where the next gather of ``unit`` reads: "node" (its node copy) or "shard"."""
        copy = self._node_copies.get(unit)
        return "node" if copy is not None and copy.version == unit.shard._version else "shard"

    def _gather(self, units: list[ShardUnit], level: str, source) -> None:
        if not units:
            return
        where = " within the node" if level == "node" else ""
        if len(units) == 1:
            unit = units[0]
            unit.pending = self.comm.all_gather(unit.gathered, source(unit), f"all-gather{where} of unit {unit.name!r}",
                                                level=level)
            return
        pending = self.comm.all_gather_coalesced(
            [u.gathered for u in units], [source(u) for u in units],
            f"coalesced all-gather{where} of {len(units)} units ({named_units(units)})", level=level,
            members=tuple(u.name for u in units),
        )
        shared = _Once(pending.wait)
        for unit in units:
            unit.pending = shared

    def wait_for_unshard(self, unit: ShardUnit) -> None:
        if unit.state is GatherState.GATHERING:
            pending, unit.pending = unit.pending, None
            if pending is not None:  # None: issuing it raised; recover() frees the buffer
                pending.wait()
            unit.state = GatherState.GATHERED

    def is_outdated(self, unit: ShardUnit) -> bool:
        """Gathered (or gathering), not computing, and the weights were updated since (an
        optimizer step, a checkpoint load): [Note: outdated gathers] in scheduler.py. A
        rep unit is never outdated (:meth:`refresh_replica` renews it in place)."""
        return (
            not unit.replicated and unit.state is not GatherState.SHARDED and unit.n_active == 0
            and unit.gathered_version != unit.shard._version
        )

    def refresh_replica(self, unit: ShardUnit) -> None:
        """Cast a rep unit's master flat into its compute copy when the master changed
        since the last cast and no use is in flight (see [Note: replicated units in the
        lifecycle]); nothing to do where compute reads the master itself."""
        if not unit.casts or unit.gathered_version == unit.shard._version or not self.idle(unit):
            return
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(unit.gathered):
            unit.gathered.copy_(unit.shard.detach())
        unit.gathered_version = unit.shard._version

    # ---- uses ---------------------------------------------------------------------------
    def begin_forward_use(self, unit: ShardUnit) -> None:
        self._count(unit, active=1)

    def end_forward_use(self, unit: ShardUnit, expects_backward: bool, needs_weights: bool = True) -> None:
        """``needs_weights``: the use's backward reads the gathered weights."""
        self._count(unit, active=-1, awaiting=1 if expects_backward else 0, weights=needs_weights)
        self.maybe_reshard(unit)

    def begin_backward_use(self, unit: ShardUnit, was_awaiting: bool, needs_weights: bool = True) -> None:
        self._count(unit, active=1, awaiting=-1 if was_awaiting else 0, weights=needs_weights)

    def end_backward_use(self, unit: ShardUnit, was_active: bool, was_awaiting: bool, needs_weights: bool = True) -> None:
        self._count(unit, active=-1 if was_active else 0, awaiting=-1 if was_awaiting else 0, weights=needs_weights)

    def drop_await(self, unit: ShardUnit, needs_weights: bool = True) -> None:
        """A use whose backward will not come (end of the backward pass)."""
        self._count(unit, awaiting=-1, weights=needs_weights)

    def idle(self, unit: ShardUnit) -> bool:
        return unit.n_active == 0 and unit.n_await == 0

    # ---- reshard --------------------------------------------------------------------------
    def reshard(self, unit: ShardUnit) -> None:
        """Free the gathered weights and the node copy (after waiting: never release
        memory a collective still writes); a rep unit keeps its weights."""
        if unit.replicated:
            return
        self._drop_node_copy(unit)
        self._free_gathered(unit)

    def reshard_to_node(self, unit: ShardUnit) -> None:
        """Keep this rank's node copy, free the gathered weights ([Note: node copies])."""
        if unit.state is GatherState.SHARDED or unit.replicated:
            return
        self.wait_for_unshard(unit)
        if self.source_level(unit) != "node":
            self._drop_node_copy(unit)
            node = self.comm.layout.node
            piece = unit.padded_numel // node.size
            copy = unit.gathered.narrow(0, node.rank * piece, piece).clone()
            self._node_copies[unit] = NodeCopy(copy, unit.gathered_version)
            self.node_copy_bytes += copy.numel() * copy.element_size()
            self.peak_node_copy_bytes = max(self.peak_node_copy_bytes, self.node_copy_bytes)
        self._free_gathered(unit)

    def _drop_node_copy(self, unit: ShardUnit) -> None:
        copy = self._node_copies.pop(unit, None)
        if copy is not None:
            self.node_copy_bytes -= copy.tensor.numel() * copy.tensor.element_size()

    def _free_gathered(self, unit: ShardUnit) -> None:
        if unit.state is GatherState.SHARDED:
            return
        self.wait_for_unshard(unit)
        unit.free_gathered()
        self.ledger.free(unit.name)
        del self._live[unit]
        self._live_bytes -= unit.gathered_bytes
        if self._kept(unit):
            self._kept_bytes -= unit.gathered_bytes

    def maybe_reshard(self, unit: ShardUnit) -> None:
        """See [Note: unit lifetime] and [Note: node copies]."""
        if unit.replicated or unit.n_active > 0 or (
                unit.state is GatherState.SHARDED and unit not in self._node_copies):
            return
        if unit.n_await_weights > 0:
            mode = self.mode_of(unit)
            if mode == MODE_DP:
                return
            if mode == MODE_HPZ:
                self.reshard_to_node(unit)
                return
        self.reshard(unit)

    def reshard_where(self, predicate) -> None:
        """Reshard every unit holding gathered weights or a node copy that ``predicate`` picks."""
        holders = list(self._live) + [u for u in self._node_copies if u not in self._live]
        for unit in holders:
            if predicate(unit):
                self.reshard(unit)

    def reset(self, units: list[ShardUnit]) -> None:
        """No use in flight, nothing gathered (after a failed step)."""
        for unit in units:
            unit.n_active = unit.n_await = unit.n_await_weights = 0
        self._kept_bytes = 0
        self.reshard_where(lambda unit: True)

    # ---- bytes ----------------------------------------------------------------------------
    def transient_bytes(self, counting: ShardUnit | None = None) -> int:
        """See [Note: transient bytes]; ``counting``: a unit about to be used, counted
        as transient even if it is kept now."""
        extra = counting.gathered_bytes if counting in self._live and self._kept(counting) else 0
        return self._live_bytes - self._kept_bytes + extra

    def gathered_units(self) -> list[ShardUnit]:
        return list(self._live)

    def node_copy_units(self) -> list[ShardUnit]:
        """Units holding a node copy now ([Note: node copies])."""
        return list(self._node_copies)

    def _kept(self, unit: ShardUnit) -> bool:
        return unit.n_active == 0 and unit.n_await_weights > 0 and self.mode_of(unit) == MODE_DP

    def _count(self, unit: ShardUnit, active: int = 0, awaiting: int = 0, weights: bool = True) -> None:
        live = unit in self._live
        if live and self._kept(unit):
            self._kept_bytes -= unit.gathered_bytes
        unit.n_active += active
        unit.n_await += awaiting
        if weights:
            unit.n_await_weights += awaiting
        if live and self._kept(unit):
            self._kept_bytes += unit.gathered_bytes


class _Once:
    """A shared wait (coalesced gather): the first caller waits, later ones return."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def wait(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()
