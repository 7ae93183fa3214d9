"""PrefetchPolicy: the recorded use order, the prefetch window, and which small units
ride along in one collective. It decides *what* to gather *when*; the gathering itself
is :class:`~osdp.runtime.lifecycle.UnitLifecycle`'s. The decisions are
``osdp.schedule_rules``' ``prefetch_walk`` and ``riders``, which the planner's step
simulation calls too (one copy of each rule; tests/runtime/test_schedule_rules.py).

[Note: prefetch window]
The order of unit uses is recorded in the first forward with grad enabled and assumed
to stay; backward prefetches in reverse order (the first backward uses the reversed
forward order, later ones the order the first backward actually took, which leaves out
uses whose backward never comes). Before computing a unit its gather is issued
(always), then gathers of the next units in that order (reversed, for backward) while
the transient gathered bytes (see [Note: transient bytes] in lifecycle.py) plus the next
unit's bytes stay <= ``window_bytes``. Prefetch stops at the first unit that does not
fit, so gathers are issued in use order on every rank.

[Note: coalesced small units]
Every collective has a fixed cost (on gloo/CPU about 0.3-0.5 ms of latency and CPU per
call, whatever its size), and OSDP's units are per leaf module, so a model has many
tiny units (LayerNorms: 2 x hidden parameters) next to its big ones. A unit is *small*
when it is a whole module (not a split slice: those are cut to bound the peak) and its
gathered bytes are <= ``coalesce_bytes // 4``. When a small unit is gathered while the
order of the phase is known (forward or backward, from the second step on), the next
small units of that order that are still sharded ride along in ONE collective, up to
``coalesce_bytes`` in total and only while the transient gathered bytes stay within the
window (they are prefetches: they count as transient until used). Their unsharded
gradients are reduced together too (see [Note: coalesced reductions] in reduce.py).
Riders gather from the same level as the unit they ride with (all from shards over the
shard group, or all from node copies over the node group: [Note: node copies] in
lifecycle.py), so one collective serves them all. Memory model: the window bound is unchanged; the coalesced collective's staging
buffers are at most 2 x ``coalesce_bytes``. ``coalesce_bytes=0`` turns it off. Big
units are never coalesced: that would need a copy out of a rank-major staging buffer,
i.e. twice their bytes. ``rep`` units never ride along (nothing to gather) and never
share a reduction with sharded units (contract.py [Note: replicated units]).
"""
from __future__ import annotations

from ..contract import is_small_unit
from ..schedule_rules import prefetch_walk, riders
from .lifecycle import UnitLifecycle
from .modes import GatherState
from .shard_unit import ShardUnit


class PrefetchPolicy:
    def __init__(self, lifecycle: UnitLifecycle, window_bytes: int, coalesce_bytes: int):
        self.lifecycle = lifecycle
        self.window_bytes = int(window_bytes)
        self.coalesce_bytes = int(coalesce_bytes)
        self.forward_order: list[ShardUnit] | None = None
        self.backward_order: list[ShardUnit] | None = None
        self._recording: list[list] | None = None  # [unit, expects_backward, needs_weights] per use
        self._backward_recording: list[ShardUnit] | None = None  # first backward's real order
        self._forward_cursor = 0
        self._backward_cursor = 0

    def mark_coalescible(self, units) -> None:
        """``units``: the whole-module units that may ride along when small (never a
        rep unit: it is not gathered, and its gradient goes to the replicated bucket)."""
        for unit in units:
            unit.coalescible = not unit.replicated and is_small_unit(unit.gathered_bytes, self.coalesce_bytes,
                                                                     is_slice=False)

    # ---- recording the order ------------------------------------------------------------
    def begin_forward(self, grad_enabled: bool) -> None:
        self._forward_cursor = 0
        if self.forward_order is None and grad_enabled:
            self._recording = []

    def record_forward_use(self, unit: ShardUnit) -> list | None:
        """The recording slot of this use (``expects_backward`` and whether its backward
        reads the weights are set at its post-forward)."""
        if self._recording is None:
            return None
        entry = [unit, False, True]
        self._recording.append(entry)
        return entry

    def end_forward(self) -> None:
        rec, self._recording = self._recording, None
        if rec and any(expects for _, expects, _ in rec):
            self.forward_order = [unit for unit, _, _ in rec]
            # until the first backward shows the real order: reversed forward order of
            # the uses whose backward gathers
            self.backward_order = [u for u, expects, weights in reversed(rec) if expects and weights]
            self._backward_recording = []

    def record_backward_use(self, unit: ShardUnit) -> None:
        if self._backward_recording is not None:
            self._backward_recording.append(unit)

    def end_backward(self) -> None:
        if self._backward_recording is not None:
            # uses whose backward never came (outputs not in the loss) drop out
            self.backward_order, self._backward_recording = self._backward_recording, None
        self._backward_cursor = 0

    def forget_partial(self) -> None:
        """A step died: drop what it was recording, keep orders of completed steps."""
        self._recording = None
        if self._backward_recording:
            self._backward_recording = []
        self._forward_cursor = self._backward_cursor = 0

    # ---- gathering in order ----------------------------------------------------------------
    def gather_for_forward(self, unit: ShardUnit, in_forward: bool) -> None:
        """Issue ``unit``'s gather (with riders) and prefetch what follows it."""
        pos = None
        if in_forward and self.forward_order is not None:
            pos = _find(self.forward_order, unit, self._forward_cursor)
        if pos is None:
            self._issue(unit)
            return
        self._issue(unit, self.forward_order, pos)
        self._forward_cursor = pos + 1
        self._prefetch(self.forward_order, pos + 1, counting=unit)

    def gather_for_backward(self, unit: ShardUnit) -> None:
        pos = None if self.backward_order is None else _find(self.backward_order, unit, self._backward_cursor)
        if pos is None:
            self._issue(unit)
            return
        self._issue(unit, self.backward_order, pos)
        self._backward_cursor = pos + 1
        self._prefetch(self.backward_order, pos + 1)

    def prefetch_forward(self) -> None:
        if self.forward_order is not None:
            self._prefetch(self.forward_order, self._forward_cursor)

    def prefetch_backward(self) -> None:
        if self.backward_order is not None:
            self._prefetch(self.backward_order, self._backward_cursor)

    def _prefetch(self, order: list[ShardUnit], start: int, counting: ShardUnit | None = None) -> None:
        """See [Note: prefetch window]; the walk is ``schedule_rules.prefetch_walk``."""
        transient = self.lifecycle.transient_bytes
        for pos in prefetch_walk(((p, order[p]) for p in range(start, len(order))), self.window_bytes,
                                 size=_gathered_bytes, transient=lambda: transient(counting), skip=_not_sharded):
            self._issue(order[pos], order, pos, counting)

    def _issue(self, unit: ShardUnit, order: list[ShardUnit] | None = None, pos: int = 0,
               counting: ShardUnit | None = None) -> None:
        if unit.state is not GatherState.SHARDED:
            return
        riders = self._riders(unit, order, pos, counting) if unit.coalescible and order is not None else []
        self.lifecycle.unshard([unit] + riders)

    def _riders(self, unit: ShardUnit, order: list[ShardUnit], pos: int, counting: ShardUnit | None) -> list[ShardUnit]:
        """See [Note: coalesced small units]; the rule is ``schedule_rules.riders``: the
        group key is the gathered dtype and the level the gather reads from."""
        level = self.lifecycle.source_level
        return riders(unit, order[pos + 1 :], self.coalesce_bytes,
                      self.window_bytes - self.lifecycle.transient_bytes(counting),
                      size=_gathered_bytes, key=lambda u: (u.dtype, level(u)),
                      eligible=lambda u: u.coalescible and u.state is GatherState.SHARDED)


def _gathered_bytes(unit: ShardUnit) -> int:
    return unit.gathered_bytes


def _not_sharded(pos: int, unit: ShardUnit) -> bool:
    return unit.state is not GatherState.SHARDED


def _find(order: list[ShardUnit], unit: ShardUnit, start: int) -> int | None:
    for i in range(start, len(order)):
        if order[i] is unit:
            return i
    return None
