"""Cut a model into shard units: swap split ops in, flatten and shard every unit's
parameters, and leave each module computing with views of its unit's gathered buffer.

The order of what is applied: (1) split modules are replaced by their split op
(``osdp.ops``), (2) each module that owns parameters becomes a unit (a module whose
parameters are all owned by an earlier unit, a tied head, reuses that unit), its
parameters are removed (the module computes with views of the gathered buffer, set by
the hooks; the flat shard is kept by the unit, registered nowhere: the optimizer sees
the original parameters, see [Note: original parameters] in shard_unit.py), (3) buffers
are left in place (replicated).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import OSDPError
from ..ops import SplitModule, get_split_op
from .modes import Mode
from .shard_unit import ParamSlot, ShardUnit


@dataclass
class BuiltModel:
    units: list[ShardUnit] = field(default_factory=list)
    # (module, path, [(unit, [(attr, slot index)])]) per module computing with unit views
    bindings: list[tuple] = field(default_factory=list)
    # path -> (split module, its slice units)
    splits: dict[str, tuple[SplitModule, list[ShardUnit]]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)  # module path -> owning unit


def _consistent(path: str, params) -> tuple[torch.dtype, bool]:
    dtypes = {p.dtype for p in params}
    grads = {p.requires_grad for p in params}
    if len(dtypes) > 1:
        raise OSDPError(f"unit {path!r} mixes dtypes {sorted(map(str, dtypes))}; a unit is one flat buffer of one dtype")
    if len(grads) > 1:
        raise OSDPError(
            f"unit {path!r} mixes frozen and trainable parameters; freeze all of its parameters or none"
        )
    return dtypes.pop(), grads.pop()


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, child, new)


def build_units(
    model: nn.Module,
    unit_modes: dict[str, tuple[Mode, ...]],
    rank: int,
    world_size: int,
    device: torch.device,
    mixed_precision=None,
    split_ops: dict[str, str] | None = None,
) -> BuiltModel:
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    reduce_dtype = getattr(mixed_precision, "effective_reduce_dtype", None)
    keep_alive = list(model.parameters())  # ids below must not be reused while we work
    fqns: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(fqn)
    owner: dict[int, tuple[ShardUnit, int]] = {}
    built = BuiltModel()

    for path, module in list(model.named_modules()):
        params = [(a, p) for a, p in module._parameters.items() if p is not None]
        if not params:
            continue
        modes = unit_modes[path]
        if len(modes) > 1:
            if any(id(p) in owner or len(fqns[id(p)]) > 1 for _, p in params):
                raise OSDPError(f"cannot split {path!r}: its parameters are shared with another module (tied)")
            op = get_split_op(module, path, (split_ops or {}).get(path))
            op.check(module, len(modes), path)
            _, requires_grad = _consistent(path, [p for _, p in params])
            slice_units = []
            whole = dict(params)
            for i, tensors in enumerate(op.slice_tensors(module, len(modes))):
                slots, names, offset = [], [], 0
                for attr, t in tensors.items():
                    slots.append(ParamSlot(attr, (), t.shape, offset, t.numel()))
                    offset += t.numel()
                    # an uncut parameter (a bias kept by one slice) keeps its name
                    fqn = fqns[id(whole[attr])][0]
                    names.append(fqn if t.shape == whole[attr].shape else f"{fqn}[{i}]")
                slice_units.append(
                    ShardUnit(
                        f"{path}[{i}]", slots, list(tensors.values()), modes[i], rank, world_size, device,
                        requires_grad, param_dtype, reduce_dtype, param_names=names,
                    )
                )
            new = op(module, len(modes))
            _set_submodule(model, path, new)
            built.units.extend(slice_units)
            built.splits[path] = (new, slice_units)
            continue

        own = [(a, p) for a, p in params if id(p) not in owner]
        entries: dict[ShardUnit, list[tuple[str, int]]] = {}
        unit = None
        if own:
            _, requires_grad = _consistent(path, [p for _, p in own])
            slots, offset = [], 0
            for attr, p in own:
                slots.append(ParamSlot(attr, tuple(fqns[id(p)]), p.shape, offset, p.numel()))
                offset += p.numel()
            unit = ShardUnit(
                path, slots, [p.detach() for _, p in own], modes[0], rank, world_size, device, requires_grad,
                param_dtype, reduce_dtype, param_names=[fqns[id(p)][0] for _, p in own],
            )
            built.units.append(unit)
            for i, (attr, p) in enumerate(own):
                owner[id(p)] = (unit, i)
        for attr, p in params:
            u, i = owner[id(p)]
            entries.setdefault(u, []).append((attr, i))
            if u is not unit:
                built.tied.setdefault(path, u.name)
        for attr, _ in params:
            del module._parameters[attr]
        built.bindings.append((module, path, list(entries.items())))
    del keep_alive
    return built
