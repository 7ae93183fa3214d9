"""ShardedView: the one internal interface through which ``osdp.checkpoint`` (and any
other tool that maps shards to original parameters) reads an OSDP-wrapped model."""
from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from .build import BuiltModel
from .collectives import CommContext
from .state_dict import Layout


class ShardedView(NamedTuple):
    """What a wrapped model is made of, for code outside the runtime: read-only by
    convention (the runtime's own state is not reachable through it)."""

    module: nn.Module  # the wrapped module (split ops swapped in, parameters removed)
    built: BuiltModel  # the shard units (``built.units``), bindings, split modules
    comm: CommContext  # the process group, rank, world size, device
    state_keys: tuple[str, ...]  # the original model's state_dict keys, in order
    layout: Layout  # where every original parameter lives in the units

    @property
    def units(self):
        return self.built.units
