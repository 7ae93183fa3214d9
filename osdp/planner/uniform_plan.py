"""``uniform_plan``: one shape for every unit (all dp, all zdp, every splittable op in g
slices), priced by the cost model like a searched plan. Calibration measures such plans
as references ([Note: calibrate and re-plan] in osdp/auto.py), bench/fidelity.py
predicts them beside their measurement."""
from __future__ import annotations

from .cost_model import PlannerSettings, build_template
from .model_desc import ModelDesc
from .device import DeviceInfo
from .batch_sweep import finish_schedule
from .plan import Plan
from .planner import plan_from_schedule
from .search import evaluate_assignment
from .search_problem import SearchResult


def uniform_plan(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings, batch: int, *,
                 slices: int = 1, zdp_slices: int = 1, checkpointed: bool = False, rep_units=()) -> Plan:
    """Every op at ``slices`` slices with ``zdp_slices`` of them zdp (the rest dp); an op
    its split op cannot cut in ``slices`` stays whole with ``min(zdp_slices, 1)`` zdp
    slices. Every block is checkpointed if ``checkpointed``, none otherwise; the units
    ``rep_units`` rep (a model that runs only so: a weight read outside its unit), no
    others; ``settings`` give the rest (mixed precision, layout, window). Its
    predictions are the cost model's for exactly this assignment."""
    if slices < 1 or not 0 <= zdp_slices <= slices:
        raise ValueError(f"zdp_slices must be in [0, slices={slices}], got {zdp_slices}")
    settings = settings.with_(policy="osdp", rep_units=tuple(rep_units),
                              checkpointing="all" if checkpointed else "none",
                              max_slices=max(slices, settings.max_slices), split_small_units=True)
    t = build_template(desc, device, settings)
    whole = (1, min(zdp_slices, 1))
    choice = []
    for i, op in enumerate(desc.ops):
        options = range(t.opt_begin[i, 0], t.opt_end[i, 0])
        offered = {int(t.opt_slices[o]) for o in options}
        want = (slices, zdp_slices) if slices in offered else whole
        match = [o for o in options if t.shape(o) == (*want, 0)]
        # a tied use runs its owner's choice; a use whose backward reads no weights (a
        # row-split embedding) has one option per slice count: both modes free its slices
        match = match or [o for o in options if int(t.opt_slices[o]) == want[0]]
        choice.append(match[0])
    variant = [0] * len(t.segments)  # one variant per segment: checkpointed or not, as asked
    _, time_s, peak, peak_op = evaluate_assignment(t.problem(batch), choice, variant)
    result = SearchResult(True, time_s, peak, peak_op, tuple(choice), tuple(variant))
    return plan_from_schedule(finish_schedule(t, batch, result, 0, 0.0))
