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
    gradient buffers   2 * G/g   (the slice being computed + one reduce-scatter pending,
                       as the runtime's scheduler keeps them)
    activation grads   b * the op's measured backward transients (describe's
                       [Note: backward transients]; its saved bytes when unknown)
With checkpointing a block keeps only its input; its activations are recomputed and
alive again during its own backward. The model therefore places the peak at the op
where prefix + transient is largest, normally the start of backward.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import numpy as np

from ..contract import DEFAULT_COALESCE_BYTES, UNSHARDED_GRADS_LIVE, is_small_unit
from ..errors import OSDPError
from .description import ModelDesc, OpDesc
from .device import DeviceInfo
from .search_problem import SearchProblem

POLICIES = ("osdp", "zdp", "dp")
CHECKPOINTING = ("auto", "none", "all")


def _is_number(value, minimum: float) -> bool:
    """A finite real number (not a bool) >= ``minimum``."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value >= minimum)


@dataclass(frozen=True)
class PlannerSettings:
    """Knobs of the planner. ``policy``: "osdp" searches per-op modes and splits;
    "zdp" is FSDP full-shard (ZeRO-3) and "dp" shard-grad-op (ZeRO-2), both unsplit."""

    max_slices: int = 16
    policy: str = "osdp"
    checkpointing: str = "none"  # "auto": per block, chosen by the search
    prefetch_bytes: float | None = None  # None: 2 x the largest slice at the finest split
    optimizer_state_bytes_per_param: float = 8.0  # AdamW: two fp32 moments
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
    # the runtime's OSDP(coalesce_bytes=...): small units share collectives up to this
    # many bytes ([Note: coalesced latency]); 0: off
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise OSDPError(f"policy {self.policy!r} unknown; use one of {POLICIES}")
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
        for name in ("optimizer_state_bytes_per_param", "backward_compute_ratio"):
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
        if self.gradient_sync not in ("every", "last"):
            raise OSDPError(f"gradient_sync must be 'every' or 'last', got {self.gradient_sync!r}")
        if isinstance(self.coalesce_bytes, bool) or not isinstance(self.coalesce_bytes, int) or self.coalesce_bytes < 0:
            raise OSDPError(f"coalesce_bytes must be an integer >= 0 (bytes; 0: off), got {self.coalesce_bytes!r}")
        if isinstance(self.rerank_batches, bool) or not isinstance(self.rerank_batches, int) or self.rerank_batches < 1:
            raise OSDPError(f"rerank_batches must be a positive integer, got {self.rerank_batches!r}")

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
    if settings.policy == "dp":
        return (0,)
    return tuple(range(g + 1))


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
    slices = []
    for op in desc.ops:
        if op.splittable:
            sizes = [gathered_bytes(op, settings) / g for g in slice_choices(op, settings)]
            slices.append(next((size for size in sizes if size <= cap), sizes[-1]))
    if not slices:
        slices = [gathered_bytes(op, settings) for op in desc.ops]
    return 2.0 * max(slices, default=0.0)


def static_bytes(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> dict[str, float]:
    """Bytes every plan pays: 1/N shards of params, grads and optimizer state (padded),
    and with gradient accumulation synced only at the last micro-batch, the unsharded
    gradient accumulators of every unit."""
    n = device.world_size
    params = grads = optim = accumulators = 0.0
    for op in desc.ops:
        shard = math.ceil(op.param_count / n)
        e = element_bytes(op)
        params += shard * e
        grads += shard * e
        optim += shard * settings.optimizer_state_bytes_per_param
        accumulators += reduced_bytes(op, settings)
    result = {
        "sharded_params": params,
        "optimizer_state": optim,
        "constant": float(device.constant_bytes) + desc.act_constant_bytes * activation_scale(desc, settings),
    }
    if settings.accumulation_steps > 1 and settings.gradient_sync == "last":
        result["grad_accumulators"] = accumulators
    if not settings.grads_set_to_none:
        result["sharded_grads"] = grads
    return result


def sharded_grads_after(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> np.ndarray:
    """Per op i, bytes of the sharded gradients alive while op i runs: with gradients
    set to None between steps, those of the ops after i (backward has reduced them)."""
    if not settings.grads_set_to_none:
        return np.zeros(len(desc.ops))
    shard = np.array([math.ceil(op.param_count / device.world_size) * element_bytes(op) for op in desc.ops])
    return np.concatenate((np.cumsum(shard[::-1])[::-1][1:], [0.0]))


def optimizer_step_s(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings) -> float:
    """AdamW reads and writes param, moments and reads grad: bandwidth bound."""
    static = static_bytes(desc, device, settings)
    state = 2.0 * (static["sharded_params"] + static["optimizer_state"])  # grads: as big as params
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
    opt_held_bytes: np.ndarray = field(repr=False, default=None)
    opt_transient_bytes: np.ndarray = field(repr=False, default=None)  # gathers + grad buffers
    opt_comm_f_s: np.ndarray = field(repr=False, default=None)
    opt_gather_b_s: np.ndarray = field(repr=False, default=None)  # backward all-gathers
    opt_reduce_b_s: np.ndarray = field(repr=False, default=None)  # backward reduce-scatters
    opt_overlap: np.ndarray = field(repr=False, default=None)
    opt_split_overhead_s: np.ndarray = field(repr=False, default=None)
    opt_split_eff: np.ndarray = field(repr=False, default=None)
    opt_begin: np.ndarray = field(repr=False, default=None)
    opt_end: np.ndarray = field(repr=False, default=None)
    # per op
    fwd_intercept_s: np.ndarray = field(repr=False, default=None)
    fwd_per_sample_s: np.ndarray = field(repr=False, default=None)
    bwd_intercept_s: np.ndarray = field(repr=False, default=None)
    bwd_per_sample_s: np.ndarray = field(repr=False, default=None)
    act_per_sample: np.ndarray = field(repr=False, default=None)
    grads_after: np.ndarray = field(repr=False, default=None)  # sharded grads alive at each op
    act_grad_per_sample: np.ndarray = field(repr=False, default=None)  # backward transients

    @property
    def budget_bytes(self) -> float:
        return self.device.memory_limit_bytes - sum(self.static.values())

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
    sizes = [gathered_bytes(op, settings) if not op.tied_to else 0 for op in desc.ops]
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


def _owner_bytes(desc: ModelDesc, op: OpDesc, settings: PlannerSettings) -> float:
    return gathered_bytes(desc.ops[desc.op_index(op.tied_to)], settings) if op.tied_to else 0.0


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
    small = [op for op in desc.ops if not op.tied_to and op.param_count
             and is_small_unit(gathered_bytes(op, settings), coalesce_bytes, is_slice=False)]
    return (share([gathered_bytes(op, settings) for op in small]),
            share([reduced_bytes(op, settings) for op in small]))


def _collective_s(cost, nbytes: float, n: int, latency_share: float) -> float:
    """``cost.time_s`` with only ``latency_share`` of its latency ([Note: coalesced latency])."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return cost.time_s(nbytes, n) - (1.0 - latency_share) * (n - 1) * cost.alpha_s


def _option_rows(desc, op, device, settings, checkpointed, window, after_i, before_i,
                 shares=(1.0, 1.0)) -> list[tuple]:
    """(g, k, held, transient, comm_f, gather_b, reduce_b, overlap, slice overhead,
    split efficiency) for every option of one op (see the Notes at the top).
    ``shares``: the latency shares of small units ([Note: coalesced latency])."""
    n = device.world_size
    full_grad = reduced_bytes(op, settings)
    rows = []
    for g in slice_choices(op, settings):
        for k in mode_choices(g, settings):
            if op.tied_to:
                # [Note: tied weights] a second use gathers the owner's weights again
                # in forward and backward, as a zdp use would
                s = _owner_bytes(desc, op, settings)
                held, comm_f = 0.0, device.all_gather.time_s(s, n)
                gather_b = comm_f * (2 if checkpointed else 1)
                grad, reduce_b = 0.0, 0.0
            else:
                s = gathered_bytes(op, settings) / g
                held = (g - k) * s
                small = is_small_unit(s, settings.coalesce_bytes, is_slice=g > 1)
                ag = _collective_s(device.all_gather, s, n, shares[0] if small else 1.0)
                grad = full_grad / g
                comm_f = g * ag
                gather_b = k * ag * (2 if checkpointed else 1)
                reduce_b = g * _collective_s(device.reduce_scatter, grad, n, shares[1] if small else 1.0)
            # backward gathers only the zdp slices (dp ones are kept, and counted in
            # held); the window fills with the units ahead
            own_b = s if (k > 0 or op.tied_to) else 0.0
            if s > window:
                gathers_f, gathers_b = s, own_b
            else:
                gathers_f = min(window, s + after_i)
                gathers_b = min(window, own_b + before_i)
            # the runtime keeps at most UNSHARDED_GRADS_LIVE (2) unsharded gradients:
            # the slice being computed and one waiting for its reduce-scatter
            transient = max(gathers_f, gathers_b + UNSHARDED_GRADS_LIVE * grad)
            rows.append((g, k, held, transient, comm_f, gather_b, reduce_b, 2 * s <= window,
                         (g - 1) * device.slice_overhead_s, split_efficiency(g, device)))
    return rows


def build_template(desc: ModelDesc, device: DeviceInfo, settings: PlannerSettings | None = None) -> ProblemTemplate:
    settings = settings or PlannerSettings()
    static = static_bytes(desc, device, settings)
    budget = device.memory_limit_bytes - sum(static.values())
    window = prefetch_window(desc, settings, budget)
    segments = _segments(desc, settings)
    after, before = _ahead_bytes(desc, window, settings)
    shares = coalesced_latency_shares(desc, settings)
    # [Note: memory quantization] in search_problem.py: enough buckets that rounding
    # up every accumulating term costs at most memory_tolerance of the budget.
    terms = len(desc.ops) + len(segments)
    buckets = min(settings.max_buckets, max(settings.min_buckets, math.ceil(terms / settings.memory_tolerance)))
    quantum = max(budget, 1.0) / buckets

    names = ("g", "k", "held", "transient", "comm_f", "gather_b", "reduce_b", "overlap", "ovh", "eff")
    cols = {k: [] for k in ("op", "variant", "ckpt") + names}
    begin = np.zeros((len(desc.ops), 2), dtype=np.int64)
    end = np.zeros((len(desc.ops), 2), dtype=np.int64)
    cache: dict[tuple, list[tuple]] = {}  # identical layers share their option rows
    for seg in segments:
        for variant, checkpointed in enumerate(seg.variants):
            for i in seg.ops:
                op = desc.ops[i]
                key = (op.param_count, op.param_bytes, op.splittable, op.in_features,
                       _owner_bytes(desc, op, settings), checkpointed, after[i], before[i])
                rows = cache.get(key)
                if rows is None:
                    rows = cache[key] = _option_rows(desc, op, device, settings, checkpointed,
                                                     window, after[i], before[i], shares)
                begin[i, variant] = len(cols["op"])
                cols["op"].extend([i] * len(rows))
                cols["variant"].extend([variant] * len(rows))
                cols["ckpt"].extend([checkpointed] * len(rows))
                for name, values in zip(names, zip(*rows)):
                    cols[name].extend(values)
                end[i, variant] = len(cols["op"])

    fits = [_compute_fit(op, device, settings) for op in desc.ops]
    arr = lambda key, dtype=np.float64: np.asarray(cols[key], dtype=dtype)  # noqa: E731
    return ProblemTemplate(
        desc=desc,
        device=device,
        settings=settings,
        window_bytes=window,
        static=static,
        quantum_bytes=quantum,
        segments=segments,
        opt_op=arr("op", np.int64),
        opt_variant=arr("variant", np.int64),
        opt_checkpointed=arr("ckpt", bool),
        opt_slices=arr("g", np.int64),
        opt_zdp=arr("k", np.int64),
        opt_held_bytes=arr("held"),
        opt_transient_bytes=arr("transient"),
        opt_comm_f_s=arr("comm_f"),
        opt_gather_b_s=arr("gather_b"),
        opt_reduce_b_s=arr("reduce_b"),
        opt_overlap=arr("overlap", bool),
        opt_split_overhead_s=arr("ovh"),
        opt_split_eff=arr("eff"),
        opt_begin=begin,
        opt_end=end,
        fwd_intercept_s=np.array([f[0] for f in fits]),
        fwd_per_sample_s=np.array([f[1] for f in fits]),
        bwd_intercept_s=np.array([f[2] for f in fits]),
        bwd_per_sample_s=np.array([f[3] for f in fits]),
        act_per_sample=np.array([op.act_bytes_per_sample for op in desc.ops]) * activation_scale(desc, settings),
        act_grad_per_sample=np.array([op.act_grad_bytes_per_sample or op.act_bytes_per_sample for op in desc.ops])
        * activation_scale(desc, settings),
        grads_after=sharded_grads_after(desc, device, settings),
    )


def option_unit_uses(t: ProblemTemplate) -> np.ndarray:
    """Unit uses per option and phase: its slice count for an op that is a unit or uses
    one (a tied second use: its owner's), 0 for an op without parameters."""
    is_unit = np.array([bool(op.param_count or op.tied_to) for op in t.desc.ops])
    return np.where(is_unit[t.opt_op], t.opt_slices, 0)


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


def _problem_at(t: ProblemTemplate, batch: int) -> SearchProblem:
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise OSDPError(f"batch size must be a positive integer, got {batch!r}")
    q = t.quantum_bytes
    act = t.act_per_sample * batch
    n_ops, n_seg = len(t.desc.ops), len(t.segments)
    act_in = np.zeros((n_ops, 2))
    carry = np.zeros((n_seg, 2), dtype=np.int64)
    for s, seg in enumerate(t.segments):
        inside = np.cumsum(act[seg.ops])
        for v, checkpointed in enumerate(seg.variants):
            kept = seg.input_bytes_per_sample * batch if checkpointed else 0.0
            # the per-op exact term also holds the sharded grads already reduced
            act_in[seg.ops, v] = kept + inside + t.grads_after[seg.ops]
            carried = kept if checkpointed else inside[-1]
            carry[s, v] = math.ceil(carried / q - 1e-9) if carried > 0 else 0
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
        opt_local_bytes=t.opt_transient_bytes + t.act_grad_per_sample[t.opt_op] * batch,
        opt_time_s=_option_times(t, batch),
        quantum_bytes=q,
        limit_bytes=float(t.device.memory_limit_bytes),
        static_bytes=float(sum(t.static.values())),
        constant_time_s=optimizer_step_s(t.desc, t.device, t.settings),
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


def live_memory(template: ProblemTemplate, batch: int, option_index, variant) -> list[tuple[int, dict]]:
    """Per op, the live bytes by category at that op (the larger of its forward and
    backward, as the model counts them), in exact bytes. Validates the assignment."""
    t = template
    act = t.act_per_sample * batch
    static_parts = {
        "sharded_states": sum(t.static.get(k, 0.0) for k in ("sharded_params", "sharded_grads", "optimizer_state")),
        "constant": t.static["constant"],
    }
    if "grad_accumulators" in t.static:
        static_parts["grad_accumulators"] = t.static["grad_accumulators"]
    held_prefix = act_prefix = 0.0
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
            inside += act[i]
            rows.append((i, {
                **static_parts,
                "kept_dp_weights": float(held_prefix),
                "saved_activations": float(act_prefix + kept + inside),
                "in_flight_and_grad_buffers": float(t.opt_transient_bytes[o]),
                "activation_grads": float(t.act_grad_per_sample[i] * batch),
                "sharded_grads_so_far": float(t.grads_after[i]),
            }))
        act_prefix += kept if checkpointed else inside
    return rows


def evaluate(
    template: ProblemTemplate,
    batch: int,
    option_index,
    variant,
) -> Estimate:
    """Price a concrete plan given as option indices (per op) and variants (per segment)
    of the template, with exact bytes (no quantization)."""
    t = template
    times = _option_times(t, batch)
    rows = live_memory(t, batch, option_index, variant)
    total_s = optimizer_step_s(t.desc, t.device, t.settings) + float(sum(times[o] for o in option_index))
    peak_i, breakdown = max(rows, key=lambda row: sum(row[1].values()))
    peak = sum(breakdown.values())
    return Estimate(
        step_s=float(total_s),
        peak_bytes=float(peak),
        peak_op=t.desc.ops[peak_i].name,
        breakdown=breakdown,
        fits=peak <= t.device.memory_limit_bytes,
    )
