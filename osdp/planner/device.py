"""Device and cluster information: what the cost model knows about the hardware.

A ``DeviceInfo`` is loaded from JSON (``load_cluster``: a shipped profile name or a
file) or measured by the profiler. All values are SI: seconds, bytes, FLOP/s.

Every field is checked when a ``DeviceInfo`` is made: its type, and > 0 (or >= 0 for
overheads, intercepts and alpha/beta, which may be zero) and finite; an error names the
field and, for a file, the file. Non-negative intercepts are also what the batch sweep's
throughput bound relies on (scheduler.py, [Note: exact batch sweep]).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..errors import OSDPError, a_type
from ..sizes import parse_bytes  # noqa: F401  (re-exported: osdp.planner.device.parse_bytes)

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


def _number(value, name: str, *, positive: bool, integer: bool = False, unit: str = ""):
    """``value`` if it is a finite number (an int when ``integer``; never a bool) that is
    > 0 (``positive``) or >= 0; else OSDPError naming ``name``."""
    kind = "an integer" if integer else "a number"
    bound = ("> 0" if positive else ">= 0") + (f" ({unit})" if unit else "")
    is_type = isinstance(value, numbers.Integral if integer else numbers.Real) and not isinstance(value, bool)
    if not is_type:
        raise OSDPError(f"{name} must be {kind} {bound}, got {value!r} ({a_type(value)})")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise OSDPError(f"{name} must be {kind} {bound}, got {value!r}")
    return value


def _mapping(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise OSDPError(f"{name} must be an object, got {value!r} ({a_type(value)})")
    return value


def _object(value, name: str, required: tuple, optional: tuple = ()) -> dict:
    """A JSON object with the ``required`` keys and maybe the ``optional`` ones."""
    keys = ", ".join(f'"{k}": ...' for k in required)
    if not isinstance(value, dict):
        raise OSDPError(f"{name} must be an object {{{keys}}}, got {value!r} ({a_type(value)})")
    missing = [k for k in required if k not in value]
    unknown = sorted(set(value) - set(required) - set(optional))
    if missing or unknown:
        what = "; ".join(filter(None, (missing and f"lacks {missing}", unknown and f"has unknown keys {unknown}")))
        raise OSDPError(f"{name} {what}; it takes {list(required) + list(optional)}")
    return value


@dataclass(frozen=True)
class CollectiveCost:
    """Ring collective: (N-1) steps, each moving 1/N of the message.

    time(bytes) = (N-1) * alpha_s + (N-1)/N * bytes * beta_s_per_byte
    where ``bytes`` is the size of the full (gathered) tensor and 1/beta is the bus
    bandwidth as nccl-tests reports it."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self):
        _number(self.alpha_s, "alpha_s", positive=False)
        _number(self.beta_s_per_byte, "beta_s_per_byte", positive=False)

    def time_s(self, nbytes: float, world_size: int) -> float:
        if world_size <= 1 or nbytes <= 0:
            return 0.0
        steps = world_size - 1
        return steps * self.alpha_s + steps / world_size * nbytes * self.beta_s_per_byte


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
                _number(value, f.name, positive=False)


@dataclass(frozen=True)
class DeviceInfo:
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

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise OSDPError(f"name must be a string, got {self.name!r} ({a_type(self.name)})")
        _number(self.world_size, "world_size", positive=True, integer=True, unit="data-parallel ranks")
        _number(self.memory_limit_bytes, "memory_limit_bytes", positive=True, unit="bytes per device, e.g. 8589934592 for 8 GiB")
        for name in ("flops_per_s", "memory_bandwidth_bytes_per_s"):
            _number(getattr(self, name), name, positive=True)
        for name in ("op_overhead_s", "slice_overhead_s", "constant_bytes"):
            _number(getattr(self, name), name, positive=False)
        for name in ("all_gather", "reduce_scatter"):
            if not isinstance(getattr(self, name), CollectiveCost):
                raise OSDPError(f"{name} must be a CollectiveCost(alpha_s, beta_s_per_byte), got {getattr(self, name)!r}")
        if not all(isinstance(v, ComputeFit) for v in _mapping(self.op_compute, "op_compute").values()):
            raise OSDPError("op_compute must map op shape keys to ComputeFit entries")
        _mapping(self.split_efficiency, "split_efficiency")
        for g, ratio in self.split_efficiency.items():
            if not (isinstance(g, str) and g.isdigit() and int(g) >= 1):
                raise OSDPError(f"split_efficiency keys are slice counts like \"4\", got {g!r}")
            _number(ratio, f"split_efficiency[{g!r}]", positive=True)
        if not isinstance(self.source, str):
            raise OSDPError(f"source must be a string, got {self.source!r}")

    def with_(self, **changes) -> "DeviceInfo":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        data = asdict(self)
        data["op_compute"] = {k: asdict(v) if not isinstance(v, dict) else v for k, v in self.op_compute.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "device description") -> "DeviceInfo":
        """A DeviceInfo from its JSON form; every error names ``where`` (e.g. the file)
        and the field."""
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
                entry = _object(data[name], name, ("alpha_s", "beta_s_per_byte"))
                values[name] = CollectiveCost(**{k: _number(v, f"{name}.{k}", positive=False) for k, v in entry.items()})
            values["op_compute"] = {}
            for key, entry in _mapping(data.get("op_compute", {}), "op_compute").items():
                entry = _object(entry, f"op_compute[{key!r}]", ("fwd_intercept_s", "fwd_per_sample_s"),
                                ("bwd_intercept_s", "bwd_per_sample_s"))
                checked = {k: v if v is None and k.startswith("bwd") else _number(v, f"op_compute[{key!r}].{k}", positive=False)
                           for k, v in entry.items()}
                values["op_compute"][key] = ComputeFit(**checked)
            _mapping(data.get("split_efficiency", {}), "split_efficiency")
            return cls(**values)
        except OSDPError as exc:
            raise OSDPError(f"{where}: {exc}") from None

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def available_clusters() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_cluster(name_or_path: str) -> DeviceInfo:
    """A shipped profile by name (see ``available_clusters()``) or a JSON file."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise OSDPError(
            f"unknown cluster {name_or_path!r}: not a file, and not one of the shipped "
            f"profiles ({', '.join(available_clusters())})"
        )
    if path.is_dir():
        raise OSDPError(f"cluster {name_or_path!r} is a directory; give a cluster JSON file or a profile name")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise OSDPError(f"cluster file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OSDPError(f"cannot read cluster file {path}: {exc}") from None
    return DeviceInfo.from_dict(data, where=f"cluster file {path}")
