"""What the cost model reads about the hardware *and* the run: ``DeviceInfo``.

A ``DeviceInfo`` is derived, not stored: ``ClusterProfile.for_run(RunSettings(...))``
(``cluster.py``, ``run.py``) puts the hardware of a cluster profile (links, compute
speed, overheads) together with what one run asks of it (world size, memory limit per
device). See [Note: hardware apart from the run] in ``cluster.py``. Tests and
hand-written models may also build one directly. All values are SI: seconds, bytes,
FLOP/s.

Every field is checked when a ``DeviceInfo`` is made: its type, and > 0 (or >= 0 for
overheads, intercepts and alpha/beta, which may be zero) and finite; an error names the
field and, for a file, the file. Non-negative intercepts are also what the batch sweep's
throughput bound relies on (batch_sweep.py, [Note: exact batch sweep]).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from ..errors import OSDPError, a_type
from ..sizes import parse_bytes  # noqa: F401  (re-exported: osdp.planner.device.parse_bytes)
from .checks import check_mapping, check_number, check_object

WORLD_SIZE_UNIT = "data-parallel ranks"
MEMORY_LIMIT_UNIT = "bytes per device, e.g. 8589934592 for 8 GiB"


@dataclass(frozen=True)
class CollectiveCost:
    """Ring collective: (N-1) steps, each moving 1/N of the message.

    time(bytes) = (N-1) * alpha_s + (N-1)/N * bytes * beta_s_per_byte
    where ``bytes`` is the size of the full (gathered) tensor and 1/beta is the bus
    bandwidth as nccl-tests reports it."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self):
        check_number(self.alpha_s, "alpha_s", positive=False)
        check_number(self.beta_s_per_byte, "beta_s_per_byte", positive=False)

    def time_s(self, nbytes: float, world_size: int) -> float:
        if world_size <= 1 or nbytes <= 0:
            return 0.0
        steps = world_size - 1
        return steps * self.alpha_s + steps / world_size * nbytes * self.beta_s_per_byte

    @classmethod
    def from_dict(cls, data, name: str) -> "CollectiveCost":
        """From ``{"alpha_s": ..., "beta_s_per_byte": ...}``; errors name ``name``."""
        entry = check_object(data, name, ("alpha_s", "beta_s_per_byte"))
        return cls(**{k: check_number(v, f"{name}.{k}", positive=False) for k, v in entry.items()})


@dataclass(frozen=True)
class ComputeFit:
    """Measured forward (and backward) time of one op: intercept + slope * batch."""

    fwd_intercept_s: float
    fwd_per_sample_s: float
    bwd_intercept_s: float | None = None
    bwd_per_sample_s: float | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.name.startswith("fwd"):
                check_number(value, f.name, positive=False)

    @classmethod
    def from_dict(cls, data, name: str) -> "ComputeFit":
        entry = check_object(data, name, ("fwd_intercept_s", "fwd_per_sample_s"), ("bwd_intercept_s", "bwd_per_sample_s"))
        return cls(**{k: v if v is None and k.startswith("bwd") else check_number(v, f"{name}.{k}", positive=False)
                      for k, v in entry.items()})


@dataclass(frozen=True)
class Calibration:
    """Global factors fitted from measured steps of the wrapped model (``osdp.profiler``,
    ``osdp/planner/calibration.py``): what the per-op fits and α/β leave out. The
    defaults change nothing. See [Note: what the profiler fits] in calibration.py.

    ``unit_overhead_s``: the runtime's own seconds on the compute stream per unit use and
    phase (hooks, gather/free bookkeeping, issuing collectives), added to every op that
    is a unit (or uses one) once per slice, in forward and in backward.
    ``overlap_efficiency``: the fraction of the communication that runs beside compute
    that is really hidden (1: fully; 0: it adds up as if serial; gloo on CPU shares the
    cores between compute and the collectives' threads).
    ``compute_scale`` / ``backward_compute_scale``: measured forward / backward compute
    over the fitted per-op compute (the fits are taken with hooks on the unwrapped
    model, the backward ones from gradient-accumulation hooks, which see less of the
    backward than a step does: two scales).
    ``comm_scale``: collective seconds in a training step over the profiled ones (the
    bare collectives are timed on an idle machine; in a step, gloo's threads share the
    CPU cores with compute, and on GPUs NCCL's kernels share SMs and memory bandwidth).
    It scales every collective of ``collective_cost.Collectives``.
    ``memory_constant_bytes``: what the measured peak held beyond the prediction, learned
    from a measurement (already added to ``DeviceInfo.constant_bytes`` by
    ``calibration.apply``; kept here to say where that part of the constant came from).
    ``source``: the measurements it was fitted from, in words."""

    unit_overhead_s: float = 0.0
    overlap_efficiency: float = 1.0
    compute_scale: float = 1.0
    backward_compute_scale: float = 1.0
    comm_scale: float = 1.0
    memory_constant_bytes: float = 0.0
    source: str = ""

    def __post_init__(self):
        check_number(self.unit_overhead_s, "calibration.unit_overhead_s", positive=False)
        check_number(self.compute_scale, "calibration.compute_scale", positive=True)
        check_number(self.backward_compute_scale, "calibration.backward_compute_scale", positive=True)
        check_number(self.comm_scale, "calibration.comm_scale", positive=True)
        check_number(self.overlap_efficiency, "calibration.overlap_efficiency", positive=False)
        if self.overlap_efficiency > 1:
            raise OSDPError(f"calibration.overlap_efficiency is a fraction in [0, 1], got {self.overlap_efficiency!r}")
        if not isinstance(self.memory_constant_bytes, (int, float)) or isinstance(self.memory_constant_bytes, bool):
            raise OSDPError(f"calibration.memory_constant_bytes must be a number of bytes, got {self.memory_constant_bytes!r}")
        if not isinstance(self.source, str):
            raise OSDPError(f"calibration.source must be a string, got {self.source!r}")

    @classmethod
    def from_dict(cls, data, name: str = "calibration") -> "Calibration":
        known = tuple(f.name for f in fields(cls))
        entry = check_object(data, name, (), known)
        return cls(**entry)


# the fields a DeviceInfo takes from the hardware's compute side (ClusterProfile has the same)
COMPUTE_FIELDS = ("flops_per_s", "op_overhead_s", "slice_overhead_s", "memory_bandwidth_bytes_per_s",
                  "constant_bytes", "op_compute", "split_efficiency")


def check_compute_fields(obj) -> None:
    """The checks of ``COMPUTE_FIELDS``, shared by DeviceInfo and ClusterProfile."""
    for name in ("flops_per_s", "memory_bandwidth_bytes_per_s"):
        check_number(getattr(obj, name), name, positive=True)
    for name in ("op_overhead_s", "slice_overhead_s", "constant_bytes"):
        check_number(getattr(obj, name), name, positive=False)
    if not all(isinstance(v, ComputeFit) for v in check_mapping(obj.op_compute, "op_compute").values()):
        raise OSDPError("op_compute must map op shape keys to ComputeFit entries")
    check_mapping(obj.split_efficiency, "split_efficiency")
    for g, ratio in obj.split_efficiency.items():
        if not (isinstance(g, str) and g.isdigit() and int(g) >= 1):
            raise OSDPError(f"split_efficiency keys are slice counts like \"4\", got {g!r}")
        check_number(ratio, f"split_efficiency[{g!r}]", positive=True)


def compute_fields_from_dict(data: dict) -> dict:
    """``op_compute`` and ``split_efficiency`` of a JSON form, as the dataclasses take them."""
    op_compute = {key: ComputeFit.from_dict(entry, f"op_compute[{key!r}]")
                  for key, entry in check_mapping(data.get("op_compute", {}), "op_compute").items()}
    return {"op_compute": op_compute, "split_efficiency": check_mapping(data.get("split_efficiency", {}), "split_efficiency")}


@dataclass(frozen=True)
class DeviceInfo:
    """The cost model's input: one run (``world_size``, ``memory_limit_bytes``) on one
    cluster's hardware (the rest). Made by ``ClusterProfile.for_run``."""

    name: str
    world_size: int
    memory_limit_bytes: float
    all_gather: CollectiveCost
    reduce_scatter: CollectiveCost
    flops_per_s: float  # sustained matmul throughput for ops without a measured fit
    op_overhead_s: float = 10e-6  # per-op launch/dispatch cost (intercept of the fit)
    slice_overhead_s: float = 5e-6  # extra cost of each additional slice of a split op
    memory_bandwidth_bytes_per_s: float = 1e12  # optimizer step is bandwidth bound
    constant_bytes: float = 0.0  # allocator slack, workspaces: paid by every plan
    # measured per-op fits, keyed by op *shape key* (see cost_model.shape_key)
    op_compute: dict = field(default_factory=dict)
    # measured compute of a split op relative to the unsplit one, by slice count ("4": 1.07)
    split_efficiency: dict = field(default_factory=dict)
    source: str = ""
    # [Note: two-level collective cost] in collective_cost.py: ranks per node, and the
    # collectives across nodes (per rank's share of its node's network); None: one flat
    # network (``all_gather`` / ``reduce_scatter`` over any number of ranks)
    node_size: int | None = None
    inter_all_gather: CollectiveCost | None = None
    inter_reduce_scatter: CollectiveCost | None = None
    # the all-reduce of a flat buffer over the ``all_gather`` link, where it was measured
    # (the profiler on gloo, whose gradient collective it is: then ``reduce_scatter`` times
    # that same all-reduce); None: priced as a ring reduce-scatter + all-gather. Read for
    # replicated units (collective_cost.py's ``all_reduce_s``)
    all_reduce: CollectiveCost | None = None
    # fitted from measured steps of the wrapped model; the defaults change nothing
    calibration: Calibration = field(default_factory=Calibration)

    def __post_init__(self):
        if not isinstance(self.calibration, Calibration):
            raise OSDPError(f"calibration must be a Calibration, got {self.calibration!r}")
        if not isinstance(self.name, str):
            raise OSDPError(f"name must be a string, got {self.name!r} ({a_type(self.name)})")
        check_number(self.world_size, "world_size", positive=True, integer=True, unit=WORLD_SIZE_UNIT)
        check_number(self.memory_limit_bytes, "memory_limit_bytes", positive=True, unit=MEMORY_LIMIT_UNIT)
        check_compute_fields(self)
        for name in ("all_gather", "reduce_scatter"):
            if not isinstance(getattr(self, name), CollectiveCost):
                raise OSDPError(f"{name} must be a CollectiveCost(alpha_s, beta_s_per_byte), got {getattr(self, name)!r}")
        if self.node_size is not None:
            check_number(self.node_size, "node_size", positive=True, integer=True, unit="ranks per node")
        for name in ("inter_all_gather", "inter_reduce_scatter"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, CollectiveCost):
                raise OSDPError(f"{name} must be a CollectiveCost(alpha_s, beta_s_per_byte) or None, got {value!r}")
        if self.all_reduce is not None and not isinstance(self.all_reduce, CollectiveCost):
            raise OSDPError(f"all_reduce must be a CollectiveCost(alpha_s, beta_s_per_byte) or None, got {self.all_reduce!r}")
        if (self.inter_all_gather is None) != (self.inter_reduce_scatter is None):
            raise OSDPError("inter_all_gather and inter_reduce_scatter come together (both the collectives across "
                            "nodes, or neither)")
        if self.inter_all_gather is not None and self.node_size is None:
            raise OSDPError("collectives across nodes (inter_all_gather) need node_size, the ranks of one node")
        if not isinstance(self.source, str):
            raise OSDPError(f"source must be a string, got {self.source!r}")

    def with_(self, **changes) -> "DeviceInfo":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in ("node_size", "inter_all_gather", "inter_reduce_scatter", "all_reduce"):
            if data[name] is None:  # one flat network: written as before two levels existed
                del data[name]
        data["op_compute"] = {k: asdict(v) if not isinstance(v, dict) else v for k, v in self.op_compute.items()}
        if self.calibration == Calibration():
            del data["calibration"]  # uncalibrated: the form written before calibration existed
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "device description") -> "DeviceInfo":
        """A DeviceInfo from its ``to_dict`` form; every error names ``where`` and the
        field. (A cluster *file* is a ClusterProfile: ``load_cluster``.)"""
        if not isinstance(data, dict):
            raise OSDPError(f"{where} must be a JSON object describing a device, got {a_type(data)}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"_comment", "sources"}
        if unknown:
            raise OSDPError(f"{where}: unknown device fields {sorted(unknown)}; known: {sorted(known)}")
        missing = {"name", "world_size", "memory_limit_bytes", "all_gather", "reduce_scatter", "flops_per_s"} - set(data)
        if missing:
            raise OSDPError(f"{where} lacks {sorted(missing)}")
        values = {k: v for k, v in data.items() if k in known}
        try:
            for name in ("all_gather", "reduce_scatter"):
                values[name] = CollectiveCost.from_dict(data[name], name)
            for name in ("inter_all_gather", "inter_reduce_scatter", "all_reduce"):
                if data.get(name) is not None:
                    values[name] = CollectiveCost.from_dict(data[name], name)
            values.update(compute_fields_from_dict(data))
            if "calibration" in data:
                values["calibration"] = Calibration.from_dict(data["calibration"])
            return cls(**values)
        except OSDPError as exc:
            raise OSDPError(f"{where}: {exc}") from None
