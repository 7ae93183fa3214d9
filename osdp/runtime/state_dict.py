"""Where every original parameter lives in the shard units, and full (unsharded) state
dicts with the original model's names and shapes.

[Note: parameter layout]
Every element of an original parameter lives in exactly one unit's flat buffer (see
[Note: flat shard layout] in shard_unit.py). A :class:`Piece` is one slot of one unit:
the flat range ``[offset, offset + numel)`` of that unit holds, in row-major order, the
box ``[box_offsets, box_offsets + box_sizes)`` of the original parameter ``fqn``. An
unsplit module's slot is the whole parameter; a slice of a split op is a box too (a
Linear slice is ``W[:, k0:k0+ks]``, an Embedding slice ``W[r0:r0+rs]``). The boxes are
derived from the split op's own ``merge`` applied to element ids (no split op needs to
describe itself), and checked: a split op whose slots are not boxes is refused.
Tied parameters are one piece under their first name (``named_parameters`` order);
the other names are aliases, also when the tied weight is split (its slices carry
every name; see [Note: tied row split] in contract.py). Padding belongs to no piece.

Everything that maps between "unit shards" and "original parameters" (full state
dicts, loading them, sharded DCP checkpoints in ``osdp.checkpoint``) goes through this
layout, so they agree by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import OSDPError
from .build import BuiltModel
from .materialize import copy_own
from .collectives import CommContext


@dataclass(frozen=True)
class Piece:
    """One slot of one unit: which box of which original parameter it holds."""

    unit: int  # index into ``built.units``
    fqn: str  # canonical name of the original parameter
    offset: int  # start in the unit's (unpadded) flat buffer
    numel: int
    box_offsets: tuple[int, ...]
    box_sizes: tuple[int, ...]


@dataclass(frozen=True)
class ParamInfo:
    fqn: str
    shape: tuple[int, ...]
    # the parameter's own (master) dtype, what the shards hold: under mixed precision
    # not the compute dtype, which a full state dict in it would round the weights to
    dtype: torch.dtype
    aliases: tuple[str, ...]  # other names of the same (tied) parameter
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Layout:
    """See [Note: parameter layout]."""

    params: dict[str, ParamInfo]  # canonical name -> info, in state_dict order
    unit_pieces: tuple[tuple[Piece, ...], ...]  # per unit, in flat-buffer order
    aliases: dict[str, str]  # alias -> canonical name
    buffers: dict[str, tuple[int, ...]]  # persistent buffers (replicated) -> shape
    state_keys: tuple[str, ...]  # the original model's state_dict keys, in order

    def fingerprint(self) -> dict:
        """What identifies the model in a checkpoint: original names and shapes."""
        return {
            "params": {k: list(p.shape) for k, p in self.params.items()},
            "tied": dict(self.aliases),
            "buffers": {k: list(v) for k, v in self.buffers.items()},
        }


def _box_of(ids: torch.Tensor, lo: int, hi: int) -> tuple[int, tuple | None]:
    """How many of the ids ``lo..hi-1`` are in ``ids``, and the box ``(offsets, sizes)``
    they fill in row-major order (None if they do not fill one)."""
    mask = (ids >= lo) & (ids < hi)
    count = int(mask.sum())
    if count == 0:
        return 0, None
    coords = mask.nonzero()
    start, stop = coords.min(0).values, coords.max(0).values + 1
    sizes = (stop - start).tolist()
    region = ids[tuple(slice(s, e) for s, e in zip(start.tolist(), stop.tolist()))]
    if math.prod(sizes) != hi - lo or not torch.equal(region.reshape(-1), torch.arange(lo, hi)):
        return count, None
    return count, (tuple(start.tolist()), tuple(sizes))


def _split_pieces(path: str, module, units, index_of: dict[int, int]) -> tuple[dict, list[Piece]]:
    """Shapes and pieces of a split module's original parameters, from its ``merge``
    applied to element ids (see [Note: parameter layout])."""
    ids, base = [], 0
    for unit in units:
        ids.append(unit.unflatten(torch.arange(base, base + unit.numel)))
        base += unit.numel
    merged = type(module).merge(ids)
    pieces, base = [], 0
    for unit in units:
        for slot in unit.slots:
            lo = base + slot.offset
            hits = [(attr, *_box_of(t, lo, lo + slot.numel)) for attr, t in merged.items()]
            hits = [h for h in hits if h[1]]
            if len(hits) != 1 or hits[0][2] is None:
                raise OSDPError(
                    f"split op {type(module).__name__} of {path!r}: slot {slot.attr!r} of {unit.name!r} is not "
                    "one box of one original parameter; checkpoints need each slice to be a box"
                )
            attr, _, (offsets, sizes) = hits[0]
            fqn = f"{path}.{attr}" if path else attr
            pieces.append(Piece(index_of[id(unit)], fqn, slot.offset, slot.numel, offsets, sizes))
        base += unit.numel
    shapes = {(f"{path}.{a}" if path else a): tuple(t.shape) for a, t in merged.items()}
    return shapes, pieces


def build_layout(model: nn.Module, built: BuiltModel, state_keys: list[str]) -> Layout:
    """The layout of an OSDP-wrapped ``model`` (``model`` is the wrapped module)."""
    index_of = {id(u): i for i, u in enumerate(built.units)}
    split_units = {id(u) for _, units in built.splits.values() for u in units}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    aliases: dict[str, str] = {}
    by_fqn: dict[str, list[Piece]] = {}
    for i, unit in enumerate(built.units):
        if id(unit) in split_units:
            continue
        for slot in unit.slots:
            fqn = slot.fqns[0]
            shapes[fqn], dtypes[fqn] = tuple(slot.shape), unit.shard_dtype
            aliases.update({alias: fqn for alias in slot.fqns[1:]})
            zeros = (0,) * len(slot.shape)
            by_fqn.setdefault(fqn, []).append(Piece(i, fqn, slot.offset, slot.numel, zeros, tuple(slot.shape)))
    for path, (module, units) in built.splits.items():
        if path in built.tied:
            continue  # a tied use computes on its owner's slices: no pieces of its own
        split_shapes, pieces = _split_pieces(path, module, units, index_of)
        shapes.update(split_shapes)
        for slot in units[0].slots:  # the other names of a tied split weight: aliases
            aliases.update({alias: slot.fqns[0] for alias in slot.fqns[1:]})
        for piece in pieces:
            dtypes[piece.fqn] = built.units[piece.unit].shard_dtype
            by_fqn.setdefault(piece.fqn, []).append(piece)
    order = [k for k in state_keys if k in shapes] + [k for k in shapes if k not in state_keys]
    params = {
        fqn: ParamInfo(fqn, shapes[fqn], dtypes[fqn], tuple(a for a, c in aliases.items() if c == fqn), tuple(by_fqn[fqn]))
        for fqn in order
    }
    for info in params.values():
        if sum(p.numel for p in info.pieces) != math.prod(info.shape):
            raise OSDPError(f"internal: the pieces of {info.fqn!r} do not cover it")
    unit_pieces = [[] for _ in built.units]
    for info in params.values():
        for piece in info.pieces:
            unit_pieces[piece.unit].append(piece)
    persistent = set(state_keys)
    buffers = {name: tuple(b.shape) for name, b in model.named_buffers() if name in persistent}
    return Layout(
        params=params,
        unit_pieces=tuple(tuple(sorted(ps, key=lambda p: p.offset)) for ps in unit_pieces),
        aliases=aliases,
        buffers=buffers,
        state_keys=tuple(state_keys),
    )


def box_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's box of a full original parameter (a view)."""
    for dim, (start, size) in enumerate(zip(piece.box_offsets, piece.box_sizes)):
        tensor = tensor.narrow(dim, start, size)
    return tensor


def local_range(piece: Piece, rank: int, shard_numel: int) -> tuple[int, int] | None:
    """The part ``[a, b)`` of the piece's flat range (in the piece's own row-major order,
    0-based) that holder ``rank``'s shard holds; None if it holds none. ``rank`` and
    ``shard_numel`` are the unit's own (``unit.shard_rank``: 0 for a rep unit, which
    holds all of it; see [Note: holder rank] in shard_unit.py), never the
    communicator's."""
    a = max(piece.offset, rank * shard_numel)
    b = min(piece.offset + piece.numel, (rank + 1) * shard_numel)
    if a >= b:
        return None
    return a - piece.offset, b - piece.offset


def full_state_dict(
    model: nn.Module,
    built: BuiltModel,
    comm: CommContext,
    state_keys: list[str],
    rank0_only: bool = True,
    layout: Layout | None = None,
) -> dict[str, torch.Tensor]:
    """Gathers every unit (a collective: call it on every rank). Returns CPU tensors in
    the original ``state_dict()`` order on rank 0 (every rank if ``rank0_only=False``);
    other ranks get ``{}``. Tied names share one tensor, as in the original model."""
    layout = layout or build_layout(model, built, state_keys)
    keep = comm.rank == 0 or not rank0_only
    full: dict[str, torch.Tensor] = {}
    if keep:
        full = {fqn: torch.empty(info.shape, dtype=info.dtype) for fqn, info in layout.params.items()}
    for unit, pieces in zip(built.units, layout.unit_pieces):
        # a rep unit is whole on every rank: nothing to gather
        flat = unit.shard.detach() if unit.replicated else comm.all_gather_sync(unit.shard.detach())
        if not keep:
            continue
        flat = flat.cpu()
        for piece in pieces:
            box_view(full[piece.fqn], piece).copy_(flat[piece.offset : piece.offset + piece.numel].view(piece.box_sizes))
    if not keep:
        return {}
    for alias, fqn in layout.aliases.items():
        full[alias] = full[fqn]
    for name, buf in model.named_buffers():
        if name in layout.buffers:
            full[name] = buf.detach().cpu().clone()
    return {k: full[k] for k in state_keys if k in full}


def listed(names: list, most: int = 8) -> str:
    """The first ``most`` of ``names`` for an error message, `` ...`` when there are more."""
    return f"{names[:most]}{' ...' if len(names) > most else ''}"


def check_full_state_dict(layout: Layout, state_dict) -> str | None:
    """Why ``state_dict`` cannot be loaded into the model (strict), or None."""
    if not isinstance(state_dict, dict):
        return f"expected a dict of tensors, got {type(state_dict).__name__}"
    expected = set(layout.state_keys)
    missing = [k for k in layout.state_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    problems = []
    if missing:
        problems.append(f"missing keys {listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {listed(unexpected)}")
    wanted = {k: p.shape for k, p in layout.params.items()}
    wanted.update({a: layout.params[c].shape for a, c in layout.aliases.items()})
    wanted.update(layout.buffers)
    for key, shape in wanted.items():
        value = state_dict.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != tuple(shape):
            problems.append(f"{key!r} has shape {list(value.shape)}, the model's is {list(shape)}")
    return "; ".join(problems) or None


def local_shards_from_full(
    layout: Layout, built: BuiltModel, fqn: str, tensor: torch.Tensor, into: list[torch.Tensor]
) -> None:
    """Copy this rank's elements of original parameter ``fqn`` (full ``tensor``) into
    ``into[unit]`` (new local shards, one per unit): each unit's part for its own holder
    rank (``unit.shard_rank``)."""
    for piece in layout.params[fqn].pieces:
        unit = built.units[piece.unit]
        rank = unit.shard_rank
        part = local_range(piece, rank, unit.shard_numel)
        if part is None:
            continue
        a, b = part
        src = box_view(tensor, piece).reshape(-1)[a:b]
        start = piece.offset + a - rank * unit.shard_numel
        into[piece.unit][start : start + (b - a)].copy_(src)


class ShardValues:
    """Full values of a wrapped model's parameters and buffers, gathered unit by unit as
    they are asked for, in the order of the units (every rank asks for the same names in
    the same order: each gather is a collective): the value source of a model rebuilt
    from another one's shards (``osdp.runtime.materialize.ValuesFrom``). A tied
    parameter's second name is not asked again (its owner holds it)."""

    def __init__(self, wrapped, release: bool = False):
        view = wrapped._sharded_view()
        self.layout, self.built, self.comm = view.layout, view.built, view.comm
        self.buffers = dict(view.module.named_buffers(remove_duplicate=False))
        self._flats: dict[int, torch.Tensor] = {}  # unit -> its gathered flat buffer, until used up
        self._left = {i: len(pieces) for i, pieces in enumerate(self.layout.unit_pieces)}
        self._done: set[str] = set()
        # release: ``wrapped`` is thrown away after: each shard storage is freed once
        # every unit in it is used up (a split op's slices share one), so that the old
        # and the new model are never both whole in memory
        self.release = release
        self._storage_units: dict[int, set[int]] = {}
        for i, unit in enumerate(self.built.units):
            self._storage_units.setdefault(unit.shard.untyped_storage().data_ptr(), set()).add(i)

    def _flat(self, i: int) -> torch.Tensor:
        if i not in self._flats:
            unit = self.built.units[i]
            self._flats[i] = unit.shard.detach() if unit.replicated else self.comm.all_gather_sync(unit.shard.detach())
        return self._flats[i]

    def value(self, name: str) -> torch.Tensor | None:
        """The full parameter ``name`` (None: asked already, under this or a tied name)."""
        fqn = self.layout.aliases.get(name, name)
        if fqn in self._done:
            return None
        self._done.add(fqn)
        info = self.layout.params[fqn]
        full = None
        for piece in info.pieces:
            flat = self._flat(piece.unit)
            if full is None:
                full = torch.empty(info.shape, dtype=flat.dtype, device=flat.device)
            box_view(full, piece).copy_(flat[piece.offset:piece.offset + piece.numel].view(piece.box_sizes))
            self._left[piece.unit] -= 1
            if self._left[piece.unit] == 0:
                del self._flats[piece.unit]
                self._used_up(piece.unit)
        return full

    def _used_up(self, i: int) -> None:
        if not self.release:
            return
        storage = self.built.units[i].shard.untyped_storage()
        if all(self._left[j] == 0 for j in self._storage_units[storage.data_ptr()]):
            storage.resize_(0)

    def fill(self, path: str, module: nn.Module) -> None:
        copy_own(module, path, lambda name, buffer: self.buffers.get(name) if buffer else self.value(name))
