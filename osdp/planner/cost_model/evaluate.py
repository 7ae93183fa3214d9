"""``evaluate``: one concrete plan's predicted step time and peak bytes (``Estimate``),
the peak being at an op, at the end of backward or at the optimizer step (docs/design/cost_model.md's [Note:
time model] and [Note: memory model])."""
from __future__ import annotations

from dataclasses import dataclass

from .end_of_backward import after_ops_moments
from .memory import live_memory
from .template import ProblemTemplate
from .timing import option_times, template_optimizer_s

OPTIMIZER_STEP = "optimizer step"  # Estimate.peak_op when the step is the peak
END_OF_BACKWARD = "end of backward"  # ... when the end of backward is ([Note: end of backward moment])


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one plan at one batch size, in exact bytes."""

    step_s: float
    peak_bytes: float
    peak_op: str  # name of the op where the peak happens
    breakdown: dict  # name -> bytes at the peak
    fits: bool

    def samples_per_s(self, batch: int, world_size: int) -> float:
        return batch * world_size / self.step_s


def evaluate(
    template: ProblemTemplate,
    batch: int,
    option_index,
    variant,
    exact: bool = True,
) -> Estimate:
    """Price a concrete plan given as option indices (per op) and variants (per segment)
    of the template, with exact bytes (no quantization) and the plan's own gathers
    ([Note: exact gathers]; ``exact=False``: the window's bound, as the search counts)."""
    t = template
    times = option_times(t, batch)
    rows = live_memory(t, batch, option_index, variant, exact=exact)
    total_s = template_optimizer_s(t) + float(sum(times[o] for o in option_index))
    peak_i, breakdown = max(rows, key=lambda row: sum(row[1].values()))
    peak_op = t.desc.ops[peak_i].name
    for moment, parts in zip((OPTIMIZER_STEP, END_OF_BACKWARD), after_ops_moments(t, batch)):  # the fixed moments
        if sum(parts.values()) > sum(breakdown.values()):
            peak_op, breakdown = moment, dict(parts)
    peak = sum(breakdown.values())
    return Estimate(
        step_s=float(total_s),
        peak_bytes=float(peak),
        peak_op=peak_op,
        breakdown=breakdown,
        fits=peak <= t.device.memory_limit_bytes,
    )
