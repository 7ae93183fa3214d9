"""Execution modes of a unit and the states it moves through."""
from __future__ import annotations

import enum

from ..errors import OSDPError


class Mode(str, enum.Enum):
    """What a unit does with its all-gathered weights between forward and backward."""

    DP = "dp"
    """Keep: gathered once before forward, kept through backward, freed after its last
    backward use. 1 all-gather + 1 reduce-scatter per step."""

    ZDP = "zdp"
    """Reshard: freed right after forward, gathered again before backward, freed after.
    2 all-gathers + 1 reduce-scatter per step."""

    HPZ = "hpz"
    """Reshard to the node (ZeRO++ hpZ, FSDP2 ``reshard_after_forward=int``): after
    forward a copy sharded only within the node is kept (``gathered_bytes / node_size``)
    and the full weights freed; backward gathers from that copy over the intra-node
    group. 1 all-gather (shard group) + 1 all-gather (node group) + 1 reduce-scatter per
    step. On a layout with one node per shard group it is ``zdp``, with one rank per
    node ``dp``: see [Note: modes per level] in ``osdp/contract.py``."""

    REP = "rep"
    """Replicated (DDP): whole parameters, gradients and optimizer state on every rank,
    never gathered; the gradient is all-reduced in buckets. Whole units only: see
    [Note: replicated units] in ``osdp/contract.py``."""


class GatherState(enum.Enum):
    """Where a unit's unsharded (gathered) weights are."""

    SHARDED = "sharded"
    """Only the local shard exists; the gathered buffer's storage has size 0."""

    GATHERING = "gathering"
    """Storage allocated and an all-gather issued; compute must wait on it first."""

    GATHERED = "gathered"
    """The gathered buffer holds the full weights and compute may read it."""


class UseState(enum.Enum):
    """One forward call's use of a unit, as seen by backward."""

    FORWARD = "forward"
    """The unit's forward is running."""

    AWAIT_BACKWARD = "await_backward"
    """Forward done; its outputs need gradients, so a backward use will come."""

    BACKWARD = "backward"
    """Backward of this use has started (weights must be gathered) and not finished."""

    DONE = "done"
    """Finished, or no backward will come (no grad needed)."""

    ABANDONED = "abandoned"
    """Its backward had not come by the end of a backward pass (outputs not in that
    loss): dropped then; a later backward through it still works (gathers again)."""

    RECOMPUTE = "recompute"
    """A checkpoint recompute inside backward: it only gathers what the recomputed
    forward reads; the original forward's use does the backward."""


def parse_mode(value, where: str) -> Mode:
    """``"dp"``/``"zdp"``/``"hpz"``/``"rep"`` (any case) or a :class:`Mode`; anything else is an OSDPError."""
    if isinstance(value, Mode):
        return value
    if isinstance(value, str):
        try:
            return Mode(value.lower())
        except ValueError:
            pass
    raise OSDPError(f"{where}: mode {value!r} is not one of 'dp', 'zdp', 'hpz', 'rep'")
