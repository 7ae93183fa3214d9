"""Device and cluster information: what the cost model knows about the hardware.

A ``DeviceInfo`` is loaded from JSON (``load_cluster``: a shipped profile name or a
file) or measured by the profiler. All values are SI: seconds, bytes, FLOP/s.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..errors import OSDPError

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class CollectiveCost:
    """Ring collective: (N-1) steps, each moving 1/N of the message.

    time(bytes) = (N-1) * alpha_s + (N-1)/N * bytes * beta_s_per_byte
    where ``bytes`` is the size of the full (gathered) tensor and 1/beta is the bus
    bandwidth as nccl-tests reports it."""

    alpha_s: float
    beta_s_per_byte: float

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
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise OSDPError(f"world size must be a positive integer, got {self.world_size!r}")
        if not self.memory_limit_bytes > 0:
            raise OSDPError(
                f"memory limit must be positive, got {self.memory_limit_bytes!r} bytes "
                "(give it like 8GiB or 16000000000)"
            )
        if not self.flops_per_s > 0:
            raise OSDPError(f"flops_per_s must be positive, got {self.flops_per_s!r}")
        for coll in (self.all_gather, self.reduce_scatter):
            if coll.alpha_s < 0 or coll.beta_s_per_byte < 0:
                raise OSDPError("collective alpha/beta must be >= 0")

    def with_(self, **changes) -> "DeviceInfo":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        data = asdict(self)
        data["op_compute"] = {k: asdict(v) if not isinstance(v, dict) else v for k, v in self.op_compute.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceInfo":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"_comment", "sources"}
        if unknown:
            raise OSDPError(f"unknown device fields {sorted(unknown)}; known: {sorted(known)}")
        missing = {"name", "world_size", "memory_limit_bytes", "all_gather", "reduce_scatter", "flops_per_s"} - set(data)
        if missing:
            raise OSDPError(f"device description lacks {sorted(missing)}")
        values = {k: v for k, v in data.items() if k in known}
        try:
            values["all_gather"] = CollectiveCost(**data["all_gather"])
            values["reduce_scatter"] = CollectiveCost(**data["reduce_scatter"])
            values["op_compute"] = {k: ComputeFit(**v) for k, v in data.get("op_compute", {}).items()}
        except TypeError as exc:
            raise OSDPError(f"malformed collective or compute entry: {exc}") from None
        return cls(**values)

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
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise OSDPError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise OSDPError(f"{path} must hold a JSON object describing a device")
    return DeviceInfo.from_dict(data)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text) -> float:
    """'8GiB', '16GB', '512MiB', '1e9' -> bytes."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        raw = str(text).strip().lower().replace(" ", "")
        number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = raw[len(number):]
        if unit not in _UNITS or not number:
            raise OSDPError(f"cannot read memory size {text!r}; write it like 8GiB, 16GB or 512MiB")
        try:
            value = float(number) * _UNITS[unit]
        except ValueError:
            raise OSDPError(f"cannot read memory size {text!r}; write it like 8GiB, 16GB or 512MiB") from None
    if not value > 0:
        raise OSDPError(f"memory size must be positive, got {text!r}")
    return value
