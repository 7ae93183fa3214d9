"""Full (unsharded) state dicts, with the original model's names and shapes."""
from __future__ import annotations

import torch
import torch.nn as nn

from .build import BuiltModel
from .collectives import CommContext


def full_state_dict(
    model: nn.Module, built: BuiltModel, comm: CommContext, state_keys: list[str], rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """Gathers every unit (a collective: call it on every rank). Returns CPU tensors in
    the original ``state_dict()`` order on rank 0 (every rank if ``rank0_only=False``);
    other ranks get ``{}``."""
    keep = comm.rank == 0 or not rank0_only
    result: dict[str, torch.Tensor] = {}
    full_of = {}
    for unit in built.units:
        full = comm.all_gather_sync(unit.shard.detach())
        if keep:
            full_of[unit.name] = full[: unit.numel].cpu().clone()
    if not keep:
        return {}
    split_units = {u.name for _, units in built.splits.values() for u in units}
    for unit in built.units:
        if unit.name in split_units:
            continue
        parts = unit.unflatten(full_of[unit.name])
        for slot in unit.slots:
            for fqn in slot.fqns:
                result[fqn] = parts[slot.attr]
    for path, (module, units) in built.splits.items():
        merged = type(module).merge([u.unflatten(full_of[u.name]) for u in units])
        for attr, tensor in merged.items():
            result[f"{path}.{attr}" if path else attr] = tensor
    for name, buf in model.named_buffers():
        result[name] = buf.detach().cpu().clone()
    ordered = {k: result[k] for k in state_keys if k in result}
    ordered.update({k: v for k, v in result.items() if k not in ordered and k in state_keys})
    return ordered
