"""The OSDP runtime: shard units, the stream scheduler, split ops, the memory ledger.

Public entry point is :class:`osdp.OSDP` (``osdp/api.py``); the pieces here:

- ``config.py``       plan / modes / splits -> per-unit slice modes (validated)
- ``build.py``        split ops swapped in, parameters flattened and sharded per unit
- ``shard_unit.py``   one unit: flat shard, gathered buffer, views
- ``collectives.py``  async all-gather / reduce-scatter (CUDA streams or gloo work)
- ``scheduler.py``    when to gather, free, prefetch and reduce-scatter
- ``hooks.py``        module hooks driving the scheduler for unsplit units
- ``checkpoint.py``   activation checkpointing of blocks
- ``ledger.py``       live and peak gathered / unsharded-gradient bytes
- ``state_dict.py``   full state dicts with the original names
"""
from .modes import GatherState, Mode, UseState

__all__ = ["Mode", "GatherState", "UseState"]
