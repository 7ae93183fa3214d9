"""Auto mode: profile, plan on rank 0, broadcast, check by hash on every rank."""
from __future__ import annotations

import torch.distributed as dist

from .errors import InfeasiblePlanError, OSDPError, PlanMismatchError
from .planner.cost_model import PlannerSettings
from .planner.plan import Plan
from .planner.planner import make_plan
from .planner.profiler import profile


def _broadcast(obj, group):
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def check_same_plan(plan: Plan, group=None) -> None:
    """Every rank must run the same plan: compare hashes, fail on all ranks if not."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    hashes = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, plan.plan_hash(), group=group)
    if len(set(hashes)) != 1:
        raise PlanMismatchError(
            f"ranks hold different plans (hashes by rank: {hashes}); every rank must use the "
            "same plan: plan once and broadcast it, or load the same file everywhere"
        )


def for_layout(device, settings: PlannerSettings | None, layout):
    """The measured run as the planner must see it on ``layout`` (a ShardLayout): its
    world size, its nodes and the layout ("hsdp" on a 2-D mesh with replicas, else
    "full"); see [Note: plan and layout] in osdp/contract.py. The profiler measured one
    ring over all ranks; that α/β is used for both levels (within and across nodes): on
    CPU/gloo every rank talks over the same loopback, so it is what both levels cost;
    across real nodes it is the flat ring's measured cost, and a cluster profile with its
    own "inter" link prices them apart. The planner's "hsdp" shards within a node, so
    there the node is the shard group."""
    settings = settings if settings is not None else PlannerSettings()
    hsdp = layout.replicate.size > 1
    node = layout.shard.size if hsdp else layout.node.size
    device = device.with_(world_size=layout.world.size, node_size=node,
                          inter_all_gather=device.inter_all_gather or device.all_gather,
                          inter_reduce_scatter=device.inter_reduce_scatter or device.reduce_scatter)
    return device, settings.with_(layout="hsdp" if hsdp else "full")


def auto_plan(
    model,
    example_inputs,
    memory_limit=None,
    *,
    process_group=None,
    settings: PlannerSettings | None = None,
    batch: int | None = None,
    global_batch: int | None = None,
    loss_fn=None,
    backend: str = "auto",
    cache_dir=None,
    progress: bool = True,
    layout=None,
    **profile_kwargs,
) -> Plan:
    """Measure this cluster, then plan for the most samples per second within
    ``memory_limit`` per device (all ranks call it): a string with a unit ("8GiB", "16GB")
    or a number of bytes (an int or float; ``8`` is 8 bytes; see osdp.sizes). Returns the
    same ``Plan`` on every rank; its ``batch_size`` is the per-device batch the training
    loop must use.

    ``example_inputs``: one forward's arguments, the same on every rank:

    - a tuple of positional arguments: ``model(*example_inputs)``;
    - a dict of keyword arguments: ``model(**example_inputs)``; for a stock Hugging Face
      model, ``{"input_ids": x, "labels": y}`` (its second positional argument is
      ``past_key_values``, not the labels);
    - ``osdp.ExampleInputs(args, kwargs)`` for both.

    The batch is dim 0 of the first tensor. The profiler runs backward on, in order:
    ``loss_fn(output)`` (a scalar tensor; it must work for any batch: the profiler also
    runs halved and repeated batches), ``output.loss`` (a Hugging Face ``ModelOutput``
    given ``labels``, or a dict's ``"loss"``), the output tensor itself (its sum if it is
    not a scalar). A tuple output, or one without a loss, needs ``loss_fn``. See
    [Note: example inputs and the loss] in ``osdp/planner/inputs.py``.

    ``batch``: plan at this per-device batch instead of sweeping for the fastest;
    ``global_batch``: samples per optimizer step over all ranks (the plan picks the
    micro-batch and ``accumulation_steps``). ``layout``: the runtime's ShardLayout
    (``osdp.OSDP`` passes its own): the plan is made for it (:func:`for_layout`). Other
    keyword arguments go to
    :func:`osdp.planner.profile` (``comm_sizes``, ``repeats``, ``batches``, ``use_cache``).
    """
    if batch is not None and global_batch is not None:
        raise OSDPError(
            f"auto_plan got batch={batch} and global_batch={global_batch}: give the per-device "
            "batch or the samples per optimizer step over all ranks, not both"
        )
    if layout is not None and process_group is None and layout.world.group is not dist.group.WORLD:
        process_group = layout.world.group  # a mesh over some of the ranks
    desc, cluster, run = profile(model, example_inputs, memory_limit=memory_limit, process_group=process_group,
                                 cache_dir=cache_dir, progress=progress, loss_fn=loss_fn, **profile_kwargs)
    device = cluster.for_run(run)
    if layout is not None:
        device, settings = for_layout(device, settings, layout)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    outcome = None
    if rank == 0:
        try:
            outcome = make_plan(desc, device, settings, batch=batch, backend=backend,
                                global_batch=global_batch).to_dict()
        except OSDPError as exc:  # every rank raises the same error instead of hanging
            outcome = {"error": type(exc).__name__, "message": str(exc),
                       "min_bytes": getattr(exc, "min_bytes", None), "breakdown": getattr(exc, "breakdown", None)}
    if distributed:
        outcome = _broadcast(outcome, process_group)
    if "error" in outcome:
        if outcome["error"] == "InfeasiblePlanError":
            raise InfeasiblePlanError(outcome["message"], outcome["min_bytes"], outcome["breakdown"])
        raise OSDPError(outcome["message"])
    plan = Plan.from_dict(outcome)
    plan.check_model(desc.fingerprint(), device.world_size)
    check_same_plan(plan, process_group)
    return plan
