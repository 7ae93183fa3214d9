"""ShardLayout: which ranks a unit is sharded over, replicated over, and re-gathered
from within a node; one process group per level.

[Note: shard layout]
A layout is a 2-D grid of ranks ``(replicate, shard)``:

- ``shard``: the ranks one unit's flat buffer is sharded over (``ShardUnit`` sees only
  this level: its rank and size are the shard group's). Gathers for forward, and for
  backward in ``zdp``, run here; gradients are reduced here first.
- ``replicate``: ranks holding the same shard (HSDP). After the shard-level reduction
  each rank all-reduces its reduced shard across its replicas; the sum is divided by the
  whole layout's size, so the result is the gradient of the mean loss over every
  rank's batch (the same as one process training on the global batch).
- ``node``: the shard group cut into nodes of ``node_size`` consecutive shard ranks; an
  ``hpz`` unit keeps a copy sharded over its node after forward and re-gathers from it
  over this group in backward (see [Note: modes per level] in ``osdp/contract.py``).
  Which piece a rank keeps is its rank in the node group, so the node group's rank
  order never has to match the shard group's.
- ``world``: all ranks of the layout; configuration checks, checkpoints and
  ``sync_module_states`` run here.

A process group (or none: the default group) is the 1-D layout: ``shard`` is that
group, ``replicate`` has one rank. A ``DeviceMesh`` with dims ``("replicate", "shard")``
is the 2-D layout (HSDP); a 1-D ``DeviceMesh`` is a process group.

``node_size``: given, or ``LOCAL_WORLD_SIZE`` (set by torchrun) when that divides the
shard group into whole nodes (else its gcd with the shard group size: the part of a
node that a shard group of consecutive ranks covers), else the shard group size (one
node: ``hpz`` is ``zdp``). An explicit ``node_size`` must divide the shard group size.
Node groups are created only where a node has 2 ranks or more and is smaller than the
shard group (else the node level is the shard group, or a single rank).
"""
from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from ..contract import effective_mode
from ..errors import OSDPError


class Level(NamedTuple):
    """One level of the layout: its process group, this rank's rank in it, its size and
    its members (global ranks, in group-rank order)."""

    name: str
    group: object  # a ProcessGroup, or None for a 1-rank level that has none
    rank: int
    size: int
    ranks: tuple[int, ...]


def _level(name: str, group) -> Level:
    ranks = tuple(dist.get_process_group_ranks(group))
    return Level(name, group, dist.get_rank(group), len(ranks), ranks)


def _single(name: str) -> Level:
    return Level(name, None, 0, 1, (dist.get_rank(),))


def group_over_ranks_of(group, *, backend: str, timeout_s: float):
    """A new process group of ``group``'s ranks beside it, with its own ``backend`` and
    ``timeout_s``, created by those ranks only (each calls it alike): the lockstep
    check's gloo group, the compiled path's group bounded by ``timeout_s``."""
    return dist.new_group(dist.get_process_group_ranks(group), backend=backend,
                          timeout=timedelta(seconds=timeout_s), use_local_synchronization=True)


def _subgroup(ranks: list[int]):
    """A process group of exactly ``ranks``: one that exists already (a DeviceMesh's, or
    an earlier layout's), else a new one created by its members only. Reusing one saves
    a communicator (NCCL's take device memory). (torch names a group created with local
    synchronization by a hash of its ranks and of how many groups the process has made,
    so a new one rendezvous only if its members have made as many groups each: true of
    OSDP's, which every member makes alike.)"""
    ranks = sorted(ranks)
    from torch.distributed import distributed_c10d as c10d

    for group, members in list(c10d._world.pg_group_ranks.items()):
        if group is not c10d.GroupMember.NON_GROUP_MEMBER and sorted(members) == ranks:
            return group
    return dist.new_group(ranks=ranks, use_local_synchronization=True)


class ShardLayout:
    """See [Note: shard layout]. Build with :meth:`from_arg`."""

    def __init__(self, world: Level, shard: Level, replicate: Level, node: Level):
        self.world = world
        self.shard = shard
        self.replicate = replicate
        self.node = node

    @property
    def node_size(self) -> int:
        return self.node.size

    @property
    def is_hierarchical(self) -> bool:
        """Whether there is more than one level of communication (HSDP or hpZ nodes)."""
        return self.replicate.size > 1 or 1 < self.node.size < self.shard.size

    def effective_mode(self, mode: str) -> str:
        """What a unit in ``mode`` does on this layout (``contract.effective_mode``)."""
        return effective_mode(mode, self.node.size, self.shard.size)

    def level(self, name: str) -> Level:
        return {"world": self.world, "shard": self.shard, "replicate": self.replicate, "node": self.node}[name]

    def describe(self) -> str:
        return (f"{self.replicate.size} replica(s) x shard group of {self.shard.size} "
                f"({self.shard.size // self.node.size} node(s) of {self.node.size})")

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def flat(cls, group) -> "ShardLayout":
        """The 1-D layout of ``group`` with one node (creates no process group)."""
        shard = _level("shard", group)
        return cls(shard._replace(name="world"), shard, _single("replicate"), shard._replace(name="node"))

    @classmethod
    def from_arg(cls, process_group=None, mesh=None, node_size: int | None = None) -> "ShardLayout":
        """The layout of ``mesh`` (a DeviceMesh) or ``process_group`` (None: the default
        group); OSDPError for what cannot be a layout. ``mesh`` may also be a ShardLayout
        already built (the profiler wraps copies of a model on the layout it runs on)."""
        if isinstance(mesh, ShardLayout) and process_group is None and node_size in (None, mesh.node_size):
            return mesh
        if mesh is not None and process_group is not None:
            raise OSDPError("give either process_group= (1-D) or mesh= (a DeviceMesh), not both")
        if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1):
            raise OSDPError(f"node_size must be an integer >= 1 (ranks per node), got {node_size!r}")
        if mesh is None:
            group = process_group if process_group is not None else dist.group.WORLD
            shard = _level("shard", group)
            return cls._with_nodes(shard, shard._replace(name="world"), _single("replicate"), node_size)
        return cls._from_mesh(mesh, node_size)

    @classmethod
    def _from_mesh(cls, mesh, node_size):
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise OSDPError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            group = mesh.get_group(0)
            shard = _level("shard", group)
            return cls._with_nodes(shard, shard._replace(name="world"), _single("replicate"), node_size)
        if mesh.ndim != 2 or names != ("replicate", "shard"):
            raise OSDPError(
                f"mesh has dims {names or mesh.ndim}; OSDP takes a 1-D mesh or a 2-D mesh with dims "
                "('replicate', 'shard') (init_device_mesh(device, (replicas, shard_size), "
                "mesh_dim_names=('replicate', 'shard')))"
            )
        shard = _level("shard", mesh.get_group("shard"))
        replicate = _level("replicate", mesh.get_group("replicate"))
        ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
        if ranks == list(range(dist.get_world_size())):
            world = _level("world", dist.group.WORLD)
        else:
            world = _level("world", _subgroup(ranks))
        return cls._with_nodes(shard, world, replicate, node_size)

    @classmethod
    def _with_nodes(cls, shard: Level, world: Level, replicate: Level, node_size) -> "ShardLayout":
        n = _node_size(shard.size, node_size)
        if n == shard.size:
            node = shard._replace(name="node")
        elif n == 1:
            node = _single("node")
        else:
            first = shard.rank // n * n
            members = [shard.ranks[i] for i in range(first, first + n)]
            node = _level("node", _subgroup(members))
        return cls(world, shard, replicate, node)

    def __repr__(self) -> str:
        return f"ShardLayout({self.describe()})"


def _node_size(shard_size: int, given: int | None) -> int:
    """See [Note: shard layout]."""
    if given is not None:
        if shard_size % given:
            raise OSDPError(
                f"node_size={given} does not divide the shard group of {shard_size} ranks into whole nodes; "
                f"give a divisor of {shard_size} (ranks per node within the shard group)"
            )
        return given
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) >= 1:
        return math.gcd(int(local), shard_size)
    return shard_size
