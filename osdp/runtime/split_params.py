"""One tensor per rank for each parameter a split op cuts.

[Note: split parameters]
A split op's slices are shard units of their own, yet the optimizer and the user see
each original parameter once, under its original name ([Note: original parameters] in
shard_unit.py): grouping idioms select parameters by name (``n.endswith(".weight")``,
a name set taken from the unwrapped model, ``dict(model.named_parameters())``), and a
weight whose slices had names of their own fell out of the weight-decay group
silently. So a cut parameter is one ``nn.Parameter`` per rank, a view of this rank's
pieces of every slice, which needs those pieces side by side in memory:

- the slices' flat shards live in ONE storage per rank, slice after slice
  (``ShardUnit(local_storage=...)``);
- within a slice's flat buffer the uncut parameters come first (a bias kept by slice 0)
  and the cut one last, and only one parameter is cut per slice, so between this
  rank's piece of slice i and its piece of slice i+1 lies nothing but slice i's
  padding (zero: it stays zero under any element-wise optimizer, see [Note: flat shard
  layout]).

The parameter is that range of the storage, padding included, shaped ``(n, 1, ...)``
with the original ndim; ``ShardUnit.param_offsets`` says where each slice's piece
starts in it. A rank holding none of it gets a ``(0, 1, ...)`` tensor.

Gradients: the slices' reduce-scatters write straight into one gradient shard laid out
like the storage, allocated (zeros) at the first slice's reduction of a backward when
none of the op's parameters has a gradient yet; the parameters' ``.grad`` are views
of it. Where gradients persist (no ``zero_grad`` between backward passes, gradient
accumulation) each slice's result is added into them instead. The planner counts the
whole gradient shard from the op's first reduction on ([Note: split backward moments]
in planner/cost_model/options.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import OSDPError
from .grad_norm import mark_sharded
from .shard_unit import ShardUnit, local_piece_shape


class SplitParams:
    """The cut parameters of one split op, each one tensor over its slices' shards."""

    def __init__(self, path: str, units: list[ShardUnit], storage: torch.Tensor, full_shapes: dict[str, torch.Size]):
        self.path = path
        self.units = list(units)
        self.storage = storage
        self.starts = []  # each unit's shard offset in the storage
        start = 0
        for unit in units:
            self.starts.append(start)
            start += unit.shard_numel
        # every parameter of the op once, with its (start, elements) in the storage
        self.params: list[nn.Parameter] = []
        self.ranges: list[tuple[int, int]] = []
        for attr, shape in full_shapes.items():
            self._bind(attr, shape)
        for u, unit in enumerate(units):
            unit.split_params = self
            for param, (start, n) in zip(unit.params, unit.local_ranges):
                if all(param is not p for p in self.params):  # a parameter the op keeps whole
                    self.params.append(param)
                    self.ranges.append((self.starts[u] + start, n))
        self._filling: torch.Tensor | None = None  # the gradient shard being filled
        self._unissued: set[int] = set()  # units that have not reduced into it yet
        self._direct: set[int] = set()  # units whose reduction in flight writes into it

    # ---- construction ---------------------------------------------------------------------
    def _slots_of(self, attr: str) -> list[tuple[int, int]]:
        """(unit index, slot index) of the cut parameter ``attr`` in every slice."""
        return [(u, j) for u, unit in enumerate(self.units) for j, s in enumerate(unit.slots) if s.attr == attr]

    def _bind(self, attr: str, full_shape: torch.Size) -> None:
        """Replace the slices' pieces of ``attr`` by one parameter spanning them."""
        slots = self._slots_of(attr)
        spans = []  # (start in the storage, elements) of this rank's pieces
        for u, j in slots:
            start, n = self.units[u].local_ranges[j]
            spans.append((self.starts[u] + start, n))
        held = [(a, n) for a, n in spans if n]
        lo = held[0][0] if held else 0
        hi = held[-1][0] + held[-1][1] if held else 0
        self._check_only_padding_between(attr, slots, lo, hi)
        unit0, j0 = self.units[slots[0][0]], slots[0][1]
        piece = self.storage.detach().narrow(0, lo, hi - lo).view(local_piece_shape(hi - lo, len(full_shape)))
        param = nn.Parameter(piece, requires_grad=unit0.requires_grad)
        param._osdp_unit_name = self.path
        param._osdp_name = unit0.param_names[j0]
        param._osdp_full_shape = full_shape
        for (u, j), (a, n) in zip(slots, spans):
            unit = self.units[u]
            unit.params[j] = param
            unit.param_offsets[j] = a - lo if n else 0
        self.params.append(param)
        self.ranges.append((lo, hi - lo))

    def _check_only_padding_between(self, attr: str, slots, lo: int, hi: int) -> None:
        """Nothing but ``attr``'s pieces and padding may lie in ``[lo, hi)``."""
        cut = set(slots)
        for u, unit in enumerate(self.units):
            for j, (start, n) in enumerate(unit.local_ranges):
                a = self.starts[u] + start
                if (u, j) not in cut and n and a < hi and lo < a + n:
                    raise OSDPError(
                        f"split op of {self.path!r} cuts {attr!r} and {unit.slots[j].attr!r} in the same slice: "
                        "OSDP keeps each original parameter one tensor per rank, which needs one cut parameter "
                        "per slice (the others kept whole by one slice)"
                    )

    # ---- gradients --------------------------------------------------------------------------
    def reduce_output(self, unit: ShardUnit) -> torch.Tensor:
        """Where ``unit``'s reduce-scatter writes: its range of the gradient shard being
        filled, opened at the op's first reduction while no parameter has a gradient;
        else a new buffer, added into ``.grad`` when done."""
        if self._filling is None and all(p.grad is None for p in self.params):
            self._open()
        u = self.units.index(unit)
        if self._filling is None or u not in self._unissued:
            return torch.empty(unit.shard_numel, dtype=unit.shard_dtype, device=unit.shard.device)
        self._unissued.discard(u)
        self._direct.add(u)
        out = self._filling.narrow(0, self.starts[u], unit.shard_numel)
        if not self._unissued:
            self._filling = None  # every slice writes into it: the next backward adds
        return out

    def _open(self) -> None:
        self._filling = torch.zeros_like(self.storage)
        self._unissued = set(range(len(self.units)))
        for param, (lo, n) in zip(self.params, self.ranges):
            grad = self._filling.narrow(0, lo, n).view(param.shape)
            mark_sharded(grad, self.units[0].norm_group)  # see [Note: global gradient norm]
            param.grad = grad

    def accumulate(self, unit: ShardUnit, flat: torch.Tensor) -> None:
        """``unit``'s reduced gradient: already in place when written into the filled
        shard, else added into its parameters' ``.grad``."""
        u = self.units.index(unit)
        if u in self._direct:
            self._direct.discard(u)
            return
        for param, (start, n), offset in zip(unit.params, unit.local_ranges, unit.param_offsets):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                mark_sharded(param.grad, unit.norm_group)
            param.grad.view(-1).narrow(0, offset, n).add_(flat.narrow(0, start, n))

    def abandon(self) -> None:
        """A failed step: no reduction writes into the gradient shard any more."""
        self._filling, self._unissued, self._direct = None, set(), set()
