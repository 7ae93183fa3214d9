"""Optimizer state per shard unit, as the sharded checkpoint stores it.

The optimizer holds the original parameters, each a view of a piece of its unit's flat
shard (see [Note: original parameters] in ``osdp/runtime/shard_unit.py``). A checkpoint
maps unit shards to original parameters through the layout, so it reads and writes the
optimizer state as one flat state per unit: an element-wise state (AdamW ``exp_avg``)
is the unit's pieces laid out like the shard (padding zero), a per-parameter state
(AdamW ``step``) must be equal for every parameter of the unit.
"""
from __future__ import annotations

import torch

from ..errors import OSDPError


def optimizer_units(view, optimizer) -> dict[int, int]:
    """id(parameter) -> unit index, for every parameter the optimizer holds (``view``:
    the model's ``ShardedView``)."""
    index = {id(p): i for i, u in enumerate(view.built.units) for p in u.params}
    found = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index:
                raise OSDPError(
                    "the optimizer holds a parameter that is not one of this OSDP model's parameters "
                    "(build the optimizer from model.parameters() or model.named_parameters() after wrapping)"
                )
            found[id(p)] = index[id(p)]
    return found


def unit_state(unit, optimizer) -> dict | None:
    """The unit's optimizer state as one flat state (None: no parameter has state)."""
    states = [optimizer.state.get(p) or None for p in unit.params]
    present = [s for s in states if s is not None]
    if not present:
        return None
    keys = set(present[0])
    if len(present) != len(states) or any(set(s) != keys for s in present):
        raise OSDPError(
            f"the parameters of unit {unit.name!r} ({', '.join(unit.param_names)}) have different optimizer "
            "states (some have none, or other keys); a checkpoint stores one state per unit: step all of "
            "them, or none"
        )
    flat = {}
    for key in keys:
        values = [s[key] for s in states]
        if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, unit.params)):
            flat[key] = unit.flatten_local([v.detach() for v in values])
        elif all(same_state(v, values[0]) for v in values):
            flat[key] = values[0]
        else:
            raise OSDPError(f"optimizer state {key!r} differs between the parameters of unit {unit.name!r}")
    return flat


def param_states(unit, flat: dict, elementwise: set[str]) -> list[dict]:
    """The inverse of :func:`unit_state`: one state dict per parameter of ``unit``
    (``elementwise``: the keys laid out like the shard)."""
    out = [{} for _ in unit.params]
    for key, value in flat.items():
        if key in elementwise:
            pieces = unit.split_local(value)
        else:
            pieces = [value.clone() if isinstance(value, torch.Tensor) else value for _ in unit.params]
        for state, piece in zip(out, pieces):
            state[key] = piece
    return out


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b
