"""Cut a model into shard units: swap split ops in, flatten and shard every unit's
parameters, and leave each module computing with views of its unit's gathered buffer.

Module by module in ``named_modules()`` order (a module built on the meta device is
made real and initialized first, and back to meta once its unit holds it: [Note: meta
initialization] in materialize.py). The order of what is applied: (1) split modules are
replaced by their split op
(``osdp.ops``), (2) each module that owns parameters becomes a unit (a module whose
parameters are all owned by an earlier unit, a tied head, reuses that unit), its
parameters are removed (the module computes with views of the gathered buffer, set by
the hooks; the flat shard is kept by the unit, registered nowhere: the optimizer sees
the original parameters, see [Note: original parameters] in shard_unit.py), (3) buffers
are left in place (replicated).

A split unit whose weight is tied to another module (an embedding and its LM head) is
split once: the owner's op makes the slice units, the tied use is replaced by the
owner op's ``tied_use_op`` computing on the SAME slice units (``built.splits`` has both,
``built.tied`` maps the use to the owner); see [Note: tied row split] in contract.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import OSDPError
from ..ops import SplitModule, get_split_op
from ..module_tree import subtree_params
from .config import tied_uses
from .modes import Mode
from .materialize import MetaInit
from .shard_unit import ParamSlot, ShardUnit, shard_numel
from .split_params import SplitParams


@dataclass
class BuiltModel:
    units: list[ShardUnit] = field(default_factory=list)
    # (module, path, [(unit, [(attr, slot index)])]) per module computing with unit views
    bindings: list[tuple] = field(default_factory=list)
    # path -> (split module, its slice units); a tied use of a split weight is here too,
    # with its owner's slice units (``tied`` names the owner)
    splits: dict[str, tuple[SplitModule, list[ShardUnit]]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)  # module path -> owning unit (split: owner path)
    # (module, attr, parameter): where each original parameter sits in the module tree
    # (tied ones under each of their modules), for ``register_params``
    tree: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)
    # leaf modules, each one unit bound at the leaf ([Note: leaf modules] in module_tree.py)
    leaves: tuple[str, ...] = ()


def register_params(built: BuiltModel) -> None:
    """Put the original parameters (this rank's pieces) back into the modules'
    ``_parameters`` under their attribute names, so that tree walks see what
    ``named_parameters`` yields; modules still compute with the gathered views the hooks
    put in their instance dict, which attribute reads find first."""
    for module, attr, param in built.tree:
        module._parameters[attr] = param


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


# a module's hook registries: a split op that replaces it takes them over, the same
# dicts (so the users' handles still remove them), so its hooks run as before
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks", "_is_full_backward_hook")


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    old = model.get_submodule(path)
    for name in _HOOK_DICTS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
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
    meta_init: MetaInit | None = None,
    leaves: tuple[str, ...] = (),
) -> BuiltModel:
    """The units of ``model`` (see the module docstring); ``meta_init``: how a model built
    on the meta device is made real, one module at a time ([Note: meta initialization]);
    ``leaves``: modules that are one unit each, their subtree's parameters together
    ([Note: leaf modules] in module_tree.py)."""
    param_dtype = getattr(mixed_precision, "param_dtype", None)
    reduce_dtype = getattr(mixed_precision, "effective_reduce_dtype", None)
    keep_alive = list(model.parameters())  # ids below must not be reused while we work
    fqns: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(fqn)
    owner: dict[int, tuple[ShardUnit, int]] = {}
    built = BuiltModel(leaves=tuple(leaves))
    tied = tied_uses(model)
    _check_splits(model, unit_modes, split_ops or {}, tied)  # before any module changes
    sliced: dict[str, list[list[tuple]]] = {}  # split path -> per slice, its tensors' (offset, shape, stride)

    for path, module in list(model.named_modules()):
        if any(path.startswith(leaf + ".") for leaf in built.leaves):
            continue  # built with its leaf
        if path in built.leaves:
            members = [(f"{path}.{sub}" if sub else path, m) for sub, m in module.named_modules()]
            if meta_init is not None:
                for sub_path, member in members:
                    meta_init.materialize(sub_path, member)
            held = [(m, [p for p in m._parameters.values() if p is not None]) for _, m in members]
            _build_leaf(path, module, unit_modes[path], built, owner, fqns, rank, world_size, device, param_dtype,
                        reduce_dtype)
            if meta_init is not None:
                for member, params in held:
                    meta_init.release(member, params)
            continue
        if meta_init is not None:
            meta_init.materialize(path, module)
        params = [(a, p) for a, p in module._parameters.items() if p is not None]
        if not params:
            continue
        _build_module(model, path, module, params, unit_modes[path], built, owner, fqns, tied, sliced, rank,
                      world_size, device, param_dtype, reduce_dtype, split_ops or {})
        if meta_init is not None:
            meta_init.release(module, [p for _, p in params])
    del keep_alive
    return built


def _build_module(model, path, module, params, modes, built, owner, fqns, tied, sliced, rank, world_size, device,
                  param_dtype, reduce_dtype, split_ops) -> None:
    """The unit(s) of one module that holds parameters: a tied use of a split unit, its
    split op's slice units, or a unit of the parameters it owns (tied ones: an earlier
    unit's)."""
    if tied.get(path) in built.splits:
        _build_tied_use(model, path, module, tied[path], built, sliced, split_ops)
        return
    if len(modes) > 1:
        _check_splittable(model, path, params, fqns, owner, tied)
        op = get_split_op(module, path, split_ops.get(path))  # checked by _check_splits
        _, requires_grad = _consistent(path, [p for _, p in params])
        tensors = op.slice_tensors(module, len(modes))
        sliced[path] = [[_cut_of(t) for t in slice_.values()] for slice_ in tensors]
        slice_units = _build_slices(path, tensors, dict(params), fqns, modes, rank, world_size, device,
                                    requires_grad, param_dtype, reduce_dtype)
        new = op(module, len(modes))
        _set_submodule(model, path, new)
        built.units.extend(slice_units)
        built.splits[path] = (new, slice_units)
        built.tree += _slice_params(new, slice_units, [[s.attr for s in u.slots] for u in slice_units])
        return

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
        built.tree.append((module, attr, u.params[i]))
        if u is not unit:
            built.tied.setdefault(path, u.name)
    for attr, _ in params:
        del module._parameters[attr]
    built.bindings.append((module, path, list(entries.items())))


def _build_leaf(path, module, modes, built, owner, fqns, rank, world_size, device, param_dtype,
                reduce_dtype) -> None:
    """One unit of every parameter below leaf module ``path``, bound at the leaf: its
    forward gathers them all, its submodules compute with views of them."""
    members = subtree_params(module)  # leaf_paths refused parameters tied across the leaf's border
    unique: dict[int, tuple[str, nn.Parameter]] = {}
    for name, _, _, p in members:
        unique.setdefault(id(p), (name, p))  # a weight tied within the leaf: one slot
    own = list(unique.values())
    _, requires_grad = _consistent(path, [p for _, p in own])
    slots, offset = [], 0
    for name, p in own:
        slots.append(ParamSlot(name, tuple(fqns[id(p)]), p.shape, offset, p.numel()))
        offset += p.numel()
    unit = ShardUnit(path, slots, [p.detach() for _, p in own], modes[0], rank, world_size, device, requires_grad,
                     param_dtype, reduce_dtype, param_names=[fqns[id(p)][0] for _, p in own])
    built.units.append(unit)
    index = {id(p): i for i, (_, p) in enumerate(own)}
    for i, (_, p) in enumerate(own):
        owner[id(p)] = (unit, i)
    for name, member, attr, p in members:
        built.tree.append((member, attr, unit.params[index[id(p)]]))
        del member._parameters[attr]
    built.bindings.append((module, path, [(unit, [(name, index[id(p)]) for name, _, _, p in members])]))


def _cut_of(tensor: torch.Tensor) -> tuple:
    """Where a slice tensor sits in its parameter: (offset, shape, stride)."""
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def _build_slices(path, sliced, whole, fqns, modes, rank, world_size, device, requires_grad, param_dtype,
                  reduce_dtype) -> list[ShardUnit]:
    """The slice units of split op ``path``, their shards side by side in one storage and
    each cut parameter one tensor over them ([Note: split parameters])."""
    layouts = []  # per slice: its slots, tensors and parameter names
    for i, tensors in enumerate(sliced):
        # the parameters kept whole (a bias of slice 0) first, the cut one last
        cut = {attr: t.shape != whole[attr].shape for attr, t in tensors.items()}
        offsets, offset = {}, 0
        for attr in sorted(tensors, key=lambda a: cut[a]):
            offsets[attr], offset = offset, offset + tensors[attr].numel()
        slots = [ParamSlot(attr, tuple(fqns[id(whole[attr])]), t.shape, offsets[attr], t.numel())
                 for attr, t in tensors.items()]
        layouts.append((slots, list(tensors.values()), [slot.fqns[0] for slot in slots], offset))
    sizes = [shard_numel(numel, world_size) for *_, numel in layouts]
    storage = torch.empty(sum(sizes), dtype=next(iter(whole.values())).dtype, device=device)
    units, start = [], 0
    for i, ((slots, tensors, names, _), size) in enumerate(zip(layouts, sizes)):
        units.append(ShardUnit(
            f"{path}[{i}]", slots, tensors, modes[i], rank, world_size, device, requires_grad, param_dtype,
            reduce_dtype, param_names=names, local_storage=storage.narrow(0, start, size),
        ))
        start += size
    # the cut parameters: over every slice (the experts split cuts gate_up in its first
    # slices and down in its last ones)
    cut_shapes = {attr: whole[attr].shape for tensors in sliced for attr, t in tensors.items()
                  if t.shape != whole[attr].shape}
    SplitParams(path, units, storage, cut_shapes)
    return units


def _check_splits(model: nn.Module, unit_modes, split_ops: dict[str, str], tied: dict[str, str]) -> None:
    """Every split asked for can be made: checked before the first unit is built, so
    that a refused one leaves the model as it was."""
    for path, modes in unit_modes.items():
        if len(modes) > 1 and path not in tied:
            module = model.get_submodule(path)
            get_split_op(module, path, split_ops.get(path)).check(module, len(modes), path)


def _check_splittable(model: nn.Module, path: str, params, fqns: dict, owner: dict, tied: dict[str, str]) -> None:
    """A split unit may share its parameters only with tied uses (modules computing
    with nothing but this unit's parameters), which then split the same way."""
    if path in tied:
        raise OSDPError(
            f"cannot split {path!r}: its parameters belong to {tied[path]!r} (tied; the first module holding a "
            f"weight owns it): split {tied[path]!r} instead, the tied pair shares one slicing"
        )
    shared = [p for _, p in params if id(p) in owner]
    if shared:
        # it holds its own parameters beside one an earlier unit owns (XLM-RoBERTa's
        # decoder: its bias is its head's), so neither that unit nor it can be split
        holder = owner[id(shared[0])][0].name
        uses = sorted(use for use, of in tied.items() if of == path)
        via = f" (nor {', '.join(map(repr, uses))}, which computes with its weight)" if uses else ""
        raise OSDPError(
            f"cannot split {path!r}{via}: its parameter {fqns[id(shared[0])][0]!r} belongs to {holder!r}, an "
            f"earlier unit (the first module holding a weight owns it), and {path!r} holds parameters of its own "
            "besides it, so the two cannot share one slicing; leave it unsplit"
        )
    for _, p in params:
        for name in fqns[id(p)][1:]:
            user = name.rpartition(".")[0]
            if tied.get(user) != path:
                raise OSDPError(
                    f"cannot split {path!r}: its parameter {fqns[id(p)][0]!r} is also {name!r}, and {user!r} "
                    "owns other parameters besides it (only a module computing with nothing but the shared "
                    "weight, such as a tied LM head, can follow the split); leave it unsplit"
                )


def _build_tied_use(model: nn.Module, path: str, module: nn.Module, owner_path: str, built: BuiltModel,
                    sliced: dict, split_ops: dict[str, str]) -> None:
    """Replace the tied use ``path`` of the split unit ``owner_path`` by the split op
    that computes on the owner's slice units; see [Note: tied row split]."""
    owner_module, units = built.splits[owner_path]
    # a module of the owner's own type (T5's encoder and decoder embeddings of its shared
    # one) runs the owner's op; another (a head) the op the owner's declares for it
    same_type = type(module) is type(owner_module).module_type
    op_name = split_ops.get(path) or (type(owner_module).op_name if same_type else type(owner_module).tied_use_op)
    if op_name is None:
        raise OSDPError(
            f"cannot split {owner_path!r}: its weight is tied to {path!r}, and split op "
            f"{type(owner_module).op_name!r} declares no tied_use_op for such a module; leave it unsplit"
        )
    op = get_split_op(module, path, op_name)
    g = len(units)
    op.check(module, g, path)
    # the tied use must cut the shared weight exactly as the owner does, slot for slot
    for i, tensors in enumerate(op.slice_tensors(module, g)):
        if [_cut_of(t) for t in tensors.values()] != sliced[owner_path][i]:
            raise OSDPError(
                f"cannot split the tied pair {owner_path!r} / {path!r}: split op {op.op_name!r} of {path!r} "
                f"cuts slice {i} of the shared weight otherwise than {type(owner_module).op_name!r} of "
                f"{owner_path!r}; name a tied use op that cuts the same rows (split_ops={{{path!r}: ...}})"
            )
    new = op(module, g)
    _set_submodule(model, path, new)
    built.splits[path] = (new, units)
    built.tied[path] = owner_path
    built.tree += _slice_params(new, units, [list(tensors) for tensors in op.slice_tensors(module, g)])


def _slice_params(module: nn.Module, units: list[ShardUnit], attrs: list[list[str]]):
    """(module, attr, parameter) of each parameter of a split op once, ``attrs[i]``
    naming slice i's slots as ``module`` calls them (a tied use: its names for its
    owner's slots)."""
    found: dict[str, nn.Parameter] = {}
    for unit, names in zip(units, attrs):
        for attr, param in zip(names, unit.params):
            found.setdefault(attr, param)
    return [(module, attr, param) for attr, param in found.items()]

