"""How the ranks of an auto-mode run agree: rank 0 decides (plans, measures, chooses),
the others receive its decision, and every rank checks it holds the same plan. Without
an initialized process group there is one rank, and every helper is the identity."""
from __future__ import annotations

import torch.distributed as dist

from .errors import PlanMismatchError
from .planner.plan import Plan


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def broadcast_from_rank0(obj, group=None):
    """Rank 0's ``obj`` (of ``group``) on every rank; ``obj`` itself without a group."""
    if not _distributed():
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def is_rank0(group=None) -> bool:
    return not _distributed() or dist.get_rank(group) == 0


def check_same_plan(plan: Plan, group=None) -> None:
    """Every rank must run the same plan: compare hashes, fail on all ranks if not."""
    if not _distributed():
        return
    hashes = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, plan.plan_hash(), group=group)
    if len(set(hashes)) != 1:
        raise PlanMismatchError(
            f"ranks hold different plans (hashes by rank: {hashes}); every rank must use the "
            "same plan: plan once and broadcast it, or load the same file everywhere"
        )
