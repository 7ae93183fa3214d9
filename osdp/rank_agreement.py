"""How the ranks of an auto-mode run agree: rank 0 decides (plans, measures, chooses),
the others receive its decision, and every rank checks it holds the same plan. Without
an initialized process group there is one rank, and every helper is the identity."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import errors
from .errors import InfeasiblePlanError, OSDPError, PlanMismatchError
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


def collective_device(group=None) -> torch.device:
    """Where a small tensor must live for a collective on ``group``: the CPU on gloo (or
    a backend pair with gloo for CPU tensors), else this process's current CUDA device
    (NCCL has no CPU tensors: "No backend type associated with device type cpu")."""
    backend = str(dist.get_backend(group)) if _distributed() else "gloo"
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def max_over_ranks(values, group=None):
    """The elementwise max over the ranks of ``group`` of a float or a list of floats
    (the slowest rank's time, the largest peak: what every rank then holds alike);
    ``values`` as given without a process group."""
    if not _distributed():
        return values
    one = not isinstance(values, (list, tuple))
    t = torch.tensor([values] if one else list(values), dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = t.tolist()
    return out[0] if one else out


def is_rank0(group=None) -> bool:
    return not _distributed() or dist.get_rank(group) == 0


def decide_on_rank0(decide, group=None):
    """[Note: rank 0 decides] ``decide()`` runs on rank 0 of ``group`` only, and its
    result (picklable: plans travel as ``to_dict()``) is returned on every rank. When it
    raises an ``OSDPError``, every rank raises that error (its class, message, and an
    ``InfeasiblePlanError``'s ``min_bytes`` and ``breakdown``) instead of the others
    waiting for a broadcast that never comes. Without a process group: ``decide()``."""
    if not _distributed():
        return decide()
    outcome = None
    if is_rank0(group):
        try:
            outcome = {"value": decide()}
        except OSDPError as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc),
                       "min_bytes": getattr(exc, "min_bytes", None), "breakdown": getattr(exc, "breakdown", None)}
    outcome = broadcast_from_rank0(outcome, group)
    if "error" not in outcome:
        return outcome["value"]
    if outcome["error"] == "InfeasiblePlanError":
        raise InfeasiblePlanError(outcome["message"], outcome["min_bytes"], outcome["breakdown"])
    cls = getattr(errors, outcome["error"], None)
    if isinstance(cls, type) and issubclass(cls, OSDPError) and cls.__init__ is OSDPError.__init__:
        raise cls(outcome["message"])
    raise OSDPError(outcome["message"])


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
