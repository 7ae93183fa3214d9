"""Registry of split ops, keyed by the module type they replace."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn

from ..errors import OSDPError

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime.scheduler import Scheduler
    from ..runtime.shard_unit import ShardUnit

_REGISTRY: dict[type, type["SplitModule"]] = {}


def split_sizes(length: int, g: int) -> list[int]:
    """Sizes of ``g`` slices of ``length``: as even as possible, the first ``length % g``
    slices one larger (like ``torch.tensor_split``)."""
    base, extra = divmod(length, g)
    return [base + (i < extra) for i in range(g)]


class SplitModule(nn.Module):
    """A module whose parameters are cut into ``g`` slices, each one shard unit.

    Subclasses implement:

    - ``check(module, g, name)`` (classmethod): raise :class:`OSDPError` when ``module``
      cannot be cut into ``g`` slices, saying what would work.
    - ``slice_tensors(module, g)`` (classmethod): per slice, an ordered dict
      ``attr -> tensor`` of the slice's parameters (what its unit flattens and shards).
    - ``merge(slices)`` (classmethod): the inverse, per-slice tensors back to the
      original module's parameters (``name -> tensor``), for full state dicts.
    - ``__init__(module, g)``: keep what ``forward`` needs (shapes, options).
    - ``forward``: compute with slices acquired from ``self.scheduler``; see
      :class:`osdp.runtime.scheduler.Scheduler` for the acquire/release protocol.
    """

    module_type: ClassVar[type]
    op_name: ClassVar[str]
    # False when backward reads no weights (then the scheduler never gathers the
    # slices for backward and frees them after forward in either mode)
    needs_weights_in_backward: ClassVar[bool] = True

    def __init__(self, g: int):
        super().__init__()
        self.g = g
        self.scheduler: Scheduler | None = None
        self.units: list[ShardUnit] = []

    def bind(self, scheduler: "Scheduler", units: list["ShardUnit"]) -> None:
        """Called by the runtime once the slice units exist."""
        self.scheduler = scheduler
        self.units = list(units)
        # the slices' flat shards, inputs of the op's autograd Function (so its backward
        # runs even when x needs no grad); not registered: the optimizer sees the
        # original parameters (see [Note: original parameters] in shard_unit.py)
        self.flat_shards = [u.shard for u in units]

    @classmethod
    def check(cls, module: nn.Module, g: int, name: str) -> None:
        raise NotImplementedError

    @classmethod
    def slice_tensors(cls, module: nn.Module, g: int) -> list[dict[str, torch.Tensor]]:
        raise NotImplementedError

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def register_split_op(cls: type[SplitModule]) -> type[SplitModule]:
    """Class decorator: ``cls`` becomes the split op for ``cls.module_type``."""
    if not (isinstance(cls, type) and issubclass(cls, SplitModule)):
        raise TypeError(f"{cls!r} is not a SplitModule subclass")
    existing = _REGISTRY.get(cls.module_type)
    if existing is not None and existing is not cls:
        raise OSDPError(
            f"{cls.module_type.__name__} already has split op {existing.op_name!r}; "
            f"cannot also register {cls.op_name!r}"
        )
    _REGISTRY[cls.module_type] = cls
    return cls


def get_split_op(module: nn.Module, name: str = "") -> type[SplitModule]:
    """The split op for ``module``'s exact type, or an OSDPError naming the known ones."""
    op = _REGISTRY.get(type(module))
    if op is None:
        known = ", ".join(sorted(t.__name__ for t in _REGISTRY)) or "none"
        raise OSDPError(
            f"unit {name!r} is a {type(module).__name__}, which has no split op; "
            f"modules that can be split: {known}"
        )
    return op


def registered_split_ops() -> dict[type, type[SplitModule]]:
    return dict(_REGISTRY)
