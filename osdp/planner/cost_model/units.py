"""Which ops own a unit, which ops share one (tied weights) and whether a use reads its
weights in backward (docs/design/cost_model.md's [Note: tied weights] and [Note: uses
and what they declare])."""
from __future__ import annotations

import numpy as np

from ...ops import registered_split_ops
from ..model_desc import ModelDesc, OpDesc
from .settings import PlannerSettings
from .unit_bytes import reduced_bytes


def unit_indices(desc: ModelDesc) -> list[int]:
    """Ops that own a unit: parameters of their own (a tied use is its owner's unit)."""
    return [i for i, op in enumerate(desc.ops) if op.param_count and not op.tied_to]


def backward_needs_weights(op: OpDesc, g: int) -> bool:
    """Whether a use of ``op``'s weights cut into ``g`` slices reads them in backward: an
    unsplit module always does (the runtime's hooks gather it for its backward); a split
    op says so in its declaration (``needs_weights_in_backward``, osdp/ops/registry.py).
    A use no backward reaches reads nothing ([Note: frozen units])."""
    if not op.in_backward:
        return False
    if g == 1 or not op.split_op:
        return True
    split = registered_split_ops().get(op.split_op)
    return True if split is None else bool(split.needs_weights_in_backward)


def tied_groups(desc: ModelDesc) -> list[tuple[int, ...]]:
    """Ops that use one unit's weights, owner first, in op order: one tuple per tied unit
    (``OpDesc.tied_to``). They share one slicing and one mode per slice: [Note: tied
    weights]."""
    return list(_tied_index(desc)[0])


def _tied_index(desc: ModelDesc) -> tuple[tuple[tuple[int, ...], ...], dict[int, tuple[int, ...]]]:
    """The tied groups and, per op in one of them, its group. Once per description: the
    option rows ask it per op, and a scan per call made pricing a plan quadratic in the
    ops (a ModelDesc is frozen, so the cache cannot go stale)."""
    cached = desc.__dict__.get("_tied_index")
    if cached is None:
        names = {op.name: i for i, op in enumerate(desc.ops)}  # unique (ModelDesc checks)
        groups: dict[int, list[int]] = {}
        for i, op in enumerate(desc.ops):
            if op.tied_to:
                owner = names.get(op.tied_to)
                if owner is None:
                    owner = desc.op_index(op.tied_to)  # raises its KeyError
                groups.setdefault(owner, [owner]).append(i)
        ordered = tuple(tuple(sorted(v)) for v in groups.values())
        group_of: dict[int, tuple[int, ...]] = {}
        for group in ordered:
            for i in group:
                group_of.setdefault(i, group)  # an op in two groups: the first, as a scan finds
        cached = desc.__dict__["_tied_index"] = (ordered, group_of)
    return cached


def _group_of(desc: ModelDesc, i: int) -> tuple[int, ...]:
    return _tied_index(desc)[1].get(i, (i,))


def tied_grads_bytes(desc: ModelDesc, settings: PlannerSettings) -> np.ndarray:
    """Per op, bytes of tied units' unsharded gradients alive there: from the backward of
    a tied unit's last use to that of its first (owner), all of it ([Note: tied weights])."""
    alive = np.zeros(len(desc.ops))
    for group in tied_groups(desc):
        alive[group[0] : group[-1] + 1] += reduced_bytes(desc.ops[group[0]], settings)
    return alive
