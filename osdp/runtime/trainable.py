"""Which units train: their original parameters' ``requires_grad``, read at each forward.

[Note: trainability follows the parameters]
A unit trains or is frozen as one (one flat shard, one gradient). Users say which
through the original parameters (``model.named_parameters()``, or the wrapped modules'
own), before wrapping or after: a backbone frozen for the first epoch and trained after
it, a layer unfrozen late. Eager OSDP computes through each unit's flat shard, the input
of its gather, so before each forward the shard takes its parameters' flag; a split op's
slices take that of the parameter cut across them. The compiled path rebuilds the shard
from the parameters inside its graph (compiled.py), so autograd follows them there
already. Before this, a unit frozen after wrapping kept training: its gradient was
reduced into the parameters' ``.grad`` and the optimizer stepped them (SGD, 2 gloo
ranks: the second step's loss 4.190704 against single-process training's 4.191924). A
unit whose parameters disagree is refused, naming them, as at wrapping (build.py). A
``rep`` unit that computes with its parameters directly ([Note: direct replicated
units] in direct.py) follows them by construction; one frozen when wrapped gets its
all-reduce hooks when it is unfrozen, so that its gradient is averaged too.

[Note: units planned frozen]
A plan prices a frozen unit without gradient, optimizer state or reduction ([Note:
frozen units] in the cost model), so it holds only while that unit stays frozen. A unit
unfrozen after planning (a backbone trained after its first epoch) trains correctly but
outside the plan's memory and time: the runtime warns once per unit, at the first
forward that finds it trainable, naming it and saying to plan again (a memory limit the
plan packed tightly may then be exceeded: the per-step check raises). Not refused: the
memory may suffice, and the user's choice is honoured.
"""
from __future__ import annotations

import warnings

from ..errors import FrozenPlanWarning, OSDPError
from .shard_unit import ShardUnit


def follow_requires_grad(units: list[ShardUnit]) -> list[ShardUnit]:
    """Set each unit's flat shard trainable or frozen as its parameters are; the units
    unfrozen by it. (A Python pass over every parameter each forward: about 0.3 ms for 292
    units of 581 parameters on this machine's CPU.)"""
    unfrozen = []
    for unit in units:
        params = unit.params
        if not params:
            continue
        trainable = params[0].requires_grad
        if any(p.requires_grad is not trainable for p in params):
            _refuse_mixed(unit)
        if trainable is not unit.shard.requires_grad:
            unit.shard.requires_grad_(trainable)
            if trainable:
                unfrozen.append(unit)
    return unfrozen


def _refuse_mixed(unit: ShardUnit) -> None:
    frozen = [n for n, p in zip(unit.param_names, unit.params) if not p.requires_grad]
    trainable = [n for n, p in zip(unit.param_names, unit.params) if p.requires_grad]
    raise OSDPError(
        f"unit {unit.name!r} mixes frozen parameters ({', '.join(frozen)}) and trainable ones "
        f"({', '.join(trainable)}): a unit trains or is frozen as one; set requires_grad alike on "
        "all of its parameters"
    )


class PlannedFrozenCheck:
    """Warns once per unit the plan priced frozen that trains ([Note: units planned
    frozen]); ``frozen_units``: their module paths (a split unit's slices share one)."""

    def __init__(self, units: list[ShardUnit], frozen_units, plan_name: str):
        names = set(frozen_units)
        paths = ((u, u.name.split("[", 1)[0]) for u in units)  # a slice unit's name is "path[i]"
        self._units = [(u, path) for u, path in paths if path in names]
        self._plan_name = plan_name
        self._warned: set[str] = set()

    def check(self) -> None:
        trained = {path for u, path in self._units if any(p.requires_grad for p in u.params)}
        trained -= self._warned
        if trained:
            self._warned |= trained
            warnings.warn(
                f"unit(s) {', '.join(sorted(trained))} train, but the plan for {self._plan_name} priced them frozen: "
                "their gradients, optimizer state and reductions are not in its memory or time (a tight memory "
                "limit may be exceeded); plan again with them trainable",
                FrozenPlanWarning, stacklevel=3)
