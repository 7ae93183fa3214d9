"""What the planner and the runtime must agree on. Both import this module; neither
imports the other (the planner prices what the runtime does, so every rule the price
depends on is written here, once).

- the modes a unit (or slice) runs in, and what ``hpz`` becomes on a given layout;
- how a split cuts an axis into slices;
- how many reduce-scatters are in flight, and so how many unsharded gradients live;
- which small units share one collective;
- which collective reduces gradients on which backend;
- the runtime's default prefetch window when no plan gives one;
- the sharding layouts a plan is made for (``LAYOUTS``) and how a plan's layout must
  match the one it runs on, [Note: plan and layout];
- :class:`RuntimeConfig`: the typed description of a plan that the runtime executes;
- how a weight shared by two modules (a tied embedding and LM head) is named and split,
  [Note: tied row split].

The scheduling DECISIONS built on these constants (the prefetch walk, which small units
ride along, when a coalesced reduction or a replicated bucket is issued, how many stay in
flight) are functions in ``osdp/schedule_rules.py`` (torch-free), called by the runtime
and by the planner's step simulation alike.

[Note: tied row split]
A weight shared by two modules (GPT's ``lm_head.weight is wte.weight``) is ONE unit,
named after its owner: the first module in ``named_modules()`` order holding it
(``wte``). The other module is its *tied use* (``lm_head``): it owns no unit.
Splitting the pair cuts the one weight into g slices ``wte[0] .. wte[g-1]``, each its
own unit with its own mode, and both uses compute on those same slices: the owner with
its split op (``embedding_rows``, a lookup), the tied use with the owner op's
``tied_use_op`` (``linear_out_features``: logits block i = ``x @ W_i^T``), which must cut
the shared weight identically (the runtime checks it slice by slice).

In a :class:`RuntimeConfig`: ``unit_modes["wte"]`` holds the per-slice modes (its length
is g), ``split_ops["wte"]`` the owner's op (may be left out when it is the default of
its type), ``tied_uses["lm_head"] = "wte"`` marks the tied use (checked against the
model). The tied use has no modes of its own: ``splits=`` / ``modes=`` given by hand
for ``lm_head`` (or ``lm_head[i]``) are moved onto ``wte`` (different ones for both are
an error); ``split_ops["lm_head"]`` may name another op for the tied use.

What it costs (what the planner prices): every call of either module is one use of
each slice. The lookup's backward reads no weights, the head's does: a ``dp`` slice is
kept from the head's forward to the head's backward only (not from the lookup), a
``zdp`` slice is gathered again for the head's backward. Per step and slice: dp 2
all-gathers (lookup forward, head forward), zdp 3 (and head backward), 1
reduce-scatter. Gradients of both uses are summed per slice before that single
reduce-scatter: the head's backward (first, in a GPT) writes dW_i into the slice's
unsharded gradient buffer, the lookup's backward (last) adds its rows, and the slice is
reduced after its last use. So from the head's backward to the lookup's backward all g
slices' unsharded gradients are live (the whole weight's gradient, in reduce dtype).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import ConfigError

MODE_DP = "dp"  # keep the gathered weights from forward to backward
MODE_ZDP = "zdp"  # free them after forward, gather again for backward
MODE_HPZ = "hpz"  # keep a copy sharded within the node, gather from it for backward
MODE_REP = "rep"  # replicated, as DDP: whole on every rank, never gathered, all-reduced
MODES = (MODE_DP, MODE_ZDP, MODE_HPZ, MODE_REP)
SHARDED_MODES = (MODE_DP, MODE_ZDP, MODE_HPZ)  # the modes a slice of a split unit may take

# [Note: replicated units]
# A ``rep`` unit is not sharded: its flat buffer is whole on every rank of the layout
# (replicas included), the ZeRO-0 / DDP arrangement, chosen per unit. What it holds and
# does, per rank (P: its parameters in the model's own dtype, the master copy; G: its
# gradient in reduce_dtype):
# - at rest: P (not P/N), the optimizer's state for all of P (the user's optimizer steps
#   the whole parameters on every rank; identical gradients keep the replicas identical),
#   and the whole ``.grad`` (P bytes) where gradients persist between steps;
# - forward and backward: nothing is gathered. Compute reads the master copy directly
#   when param_dtype is the model's dtype; under mixed precision a param_dtype copy is
#   cast locally at the unit's first use after an optimizer step and kept (static:
#   P * param_dtype / dtype bytes);
# - gradient: the unsharded gradient buffer (G) is allocated at its first backward use,
#   as for any unit; after the unit's last backward use it joins the replicated bucket.
#   A unit that casts nothing (param_dtype and reduce_dtype its own) is DIRECT (osdp/
#   runtime/direct.py [Note: direct replicated units]): its modules compute with its
#   parameters and G is autograd's own ``.grad`` (added into it where ``.grad``
#   persists); it joins the bucket once all of its parameters accumulated.
#   A bucket is all-reduced (one collective, summed then averaged over every rank of the
#   layout) once it holds >= REPLICATE_BUCKET_BYTES of gradients, and at the end of the
#   backward pass; at most MAX_INFLIGHT_REPLICATE_BUCKETS buckets are in flight (issuing
#   one more waits for the oldest). The bucket is reduced in one flat staging copy (its
#   bytes, transient, alive while in flight). A finished bucket is averaged and added
#   into ``.grad`` (in the parameters' dtype), then its gradient buffers are freed
#   (where ``.grad`` was None and the dtypes agree, the buffer becomes ``.grad``; a
#   direct unit's ``.grad`` is replaced by it, since the bucket averaged what it held).
# - comm per step: no all-gather; one all-reduce of G per step, shared by the bucket
#   (latency once per bucket); its collectives never mix with sharded units' ones.
# - only whole (unsplit) units may be ``rep``: splitting exists to gather less, and a
#   replicated unit gathers nothing. The mode is the same on every layout
#   (``effective_mode`` keeps it), and checkpoints name original parameters only, so a
#   checkpoint of a plan with ``rep`` units loads into any other plan and back.
REPLICATE_BUCKET_BYTES = 4 * 2**20
MAX_INFLIGHT_REPLICATE_BUCKETS = 1

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

# [Note: plan and layout]
# A plan is made for one layout (planner/collective_cost.py's [Note: sharding layouts]):
# "full", one shard group of all ``world_size`` ranks, or "hsdp", shard groups of
# ``node_size`` ranks (one node each) replicated ``world_size / node_size`` times; and for
# nodes of ``node_size`` ranks within its shard group (where ``hpz`` re-gathers). The
# runtime's layout (runtime/mesh.py ShardLayout) must be that one:
# - world: the layout's rank count (replicas included) is the plan's ``world_size``;
# - shard group: "full" needs a layout without replicas (a process group or a 1-D mesh);
#   "hsdp" a 2-D mesh ("replicate", "shard") whose shard dim is the plan's ``shard_size``
#   (with one replica, shard = world, any layout of ``world_size`` ranks is that one);
# - node: where a "full" plan knows its ``node_size`` (None: a plan from before layouts,
#   or one priced on a flat network), the layout's node size must equal it; give it with
#   ``node_size=`` (default: LOCAL_WORLD_SIZE, else the shard group is one node). An
#   "hsdp" plan's node is its shard group (checked above); it has no hpz units.
# Any mismatch is a PlanMismatchError naming both values and the argument to pass. Where
# the plan does not fix the node size, ``hpz`` units whose mode is trivial on the given
# layout (``effective_mode``) run as what they become (``zdp`` or ``dp``), with a warning.
LAYOUT_FULL = "full"
LAYOUT_HSDP = "hsdp"
LAYOUTS = (LAYOUT_FULL, LAYOUT_HSDP)


def plan_shard_size(layout: str, world_size: int | None, node_size: int | None) -> int | None:
    """Ranks a plan shards every unit over: all of them ("full"), a node ("hsdp");
    None where unknown (an "hsdp" plan without its node size)."""
    return world_size if layout == LAYOUT_FULL else node_size


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



# [Note: fused head loss]
# A model whose loss runs through its vocabulary-split head's fused cross-entropy (the
# head's ``cross_entropy``: no [tokens, vocab] logits once the head is split) says so with
# a true class attribute ``osdp_fuses_head_loss``. The planner counts the logits saving
# of a split head only for such a model (describe's [Note: the vocabulary head]); a model
# that computes the logits itself (a stock Hugging Face LM) holds them, split or not.
FUSES_HEAD_LOSS_ATTR = "osdp_fuses_head_loss"


def fuses_head_loss(model) -> bool:
    """Whether ``model`` computes its loss through a split head's fused cross-entropy."""
    return bool(getattr(model, FUSES_HEAD_LOSS_ATTR, False))


@dataclass(frozen=True)
class RuntimeConfig:
    """A plan as the runtime executes it (``Plan.runtime_config()``); built by hand for
    plans the planner did not make. Unit names are module paths."""

    unit_modes: dict[str, tuple[str, ...]]  # per-slice modes; the length is the slice count
    split_ops: dict[str, str] = field(default_factory=dict)  # split unit -> registered op name
    # tied use (module path) -> the unit that owns its weight; see [Note: tied row split]
    tied_uses: dict[str, str] = field(default_factory=dict)
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
    # the layout the plan was made for, [Note: plan and layout]: "full" or "hsdp"; ranks
    # per node within the shard group (None: any); ranks per shard group (None: unknown)
    layout: str = LAYOUT_FULL
    node_size: int | None = None
    shard_size: int | None = None
    # units the plan priced frozen (no gradient or optimizer state in its memory): the
    # runtime warns if one of them trains (runtime/trainable.py)
    frozen_units: tuple[str, ...] = ()

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ConfigError(f"RuntimeConfig.layout {self.layout!r} unknown; use one of {LAYOUTS}")
        for name in ("node_size", "shard_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"RuntimeConfig.{name} must be an integer >= 1 or None, got {value!r}")
