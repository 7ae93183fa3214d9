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
split] in contract.py).

[Note: transient bytes]
The prefetch window bounds the *transient* gathered bytes: every gathered unit except
``dp`` units that finished forward and wait for backward (kept: the memory model
counts them as kept weights, not as in flight). The totals move with every gather,
free and use-count change, so reading them is O(1).
"""
from __future__ import annotations

from .collectives import CommContext
from .ledger import MemoryLedger
from .modes import GatherState, Mode
from .shard_unit import ShardUnit


class UnitLifecycle:
    def __init__(self, comm: CommContext, ledger: MemoryLedger):
        self.comm = comm
        self.ledger = ledger
        self._live: dict[ShardUnit, None] = {}  # units not SHARDED, in gather order
        self._live_bytes = 0  # their gathered bytes
        self._kept_bytes = 0  # of those, the kept ones' (see [Note: transient bytes])

    # ---- unshard ------------------------------------------------------------------------
    def unshard(self, units: list[ShardUnit]) -> None:
        """Allocate and all-gather ``units`` (sharded ones), in ONE collective when
        there are several (see [Note: coalesced small units] in prefetch.py)."""
        units = [u for u in units if u.state is GatherState.SHARDED]
        if not units:
            return
        for unit in units:
            unit.alloc_gathered()
            self.ledger.gather(unit.name, unit.gathered_bytes)
            unit.state = GatherState.GATHERING
            unit.gathered_version = unit.shard._version
            self._live[unit] = None
            self._live_bytes += unit.gathered_bytes
            if self._kept(unit):
                self._kept_bytes += unit.gathered_bytes
        if len(units) == 1:
            unit = units[0]
            unit.pending = self.comm.all_gather(unit.gathered, unit.shard, f"all-gather of unit {unit.name!r}")
            return
        names = ", ".join(repr(u.name) for u in units[:4]) + (", ..." if len(units) > 4 else "")
        pending = self.comm.all_gather_coalesced(
            [u.gathered for u in units], [u.shard for u in units],
            f"coalesced all-gather of {len(units)} units ({names})",
        )
        shared = _Once(pending.wait)
        for unit in units:
            unit.pending = shared

    def wait_for_unshard(self, unit: ShardUnit) -> None:
        if unit.state is GatherState.GATHERING:
            unit.pending.wait()
            unit.pending = None
            unit.state = GatherState.GATHERED

    def is_stale(self, unit: ShardUnit) -> bool:
        """Gathered, unused, and the weights were updated since (an optimizer step)."""
        return (
            unit.state is GatherState.GATHERED and unit.n_active == 0 and unit.n_await == 0
            and unit.gathered_version != unit.shard._version
        )

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
        """Free the gathered weights (after waiting: never release memory a collective
        still writes)."""
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
        """See [Note: unit lifetime]."""
        if unit.state is GatherState.SHARDED or unit.n_active > 0:
            return
        if unit.mode is Mode.DP and unit.n_await_weights > 0:
            return
        self.reshard(unit)

    def reshard_where(self, predicate) -> None:
        for unit in list(self._live):
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

    def _kept(self, unit: ShardUnit) -> bool:
        return unit.mode is Mode.DP and unit.n_active == 0 and unit.n_await_weights > 0

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
