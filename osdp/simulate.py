"""``osdp simulate``: the paper's experiment grid (Section 3), predicted by the cost model.

Three model families at 8 and 16 GiB per device on the paper's cluster profile (the
default cluster, one node of it unless ``world_size`` says otherwise); for each,
the throughput of FSDP full shard and OSDP without and with operator splitting, and the
same with activation checkpointing against FSDP with checkpointing (every block, as the
paper does; "auto" lets the planner choose per block). Ratios are OSDP / FSDP samples/s.
"""
from __future__ import annotations

from .errors import InfeasiblePlanError
from .models import get_preset
from .planner.cost_model import PlannerSettings
from .planner.cluster import DEFAULT_CLUSTER, load_cluster
from .planner.gpt_desc import describe_gpt
from .planner.run import RunSettings
from .planner.scheduler import schedule

FAMILIES = {
    "N&D": ["nd-48x1024", "nd-96x1024", "nd-64x1536"],
    "W&S": ["ws-8x6144", "ws-4x8192", "ws-2x12288"],
    "I&C": ["ic-16x1024-4096", "ic-8x2048-8192"],
}
LIMITS_GIB = (8, 16)
# column -> (settings, baseline column its ratio is taken against)
COLUMNS = {
    "FSDP": (dict(policy="zdp", checkpointing="none"), None),
    "OSDP": (dict(max_slices=1), "FSDP"),
    "OSDP+split": (dict(), "FSDP"),
    "FSDP+ckpt": (dict(policy="zdp", checkpointing="all"), None),
    "OSDP+ckpt": (dict(max_slices=1, checkpointing="all"), "FSDP+ckpt"),
    "OSDP+split+ckpt": (dict(checkpointing="all"), "FSDP+ckpt"),
    "OSDP+split+auto-ckpt": (dict(checkpointing="auto"), "FSDP+ckpt"),
}


def _throughput(desc, device, overrides, backend):
    try:
        return schedule(desc, device, PlannerSettings(**overrides), backend=backend).samples_per_s
    except InfeasiblePlanError:
        return None


def simulate_grid(cluster: str = DEFAULT_CLUSTER, backend: str = "auto", quick: bool = False,
                  world_size: int | None = None):
    """Rows of (family, preset, limit GiB, {column: samples/s or None}); ``world_size``
    None: one node of ``cluster``."""
    hardware = load_cluster(cluster)
    ranks = world_size or hardware.node_size
    rows = []
    for family, presets in FAMILIES.items():
        for preset in presets[:1] if quick else presets:
            desc = describe_gpt(get_preset(preset), name=preset)
            for gib in LIMITS_GIB:
                device = hardware.for_run(RunSettings(world_size=ranks, memory_limit_bytes=gib * 2**30))
                rows.append((family, preset, gib, {c: _throughput(desc, device, s, backend) for c, (s, _) in COLUMNS.items()}))
    return rows


def format_grid(rows) -> str:
    head = f"{'family':<6} {'model':<18} {'GiB':>4} {'FSDP':>9} {'FSDP+ckpt':>10}  " + "  ".join(
        f"{c:>{max(len(c), 6)}}" for c, (_, ref) in COLUMNS.items() if ref
    )
    lines = ["predicted samples/s (FSDP columns) and OSDP / FSDP throughput ratios", head, "-" * len(head)]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for family, preset, gib, values in rows:
        cells = []
        for c, (_, ref) in COLUMNS.items():
            if not ref:
                continue
            mine, theirs = values[c], values[ref]
            if mine is None:
                text = "OOM"
            elif theirs is None:
                text = "fits"  # OSDP trains where FSDP cannot
            else:
                text = f"{mine / theirs:.2f}x"
            cells.append(f"{text:>{max(len(c), 6)}}")
        lines.append(f"{family:<6} {preset:<18} {gib:>4} {fmt(values['FSDP']):>9} {fmt(values['FSDP+ckpt']):>10}  " + "  ".join(cells))
    lines.append("OOM: no plan fits; fits: OSDP fits where the FSDP baseline does not.")
    return "\n".join(lines)


def run_simulation(cluster: str = DEFAULT_CLUSTER, backend: str = "auto", quick: bool = False,
                   world_size: int | None = None) -> str:
    return format_grid(simulate_grid(cluster, backend, quick, world_size))
