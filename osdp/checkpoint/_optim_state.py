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


def optimizer_units(view, optimizer) -> list[int]:
    """The indices of the units holding the parameters the optimizer holds (a split
    op's cut parameter: all of its slices; ``view``: the model's ``ShardedView``)."""
    index: dict[int, list[int]] = {}
    for i, unit in enumerate(view.built.units):
        for p in unit.params:
            index.setdefault(id(p), []).append(i)
    found: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index:
                raise OSDPError(
                    "the optimizer holds a parameter that is not one of this OSDP model's parameters "
                    "(build the optimizer from model.parameters() or model.named_parameters() after wrapping)"
                )
            found.update(index[id(p)])
    return sorted(found)


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


def param_states(unit, flat: dict, elementwise: set[str], into: dict[int, dict]) -> None:
    """The inverse of :func:`unit_state`: the unit's part of each of its parameters'
    states, into ``into[id(param)]`` (``elementwise``: the keys laid out like the shard).
    A parameter of its own gets views of ``flat``; a split op's cut parameter, whose
    slices are several units, one tensor that each of them fills its part of."""
    for param, (start, n), offset in zip(unit.params, unit.local_ranges, unit.param_offsets):
        state = into.setdefault(id(param), {})
        for key, value in flat.items():
            if key not in elementwise:
                state.setdefault(key, value.clone() if isinstance(value, torch.Tensor) else value)
            elif unit.split_params is None:
                state[key] = value.narrow(0, start, n).view(param.shape)
            else:
                if key not in state:
                    state[key] = torch.zeros(param.shape, dtype=value.dtype, device=value.device)
                state[key].view(-1).narrow(0, offset, n).copy_(value.narrow(0, start, n))


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b
