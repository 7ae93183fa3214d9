"""The cost model: what every choice costs in time and memory. Single source of truth.

Search, batch scheduler, plan reports and the runtime's prefetch window all read it.
``ProblemTemplate`` holds the batch-independent part of every option; ``problem(b)``
turns it into the search's option tables at batch b; ``evaluate`` prices one concrete
plan with exact (unquantized) bytes and says where its peak is. The design notes ([Note:
time model], [Note: memory model], ...) are in docs/design/cost_model.md.

Modules, each one job, in import order (each imports only those above it, and
step_sim.py imports only from those above memory.py: memory.py imports step_sim):
    settings        PlannerSettings and the choices it allows
    unit_bytes      an op's bytes at rest, gathered, reduced; activations, logits
    units           unit owners, tied uses, whether backward reads the weights
    replicate       rep units: buckets, all-reduce shares, gradient bytes
    static          bytes every plan pays; the optimizer step's moment
    timing          compute fits, shared latency, option times, the optimizer's time
    prefetch        the prefetch window and what fits ahead of each op
    options         an op's option rows (OptionRow); gradient reductions pending, sharded grads
    end_of_backward the end of backward's moment (what the reductions leave to the end)
    problem         the search's problem at one batch
    template        ProblemTemplate and build_template
    tied_templates  tied units: sub-templates per joint choice, aligned uses
    memory          a plan's live bytes per op, with its exact gathers
    evaluate        a plan's Estimate: step time and peak
This package re-exports their public names, so ``from osdp.planner.cost_model import X``
works for all.
"""
from __future__ import annotations

from .settings import (CHECKPOINTING, OPTIMIZER_TEMPORARIES, POLICIES, PlannerSettings, layout_collectives,
                       mode_choices, reshard_choices, slice_choices)
from .unit_bytes import activation_scale, element_bytes, fused_logits_bytes, gathered_bytes, reduced_bytes
from .units import backward_needs_weights, tied_grads_bytes, tied_groups, unit_indices
from .replicate import (rep_is_direct, rep_op_mask, rep_unit_names, replicate_buckets, replicate_reduce_s,
                        replicated_grads_bytes)
from .static import LOSS_SCALARS_BYTES, optimizer_step_bytes, static_bytes
from .timing import (option_times, coalesced_latency_shares, option_compute_s, option_unit_uses, optimizer_step_s,
                     shape_key, split_efficiency, template_optimizer_s)
from .prefetch import WINDOW_BUDGET_SHARE, prefetch_window
from .options import OptionRow, pending_reduce_bytes, sharded_grads_after
from .end_of_backward import end_of_backward_bytes
from .problem import option_local_bytes
from .template import ProblemTemplate, build_template, restrict_template
from .tied_templates import align_tied, tied_choices
from .memory import exact_transients, live_memory
from .evaluate import END_OF_BACKWARD, OPTIMIZER_STEP, Estimate, evaluate

__all__ = [
    "CHECKPOINTING", "END_OF_BACKWARD", "Estimate", "LOSS_SCALARS_BYTES", "OPTIMIZER_STEP",
    "OPTIMIZER_TEMPORARIES", "OptionRow", "POLICIES", "PlannerSettings", "ProblemTemplate", "WINDOW_BUDGET_SHARE",
    "activation_scale", "align_tied", "backward_needs_weights", "build_template", "coalesced_latency_shares",
    "element_bytes", "end_of_backward_bytes", "evaluate", "exact_transients", "fused_logits_bytes",
    "gathered_bytes", "layout_collectives", "live_memory", "mode_choices", "option_compute_s", "option_times",
    "option_local_bytes", "option_unit_uses", "optimizer_step_bytes", "optimizer_step_s", "pending_reduce_bytes",
    "prefetch_window", "reduced_bytes", "rep_is_direct", "rep_op_mask", "rep_unit_names", "replicate_buckets",
    "replicate_reduce_s", "replicated_grads_bytes", "reshard_choices", "restrict_template", "shape_key",
    "sharded_grads_after", "slice_choices", "split_efficiency", "static_bytes", "template_optimizer_s",
    "tied_choices", "tied_grads_bytes", "tied_groups", "unit_indices",
]
