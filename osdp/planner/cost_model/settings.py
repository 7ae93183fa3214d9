"""The planner's settings (``PlannerSettings``) and what they allow: slice counts, modes
per slice, the run's collectives under the settings' layout, and when gradients outlive
a micro-batch. Modes: docs/design/cost_model.md's [Note: hpz mode] and [Note: rep mode]."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ...contract import DEFAULT_COALESCE_BYTES, is_small_unit
from ...errors import OSDPError
from ..collective_cost import LAYOUTS, Collectives
from ..model_desc import OpDesc
from ..device import DeviceInfo
from .unit_bytes import gathered_bytes

POLICIES = ("osdp", "zdp", "dp", "hpz", "rep")
CHECKPOINTING = ("auto", "none", "all")
# what AdamW's step allocates besides its state ([Note: optimizer step moment])
OPTIMIZER_TEMPORARIES = ("auto", "per_tensor", "foreach", "none")


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
    scheduler choose which whole units are ``rep`` ([Note: rep family] in batch_sweep.py);
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
    # whether a small unit may be split: pricing a plan made by hand (calibration's
    # assignment_of, uniform_plan); the search leaves them whole (slice_choices)
    split_small_units: bool = False

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
    """Granularities g for an op: powers of two up to max_slices and the split axis.

    A small unit ([Note: coalesced small units] in runtime/prefetch.py) stays whole: its
    gradient joins the small units' coalesced reduction, and a slice of it would not (a
    slice is never small), which moves where that group is issued and what waits beside
    it, a choice of one op changing the moments of others, which the per-op search
    cannot price ([Note: pending reduction] plays the groups once, every small unit in
    them). Measured: a stock Llama (2 layers, hidden 32, 2 gloo ranks, 390 KiB) whose
    plan split an 8 KiB gate_proj in two had its group issued one op later, at an o_proj
    holding the group's gradients, their concatenation and the output together: 412380 B
    against 375408 predicted there (+9.8%; MemoryLimitExceeded). Splitting a unit that
    small saves at most its own bytes. A plan made by hand may split one
    (``split_small_units``): priced with the groups as if it were whole."""
    if settings.policy != "osdp" or not op.splittable:
        return (1,)
    if not settings.split_small_units and is_small_unit(gathered_bytes(op, settings), settings.coalesce_bytes,
                                                        is_slice=False):
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


def _grad_persists(settings: PlannerSettings) -> bool:
    """Whether a rep unit's ``.grad`` lives through the whole step: kept between steps,
    or made by the first of several micro-batches that are each reduced."""
    return not settings.grads_set_to_none or (settings.accumulation_steps > 1 and settings.gradient_sync == "every")


def _accumulators_static(settings: PlannerSettings) -> bool:
    """Whether every unit's unsharded gradient buffer is a static accumulator."""
    return settings.accumulation_steps > 1 and settings.gradient_sync == "last"
