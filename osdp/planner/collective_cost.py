"""What one collective over a shard group costs when the group spans nodes.

``collectives(device, layout)`` gives the cost model (and the step simulation) the
seconds of the three collectives a unit issues, for the run's sharding layout:

    gather_s(nbytes)       all-gather of a unit's full weights over its shard group
    node_gather_s(nbytes)  all-gather within one node (hpz: the backward re-gather from
                           the copy sharded within the node)
    grad_s(nbytes)         the gradient collective: reduce-scatter over the shard group
                           (HSDP: + all-reduce of the 1/shard piece across replicas)

and ``shard_ranks``: over how many ranks parameters, gradients and optimizer state are
sharded (1/shard_ranks of every unit at rest).

[Note: sharding layouts]
``"full"``: one shard group of all N ranks (FSDP2 ``fully_shard`` on a 1-D mesh, ZeRO-3).
``"hsdp"``: shard within a node (m = ``node_size`` ranks), replicate across the r = N/m
nodes (FSDP2 HSDP on a 2-D mesh ("replicate", "shard")). The layout is one choice for
the whole plan (``PlannerSettings.layout``); the modes stay per unit and per slice:
``dp``, ``zdp`` and, under "full" across nodes, ``hpz`` ([Note: hpz mode] in
docs/design/cost_model.md). Under "hsdp" every gather is already within the node, so ``hpz`` would
be ``zdp`` and is not offered.

[Note: two-level collective cost]
A run on a profile with an "inter" link and more ranks than one node (N = n m, n nodes
of m = ``node_size`` ranks) times a collective over all N ranks as the hierarchical
ring NCCL approaches with one ring per NIC ("rails"): rank j of every node talks to rank
j of the other nodes over its own share of the node's network, and within a node over
NVLink / PCIe. An all-gather of S bytes (the full tensor; every rank starts with S/N):

  phase 1, across nodes: the m rails (one per local rank j) all-gather in parallel, each
      a ring of n ranks over the inter link; rail j gathers the n shards of the S/m
      bytes it serves, so, by the ring formula with S/m bytes over n ranks,
          T_e = (n-1) a_e + (n-1)/n * (S/m) * b_e
  phase 2, within each node: a ring of m ranks, each now holding S/m, gathers S:
          T_a = (m-1) a_a + (m-1)/m * S * b_a

  AG(S) = T_e + T_a.   A reduce-scatter runs the phases in the reverse order (within
  the node on S, then across nodes on S/m): the same formula with the reduce-scatter's
  a/b. b_e is seconds per byte of ONE rank's share of its node's network (for 8 ranks and
  8 NICs of 400 Gb/s: 1 / 46 GB/s; for 8 ranks and one 100 GbE NIC: 8 / 11 GB/s), a_e a
  step's latency across nodes; a_a, b_a those of the intra-node ring (``CollectiveCost``).

Checks: n = 1 gives the intra ring, m = 1 the ring over the inter link. The phases are
summed, not overlapped: a two-phase algorithm waits for phase 1 before it forwards in
phase 2; NCCL pipelines its flat ring in chunks, but its ring then carries (N-1)/N * S/m
bytes through every NIC instead of (n-1)/n * S/m, and the sum reproduces the one public
figure at hand: nccl-tests all_gather over 32 nodes of 8 H100 with 8x400 Gb/s NDR, 2 GiB,
~200 GB/s bus bandwidth (NVIDIA/nccl issue 1218); with the h100-ib-ndr profile,
AG(2 GiB) = 5.9 ms across + 5.3 ms within, bus bandwidth (N-1)/N * S / AG = 191 GB/s
(the overlapped max would claim 360 GB/s). The latency part
is (n-1) a_e + (m-1) a_a, not (N-1) a: the flat ring's N-1 steps would price 1024 ranks'
gathers at ~1000 latencies each, which NCCL's rings-per-rail layout avoids.

Replicated units ([Note: replicated units] in osdp/contract.py) all-reduce their whole
gradient over EVERY rank of the run, whatever the layout (``all_reduce_s``): one flat
ring over the N ranks (the measured ``DeviceInfo.all_reduce`` where there is one, else a
ring reduce-scatter + all-gather), or across nodes the hierarchical all-reduce: within
the node on G, across nodes the 1/m piece (the m rails in parallel), within again:
    AR(G) = AR_a(G; m) + RS_e(G/m; n) + AG_e(G/m; n)
Both are a latency plus bytes times a rate (``all_reduce_terms``), so a bucket of
several units' gradients costs one latency and the sum of their bandwidth terms.

HSDP (shard = node, r = n replicas): gathers are one intra ring of m ranks; gradients
are reduce-scattered within the node and the 1/m piece all-reduced across the r
replicas (the m rails in parallel), a ring all-reduce = reduce-scatter + all-gather:
    grad(G) = RS_a(G; m) + RS_e(G/m; r) + AG_e(G/m; r)
A profile without an "inter" link describes one flat network: "full" is then today's
flat ring over all N ranks on the intra link ([Note: link levels] in cluster.py) and
HSDP's all-reduce across replicas runs on that same link.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..contract import LAYOUTS  # [Note: sharding layouts]
from ..errors import OSDPError
from .device import CollectiveCost, DeviceInfo



def ring_s(cost: CollectiveCost, nbytes: float, ranks: int) -> float:
    """One flat ring over ``ranks`` ranks (``CollectiveCost.time_s``)."""
    return cost.time_s(nbytes, ranks)


def two_level_s(intra: CollectiveCost, inter: CollectiveCost, nbytes: float, nodes: int, per_node: int) -> float:
    """A collective of ``nbytes`` (the full tensor) over ``nodes`` x ``per_node`` ranks
    as the hierarchical ring of [Note: two-level collective cost]."""
    if nbytes <= 0:
        return 0.0
    return inter.time_s(nbytes / per_node, nodes) + intra.time_s(nbytes, per_node)


def all_reduce_s(reduce_scatter: CollectiveCost, all_gather: CollectiveCost, nbytes: float, ranks: int) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather of the same bytes."""
    return reduce_scatter.time_s(nbytes, ranks) + all_gather.time_s(nbytes, ranks)


def spans_nodes(device: DeviceInfo) -> bool:
    """Whether the run's ranks fill more than one node of the profile."""
    return device.node_size is not None and device.world_size > device.node_size


@dataclass(frozen=True)
class Collectives:
    """The collectives of one run under one layout ([Note: two-level collective cost])."""

    device: DeviceInfo
    layout: str = "full"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise OSDPError(f"layout {self.layout!r} unknown; use one of {LAYOUTS} (\"full\": one shard group of "
                            "all ranks; \"hsdp\": shard within a node, replicate across nodes)")
        d = self.device
        if spans_nodes(d) and d.world_size % d.node_size:
            raise OSDPError(f"world_size {d.world_size} is not a whole number of nodes of {d.node_size} ranks: "
                            f"give a multiple of {d.node_size} (the profile's node_size) to plan across nodes")

    # ---- the group shape ---------------------------------------------------------------
    @property
    def per_node(self) -> int:
        """m: ranks per node the run fills (all of them when it fits in one node)."""
        d = self.device
        return d.node_size if spans_nodes(d) else d.world_size

    @property
    def nodes(self) -> int:
        return self.device.world_size // self.per_node

    @property
    def two_level(self) -> bool:
        """Whether a collective over all ranks crosses an "inter" link."""
        return self.nodes > 1 and self.device.inter_all_gather is not None

    @property
    def shard_ranks(self) -> int:
        """Ranks a unit is sharded over at rest."""
        return self.per_node if self.layout == "hsdp" else self.device.world_size

    @property
    def hpz_available(self) -> bool:
        """hpz differs from zdp only when the full shard group crosses nodes."""
        return self.layout == "full" and self.nodes > 1

    # ---- the collectives ---------------------------------------------------------------
    @property
    def comm_scale(self) -> float:
        """Measured over profiled collective seconds (the calibration's ``comm_scale``:
        in a training step the collectives share the machine with compute)."""
        return self.device.calibration.comm_scale

    def gather_s(self, nbytes: float) -> float:
        d = self.device
        if self.layout == "hsdp":
            seconds = ring_s(d.all_gather, nbytes, self.per_node)
        elif self.two_level:
            seconds = two_level_s(d.all_gather, d.inter_all_gather, nbytes, self.nodes, self.per_node)
        else:
            seconds = ring_s(d.all_gather, nbytes, d.world_size)
        return seconds * self.comm_scale

    def node_gather_s(self, nbytes: float) -> float:
        return ring_s(self.device.all_gather, nbytes, self.per_node) * self.comm_scale

    def all_reduce_terms(self) -> tuple[float, float]:
        """(latency seconds, seconds per byte) of an all-reduce of a flat buffer over
        every rank of the run (replicas included): replicated units' gradient collective
        (see [Note: two-level collective cost]). 0 seconds on one rank."""
        d = self.device

        def ring(ranks: int) -> tuple[float, float]:  # within the intra link
            if ranks <= 1:
                return 0.0, 0.0
            costs = (d.all_reduce,) if d.all_reduce is not None else (d.reduce_scatter, d.all_gather)
            return ((ranks - 1) * sum(c.alpha_s for c in costs),
                    (ranks - 1) / ranks * sum(c.beta_s_per_byte for c in costs))

        if not self.two_level:
            lat, rate = ring(d.world_size)
        else:
            m, n = self.per_node, self.nodes
            lat, rate = ring(m)
            inter = (d.inter_reduce_scatter, d.inter_all_gather)
            lat += (n - 1) * sum(c.alpha_s for c in inter)
            rate += (n - 1) / n / m * sum(c.beta_s_per_byte for c in inter)
        return lat * self.comm_scale, rate * self.comm_scale

    def all_reduce_s(self, nbytes: float) -> float:
        """An all-reduce of ``nbytes`` over every rank of the run (``all_reduce_terms``)."""
        if nbytes <= 0:
            return 0.0
        lat, rate = self.all_reduce_terms()
        return lat + rate * nbytes

    def grad_s(self, nbytes: float) -> float:
        d = self.device
        if self.layout == "hsdp":
            within = ring_s(d.reduce_scatter, nbytes, self.per_node)
            rs = d.inter_reduce_scatter or d.reduce_scatter
            ag = d.inter_all_gather or d.all_gather
            seconds = within + all_reduce_s(rs, ag, nbytes / self.per_node, self.nodes)
        elif self.two_level:
            seconds = two_level_s(d.reduce_scatter, d.inter_reduce_scatter, nbytes, self.nodes, self.per_node)
        else:
            seconds = ring_s(d.reduce_scatter, nbytes, d.world_size)
        return seconds * self.comm_scale


def latency_s(seconds_for) -> float:
    """The latency of a collective whose time for n bytes is ``seconds_for(n)``: every
    collective here costs latency + bytes x seconds per byte (per level, summed), so
    its value at 0 bytes, read off two sizes (at 0 itself it is 0: nothing is sent)."""
    return max(0.0, 2.0 * seconds_for(1.0) - seconds_for(2.0))


def collectives(device: DeviceInfo, layout: str = "full") -> Collectives:
    return Collectives(device, layout)
