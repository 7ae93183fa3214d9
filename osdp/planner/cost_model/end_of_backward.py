"""The end of backward's moment: the bytes live while the runtime reduces what backward
left (docs/design/cost_model.md's [Note: memory model]; [Note: end of backward moment]
here), the same for every plan, like the optimizer step's (static.py)."""
from __future__ import annotations

from ..device import DeviceInfo
from ..model_desc import ModelDesc
from .options import _coalesced_copies, reduction_walk
from .replicate import rep_op_mask, replicated_grads_at_end
from .settings import PlannerSettings, layout_collectives
from .static import after_backward_bytes


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
