"""What one training run asks of a cluster: ``RunSettings``.

The hardware is a ``ClusterProfile`` (``cluster.py``); a run says how many data-parallel
ranks it uses and how much memory each may fill. ``ClusterProfile.for_run(run)`` puts the
two together into the ``DeviceInfo`` the cost model reads. A run never carries link,
compute or memory-capacity numbers; a profile never carries a world size or a memory
limit (see [Note: hardware apart from the run] in ``cluster.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .checks import check_number
from .device import MEMORY_LIMIT_UNIT, WORLD_SIZE_UNIT


@dataclass(frozen=True)
class RunSettings:
    """``world_size``: data-parallel ranks (the ring every collective runs over).
    ``memory_limit_bytes``: what each device may hold, in bytes (a number; parse text
    like "8GiB" with ``osdp.sizes.parse_bytes``); None: all of the device's memory
    (``ClusterProfile.device_memory_bytes``)."""

    world_size: int
    memory_limit_bytes: float | None = None

    def __post_init__(self):
        check_number(self.world_size, "world_size", positive=True, integer=True, unit=WORLD_SIZE_UNIT)
        if self.memory_limit_bytes is not None:
            check_number(self.memory_limit_bytes, "memory_limit_bytes", positive=True, unit=MEMORY_LIMIT_UNIT)

    def with_(self, **changes) -> "RunSettings":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})
