"""DCP glue: a rank's pieces of an original tensor as DCP chunks, and the planners that
write and read them.

[Note: chunked tensors in DCP]
``torch.distributed.checkpoint`` stores a tensor as its global shape plus chunks (boxes
given by offsets and sizes), each written by one rank, and reads any box a rank asks
for from whichever saved chunks overlap it. A :class:`ChunkedTensor` is one rank's
share of one original tensor: the boxes its flat shards hold (see
[Note: parameter layout] in ``osdp/runtime/state_dict.py``), each a contiguous range
of a shard viewed in the box's shape. A range of a box in row-major order is cut into
at most ``2 * ndim - 1`` boxes (:func:`range_boxes`), so the chunk count does not grow
with the tensor. Chunks of all ranks tile the tensor exactly (padding is in no chunk),
which DCP checks when it plans the save. No DTensor/ShardedTensor is built: the two
planners below turn ChunkedTensors into write/read items directly, so saving and
loading need no communication beyond DCP's own planning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import OSDPError


@dataclass
class ChunkedTensor:
    """One rank's chunks of a global tensor: ``(offsets, tensor)`` with ``tensor`` of the
    chunk's shape (a view into the rank's own storage)."""

    size: torch.Size
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    @classmethod
    def whole(cls, tensor: torch.Tensor, present: bool = True) -> "ChunkedTensor":
        """A replicated tensor: one chunk covering it (``present=False``: none)."""
        chunks = [((0,) * tensor.dim(), tensor)] if present else []
        return cls(tensor.shape, tensor.dtype, chunks)

    def metadata(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.chunks]


def range_boxes(a: int, b: int, sizes: tuple[int, ...]):
    """Boxes ``(offsets, sizes)`` covering elements ``[a, b)`` of a box of ``sizes`` in
    row-major order, in that order; each one is a contiguous run of the range."""
    if a >= b:
        return
    if not sizes:
        yield (), ()
        return
    rest = tuple(sizes[1:])
    inner = math.prod(rest)
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    zeros = (0,) * len(rest)
    if i0 == i1:  # inside one row
        for off, sz in range_boxes(r0, r1, rest):
            yield (i0,) + off, (1,) + sz
        return
    if r0:
        for off, sz in range_boxes(r0, inner, rest):
            yield (i0,) + off, (1,) + sz
        i0 += 1
    if i1 > i0:
        yield (i0,) + zeros, (i1 - i0,) + rest
    if r1:
        for off, sz in range_boxes(0, r1, rest):
            yield (i1,) + off, (1,) + sz


def flat_index(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """Row-major position of ``offsets`` in a box of ``sizes``."""
    index = 0
    for off, size in zip(offsets, sizes):
        index = index * size + off
    return index


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _find(obj: ChunkedTensor, offsets) -> torch.Tensor:
    wanted = tuple(offsets)
    for off, tensor in obj.chunks:
        if off == wanted:
            return tensor
    raise OSDPError(f"internal: no local chunk at {wanted}")


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes every chunk of every :class:`ChunkedTensor` of the (flat) state dict."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            for offsets, tensor in obj.chunks:
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape),
                            properties=TensorProperties.create_from_tensor(tensor),
                            size=obj.size,
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return _find(self.state_dict[write_item.index.fqn], write_item.index.offset).detach()


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads every chunk of every :class:`ChunkedTensor` from whatever saved chunks
    overlap it (DCP's resharding); every key must be in the checkpoint."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        missing = [k for k in self.state_dict if k not in saved]
        if missing:
            raise OSDPError(f"the checkpoint has no entries {missing[:8]}: it is incomplete or from another model")
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = saved[fqn]
            if tuple(getattr(md, "size", ())) != tuple(obj.size):
                raise OSDPError(f"checkpoint entry {fqn!r} has shape {list(md.size)}, expected {list(obj.size)}")
            items.extend(create_read_items_for_chunk_list(fqn, md, obj.metadata()))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self.state_dict[read_item.dest_index.fqn]
        _, tensor = obj.chunks[read_item.dest_index.index]
        return _narrow(tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
