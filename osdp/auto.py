"""Auto mode: profile, plan on rank 0, broadcast, check by hash on every rank; then
calibrate: measure the plan on the runtime, refit and re-plan once when the model was
off (see [Note: calibrate and re-plan])."""
from __future__ import annotations

import logging
from dataclasses import asdict, replace

import torch.distributed as dist

from .errors import InfeasiblePlanError, OSDPError, PlanMismatchError
from .planner.cost_model import PlannerSettings
from .planner.plan import Plan
from .planner.planner import make_plan
from .planner.profiler import profile

log = logging.getLogger("osdp.auto")


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
    calibrate: bool = True,
    calibration_steps: int = 3,
    mixed_precision=None,
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
    micro-batch and ``accumulation_steps``). Other keyword arguments go to
    :func:`osdp.planner.profile` (``comm_sizes``, ``repeats``, ``batches``, ``use_cache``).

    ``calibrate`` (default on, with a process group): the plan is then measured on the
    runtime (a copy of ``model`` wrapped with it, ``calibration_steps`` timed steps) and,
    when the model was off, refitted and planned again once; see [Note: calibrate and
    re-plan]. The returned plan carries ``measured`` and ``calibration``.
    ``mixed_precision``: the policy the model will be wrapped with (for that measurement).
    """
    if batch is not None and global_batch is not None:
        raise OSDPError(
            f"auto_plan got batch={batch} and global_batch={global_batch}: give the per-device "
            "batch or the samples per optimizer step over all ranks, not both"
        )
    desc, cluster, run = profile(model, example_inputs, memory_limit=memory_limit, process_group=process_group,
                                 cache_dir=cache_dir, progress=progress, loss_fn=loss_fn, **profile_kwargs)
    device = cluster.for_run(run)
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
    if calibrate and distributed:
        plan = calibrate_plan(model, example_inputs, desc, device, plan, settings=settings, batch=batch,
                              global_batch=global_batch, backend=backend, loss_fn=loss_fn,
                              process_group=process_group, steps=calibration_steps, mixed_precision=mixed_precision)
    check_same_plan(plan, process_group)
    return plan


# ---- calibration -------------------------------------------------------------------------

def calibrate_plan(model, example_inputs, desc, device, plan: Plan, *, settings=None, batch=None, global_batch=None,
                   backend: str = "auto", loss_fn=None, process_group=None, steps: int = 3,
                   mixed_precision=None, measure=None) -> Plan:
    """[Note: calibrate and re-plan]
    1. The plan is measured on the runtime (``osdp.profiler.measure_plan``: a copy of
       the model wrapped with it, a few AdamW steps; max over ranks, so every rank holds
       the same numbers).
    2. Rank 0 compares it with the prediction (``calibration.reasons_to_refit``): step
       time off by more than 5%, or the measured peak within the memory tolerance of
       the limit. If neither, the plan stays, with its measurement beside it.
    3. Otherwise the factors are refitted (``calibration.refit``: compute scale, unit
       overhead, overlap efficiency, optimizer bandwidth, memory constant) to the plan's
       measurement and, for enough equations, to that of FSDP full shard (all ``zdp``) at
       the same batch when it fits, measured too. Rank 0 plans again on the refitted
       device (the learned memory constant makes the margin) and broadcasts it.
    4. A re-plan that differs is measured; it is kept only if it measured better
       (``calibration.better``: within the limit less the margin first, then samples/s).
       Rank 0 decides and broadcasts the plan that is returned on every rank.
    ``measure(plan) -> Measurement``: the measurement (default ``measure_plan``)."""
    from .planner import calibration as cal

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    settings = settings or PlannerSettings()
    margin = settings.memory_tolerance
    if measure is None:
        from .profiler import measure_plan

        def measure(p):
            return measure_plan(model, p, example_inputs, loss_fn=loss_fn, steps=steps, process_group=process_group,
                                mixed_precision=mixed_precision)

    def share(obj):
        return _broadcast(obj, process_group) if distributed else obj

    first = measure(plan)
    # 2. rank 0 decides whether to refit, and names the reference plan to measure
    step = None
    if rank == 0:
        step = {"reasons": cal.reasons_to_refit(plan, first, margin), "reference": None}
        if step["reasons"] and not all(m == "zdp" for u in plan.units for m in u.modes):
            try:
                ref = make_plan(desc, device, settings.with_(policy="zdp", checkpointing="none", rerank=False),
                                batch=plan.batch_size, backend=backend, baselines=False)
                if ref.accumulation_steps == plan.accumulation_steps:
                    step["reference"] = ref.to_dict()
            except OSDPError:
                pass  # FSDP does not fit at this batch: refit from the plan alone
    step = share(step)
    if not step["reasons"]:
        return _annotated(plan, first, {"decision": "kept: the model predicted it within 5% and with room below the "
                                                    "limit", "reasons": [], **_predictions(cal, desc, device, plan)})
    observations = [(plan, first)]
    if step["reference"] is not None:
        ref = Plan.from_dict(step["reference"])
        observations.append((ref, measure(ref)))
    # 3. rank 0 refits and plans again
    outcome = None
    if rank == 0:
        try:
            fitted = cal.refit(desc, device, observations)
            replan = make_plan(desc, fitted, settings, batch=batch, backend=backend, global_batch=global_batch)
            outcome = {"device": fitted.to_dict(), "replan": replan.to_dict()}
        except OSDPError as exc:
            outcome = {"error": str(exc)}
    outcome = share(outcome)
    info = {"reasons": step["reasons"],
            "observations": [{"plan": p.plan_hash(), "measured": m.to_dict(), **_predictions(cal, desc, device, p)}
                             for p, m in observations]}
    if "error" in outcome:
        log.warning("calibration could not re-plan (%s); keeping the plan", outcome["error"])
        return _annotated(plan, first, {**info, "decision": f"kept: re-planning failed ({outcome['error']})"})
    from .planner.device import DeviceInfo

    fitted = DeviceInfo.from_dict(outcome["device"], "calibrated device")
    info["factors"] = asdict(fitted.calibration)
    info["memory_bandwidth_bytes_per_s"] = fitted.memory_bandwidth_bytes_per_s
    info["constant_bytes"] = fitted.constant_bytes
    replan = Plan.from_dict(outcome["replan"])
    if replan.plan_hash() == plan.plan_hash():
        decision = "kept: the re-plan on the refitted model is the same plan"
        return _annotated(replace(replan, notes=plan.notes), first,
                          {**info, "decision": decision, **_predictions(cal, desc, fitted, replan)})
    # 4. measure the re-plan; rank 0 keeps the better one
    second = measure(replan)
    keep = None
    if rank == 0:
        keep_replan = cal.better((plan, first), (replan, second), margin)[0] is replan
        chosen, other = ((replan, second), (plan, first)) if keep_replan else ((plan, first), (replan, second))
        samples = [m.samples_per_s(p.world_size, p.accumulation_steps) for p, m in (chosen, other)]
        decision = (f"re-planned: the re-plan measured {samples[0]:.2f} samples/s against {samples[1]:.2f}"
                    if keep_replan else
                    f"kept: the re-plan measured {samples[1]:.2f} samples/s against the plan's {samples[0]:.2f}")
        extra = {**info, "decision": decision, "other": {"plan": other[0].to_dict(), "measured": other[1].to_dict()},
                 **_predictions(cal, desc, fitted, chosen[0])}
        keep = _annotated(chosen[0], chosen[1], extra).to_dict()
    return Plan.from_dict(share(keep))


def _predictions(cal, desc, device, plan) -> dict:
    """Predicted seconds per phase and per unit group of ``plan`` on ``device``."""
    try:
        a = cal.assignment_of(desc, device, plan)
        sim = cal.simulate(a, device)
        return {"predicted_phases": {k: v.duration_s for k, v in sim.phases.items()},
                "predicted_step_s": sim.step_s,
                "predicted_groups": cal.predicted_groups(a, device)}
    except OSDPError as exc:
        return {"predicted_error": str(exc)}


def _annotated(plan: Plan, measured, calibration: dict) -> Plan:
    return replace(plan, measured=measured.to_dict(), calibration=calibration)
