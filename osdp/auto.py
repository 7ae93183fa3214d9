"""Auto mode: profile, plan on rank 0, broadcast, check by hash on every rank; then
calibrate: measure the plan on the runtime, refit and re-plan once when the model was
off (see [Note: calibrate and re-plan]), and measure the few alternatives the model
could have mis-ranked beside it ([Note: measured choice])."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from .api import ShardedModel
from .errors import InfeasiblePlanError, OSDPError
from .compiled_choice import compiled_choice
from .measured_choice import measured_choice
from .measured_plans import MeasuredPlans
from .ops import registered_split_ops
from .planner import calibration as cal
from .planner.cost_model import PlannerSettings
from .planner.device import DeviceInfo
from .planner.inputs import as_example_inputs, auto_mode_loss
from .planner.calibration_record import CalibrationRecord
from .planner.plan import Plan
from .planner.planner import make_plan
from .profiler import compute_device, profile
from .planner.uniform_plan import uniform_plan
from .profiler import TrialPool, measure_plans
from .profiler.plans import forked_rng
from .rank_agreement import check_same_plan, decide_on_rank0, is_rank0
from .planner.calibration import Measurement
from .planning_budget import (DEFAULT_BUDGET_S, MIN_SHARE, PROFILE_SHARE, PlanningBudget, predicted_optimizer_step_s,
                              show_progress)
from .runtime.compile_config import CompileConfig
from .runtime.options import default_device
from .runtime.peak import step_peak_readable
from .runtime.materialize import has_meta, meta_skeleton
from .sizes import format_bytes

log = logging.getLogger("osdp.auto")


def for_model_device(settings: PlannerSettings | None, model) -> PlannerSettings:
    """``settings`` with ``optimizer_temporaries`` "auto" resolved as torch's AdamW
    resolves its own default for the parameters it will step: foreach on CUDA (where
    ``model`` is, or where ``osdp.OSDP`` puts it by default), the for-loop elsewhere
    (cost_model/static.py's [Note: optimizer step moment])."""
    settings = settings if settings is not None else PlannerSettings()
    if settings.optimizer_temporaries != "auto":
        return settings
    on_cuda = torch.cuda.is_available() or any(p.device.type == "cuda" for p in model.parameters())
    return settings.with_(optimizer_temporaries="foreach" if on_cuda else "per_tensor")


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
    calibrate: bool = True,
    calibration_steps: int = 3,
    mixed_precision=None,
    param_init_fn=None,
    compile=None,
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
    - ``osdp.ExampleInputs(args, kwargs)`` for both; ``ExampleInputs(args, kwargs,
      at_batch=fn)`` where samples do not sit along dim 0 (packed image patches),
      ``fn(n)`` the inputs of ``n`` samples for the profiler's other batch sizes.

    The batch is dim 0 of the first tensor (in a dict, list or tuple argument too).
    The profiler runs backward on, in order:
    ``loss_fn(output)`` (a scalar tensor; it must work for any batch: the profiler also
    runs halved and repeated batches), ``output.loss`` (a Hugging Face ``ModelOutput``
    given ``labels``, or a dict's ``"loss"``), the output tensor itself when a scalar, else
    a cross-entropy over logits it assumes (and logs), else the sum. A tuple output, or
    one without a loss, needs ``loss_fn``. See
    [Note: example inputs and the loss] in ``osdp/planner/inputs.py``.

    ``batch``: plan at this per-device batch instead of sweeping for the fastest;
    ``global_batch``: samples per optimizer step over all ranks (the plan picks the
    micro-batch and ``accumulation_steps``). ``layout``: the runtime's ShardLayout
    (``osdp.OSDP`` passes its own): the plan is made for it (:func:`for_layout`). Other
    keyword arguments go to
    :func:`osdp.profiler.profile` (``comm_sizes``, ``repeats``, ``batches``, ``use_cache``).

    ``calibrate`` (default on, with a process group): the plan is then measured on the
    runtime (a copy of ``model`` wrapped with it, ``calibration_steps`` timed steps) and,
    when the model was off, refitted and planned again once; see [Note: calibrate and
    re-plan]. The returned plan carries ``measured`` and ``calibration``.
    ``mixed_precision``: the policy the model will be wrapped with (for that measurement).
    ``compile``: the ``OSDP(compile=...)`` the model will run with: the best eager plans
    are measured compiled and the fastest compiled kept ([Note: compiled plans] in
    osdp/compiled_choice.py).
    """
    # a meta model's values: initialized under a forked state (the caller's draws stay its
    # own); passed on, not kept here (the pool lets it go once a trial holds them)
    plan, values = plan_with_values(
        model, example_inputs, memory_limit,
        holder=_forked_holder(model, process_group, layout, mixed_precision, param_init_fn) if has_meta(model)
        else None, process_group=process_group, settings=settings,
        batch=batch, global_batch=global_batch, loss_fn=loss_fn, backend=backend, cache_dir=cache_dir,
        progress=progress, layout=layout, calibrate=calibrate, calibration_steps=calibration_steps,
        mixed_precision=mixed_precision, compile=compile, **profile_kwargs)
    values.close()
    return plan


@contextlib.contextmanager
def _state_kept(model):
    """Profiling runs forwards and backwards on the user's model in train mode: its
    buffers (BatchNorm's running statistics and step counts, moved a different number of
    times on each rank, as each times its units) and the random streams it draws from
    (dropout) are put back as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with forked_rng():
            yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _forked_holder(model, process_group, layout, mixed_precision, param_init_fn):
    with forked_rng():
        return value_holder(model, process_group, layout, mixed_precision, param_init_fn)


def value_holder(model, process_group, layout, mixed_precision, param_init_fn):
    """``model`` (on the meta device) wrapped as FSDP, all units ``zdp`` (the least memory
    a wrapped model holds), and initialized: what holds its values while auto mode
    measures it ([Note: one trial at a time] in osdp/profiler/plans.py)."""
    where = {"mesh": layout} if layout is not None else {"process_group": process_group}
    return ShardedModel(meta_skeleton(model), default_mode="zdp", mixed_precision=mixed_precision, memory_check=False,
                        param_init_fn=param_init_fn, **where)


def plan_with_values(model, example_inputs, memory_limit=None, *, holder=None, process_group=None,
                     settings: PlannerSettings | None = None, batch: int | None = None,
                     global_batch: int | None = None, loss_fn=None, backend: str = "auto", cache_dir=None,
                     progress: bool = True, layout=None, calibrate: bool = True, calibration_steps: int = 3,
                     mixed_precision=None, budget_s: float | None = DEFAULT_BUDGET_S, use_plan_cache: bool = True,
                     compile=None, **profile_kwargs):
    """:func:`auto_plan`'s work: ``(plan, values)``, ``values`` the ``RuntimeMeasure``
    whose ``holder()`` is the wrapped model holding the values of a ``model`` on the meta
    device (``holder``: the one it started from; the last trial after measuring); the
    caller builds from it, then closes it."""
    if batch is not None and global_batch is not None:
        raise OSDPError(
            f"auto_plan got batch={batch} and global_batch={global_batch}: give the per-device "
            "batch or the samples per optimizer step over all ranks, not both"
        )
    if layout is not None and process_group is None and layout.world.group is not dist.group.WORLD:
        process_group = layout.world.group  # a mesh over some of the ranks
    show_progress(progress, process_group)
    budget = PlanningBudget(budget_s, process_group)  # [Note: planning budget]
    loss_fn = auto_mode_loss(loss_fn, announce=is_rank0(process_group))  # [Note: example inputs and the loss]
    profile_kwargs.setdefault("compute_time_s", budget.seconds * PROFILE_SHARE)  # [Note: planning budget]
    with _state_kept(model):
        desc, cluster, run = profile(model, example_inputs, memory_limit=memory_limit, process_group=process_group,
                                     cache_dir=cache_dir, progress=progress, loss_fn=loss_fn, **profile_kwargs)
    log.info("described %d units%s and profiled this machine in %.1f s", len(desc.ops),
             " on fake tensors (the model is on the meta device)" if has_meta(model) else "", budget.spent())
    compile_config = CompileConfig.from_arg(compile)
    if compile_config is not None:
        desc = splits_the_compiled_path_runs(desc)
    device = cluster.for_run(run)
    settings = for_model_device(settings, model)
    if layout is not None:
        device, settings = for_layout(device, settings, layout)
    hardware = device  # the profile on this layout, before calibration refits it
    calibrate = calibrate and dist.is_available() and dist.is_initialized()
    measure = RuntimeMeasure(model, example_inputs, loss_fn=loss_fn, process_group=process_group,
                             steps=calibration_steps, mixed_precision=mixed_precision, layout=layout, holder=holder,
                             budget=budget, compile=compile_config)
    del holder  # the pool holds it, until a trial holds the values
    cache = MeasuredPlans(cache_dir, enabled=use_plan_cache and calibrate, group=process_group,
                          device=compute_device(model))
    key = cache.key(desc, device, settings, batch, global_batch, example_inputs, loss_fn, mixed_precision,
                    compile_config)
    try:
        plan = cache.get(key)
        if plan is not None:
            log.info("plan from the cache of measured plans (%s): %s, batch %d", cache.path, plan_summary(plan),
                     plan.batch_size)
            return plan, measure
        if calibrate:  # [Note: calibrate and re-plan] step 1
            device, reference = runtime_profile(desc, device, settings or PlannerSettings(),
                                                as_example_inputs(example_inputs).batch_size(), measure,
                                                process_group=process_group, backend=backend)
            log.info("fitted the runtime's factors to %d measured FSDP steps", len(reference))
        plan = _plan_on_rank0(desc, device, settings, batch, global_batch, backend, process_group)
        if calibrate and batch is None and global_batch is None:
            cap = budget.batch_cap(plan, floor=as_example_inputs(example_inputs).batch_size())
            if cap is not None:
                batch = cap
                plan = _plan_on_rank0(desc, device, settings, batch, None, backend, process_group)
        log.info("planned: %s, batch %d, predicted step %.0f ms, peak %s of %s", plan_summary(plan), plan.batch_size,
                 predicted_optimizer_step_s(plan) * 1e3, format_bytes(plan.predicted.peak_bytes),
                 format_bytes(device.memory_limit_bytes))
        if calibrate:
            plan = calibrate_plan(desc, hardware, device, plan, measure, reference=reference, settings=settings,
                                  batch=batch, global_batch=global_batch, backend=backend,
                                  process_group=process_group)
            log.info("calibration: %s", plan.calibration.decision or "-")
            measured = []
            plan = measured_choice(desc, device, plan, measure, settings=settings, batch=batch,
                                   global_batch=global_batch, backend=backend, process_group=process_group,
                                   measured_out=measured)
            if compile_config is not None:
                plan = compiled_choice(desc, device, plan, measured, measure, settings=settings or PlannerSettings(),
                                       process_group=process_group, batch=batch, global_batch=global_batch,
                                       backend=backend)
            plan = replace(plan, calibration=plan.calibration.with_(budget=budget.record()),
                           assumed_loss=getattr(loss_fn, "assumed", ""))
            _refuse_measured_over_limit(plan, measured)
            cache.put(key, plan)
        plan = replace(plan, assumed_loss=getattr(loss_fn, "assumed", ""))
        check_same_plan(plan, process_group)
        log.info("picked: %s, batch %d%s; %.0f s in auto mode", plan_summary(plan), plan.batch_size,
                 f", measured {Measurement.from_dict(plan.measured).step_s * 1e3:.0f} ms a step"
                 if plan.measured else "", budget.spent())
    except BaseException:
        measure.close()
        raise
    return plan, measure


def _refuse_measured_over_limit(plan: Plan, measured: list) -> None:
    """Every plan auto mode measured went over the limit (the model under-predicted, and
    calibration found no plan that fits): handed out, it raised MemoryLimitExceeded at
    every training step. ``measured``: the (plan, Measurement) pairs of the measured
    choice; all ranks hold the same (rank 0's, broadcast), so all raise alike."""
    peak = Measurement.from_dict(plan.measured).peak_bytes if plan.measured else None
    if peak is None or peak <= plan.memory_limit_bytes:
        return
    least_plan, least = min([(plan, Measurement.from_dict(plan.measured))] + list(measured),
                            key=lambda pair: pair[1].peak_bytes)
    other = (f"; the least any measured plan peaked at is {format_bytes(least.peak_bytes)} "
             f"({plan_summary(least_plan)}, batch {least_plan.batch_size})" if least.peak_bytes < peak else "")
    raise InfeasiblePlanError(
        f"no plan auto mode measured fits in {format_bytes(plan.memory_limit_bytes)}: the model predicted they "
        f"would, and the best one ({plan_summary(plan)}, batch {plan.batch_size}) measured a peak of "
        f"{format_bytes(peak)}{other}. Give a memory limit of at least that (memory_limit={int(least.peak_bytes)}), "
        "or plan by hand with less held (default_mode='zdp', checkpoint_blocks=)", min_bytes=least.peak_bytes)


def _plan_on_rank0(desc, device, settings, batch, global_batch, backend, process_group) -> Plan:
    """``make_plan`` on rank 0, broadcast; every rank raises the same error instead of
    hanging."""
    plan = Plan.from_dict(decide_on_rank0(
        lambda: make_plan(desc, device, settings, batch=batch, backend=backend, global_batch=global_batch).to_dict(),
        process_group))
    plan.check_model(desc.fingerprint(), device.world_size)
    return plan


# ---- calibration -------------------------------------------------------------------------

class RuntimeMeasure:
    """``measure([plan, ...]) -> [Measurement, ...]``: ``osdp.profiler.measure_plans``
    of ``model``, one trial at a time, the last one kept warm for the next call ([Note:
    one trial at a time]) until :meth:`close`. ``holder``: the wrapped model holding the
    values of a ``model`` on the meta device."""

    def __init__(self, model, example_inputs, *, loss_fn=None, process_group=None, steps: int = 3,
                 mixed_precision=None, layout=None, holder=None, budget: PlanningBudget | None = None,
                 compile: CompileConfig | None = None):
        self.model, self.example_inputs, self.steps = model, example_inputs, steps
        self.options = dict(loss_fn=loss_fn, process_group=process_group, mixed_precision=mixed_precision,
                            layout=layout)
        self.pool = TrialPool(holder=holder)
        self.budget = budget if budget is not None else PlanningBudget(None, process_group)
        self.compile = compile  # the run's: its compiled choice's trials ([Note: compiled plans])
        self.count = 0
        self.first_compiled_step_s: dict[str, float] = {}  # per plan hash: its compiled trial's first step
        self.compiled_cpu_peaks: dict[str, float] = {}  # per plan hash: its compiled CPU step's allocator bytes

    def __call__(self, plans):
        """Each plan's eager :class:`Measurement` (compiled runs too: [Note: compiled
        plans] in osdp/compiled_choice.py)."""
        return self._measured(plans, None)

    def compiled(self, pairs) -> list[Measurement]:
        """Each ``(plan, its eager measurement)`` measured compiled, one trial at a time
        (each trial's first step compiles), with all of ``self.steps`` timed: the
        compiled choice is outside the planning budget. The peak it is held to its limit
        by ([Note: compiled memory] in osdp/compiled_choice.py): the compiled step's on
        CUDA (the allocator's, as the eager step's is); on CPU the eager step's live
        tensors, the bytes the runtime and the memory model count there, while the
        compiled step's allocator bytes, another measure (it also holds the backends'
        own buffers: W&S all zdp at batch 20, eager, 272.0 MiB against the live tensors'
        263.0), are kept beside it (``compiled_cpu_peaks``, [Note: CPU allocator peak]
        in osdp/memtrack.py)."""
        out = []
        for plan, eager in pairs:
            (m,) = self._measured([plan], self.compile, budgeted=False)
            # the first compile of a plan (a rebuild's compiles from inductor's cache)
            self.first_compiled_step_s.setdefault(plan.plan_hash(), self.pool.current.first_step_s)
            if not step_peak_readable(default_device(), compiled=True):  # the trials' device
                if not m.peak_source.startswith("not measured"):
                    self.compiled_cpu_peaks[plan.plan_hash()] = m.peak_bytes
                m = replace(m, peak_bytes=eager.peak_bytes, peak_source=f"the eager step's: {eager.peak_source}")
            out.append(replace(m, compiled=True))
        return out

    def _measured(self, plans, config, budgeted: bool = True):
        steps = self.budget.steps(plans, self.steps, warmup=2) if budgeted else self.steps
        results = measure_plans(self.model, plans, self.example_inputs, steps=steps, pool=self.pool, compile=config,
                                **self.options)
        for plan, m in zip(plans, results):
            self.count += 1
            log.info("measured plan %d%s: %s, batch %d: step %.0f ms (%d timed), %.1f samples/s, peak %s; %.0f s of "
                     "the budget left", self.count, " compiled" if config is not None else "", plan_summary(plan),
                     plan.batch_size, m.step_s * 1e3, m.steps, m.samples_per_s(plan.world_size, plan.accumulation_steps),
                     format_bytes(m.peak_bytes), max(self.budget.left(), 0))
        return results

    def holder(self):
        """The wrapped model that holds a meta model's values now (None for a real
        model), its optimizer state and gradients gone: what a model is built from."""
        self.pool.strip()
        return self.pool.values()

    def close(self) -> None:
        self.pool.close()
        self.pool.holder = None  # a holder never measured from (a cached plan) goes too


def splits_the_compiled_path_runs(desc):
    """``desc`` with the ops whose split op has no compiled forward (the embedding's row
    split) left whole: every plan a compiled run measures, and the one it hands out, must
    run on the compiled path ([Note: compiled units] refuses the others)."""
    ops = registered_split_ops()
    return replace(desc, ops=tuple(op if not op.splittable or hasattr(ops.get(op.split_op), "compiled_forward")
                                   else replace(op, splittable=False) for op in desc.ops))


def runtime_profile(desc, device, settings: PlannerSettings, batch: int, measure, *, process_group=None,
                    backend: str = "auto"):
    """Step 1 of [Note: calibrate and re-plan]: FSDP full shard (all ``zdp``, no
    checkpointing: the plan every model can run) measured on the runtime at ``batch``
    and at half of it (compute grows with the batch, the runtime's per-unit overhead and
    the collectives do not, which tells them apart), and FSDP split
    (``split_reference``: more unit uses and collectives per FLOP), the factors
    refitted to all three.
    Returns the refitted device and the [(plan, measurement)] it was fitted to ([] and
    ``device`` when FSDP does not fit at ``batch``)."""
    def reference_plans():
        fsdp = settings.with_(policy="zdp", checkpointing="none", rerank=False, accumulation_steps=1)
        refs = []
        for b in sorted({batch, max(1, batch // 2)}, reverse=True):
            try:
                refs.append(_fsdp_reference(desc, device, fsdp, b, settings, backend))
            except OSDPError:
                continue
        split = split_reference(desc, device, settings, batch) if refs else None
        if split is not None:
            refs.append(split)
        budget = getattr(measure, "budget", None)  # [Note: planning budget]: FSDP at the batch always
        if budget is not None and refs:
            refs = refs[:1] + budget.affordable(refs[1:], "calibration's extra reference plans",
                                                reserve_s=MIN_SHARE * budget.seconds)
        return [p.to_dict() for p in refs]

    refs = [Plan.from_dict(r) for r in decide_on_rank0(reference_plans, process_group)]
    if not refs:
        return device, []
    observations = list(zip(refs, measure(refs)))
    try:
        fitted = decide_on_rank0(lambda: cal.refit(desc, device, observations).to_dict(), process_group)
    except OSDPError as exc:
        fitted = None
        if is_rank0(process_group):
            log.warning("could not fit the runtime's factors (%s); planning on the profile alone", exc)
    return (device if fitted is None else DeviceInfo.from_dict(fitted, "calibrated device")), observations


REFERENCE_SLICES = 4  # the split reference's slices per splittable op (at most max_slices)


def _fsdp_reference(desc, device, fsdp: PlannerSettings, batch: int, settings: PlannerSettings, backend: str):
    """FSDP full shard at ``batch``; with the units ``settings`` fixes as rep kept rep:
    a model reading a weight outside its unit runs only so, and the rest all zdp is
    still FSDP's plan (``uniform_plan``). OSDPError where it does not fit."""
    rep_units = settings.rep_units if settings.policy == "osdp" else None
    if not rep_units:
        return make_plan(desc, device, fsdp, batch=batch, backend=backend, baselines=False)
    plan = uniform_plan(desc, device, fsdp, batch, rep_units=rep_units)
    if plan.predicted.peak_bytes > device.memory_limit_bytes:
        raise OSDPError(f"FSDP with rep units {list(rep_units)} does not fit at batch {batch}")
    return plan


def split_reference(desc, device, settings: PlannerSettings, batch: int) -> Plan | None:
    """FSDP with every splittable op in ``min(REFERENCE_SLICES, max_slices)`` zdp slices
    at ``batch`` (``uniform_plan``), where the planner may split (policy "osdp",
    ``max_slices`` >= 2) and it is predicted to fit; else None. Split plans make many
    more unit uses and collectives per FLOP than FSDP: without one measured, the fit
    cannot tell the runtime's per-unit overhead and the collectives' latency from
    compute, and it under-priced split plans by 20-27% (bench/fidelity.py, I&C
    split4_mixed)."""
    slices = min(REFERENCE_SLICES, settings.max_slices)
    if settings.policy != "osdp" or slices < 2 or not any(op.splittable for op in desc.ops):
        return None
    try:
        plan = uniform_plan(desc, device, settings.with_(accumulation_steps=1), batch, slices=slices,
                            zdp_slices=slices, rep_units=settings.rep_units or ())
    except OSDPError:
        return None
    if plan.predicted.peak_bytes > device.memory_limit_bytes or all(u.slices == 1 for u in plan.units):
        return None
    return plan


def calibrate_plan(desc, hardware, device, plan: Plan, measure, *, reference=None, settings=None, batch=None,
                   global_batch=None, backend: str = "auto", process_group=None) -> Plan:
    """[Note: calibrate and re-plan]
    1. (``runtime_profile``) FSDP full shard at the example batch and at half of it,
       and FSDP with its splittable ops in slices (``split_reference``), are
       measured on the runtime (``osdp.profiler.measure_plan``: a copy of the model
       wrapped by ``osdp.OSDP``, a few AdamW steps; the slowest rank's, so every rank
       holds the same numbers) and the factors are fitted to it (``calibration.refit``:
       compute scales, unit overhead, overlap efficiency, comm scale, optimizer bandwidth, memory
       constant). The plan is made on that
       ``device``: a plan is only handed out with the memory margin the measurement
       taught (the learned constant).
    2. The plan is measured and rank 0 compares it with its prediction
       (``calibration.reasons_to_refit``): step time off by more than 5%, or the
       measured peak within the memory tolerance of the limit. If neither, it stays,
       with its measurement beside it.
    3. Otherwise every factor is refitted from the ``hardware`` profile to the plan's
       measurement and those of step 1 (two phase equations each), rank 0 plans again
       on it and broadcasts the re-plan.
    4. A re-plan that differs is measured beside the plan (their steps interleaved);
       it is kept only if it measured better (``calibration.better``: within the limit
       less the margin first, then samples/s).
       Rank 0 decides and broadcasts the plan returned on every rank.
    ``measure([plan, ...]) -> [Measurement, ...]`` (``RuntimeMeasure``); ``reference``: step 1's
    [(plan, measurement)]."""
    group = process_group
    settings = settings or PlannerSettings()
    margin = settings.memory_tolerance
    reference = list(reference or [])
    same = [m for p, m in reference if p.plan_hash() == plan.plan_hash()]
    first = same[0] if same else measure([plan])[0]
    # every measurement at its own batch: compute grows with the batch, the runtime's
    # per-unit overhead does not, so measurements at several batches tell them apart
    observations = [(plan, first)] + [(p, m) for p, m in reference if m is not first]
    info = CalibrationRecord().with_(factors=asdict(device.calibration),
                                     memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
                                     constant_bytes=device.constant_bytes)
    reasons = decide_on_rank0(lambda: cal.reasons_to_refit(plan, first, margin), group)
    info = info.with_(reasons=reasons)
    used = {id(m) for _, m in observations}
    info = info.with_(observations=[{"plan": p.plan_hash(), "batch_size": p.batch_size, "measured": m.to_dict(),
                                     "refitted_to": id(m) in used}
                                    for p, m in [(plan, first)] + [(p, m) for p, m in reference if m is not first]])
    if not reasons:
        return _annotated(plan, first, info.with_(decision="kept: the model predicted it within 5% and with room "
                                                           "below the limit", **cal.predictions(desc, device, plan)))
    def refit_and_replan():
        fitted = cal.refit(desc, hardware, observations)
        replan = make_plan(desc, fitted, settings, batch=batch, backend=backend, global_batch=global_batch)
        return {"device": fitted.to_dict(), "replan": replan.to_dict()}

    try:
        outcome = decide_on_rank0(refit_and_replan, group)
    except OSDPError as exc:
        log.warning("calibration could not re-plan (%s); keeping the plan", exc)
        return _annotated(plan, first, info.with_(decision=f"kept: re-planning failed ({exc})",
                                                  **cal.predictions(desc, device, plan)))
    fitted = DeviceInfo.from_dict(outcome["device"], "calibrated device")
    info = info.with_(factors=asdict(fitted.calibration),
                      memory_bandwidth_bytes_per_s=fitted.memory_bandwidth_bytes_per_s,
                      constant_bytes=fitted.constant_bytes)
    replan = Plan.from_dict(outcome["replan"])
    if replan.plan_hash() == plan.plan_hash():
        return _annotated(replan, first, info.with_(decision="kept: the re-plan on the refitted model is the same plan",
                                                    **cal.predictions(desc, fitted, replan)))
    budget = getattr(measure, "budget", None)
    if not decide_on_rank0(lambda: budget is None or bool(budget.affordable([plan, replan], "calibration's re-plan")),
                           group):
        return _annotated(plan, first, info.with_(decision="kept: the re-plan was not measured (the planning "
                                                  "budget was spent)", **cal.predictions(desc, device, plan)))
    # both measured again, one after the other ([Note: one trial at a time])
    first, second = measure([plan, replan])

    def choose():
        keep_replan = cal.better((plan, first), (replan, second), margin)[0] is replan
        chosen, other = ((replan, second), (plan, first)) if keep_replan else ((plan, first), (replan, second))
        samples = [m.samples_per_s(p.world_size, p.accumulation_steps) for p, m in (chosen, other)]
        decision = (f"re-planned: the re-plan measured {samples[0]:.2f} samples/s against {samples[1]:.2f}"
                    if keep_replan else
                    f"kept: the re-plan measured {samples[1]:.2f} samples/s against the plan's {samples[0]:.2f}")
        extra = info.with_(decision=decision, other={"plan": other[0].to_dict(), "measured": other[1].to_dict()},
                           **cal.predictions(desc, fitted, chosen[0]))
        return _annotated(chosen[0], chosen[1], extra).to_dict()

    return Plan.from_dict(decide_on_rank0(choose, group))


def plan_summary(plan: Plan) -> str:
    """One line of what a plan runs: its modes and slices, checkpointed blocks."""
    modes: dict[str, int] = {}
    for unit in plan.units:
        for mode in unit.modes:
            modes[mode] = modes.get(mode, 0) + 1
    split = sum(1 for u in plan.units if u.slices > 1)
    parts = [" ".join(f"{n} {m}" for m, n in sorted(modes.items()))]
    parts += [f"{split} split"] if split else []
    parts += [f"{len(plan.checkpoint_blocks)} blocks checkpointed"] if plan.checkpoint_blocks else []
    return ", ".join(parts)


def _annotated(plan: Plan, measured, calibration: CalibrationRecord) -> Plan:
    return replace(plan, measured=measured.to_dict(), calibration=calibration)
