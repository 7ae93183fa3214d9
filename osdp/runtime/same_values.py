"""Every rank must wrap the same values: checked at wrap by a checksum of each parameter.

[Note: the same values on every rank]
Each rank cuts its shard out of the values it was given. Ranks given different values
(seeded differently, or pretrained weights loaded on rank 0 only) trained without an
error: a ``rep`` unit's replicas stayed apart for good, the ranks adding the same
averaged gradient to different weights (found by a helper: two seeds, a rep unit, the
ranks' losses 4.889 and 4.847 at step 0 and apart ever after), and a sharded unit
became a mix of the ranks' values that no rank was given. DDP broadcasts rank 0's
values in its constructor; FSDP2 leaves it to the user. OSDP checks: a CRC-32 of each
parameter's bits (about 4 GB/s on one CPU core), one all-gather of a checksum over all
of them, and only when those differ one per parameter, to name the first that does.
A model on the meta device is checked as it is initialized, one module at a time
(materialize.py), after it was built; any other before anything changes, so that the
model can be wrapped again with ``sync_module_states=True``, which broadcasts rank
0's values instead and skips the check.
"""
from __future__ import annotations

import zlib

import torch

from ..errors import PlanMismatchError


def value_hash(tensor: torch.Tensor) -> int:
    """A CRC-32 of ``tensor``'s bits."""
    data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def check_same_values(comm, named_hashes: list[tuple[str, int]]) -> None:
    """Raises :class:`PlanMismatchError` naming the first parameter whose values differ
    between the ranks (``comm``: the wrapped model's CommContext; ``named_hashes``: the
    parameters' names and :func:`value_hash`, in the same order on every rank)."""
    if comm.layout.world.size == 1 or not named_hashes:
        return
    combined = value_hash(torch.tensor([h for _, h in named_hashes], dtype=torch.int64))
    if len(set(comm.all_gather_object_hash(combined, "all-gather of the values' checksum"))) == 1:
        return
    for name, mine in named_hashes:
        every = comm.all_gather_object_hash(mine, f"all-gather of {name!r}'s checksum")
        if len(set(every)) > 1:
            ranks = [r for r, h in enumerate(every) if h != every[0]]
            break
    else:
        return  # the combined checksums collided: the parameters agree
    raise PlanMismatchError(
        f"the ranks wrap different values: {name!r} (and maybe others) on rank(s) {ranks} differs from rank 0's. "
        "Each rank keeps its own piece of each unit, so the model would train as a mix of the ranks' values (a rep "
        "unit's replicas staying apart). Seed every rank alike (torch.manual_seed) before building the model, load "
        "the same weights on every rank, or pass sync_module_states=True to broadcast rank 0's. See [Note: the "
        "same values on every rank] in osdp/runtime/same_values.py")
