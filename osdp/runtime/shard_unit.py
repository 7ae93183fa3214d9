"""A shard unit: the parameters one module (or one slice of a split module) owns,
flattened into one buffer that is sharded evenly across ranks (or, for a ``rep`` unit,
held whole on every rank: [Note: replicated units] in contract.py).

[Note: flat shard layout]
A unit's parameters are flattened in a fixed order and concatenated into one flat
buffer of ``numel`` elements, zero-padded to ``padded_numel = world * shard_numel``.
Rank r holds ``flat[r * shard_numel : (r + 1) * shard_numel]`` as an nn.Parameter
(what the optimizer sees). One all-gather of the shards rebuilds the flat buffer in
rank order, so every original parameter is a plain view of the gathered buffer (no
copy-out), and one reduce-scatter of the flat gradient gives each rank its shard's
gradient. The padding is zero in the weights and in every gradient, so optimizers keep
it zero.

[Note: freeing gathered storage]
The gathered buffer is allocated once as a tensor; freeing resizes its *storage* to 0
bytes and gathering resizes it back and writes into it. Views of it (the parameter
views and anything autograd saved) stay the same objects, so a zdp unit re-gathered
for backward is seen by the tensors autograd saved in forward. Writes into it happen
under ``_unsafe_preserve_version_counter`` so the saved tensors' version check passes.

[Note: holder rank]
Which part of the flat buffer this rank holds is a property of the unit, not of the
communicator: ``shard_rank`` of ``shard_world`` holders. A sharded unit's holders are
the shard group (the communicator's shard rank and size); a ``rep`` unit is a shard
group of one (``shard_rank`` 0 of 1: ``shard_numel == numel``, no padding), so every
rank holds all of it. Everything that maps this rank's flat buffer to original
parameters (the parameter views, state dicts, checkpoints, optimizer state) reads
``shard_rank`` / ``shard_numel`` of the unit, so a rep unit needs no case of its own
there.

[Note: replica compute copy]
A ``rep`` unit is never gathered (its ``gathered_bytes`` is 0 and it is always
GATHERED). When the compute dtype is the master dtype its ``gathered`` buffer IS the
master flat (a detached alias: the same storage and version counter), so the views
modules compute with read the weights the optimizer updates in place, and stay valid
across steps. Under mixed precision ``gathered`` is its own ``param_dtype`` buffer,
cast from the master flat at the unit's first use after the master changed (the
lifecycle compares ``gathered_version`` with the shard's version, as ``is_outdated`` does)
and kept: static memory, P * param_dtype / dtype bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..memtrack import storage_key
from .modes import GatherState, Mode
from .grad_norm import mark_sharded

# [Note: original parameters]
# What the optimizer and the user see are the ORIGINAL parameters, by their original
# names (``named_parameters()``), as FSDP2 users expect: each is an ``nn.Parameter`` that
# is a view of this rank's part of the unit's flat shard, so an optimizer step on them
# updates the shard in place (no copy, one version counter), and the padding of the
# flat shard belongs to no parameter (it stays zero). The rank's part of a parameter is
# the contiguous range of its flattened elements that falls into the rank's shard, so it
# has ``n`` elements (0..numel, possibly 0 on some ranks). It is shaped ``(n, 1, ..., 1)``
# with the original ``ndim``: rules that pick weight decay by ``p.dim() >= 2`` keep
# working (a 0-d parameter is ``(1,)`` where held, ``(0,)`` elsewhere: a 0-d piece
# could not be told apart from a per-parameter optimizer state such as AdamW's
# ``step`` in checkpoints). The full shape is
# ``p._osdp_full_shape``. A ``rep`` unit's parameters are whole on every rank and keep
# their ORIGINAL shapes (what a DDP user expects), except that a 0-d parameter is
# ``(1,)`` there too (for the same checkpoint reason); element-wise optimizer state
# follows the parameter's shape, and checkpoints map it by flattening, so nothing else
# depends on the shape. A split op's slices each hold a box of a cut parameter; the
# rank's pieces of all of them are ONE parameter under the original name, a view of
# the slices' shards side by side (padding between included), see [Note: split
# parameters] in split_params.py: every original parameter appears once, by its name.
# Gradients: the reduce-scattered shard gradient is handed out as views too (``p.grad``),
# added onto ``p.grad`` when it exists (no ``zero_grad``), so gradients accumulate across
# backward passes as in plain PyTorch. A rep unit's averaged all-reduced gradient is
# handed out the same way (``accumulate_replicated_grad``), whole.


def shard_numel(numel: int, world: int) -> int:
    """Elements per holder of a flat buffer of ``numel`` sharded over ``world`` (ceil)."""
    return -(-numel // world)


def local_piece_shape(n: int, ndim: int) -> tuple[int, ...]:
    """Shape of a rank's ``n``-element piece of a parameter with ``ndim`` dims, see
    [Note: original parameters]."""
    return (n,) + (1,) * (ndim - 1)


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in its unit's flat buffer."""

    attr: str  # attribute name on the module that computes with it
    # its names in the original model's state dict (several if tied); a slice of a cut
    # parameter holds a box of the parameter these name
    fqns: tuple[str, ...]
    shape: torch.Size
    offset: int
    numel: int


class ShardUnit:
    """Flat sharded parameters of one unit, the gathered buffer and per-step counters."""

    def __init__(
        self,
        name: str,
        slots: list[ParamSlot],
        tensors: list[torch.Tensor],
        mode: Mode,
        rank: int,
        world_size: int,
        device: torch.device,
        requires_grad: bool,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        param_names: list[str] | None = None,
        local_storage: torch.Tensor | None = None,
    ):
        self.name = name
        self.slots = tuple(slots)
        self.mode = mode
        # who holds which part of the flat buffer: see [Note: holder rank]
        self.replicated = mode is Mode.REP
        self.shard_rank, self.shard_world = (0, 1) if self.replicated else (rank, world_size)
        self.world_size = self.shard_world
        dtype = tensors[0].dtype
        self.numel = sum(s.numel for s in slots)
        self.shard_numel = shard_numel(self.numel, self.shard_world)
        self.padded_numel = self.shard_numel * self.shard_world
        lo = self.shard_rank * self.shard_numel
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=dtype)
            for slot, tensor in zip(slots, tensors):
                flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
            local = flat[lo : lo + self.shard_numel]
            # a split op's slices keep their shards side by side in one storage, so that
            # each cut parameter is one tensor per rank ([Note: split parameters])
            local = local.to(device).clone() if local_storage is None else local_storage.copy_(local)
        # the flat shard is the storage; autograd sees it as the input of the gather
        # (hooks.py), the optimizer sees the original-parameter views below
        self.shard = nn.Parameter(local, requires_grad=requires_grad)
        self.shard._osdp_unit_name = name  # so a parameter can be traced back to its unit
        names = list(param_names) if param_names is not None else [s.attr for s in slots]
        self.local_ranges = [self._local_range(s, self.shard_rank) for s in slots]
        self.params: list[nn.Parameter] = []
        for slot, pname, (start, n) in zip(slots, names, self.local_ranges):
            # a rep unit's parameters are whole: original shapes ([Note: original parameters])
            shape = slot.shape if self.replicated and len(slot.shape) else local_piece_shape(n, len(slot.shape))
            piece = self.shard.detach().narrow(0, start, n).view(shape)
            param = nn.Parameter(piece, requires_grad=requires_grad)
            param._osdp_unit_name = name
            param._osdp_name = pname
            param._osdp_full_shape = slot.shape
            self.params.append(param)
        self.param_names = names
        # where each slot's piece starts in its parameter's local elements: 0 unless a
        # split op's cut parameter spans several units ([Note: split parameters])
        self.param_offsets = [0] * len(slots)
        self.split_params = None  # the SplitParams owning such a parameter, if any
        # mixed precision (see [Note: mixed precision] in mixed_precision.py): the shard
        # keeps the parameters' dtype (the master copy the optimizer steps); the gathered
        # buffer, and so compute, is in param_dtype; gradients are reduced in reduce_dtype
        floating = dtype.is_floating_point
        self.param_dtype = param_dtype if (param_dtype is not None and floating) else dtype
        self.reduce_dtype = reduce_dtype if (reduce_dtype is not None and floating) else self.param_dtype
        # a rep unit is never gathered: see [Note: replica compute copy]
        self.casts = self.replicated and self.param_dtype != dtype
        if self.replicated and not self.casts:
            self.gathered = self.shard.detach()
        else:
            self.gathered = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
        # when allocated; a rep unit allocates none
        self.gathered_bytes = 0 if self.replicated else self.padded_numel * self.gathered.element_size()
        self.views = [self.gathered.narrow(0, s.offset, s.numel).view(s.shape) for s in slots]
        self._free_storage()
        self.state = GatherState.GATHERED if self.replicated else GatherState.SHARDED
        self.pending = None  # collectives.Pending of an all-gather in flight
        self.gathered_version = -1  # shard._version when the gathered copy was made (or cast)
        # per-step bookkeeping, owned by the scheduler
        self.n_active = 0  # uses computing now (forward or backward)
        self.n_await = 0  # uses whose backward has not started yet
        self.n_await_weights = 0  # of those, the ones whose backward reads the weights
        self.grad_flat: torch.Tensor | None = None  # unsharded gradient being accumulated
        # a direct rep unit (direct.py [Note: direct replicated units]): its gradient is
        # its parameters' .grad; how many of them this backward still awaits, and whether
        # .grad holds this rank's unreduced gradient (counted by the ledger)
        self.direct = False
        self.direct_awaited = 0
        self.grad_local = False
        # small whole-module unit whose collectives may be coalesced with other small
        # units' (set by the scheduler, see [Note: coalesced small units])
        self.coalescible = False
        # the group over which its gradients' norm is taken ([Note: global gradient
        # norm] in grad_norm.py), set by the runtime once the unit is built
        self.norm_group = None

    @property
    def requires_grad(self) -> bool:
        """Trainable or frozen: the flat shard's flag, which follows the parameters'
        ([Note: trainability follows the parameters] in trainable.py)."""
        return self.shard.requires_grad

    @property
    def dtype(self) -> torch.dtype:
        """The gathered (compute) dtype."""
        return self.gathered.dtype

    @property
    def shard_dtype(self) -> torch.dtype:
        """The sharded parameters' (master) dtype."""
        return self.shard.dtype

    @property
    def replica_copy_bytes(self) -> int:
        """A rep unit's static param_dtype compute copy (0: none; [Note: replica compute copy])."""
        return self.numel * self.gathered.element_size() if self.casts else 0

    def alloc_gathered(self) -> None:
        if self.replicated:
            return
        storage = self.gathered.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.gathered_bytes)

    def _free_storage(self) -> None:
        if self.replicated:  # its gathered buffer may be the master flat itself
            return
        storage = self.gathered.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    def free_gathered(self) -> None:
        if self.replicated:
            return
        self._free_storage()
        self.state = GatherState.SHARDED

    def _local_range(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """(start in the shard, element count) of ``slot``'s elements held by ``rank``."""
        lo = max(slot.offset, rank * self.shard_numel)
        hi = min(slot.offset + slot.numel, (rank + 1) * self.shard_numel)
        if hi <= lo:
            return 0, 0
        return lo - rank * self.shard_numel, hi - lo

    def reduce_output(self) -> torch.Tensor:
        """The buffer this unit's reduce-scatter writes its ``shard_numel`` elements into."""
        if self.split_params is not None:
            return self.split_params.reduce_output(self)
        return torch.empty(self.shard_numel, dtype=self.shard_dtype, device=self.shard.device)

    def replaced_param(self) -> nn.Parameter | None:
        """The first original parameter whose data is no longer a view of the flat shard
        (a module cast or moved after wrapping: ``nn.Module._apply`` swaps ``.data``),
        or None. A split op's cut parameters are its SplitParams' (not checked)."""
        if self.split_params is not None:
            return None
        shard = storage_key(self.shard)
        return next((p for p in self.params if storage_key(p) != shard), None)

    def accumulate_sharded_grad(self, flat: torch.Tensor) -> None:
        """Hand this rank's reduced gradient (``shard_numel`` elements, from
        :meth:`reduce_output`) to the original parameters: views of ``flat`` where they
        have none, added otherwise."""
        if self.split_params is not None:
            self.split_params.accumulate(self, flat)
            return
        for param, piece in zip(self.params, self.split_local(flat)):
            if param.grad is None:
                param.grad = piece
            else:
                param.grad.add_(piece)
            mark_sharded(param.grad, self.norm_group)  # [Note: global gradient norm]

    def accumulate_replicated_grad(self, flat: torch.Tensor) -> None:
        """Hand a rep unit's averaged gradient (``numel`` elements, already in the
        parameters' dtype) to the original parameters: views of ``flat`` (no copy) where
        they have none, added otherwise; a direct unit's replace theirs (its bucket
        averaged them, [Note: direct replicated units]). Whole and equal on every rank,
        so it is marked replicated, not sharded ([Note: global gradient norm] in
        grad_norm.py)."""
        for param, piece in zip(self.params, self.split_local(flat)):
            if param.grad is None or self.direct:
                param.grad = piece
            else:
                param.grad.add_(piece)
            param.grad._osdp_replicated = True

    def flatten_local(self, pieces: list[torch.Tensor | None]) -> torch.Tensor:
        """One tensor per original parameter (shaped like ``self.params``) -> one flat
        shard (a copy; padding and missing pieces zero), in the pieces' dtype."""
        dtype = next((t.dtype for t in pieces if t is not None), self.shard_dtype)
        flat = torch.zeros(self.shard_numel, dtype=dtype, device=self.shard.device)
        for piece, (start, n), offset in zip(pieces, self.local_ranges, self.param_offsets):
            if piece is not None:
                flat.narrow(0, start, n).copy_(piece.reshape(-1).narrow(0, offset, n))
        return flat

    def split_local(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`flatten_local`: views of ``flat`` shaped like the params
        (a unit whose parameters are its own: not a split op's slice)."""
        assert self.split_params is None, "a split op's cut parameter spans several units"
        return [flat.narrow(0, start, n).view(p.shape) for p, (start, n) in zip(self.params, self.local_ranges)]

    def local_pieces(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per slot, this unit's elements of a tensor shaped like its parameter (a view;
        ``values`` one per slot, shaped like ``self.params``), flat."""
        return [v.reshape(-1).narrow(0, offset, n)
                for v, (_, n), offset in zip(values, self.local_ranges, self.param_offsets)]

    def sharded_grad(self) -> torch.Tensor | None:
        """This rank's gradient as one flat shard (padding zero; a copy), or None when
        no parameter has a gradient."""
        if all(p.grad is None for p in self.params):
            return None
        return self.flatten_local([p.grad for p in self.params])

    def grad_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``attr -> tensor`` views of a full (gathered) flat buffer."""
        return {s.attr: flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots}

    def __repr__(self) -> str:
        return (
            f"ShardUnit({self.name!r}, mode={self.mode.value}, numel={self.numel}, "
            f"shard_numel={self.shard_numel}, state={self.state.value})"
        )
