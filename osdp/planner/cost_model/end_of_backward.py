"""The end of backward's moment: the bytes live while the runtime reduces what backward
left (docs/design/cost_model.md's [Note: memory model]; [Note: end of backward moment]
here), the same for every plan, like the optimizer step's (static.py); and the output a
loop holds through both ([Note: the held output]).

[Note: the held output]
A training loop holds the model's output through backward and the optimizer step
(``out = model(**batch); out.loss.backward(); optim.step()``), and the planner prices
that loop ([Note: example inputs and the loss] in osdp/planner/inputs.py). Inside
backward the held tensors are in describe's measured transients (its loss holds the
output); the moments after the ops' are priced, not measured, and used to leave them
out: a stock Llama (2 layers, hidden 32, vocabulary 100, all rep, 2 gloo ranks, batch 2)
measured 515756 B at its end of backward against 499964 predicted (+3.2%), the 15.8 kB
its output held (logits and the returned key/value cache). describe now measures the
bytes still alive once backward is over beside the parameters, gradients, buffers and
inputs (``ModelDesc.output_bytes_per_sample``: what grows with the batch), and both
moments add them at the plan's batch (in the compute dtype, as activations)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..device import DeviceInfo
from ..model_desc import ModelDesc
from .options import _coalesced_copies, reduction_walk
from .replicate import rep_op_mask, replicated_grads_at_end
from .settings import PlannerSettings, layout_collectives
from .static import after_backward_bytes
from .unit_bytes import activation_scale

if TYPE_CHECKING:  # annotations only: template.py imports this module
    from .template import ProblemTemplate


def end_of_backward_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """[Note: end of backward moment] The bytes live when backward's last op is done and
    the runtime issues what is left (``GradReducer.finish``), by category: the small
    units' gradients still waiting are reduced in one group (with its two copies,
    ``_coalesced_copies``) beside the reduction in flight, which is then waited for;
    then the last bucket of rep units is issued (its staging copy beside its buffers).
    No gathered weight or activation is left, every sharded gradient is there (those in
    flight as their outputs); the rep units' gradients as ``replicated_grads_at_end``.
    The larger of the two moments, the same for every plan: the reduction in flight is
    priced at its smallest (``ReductionsAtEnd``), since whether its op is split is the
    plan's choice; unsplit, that op's own backward moment holds more than it adds here
    (its buffer and autograd's gradient beside the reduction in flight). Without it, a small
    Llama whose units all coalesce (2 ranks, 64 KiB groups) measured 21% over its
    prediction at this moment: its last group, the one before it still in flight and
    their copies."""
    n = layout_collectives(device, settings).shard_ranks
    persist = not settings.grads_set_to_none
    rep = rep_op_mask(desc, settings)
    parts = after_backward_bytes(desc, device, settings)
    end = reduction_walk(desc, device, settings, rep).end
    last = end.in_flight + (end.in_flight_out if persist else 0.0)
    final = (end.waiting + _coalesced_copies(end.waiting, end.waiting_out, n) + (end.waiting_out if persist else 0.0)
             if end.waiting else 0.0)
    rep_before, rep_after = replicated_grads_at_end(desc, settings, rep)
    reductions, rep_grads = max(((last + final, rep_before), (final or last, rep_after)), key=sum)
    if reductions:
        parts["reductions_in_flight"] = reductions
    if rep_grads:
        parts["replicated_grads"] = parts.get("replicated_grads", 0.0) + rep_grads
    return parts


def after_ops_moments(t: ProblemTemplate, batch: int) -> tuple[dict[str, float], dict[str, float]]:
    """The optimizer step's bytes and the end of backward's at ``batch``, by category: the
    template's, with the output the loop holds ([Note: the held output])."""
    held = t.desc.output_bytes_per_sample * batch * activation_scale(t.desc, t.settings)
    extra = {"held_output": float(held)} if held else {}
    return {**t.step_bytes, **extra}, {**t.end_bytes, **extra}
