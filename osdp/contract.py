"""What the planner and the runtime must agree on. Both import this module; neither
imports the other (the planner prices what the runtime does, so every rule the price
depends on is written here, once).

- the modes a unit (or slice) runs in, and what ``hpz`` becomes on a given layout;
- how a split cuts an axis into slices;
- how many reduce-scatters are in flight, and so how many unsharded gradients live;
- which small units share one collective;
- which collective reduces gradients on which backend;
- the runtime's default prefetch window when no plan gives one;
- :class:`RuntimeConfig`: the typed description of a plan that the runtime executes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

MODE_DP = "dp"  # keep the gathered weights from forward to backward
MODE_ZDP = "zdp"  # free them after forward, gather again for backward
MODE_HPZ = "hpz"  # keep a copy sharded within the node, gather from it for backward
MODES = (MODE_DP, MODE_ZDP, MODE_HPZ)

# [Note: modes per level]
# | mode  | after forward                 | backward gather           | comm per step (shard level / node level) |
# |-------|-------------------------------|---------------------------|------------------------------------------|
# | dp    | gathered weights kept (P)     | none                      | 1 AG + 1 RS / -                          |
# | zdp   | freed                         | over the shard group      | 2 AG + 1 RS / -                          |
# | hpz   | a copy sharded within the     | over the node group (the  | 1 AG + 1 RS / 1 AG                       |
# |       | node kept (P / node_size)     | fast link)                |                                          |
# (P: the unit's gathered bytes.) The shard group is cut into nodes of ``node_size``
# consecutive shard ranks (runtime/mesh.py). On a layout where that cut is trivial,
# hpz is exactly one of the other two (:func:`effective_mode`): ``node_size`` equal to
# the shard group size (the shard group lies within one node, e.g. HSDP with a node per
# shard group) makes the node group the shard group, so hpz IS zdp (free, gather again
# over the shard group, which is the intra-node link); ``node_size == 1`` would keep a
# copy sharded over one rank, i.e. the whole P, and gather nothing: that IS dp. With a
# replicate dimension (HSDP) every mode's gradient is reduced within the shard group and
# then all-reduced across the replicas (1 all-reduce per unit on the replicate level).


def effective_mode(mode: str, node_size: int, shard_size: int) -> str:
    """What ``mode`` does on a layout whose shard group has ``shard_size`` ranks cut into
    nodes of ``node_size``: see [Note: modes per level]."""
    if mode != MODE_HPZ:
        return mode
    if node_size >= shard_size:
        return MODE_ZDP
    if node_size <= 1:
        return MODE_DP
    return MODE_HPZ

# [Note: unsharded gradients] in runtime/reduce.py: issuing a reduce-scatter beyond this
# waits for the oldest, so at most MAX_INFLIGHT_REDUCE_SCATTERS + 1 units' unsharded
# gradients are live (the one being computed and those being reduced)
MAX_INFLIGHT_REDUCE_SCATTERS = 1
UNSHARDED_GRADS_LIVE = MAX_INFLIGHT_REDUCE_SCATTERS + 1

# [Note: coalesced small units] in runtime/prefetch.py
DEFAULT_COALESCE_BYTES = 64 * 1024
SMALL_UNIT_FRACTION = 4  # small: gathered bytes <= coalesce_bytes // SMALL_UNIT_FRACTION


def is_small_unit(gathered_bytes: float, coalesce_bytes: int, is_slice: bool) -> bool:
    """Whether a unit shares its collectives with other small units."""
    return coalesce_bytes > 0 and not is_slice and gathered_bytes <= coalesce_bytes // SMALL_UNIT_FRACTION


def split_sizes(length: int, g: int) -> list[int]:
    """Sizes of ``g`` slices of ``length``: as even as possible, the first ``length % g``
    slices one larger (like ``torch.tensor_split``)."""
    base, extra = divmod(length, g)
    return [base + (i < extra) for i in range(g)]


def gradient_collective(device_type: str) -> str:
    """``"reduce_scatter"``, or ``"all_reduce"`` on gloo (CPU), where it is the faster
    one at unit sizes (see [Note: gloo reduce-scatter] in runtime/collectives.py);
    ``OSDP_GLOO_REDUCE_SCATTER=1`` forces reduce-scatter there."""
    if device_type != "cuda" and os.environ.get("OSDP_GLOO_REDUCE_SCATTER", "0") != "1":
        return "all_reduce"
    return "reduce_scatter"


def default_prefetch_bytes(largest_unit_gathered_bytes: int) -> int:
    """The window without a plan: the next unit's gather may run while one computes."""
    return 2 * int(largest_unit_gathered_bytes)


@dataclass(frozen=True)
class RuntimeConfig:
    """A plan as the runtime executes it (``Plan.runtime_config()``); built by hand for
    plans the planner did not make. Unit names are module paths."""

    unit_modes: dict[str, tuple[str, ...]]  # per-slice modes; the length is the slice count
    split_ops: dict[str, str] = field(default_factory=dict)  # split unit -> registered op name
    prefetch_bytes: int | None = None  # None: default_prefetch_bytes
    checkpoint_blocks: tuple[str, ...] = ()
    world_size: int | None = None  # None: any
    batch_size: int | None = None  # per device; None: not bounded
    accumulation_steps: int = 1
    gradient_sync: str = "last"  # "last" or "every" micro-batch
    fingerprint: str | None = None
    model_name: str = "?"
    unit_param_bytes: dict[str, int] = field(default_factory=dict)  # what the plan priced
    param_dtype_bytes: int | None = None  # None: the model's own dtype
    reduce_dtype_bytes: int | None = None
