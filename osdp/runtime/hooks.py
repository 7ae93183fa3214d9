"""Module hooks that run ordinary (unsplit) units through the scheduler.

Before a bound module's forward, each of its units is gathered and the module's
parameter attributes are set to views of the gathered buffers. For a trainable unit
the views come out of :class:`_GatherFn`, whose backward receives exactly this call's
gradient of every view: that is the "backward of this use is done" signal. A frozen
unit has no gradient; its signal is :class:`_InputGradFn` on the module's inputs (when
they need grad) or, failing that, the end of the backward pass. Hooks on the module's
outputs start each use's backward (gather again / prefetch) before autograd runs the
module's backward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..memtrack import storage_key
from .foreign_reads import FreedWeight, mark
from .modes import UseState
from .scheduler import Scheduler, Use, backward_pass
from .shard_unit import ShardUnit


class _GatherFn(torch.autograd.Function):
    """shard -> views of the gathered weights (fresh aliases per call)."""

    @staticmethod
    def forward(ctx, scheduler: Scheduler, use: Use, shard: torch.Tensor):
        ctx.scheduler, ctx.use = scheduler, use
        ctx.set_materialize_grads(False)
        return tuple(v.view_as(v) for v in use.unit.views)

    @staticmethod
    def backward(ctx, *grads):
        # also a recompute's: a reentrant checkpoint runs its backward ([Note: activation
        # checkpointing] in scheduler.py)
        ctx.scheduler.post_backward(ctx.use, grads)
        return None, None, None


class _InputGradFn(torch.autograd.Function):
    """Identity on a module's inputs; its backward marks the end of frozen units' uses."""

    @staticmethod
    def forward(ctx, scheduler: Scheduler, uses, *tensors):
        ctx.scheduler, ctx.uses = scheduler, uses
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        for use in ctx.uses:
            ctx.scheduler.post_backward(use, None)
        return (None, None) + grads


class _PreBackward:
    """Tensor hook on a module's outputs: the first one to fire in a backward pass starts
    the uses' backward ([Note: backward passes through one graph] in scheduler.py)."""

    def __init__(self, scheduler: Scheduler, uses: list[Use]):
        self.scheduler = scheduler
        self.uses = uses
        self.fired_in: int | None = None  # the graph task it last fired in

    def __call__(self, grad):
        current = backward_pass()
        if current != self.fired_in:
            self.fired_in = current
            for use in self.uses:
                self.scheduler.pre_backward(use)
        return None


def attr_owner(module: nn.Module, attr: str) -> tuple[nn.Module, str]:
    """The module holding ``attr`` and its name there: a leaf module's slots are dotted
    paths below it ([Note: leaf modules] in osdp/module_tree.py)."""
    sub, _, name = attr.rpartition(".")
    return (module.get_submodule(sub) if sub else module), name


class ModuleBinding:
    """One module and the units whose views it computes with (several when a parameter
    is tied to another module's unit): ``entries = [(unit, [(attr, slot index)])]``;
    a leaf module's attributes are dotted paths to its submodules'."""

    def __init__(self, module: nn.Module, path: str, entries, scheduler: Scheduler):
        self.module = module
        self.path = path
        self.entries: list[tuple[ShardUnit, list[tuple[str, int]]]] = entries
        # per entry, where each view goes: (module holding the attribute, its name, slot,
        # the parameter's full name)
        self._targets = [[(*attr_owner(module, attr), i, f"{path}.{attr}" if path else attr) for attr, i in attrs]
                         for _, attrs in entries]
        # per target, what its attribute holds while the module does not run: nothing for
        # a replicated unit (whole weights), else a FreedWeight ([Note: weights read
        # outside their unit] in foreign_reads.py)
        self._freed = [[None if unit.replicated else FreedWeight(unit.views[i], unit, path, attr) for attr, i in attrs]
                       for unit, attrs in entries]
        self.scheduler = scheduler
        # the first forward's ForeignReadCheck while it runs ([Note: weights read outside
        # their unit] in foreign_reads.py)
        self.read_check = None
        self._stack: list[list[Use]] = []
        self._last_views = [unit.views for unit, _ in entries]  # per entry, what the last forward installed
        scheduler.recover_listeners.append(self._recover)
        self.handles = [
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._post_forward, with_kwargs=True),
        ]

    def set_views(self) -> None:
        """Point the module's parameter attributes at what they hold while it does not
        run: a replicated unit's views, a sharded unit's FreedWeight."""
        for (unit, _), targets, freed in zip(self.entries, self._targets, self._freed):
            for (owner, attr, i, _), placeholder in zip(targets, freed):
                # the instance dict: the module's _parameters hold the original
                # parameters (shards) under the same names, attribute reads find this
                owner.__dict__[attr] = unit.views[i] if placeholder is None else placeholder

    @contextlib.contextmanager
    def recomputing(self):
        """Around the recompute of this module as a checkpointed block, which calls its
        forward without the hooks: the attributes are what its last forward computed with
        (views of the buffers the scheduler gathered again for the recompute; as they
        were, so the recompute saves the tensors the forward saved)."""
        for targets, tensors in zip(self._targets, self._last_views):
            for owner, attr, i, _ in targets:
                owner.__dict__[attr] = tensors[i]
        try:
            yield
        finally:
            self.set_views()

    def _recover(self) -> None:
        """A step died mid-forward: no call of the module is in progress."""
        self._stack.clear()
        self.set_views()

    def _pre_forward(self, module, args, kwargs):
        sched = self.scheduler
        grad_enabled = torch.is_grad_enabled()
        # a checkpoint recompute that stopped early never ran our post-forward hook
        while self._stack and self._stack[-1][0].state is UseState.RECOMPUTE:
            self._stack.pop()
        uses = []
        for entry, ((unit, _), targets) in enumerate(zip(self.entries, self._targets)):
            use = sched.pre_forward(unit)
            uses.append(use)
            if grad_enabled and unit.requires_grad:
                # also in a checkpoint recompute: the recomputed graph must save the same
                # tensors as the original forward did
                tensors = _GatherFn.apply(sched, use, unit.shard)
            else:
                tensors = [v.view_as(v) for v in unit.views]
            self._last_views[entry] = tensors
            for owner, attr, i, name in targets:
                owner.__dict__[attr] = tensors[i]  # see set_views
                if self.read_check is not None and not unit.replicated:
                    mark(tensors[i], unit, name)
        frozen = [u for u in uses if not u.unit.requires_grad]
        if frozen and grad_enabled:
            args, kwargs = _hook_inputs(sched, frozen, args, kwargs)
        self._stack.append(uses)
        return args, kwargs

    def _post_forward(self, module, args, kwargs, output):
        if self.read_check is not None:  # the module's own hooks from before wrapping have run
            self.read_check.exited(module)
        uses = self._stack.pop()
        flat, spec = tree_flatten(output)
        if _off_gathered(flat, uses):
            output = tree_unflatten(flat, spec)
        needs_grad = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        grad_flows = torch.is_grad_enabled() and bool(needs_grad)
        expects_backward = grad_flows and uses[0].state is not UseState.RECOMPUTE
        for use in uses:
            self.scheduler.post_forward(use, expects_backward)
        if not self._stack:  # not inside another call of this module
            self.set_views()
        if grad_flows:  # a recompute's hooks fire only under a reentrant checkpoint
            hook = _PreBackward(self.scheduler, uses)
            for tensor in needs_grad:
                tensor.register_hook(hook)
        return output


def _off_gathered(outputs: list, uses) -> bool:
    """Replace in ``outputs`` (a forward's flattened output) each tensor that is a view of
    a gathered buffer of ``uses`` (a module returning its own parameter, or a view of it:
    Perceiver's latents, ``return self.latents.expand(b, -1, -1)``) by a copy; whether
    any was. The buffer is freed (zdp) or reused when the module's forward ends, and a
    view of it read later would read freed storage (a segmentation fault) or another
    unit's weights. The copy is differentiable: the gradient still reaches the parameter
    through the gathered view."""
    gathered = {storage_key(use.unit.gathered) for use in uses
                if not use.unit.replicated and use.unit.gathered.untyped_storage().size()}
    if not gathered:
        return False
    hit = False
    for i, t in enumerate(outputs):
        if isinstance(t, torch.Tensor) and storage_key(t) in gathered:
            outputs[i], hit = t.clone(), True
    return hit


def _hook_inputs(scheduler, uses, args, kwargs):
    flat_args, spec = tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat_args) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return args, kwargs
    outs = _InputGradFn.apply(scheduler, uses, *[flat_args[i] for i in idx])
    for i, t in zip(idx, outs):
        flat_args[i] = t
    return tree_unflatten(flat_args, spec)
