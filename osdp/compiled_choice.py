"""[Note: compiled plans]: auto mode with ``compile=`` chooses among its best eager
plans by their compiled steps."""
from __future__ import annotations

from dataclasses import replace

from .measured_choice import calibrated_device, faster_within_limit, same_schedule
from .planner import calibration as cal
from .planner.calibration import Measurement
from .planner.plan import Plan
from .rank_agreement import decide_on_rank0

COMPILED_FINALISTS = 2  # plans measured compiled: the eager pick and the best other schedule
FINALIST_MARGIN = 0.15  # of the eager pick's samples/s: how far behind a finalist may be


def _samples_per_s(plan: Plan, m: Measurement) -> float:
    return m.samples_per_s(plan.world_size, plan.accumulation_steps)


def finalists(plan: Plan, eager: Measurement, measured, most: int = COMPILED_FINALISTS,
              margin: float = FINALIST_MARGIN) -> list[tuple[Plan, Measurement]]:
    """``(plan, eager)`` first, then the fastest of ``measured`` ((plan, eager
    measurement) pairs) that fit their limit, each of a schedule not taken yet
    (``same_schedule``: between two batches of one schedule the larger is kept anyway)
    and within ``margin`` of the pick's samples/s, ``most`` in all."""
    out = [(plan, eager)]
    floor = (1 - margin) * _samples_per_s(plan, eager)
    for p, m in sorted(measured, key=lambda pair: -_samples_per_s(*pair)):
        if len(out) >= most or _samples_per_s(p, m) < floor:
            break
        if m.peak_bytes <= p.memory_limit_bytes and not any(same_schedule(p, q) for q, _ in out):
            out.append((p, m))
    return out


def compiled_choice(desc, device, plan: Plan, measured, measure, *, process_group=None) -> Plan:
    """[Note: compiled plans]
    Auto mode with ``compile=`` calibrates and chooses on eager steps, as without it
    ([Note: calibrate and re-plan], [Note: measured choice]; the cost model prices the
    eager runtime), then measures its finalists compiled and keeps the one fastest
    compiled: the eager pick and the fastest plan of another schedule measured within
    FINALIST_MARGIN of it (``finalists``; ``measured``: the measured choice's (plan,
    eager measurement) pairs). Compiling changes what a plan costs unevenly: compute
    fuses (more where elementwise work weighs), and a compiled backward hands out a
    graph's gradients at its end, so ``rep`` units' all-reduce overlaps less ([Note: rep
    gradients bucketed] in osdp/runtime/compiled_rep_grads.py).

    Each finalist is measured compiled and then eager, one trial right after the other
    ([Note: one trial at a time]), and its compiled samples/s is estimated as its eager
    samples/s in the measured choice times that compile gain (compiled over eager,
    measured side by side): the finalists' own trials run minutes apart, and a shared
    machine's load drifts more than that gain between them, where the choice's eager
    measurements were taken side by side. Measured: a W&S run whose trials found all zdp
    at batch 19 13.9 samples/s compiled against 18.2 eager (0.76x) kept all rep at batch
    9 (16.9 compiled); the same zdp plan measured compiled and eager side by side ran
    1.03x (2026-11-28, 2 gloo ranks, 2-core CPU). The estimates decide, by
    ``faster_within_limit``. A compiled trial's first step compiles: COMPILED_FINALISTS
    compiles and as many eager trials, outside the planning budget (which the eager work
    spends as it would without ``compile=``; [Note: planning budget]).

    Until 2026-11-28 every plan auto mode measured was measured compiled (calibration's
    references, the plan, the re-plan, the measured choice's alternatives) and the
    factors fitted to compiled steps: each compile came out of the budget. Measured (W&S
    2x768 at bench/compile.py's middle budget, 2 gloo ranks, 2-core CPU, the default 60 s
    budget, scope "model"): 160 s in auto mode, the three references' compiles spent the
    budget, the batch was capped at 10 (uncapped: 19) and no alternative was measured;
    it picked 6 dp + 10 rep units at batch 10, 17.2 samples/s compiled, where eager auto
    mode picked every unit zdp at batch 20 (19.2 samples/s eager).

    Where a compiled step's peak is not measured (CPU: the live-tensor tracker cannot see
    inside compiled code), the eager trial's peak stands for it (``peak_source`` says
    so): a compiled step's activations may differ, unmeasured there. The plan handed out
    keeps its eager measurement (``plan.measured``, beside the eager predictions);
    ``plan.calibration.compiled`` records its compiled step, the eager step beside it,
    the first (compiling) step and every finalist, for ``model.report()``. Rank 0
    decides; every rank measures."""
    group = process_group
    eager = Measurement.from_dict(plan.measured)
    picked = decide_on_rank0(lambda: [(p.to_dict(), m.to_dict()) for p, m in finalists(plan, eager, measured)[1:]],
                             group)
    pairs = [(plan, eager)] + [(Plan.from_dict(p), Measurement.from_dict(m)) for p, m in picked]
    beside = measure.compiled([p for p, _ in pairs])  # (compiled, eager) per finalist, side by side
    estimated = [replace(c, step_s=e.step_s * c.step_s / b.step_s) for (_, e), (c, b) in zip(pairs, beside)]
    best = 0
    for k in range(1, len(pairs)):
        if faster_within_limit((pairs[best][0], estimated[best]), (pairs[k][0], estimated[k]))[0] is pairs[k][0]:
            best = k
    chosen, chosen_eager = pairs[best]
    rows = [{"plan": p.plan_hash(), "batch_size": p.batch_size, "eager_samples_per_s": _samples_per_s(p, e),
             "samples_per_s": _samples_per_s(p, c), "gain": b.step_s / c.step_s,
             "estimated_samples_per_s": _samples_per_s(p, x), "peak_bytes": c.peak_bytes}
            for (p, e), (c, b), x in zip(pairs, beside, estimated)]
    record = {"scope": measure.compile.scope, "step_s": beside[best][0].step_s, "eager_step_s": beside[best][1].step_s,
              "first_step_s": measure.first_compiled_step_s[chosen.plan_hash()], "finalists": rows,
              "kept": chosen.plan_hash()}
    if best == 0:
        return replace(plan, calibration=plan.calibration.with_(compiled=record))
    predictions = cal.predictions(desc, calibrated_device(device, plan), chosen)
    return replace(chosen, measured=chosen_eager.to_dict(),
                   calibration=plan.calibration.with_(compiled=record, **predictions))
