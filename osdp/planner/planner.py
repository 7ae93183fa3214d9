"""make_plan: describe + device + settings -> Plan, with the FSDP baselines beside it."""
from __future__ import annotations

from dataclasses import asdict, replace

from ..contract import MODE_DP, MODE_HPZ, MODE_REP, MODE_ZDP
from ..errors import InfeasiblePlanError, OSDPError
from ..sizes import format_bytes
from .collective_cost import collectives
from .cost_model import PlannerSettings
from .model_desc import ModelDesc
from .device import DeviceInfo
from .plan import Plan, Prediction, UnitDecision
from .batch_sweep import Scheduled, check_batch, schedule
from .rerank import rerank, with_simulation
from .step_sim import simulate_scheduled

# baseline name -> settings overrides (policy, checkpointing); "ddp": every unit rep
BASELINES = {
    "fsdp": dict(policy="zdp", checkpointing="none", layout="full"),
    "shard_grad_op": dict(policy="dp", checkpointing="none", layout="full"),
    "ddp": dict(policy="rep", checkpointing="none", layout="full"),
}
CKPT_BASELINES = {"fsdp_ckpt": dict(policy="zdp", checkpointing="all", layout="full")}


def _prediction(s: Scheduled) -> Prediction:
    return Prediction(
        batch_size=s.batch,
        step_s=s.result.time_s,
        samples_per_s=s.samples_per_s,
        peak_bytes=s.estimate.peak_bytes,
        peak_op=s.estimate.peak_op,
        breakdown=dict(s.estimate.breakdown),
    )


def plan_from_schedule(s: Scheduled, baselines: dict | None = None, notes: tuple[str, ...] = ()) -> Plan:
    t = s.template
    desc = t.desc
    checkpointed = {
        desc.ops[i].name
        for seg, v in zip(t.segments, s.result.variant)
        if seg.variants[v]
        for i in seg.ops
    }
    units, modes_of = [], {}
    for i, op in enumerate(desc.ops):
        if op.tied_to:  # a second use of another unit's weights: its owner's unit
            if op.param_count:  # and a bias of its own: a unit in its owner's mode (unsplit)
                units.append(UnitDecision(op.name, op.kind, op.param_bytes, modes_of[op.tied_to],
                                          op.name in checkpointed, "", frozen=not op.trainable))
            continue
        o = s.result.option_index[i]
        g, k, h = t.shape(o)
        modes = (MODE_ZDP,) * k + (MODE_HPZ,) * h + (MODE_DP,) * (g - k - h)
        if t.rep is not None and t.rep[i]:  # the template's rep set: [Note: rep mode]
            modes = (MODE_REP,)
        modes_of[op.name] = modes
        units.append(UnitDecision(op.name, op.kind, op.param_bytes, modes,
                                  op.name in checkpointed, op.split_op if g > 1 else "", frozen=not op.trainable))
    blocks = tuple(seg.name for seg, v in zip(t.segments, s.result.variant) if seg.variants[v])
    rounded_terms = sum(1 for i in range(len(desc.ops)) if t.opt_held_bytes[s.result.option_index[i]] > 0)
    return Plan(
        model_name=desc.name,
        fingerprint=desc.fingerprint(),
        world_size=t.device.world_size,
        memory_limit_bytes=float(t.device.memory_limit_bytes),
        batch_size=s.batch,
        prefetch_bytes=int(t.window_bytes),
        units=tuple(units),
        checkpoint_blocks=blocks,
        predicted=_prediction(s),
        baselines=dict(baselines or {}),
        device_name=t.device.name,
        search_s=s.search_s,
        searches=s.searches,
        quantum_bytes=t.quantum_bytes,
        rounding_bound_bytes=t.quantum_bytes * (rounded_terms + len(t.segments)),
        settings=_settings_json(t.settings),
        accumulation_steps=t.settings.accumulation_steps,
        gradient_sync=t.settings.gradient_sync,
        notes=tuple(notes) + _capped_note(s),
        node_size=_plan_node_size(t.device, t.settings.layout),
    )


def _settings_json(settings: PlannerSettings) -> dict:
    """The settings as a plan's JSON holds them (the rep set as a list, as it loads)."""
    data = asdict(settings)
    if data.get("rep_units") is not None:
        data["rep_units"] = list(data["rep_units"])
    return data


def _plan_node_size(device: DeviceInfo, layout: str) -> int | None:
    """Ranks per node within the shard group, as the plan priced them (None: a flat
    network, any node size); "hsdp": the shard group. See [Note: plan and layout]."""
    if device.node_size is None and layout == "full":
        return None
    return collectives(device, layout).per_node


def _capped_note(s: Scheduled) -> tuple[str, ...]:
    if not s.batch_capped:
        return ()
    return (f"the batch sweep stops at {s.batch} samples per device (MAX_BATCH): that batch fits in "
            f"{format_bytes(s.template.device.memory_limit_bytes)} and larger ones may too; is the memory "
            "limit right? Give a batch size (--batch, make_plan(batch=...)) to plan for another",)


def make_plan(
    desc: ModelDesc,
    device: DeviceInfo,
    settings: PlannerSettings | None = None,
    batch: int | None = None,
    backend: str = "auto",
    baselines: bool = True,
    global_batch: int | None = None,
) -> Plan:
    """The plan with the most samples/s (or the fastest at ``batch``), plus the
    predictions of FSDP full shard, shard-grad-op and DDP (every unit ``rep``) at the
    same memory limit (and FSDP with checkpointing when checkpointing is allowed).
    Without ``batch`` each baseline is at its own best batch; with ``batch`` every
    baseline is evaluated at that same batch (no sweep; ``None`` where it does not fit),
    and the plan's notes say so.

    With ``settings.rerank`` (the default) the search's best plan and a few alternatives
    are priced by the step simulation and the one with the most simulated samples/s
    that fits is returned (see rerank.py's [Note: re-ranking]); ``predicted`` then
    carries ``simulated_step_s`` and ``plan.rerank`` the candidates."""
    settings = settings or PlannerSettings()
    batch = check_batch(batch)
    if batch is not None and global_batch is not None:
        raise OSDPError("give batch (per device) or global_batch (per optimizer step), not both")
    best = schedule(desc, device, settings, batch=batch, backend=backend, global_batch=global_batch)
    found, scheduled, notes = {}, {}, ()
    if baselines and batch is not None:
        notes = (f"the FSDP baselines are evaluated at the same batch {batch}/device (a given batch is not swept)",)
    if baselines:
        wanted = dict(BASELINES)
        if settings.checkpointing != "none":
            wanted.update(CKPT_BASELINES)
        for name, overrides in wanted.items():
            try:
                scheduled[name] = schedule(desc, device, settings.with_(**overrides), batch=batch, backend=backend,
                                           global_batch=global_batch)
                found[name] = _prediction(scheduled[name])
            except InfeasiblePlanError:
                found[name] = None
    if not settings.rerank:
        return plan_from_schedule(best, found, notes)
    return _reranked_plan(desc, device, settings, best, found, scheduled, batch, global_batch, backend, notes)


def _reranked_plan(desc, device, settings, best, found, scheduled, batch, global_batch, backend, notes) -> Plan:
    # the baselines above were swept at their own best batch: reusable as candidates
    # only when this plan's batch is swept too
    ranked = rerank(desc, device, settings, best, batch=batch, global_batch=global_batch, backend=backend,
                    known=scheduled if batch is None else None)
    sims = {id(c.scheduled): c.sim for c in ranked.candidates}
    for name, s in scheduled.items():
        sim = sims.get(id(s)) or simulate_scheduled(s)
        found[name] = with_simulation(found[name], sim, s)
    picked = ranked.picked
    # the sweep's cap is a fact about the sweep (the search's best), whichever plan wins
    if picked.scheduled is not best and not picked.scheduled.batch_capped:
        notes = tuple(notes) + _capped_note(best)
    plan = plan_from_schedule(picked.scheduled, found, notes)
    return replace(
        plan,
        predicted=with_simulation(plan.predicted, picked.sim, picked.scheduled),
        search_s=best.search_s,  # the sweep's; the re-ranking's own time is in plan.rerank
        searches=best.searches,
        rerank=ranked.report(),
    )
