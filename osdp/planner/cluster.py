"""Cluster profiles: what the hardware is, apart from what a run asks of it.

    cluster = load_cluster(DEFAULT_CLUSTER)                 # a shipped name or a JSON file
    device = cluster.for_run(RunSettings(world_size=8, memory_limit_bytes=8 * 2**30))

A ``ClusterProfile`` holds the links (α/β per collective, per network level), compute
speed, overheads and memory per device, with the sources of its numbers. It is loaded
from JSON (``load_cluster``: a shipped profile in ``osdp/profiles/`` or a file) or
measured by the profiler (``osdp.profiler.profile``). ``for_run`` derives the ``DeviceInfo`` the
cost model reads.

[Note: hardware apart from the run]
A profile file describes hardware that exists whatever one trains on it; a run
(``RunSettings``, ``run.py``) is a choice made per job: how many data-parallel ranks and
how much memory each may fill. A profile never carries a world size or a memory limit,
and a run never carries link, compute or capacity numbers; ``DeviceInfo`` is the only
place both meet, and it is derived (``ClusterProfile.for_run``), never stored. Defaults
of a run come from the hardware where one is needed (the CLI): one node's worth of ranks
(``node_size``) and all of the device's memory (``device_memory_bytes``).

[Note: link levels]
``links`` maps a level of the network to the α/β of its collectives:

    "links": {"intra": {"all_gather": {"alpha_s": ..., "beta_s_per_byte": ...},
                        "reduce_scatter": {...}},
              "inter": {...}}                       # optional

"intra" is a ring among the ``node_size`` devices of one node (NVLink, PCIe); "inter",
when given, is a ring of one rank per node (a "rail"): its beta is seconds per byte of
ONE rank's share of its node's network (8 ranks with 8 NICs of 400 Gb/s: 1 / 46 GB/s;
8 ranks sharing one 100 GbE NIC: 8 / 11 GB/s), its alpha a step's latency across nodes.
``for_run`` puts "intra" in ``DeviceInfo.all_gather`` / ``reduce_scatter`` and "inter"
in ``inter_all_gather`` / ``inter_reduce_scatter`` with ``node_size``; the cost model
prices a collective whose group spans nodes as the hierarchical ring of [Note: two-level
collective cost] (collective_cost.py), and HSDP (shard within a node, replicate across
nodes) with each level's own alpha/beta. A profile with one level describes one flat
network: every collective is a flat ring on "intra" over all ranks (so every profile was
read before hardware and run were apart, and bench/planner.py still scales the 8-GPU
H100 profile to 256 ranks that way).

[Note: old cluster files]
Files written before the split carry ``world_size``, ``memory_limit_bytes`` and
top-level ``all_gather`` / ``reduce_scatter``. They still load, converted, with an
``OldClusterFormatWarning`` that says what became of each field: ``world_size`` ->
``node_size`` (the devices its one link connected), ``memory_limit_bytes`` ->
``device_memory_bytes`` (what a device offered), both collectives -> ``links.intra``, a
``source`` line -> ``sources["source"]``. The run defaults (``node_size`` ranks, all of
``device_memory_bytes``) then give the world size and memory limit the old file gave, so
``osdp plan --cluster old.json`` plans as before. ``load_cluster(path).save(path)``
writes the converted file. A file that mixes the formats (``links`` and ``all_gather``,
or ``node_size`` and ``world_size``) is refused: the old values are checked first (with
the messages they always had), then the mix is named.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..errors import OldClusterFormatWarning, OSDPError, a_type
from ..sizes import format_bytes
from .checks import check_mapping, check_number, check_object, check_string, read_json_file
from .device import (
    COMPUTE_FIELDS,
    MEMORY_LIMIT_UNIT,
    WORLD_SIZE_UNIT,
    CollectiveCost,
    DeviceInfo,
    check_compute_fields,
    compute_fields_from_dict,
)
from .run import RunSettings

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
DEFAULT_CLUSTER = "titan-rtx-pcie3"  # the paper's testbed (Section 3.1); the CLI's and simulate's default
LINK_LEVELS = ("intra", "inter")  # [Note: link levels]
RUN_FIELDS = ("world_size", "memory_limit_bytes")  # what a profile never holds
REQUIRED_FIELDS = ("name", "node_size", "device_memory_bytes", "links", "flops_per_s")
OLD_FORMAT_FIELDS = RUN_FIELDS + ("all_gather", "reduce_scatter")  # [Note: old cluster files]

_DEVICE_DEFAULTS = {f.name: f.default for f in fields(DeviceInfo)}


@dataclass(frozen=True)
class Link:
    """The collectives over one level of the network (a ring over its devices).
    ``all_reduce`` (optional, "intra" only): a measured all-reduce of a flat buffer (the
    profiler's on gloo, where it is the gradient collective); without it an all-reduce
    is priced as reduce-scatter + all-gather."""

    all_gather: CollectiveCost
    reduce_scatter: CollectiveCost
    all_reduce: CollectiveCost | None = None

    def __post_init__(self):
        for name in ("all_gather", "reduce_scatter"):
            if not isinstance(getattr(self, name), CollectiveCost):
                raise OSDPError(f"{name} must be a CollectiveCost(alpha_s, beta_s_per_byte), got {getattr(self, name)!r}")
        if self.all_reduce is not None and not isinstance(self.all_reduce, CollectiveCost):
            raise OSDPError(f"all_reduce must be a CollectiveCost(alpha_s, beta_s_per_byte) or None, got {self.all_reduce!r}")

    @classmethod
    def from_dict(cls, data, name: str) -> "Link":
        optional = ("all_reduce",) if name == "links.intra" else ()
        entry = check_object(data, name, ("all_gather", "reduce_scatter"), optional)
        return cls(**{k: CollectiveCost.from_dict(v, f"{name}.{k}") for k, v in entry.items()})

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["all_reduce"] is None:  # not measured: written as before it existed
            del data["all_reduce"]
        return data


@dataclass(frozen=True)
class ClusterProfile:
    """One cluster's hardware. ``node_size``: devices per node (those ``links["intra"]``
    connects); ``device_memory_bytes``: memory of one device; ``links``: level ->
    ``Link`` ([Note: link levels]); ``sources``: where the numbers come from (field or
    topic -> text). The compute fields mean what they mean in ``DeviceInfo``."""

    name: str
    node_size: int
    device_memory_bytes: float
    links: dict
    flops_per_s: float
    op_overhead_s: float = _DEVICE_DEFAULTS["op_overhead_s"]
    slice_overhead_s: float = _DEVICE_DEFAULTS["slice_overhead_s"]
    memory_bandwidth_bytes_per_s: float = _DEVICE_DEFAULTS["memory_bandwidth_bytes_per_s"]
    constant_bytes: float = _DEVICE_DEFAULTS["constant_bytes"]
    op_compute: dict = field(default_factory=dict)
    split_efficiency: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

    def __post_init__(self):
        check_string(self.name, "name")
        check_number(self.node_size, "node_size", positive=True, integer=True, unit="devices per node")
        check_number(self.device_memory_bytes, "device_memory_bytes", positive=True,
                     unit="bytes of one device, e.g. 25769803776 for 24 GiB")
        check_mapping(self.links, "links")
        unknown = [k for k in self.links if k not in LINK_LEVELS]
        if unknown:
            raise OSDPError(f"links has unknown levels {unknown}; the levels are 'intra' (within a node of "
                            "node_size devices) and 'inter' (a ring across nodes)")
        if "intra" not in self.links:
            raise OSDPError('links lacks "intra" (the collectives within a node): "links": {"intra": '
                            '{"all_gather": {"alpha_s": ..., "beta_s_per_byte": ...}, "reduce_scatter": {...}}}')
        for level, link in self.links.items():
            if not isinstance(link, Link):
                raise OSDPError(f"links[{level!r}] must be a Link(all_gather, reduce_scatter), got {link!r}")
        check_compute_fields(self)
        for key, text in check_mapping(self.sources, "sources").items():
            if not (isinstance(key, str) and isinstance(text, str)):
                raise OSDPError(f"sources maps a field or topic to where its number comes from (text), got "
                                f"{key!r}: {text!r} ({a_type(text)})")

    # ---- the run -------------------------------------------------------------------------

    def link_for(self, world_size: int) -> Link:
        """The link ``DeviceInfo.all_gather`` / ``reduce_scatter`` hold: "intra" always
        ([Note: link levels]); the level across nodes goes to ``inter_*`` beside it."""
        return self.links["intra"]

    def for_run(self, run: RunSettings) -> DeviceInfo:
        """The ``DeviceInfo`` of ``run`` on this hardware: what the cost model reads."""
        if not isinstance(run, RunSettings):
            raise OSDPError(f"for_run takes RunSettings(world_size=..., memory_limit_bytes=...), got {run!r} "
                            f"({a_type(run)})")
        link = self.link_for(run.world_size)
        inter = self.links.get("inter")
        limit = self.device_memory_bytes if run.memory_limit_bytes is None else run.memory_limit_bytes
        return DeviceInfo(
            name=self.name,
            world_size=run.world_size,
            memory_limit_bytes=limit,
            all_gather=link.all_gather,
            reduce_scatter=link.reduce_scatter,
            source="; ".join(f"{k}: {v}" for k, v in self.sources.items()),
            node_size=self.node_size,
            inter_all_gather=inter.all_gather if inter else None,
            inter_reduce_scatter=inter.reduce_scatter if inter else None,
            all_reduce=link.all_reduce,
            **{k: getattr(self, k) for k in COMPUTE_FIELDS},
        )

    def with_(self, **changes) -> "ClusterProfile":
        """A copy with ``changes`` (None values are left out). A run's fields are refused
        with where they belong instead."""
        moved = [k for k in changes if k in RUN_FIELDS]
        if moved:
            raise OSDPError(f"{', '.join(moved)} belong to a run, not to a cluster profile: give them as "
                            f"cluster.for_run(RunSettings({', '.join(f'{k}=...' for k in moved)}))")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise OSDPError(f"a cluster profile has no fields {unknown}; it has {sorted(known)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    # ---- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["links"] = {level: link.to_dict() for level, link in self.links.items()}
        data["op_compute"] = {k: asdict(v) for k, v in self.op_compute.items()}
        data["split_efficiency"] = dict(self.split_efficiency)
        data["sources"] = dict(self.sources)
        return data

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data, where: str = "cluster profile") -> "ClusterProfile":
        """A profile from its JSON form (an old-format one converted, with a warning: [Note:
        old cluster files]); every error names ``where`` (e.g. the file) and the field."""
        if not isinstance(data, dict):
            raise OSDPError(f"{where} must be a JSON object describing a cluster, got {a_type(data)}")
        converted = None
        try:
            if any(k in data for k in OLD_FORMAT_FIELDS):
                data, converted = _from_old_format(data)
            known = {f.name for f in fields(cls)}
            unknown = set(data) - known - {"_comment"}
            if unknown:
                raise OSDPError(f"unknown cluster fields {sorted(unknown)}; known: {sorted(known)}")
            missing = [k for k in REQUIRED_FIELDS if k not in data]
            if missing:
                raise OSDPError(f"lacks {missing}")
            values = {k: v for k, v in data.items() if k in known}
            values["links"] = {level: Link.from_dict(entry, f"links.{level}") if level in LINK_LEVELS else entry
                               for level, entry in check_mapping(data["links"], "links").items()}
            values.update(compute_fields_from_dict(data))
            profile = cls(**values)
        except OSDPError as exc:
            # "cluster file F: node_size must be ...", but "cluster file F lacks [...]"
            text = str(exc)
            raise OSDPError(f"{where}{' ' if text.startswith(('lacks ', 'is ')) else ': '}{text}") from None
        if converted:
            warnings.warn(f"{where} {converted}", OldClusterFormatWarning, stacklevel=3)
        return profile


def _from_old_format(data: dict) -> tuple[dict, str]:
    """The current form of an old-format file and what the conversion did, in words
    ([Note: old cluster files])."""
    old = [k for k in OLD_FORMAT_FIELDS if k in data]
    if "world_size" in data:
        check_number(data["world_size"], "world_size", positive=True, integer=True, unit=WORLD_SIZE_UNIT)
    if "memory_limit_bytes" in data:
        check_number(data["memory_limit_bytes"], "memory_limit_bytes", positive=True, unit=MEMORY_LIMIT_UNIT)
    for name in ("all_gather", "reduce_scatter"):
        if name in data:
            CollectiveCost.from_dict(data[name], name)
    becomes = {"world_size": "node_size", "memory_limit_bytes": "device_memory_bytes",
               "all_gather": "links", "reduce_scatter": "links"}
    mixed = [(k, becomes[k]) for k in old if becomes[k] in data]
    if mixed:
        old_key, new_key = mixed[0]
        if old_key in RUN_FIELDS:
            raise OSDPError(f"{old_key} is a run setting, not hardware (this file has {new_key}, so it is in the "
                            f"current format): remove {old_key} and give it to the run (RunSettings({old_key}=...), "
                            f"or --world-size / --memory)")
        raise OSDPError(f"{old_key} belongs under links.intra in the current format (this file has links): "
                        f"move it there")
    missing = [k for k in OLD_FORMAT_FIELDS if k not in data]
    if missing:
        raise OSDPError(f"is in the old format (it has {old}) but lacks {missing}; the current format has "
                        f"node_size, device_memory_bytes and links instead (see osdp/profiles/*.json)")
    new = {k: v for k, v in data.items() if k not in OLD_FORMAT_FIELDS and k != "source"}
    new["node_size"] = data["world_size"]
    new["device_memory_bytes"] = data["memory_limit_bytes"]
    new["links"] = {"intra": {"all_gather": data["all_gather"], "reduce_scatter": data["reduce_scatter"]}}
    if data.get("source"):
        sources = data.get("sources", {})
        new["sources"] = {**sources, "source": data["source"]} if isinstance(sources, dict) else sources
    said = (f"is in the old format, which mixes a run into the hardware; it was read as: world_size "
            f"{data['world_size']} -> node_size, memory_limit_bytes {format_bytes(data['memory_limit_bytes'])} -> "
            f"device_memory_bytes, all_gather/reduce_scatter -> links.intra. A run's world size and memory limit "
            f"now default to those (give others with RunSettings(world_size=..., memory_limit_bytes=...) or "
            f"--world-size / --memory); write the file in the current format with "
            f"osdp.planner.load_cluster(path).save(path)")
    return new, said


def available_clusters() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_cluster(name_or_path: str = DEFAULT_CLUSTER) -> ClusterProfile:
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
    data = read_json_file(path, "cluster file")
    return ClusterProfile.from_dict(data, where=f"cluster file {path}")
