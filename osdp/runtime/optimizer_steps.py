"""What a model sees of the optimizers stepping its parameters: the steps they take (for
the lockstep check), and gradients a step would miss.

[Note: optimizer steps in lockstep]
Each rank's optimizer steps its own shards of the parameters. A rank that skips a step
its peers take leaves the model half updated, and nothing fails: the next forward
gathers shards of two different steps. ``torch.amp.GradScaler`` does exactly that with
sharded gradients: it skips the step where THIS rank's gradients hold an inf or NaN,
and an overflow often lands in one rank's shards only (an embedding's gradient is
nonzero in the rows of the tokens seen: tests/runtime/grad_scaler_cases.py makes one),
after which the ranks also keep different loss scales. ``osdp.GradScaler``
(grad_scaler.py) agrees on the found inf over the model's ranks, as FSDP's
``ShardedGradScaler`` does. A step under a rank-local condition (``if loss < x``) does
the same damage.

So the lockstep check ([Note: lockstep check] in lockstep_check.py) compares, beside
its hash of the collectives, the number of optimizer steps each rank took on the
model's parameters since the previous check. They are counted by a global optimizer
step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``: every
optimizer, whoever built it) for the optimizers that hold one of the parameters. The
check is after the fact: at the end of the next backward one rank's shards have stepped
and another's have not, so the error says to restore the last checkpoint; it comes
before the optimizer could step again. Cost: a Python call per optimizer step, the
membership test cached per optimizer and its parameter groups' sizes.

[Note: held gradients at a step]
Micro-batches whose backward runs with gradient sync off keep their unsharded gradients
in the units ([Note: gradient accumulation] in reduce.py), not in ``.grad`` (a direct
``rep`` unit's are in ``.grad``, this rank's alone): only the backward with sync on
reduces them over the ranks into ``.grad``. An optimizer step taken while some are
held (every micro-batch ran under ``no_sync``) would step without them, and they would
be added into the next step's gradients (or each rank would step its rep units with its
own gradients, and the ranks' copies would part). So a
global optimizer step pre-hook raises for an optimizer holding one of the model's
parameters while the model holds such gradients, and says how to reduce or drop them
(``model.zero_grad()`` drops them; ``optimizer.zero_grad()`` cannot: it sees ``.grad``
only).

[Note: optimizers that read shapes]
The optimizer steps this rank's piece of each parameter of a sharded unit: a flat range
of its elements, shaped as it can be (a (128, 32) weight's half is a (2048, 1) piece).
An element-wise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...) computes on each
element what it would on the whole parameter. One that reads a parameter's shape or all
of its elements together computes another update, silently: ``Adafactor`` factors the
second moment over a matrix's rows and columns (on an empty piece it divides by zero),
``Muon`` orthogonalizes the matrix, ``LBFGS`` takes dot products over every parameter.
So a step of one of those on a piece is refused, naming the piece; its ``rep`` units
(whole on every rank) it may step.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from typing import Callable

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..errors import OSDPError


# every live watcher; one global hook for each kind, registered once and never removed: a
# hook removed when its model is collected, which may happen inside an optimizer's step,
# changes torch's dict of global hooks while the step iterates it ("OrderedDict mutated
# during iteration")
_COUNTERS: weakref.WeakSet = weakref.WeakSet()
_STEP_CHECKS: weakref.WeakSet = weakref.WeakSet()  # each with ``_before_step(optimizer)``
_HOOKED: set[str] = set()


def _count_step(optimizer, args, kwargs) -> None:
    for counter in list(_COUNTERS):
        counter._stepped(optimizer)


def _check_step(optimizer, args, kwargs) -> None:
    for check in list(_STEP_CHECKS):
        check._before_step(optimizer)


def _watch(registry: weakref.WeakSet, watcher, kind: str) -> None:
    registry.add(watcher)  # weakly: the hook does not keep the model's state alive
    if kind not in _HOOKED:
        register = register_optimizer_step_post_hook if kind == "post" else register_optimizer_step_pre_hook
        register(_count_step if kind == "post" else _check_step)
        _HOOKED.add(kind)


class ParamMembership:
    """Whether an optimizer holds one of ``params``, cached per optimizer and its
    parameter groups' sizes."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._param_ids = frozenset(id(p) for p in params)
        # optimizer -> (its groups' sizes when tested, whether it holds one of the params)
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, optimizer: torch.optim.Optimizer) -> bool:
        sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
        known = self._holds.get(optimizer)
        if known is None or known[0] != sizes:
            holds = any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])
            known = self._holds[optimizer] = (sizes, holds)
        return known[1]


class OptimizerSteps:
    """How many optimizer steps touched ``params`` since the last :meth:`take`."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._holds = ParamMembership(params)
        self._count = 0
        _watch(_COUNTERS, self, "post")

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        self._count += self._holds(optimizer)

    def take(self) -> int:
        """The steps counted since the last call; the count starts over."""
        count, self._count = self._count, 0
        return count


def uneven_steps_message(steps: list[int], rank: int) -> str:
    """For :class:`RanksOutOfStepError`: the ranks stepped the optimizer unequally."""
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(steps))
    return (
        f"rank {rank}: the ranks took different numbers of optimizer steps on this model's parameters since the "
        f"previous backward ({per_rank}), so some ranks' shards of the parameters stepped and others' did not: the "
        "model is now a mix of two steps. Restore the last checkpoint. torch.amp.GradScaler skips the step where "
        "its own rank's gradient shards overflow, and the ranks' shards differ: use osdp.GradScaler(model), which "
        "agrees on the overflow over every rank (as FSDP's ShardedGradScaler does); a step under a condition each "
        "rank evaluates on its own data must be decided alike on every rank. See [Note: optimizer steps in lockstep] "
        "in osdp/runtime/optimizer_steps.py. lockstep_check=False (or OSDP_LOCKSTEP_CHECK=0) turns this check off"
    )


class HeldGradientsCheck:
    """Refuses an optimizer step on ``params`` while ``held()`` names units holding
    gradients no backward has reduced: [Note: held gradients at a step]."""

    def __init__(self, params: Iterable[torch.Tensor], held: Callable[[], list[str]]):
        self._holds = ParamMembership(params)
        self._held = held
        _watch(_STEP_CHECKS, self, "pre")

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        names = self._held()
        if not names or not self._holds(optimizer):
            return
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise OSDPError(
            f"optimizer.step() while {len(names)} units ({shown}) hold gradients that backward passes with gradient "
            "sync off (no_sync, set_requires_gradient_sync(False), a micro_batch before the last) accumulated and "
            "no backward has reduced over the ranks: this step would miss them (a sharded unit's are not in "
            ".grad, the next step would add them in) or step each rank with its own (a rep unit's). Run the last "
            "micro-batch's backward with sync on (outside no_sync), or call model.zero_grad() to drop them "
            "([Note: held gradients at a step] in osdp/runtime/optimizer_steps.py)")


# torch.optim's optimizers that read a parameter's shape or all its elements together
SHAPE_READING_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in ("Adafactor", "Muon", "LBFGS")
                                 if hasattr(torch.optim, name))


class PieceShapeCheck:
    """Refuses a step of a shape-reading optimizer on a piece of a sharded parameter:
    [Note: optimizers that read shapes]. ``params``: (name, parameter) pairs."""

    def __init__(self, params: Iterable[tuple[str, torch.Tensor]]):
        self._pieces = {id(p): name for name, p in params
                        if tuple(getattr(p, "_osdp_full_shape", p.shape)) != tuple(p.shape)}
        _watch(_STEP_CHECKS, self, "pre")

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, SHAPE_READING_OPTIMIZERS):
            return
        piece = next((p for group in optimizer.param_groups for p in group["params"] if id(p) in self._pieces), None)
        if piece is None:
            return
        raise OSDPError(
            f"torch.optim.{type(optimizer).__name__} steps each parameter as a whole (its shape, or all its "
            f"elements together), and OSDP hands optimizers this rank's piece of each sharded parameter: "
            f"{self._pieces[id(piece)]!r} is a {tuple(piece.shape)} piece of a {tuple(piece._osdp_full_shape)} "
            "parameter, so it would compute another update. Use an element-wise optimizer (AdamW, Adam, SGD, "
            "Adagrad, RMSprop, ...), or keep the units it steps whole with modes={unit: 'rep'} ([Note: optimizers "
            "that read shapes] in osdp/runtime/optimizer_steps.py)")
