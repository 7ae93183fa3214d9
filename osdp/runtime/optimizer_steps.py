"""Counting the optimizer steps taken on a model's parameters, for the lockstep check.

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
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


# every live counter; one global hook for all, registered once and never removed: a
# hook removed when its model is collected, which may happen inside an optimizer's step,
# changes torch's dict of global hooks while the step iterates it ("OrderedDict mutated
# during iteration")
_COUNTERS: weakref.WeakSet = weakref.WeakSet()
_HOOKED = False


def _count_step(optimizer, args, kwargs) -> None:
    for counter in list(_COUNTERS):
        counter._stepped(optimizer)


class OptimizerSteps:
    """How many optimizer steps touched ``params`` since the last :meth:`take`."""

    def __init__(self, params: Iterable[torch.Tensor]):
        global _HOOKED
        self._param_ids = frozenset(id(p) for p in params)
        # optimizer -> (its groups' sizes when tested, whether it holds one of the params)
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._count = 0
        _COUNTERS.add(self)  # weakly: the hook does not keep the model's state alive
        if not _HOOKED:
            register_optimizer_step_post_hook(_count_step)
            _HOOKED = True

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
        known = self._holds.get(optimizer)
        if known is None or known[0] != sizes:
            holds = any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])
            known = self._holds[optimizer] = (sizes, holds)
        self._count += known[1]

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
