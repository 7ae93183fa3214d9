"""Direct replicated units: ``rep`` units whose modules compute with the original
parameters themselves, off the per-use hook path.

[Note: direct replicated units]
A ``rep`` unit is never gathered, and when nothing is cast (no mixed-precision
``param_dtype`` or ``reduce_dtype`` other than its own dtype) its compute weights ARE its
parameters (views of its shard, original shapes). Such a unit needs nothing of the
scheduler per use, so it gets nothing per use, as in torch DDP:

- the modules using it compute with ``unit.params`` directly (set once as instance
  attributes, not registered: the module still owns no parameters);
- autograd accumulates their gradients into ``.grad`` as in plain PyTorch;
- a post-accumulate-grad hook on each parameter tells the scheduler when the unit's
  gradient is complete in this backward pass, and the unit joins the replicated bucket
  (reduce.py [Note: replicated buckets]).

Why: the per-use path (module pre/post hooks, ``_GatherFn``, a gradient buffer copied
per unit) cost about 30 ms per step over torch DDP on N&D 12x128's 76 units at every
batch on this CPU (2 gloo ranks: 146 against 114 ms at b1, 280 against 225 at b5).

What stays as on the hook path: the bucket rule, the staging copy with the mean taken
before the collective, the ledger's bytes (a unit's G counted from its first
accumulated parameter until its bucket finished, the staging copy while in flight), and
``.grad`` after the step (a view of the bucket's averaged copy). What differs:

- G is the parameters' ``.grad``. Where ``.grad`` was not None before the backward,
  autograd adds into it and the bucket averages the sum. That is the same value (up to
  rounding): what was there is either equal on every rank (a reduced gradient, so its
  mean is itself) or the local sum of ``no_sync`` micro-batches, which is what must be
  averaged. The bucket's result therefore REPLACES ``.grad`` instead of being added to
  it.
- After a failed backward (recovery, scheduler.py), ``.grad`` of a direct unit whose
  bucket had not finished is None: it held this rank's unreduced gradient. Call
  ``zero_grad`` after catching the failure either way, as in plain PyTorch.
- A module that computes with a direct unit and with a unit that is not (a parameter
  tied across modes, a cast copy) stays on the hook path, and so does every unit it uses:
  a unit's gradient has one home.

Peak attribution ([Note: measured peak] in peak.py): a forward pre-hook notes the
unit's forward (one Python call per module call); its gradient hook notes "after
backward" of the unit (what runs next is the backward of the module before it).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .ledger import MemoryLedger
from .shard_unit import ShardUnit


def can_be_direct(unit: ShardUnit) -> bool:
    """A rep unit that computes and reduces in its own dtype."""
    return unit.replicated and not unit.casts and unit.reduce_dtype == unit.shard_dtype


def direct_units(bindings) -> set[ShardUnit]:
    """The units every module using them can compute with the parameters directly.
    ``bindings``: ``(module, path, [(unit, [(attr, slot)])])`` as ``BuiltModel.bindings``."""
    direct = {unit for _, _, entries in bindings for unit, _ in entries if can_be_direct(unit)}
    while True:  # a module mixing a direct unit with another one keeps all of them hooked
        mixed = {unit for _, _, entries in bindings if not all(u in direct for u, _ in entries)
                 for unit, _ in entries if unit in direct}
        if not mixed:
            return direct
        direct -= mixed


class DirectBinding:
    """A module whose units are all direct: its attributes are the units' parameters."""

    def __init__(self, module: nn.Module, path: str, entries, ledger: MemoryLedger):
        self.module = module
        self.path = path
        self.entries = entries
        name = entries[0][0].name  # the unit the module owns (tied uses: the owner's)

        def note_forward(_module, _args):
            ledger.note_use(name, "forward")

        self.handles = [module.register_forward_pre_hook(note_forward)]

    def set_views(self) -> None:
        for unit, attrs in self.entries:
            for attr, i in attrs:
                # the instance dict, not Module.__setattr__: that would register the
                # parameter with the module (the model's parameters are the units')
                object.__setattr__(self.module, attr, unit.params[i])


class DirectGradHooks:
    """Per direct trainable unit, a post-accumulate-grad hook on each of its parameters;
    the scheduler hears of each accumulation (``direct_grad_accumulated``). A unit
    frozen when wrapped gets its hooks once it is unfrozen (:meth:`hook`; [Note:
    trainability follows the parameters] in trainable.py)."""

    def __init__(self, units, scheduler):
        self.scheduler = scheduler
        self.units = set(units)
        self.handles = []
        for unit in units:
            if unit.requires_grad:
                self.hook(unit)

    def hook(self, unit: ShardUnit) -> None:
        """Hook ``unit``'s parameters (trainable now), unless it is not direct or is hooked
        (``unit.direct``)."""
        if unit not in self.units or unit.direct:
            return
        unit.direct = True
        unit.direct_awaited = len(unit.params)
        for param in unit.params:
            self.handles.append(param.register_post_accumulate_grad_hook(
                lambda _param, unit=unit: self.scheduler.direct_grad_accumulated(unit)))


def reset_awaited(units) -> None:
    """Every direct unit awaits all of its parameters' gradients again (a new backward)."""
    for unit in units:
        if unit.direct:
            unit.direct_awaited = len(unit.params)


def drop_local_grads(unit: ShardUnit) -> None:
    """A failed step: this rank's unreduced gradient leaves ``.grad``."""
    for param in unit.params:
        param.grad = None


def local_grad_pieces(unit: ShardUnit) -> list[torch.Tensor]:
    """The unit's ``.grad`` flattened, in its slot order (a parameter without a gradient
    contributes zeros): what its bucket stages."""
    return [param.grad.reshape(-1) if param.grad is not None
            else torch.zeros(param.numel(), dtype=unit.shard_dtype, device=unit.shard.device)
            for param in unit.params]
