"""The stream scheduler: when each unit is all-gathered, freed and reduce-scattered.

A thin coordinator over three pieces, each with one job (as FSDP2 splits
``FSDPParamGroup`` / ``FSDPCommContext`` / ``foreach_reduce``):

- :class:`~osdp.runtime.lifecycle.UnitLifecycle`: gather state and use counts
  (unshard, wait, reshard), [Note: unit lifetime];
- :class:`~osdp.runtime.prefetch.PrefetchPolicy`: the recorded order, the window, the
  small units that ride along, [Note: prefetch window];
- :class:`~osdp.runtime.reduce.GradReducer`: unsharded gradients, the reduce-scatter
  queue, the replicated buckets of ``rep`` units, accumulation, [Note: unsharded
  gradients], [Note: replicated buckets].

The coordinator owns the phase (forward, backward, end of backward) and the uses.
Module hooks (``hooks.py``) and split ops (``osdp.ops``) drive it with one protocol::

    use = sched.pre_forward(unit)         # gathered (and later units prefetched)
    ... compute with unit.views ...
    sched.post_forward(use, expects_backward, needs_weights)
    # backward
    sched.pre_backward(use)               # gathered again if it was freed (skipped by
                                          # uses whose backward reads no weights)
    grads, accumulate = sched.grad_buffer(unit)   # optional: write dW in place
    sched.post_backward(use, grads_or_None)       # reduce-scatter when the last use is done

A direct rep unit (direct.py [Note: direct replicated units]) is outside this protocol:
its modules compute with its parameters, and each parameter's post-accumulate-grad hook
calls ``sched.direct_grad_accumulated(unit)``; the last one joins the replicated bucket.

[Note: end of the backward pass]
At the end of a backward pass (autograd final callback) uses that never got a
backward (outputs not in the loss) are abandoned, uses whose backward began but got no
gradient (a module owning a parameter that only a tied submodule computes with) end,
partial gradients are
reduce-scattered (a rep unit's join the replicated bucket, which is all-reduced then),
the ranks start comparing the collectives they issued, all reductions are waited on
and every gathered buffer is freed, on every rank alike (the graph is the same on every
rank); ranks out of step then raise ([Note: lockstep check] in lockstep_check.py).

[Note: recovery after an exception]
An exception inside forward or backward (an out-of-range token id, an OOM, a user
error) stops the step between a unit's pre- and post-hook: use counts stay raised, so
that unit would never be freed or reduced again. ``recover()`` puts the scheduler back
to the state of a fresh step: it waits for every collective already issued (each was
issued on every rank, so waiting keeps the ranks' collective sequences aligned), frees
every gathered buffer, drops the failed step's gradients that had not reached
``.grad`` (unsharded ones, and reduce-scatters still in flight: waited for, their
result dropped; as in plain PyTorch, a failed backward may have left earlier units'
gradients in ``.grad``: call ``zero_grad`` after catching it),
forgets uses in flight and any order it was recording, and keeps orders recorded by
completed steps. ``OSDP.forward`` calls it when the module raises; a backward that
raised never runs the autograd final callback, so the next ``begin_forward`` outside
autograd finds ``_in_backward`` still set (or a use still computing) and recovers
first. An exception on only some ranks leaves the others inside a collective: they
fail with ``CollectiveTimeoutError`` after ``timeout_s``; that step cannot be saved.

[Note: outdated gathers]
A unit's gathered copy is reused by its next forward use only while the weights it was
gathered from are unchanged (``ShardUnit.gathered_version``, the shard's version
counter). A ``dp`` unit stays gathered while a forward use awaits its backward, and a
forward whose output gets no backward (a metric computed with grad on between
``backward`` and ``step``, a forward before ``osdp.checkpoint.load``) leaves such uses
until the end of the next backward pass. When the weights have changed since (the
optimizer's step, a load), those uses are abandoned and the unit gathered again: their
backward would have run through weights modified in place, which plain PyTorch refuses
at ``backward`` ("modified by an inplace operation"). Every use remembers the version
its forward computed with, and a backward whose unit's weights changed since raises
the same way (:class:`~osdp.errors.OSDPError` naming the unit) instead of computing
with the new weights a gather would give it.

[Note: activation checkpointing]
A forward that runs inside backward is a checkpoint recompute. It gathers what it needs
(a ``zdp`` unit is gathered again) and frees only what it gathered itself. A
non-reentrant checkpoint (OSDP's ``checkpoint_blocks``, Hugging Face's default) only
unpacks tensors from the recomputed graph and runs the original forward's backward: the
original uses gather again, reduce and free. A reentrant one (``use_reentrant=True``,
``torch.utils.checkpoint``'s default while it warns) ran the original forward without
grad, so those uses expect no backward, and it runs the backward of the recomputed graph
itself: the recompute's uses carry the same backward hooks as any use, which then gather
again (gathered three times a step, against twice non-reentrant), reduce and free. In a
non-reentrant recompute those hooks never fire.

[Note: backward passes through one graph]
Plain PyTorch lets a forward's graph be walked more than once: ``backward(retain_graph=
True)`` then another backward (the gradients add up), and ``autograd.grad(...,
create_graph=True)`` for a gradient penalty, whose backward walks the graph of that
first backward too. Each walk is a graph task of autograd's engine; a use remembers the
one its backward ran in (``backward_pass``), and a use whose backward ran in an earlier
pass, or never ran (abandoned), starts a backward again in a later one: gathered again,
its gradient added and reduced like any. The hooks on a module's outputs fire once per
pass (hooks.py). A pass with ``create_graph`` records a graph of its own that computes
with the gathered weights (dX = dY W saves W), which the next pass walks after or
before the original forward's hooks fire: so such a pass frees nothing, and the units
it gathered stay gathered until the end of a backward pass without it (or their next
use frees them). Every rank runs the same passes, so the collectives stay in step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.autograd import Variable

from ..errors import OSDPError
from .collectives import CommContext
from .direct import reset_awaited
from .ledger import MemoryLedger
from .lifecycle import UnitLifecycle
from .lockstep_check import LockstepCheck
from .modes import GatherState, UseState
from .prefetch import PrefetchPolicy
from .reduce import GradReducer
from .shard_unit import ShardUnit


@dataclass(eq=False)
class Use:
    """One forward call's use of a unit (the handle that backward refers to)."""

    unit: ShardUnit
    state: UseState = UseState.FORWARD
    frees_after: bool = False  # RECOMPUTE only: this use gathered the unit, so it frees it
    # its backward reads the gathered weights (False: an embedding row lookup, whose
    # backward only scatters dY rows; a dp unit is not kept for such a use)
    needs_weights: bool = True
    entry: list | None = field(default=None, repr=False)  # its slot in the recorded order
    backward_pass: int | None = None  # the graph task its backward ran in ([Note: backward passes through one graph])
    weights_version: int | None = None  # the shard's version its forward computed with ([Note: outdated gathers])


def backward_pass() -> int:
    """The graph task of the backward running now (-1: none): [Note: backward passes
    through one graph]."""
    return torch._C._current_graph_task_id()


def _in_autograd_engine() -> bool:
    return backward_pass() != -1


def _outside_inference_mode(method):
    """[Note: inference mode]
    A forward under ``torch.inference_mode()`` (an evaluation loop) drives the scheduler
    too. Tensors created there are inference tensors: they have no version counter (the
    collectives restore it: [Note: freeing gathered storage] in shard_unit.py) and can
    never be saved for backward, so a gather buffer or staging copy made there would
    fail at once or poison the next training step. The scheduler's forward entry points
    run with inference mode off; the module's own compute stays inside it (its outputs
    are inference tensors, as the user asked). Never traced by dynamo (an outer
    ``torch.compile`` of an eager-wrapped model): this one wrapper of every entry point
    was compiled again per argument count until dynamo's recompile limit (2-layer GPT,
    4 steps: 27 graphs, 15 untraced; the steps' time 11.5 -> 8.0 s, medians of 3 runs on
    a busy 2-core machine)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return torch.compiler.disable(run)


class Scheduler:
    def __init__(
        self,
        units: list[ShardUnit],
        comm: CommContext,
        ledger: MemoryLedger,
        prefetch_bytes: int,
        coalesce_bytes: int = 0,
        lockstep: LockstepCheck | None = None,
    ):
        self.units = units
        self.lockstep = lockstep  # [Note: lockstep check]; None: off, or one rank
        coalesce_bytes = int(coalesce_bytes) if comm.world_size > 1 else 0
        self.lifecycle = UnitLifecycle(comm, ledger)
        self.prefetch = PrefetchPolicy(self.lifecycle, prefetch_bytes, coalesce_bytes)
        self.reducer = GradReducer(comm, ledger, coalesce_bytes)
        self._in_forward = False
        self._in_backward = False
        self._keeps_gathered = False  # a create_graph backward pass: [Note: backward passes through one graph]
        self._backward_label: tuple[str, str] | None = None  # the ledger's label of the backward in progress
        self._awaiting: dict[Use, None] = {}
        self._computing_backward: dict[Use, None] = {}  # pre_backward ran, post_backward not yet
        self.recover_listeners: list = []  # called by recover() (module hooks drop their stacks)

    # ---- settings the API reads and writes ---------------------------------------------
    @property
    def prefetch_bytes(self) -> int:
        return self.prefetch.window_bytes

    @prefetch_bytes.setter
    def prefetch_bytes(self, value: int) -> None:
        self.prefetch.window_bytes = int(value)

    @property
    def coalesce_bytes(self) -> int:
        return self.prefetch.coalesce_bytes

    @property
    def sync_gradients(self) -> bool:
        return self.reducer.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.reducer.sync_gradients = bool(value)

    def mark_coalescible(self, units) -> None:
        self.prefetch.mark_coalescible(units)

    # ---- forward ---------------------------------------------------------------------
    @_outside_inference_mode
    def begin_forward(self) -> None:
        if not _in_autograd_engine() and (self._in_backward or any(u.n_active for u in self.units)):
            self.recover()  # the previous step died inside backward; see [Note: recovery after an exception]
        self._in_forward = True
        self.prefetch.begin_forward(torch.is_grad_enabled())

    @_outside_inference_mode
    def end_forward(self) -> None:
        self._in_forward = False
        # prefetched (or coalesced) units this forward did not use: nothing waits for them
        self.lifecycle.reshard_where(self.lifecycle.idle)
        self.prefetch.end_forward()

    @property
    def forward_order(self) -> list[str] | None:
        order = self.prefetch.forward_order
        return None if order is None else [u.name for u in order]

    @_outside_inference_mode
    def pre_forward(self, unit: ShardUnit) -> Use:
        life = self.lifecycle
        if self._in_backward or _in_autograd_engine():
            # a checkpoint recompute; no n_active pin: checkpoint may stop the recompute
            # early, inside a module's forward, so a matching post_forward is not
            # guaranteed; nothing frees this unit before it is used (frees happen on its
            # own events); see [Note: activation checkpointing]
            was_gathered = unit.state is not GatherState.SHARDED
            life.refresh_replica(unit)
            self.prefetch.gather_for_forward(unit, in_forward=False)
            life.wait_for_unshard(unit)
            life.ledger.note_use(unit.name, "recompute")
            return Use(unit, UseState.RECOMPUTE, frees_after=not was_gathered)
        if life.is_outdated(unit):  # the weights were updated since this copy was gathered
            self._abandon_awaiting(unit)
            life.reshard(unit)
        life.refresh_replica(unit)  # a rep unit's compute copy, cast locally
        self.prefetch.gather_for_forward(unit, in_forward=self._in_forward)
        life.wait_for_unshard(unit)
        life.begin_forward_use(unit)
        life.ledger.note_use(unit.name, "forward")
        use = Use(unit, weights_version=unit.shard._version)
        if self._in_forward:
            use.entry = self.prefetch.record_forward_use(unit)
        return use

    @_outside_inference_mode
    def post_forward(self, use: Use, expects_backward: bool, needs_weights: bool = True) -> None:
        """``needs_weights``: this use's backward reads the gathered weights (it calls
        :meth:`pre_backward`); False: it only writes a gradient (no gather for it)."""
        unit = use.unit
        if use.state is UseState.RECOMPUTE:
            if use.frees_after:
                use.frees_after = False
                self.lifecycle.maybe_reshard(unit)
            return
        use.needs_weights = bool(needs_weights)
        self.lifecycle.end_forward_use(unit, expects_backward, use.needs_weights)
        if expects_backward:
            use.state = UseState.AWAIT_BACKWARD
            self._awaiting[use] = None
            if use.entry is not None:
                use.entry[1] = True
                use.entry[2] = use.needs_weights
        else:
            use.state = UseState.DONE
        # what runs next outside units (the loss after the head) is attributed to this
        # unit's "after forward", not to its forward
        self.lifecycle.ledger.note_use(unit.name, "after forward")
        if self._in_forward:
            self.prefetch.prefetch_forward()

    def end_recompute(self) -> None:
        """A checkpointed block's recompute returned (or stopped early, after the last
        tensor its backward needs): the backward that unpacked it goes on."""
        if self._in_backward and self._backward_label is not None:
            self.lifecycle.ledger.note_use(*self._backward_label)

    # ---- backward --------------------------------------------------------------------
    def pre_backward(self, use: Use) -> None:
        # a RECOMPUTE use comes here only from a reentrant checkpoint, the one kind that
        # runs the recomputed graph's backward: see [Note: activation checkpointing]
        # done in this pass, or done without a backward (a use that expected none)
        if use.state is UseState.BACKWARD or (use.state is UseState.DONE
                                              and use.backward_pass in (None, backward_pass())):
            return
        # AWAIT_BACKWARD; or DONE / ABANDONED in an earlier pass: [Note: backward passes
        # through one graph]
        unit = use.unit
        if use.weights_version is not None and use.weights_version != unit.shard._version:
            raise OSDPError(
                f"backward through unit {unit.name!r}, whose weights were modified in place (an optimizer step, a "
                "checkpoint load) after the forward this backward runs through: plain PyTorch refuses it too (one "
                "of the variables needed for gradient computation has been modified by an inplace operation). Run "
                "backward before optimizer.step(), or the forward again after it ([Note: outdated gathers])")
        self._enter_backward()
        self._awaiting.pop(use, None)
        self.lifecycle.begin_backward_use(unit, use.state is UseState.AWAIT_BACKWARD, use.needs_weights)
        use.state = UseState.BACKWARD
        use.backward_pass = backward_pass()
        self._computing_backward[use] = None
        self.prefetch.record_backward_use(unit)
        self.prefetch.gather_for_backward(unit)
        self.lifecycle.wait_for_unshard(unit)
        self._backward_label = (unit.name, "backward")
        self.lifecycle.ledger.note_use(*self._backward_label)

    def grad_buffer(self, unit: ShardUnit) -> tuple[list[torch.Tensor], bool]:
        """Views of ``unit``'s unsharded gradient and whether they hold one already."""
        return self.reducer.grad_buffer(unit)

    def post_backward(self, use: Use, grads) -> None:
        """``grads``: one gradient (or None) per slot, or None when the caller wrote them
        through :meth:`grad_buffer` (or the unit is frozen)."""
        unit = use.unit
        self._enter_backward()
        was_active = use.state is UseState.BACKWARD
        # backward without pre_backward: a split op that needs no weights
        was_awaiting = use.state is UseState.AWAIT_BACKWARD
        self._awaiting.pop(use, None)
        self._computing_backward.pop(use, None)
        self.lifecycle.end_backward_use(unit, was_active, was_awaiting, use.needs_weights)
        use.state = UseState.DONE
        use.backward_pass = backward_pass()
        if grads is not None and unit.requires_grad:
            self.reducer.add_grads(unit, grads)
        if self.lifecycle.idle(unit) and unit.grad_flat is not None and self.sync_gradients:
            self.reducer.reduce(unit)
        if not self._keeps_gathered:
            self.lifecycle.maybe_reshard(unit)
        self.prefetch.prefetch_backward()

    def direct_grad_accumulated(self, unit: ShardUnit) -> None:
        """A parameter of a direct rep unit accumulated its gradient into ``.grad``
        (direct.py [Note: direct replicated units]); the last one joins the bucket."""
        self._enter_backward()
        self.reducer.local_grad(unit)
        unit.direct_awaited -= 1
        if unit.direct_awaited == 0:
            self.lifecycle.ledger.note_use(unit.name, "after backward")
            if self.sync_gradients:
                self.reducer.reduce(unit)

    def _enter_backward(self) -> None:
        if not self._in_backward and _in_autograd_engine():
            self._in_backward = True
            # the engine runs a create_graph pass with grad mode on
            self._keeps_gathered = torch.is_grad_enabled()
            Variable._execution_engine.queue_callback(self._end_backward)

    def _abandon_awaiting(self, unit: ShardUnit) -> None:
        """Uses of ``unit`` awaiting a backward through weights updated since: abandoned
        ([Note: outdated gathers])."""
        for use in [use for use in self._awaiting if use.unit is unit]:
            del self._awaiting[use]
            self.lifecycle.drop_await(unit, use.needs_weights)
            use.state = UseState.ABANDONED

    def _end_backward(self) -> None:
        """See [Note: end of the backward pass]."""
        for use in list(self._awaiting):
            self.lifecycle.drop_await(use.unit, use.needs_weights)
            use.state = UseState.ABANDONED
        self._awaiting.clear()
        for use in list(self._computing_backward):
            # its module's output got a gradient but its own views none: a module that
            # owns a parameter only a tied submodule computes with (BERT's prediction
            # head owns the bias its decoder adds); the submodule's use carried it
            self.lifecycle.end_backward_use(use.unit, True, False, use.needs_weights)
            use.state = UseState.DONE
        self._computing_backward.clear()
        if self.sync_gradients:
            for unit in self.units:
                if self.reducer.has_grad(unit) and unit.n_active == 0:
                    self.reducer.reduce(unit)
        check = None
        if self.lockstep is not None:  # [Note: lockstep check]
            self.reducer.flush()  # every collective of the step issued
            self.reducer.flush_buckets()
            check = self.lockstep.start()
        self.reducer.finish()
        reset_awaited(self.units)
        if not self._keeps_gathered:
            self.lifecycle.reshard_where(lambda unit: unit.n_active == 0)
        self.prefetch.end_backward()
        self._in_backward = self._keeps_gathered = False
        self._backward_label = None
        self.lifecycle.ledger.note_use("", "after backward")
        if check is not None:
            self.lockstep.finish(check)  # ranks out of step raise, the step finished

    # ---- outside a step ----------------------------------------------------------------
    def recover(self) -> None:
        """Back to the state of a fresh step; see [Note: recovery after an exception]."""
        for use in (*self._awaiting, *self._computing_backward):
            use.state = UseState.ABANDONED
        self._awaiting.clear()
        self._computing_backward.clear()
        self.lifecycle.reset(self.units)
        self.reducer.drop(self.units)
        reset_awaited(self.units)
        self.prefetch.forget_partial()
        if self.lockstep is not None:
            self.lockstep.log.reset()
        self._in_forward = self._in_backward = self._keeps_gathered = False
        self._backward_label = None
        for listener in self.recover_listeners:
            listener()

    def held_gradients(self) -> list[str]:
        """The units holding gradients no backward has reduced (accumulated with sync
        off): [Note: held gradients at a step] in optimizer_steps.py. Empty inside a
        backward pass, which reduces or keeps them at its end."""
        if self._in_backward:
            return []
        return [u.name for u in self.units if self.reducer.has_grad(u)]

    def drop_held_gradients(self) -> None:
        """``model.zero_grad()``: drop the gradients accumulated with sync off, as plain
        PyTorch's ``zero_grad`` drops what ``no_sync`` left in ``.grad``."""
        if not self._in_backward and self.held_gradients():
            self.reducer.drop(self.units)

    def wait_reduce_scatters(self) -> None:
        self.reducer.finish()

    def transient_bytes(self) -> int:
        return self.lifecycle.transient_bytes()

    def gathered_units(self) -> list[str]:
        return [u.name for u in self.lifecycle.gathered_units()]
