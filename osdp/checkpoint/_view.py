"""The wrapped model as the checkpoint functions read it: its sharded view and all the
ranks of its layout."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import OSDPError
from ..runtime.view import ShardedView


class Ranks(NamedTuple):
    """All ranks of the model's layout (replicas included), as ``_atomic``'s helpers take
    them; see [Note: checkpoints of replicated layouts]."""

    group: object
    rank: int
    world_size: int
    device: torch.device


def world(view: ShardedView) -> Ranks:
    level = view.comm.layout.world
    return Ranks(level.group, level.rank, level.size, view.comm.device)


def prepare(model) -> ShardedView:
    """The wrapped model's sharded view (units, comm, layout), its pending gradient
    reductions finished; OSDPError for anything but an osdp.OSDP model."""
    view_of = getattr(model, "_sharded_view", None)
    if view_of is None:
        raise OSDPError(f"expected an osdp.OSDP-wrapped model, got {type(model).__name__}")
    return view_of()
