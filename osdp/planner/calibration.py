"""Calibration: fit the few global factors of the time and memory model to measured
steps of the wrapped model, and decide whether a plan must be made again.

Pure (no runtime import): the measurement itself is ``osdp.profiler`` (it wraps a copy
of the model with ``osdp.OSDP`` and times real training steps); auto mode
(``osdp/auto.py``) drives plan -> measure -> refit -> re-plan once.

[Note: what the profiler fits]
Two kinds of numbers feed the cost model, from two kinds of measurement:

1. hardware, per op and per collective (``osdp.profiler.profile``): α/β of all-gather and
   of the gradient collective the runtime uses on this backend, timed as bare
   collectives over message sizes; per-unit forward/backward compute fitted over the
   batch, timed with hooks on the UNWRAPPED model; the split matmul's efficiency.
2. the runtime as it runs (``osdp.profiler.measure_plan``): a copy of the model wrapped
   by ``osdp.OSDP`` with the plan (real scheduler, prefetch window, coalescing of small
   units, reduction queue), trained for a few steps with AdamW on the example batch;
   measured per step: forward, backward and optimizer wall time (medians, max over
   ranks) and the peak memory of one step (live tensors on CPU, the allocator on CUDA).

From (2) ``fit_factors`` fits, by least squares over the forward and backward phases of
every measured plan (relative errors, each factor kept in its range), the linear model

    measured_phase = compute_scale * F + backward_compute_scale * B + unit_overhead_s * U
                     + W + (1 - overlap_efficiency) * H

where, for that plan as the step simulation plays it (``step_sim.py``): F and B are the
phase's fitted forward and backward compute (the per-op fits of (1); F in the backward
phase is the recompute of checkpointed blocks), U its unit uses (one per
slice per use; hooks, bookkeeping and collective issue run on the compute stream), W the
time compute waited for communication, H the communication that ran beside compute.
W and H depend on the factors, so the fit is repeated a few times with W and H
simulated at the last factors, then polished on the simulation itself
(``fit_by_simulation``: Levenberg-Marquardt, the simulated phases against the
measured), which also fits ``comm_scale``: every collective's seconds in a step over
the bare collectives the profile timed (on this 2-core CPU, 2 gloo ranks: 1.0-2.8,
their threads share the cores with compute). Every factor is pulled toward the
profile's value ([Note: the prior pull]), so a factor the measurements do not pin down
stays where it was; a factor whose column is zero everywhere (no hidden comm: H = 0)
keeps its prior. Without the pull (``prior_weight=0``) the factors are fitted in the
order of ``FACTORS``, as many as there are phase equations. The optimizer phase is fitted on its own: memory bandwidth (the cost
model's optimizer is bandwidth bound) scaled by predicted / measured. The memory
constant is the largest (measured peak - predicted peak) over the measured plans, added
to ``DeviceInfo.constant_bytes``: a re-plan is handed out with the margin the
measurement showed (``memory_constant_bytes`` says how much of the constant was learned).
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ..errors import OSDPError
from ..sizes import format_bytes
from .cost_model import PlannerSettings, ProblemTemplate, build_template, evaluate, option_compute_s, option_unit_uses
from .cost_model import optimizer_step_s
from .model_desc import ModelDesc
from .device import Calibration, DeviceInfo
from .step_sim import simulate_step

STEP_TOLERANCE = 0.05  # re-plan when the step is predicted further off than this
COMPUTE_SCALE_RANGE = (0.1, 10.0)
COMM_SCALE_RANGE = (0.25, 10.0)
FIT_ROUNDS = 3
RIDGE = 1e-6
# [Note: the prior pull] weight and scale of each factor's pull toward the profile's
# value, in the units of the fit's residuals (relative phase errors): a factor off its
# prior by one scale costs as much as one phase predicted PRIOR_WEIGHT off
PRIOR_WEIGHT = 0.1
PRIOR_SCALES = (1.0, 1.0, 200e-6, 1.0, 1.0)  # scales: x1; unit overhead: 200 us; overlap: its range
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class Measurement:
    """Measured steps of one plan on the runtime (``osdp.profiler.measure_plan``):
    medians over ``steps`` timed steps, max over ranks; ``peak_bytes`` of one steady
    step (``peak_source`` says how it was read). ``groups``: unit group (module path
    with layer indices as ``*``) -> measured forward seconds of a step's first
    micro-batch, summed over the group's units (each from its forward pre-hook to the
    next unit's: its compute, the work attributed to it, and waits for the next gather).
    ``compiled``: the steps ran compiled ([Note: compiled plans] in osdp/compiled_choice.py)."""

    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    peak_bytes: float
    batch_size: int
    steps: int = 0
    peak_source: str = ""
    groups: dict = field(default_factory=dict)
    compiled: bool = False

    def samples_per_s(self, world_size: int, accumulation_steps: int = 1) -> float:
        return self.batch_size * accumulation_steps * world_size / self.step_s

    def phase_s(self, phase: str) -> float:
        return getattr(self, f"{phase}_s")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data, where: str = "measurement") -> "Measurement":
        if not isinstance(data, dict):
            raise OSDPError(f"{where} must be an object, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OSDPError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise OSDPError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class PhaseTerms:
    """One measured phase and the terms of [Note: what the profiler fits]."""

    phase: str
    measured_s: float
    forward_compute_s: float  # F: fitted forward compute, scale 1, no runtime overhead
    backward_compute_s: float  # B: fitted backward compute, likewise
    unit_uses: float  # U
    waited_s: float  # W
    hidden_s: float  # H


@dataclass(frozen=True)
class Assignment:
    """A plan as option indices of a template (what the cost model prices)."""

    template: ProblemTemplate
    batch: int
    option_index: tuple
    variant: tuple


def settings_of(plan) -> PlannerSettings:
    """The settings a plan was made with (a plan from an older OSDP may lack some)."""
    known = {f.name for f in fields(PlannerSettings)}
    return PlannerSettings(**{k: v for k, v in (plan.settings or {}).items() if k in known})


def assignment_of(desc: ModelDesc, device: DeviceInfo, plan, settings: PlannerSettings | None = None) -> Assignment:
    """The option indices of ``plan``'s units (slices and zdp slices) and its
    checkpointed blocks, in a template of ``desc`` on ``device``: the plan's settings
    widened to every option (policy "osdp", its slice counts, checkpointing when it
    checkpoints) with its ``rep`` units as the template's rep set, its prefetch window as
    the runtime runs it."""
    settings = settings or settings_of(plan)
    tied_uses = {op.name for op in desc.ops if op.tied_to}
    settings = settings.with_(
        policy="osdp", prefetch_bytes=float(plan.prefetch_bytes),
        max_slices=max([settings.max_slices] + [u.slices for u in plan.units]), split_small_units=True,
        checkpointing="auto" if plan.checkpoint_blocks else settings.checkpointing,
        # its rep units, read off its modes ([Note: rep mode] in docs/design/cost_model.md); a tied
        # use's bias runs its owner's mode and is not a unit of the rep set
        rep_units=tuple(u.name for u in plan.units if u.modes == ("rep",) and u.name not in tied_uses))
    t = build_template(desc, device, settings)
    decisions = {u.name: u for u in plan.units}
    blocks = set(plan.checkpoint_blocks)
    variant = []
    for seg in t.segments:
        want = seg.name in blocks
        variant.append(next((v for v, ck in enumerate(seg.variants) if ck == want), 0))
    option_index = []
    for i, op in enumerate(desc.ops):
        s = next(s for s, seg in enumerate(t.segments) if i in seg.ops)
        v = variant[s]
        u = decisions.get(op.tied_to or op.name)  # a tied use runs its owner's choice
        g, k, h = (1, 0, 0) if u is None else (u.slices, u.zdp_slices, u.hpz_slices)
        options = [o for o in range(t.opt_begin[i, v], t.opt_end[i, v]) if int(t.opt_slices[o]) == g]
        match = [o for o in options if t.shape(o) == (g, k, h)]
        if not match and len(options) == 1:
            match = options  # a use that reads no weights in backward: one option per g
        if not match:
            raise OSDPError(f"the plan's unit {op.name!r} ({g} slices, {k} zdp, {h} hpz) is not an option of the "
                            "cost model under the plan's settings")
        option_index.append(match[0])
    return Assignment(t, plan.batch_size, tuple(option_index), tuple(variant))


def _raw_compute(a: Assignment) -> dict[str, tuple[float, float, float]]:
    """(F, B, U) per phase for one optimizer step, at compute scale 1 without overhead."""
    t = a.template
    bare = replace(t, device=t.device.with_(calibration=Calibration()))
    comp_f, comp_b = option_compute_s(bare, a.batch)
    uses = option_unit_uses(t)
    o = np.asarray(a.option_index)
    ckpt = t.opt_checkpointed[o]
    steps = t.settings.accumulation_steps
    forward = (float(comp_f[o].sum()) * steps, 0.0, float(uses[o].sum()) * steps)
    backward = (float((comp_f[o] * ckpt).sum()) * steps, float(comp_b[o].sum()) * steps,
                float((uses[o] * (1 + ckpt)).sum()) * steps)
    return {"forward": forward, "backward": backward}


def simulate(a: Assignment, device: DeviceInfo):
    """The step simulation of the assignment on ``device`` (its calibration)."""
    return simulate_step(replace(a.template, device=device), a.batch, a.option_index, a.variant)


def phase_terms(a: Assignment, device: DeviceInfo, measured: Measurement) -> list[PhaseTerms]:
    """Forward and backward terms of ``measured`` with W and H simulated on ``device``
    at full overlap (the lost part of the overlap is what the fit finds)."""
    full = device.with_(calibration=replace(device.calibration, overlap_efficiency=1.0))
    sim = simulate(a, full)
    raw = _raw_compute(a)
    rows = []
    for phase in ("forward", "backward"):
        p = sim.phases[phase]
        waited = p.duration_s - p.compute_s
        hidden = min(max(0.0, p.comm_s - waited), p.compute_s)
        rows.append(PhaseTerms(phase, measured.phase_s(phase), *raw[phase], waited, hidden))
    return rows


FACTORS = ("compute_scale", "backward_compute_scale", "unit_overhead_s", "overlap_efficiency", "comm_scale")
BOUNDS = (COMPUTE_SCALE_RANGE, COMPUTE_SCALE_RANGE, (0.0, math.inf), (0.0, 1.0), COMM_SCALE_RANGE)
LINEAR = 4  # factors of the linear fit; comm_scale moves W and H, which only the simulation follows


def box_lstsq(a: np.ndarray, b: np.ndarray, lo, hi) -> np.ndarray | None:
    """argmin ||a z - b|| with lo <= z <= hi, exactly: every combination of variables
    free or at a (finite) bound is solved and the best feasible one kept (fine for the
    few factors here: 3^4 = 81 small solves). None when no combination is feasible."""
    k = a.shape[1]
    best, best_err = None, math.inf
    for states in itertools.product((0, 1, 2), repeat=k):
        z = np.zeros(k)
        free = []
        for j, st in enumerate(states):
            if st == 0:
                free.append(j)
                continue
            bound = (lo[j], hi[j])[st - 1]
            if not math.isfinite(bound):
                break
            z[j] = bound
        else:
            if free:
                sub = a[:, free]
                if np.linalg.matrix_rank(sub) < len(free):
                    continue
                z[free] = np.linalg.lstsq(sub, b - a @ z, rcond=None)[0]
            if any(not (lo[j] - 1e-12 <= z[j] <= hi[j] + 1e-12) for j in range(k)):
                continue
            err = float(np.sum((a @ z - b) ** 2))
            if err < best_err - 1e-18:
                best, best_err = np.clip(z, lo, hi), err
    return best


def _fitted(columns: np.ndarray, rows: int, prior_weight: float) -> list[int]:
    """Factors to fit: those with a nonzero column; without the prior pull at most one
    per equation, in order (with it, the pull makes every fit unique)."""
    nonzero = [j for j in range(columns.shape[1]) if np.abs(columns[:, j]).max() > 0]
    return nonzero if prior_weight > 0 else nonzero[:rows]


def fit_factors(rows: list[PhaseTerms], prior: Calibration = Calibration(),
                prior_weight: float = PRIOR_WEIGHT) -> Calibration:
    """Least squares of the linear model of [Note: what the profiler fits] over
    ``rows`` with W and H as given, relative errors, each factor in its range (the
    compute scales in COMPUTE_SCALE_RANGE, unit_overhead_s >= 0, overlap_efficiency in
    [0, 1]), each pulled toward ``prior`` ([Note: the prior pull]). Without the pull
    (``prior_weight=0``) at most as many factors as rows are fitted, in the order of
    ``FACTORS``; factors not fitted keep ``prior``."""
    if not rows:
        return prior
    # y = cf F + cb B + u U - e H   with   y = measured - W - H
    a = np.array([[r.forward_compute_s, r.backward_compute_s, r.unit_uses, -r.hidden_s] for r in rows],
                 dtype=np.float64)
    y = np.array([r.measured_s - r.waited_s - r.hidden_s for r in rows], dtype=np.float64)
    w = 1.0 / np.maximum(np.array([r.measured_s for r in rows]), 1e-12)
    a, y = a * w[:, None], y * w
    x = np.array([getattr(prior, n) for n in FACTORS[:LINEAR]], dtype=np.float64)
    fit = _fitted(a, len(rows), prior_weight)
    if not fit:
        return prior
    pull = np.diag(_pull_weights(a, fit, prior_weight))
    sub = np.vstack([a[:, fit], pull])
    rhs = np.concatenate([y - np.delete(a, fit, axis=1) @ np.delete(x, fit), pull @ x[fit]])
    z = box_lstsq(sub, rhs, [BOUNDS[j][0] for j in fit], [BOUNDS[j][1] for j in fit])
    if z is None:
        return prior
    x[fit] = z
    return replace(prior, **{n: float(v) for n, v in zip(FACTORS[:LINEAR], x)})


def _pull_weights(columns: np.ndarray, fit: list[int], prior_weight: float) -> np.ndarray:
    """[Note: the prior pull]
    Four factors fitted to four to six measured phases fit the noise: on a shared CPU
    two identical forward phases of one run differ by 50%, and an exact fit moved
    compute_scale to its bound (0.1) and charged the step to unit overhead, which then
    mispriced every plan with more unit uses (split plans, +52%). So each fitted factor
    is pulled toward the profile's value (the per-op compute timed on this machine: a
    compute scale of 1) with weight ``prior_weight / PRIOR_SCALES[j]``: data that
    consistently asks for another value moves it (a doubled compute scale costs what a
    phase PRIOR_WEIGHT off does, and every measured phase pays for not doubling), noise
    in one phase does not. A tiny ridge (RIDGE of the column's size) stays where the
    weight is 0, to keep the fit unique where the measurements cannot tell factors apart."""
    return np.array([max(prior_weight / PRIOR_SCALES[j], RIDGE * np.linalg.norm(columns[:, j])) for j in fit])


CONVERGED = 1e-6  # relative gain of a Levenberg-Marquardt step below which the fit stops


def fit_by_simulation(assigned: list[tuple[Assignment, Measurement]], device: DeviceInfo,
                      start: Calibration, iterations: int = 20, prior: Calibration | None = None,
                      prior_weight: float = PRIOR_WEIGHT) -> tuple[Calibration, float]:
    """Polish ``start`` so that the step SIMULATION (not its linearization) meets the
    measured forward and backward phases: Levenberg-Marquardt on relative errors with
    a finite-difference Jacobian, every step box-constrained (``box_lstsq``), each factor
    pulled toward ``prior`` (default ``start``; [Note: the prior pull]); the factors
    fitted are those ``fit_factors`` fits. A step is taken only if it lowers the error;
    the fit stops when none does, or when one gains less than ``CONVERGED`` of it.
    Returns the factors and the sum of squared residuals (phases and pulls)."""
    measured = np.array([m.phase_s(p) for _, m in assigned for p in ("forward", "backward")])
    prior = prior or start
    center = np.array([getattr(prior, n) for n in FACTORS], dtype=np.float64)
    pulls = np.array([prior_weight / s for s in PRIOR_SCALES])

    def residuals(x) -> np.ndarray:
        cal = replace(start, **{n: float(v) for n, v in zip(FACTORS, x)})
        dev = device.with_(calibration=cal)
        out = []
        for a, _ in assigned:
            sim = simulate(a, dev)
            out += [sim.phases["forward"].duration_s, sim.phases["backward"].duration_s]
        return np.concatenate([np.array(out) / measured - 1.0, (pulls * (x - center))[fit]])

    rows = [row for a, m in assigned for row in phase_terms(a, device.with_(calibration=start), m)]
    columns = np.array([[r.forward_compute_s, r.backward_compute_s, r.unit_uses, r.hidden_s,
                         r.waited_s + r.hidden_s] for r in rows])
    fit = _fitted(columns, len(rows), prior_weight)
    x = np.array([getattr(start, n) for n in FACTORS], dtype=np.float64)
    if not fit:
        return start, float(residuals(x) @ residuals(x))
    lo, hi = np.array([BOUNDS[j][0] for j in fit]), np.array([BOUNDS[j][1] for j in fit])
    r = residuals(x)
    cost, damping = float(r @ r), 1e-3
    for _ in range(iterations):
        before = cost
        jac = np.zeros((len(r), len(fit)))
        for c, j in enumerate(fit):
            h = 1e-4 * max(abs(x[j]), 1e-2 if j != 2 else 1e-5)
            step = h if x[j] + h <= BOUNDS[j][1] else -h
            xh = x.copy()
            xh[j] += step
            jac[:, c] = (residuals(xh) - r) / step
        scale = np.maximum(np.linalg.norm(jac, axis=0), 1e-12)
        improved = False
        while damping < 1e6:
            a = np.vstack([jac, np.diag(np.sqrt(damping) * scale)])
            b = np.concatenate([-r, np.zeros(len(fit))])
            d = box_lstsq(a, b, lo - x[fit], hi - x[fit])
            if d is None:
                break
            trial = x.copy()
            trial[fit] = np.clip(x[fit] + d, lo, hi)
            rt = residuals(trial)
            if float(rt @ rt) < cost:
                x, r, cost, improved = trial, rt, float(rt @ rt), True
                damping = max(damping / 10, 1e-9)
                break
            damping *= 10
        # converged: a step that gains less than CONVERGED of the error moves the
        # factors in their fifth digit (bench/fidelity.py's fits: 4-6 steps, not 20)
        if not improved or cost < 1e-20 or before - cost <= CONVERGED * before:
            break
    return replace(start, **{n: float(v) for n, v in zip(FACTORS, x)}), cost


def fit_memory(observations: list[tuple[Assignment, Measurement]], device: DeviceInfo) -> float:
    """The largest (measured - predicted) peak over the measured plans, bytes."""
    deltas = []
    for a, m in observations:
        t = replace(a.template, device=device)
        predicted = evaluate(t, a.batch, a.option_index, a.variant).peak_bytes
        deltas.append(m.peak_bytes - predicted)
    return max(deltas, default=0.0)


def fit_optimizer(observations: list[tuple[Assignment, Measurement]], device: DeviceInfo) -> float:
    """Memory bandwidth that makes the optimizer phase take what it measured (median
    over the plans; the optimizer does the same work in every plan)."""
    ratios = []
    for a, m in observations:
        predicted = optimizer_step_s(a.template.desc, device, a.template.settings)
        if predicted > 0 and m.optimizer_s > 0:
            ratios.append(predicted / m.optimizer_s)
    if not ratios:
        return device.memory_bandwidth_bytes_per_s
    return device.memory_bandwidth_bytes_per_s * float(np.median(ratios))


def apply(device: DeviceInfo, calibration: Calibration, memory_delta_bytes: float = 0.0,
          memory_bandwidth_bytes_per_s: float | None = None) -> DeviceInfo:
    """``device`` with ``calibration`` and the learned memory constant (never below 0)."""
    constant = max(0.0, device.constant_bytes + memory_delta_bytes)
    learned = calibration.memory_constant_bytes + (constant - device.constant_bytes)
    return device.with_(calibration=replace(calibration, memory_constant_bytes=learned), constant_bytes=constant,
                        memory_bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s)


def refit(desc: ModelDesc, device: DeviceInfo, observations: list[tuple[object, Measurement]],
          rounds: int = FIT_ROUNDS, prior_weight: float = PRIOR_WEIGHT) -> DeviceInfo:
    """``device`` with every factor refitted to ``observations`` ((plan, measurement)
    pairs; see [Note: what the profiler fits]), each pulled toward ``device``'s own
    calibration ([Note: the prior pull]; 0: an exact fit of as many factors as phases)."""
    assigned = [(assignment_of(desc, device, plan), m) for plan, m in observations]
    calibration = device.calibration
    bandwidth = fit_optimizer(assigned, device)
    fitted = device.with_(memory_bandwidth_bytes_per_s=bandwidth)
    for _ in range(rounds):
        rows = [row for a, m in assigned for row in phase_terms(a, fitted, m)]
        calibration = fit_factors(rows, device.calibration, prior_weight)  # W and H at the last fit
        fitted = fitted.with_(calibration=calibration)
    # polished from the linear fit and from the prior; the better one is kept
    tries = [fit_by_simulation(assigned, fitted, start, prior=device.calibration, prior_weight=prior_weight)
             for start in (calibration, device.calibration)]
    calibration = min(tries, key=lambda pair: pair[1])[0]
    fitted = fitted.with_(calibration=calibration)
    sources = "; ".join(f"{plan.model_name} batch {m.batch_size}: measured step {m.step_s * 1e3:.1f} ms"
                        for plan, m in observations)
    calibration = replace(calibration, source=f"fitted by osdp.planner.calibration.refit to {sources}")
    return apply(device.with_(memory_bandwidth_bytes_per_s=bandwidth), calibration, fit_memory(assigned, fitted))


def predicted_step_s(plan) -> float:
    """What a plan predicts for its step: the simulated step when it has one."""
    p = plan.predicted
    return p.simulated_step_s if p.simulated_step_s is not None else p.step_s


def reasons_to_refit(plan, measured: Measurement, margin_fraction: float,
                     tolerance: float = STEP_TOLERANCE) -> list[str]:
    """Why the model must be refitted (empty: it predicted this plan well enough):
    step time off by more than ``tolerance``, or the measured peak within
    ``margin_fraction`` of the limit (or over it)."""
    reasons = []
    predicted = predicted_step_s(plan)
    error = predicted / measured.step_s - 1
    if abs(error) > tolerance:
        reasons.append(f"step time predicted {predicted * 1e3:.1f} ms, measured {measured.step_s * 1e3:.1f} ms "
                       f"({error:+.1%}, more than {tolerance:.0%} off)")
    limit = plan.memory_limit_bytes
    if measured.peak_bytes > limit * (1 - margin_fraction):
        reasons.append(f"measured peak {format_bytes(measured.peak_bytes)} is within {margin_fraction:.0%} of the "
                       f"limit {format_bytes(limit)}")
    return reasons


def better(first: tuple[object, Measurement], second: tuple[object, Measurement], margin_fraction: float):
    """The better of two measured plans: one whose measured peak stays below the limit
    less the margin over one that does not, then the most measured samples/s; ties keep
    ``first``."""
    def key(pair):
        plan, m = pair
        fits = m.peak_bytes <= plan.memory_limit_bytes * (1 - margin_fraction)
        return (fits, m.samples_per_s(plan.world_size, plan.accumulation_steps))

    return second if key(second) > key(first) else first


def predicted_phases(plan) -> dict:
    """Predicted seconds per phase of a plan ({} when it was not simulated)."""
    return dict(getattr(plan.predicted, "phases", None) or {})


def group_of(name: str) -> str:
    """A unit's group: its module path with layer indices as ``*`` (``blocks.*.mlp.fc``)."""
    name = re.sub(r"\[\d+\]$", "", name)
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


def predicted_groups(a: Assignment, device: DeviceInfo) -> dict[str, float]:
    """Predicted forward seconds per unit group: each forward compute of the simulated
    step with the waits for communication just before it."""
    sim = simulate_step_timeline(a, device)
    out: dict[str, float] = {}
    pending = 0.0
    for ev in sim.timeline:
        if ev.resource != "compute" or ev.phase != "forward" or ev.micro_batch != 0:
            continue
        if ev.kind == "wait":
            pending += ev.end_s - ev.start_s
        elif ev.kind == "forward":
            g = group_of(ev.what)
            out[g] = out.get(g, 0.0) + ev.end_s - ev.start_s + pending
            pending = 0.0
    return out


def simulate_step_timeline(a: Assignment, device: DeviceInfo):
    return simulate_step(replace(a.template, device=device), a.batch, a.option_index, a.variant, timeline=True)


def format_report(plan) -> str:
    """Predicted beside measured, per phase and per unit group (``OSDP.report()``)."""
    if plan is None:
        return "no plan: nothing was predicted (OSDP was given modes by hand)"
    info = plan.calibration  # a CalibrationRecord ([Note: calibration record])
    measured = plan.measured or {}
    phases = info.predicted_phases or predicted_phases(plan)
    step = info.predicted_step_s or predicted_step_s(plan)
    lines = [f"OSDP report for {plan.model_name}: batch {plan.batch_size}/device, world size {plan.world_size}"]
    if info.decision:
        lines.append(f"  calibration: {info.decision}")
    for reason in info.reasons or ():
        lines.append(f"    why: {reason}")
    choice = info.measured_choice or {}
    if choice.get("candidates"):
        kept = next((c for c in choice["candidates"] if c["plan"] == choice.get("kept")), None)
        if kept is not None and kept is not choice["candidates"][0]:
            lines.append(f"  measured choice: kept another plan (batch {kept['batch_size']}, "
                         f"{kept['samples_per_s']:.2f} samples/s measured) of {len(choice['candidates'])} measured; "
                         "predictions below are its own")
        elif kept is not None:
            lines.append(f"  measured choice: kept this plan, the best of {len(choice['candidates'])} measured")
    if info.factors:
        f = {**asdict(Calibration()), **info.factors}
        lines.append(f"  fitted: compute scale {f['compute_scale']:.3f} forward, "
                     f"{f['backward_compute_scale']:.3f} backward, unit overhead {f['unit_overhead_s'] * 1e6:.1f} us, "
                     f"overlap efficiency {f['overlap_efficiency']:.2f}, comm scale {f['comm_scale']:.2f}, learned memory constant "
                     f"{format_bytes(f['memory_constant_bytes'])}")
    if not measured:
        lines.append("  not measured (plans made with calibrate=True in auto mode carry a measurement)")
    if info.compiled:  # [Note: compiled plans] in osdp/compiled_choice.py
        lines += _compiled_lines(info.compiled, measured)

    def row(name, pred, meas):
        p = f"{pred * 1e3:10.2f}" if pred is not None else f"{'-':>10}"
        m = f"{meas * 1e3:10.2f}" if meas is not None else f"{'-':>10}"
        err = f"{pred / meas - 1:+8.1%}" if pred is not None and meas else f"{'':>8}"
        return f"  {name:<30} {p} {m} {err}"

    lines.append(f"  {'phase (ms per step)':<30} {'predicted':>10} {'measured':>10} {'error':>8}")
    for phase in PHASES:
        lines.append(row(phase, phases.get(phase), measured.get(f"{phase}_s")))
    lines.append(row("step", step, measured.get("step_s")))
    peak = measured.get("peak_bytes")
    lines.append(f"  {'peak memory':<30} {format_bytes(plan.predicted.peak_bytes):>10} "
                 f"{format_bytes(peak) if peak is not None else '-':>10} "
                 + (f"{plan.predicted.peak_bytes / peak - 1:+8.1%}" if peak else "")
                 + f"   (limit {format_bytes(plan.memory_limit_bytes)})")
    groups_p = info.predicted_groups or {}
    groups_m = measured.get("groups") or {}
    if groups_p or groups_m:
        lines.append(f"  {'unit group (forward ms)':<30} {'predicted':>10} {'measured':>10} {'error':>8}")
        for g in sorted(set(groups_p) | set(groups_m)):
            lines.append(row(g, groups_p.get(g), groups_m.get(g)))
    return "\n".join(lines)


def predictions(desc: ModelDesc, device: DeviceInfo, plan) -> dict:
    """Predicted seconds per phase and per unit group of ``plan`` on ``device``, as a
    plan's calibration record keeps them."""
    try:
        a = assignment_of(desc, device, plan)
        sim = simulate(a, device)
        return {"predicted_phases": {k: v.duration_s for k, v in sim.phases.items()},
                "predicted_step_s": sim.step_s,
                "predicted_groups": predicted_groups(a, device)}
    except OSDPError as exc:
        return {"predicted_error": str(exc)}


def _compiled_lines(compiled: dict, measured: dict) -> list[str]:
    """The report's lines on the compiled steps: the kept plan's, and the compiled choice
    between the finalists ([Note: compiled plans] in osdp/compiled_choice.py)."""
    eager = compiled.get("eager_step_s")
    line = f"  compiled ({compiled.get('scope', '?')}): step {compiled['step_s'] * 1e3:.2f} ms measured"
    if eager:
        # the eager step is the measured choice's trial, taken minutes before the compiled
        # ones on another load: no ratio of the two (one run printed 1.61x from an eager
        # outlier); bench/compile_phases.py times them side by side
        line += f" (eager, in the measured choice, earlier: {eager * 1e3:.2f} ms)"
    if "first_step_s" in compiled:
        line += f"; first step (compiling) {compiled['first_step_s']:.1f} s"
    line += "; the rows below are compiled steps" if measured.get("compiled") else "; the rows below are eager"
    lines = [line]
    if "predicted_step_s" in compiled:
        lines.append(f"  fitted to the compiled steps: compute scale {compiled['compute_scale']:.3f} forward, "
                     f"{compiled['backward_compute_scale']:.3f} backward (eager: "
                     f"{compiled['eager_compute_scale']:.3f}, {compiled['eager_backward_compute_scale']:.3f}); "
                     f"compiled step predicted {compiled['predicted_step_s'] * 1e3:.2f} ms "
                     f"({compiled['predicted_step_s'] / compiled['step_s'] - 1:+.1%})")
    finalists = compiled.get("finalists") or []
    if len(finalists) > 1:
        kept = next((f for f in finalists if f["plan"] == compiled.get("kept")), finalists[0])
        which = "the eager pick" if kept is finalists[0] else "a plan other than the eager pick"
        others = ", ".join(f"batch {f['batch_size']}: {f['samples_per_s']:.2f} compiled, "
                           f"{f['eager_samples_per_s']:.2f} eager" for f in finalists if f is not kept)
        lines.append(f"  compiled choice: kept {which} (batch {kept['batch_size']}: {kept['samples_per_s']:.2f} "
                     f"samples/s compiled, {kept['eager_samples_per_s']:.2f} eager) over {others}")
    return lines
