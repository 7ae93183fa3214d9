"""The cost model: what every choice costs in time and memory. Single source of truth.

Search, batch scheduler, plan reports and the runtime's prefetch window all read it.
``ProblemTemplate`` holds the batch-independent part of every option; ``problem(b)``
turns it into the search's option tables at batch b; ``evaluate`` prices one concrete
plan with exact (unquantized) bytes and says where its peak is.

[Note: time model]
Per op and option (g slices, k of them ``zdp``), with N ranks and ring collectives
AG(x) = (N-1) a_ag + (N-1)/N x b_ag, RS likewise:
    forward  comm = g * AG(P/g)                      (every slice is gathered once)
    backward comm = k * AG(P/g) * (2 if the block is checkpointed else 1)
                    + g * RS(G/g)                    (grads of every slice)
    forward  compute = fit(b) * split_efficiency(g) + (g-1) * slice_overhead
    backward compute = ratio * forward compute (+ forward compute when checkpointed)
With mixed precision, P is the weights' bytes in param_dtype and G the gradients' in
reduce_dtype. With gradient accumulation over a micro-batches an optimizer step costs
a times the above, or, when gradients are reduce-scattered only after the last
micro-batch, (a - 1) micro-batches without the reduce-scatters plus one with them.
Communication runs on its own stream and is issued ahead of use within the prefetch
window W. Each phase of each op costs max(compute, comm) when the op's slice and the
next unit can both be in flight inside the window (2 P/g <= W), and compute + comm when
they cannot (the gather then waits for the previous buffer to be freed). Taking the
max per op rather than over the whole step is what keeps the objective additive, and
so the search exact; it is pessimistic where a comm-bound op could borrow idle comm
time from a compute-bound neighbour. step_sim.py prices a finished plan as the runtime
schedules it (from these same per-op numbers); make_plan re-ranks a few plans by it.
Small units share one collective's latency per coalesced group, as the runtime issues
them ([Note: coalesced latency]). ``DeviceInfo.calibration`` (fitted from measured steps
of the wrapped model, [Note: what the profiler fits] in calibration.py) scales the
compute, adds the runtime's overhead per unit use, and charges (1 - overlap efficiency)
of the smaller of compute and comm on top of the max; with intercepts and comm >= 0
each term stays of the form the batch sweep's bound needs (time / b never increases).

[Note: memory model]
Static (paid by every plan): the 1/N shards of parameters and optimizer state (in the
model's own dtype: the fp32 master copy under mixed precision; sharded gradients too when
they persist between steps, else they count per op, for the ops whose backward is
done, as they appear when backward reduce-scatters them), the
device's constant bytes and batch-independent saved tensors, and under gradient
accumulation synced at the last micro-batch, every unit's unsharded gradient
accumulator in reduce_dtype. Per op i the
search adds, on top of the prefix of kept weights and saved activations (see
search_problem.py's [Note: the memory constraint]):
    kept weights     (g - k) * P/g                  from its forward to its backward
    in-flight gathers  P/g if P/g > W else min(W, P/g + bytes of the ops around it)
                       (in backward the op's own P/g only if it has zdp slices)
    gradient buffers   unsplit: G + pending + G + G/N (its buffer, the one reduction
                       the runtime keeps in flight, [Note: pending reduction], autograd's
                       gradient, both live until its reduce-scatter is issued, and that
                       reduce-scatter's output); split: per slice in backward
                       order, its buffer, the previous slice still reducing and the
                       slices' reduce-scatter outputs so far ([Note: split backward
                       moments])
    activation grads   b * the op's measured backward transients (describe's
                       [Note: backward transients]; its saved bytes when unknown)
With checkpointing a block keeps only its input; its activations are recomputed and
alive again during its own backward. The model therefore places the peak at the op
where prefix + transient is largest, normally the start of backward, or at the
optimizer step ([Note: optimizer step moment]), the same for every plan.

[Note: the hook moment]
An unsplit op's backward has three moments, with A its saved activations, D autograd's
dW and B + O the unit's buffer and its reduce-scatter's output:
    in autograd's node     prefix (A in it) + D, no B + O yet
    at the runtime's hook  prefix - A + D + B + O: autograd released A when the node
                           ended; the hook copies D into B and issues the reduction
    after the hook         prefix + B + O, D freed; the next non-unit ops' backward
                           (a GELU's, before the previous unit's node) runs here, and
                           describe's measured transients of this op already net A out
                           of it ([Note: backward transients] counts from the prefix)
The model counted prefix + D + B + O: W&S 2x768 all zdp, 2 ranks, 3.4% above the
measured peak at batch 8 (c_proj's hook: its 6 MiB input gone, 9 + 9 + 4.5 MiB there),
and 2.4-3.9% on other wide MLPs. The largest of the three is that less min(A, D, B + O):
each option carries ``release`` = min(D, B + O, what its backward adds over its forward
moment), and its A offsets up to that much (``_local_moments``). Split ops (their
Function issues each slice's reduce-scatter inside its own backward, holding x), tied
units, the head (its logits are [Note: fused vocabulary-split loss]'s) and static
accumulators release nothing. Known gap: on a 2x384 GPT at batch 8 the measured peak
(a GELU's backward after c_proj's hook) is 0.3% above this, the runtime then holding
0.4 MiB more prefetched weights than the window's bound counts.

[Note: hpz mode]
Across nodes (layout "full", n nodes of m ranks: collective_cost.py's [Note: two-level
collective cost]) a slice may also run in ``hpz`` (ZeRO++ hpZ, FSDP2's
``reshard_after_forward=m``): forward gathers it over the whole shard group as ``zdp``
does; after forward the gathered weights are freed but a copy sharded within the node
(P/g/m bytes per rank) is kept until the slice's backward, which gathers from it over
the intra-node link only. Per option (g slices: k ``zdp``, h ``hpz``, g-k-h ``dp``):
    forward  comm = g * AG(P/g)                       (over the shard group)
    backward comm = (k * AG(P/g) + h * AG_node(P/g)) * (2 if checkpointed else 1)
                    + g * GRAD(G/g)
    kept weights  = (g - k - h) * P/g + h * P/(g m)
where AG, AG_node, GRAD are collective_cost.py's ``gather_s``, ``node_gather_s`` and
``grad_s`` (HSDP's gradient all-reduce across replicas included). The resharded slices
of one option share a mode (k = 0 or h = 0): mixing zdp and hpz slices in one op would
square the option count for steps already between hpz and zdp of the neighbours.

[Note: uses and what they declare]
An op's option is priced by what its split op declares (osdp/ops/registry.py), never by
its kind: unsplit (g = 1), a module's backward always reads its weights (the runtime's
hooks gather a zdp unit again); split, it does when ``needs_weights_in_backward``. A use
whose backward reads no weights (a row-split embedding: its backward scatter-adds rows
of dY) gathers its g slices in forward only, frees them after forward in either mode
(so its options are one per g), and has no backward gathers and no kept weights.

[Note: tied weights]
A unit whose weights several ops use (a GPT's tied embedding and head: ``tied_to``) is
one slicing and one mode per slice for all its uses; the search sees each use as an op,
with rows for every (g, k) of the owner's choices, and ``tied_choices`` makes the uses
agree. Per use, with s = P/g:
    kept      (g - k) s at the first use in op order whose backward reads the weights
              (the head, for a GPT: dp slices live from the head's forward to its
              backward); none at the others
    forward   g gathers of s, or k when an earlier use keeps the dp slices
    backward  k gathers when the use reads weights in backward, else none
    reduce    g reduce-scatters of G/g, at the first use (the last in backward)
The slices' gradients are summed over the uses before their reduce-scatter, so the
whole unsharded gradient G lives from the backward of the last use to that of the
first: a choice-independent term at those ops (``tied_grads``, breakdown
"tied_unsharded_grads"), counted in forward too (conservative; the peak, at the start
of backward, holds it).
A use with parameters of its own beside the shared weight (a head's bias) never splits
(describe: the runtime cuts a shared weight only for a use computing with nothing else)
and its own unit runs the owner's mode (``plan_from_schedule``), so that no module mixes
a direct rep unit with a hooked one; its bytes are priced with the owner's mode (static
states; a rep bias in the replicated bucket). Its gathers and kept bytes as a sharded
unit are not priced (a bias beside the weight it follows).

[Note: fused vocabulary-split loss]
The model's vocabulary head (describe's [Note: the vocabulary head]: its last op, whose
output is the logits) declares ``logits_bytes_per_sample`` L: the log-probabilities the
loss saves, as big as the logits. Split along the vocabulary (g > 1; describe only
declares L when the head's split op cuts the vocabulary), the loss is computed slice by
slice with an online log-sum-exp (osdp.ops.split_head_cross_entropy), so per sample:
    saved activations   L (unsplit)        -> 0 (split; a per-token fp32 log-sum-exp
                                              stays, 1/V of L, not counted)
    backward transients 2 L (dlogprobs, dlogits) -> 2 L / g (one slice's logits and
                                              their gradient, recomputed in backward)
These are per-option terms (``opt_logits_per_sample``, ``opt_loss_grad_per_sample``,
``opt_logits_grad_per_sample``; breakdown "logits_and_grads") taken out of the op's
choice-independent activations. Exact because the head is the last op: its saved bytes
are seen by no later op (for a head that is not last, L is not taken out: no saving is
claimed).

Unsplit, the loss's backward runs BEFORE the head's: the saved log-probabilities, their
gradient and the logits' gradient (3 L) are alive while none of the head's weights are
gathered again and none of its gradient buffers exist yet; then the head's backward
holds only the logits' gradient (L) beside its gathers and buffers. So the op's local
bytes are the larger of the two moments (``option_local_bytes``), not their sum
(measured, 2 gloo ranks, N&D 12x128 at batch 10: 3 L = 7.86 MB live at
``_log_softmax_backward_data`` with no head weights; the sum over-counted 2.10 MB, 7%
of the peak). Split and fused, the slices' logits live inside the head's backward,
beside its gathers: the sum.

[Note: rep mode]
A ``rep`` unit is replicated, DDP per unit ([Note: replicated units] in
osdp/contract.py): whole on every rank, never gathered, its gradient all-reduced over
every rank of the run in buckets. Which units are ``rep`` is fixed per template
(``rep_units``: [Note: rep family] in scheduler.py says how the scheduler picks the
sets), because it changes the static bytes, which the search takes as a constant. An op
using a rep unit has ONE option (whole units only: g = 1, nothing gathered or kept).
With P its parameters' bytes in the model's dtype (the master copy), G its gradient's in
reduce_dtype, d the param_dtype's bytes per parameter (mixed precision), e the model's:
    forward  comm = 0;  backward comm = its share of its bucket's all-reduce:
        AR_rate * G + AR_latency / (units in its bucket)
    (``replicate_buckets``: rep units in backward order, each joining after its last use,
    a bucket issued once it holds >= REPLICATE_BUCKET_BYTES, the rest at the end; so a
    bucket's shares add up to its ``all_reduce_s`` (collective_cost.py: over every
    rank, the measured all-reduce where the profile has one, the latency paid once per
    bucket, as small units share theirs in [Note: coalesced latency]); at the owner, the
    last use in backward; like every gradient collective, after the last micro-batch
    only when gradients are reduced only then)
    compute  = the unsplit option's; the calibration's per-unit overhead only where it
               runs on the hook path: a DIRECT rep unit (it computes and reduces in the
               model's dtype, [Note: direct replicated units] in osdp/runtime/direct.py)
               computes with its parameters themselves, no per-use hooks
    static   = P + the optimizer state of all its parameters (instead of the 1/N shards),
               + P for its ``.grad`` where that lives through the step (gradients kept
               between steps, or made by the first of several micro-batches each
               reduced), + P d / e for the kept param_dtype copy under mixed precision
               (``replicated_*`` in ``static_bytes``; the optimizer step reads them too)
    kept     = 0
    transient at the op: the gathers prefetched around it (others'), its own gradient
               buffer G (none under accumulation synced at the last micro-batch: the
               static accumulator; a tied unit's is ``tied_grads``; none for a direct
               unit: its G is autograd's gradient itself, kept as ``.grad``), and the whole
               gradient of the nearest later sharded unit (a reduce-scatter still in
               flight: an upper bound)
    after its backward (choice-independent given the rep set: ``rep_grads``, breakdown
    "replicated_grads"), at op j, for every rep unit whose last use is after j:
        in the bucket being filled: its buffer G (a direct unit's ``.grad``: 0 where
        ``.grad`` is static, autograd adds into it);
        in the newest MAX_INFLIGHT_REPLICATE_BUCKETS buckets issued (maybe in flight):
        G + its part of the staging copy (G) + the ``.grad`` made at the bucket's end
        (P) unless the buffer becomes ``.grad`` (dtypes agree) or ``.grad`` is static;
        in the buckets before them (done, as issuing one more waited for them): its
        ``.grad`` (P, the buffer itself when the dtypes agree), 0 where it is static.
Policy "rep" makes every unit rep: DDP.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field, replace

import numpy as np

from ..contract import DEFAULT_COALESCE_BYTES, MAX_INFLIGHT_REPLICATE_BUCKETS, REPLICATE_BUCKET_BYTES, is_small_unit
from ..errors import OSDPError
from .collective_cost import LAYOUTS, Collectives
from .description import ModelDesc, OpDesc
from .device import DeviceInfo
from .search_problem import SearchProblem

POLICIES = ("osdp", "zdp", "dp", "hpz", "rep")
CHECKPOINTING = ("auto", "none", "all")
# what AdamW's step allocates besides its state ([Note: optimizer step moment])
OPTIMIZER_TEMPORARIES = ("auto", "per_tensor", "foreach", "none")
OPTIMIZER_STEP = "optimizer step"  # Estimate.peak_op when the step is the peak


def _is_number(value, minimum: float) -> bool:
    """A finite real number (not a bool) >= ``minimum``."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= minimum)


@dataclass(frozen=True)
class PlannerSettings:
    """Knobs of the planner. ``policy``: "osdp" searches per-op modes and splits;
    "zdp" is FSDP full-shard (ZeRO-3), "dp" shard-grad-op (ZeRO-2) and "hpz" ZeRO++ hpZ
    (FSDP2 ``reshard_after_forward=node_size``; zdp within one node), all unsplit; "rep"
    is DDP: every unit replicated ([Note: rep mode]).
    ``rep_units`` (policy "osdp" only; the other policies ignore it): None lets the
    scheduler choose which whole units are ``rep`` ([Note: rep family] in scheduler.py);
    a tuple of unit names (module paths of units with parameters; a tied unit by its
    owner) fixes that set, ``()`` plans without ``rep``.
    ``layout``: "full" (one shard group), "hsdp" (shard within a node, replicate
    across nodes) or "auto" (the scheduler plans both and keeps the faster): see
    collective_cost.py's [Note: sharding layouts]."""

    max_slices: int = 16
    policy: str = "osdp"
    checkpointing: str = "none"  # "auto": per block, chosen by the search
    prefetch_bytes: float | None = None  # None: 2 x the largest slice at the finest split
    optimizer_state_bytes_per_param: float = 8.0  # AdamW: two fp32 moments
    # AdamW: its fp32 ``step`` per parameter tensor (on the device on CPU, and on CUDA when
    # fused or capturable; counted always: a few hundred bytes at most)
    optimizer_state_bytes_per_tensor: float = 4.0
    # the step's temporaries ([Note: optimizer step moment]): "per_tensor" (torch's
    # for-loop AdamW, its default off CUDA), "foreach" (its default on CUDA), "none"
    # (fused); "auto": the larger of the first two (auto_plan resolves it from the
    # model's device)
    optimizer_temporaries: str = "auto"
    # mixed precision (like FSDP2's MixedPrecisionPolicy): weights are gathered and used
    # in param_dtype, gradients reduced in reduce_dtype, the sharded master copy and its
    # optimizer state stay in the model's own dtype. None: the model's own dtype.
    param_dtype_bytes: int | None = None
    reduce_dtype_bytes: int | None = None
    # gradient accumulation: micro-batches per optimizer step, and whether gradients are
    # reduce-scattered after every micro-batch ("every") or only after the last one
    # ("last": unsharded accumulators for every unit stay alive across micro-batches)
    accumulation_steps: int = 1
    gradient_sync: str = "last"
    # optimizer.zero_grad(set_to_none=True), PyTorch's default: sharded gradients do not
    # exist at the start of a step and appear as backward reduces them
    grads_set_to_none: bool = True
    backward_compute_ratio: float = 2.0
    memory_tolerance: float = 0.03  # worst-case quantization error / budget
    min_buckets: int = 4096
    max_buckets: int = 65536
    # make_plan re-ranks the search's best plans at its top batch sizes and the baseline
    # configurations by a simulated step (step_sim.py, rerank.py); rerank_batches: how
    # many batch sizes (by the cost model's samples/s) contribute their best plan
    rerank: bool = True
    rerank_batches: int = 3
    layout: str = "full"
    # the runtime's OSDP(coalesce_bytes=...): small units share collectives up to this
    # many bytes ([Note: coalesced latency]); 0: off
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES
    rep_units: tuple[str, ...] | None = None  # see the docstring and [Note: rep mode]

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise OSDPError(f"policy {self.policy!r} unknown; use one of {POLICIES}")
        if self.layout not in LAYOUTS + ("auto",):
            raise OSDPError(f"layout {self.layout!r} unknown; use one of {LAYOUTS + ('auto',)}")
        if self.checkpointing not in CHECKPOINTING:
            raise OSDPError(f"checkpointing {self.checkpointing!r} unknown; use one of {CHECKPOINTING}")
        for name in ("max_slices", "accumulation_steps", "min_buckets", "max_buckets"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                what = {"max_slices": "max slices", "accumulation_steps": "accumulation steps"}.get(name, name)
                raise OSDPError(f"{what} must be a positive integer, got {value!r}")
        if self.min_buckets > self.max_buckets:
            raise OSDPError(f"min_buckets ({self.min_buckets}) must not exceed max_buckets ({self.max_buckets})")
        if self.prefetch_bytes is not None and not _is_number(self.prefetch_bytes, 0):
            raise OSDPError(f"prefetch window must be a number of bytes >= 0 (or None), got {self.prefetch_bytes!r}")
        for name in ("optimizer_state_bytes_per_param", "optimizer_state_bytes_per_tensor", "backward_compute_ratio"):
            if not _is_number(getattr(self, name), 0):
                raise OSDPError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        if not _is_number(self.memory_tolerance, 0) or not 0 < self.memory_tolerance < 1:
            raise OSDPError(f"memory_tolerance must be a fraction of the budget in (0, 1), got {self.memory_tolerance!r}")
        if not isinstance(self.grads_set_to_none, bool):
            raise OSDPError(f"grads_set_to_none must be True or False, got {self.grads_set_to_none!r}")
        for name in ("param_dtype_bytes", "reduce_dtype_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in (1, 2, 4, 8)):
                raise OSDPError(f"{name} must be 1, 2, 4 or 8 bytes, got {value!r}")
        if self.optimizer_temporaries not in OPTIMIZER_TEMPORARIES:
            raise OSDPError(f"optimizer_temporaries must be one of {OPTIMIZER_TEMPORARIES}, "
                            f"got {self.optimizer_temporaries!r}")
        if self.gradient_sync not in ("every", "last"):
            raise OSDPError(f"gradient_sync must be 'every' or 'last', got {self.gradient_sync!r}")
        if isinstance(self.coalesce_bytes, bool) or not isinstance(self.coalesce_bytes, int) or self.coalesce_bytes < 0:
            raise OSDPError(f"coalesce_bytes must be an integer >= 0 (bytes; 0: off), got {self.coalesce_bytes!r}")
        if isinstance(self.rerank_batches, bool) or not isinstance(self.rerank_batches, int) or self.rerank_batches < 1:
            raise OSDPError(f"rerank_batches must be a positive integer, got {self.rerank_batches!r}")
        if self.rep_units is not None:
            if isinstance(self.rep_units, str) or not isinstance(self.rep_units, (list, tuple, set, frozenset)) \
                    or not all(isinstance(n, str) for n in self.rep_units):
                raise OSDPError(f"rep_units must be None or a list of unit names (module paths), got {self.rep_units!r}")
            # one canonical form (a plan's JSON gives a list): equal sets are equal settings
            object.__setattr__(self, "rep_units", tuple(sorted(set(self.rep_units))))

    def with_(self, **changes) -> "PlannerSettings":
        return replace(self, **changes)


def slice_choices(op: OpDesc, settings: PlannerSettings) -> tuple[int, ...]:
    """Granularities g for an op: powers of two up to max_slices and the split axis."""
    if settings.policy != "osdp" or not op.splittable:
        return (1,)
    return tuple(g for g in (1, 2, 4, 8, 16, 32, 64) if g <= settings.max_slices and g <= op.max_slices)


def mode_choices(g: int, settings: PlannerSettings) -> tuple[int, ...]:
    """Numbers k of zdp slices allowed for g slices."""
    if settings.policy == "zdp":
        return (g,)
    if settings.policy in ("dp", "hpz"):
        return (0,)
    return tuple(range(g + 1))


def reshard_choices(g: int, settings: PlannerSettings, hpz: bool) -> tuple[tuple[int, int], ...]:
    """(k zdp, h hpz) slices allowed for g slices; ``hpz``: whether the run offers it
    ([Note: hpz mode]: one reshard mode per option)."""
    if settings.policy == "hpz":
        return ((0, g),) if hpz else ((g, 0),)  # within one node hpZ is ZeRO-3
    pairs = tuple((k, 0) for k in mode_choices(g, settings))
    if hpz and settings.policy == "osdp":
        pairs += tuple((0, h) for h in range(1, g + 1))
    return pairs


def layout_collectives(device: DeviceInfo, settings: PlannerSettings) -> Collectives:
    """The collectives of the run under the settings' layout (a concrete one)."""
    if settings.layout == "auto":
        raise OSDPError('layout "auto" is resolved by the scheduler (it plans "full" and "hsdp"); the cost model '
                        'prices one concrete layout')
    return Collectives(device, settings.layout)


def element_bytes(op: OpDesc) -> float:
    """Bytes per parameter at rest (the model's own dtype: the master copy)."""
    return op.param_bytes / op.param_count if op.param_count else 0.0


def gathered_bytes(op: OpDesc, settings: PlannerSettings) -> float:
    """Bytes of the unit's full weights as gathered and computed with."""
    if settings.param_dtype_bytes is None or not op.param_count:
        return float(op.param_bytes)
    return float(op.param_count * settings.param_dtype_bytes)


def reduced_bytes(op: OpDesc, settings: PlannerSettings) -> float:
    """Bytes of the unit's full gradient as reduce-scattered."""
    return float(op.param_count * (settings.reduce_dtype_bytes or element_bytes(op)))


def unit_indices(desc: ModelDesc) -> list[int]:
    """Ops that own a unit: parameters of their own (a tied use is its owner's unit)."""
    return [i for i, op in enumerate(desc.ops) if op.param_count and not op.tied_to]


def rep_unit_names(desc: ModelDesc, settings: PlannerSettings) -> tuple[str, ...]:
    """The units a plan under ``settings`` runs ``rep`` ([Note: rep mode]): every unit for
    policy "rep", ``settings.rep_units`` for "osdp" (checked against the model), none
    otherwise (and for "osdp" without a set: the scheduler's family fixes one per
    template)."""
    if settings.policy == "rep":
        return tuple(sorted(desc.ops[i].name for i in unit_indices(desc)))
    if settings.policy != "osdp" or not settings.rep_units:
        return ()
    units = {desc.ops[i].name for i in unit_indices(desc)}
    for name in settings.rep_units:
        if name not in units:
            op = next((o for o in desc.ops if o.name == name), None)
            why = (f"it uses the weights of {op.tied_to!r}: name that unit" if op is not None and op.tied_to else
                   "it has no parameters" if op is not None else f"model {desc.name!r} has no unit of that name")
            raise OSDPError(f"rep_units names {name!r}, which is not a unit: {why}")
    return settings.rep_units


def rep_op_mask(desc: ModelDesc, settings: PlannerSettings) -> np.ndarray:
    """Per op, whether it uses a ``rep`` unit (a tied use: its owner's)."""
    names = set(rep_unit_names(desc, settings))
    return np.array([bool(names) and (op.tied_to or op.name) in names and bool(op.param_count or op.tied_to)
                     for op in desc.ops], dtype=bool)


def rep_is_direct(op: OpDesc, settings: PlannerSettings) -> bool:
    """Whether a rep unit of ``op`` (its owner) runs direct: it computes and reduces in
    the model's dtype ([Note: direct replicated units] in osdp/runtime/direct.py)."""
    e = element_bytes(op)
    return settings.param_dtype_bytes in (None, e) and settings.reduce_dtype_bytes in (None, e)


def _rep_owner(desc: ModelDesc, rep: np.ndarray, i: int) -> bool:
    """Whether op i owns parameters of a ``rep`` unit: its own, or a tied use's bias,
    which runs its owner's mode (``plan_from_schedule``)."""
    return bool(rep[i]) and bool(desc.ops[i].param_count)


def _grad_persists(settings: PlannerSettings) -> bool:
    """Whether a rep unit's ``.grad`` lives through the whole step: kept between steps,
    or made by the first of several micro-batches that are each reduced."""
    return not settings.grads_set_to_none or (settings.accumulation_steps > 1 and settings.gradient_sync == "every")


def _accumulators_static(settings: PlannerSettings) -> bool:
    """Whether every unit's unsharded gradient buffer is a static accumulator."""
    return settings.accumulation_steps > 1 and settings.gradient_sync == "last"


def replicate_buckets(desc: ModelDesc, settings: PlannerSettings, rep: np.ndarray) -> list[list[int]]:
    """The rep units (owner op indices) per all-reduce bucket, in issue order, as the
    runtime fills them ([Note: replicated units] in osdp/contract.py): a unit joins after
    its last use in backward (its owner op: the first in op order), a bucket is issued
    once it holds >= REPLICATE_BUCKET_BYTES; the last one at the end of backward."""
    buckets, current, filled = [], [], 0.0
    for i in range(len(desc.ops) - 1, -1, -1):
        if not _rep_owner(desc, rep, i):
            continue
        current.append(i)
        filled += reduced_bytes(desc.ops[i], settings)
        if filled >= REPLICATE_BUCKET_BYTES:
            buckets.append(current)
            current, filled = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def replicate_reduce_s(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings,
                       rep: np.ndarray) -> dict[int, float]:
    """Per rep unit (owner op index), its share of its bucket's all-reduce: its bytes at
    the all-reduce's rate plus the bucket's latency divided among the bucket's units, so
    that the shares of a bucket add up to its ``all_reduce_s`` ([Note: rep mode])."""
    latency, rate = layout_collectives(device, settings).all_reduce_terms()
    share = {}
    for bucket in replicate_buckets(desc, settings, rep):
        for i in bucket:
            share[i] = rate * reduced_bytes(desc.ops[i], settings) + latency / len(bucket)
    return share


def replicated_grads_bytes(desc: ModelDesc, settings: PlannerSettings, rep: np.ndarray) -> np.ndarray:
    """Per op j, bytes of the rep units' gradients alive there after their backward
    (their last use after j): the buffers of the bucket being filled, those of the
    buckets in flight with their staging copies (and a ``.grad`` made at the end when it
    is not the buffer itself), the ``.grad`` of finished buckets; see [Note: rep mode]."""
    alive = np.zeros(len(desc.ops))
    buckets = replicate_buckets(desc, settings, rep)
    if not buckets:
        return alive
    per = {i: _rep_grad_sizes(desc.ops[i], settings) for bucket in buckets for i in bucket}
    # a full bucket is issued after the backward of its last unit; the rest at the end
    full = [sum(reduced_bytes(desc.ops[i], settings) for i in b) >= REPLICATE_BUCKET_BYTES for b in buckets]
    done = np.concatenate(([0.0], np.cumsum([sum(per[i][2] for i in b) for b in buckets])))
    flight = np.concatenate(([0.0], np.cumsum([sum(per[i][1] for i in b) for b in buckets])))
    bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
    issued, filling = 0, 0.0  # buckets issued before op j's backward; buffers of the one filling
    for j in range(len(desc.ops) - 1, -1, -1):
        u = j + 1  # its backward done before op j's: joined
        if u in bucket_of:
            k = bucket_of[u]
            filling += per[u][0]
            if full[k] and buckets[k][-1] == u:
                issued, filling = k + 1, 0.0
        oldest = max(0, issued - MAX_INFLIGHT_REPLICATE_BUCKETS)
        alive[j] = done[oldest] + (flight[issued] - flight[oldest]) + filling
    return alive


def activation_scale(desc: ModelDesc, settings: PlannerSettings) -> float:
    """Saved activations shrink with the compute dtype (the description was measured in
    the model's own dtype)."""
    if settings.param_dtype_bytes is None:
        return 1.0
    counted = [op for op in desc.ops if op.param_count]
    model_bytes = sum(op.param_bytes for op in counted) / max(sum(op.param_count for op in counted), 1)
    return settings.param_dtype_bytes / model_bytes if model_bytes else 1.0


def shape_key(op: OpDesc) -> str:
    """Ops with equal keys cost the same compute (identical layers share a fit)."""
    return f"{op.kind}:{op.param_count}:{op.flops_per_sample:.6g}:{op.act_bytes_per_sample:.6g}"


WINDOW_BUDGET_SHARE = 1 / 50


def prefetch_window(desc: ModelDesc, settings: PlannerSettings, budget_bytes: float = math.inf) -> float:
    """Default: room for two slices of the largest op, each op cut only as finely as
    needed for a slice to stay within 2% of the memory budget (so a model whose units
    are all small overlaps every gather unsplit, and a giant op still overlaps once
    split). Unsplittable ops do not set it: they run with their gather exposed rather
    than inflate every op's window."""
    if settings.prefetch_bytes is not None:
        return float(settings.prefetch_bytes)
    cap = budget_bytes * WINDOW_BUDGET_SHARE
    rep = rep_op_mask(desc, settings)  # rep units are never gathered
    slices = []
    for i, op in enumerate(desc.ops):
        if op.splittable and not rep[i]:
            sizes = [gathered_bytes(op, settings) / g for g in slice_choices(op, settings)]
            slices.append(next((size for size in sizes if size <= cap), sizes[-1]))
    if not slices:
        slices = [gathered_bytes(op, settings) for i, op in enumerate(desc.ops) if not rep[i]]
    return 2.0 * max(slices, default=0.0)


LOSS_SCALARS_BYTES = 8.0  # the loss and the gradient backward starts from: two fp32 scalars


def static_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """Bytes every plan pays: 1/N shards of params, grads and optimizer state (padded),
    and with gradient accumulation synced only at the last micro-batch, the unsharded
    gradient accumulators of every unit. Units that are ``rep`` under ``settings`` hold
    all of theirs instead ([Note: rep mode]): ``replicated_*``, present only when some are."""
    n = layout_collectives(device, settings).shard_ranks
    rep = rep_op_mask(desc, settings)
    params = grads = optim = accumulators = 0.0
    r_params = r_optim = r_grads = r_copies = 0.0
    for i, op in enumerate(desc.ops):
        e = element_bytes(op)
        accumulators += reduced_bytes(op, settings)
        if _rep_owner(desc, rep, i):
            r_params += op.param_count * e
            r_optim += op.param_count * settings.optimizer_state_bytes_per_param \
                + op.param_tensors * settings.optimizer_state_bytes_per_tensor
            r_grads += op.param_count * e if _grad_persists(settings) else 0.0
            if settings.param_dtype_bytes is not None and settings.param_dtype_bytes != e:
                r_copies += op.param_count * settings.param_dtype_bytes  # the kept param_dtype copy
            continue
        shard = math.ceil(op.param_count / n)
        params += shard * e
        grads += shard * e
        optim += shard * settings.optimizer_state_bytes_per_param + op.param_tensors * settings.optimizer_state_bytes_per_tensor
    result = {
        "sharded_params": params,
        "optimizer_state": optim,
        "constant": float(device.constant_bytes) + desc.act_constant_bytes * activation_scale(desc, settings)
        + LOSS_SCALARS_BYTES,
    }
    if settings.accumulation_steps > 1 and settings.gradient_sync == "last":
        result["grad_accumulators"] = accumulators
    if not settings.grads_set_to_none:
        result["sharded_grads"] = grads
    if rep.any():
        result.update(replicated_params=r_params, replicated_optimizer_state=r_optim)
        if r_grads:
            result["replicated_grads"] = r_grads
        if r_copies:
            result["replicated_param_copies"] = r_copies
    return result


def _rep_grad_sizes(op: OpDesc, settings: PlannerSettings) -> tuple[float, float, float]:
    """A rep unit's gradient bytes: (its buffer while the bucket fills, buffer + staging
    + a new ``.grad`` while the bucket is in flight, its ``.grad`` once the bucket is done)."""
    persists, static_buffers = _grad_persists(settings), _accumulators_static(settings)
    grad, param = reduced_bytes(op, settings), float(op.param_bytes)
    # a direct unit's buffer is .grad: static where .grad persists (autograd adds into it)
    buffer = 0.0 if static_buffers or (persists and rep_is_direct(op, settings)) else grad
    new_grad = param if not persists and grad != param else 0.0  # .grad apart from the buffer
    done = 0.0 if persists else (param if grad != param else buffer)
    return buffer, buffer + grad + new_grad, done


def optimizer_step_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """[Note: optimizer step moment] The bytes live while the optimizer steps, by
    category. Backward is over: no gathered weight, activation or gradient buffer is
    left, every gradient is reduced (sharded, and the rep units' whole ``.grad``), and
    AdamW makes its temporaries beside the static states:
      per_tensor  torch's for-loop AdamW (its default off CUDA) steps one parameter
                  tensor at a time: ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds
                  two copies of it while ``denom`` still holds the previous tensor's:
                  the most of 2 x a local tensor + the one before it (OpDesc.tensors,
                  in registration order, taken to follow op order; measured: three
                  4 MiB tensors step with 12 MiB of temporaries, one with 8; W&S 2x768
                  all rep, 2 x c_fc's weight + a bias, to 2 KB)
      foreach     torch's default on CUDA: ``_foreach_sqrt`` of every exp_avg_sq at
                  once: one copy of every local tensor
      none        fused AdamW: one kernel, no temporaries
      auto        unresolved (no model device seen): the larger of the first two
    A local tensor is bounded by itself and by its unit's shard (a rep unit's: all of
    it); a split op is bounded unsplit, since its slices' shards are smaller (the moment
    stays the same for every choice of the search, which checks it once). Adam with an
    L2 weight decay (not AdamW) copies each gradient too: not priced."""
    n = layout_collectives(device, settings).shard_ranks
    rep = rep_op_mask(desc, settings)
    static = static_bytes(desc, device, settings)
    parts = {k: v for k, v in static.items() if k != "constant"}
    # the activations' batch-independent part is freed with the graph; the loss stays
    parts["constant"] = float(device.constant_bytes) + LOSS_SCALARS_BYTES
    local = [op.param_count * element_bytes(op) if _rep_owner(desc, rep, i)
             else math.ceil(op.param_count / n) * element_bytes(op)
             for i, op in enumerate(desc.ops)]
    # every parameter tensor the optimizer steps, in its order (registration order,
    # which follows op order in the models OSDP describes): a tensor's local piece is at
    # most the tensor and at most its unit's shard
    pieces = [min(numel, math.ceil(op.param_count / n)) * element_bytes(op) if not _rep_owner(desc, rep, i)
              else numel * element_bytes(op)
              for i, op in enumerate(desc.ops) for numel in op.tensors]
    if settings.grads_set_to_none:
        parts["sharded_grads"] = float(sum(math.ceil(op.param_count / n) * element_bytes(op)
                                           for i, op in enumerate(desc.ops) if not rep[i]))
    rep_done = sum(_rep_grad_sizes(desc.ops[i], settings)[2] for bucket in replicate_buckets(desc, settings, rep)
                   for i in bucket)
    if rep_done:
        parts["replicated_grads"] = float(rep_done)
    # two copies of each tensor beside the previous tensor's denom
    per_tensor = max((2.0 * x + (pieces[j - 1] if j else 0.0) for j, x in enumerate(pieces)), default=0.0)
    foreach = float(sum(local))
    parts["optimizer_temporaries"] = {"per_tensor": per_tensor, "foreach": foreach, "none": 0.0,
                                      "auto": max(per_tensor, foreach)}[settings.optimizer_temporaries]
    return parts


def sharded_grads_after(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> np.ndarray:
    """Per op i, bytes of the sharded gradients alive while op i runs: with gradients
    set to None between steps, those of the ops after i (backward has reduced them)."""
    if not settings.grads_set_to_none:
        return np.zeros(len(desc.ops))
    n = layout_collectives(device, settings).shard_ranks
    rep = rep_op_mask(desc, settings)  # a rep unit's gradient: replicated_grads_bytes
    shard = np.array([0.0 if rep[i] else math.ceil(op.param_count / n) * element_bytes(op)
                      for i, op in enumerate(desc.ops)])
    return np.concatenate((np.cumsum(shard[::-1])[::-1][1:], [0.0]))


def optimizer_step_s(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> float:
    """AdamW reads and writes param, moments and reads grad: bandwidth bound."""
    static = static_bytes(desc, device, settings)
    # grads: as big as params; rep units step their whole parameters
    state = 2.0 * sum(static.get(k, 0.0) for k in ("sharded_params", "optimizer_state", "replicated_params",
                                                    "replicated_optimizer_state"))
    return 2.0 * state / device.memory_bandwidth_bytes_per_s


def split_efficiency(g: int, device: DeviceInfo) -> float:
    """Compute of a split matmul relative to the unsplit one: measured by the profiler
    (``DeviceInfo.split_efficiency``), else 1 (a fused accumulate keeps it near 1 and
    ``slice_overhead_s`` charges each extra slice's launch)."""
    if g == 1:
        return 1.0
    return float(device.split_efficiency.get(str(g), 1.0))


@dataclass
class _Segment:
    name: str
    ops: list[int]
    variants: tuple[bool, ...]  # per search variant: is the segment checkpointed
    input_bytes_per_sample: float


def _segments(desc: ModelDesc, settings: PlannerSettings) -> list[_Segment]:
    """Blocks as segments; every op outside a block is a segment of its own."""
    variants = {"none": (False,), "auto": (False, True), "all": (True,)}[settings.checkpointing]
    by_first = {b.first_op: b for b in desc.blocks}
    segments, i = [], 0
    while i < len(desc.ops):
        block = by_first.get(i)
        if block is not None and settings.checkpointing != "none":
            segments.append(_Segment(block.name, list(range(i, i + block.num_ops)), variants, block.input_bytes_per_sample))
            i += block.num_ops
        else:
            segments.append(_Segment(desc.ops[i].name, [i], (False,), 0.0))
            i += 1
    return segments


@dataclass
class ProblemTemplate:
    """Batch-independent option tables of a model on a device under settings."""

    desc: ModelDesc
    device: DeviceInfo
    settings: PlannerSettings
    window_bytes: float
    static: dict[str, float]
    quantum_bytes: float
    segments: list[_Segment]
    # flat per option (variant-1 options of a segment follow its variant-0 ones)
    opt_op: np.ndarray = field(repr=False, default=None)
    opt_variant: np.ndarray = field(repr=False, default=None)
    opt_checkpointed: np.ndarray = field(repr=False, default=None)
    opt_slices: np.ndarray = field(repr=False, default=None)
    opt_zdp: np.ndarray = field(repr=False, default=None)
    opt_hpz: np.ndarray = field(repr=False, default=None)  # hpz slices ([Note: hpz mode])
    opt_held_bytes: np.ndarray = field(repr=False, default=None)
    opt_transient_bytes: np.ndarray = field(repr=False, default=None)  # gathers + grad buffers
    opt_comm_f_s: np.ndarray = field(repr=False, default=None)
    opt_gather_b_s: np.ndarray = field(repr=False, default=None)  # backward all-gathers
    opt_reduce_b_s: np.ndarray = field(repr=False, default=None)  # backward reduce-scatters
    opt_overlap: np.ndarray = field(repr=False, default=None)
    opt_split_overhead_s: np.ndarray = field(repr=False, default=None)
    opt_split_eff: np.ndarray = field(repr=False, default=None)
    # per sample: a vocabulary head's saved logits, the loss's backward transients before
    # the head's backward and the logits gradients during it, under this option ([Note:
    # fused vocabulary-split loss]), apart from act_per_sample / act_grad_per_sample
    opt_logits_per_sample: np.ndarray = field(repr=False, default=None)
    opt_loss_grad_per_sample: np.ndarray = field(repr=False, default=None)
    opt_logits_grad_per_sample: np.ndarray = field(repr=False, default=None)
    # of the transient, the bytes the op's own saved activations offset ([Note: the hook moment])
    opt_release_bytes: np.ndarray = field(repr=False, default=None)
    opt_begin: np.ndarray = field(repr=False, default=None)
    opt_end: np.ndarray = field(repr=False, default=None)
    # per op
    fwd_intercept_s: np.ndarray = field(repr=False, default=None)
    fwd_per_sample_s: np.ndarray = field(repr=False, default=None)
    bwd_intercept_s: np.ndarray = field(repr=False, default=None)
    bwd_per_sample_s: np.ndarray = field(repr=False, default=None)
    act_per_sample: np.ndarray = field(repr=False, default=None)
    # of it, the block's input ([Note: checkpointed block input])
    act_block_input_per_sample: np.ndarray = field(repr=False, default=None)
    grads_after: np.ndarray = field(repr=False, default=None)  # sharded grads alive at each op
    tied_grads: np.ndarray = field(repr=False, default=None)  # tied units' unsharded grads at each op
    act_grad_per_sample: np.ndarray = field(repr=False, default=None)  # backward transients
    # [Note: rep mode]: per op, whether it uses a rep unit (the template's fixed rep set),
    # and the rep units' gradients alive there after their backward
    rep: np.ndarray = field(repr=False, default=None)
    rep_grads: np.ndarray = field(repr=False, default=None)
    # the optimizer step's bytes by category, static included ([Note: optimizer step moment])
    step_bytes: dict = field(repr=False, default_factory=dict)

    @property
    def rep_units(self) -> tuple[str, ...]:
        """Names of the units this template runs ``rep``, sorted (as ``rep_units`` is)."""
        if self.rep is None:
            return ()
        return tuple(sorted(op.name for i, op in enumerate(self.desc.ops) if self.rep[i] and not op.tied_to))

    @property
    def budget_bytes(self) -> float:
        return self.device.memory_limit_bytes - sum(self.static.values())

    def shape(self, o: int) -> tuple[int, int, int]:
        """Option ``o``'s (slices, zdp slices, hpz slices): what the runtime runs of it."""
        return int(self.opt_slices[o]), int(self.opt_zdp[o]), int(self.opt_hpz[o])

    def problem(self, batch: int) -> SearchProblem:
        return _problem_at(self, batch)


def _compute_fit(op: OpDesc, device: DeviceInfo, settings: PlannerSettings):
    fit = device.op_compute.get(shape_key(op))
    if fit is not None:
        bi = fit.bwd_intercept_s if fit.bwd_intercept_s is not None else settings.backward_compute_ratio * fit.fwd_intercept_s
        bs = fit.bwd_per_sample_s if fit.bwd_per_sample_s is not None else settings.backward_compute_ratio * fit.fwd_per_sample_s
        return fit.fwd_intercept_s, fit.fwd_per_sample_s, bi, bs
    per_sample = op.flops_per_sample / device.flops_per_s
    return (
        device.op_overhead_s,
        per_sample,
        settings.backward_compute_ratio * device.op_overhead_s,
        settings.backward_compute_ratio * per_sample,
    )


def _ahead_bytes(desc: ModelDesc, window: float, settings: PlannerSettings) -> tuple[list[float], list[float]]:
    """Bytes that can be gathered ahead of each op: the following ops in forward, the
    preceding ones in backward, capped by the window."""
    rep = rep_op_mask(desc, settings)  # rep units are never gathered
    sizes = [gathered_bytes(op, settings) if not (op.tied_to or rep[i]) else 0 for i, op in enumerate(desc.ops)]
    after, before = [0.0] * len(sizes), [0.0] * len(sizes)
    acc = 0.0
    for i in range(len(sizes) - 1, -1, -1):
        after[i] = min(window, acc)
        acc = min(window, acc + sizes[i])
    acc = 0.0
    for i, size in enumerate(sizes):
        before[i] = min(window, acc)
        acc = min(window, acc + size)
    return after, before


def backward_needs_weights(op: OpDesc, g: int) -> bool:
    """Whether a use of ``op``'s weights cut into ``g`` slices reads them in backward: an
    unsplit module always does (the runtime's hooks gather it for its backward); a split
    op says so in its declaration (``needs_weights_in_backward``, osdp/ops/registry.py)."""
    if g == 1 or not op.split_op:
        return True
    from ..ops import registered_split_ops

    split = registered_split_ops().get(op.split_op)
    return True if split is None else bool(split.needs_weights_in_backward)


def coalesced_latency_shares(desc: ModelDesc, settings: PlannerSettings) -> tuple[float, float]:
    """[Note: coalesced latency] The runtime gathers small whole-module units together
    (``contract.is_small_unit``; [Note: coalesced small units] in runtime/prefetch.py):
    the next small units of the use order ride along in ONE all-gather of up to
    ``coalesce_bytes``, and their gradients are reduced together in ONE collective of up
    to ``coalesce_bytes``. So the small units share one latency per group, not one each.
    The additive model charges each small unit the fraction (groups / small units) of
    one collective's latency, groups packed in use order as the runtime packs them
    (greedy, each group closed when the next unit would overflow ``coalesce_bytes``);
    the bandwidth term stays per unit (``settings.coalesce_bytes``: the runtime's). Returns (gather share, reduction share); 1.0 when
    nothing is small. The share does not depend on the plan (which units are ``zdp``
    changes which ones gather again in backward; the forward packing stands for both),
    so the objective stays additive. Splitting a unit makes its slices not small."""
    def share(sizes):
        if not sizes:
            return 1.0
        groups, room = 0, 0.0
        for size in sizes:
            if size > room:
                groups, room = groups + 1, float(coalesce_bytes)
            room -= size
        return groups / len(sizes)

    coalesce_bytes = settings.coalesce_bytes
    rep = rep_op_mask(desc, settings)  # rep units are never gathered: no group holds them
    small = [op for i, op in enumerate(desc.ops) if not op.tied_to and op.param_count and not rep[i]
             and is_small_unit(gathered_bytes(op, settings), coalesce_bytes, is_slice=False)]
    return (share([gathered_bytes(op, settings) for op in small]),
            share([reduced_bytes(op, settings) for op in small]))


def _shared_latency_s(time_s: float, cost, ranks: int, latency_share: float, comm_scale: float) -> float:
    """A collective's ``time_s`` with only ``latency_share`` of its latency ([Note:
    coalesced latency]): ``(ranks - 1) * cost.alpha_s`` is the latency of a ring over the
    shard group on ``cost``'s link, scaled as every collective is by ``comm_scale``
    (across nodes the inter-node latency is left whole: conservative)."""
    if time_s <= 0:
        return 0.0
    return max(0.0, time_s - (1.0 - latency_share) * (ranks - 1) * cost.alpha_s * comm_scale)


def tied_groups(desc: ModelDesc) -> list[tuple[int, ...]]:
    """Ops that use one unit's weights, owner first, in op order: one tuple per tied unit
    (``OpDesc.tied_to``). They share one slicing and one mode per slice: [Note: tied
    weights]."""
    return list(_tied_index(desc)[0])


def _tied_index(desc: ModelDesc) -> tuple[tuple[tuple[int, ...], ...], dict[int, tuple[int, ...]]]:
    """The tied groups and, per op in one of them, its group. Once per description: the
    option rows ask it per op, and a scan per call made pricing a plan quadratic in the
    ops (a ModelDesc is frozen, so the cache cannot go stale)."""
    cached = desc.__dict__.get("_tied_index")
    if cached is None:
        names = {op.name: i for i, op in enumerate(desc.ops)}  # unique (ModelDesc checks)
        groups: dict[int, list[int]] = {}
        for i, op in enumerate(desc.ops):
            if op.tied_to:
                owner = names.get(op.tied_to)
                if owner is None:
                    owner = desc.op_index(op.tied_to)  # raises its KeyError
                groups.setdefault(owner, [owner]).append(i)
        ordered = tuple(tuple(sorted(v)) for v in groups.values())
        group_of: dict[int, tuple[int, ...]] = {}
        for group in ordered:
            for i in group:
                group_of.setdefault(i, group)  # an op in two groups: the first, as a scan finds
        cached = desc.__dict__["_tied_index"] = (ordered, group_of)
    return cached


def fused_logits_bytes(desc: ModelDesc, i: int) -> float:
    """Logits bytes per sample that a vocabulary-split option of op ``i`` never holds
    ([Note: fused vocabulary-split loss]); 0 unless op ``i`` is the model's last op (the
    saved logits are then seen by no later op, so the saving is an option's own term)."""
    op = desc.ops[i]
    if i != len(desc.ops) - 1 or op.logits_bytes_per_sample <= 0:
        return 0.0
    return float(min(op.logits_bytes_per_sample, op.act_bytes_per_sample))


def _group_of(desc: ModelDesc, i: int) -> tuple[int, ...]:
    return _tied_index(desc)[1].get(i, (i,))


def _rep_row(desc, i, settings, window, after_i, before_i, reduce_s, pending) -> tuple:
    """The one option of an op using a ``rep`` unit ([Note: rep mode]): unsplit, nothing
    gathered or kept; ``reduce_s`` its share of its bucket's all-reduce (charged at the
    owner, the last use in backward; a tied use's: its own bias's, if any); ``pending``:
    a sharded unit's gradient that may still be reduce-scattering beside it."""
    group = _group_of(desc, i)
    owner = desc.ops[group[0]]
    logits = fused_logits_bytes(desc, i)
    own_buffer = len(group) == 1 and not _accumulators_static(settings) and not rep_is_direct(owner, settings)
    own_grad = reduced_bytes(owner, settings) if own_buffer else 0.0
    # others' gathers prefetched around it; its own gradient buffer (a tied unit's:
    # tied_grads) and one pending reduce-scatter
    # unsplit: autograd's gradient is live while the hook copies it in (_grads_live); a
    # direct unit's is not copied, it becomes .grad
    transient = max(min(window, after_i), min(window, before_i) + own_grad + gathered_bytes(owner, settings) + pending)
    return (1, 0, 0, 0.0, transient, 0.0, 0.0, reduce_s, True, 0.0, 1.0, logits, 2.0 * logits, logits, 0.0)


def pending_reduce_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings,
                         rep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[Note: pending reduction] Per op, (the unsharded gradient bytes of other units that
    are live while the op's backward runs, the sharded outputs the reduce-scatter issued
    at its backward allocates).
    Pending: the one reduction the runtime keeps in flight (MAX_INFLIGHT_REDUCE_SCATTERS
    = 1; runtime/reduce.py's [Note: unsharded gradients]), the last issued before this
    op's backward, and the small units' gradients waiting to be reduced together ([Note:
    coalesced reductions]). Played in backward order as the runtime groups them: a unit
    that reduces alone is in flight whole (its slices, if split, are no larger); a small
    one waits until the waiting ones reach ``coalesce_bytes``, then they are in flight as
    one group (split instead, its slices reduce alone, smaller still). Rep units reduce in
    their own buckets and a tied unit at its owner's use, so neither counts elsewhere.
    Outputs: ``GradReducer._issue`` allocates every output of the reduce-scatter it
    issues, then waits for the one in flight, with the op's own gradient and autograd's
    still live: its own shard (unsplit; a split op's slices are priced by
    ``_split_backward_bytes``), and when it completes a group of small units, theirs too
    (measured: three 4 MiB Linears in zdp on 2 ranks peaked 2 MiB, one shard, over the
    model without it). Where gradients persist between steps (``grads_set_to_none``
    False) an output is added into ``.grad`` and freed when its reduction is waited
    for, so the one in flight is counted too; set to None, it becomes the sharded
    gradient ``sharded_grads_after`` counts. Returns (pending, outputs, in-flight
    outputs not counted elsewhere: a split op's first slice meets them)."""
    n = layout_collectives(device, settings).shard_ranks
    persist = not settings.grads_set_to_none
    pending, outputs, flight_out = (np.zeros(len(desc.ops)) for _ in range(3))
    owners = {group[0] for group in tied_groups(desc)}
    in_flight, in_flight_out, waiting, waiting_out = 0.0, 0.0, 0.0, 0.0
    for i in range(len(desc.ops) - 1, -1, -1):
        pending[i] = in_flight + waiting
        flight_out[i] = in_flight_out if persist else 0.0
        op = desc.ops[i]
        if not op.param_count or rep[i] or (op.tied_to and i not in owners):
            continue  # no reduction of its own issued here
        grad = reduced_bytes(op, settings)
        out = math.ceil(op.param_count / n) * element_bytes(op)
        if i not in owners and is_small_unit(gathered_bytes(op, settings), settings.coalesce_bytes, is_slice=False):
            waiting, waiting_out = waiting + grad, waiting_out + out
            if waiting < settings.coalesce_bytes:
                continue
            grad, out, waiting, waiting_out = waiting, waiting_out, 0.0, 0.0
        outputs[i] = out + flight_out[i]
        in_flight, in_flight_out = grad, out
    return pending, outputs, flight_out


def _option_rows(desc, i, device, settings, checkpointed, window, after_i, before_i,
                 shares=(1.0, 1.0), pending=0.0, issued=0.0, flight_out=0.0, exact=None, only=None) -> list[tuple]:
    """(g, k, h, held, transient, comm_f, gather_b, reduce_b, overlap, slice overhead,
    split efficiency, logits saved, the loss's backward transients, logits grads in the
    head's backward, release) for every option of op ``i`` (see the
    Notes at the top, [Note: hpz mode] and [Note: tied weights]). ``shares``: the latency
    shares of small units ([Note: coalesced latency]); ``pending``: the gradient bytes
    that may still be reducing beside its backward, ``issued``: the sharded outputs its
    unsplit backward's reduce-scatter allocates, ``flight_out``: those of the one in
    flight before it where nothing else counts them ([Note: pending reduction]).
    ``exact``: a concrete plan's gathered bytes beyond the kept prefix, ``(forward,
    [backward per slice j])``, in place of the window's bound ([Note: exact gathers]).
    ``only``: a (g, k, h) whose row alone is wanted (pricing one plan: the other rows'
    slice-by-slice backward made ``exact_transients`` the planner's largest cost)."""
    coll = layout_collectives(device, settings)
    group = _group_of(desc, i)
    owner = desc.ops[group[0]]
    full_grad = reduced_bytes(owner, settings)
    logits = fused_logits_bytes(desc, i)
    rows = []
    splittable = all(desc.ops[j].splittable for j in group)
    for g in slice_choices(owner, settings) if splittable else (1,):
        if only is not None and g != only[0]:
            continue
        ex = exact if exact is not None and len(exact[1]) == g else None  # the plan's g only
        needs = [backward_needs_weights(desc.ops[j], g) for j in group]
        # dp slices are kept by the first use that reads them in backward, until the end
        keeper = next((j for j, need in zip(group, needs) if need), None)
        weights_b = needs[group.index(i)]
        s = gathered_bytes(owner, settings) / g
        ag, ag_node = coll.gather_s(s), coll.node_gather_s(s)
        grad = full_grad / g
        # one slice's sharded gradient: its reduce-scatter's output
        reduced_slice = math.ceil(owner.param_count / g / coll.shard_ranks) * element_bytes(owner)
        grad_s = coll.grad_s(grad)
        if len(group) == 1 and is_small_unit(s, settings.coalesce_bytes, is_slice=g > 1):
            ag = _shared_latency_s(ag, device.all_gather, coll.shard_ranks, shares[0], coll.comm_scale)
            grad_s = _shared_latency_s(grad_s, device.reduce_scatter, coll.shard_ranks, shares[1], coll.comm_scale)
        # hpz needs a backward that reads the weights; a tied unit's uses share plain
        # dp/zdp modes (tied_choices enumerates (g, k) only)
        choices = reshard_choices(g, settings, coll.hpz_available and len(group) == 1 and weights_b)
        if len(group) == 1 and not weights_b:
            choices = ((g, 0),)  # no weights in backward: dp and zdp slices are both freed after forward
        for k, h in choices:
            if only is not None and (k, h) != only[1:]:
                continue
            held = ((g - k - h) * s + h * s / coll.per_node) if keeper == i else 0.0
            # a use gathers what no earlier use keeps; in backward, its zdp / hpz slices
            gathered_f = k if keeper is not None and keeper < i else g
            regather_b = (k * ag + h * ag_node) if weights_b else 0.0
            recompute = (regather_b if weights_b else g * ag) if checkpointed else 0.0
            comm_f = gathered_f * ag
            gather_b = regather_b + recompute
            # gradients are reduced after the last use in backward: the first in op order
            reduce_b = g * grad_s if i == group[0] else 0.0
            # forward: its gathered slice, unless the prefix holds it already (a dp slice
            # of this keeper: then only a zdp / hpz slice's moment adds it)
            own_f = s if gathered_f and (keeper != i or k + h > 0) else 0.0
            # the window also prefetches its own later slices (whole units of their own)
            gathers_f = own_f + _forward_prefetch(s, window, after_i + (gathered_f - 1) * s * (gathered_f > 0)) \
                if ex is None else ex[0]
            if g > 1 and len(group) == 1:
                backward = _split_backward_bytes(s, g, k + h, weights_b, window, before_i, grad, pending,
                                                 reduced_slice, None if settings.grads_set_to_none else flight_out,
                                                 None if ex is None else ex[1])
            else:
                own_b = s if (weights_b and k + h > 0) else 0.0
                gathers_b = own_b if s > window else min(window, own_b + before_i)
                if ex is not None:
                    gathers_b = ex[1][0]
                backward = gathers_b + _grads_live(grad, untied=len(group) == 1, pending=pending,
                                                   autograd=s if g == 1 else 0.0) + issued
            transient = max(gathers_f, backward)
            release = 0.0
            if g == 1 and len(group) == 1 and logits == 0 and not _accumulators_static(settings):
                # [Note: the hook moment]: the buffer and the reduce-scatter's output
                # come after autograd's node, whose saved activations are gone by then;
                # after the copy autograd's dW (s) is gone too
                release = max(0.0, min(grad + issued, s, backward - gathers_f))
            # [Note: fused vocabulary-split loss]: split, the head never holds the logits;
            # unsplit, the loss's backward (3 L) comes before the head's (L of it left)
            fused = g > 1 and logits > 0
            logits_saved = 0.0 if fused else logits
            loss_grads = 0.0 if fused else 2.0 * logits
            logits_grads = 2.0 * logits / g if fused else logits
            rows.append((g, k, h, held, transient, comm_f, gather_b, reduce_b, 2 * s <= window,
                         (g - 1) * device.slice_overhead_s, split_efficiency(g, device), logits_saved, loss_grads,
                         logits_grads, release))
    return rows


def _forward_prefetch(s: float, window: float, after: float) -> float:
    """Bytes prefetched beside a forward use of a slice of ``s`` bytes, ``after`` being
    what the next ops could gather (``_ahead_bytes``): the window holds the slice in
    use too, kept dp or not (runtime/prefetch.py gathers it counting the unit in use,
    [Note: transient bytes] in lifecycle.py); the slice itself is counted by the caller
    (as a gather, or in the prefix when kept). In backward the window is filled at the
    previous use's release, when nothing of this op is in use: there a dp slice
    leaves the whole window to prefetches (``min(window, own + before)``)."""
    return 0.0 if s > window else min(window - s, after)


def _grads_live(grad: float, untied: bool, pending: float, autograd: float) -> float:
    """Unsharded gradient bytes live during the backward of an unsplit op or of a tied
    unit's use, ``grad`` being its gradient ([Note: pending reduction]): the unit's buffer
    (a tied unit's is summed over its uses first: ``tied_grads_bytes``), the one
    reduction in flight and ``autograd``: unsplit, the gradient autograd made (in the
    compute dtype), which the runtime's hook copies into that buffer, both live during
    the copy."""
    return autograd + (grad if untied else 0.0) + pending


def _split_backward_bytes(s: float, g: int, resharded: int, weights_b: bool, window: float,
                          before_i: float, grad: float, pending: float, reduced_slice: float,
                          persist_flight_out: float | None = None, exact_gathers=None) -> float:
    """[Note: split backward moments] Bytes a split (untied) op adds at its busiest
    backward moment, beyond the prefix, the larger over its slices j = g-1 .. 0 in the
    order backward runs them, each at the issue of its reduce-scatter (the runtime
    allocates the output, then waits for the one in flight: runtime/reduce.py):
      gathers    its weights if slice j is resharded (the first ``resharded`` slices:
                 planner.py orders a unit's modes zdp, hpz, dp) and backward reads them,
                 and the window's prefetch around it (as unsplit)
      gradients  slice j's buffer, the reduction in flight (``pending`` for the first
                 slice, else slice j+1's buffer) and the op's sharded gradient, all g
                 slices' outputs (``reduced_slice`` each): the first reduction allocates
                 it whole, each slice's writes its part ([Note: split parameters] in
                 runtime/split_params.py);
                 where gradients persist (``persist_flight_out`` given) an output is
                 freed once reduced: its own and the one in flight (slice j+1's, or
                 ``persist_flight_out`` before the first)
    ``exact_gathers[j]``: a concrete plan's gathered bytes beyond the kept prefix at
    slice j's backward ([Note: exact gathers]), released dp slices included.
    It writes its dW into the buffer itself (osdp/ops/matmul_split.py): no autograd
    copy. Measured (I&C 6x128-512 at batch 14, a 4 MiB c_proj in 4 zdp slices on 2
    ranks): 2 MiB of outputs beside the two 1 MiB buffers, predicted to 0.02%.
    Not subtracted, a known over-bound: the dp slices after j, which the runtime frees
    after their backward while the prefix still counts them (W&S 2x768, 2 dp + 2 zdp
    slices: +2.6%). Subtracting them let the search pick plans where the window's
    fractional fill (the runtime prefetches whole units and stops at the first that
    does not fit) over-counts a further 1 MiB, 5.4% over at a small GPT's split head
    (tests/runtime/test_peak.py): both need the neighbours' choices, which the per-op
    search does not see."""
    worst = 0.0
    for j in range(g - 1, -1, -1):
        own = s if weights_b and j < resharded else 0.0
        # what backward reaches next: its resharded slices below j, then the ops before
        ahead = min(j, resharded) * s if weights_b else 0.0
        gathers = own if s > window else min(window, own + ahead + before_i)
        in_flight = pending if j == g - 1 else grad
        if persist_flight_out is None:
            outputs = g * reduced_slice
        else:
            outputs = reduced_slice + (persist_flight_out if j == g - 1 else reduced_slice)
        # its dp slices after j were freed after their own backward (the prefix holds them)
        released = max(0, g - max(j + 1, resharded)) * s if weights_b else 0.0
        if exact_gathers is not None:
            gathers, released = exact_gathers[j], 0.0
        worst = max(worst, gathers + grad + in_flight + outputs - released)
    return worst


def tied_grads_bytes(desc: ModelDesc, settings: PlannerSettings) -> np.ndarray:
    """Per op, bytes of tied units' unsharded gradients alive there: from the backward of
    a tied unit's last use to that of its first (owner), all of it ([Note: tied weights])."""
    alive = np.zeros(len(desc.ops))
    for group in tied_groups(desc):
        alive[group[0] : group[-1] + 1] += reduced_bytes(desc.ops[group[0]], settings)
    return alive


def _rows_key(desc: ModelDesc, i: int, owners, checkpointed, *moment_terms) -> tuple:
    """What op ``i``'s option rows depend on besides the template's own settings: its
    sizes and split op (its name when it is tied, owns a tied unit or is a fused head),
    whether it is checkpointed, and its ``_option_rows`` byte terms (``moment_terms``).
    Identical layers share one key, so their rows are computed once."""
    op = desc.ops[i]
    special = op.tied_to or i in owners or fused_logits_bytes(desc, i) > 0
    sizes = (op.name,) if special else (op.param_count, op.param_bytes, op.splittable, op.in_features, op.split_op)
    return sizes + (checkpointed,) + tuple(moment_terms)


# the fields of an option row (_option_rows, _rep_row), in order
_ROW_FIELDS = ("g", "k", "h", "held", "transient", "comm_f", "gather_b", "reduce_b", "overlap", "ovh", "eff",
               "logits", "loss_grad", "logits_grad", "release")


def build_template(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings | None = None) -> ProblemTemplate:
    settings = settings or PlannerSettings()
    static = static_bytes(desc, device, settings)
    budget = device.memory_limit_bytes - sum(static.values())
    window = prefetch_window(desc, settings, budget)
    segments = _segments(desc, settings)
    after, before = _ahead_bytes(desc, window, settings)
    shares = coalesced_latency_shares(desc, settings)
    rep = rep_op_mask(desc, settings)  # [Note: rep mode]: a fixed set per template
    rep_reduce = replicate_reduce_s(desc, device, settings, rep) if rep.any() else {}
    pending, issued, flight_out = pending_reduce_bytes(desc, device, settings, rep)
    # [Note: memory quantization] in search_problem.py: enough buckets that rounding
    # up every accumulating term costs at most memory_tolerance of the budget.
    terms = len(desc.ops) + len(segments)
    buckets = min(settings.max_buckets, max(settings.min_buckets, math.ceil(terms / settings.memory_tolerance)))
    quantum = max(budget, 1.0) / buckets

    begin = np.zeros((len(desc.ops), 2), dtype=np.int64)
    end = np.zeros((len(desc.ops), 2), dtype=np.int64)
    blocks: list[np.ndarray] = []  # option rows (_ROW_FIELDS) per distinct key
    block_of: dict[tuple, int] = {}  # identical layers share their option rows
    runs = []  # per (op, variant) in option order: (op, variant, checkpointed, block)
    count = 0
    owners = {group[0] for group in tied_groups(desc)}
    for seg in segments:
        for variant, checkpointed in enumerate(seg.variants):
            for i in seg.ops:
                key = _rows_key(desc, i, owners, checkpointed, after[i], before[i], pending[i], issued[i],
                                flight_out[i])
                if rep[i]:
                    key += ("rep", rep_reduce.get(i, 0.0))
                b = block_of.get(key)
                if b is None:
                    if rep[i]:
                        rows = [_rep_row(desc, i, settings, window, after[i], before[i], rep_reduce.get(i, 0.0),
                                         pending[i])]
                    else:
                        rows = _option_rows(desc, i, device, settings, checkpointed, window, after[i], before[i],
                                            shares, pending[i], issued[i], flight_out[i])
                    b = block_of[key] = len(blocks)
                    blocks.append(np.array(rows, dtype=np.float64).reshape(len(rows), len(_ROW_FIELDS)))
                begin[i, variant] = count
                count += len(blocks[b])
                end[i, variant] = count
                runs.append((i, variant, checkpointed, b))
    # one array per field, as the rows would give them (small ints and bools are exact as floats)
    table = np.concatenate([blocks[b] for *_, b in runs] + [np.zeros((0, len(_ROW_FIELDS)))])
    col = {name: table[:, j].copy() for j, name in enumerate(_ROW_FIELDS)}
    sizes = np.array([len(blocks[b]) for *_, b in runs], dtype=np.int64)
    per_run = np.array([r[:3] for r in runs], dtype=np.int64).reshape(-1, 3)

    fits = [_compute_fit(op, device, settings) for op in desc.ops]
    return ProblemTemplate(
        desc=desc,
        device=device,
        settings=settings,
        window_bytes=window,
        static=static,
        quantum_bytes=quantum,
        segments=segments,
        opt_op=np.repeat(per_run[:, 0], sizes),
        opt_variant=np.repeat(per_run[:, 1], sizes),
        opt_checkpointed=np.repeat(per_run[:, 2], sizes).astype(bool),
        opt_slices=col["g"].astype(np.int64),
        opt_zdp=col["k"].astype(np.int64),
        opt_hpz=col["h"].astype(np.int64),
        opt_held_bytes=col["held"],
        opt_transient_bytes=col["transient"],
        opt_comm_f_s=col["comm_f"],
        opt_gather_b_s=col["gather_b"],
        opt_reduce_b_s=col["reduce_b"],
        opt_overlap=col["overlap"].astype(bool),
        opt_split_overhead_s=col["ovh"],
        opt_split_eff=col["eff"],
        opt_logits_per_sample=col["logits"],
        opt_loss_grad_per_sample=col["loss_grad"],
        opt_logits_grad_per_sample=col["logits_grad"],
        opt_release_bytes=col["release"],
        opt_begin=begin,
        opt_end=end,
        fwd_intercept_s=np.array([f[0] for f in fits]),
        fwd_per_sample_s=np.array([f[1] for f in fits]),
        bwd_intercept_s=np.array([f[2] for f in fits]),
        bwd_per_sample_s=np.array([f[3] for f in fits]),
        # a fused head's logits (saved, and their gradients) are its options' own terms
        act_per_sample=np.array([op.act_bytes_per_sample - fused_logits_bytes(desc, i)
                                 for i, op in enumerate(desc.ops)]) * activation_scale(desc, settings),
        act_block_input_per_sample=np.array([op.block_input_bytes_per_sample for op in desc.ops])
        * activation_scale(desc, settings),
        act_grad_per_sample=np.array([max((op.act_grad_bytes_per_sample or op.act_bytes_per_sample)
                                          - 2.0 * fused_logits_bytes(desc, i), 0.0)
                                      for i, op in enumerate(desc.ops)]) * activation_scale(desc, settings),
        grads_after=sharded_grads_after(desc, device, settings),
        tied_grads=tied_grads_bytes(desc, settings),
        rep=rep,
        rep_grads=replicated_grads_bytes(desc, settings, rep),
        step_bytes=optimizer_step_bytes(desc, device, settings),
    )


_COST_FIELDS = ("opt_held_bytes", "opt_transient_bytes", "opt_comm_f_s", "opt_gather_b_s", "opt_reduce_b_s",
                "opt_overlap", "opt_split_overhead_s", "opt_split_eff", "opt_logits_per_sample",
                "opt_loss_grad_per_sample", "opt_logits_grad_per_sample", "opt_release_bytes")
_OPTION_FIELDS = ("opt_op", "opt_variant", "opt_checkpointed", "opt_slices", "opt_zdp", "opt_hpz") + _COST_FIELDS


def restrict_template(t: ProblemTemplate, keep: np.ndarray) -> ProblemTemplate:
    """``t`` with only the options where ``keep`` is True (per-op ranges recomputed)."""
    keep = np.asarray(keep, dtype=bool)
    kept_before = np.concatenate(([0], np.cumsum(keep))).astype(np.int64)
    return replace(t, opt_begin=kept_before[t.opt_begin], opt_end=kept_before[t.opt_end],
                   **{name: getattr(t, name)[keep] for name in _OPTION_FIELDS})


def _varies_with_k(t: ProblemTemplate, i: int, g: int) -> bool:
    """Whether op ``i``'s options at ``g`` slices cost differently for different k."""
    for v in range(2):
        rows = [o for o in range(t.opt_begin[i, v], t.opt_end[i, v]) if t.opt_slices[o] == g]
        if len({tuple(float(getattr(t, name)[o]) for name in _COST_FIELDS) for o in rows}) > 1:
            return True
    return False


def tied_choices(t: ProblemTemplate) -> list[ProblemTemplate]:
    """[Note: tied weights] The search decides per op; a tied unit's uses must share one
    (g, k). So the template is cut into sub-templates, one per joint choice of the tied
    units' keys, each searched exactly and the best kept (scheduler.schedule): per tied
    unit and g, one sub-template when at most one of its uses costs differently with k
    (that use keeps its k free, the others follow it: ``align_tied``), else one per
    (g, k). A GPT's tied pair: the embedding's cost at g > 1 does not depend on k (its
    backward reads no weights), so it is one sub-template per g (plus one per k unsplit).
    Without tied units: ``[t]``."""
    groups = tied_groups(t.desc)
    if not groups:
        return [t]
    per_group = []
    for group in groups:
        member = np.isin(t.opt_op, group)
        keys = []
        for g in sorted({int(x) for x in t.opt_slices[member]}):
            varying = [i for i in group if _varies_with_k(t, i, g)]
            if len(varying) <= 1:
                keys.append((g, None, varying[0] if varying else group[-1]))
            else:
                keys.extend((g, k, None) for k in sorted({int(x) for x in t.opt_zdp[member & (t.opt_slices == g)]}))
        per_group.append(keys)
    result = []
    for combo in itertools.product(*per_group):
        keep = np.ones(len(t.opt_op), dtype=bool)
        for group, (g, k, _) in zip(groups, combo):
            ok = t.opt_slices == g
            if k is not None:
                ok &= t.opt_zdp == k
            keep &= ~np.isin(t.opt_op, group) | ok
        sub = restrict_template(t, keep)
        sub.tied_free = {group: free for group, (_, _, free) in zip(groups, combo) if free is not None}
        result.append(sub)
    return result


def align_tied(t: ProblemTemplate, option_index, variant) -> tuple[int, ...]:
    """``option_index`` with every use of a tied unit on the (g, k) of the use that chose
    freely in ``t`` (``tied_choices``); the others cost the same for every k, so time and
    memory are unchanged."""
    free = getattr(t, "tied_free", None)
    if not free:
        return tuple(option_index)
    seg_of = {i: s for s, seg in enumerate(t.segments) for i in seg.ops}
    chosen = list(option_index)
    for group, j in free.items():
        g, k = int(t.opt_slices[chosen[j]]), int(t.opt_zdp[chosen[j]])
        for i in group:
            v = int(variant[seg_of[i]])
            rows = [o for o in range(t.opt_begin[i, v], t.opt_end[i, v])
                    if t.opt_slices[o] == g and t.opt_zdp[o] == k]
            if not rows:
                raise OSDPError(f"tied unit {t.desc.ops[group[0]].name!r}: use {t.desc.ops[i].name!r} has no option "
                                f"with {g} slices, {k} zdp")
            chosen[i] = rows[0]
    return tuple(chosen)
def option_unit_uses(t: ProblemTemplate) -> np.ndarray:
    """Unit uses per option and phase: its slice count for an op that is a unit or uses
    one (a tied second use: its owner's), 0 for an op without parameters or using a
    direct rep unit (no per-use hooks, [Note: rep mode]). Once per template: every
    batch's option times read it."""
    uses = t.__dict__.get("_unit_uses")
    if uses is None:
        ops = t.desc.ops
        by_name = {op.name: op for op in ops}
        rep = t.rep if t.rep is not None else np.zeros(len(ops), dtype=bool)
        is_unit = np.array([bool(op.param_count or op.tied_to)
                            and not (rep[i] and rep_is_direct(by_name.get(op.tied_to, op), t.settings))
                            for i, op in enumerate(ops)])
        uses = t.__dict__["_unit_uses"] = np.where(is_unit[t.opt_op], t.opt_slices, 0)
        uses.setflags(write=False)  # shared by every caller
    return uses


def option_compute_s(t: ProblemTemplate, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward compute seconds of one micro-batch per option, all slices
    of the op together (the backward without a checkpoint's recompute): the fits scaled
    by the calibration's ``compute_scale`` (forward) and ``backward_compute_scale``,
    plus its ``unit_overhead_s`` per unit use (``DeviceInfo.calibration``; the defaults
    add nothing)."""
    op = t.opt_op
    cal = t.device.calibration
    comp_f = (t.fwd_intercept_s[op] + t.fwd_per_sample_s[op] * batch) * t.opt_split_eff + t.opt_split_overhead_s
    comp_b = (t.bwd_intercept_s[op] + t.bwd_per_sample_s[op] * batch) * t.opt_split_eff + t.opt_split_overhead_s
    if cal.compute_scale != 1.0 or cal.backward_compute_scale != 1.0 or cal.unit_overhead_s:
        runtime = cal.unit_overhead_s * option_unit_uses(t)
        comp_f = comp_f * cal.compute_scale + runtime
        comp_b = comp_b * cal.backward_compute_scale + runtime
    return comp_f, comp_b


def _phase_times(t: ProblemTemplate, batch: int, reduce: bool) -> np.ndarray:
    """Forward + backward time of one micro-batch per option, with or without the
    reduce-scatter of its gradients. Overlapped, a phase costs max(compute, comm) plus
    the part (1 - overlap_efficiency) of the smaller one that is not really hidden."""
    comp_f, comp_b = option_compute_s(t, batch)
    comp_b = comp_b + comp_f * t.opt_checkpointed  # recompute of a checkpointed block
    comm_b = t.opt_gather_b_s + (t.opt_reduce_b_s if reduce else 0.0)
    lost = 1.0 - t.device.calibration.overlap_efficiency
    overlapped = np.maximum(comp_f, t.opt_comm_f_s) + np.maximum(comp_b, comm_b)
    if lost:
        overlapped = overlapped + lost * (np.minimum(comp_f, t.opt_comm_f_s) + np.minimum(comp_b, comm_b))
    serial = comp_f + t.opt_comm_f_s + comp_b + comm_b
    return np.where(t.opt_overlap, overlapped, serial)


def _option_times(t: ProblemTemplate, batch: int) -> np.ndarray:
    """Time of one optimizer step per option: every micro-batch of the accumulation,
    reduce-scattering after each one or only after the last (``gradient_sync``)."""
    steps = t.settings.accumulation_steps
    full = _phase_times(t, batch, reduce=True)
    if steps == 1:
        return full
    if t.settings.gradient_sync == "every":
        return steps * full
    return (steps - 1) * _phase_times(t, batch, reduce=False) + full


def _local_moments(t: ProblemTemplate, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per option, bytes local to its op at its own busiest moment (gathers, gradient
    buffers, activation gradients, logits gradients inside the head's backward) and in
    the loss's backward before it (saved log-probabilities and their gradients: [Note:
    fused vocabulary-split loss]; 0 for every op but an unsplit head). At the backward
    hook of an unsplit op its own saved activations are released ([Note: the hook
    moment]): they offset up to ``opt_release_bytes`` of its transient."""
    released = np.minimum(t.opt_release_bytes, t.act_per_sample[t.opt_op] * batch)
    own = t.opt_transient_bytes - released + (t.act_grad_per_sample[t.opt_op] + t.opt_logits_grad_per_sample) * batch
    loss = (t.opt_logits_per_sample + t.opt_loss_grad_per_sample) * batch
    return own, loss


def option_local_bytes(t: ProblemTemplate, batch: int) -> np.ndarray:
    """Per option, the bytes its op adds on top of the kept prefix at its peak moment."""
    return np.maximum(*_local_moments(t, batch))


def template_optimizer_s(t: ProblemTemplate) -> float:
    """``optimizer_step_s`` of the template's model, device and settings, computed once
    per template (the batch sweep builds a problem per probe)."""
    cached = t.__dict__.get("_optimizer_step_s")
    if cached is None:
        cached = t.__dict__["_optimizer_step_s"] = optimizer_step_s(t.desc, t.device, t.settings)
    return cached


def _segment_layout(t: ProblemTemplate):
    """The template's segments grouped by length (once per template): per group the
    segment indices, their ops (rows), which variants exist and which are checkpointed,
    and their input bytes per sample; so ``_problem_at`` sums each segment's activations
    row by row, in the same order as one segment at a time."""
    layout = t.__dict__.get("_segment_layout")
    if layout is None:
        by_length: dict[int, list[int]] = {}
        for s, seg in enumerate(t.segments):
            by_length.setdefault(len(seg.ops), []).append(s)
        groups = []
        for segs in by_length.values():
            has = np.zeros((len(segs), 2), dtype=bool)
            ckpt = np.zeros((len(segs), 2), dtype=bool)
            for r, s in enumerate(segs):
                for v, checkpointed in enumerate(t.segments[s].variants):
                    has[r, v], ckpt[r, v] = True, checkpointed
            groups.append((np.array(segs, dtype=np.int64), np.array([t.segments[s].ops for s in segs], dtype=np.int64),
                           has, ckpt, np.array([t.segments[s].input_bytes_per_sample for s in segs])))
        layout = t.__dict__["_segment_layout"] = groups
    return layout


def _problem_at(t: ProblemTemplate, batch: int) -> SearchProblem:
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise OSDPError(f"batch size must be a positive integer, got {batch!r}")
    q = t.quantum_bytes
    act = t.act_per_sample * batch
    n_ops, n_seg = len(t.desc.ops), len(t.segments)
    act_in = np.zeros((n_ops, 2))
    carry = np.zeros((n_seg, 2), dtype=np.int64)
    rep_grads = t.rep_grads if t.rep_grads is not None and t.rep_grads.any() else None
    recomputed = act - t.act_block_input_per_sample * batch  # [Note: checkpointed block input]
    for segs, ops, has, ckpt, inputs in _segment_layout(t):
        inside = np.cumsum(act[ops], axis=1)  # within each segment (row), in op order
        inside_recomputed = np.cumsum(recomputed[ops], axis=1)
        for v in range(2):
            rows = has[:, v]
            if not rows.any():
                continue
            checkpointed = ckpt[rows, v]
            kept = np.where(checkpointed, inputs[rows] * batch, 0.0)
            # the per-op exact term also holds the sharded grads already reduced (and
            # the rep units' gradients: [Note: rep mode])
            within = np.where(checkpointed[:, None], inside_recomputed[rows], inside[rows])
            value = kept[:, None] + within + t.grads_after[ops[rows]] + t.tied_grads[ops[rows]]
            if rep_grads is not None:
                value = value + rep_grads[ops[rows]]
            act_in[ops[rows], v] = value
            carried = np.where(checkpointed, kept, inside[rows, -1])
            carry[segs[rows], v] = np.where(carried > 0, np.ceil(carried / q - 1e-9), 0.0).astype(np.int64)
    held_q = np.ceil(t.opt_held_bytes / q - 1e-9).astype(np.int64)
    held_q[t.opt_held_bytes <= 0] = 0
    return SearchProblem(
        seg_first_op=np.array([seg.ops[0] for seg in t.segments], dtype=np.int64),
        seg_num_ops=np.array([len(seg.ops) for seg in t.segments], dtype=np.int64),
        seg_num_variants=np.array([len(seg.variants) for seg in t.segments], dtype=np.int64),
        seg_carry_act_q=carry,
        seg_extra_time_s=np.zeros((n_seg, 2)),
        act_in_segment_bytes=act_in,
        opt_begin=t.opt_begin,
        opt_end=t.opt_end,
        opt_slices=t.opt_slices,
        opt_zdp_slices=t.opt_zdp,
        opt_held_q=held_q,
        opt_local_bytes=option_local_bytes(t, batch),
        opt_time_s=_option_times(t, batch),
        quantum_bytes=q,
        limit_bytes=float(t.device.memory_limit_bytes),
        static_bytes=float(sum(t.static.values())),
        step_bytes=float(sum(t.step_bytes.values())),
        constant_time_s=template_optimizer_s(t),
        seg_names=tuple(seg.name for seg in t.segments),
    )


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


def exact_transients(t: ProblemTemplate, batch: int, option_index, variant) -> tuple[np.ndarray, np.ndarray]:
    """[Note: exact gathers] Per op, its chosen option's transient bytes (the larger of
    its forward and backward moments beyond the prefix) with the gathers the runtime
    really holds there, for this one plan, and the part of them its own released
    activations offset ([Note: the hook moment]).
    The search prices every op's gathers by the window's bound, the same for any choice
    of the ops around it: ``min(window, own + the bytes the next ops could gather)``.
    The runtime prefetches whole units, skips the ones kept (``dp``) or replicated, and
    stops at the first that does not fit, so a plan's neighbours can leave the window
    nearly empty: all-dp plans measured 5.4-6% under that bound (bench/fidelity.py), a
    small GPT's head 1 MiB under it at a 28 MiB budget (tests/runtime/test_peak.py).
    A concrete plan's gathers are known: ``step_sim.gathered_at_compute`` plays the
    runtime's prefetch rules (window, skips, coalesced riders, recompute) and gives the
    gathered bytes at every op's (slice's) forward and backward compute; less the dp
    bytes the prefix already holds there, they replace the bound in the same moment
    formulas (``_option_rows``). A backward moment takes the larger of the gathers at
    its compute and those right after it: the hook that frees the op's weights
    prefetches the next units while the op's dW, its buffer and the reduction's output
    are still live (64 fake ranks, a small GPT's head under a 3 MiB window: 2.4 MB of
    prefetches beside its 4 MiB of gradients, 0.56% over the prediction when only the
    compute moment was priced: tests/runtime/test_peak.py). The search keeps the bound
    (it cannot see the neighbours), so a plan it calls feasible is feasible here too;
    ``evaluate`` prices the plan it returns with these."""
    from .step_sim import gathered_at_compute  # step_sim prices plans with this module

    at = gathered_at_compute(t, batch, option_index, variant)
    desc, device, settings = t.desc, t.device, t.settings
    window = t.window_bytes
    after, before = _ahead_bytes(desc, window, settings)
    shares = coalesced_latency_shares(desc, settings)
    pending, issued, flight_out = pending_reduce_bytes(desc, device, settings, t.rep)
    per_node = layout_collectives(device, settings).per_node
    checkpointed_at = {}  # per op, whether its segment runs checkpointed in this plan
    for s, seg in enumerate(t.segments):
        for i in seg.ops:
            checkpointed_at.setdefault(i, seg.variants[int(variant[s])])
    out = np.array([t.opt_transient_bytes[o] for o in option_index], dtype=float)
    release = np.array([t.opt_release_bytes[o] for o in option_index], dtype=float)
    kept = 0.0  # dp bytes the prefix holds (an hpz slice's node copy is not a gather)
    owners = {group[0] for group in tied_groups(desc)}
    rows_of: dict[tuple, tuple] = {}  # identical layers with the same gathers: one row
    for i, o in enumerate(option_index):
        g, k, h = t.shape(o)
        owner = desc.ops[_group_of(desc, i)[0]]
        kept += t.opt_held_bytes[o] - (h * gathered_bytes(owner, settings) / g / per_node if h else 0.0)
        if t.rep is not None and t.rep[i]:
            continue  # never gathered
        steps = g if ("forward", i, g - 1) in at and g > 1 else 1
        fwd = max(at.get(("forward", i, j), 0.0) for j in range(steps)) - kept
        bwd = [max(at.get((phase, i, min(j, steps - 1)), 0.0) for phase in ("backward", "after backward")) - kept
               for j in range(g)]
        key = _rows_key(desc, i, owners, checkpointed_at[i], after[i], before[i], pending[i], issued[i],
                        flight_out[i]) + (g, k, h, fwd, tuple(bwd))
        row = rows_of.get(key)
        if row is None:
            rows = _option_rows(desc, i, device, settings, checkpointed_at[i], window, after[i], before[i], shares,
                                pending[i], issued[i], flight_out[i], exact=(fwd, bwd), only=(g, k, h))
            row = rows_of[key] = next(row for row in rows if row[:3] == (g, k, h))
        out[i], release[i] = row[4], row[14]
    return out, release


def live_memory(template: ProblemTemplate, batch: int, option_index, variant,
                exact: bool = True) -> list[tuple[int, dict]]:
    """Per op, the live bytes by category at that op (the larger of its forward and
    backward, as the model counts them), in exact bytes. Validates the assignment.
    ``exact``: the plan's own gathers ([Note: exact gathers]); False: the window's bound,
    as the search prices them."""
    t = template
    act = t.act_per_sample * batch
    static_parts = {
        "sharded_states": sum(t.static.get(k, 0.0) for k in ("sharded_params", "sharded_grads", "optimizer_state")),
        "constant": t.static["constant"],
    }
    replicated = [k for k in t.static if k.startswith("replicated_")]
    if replicated:  # [Note: rep mode]
        static_parts["replicated_states"] = sum(t.static[k] for k in replicated)
    if "grad_accumulators" in t.static:
        static_parts["grad_accumulators"] = t.static["grad_accumulators"]
    held_prefix = act_prefix = 0.0
    own_bytes, loss_bytes = _local_moments(t, batch)
    option_index = [int(o) for o in option_index]
    variant_of = {}  # per op, its segment's variant (the first segment holding it)
    for s, seg in enumerate(t.segments):
        for i in seg.ops:
            variant_of.setdefault(i, int(variant[s]))
    for i, o in enumerate(option_index):
        v = variant_of[i]
        if not (t.opt_begin[i, v] <= o < t.opt_end[i, v]):
            raise OSDPError(f"option {o} is not an option of op {t.desc.ops[i].name!r} in variant {v}")
    bound, bound_release = t.opt_transient_bytes[option_index], t.opt_release_bytes[option_index]
    transient, release = exact_transients(t, batch, option_index, variant) if exact else (bound, bound_release)
    # its own activations released at the hook ([Note: the hook moment])
    own_released = np.minimum(release, act)
    # the exact gathers change the op's own moment, not the loss's before it
    own_bytes = own_bytes[option_index] + (transient - bound) - (own_released - np.minimum(bound_release, act))
    loss_bytes = loss_bytes[option_index]
    rows = []
    for s, seg in enumerate(t.segments):
        v = variant[s]
        checkpointed = seg.variants[v]
        inside = 0.0
        kept = seg.input_bytes_per_sample * batch if checkpointed else 0.0
        for i in seg.ops:
            o = option_index[i]
            if not (t.opt_begin[i, v] <= o < t.opt_end[i, v]):
                raise OSDPError(f"option {o} is not an option of op {t.desc.ops[i].name!r} in variant {v}")
            held_prefix += t.opt_held_bytes[o]
            # [Note: checkpointed block input]
            inside += act[i] - (t.act_block_input_per_sample[i] * batch if checkpointed else 0.0)
            # [Note: the hook moment]: at the hook, its activations are gone and the
            # buffers all there; if they outweigh what the hook adds, the peak is in the
            # node, before the hook's buffers
            at_hook = own_released[i] < release[i]
            parts = {
                **static_parts,
                "kept_dp_weights": float(held_prefix),
                "saved_activations": float(act_prefix + kept + inside - (own_released[i] if at_hook else 0.0)),
                "in_flight_and_grad_buffers": float(transient[i] - (0.0 if at_hook else own_released[i])),
                "activation_grads": float(t.act_grad_per_sample[i] * batch),
                "sharded_grads_so_far": float(t.grads_after[i]),
            }
            if t.tied_grads[i]:
                parts["tied_unsharded_grads"] = float(t.tied_grads[i])
            if t.rep_grads is not None and t.rep_grads[i]:
                parts["replicated_grads"] = float(t.rep_grads[i])
            logits_grads = float(t.opt_logits_grad_per_sample[o] * batch)
            if logits_grads and exact and t.opt_slices[o] == 1 and len(_group_of(t.desc, i)) == 1:
                # an unsplit head's logits gradient is released with its backward node,
                # before the hook copies dW into the unit's buffer and issues its
                # reduce-scatter: the two are live at different moments (measured: 64
                # ranks, a 2 MiB dp head, 1 MiB over without this)
                op = t.desc.ops[i]
                n = layout_collectives(t.device, t.settings).shard_ranks
                buffer = reduced_bytes(op, t.settings) + math.ceil(op.param_count / n) * element_bytes(op)
                released = min(logits_grads, buffer)
                logits_grads -= released
                own_bytes[i] -= released
            # the larger moment is picked after the release: compared before it, the
            # head's own moment hid a larger loss moment (N&D 12x128 all zdp at batch 4:
            # measured 45.51 MiB at nll_loss_backward, predicted 44.79 at the head)
            if loss_bytes[i] > own_bytes[i]:  # the loss's backward, before the head's: nothing of the op's own
                parts.update(in_flight_and_grad_buffers=0.0, activation_grads=0.0,
                             saved_activations=float(act_prefix + kept + inside))
                parts["logits_and_grads"] = float(loss_bytes[i])
            elif logits_grads:
                parts["logits_and_grads"] = logits_grads
            rows.append((i, parts))
        act_prefix += kept if checkpointed else inside
    return rows


# [Note: checkpointed block input]
# A checkpointed block keeps its input through the step (``input_bytes_per_sample``) and
# recomputes its saved activations in its backward. The first op of a transformer block
# (its LayerNorm) saves the block's input itself: the recompute saves the SAME tensor the
# checkpoint kept, so within a checkpointed block an op's activations count without the
# bytes that are its block's input (``OpDesc.block_input_bytes_per_sample``, measured by
# describe as saved storages that are the block's input). Not checkpointed, that tensor is
# the op's own saved input and counts as before. Measured (N&D 12x128, all zdp, every
# block checkpointed, batch 12, fake 2-rank group): the peak at blocks.11.mlp.c_proj's
# backward was predicted 31734112 B against 31157340 measured (+1.85%) counting it twice.


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
    times = _option_times(t, batch)
    rows = live_memory(t, batch, option_index, variant, exact=exact)
    total_s = template_optimizer_s(t) + float(sum(times[o] for o in option_index))
    peak_i, breakdown = max(rows, key=lambda row: sum(row[1].values()))
    peak_op = t.desc.ops[peak_i].name
    if sum(t.step_bytes.values()) > sum(breakdown.values()):  # [Note: optimizer step moment]
        peak_op, breakdown = OPTIMIZER_STEP, dict(t.step_bytes)
    peak = sum(breakdown.values())
    return Estimate(
        step_s=float(total_s),
        peak_bytes=float(peak),
        peak_op=peak_op,
        breakdown=breakdown,
        fits=peak <= t.device.memory_limit_bytes,
    )
