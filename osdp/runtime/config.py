"""Turn ``plan=`` or ``default_mode=/modes=/splits=`` into per-unit slice modes, with
errors that say what is wrong and what would be right."""
from __future__ import annotations

import difflib
import numbers
import re
import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from ..contract import LAYOUT_FULL, MODE_HPZ, MODE_REP, SHARDED_MODES, RuntimeConfig, effective_mode
from ..errors import OSDPError, PlanMismatchError
from ..module_tree import leaf_paths, leaves_of_unit_names, unit_params
from .args import mapping_arg, names_arg
from .modes import Mode, parse_mode

_SLICE_NAME = re.compile(r"(.+)\[(\d+)\]")


@dataclass(frozen=True)
class ResolvedConfig:
    """What the runtime executes, resolved against the model: per-unit modes (one per
    slice; len = slice count), split ops, window, checkpointed blocks."""

    unit_modes: dict[str, tuple[Mode, ...]]
    prefetch_bytes: int | None  # None: the runtime picks a default
    checkpoint_blocks: tuple[str, ...]
    fingerprint: str | None = None
    split_ops: dict[str, str] = field(default_factory=dict)  # split unit -> op name (default: the type's)
    leaves: tuple[str, ...] = ()  # leaf modules, each one unit ([Note: leaf modules] in module_tree.py)


def tied_uses(model: nn.Module) -> dict[str, str]:
    """Module path -> owner path, for each module whose parameters are ALL owned by one
    earlier module (a tied LM head: ``lm_head.weight is wte.weight``); see
    [Note: tied row split] in contract.py."""
    owner_of: dict[int, str] = {}
    uses: dict[str, str] = {}
    for path, module in model.named_modules():
        params = [p for p in module._parameters.values() if p is not None]
        owners = {owner_of.get(id(p)) for p in params}
        if params and len(owners) == 1 and None not in owners:
            uses[path] = owners.pop()
        for p in params:
            owner_of.setdefault(id(p), path)
    return uses


def _onto_owners(mapping: dict, tied: dict[str, str], what: str) -> dict:
    """``mapping`` with keys naming a tied use (or a slice of it, ``lm_head[i]``) renamed
    to its owner; the same key given both ways must agree. A tied use is no unit of its own: its weight is the owner's, so a
    mode given to it is the owner's ([Note: tied row split] in contract.py)."""
    out: dict = {}
    renamed: dict = {}
    for key, value in mapping.items():
        match = _SLICE_NAME.fullmatch(key) if isinstance(key, str) else None
        base, suffix = (match.group(1), f"[{match.group(2)}]") if match and key not in tied else (key, "")
        if isinstance(base, str) and base in tied:
            renamed[tied[base] + suffix] = (key, value)
        else:
            out[key] = value
    for key, (given, value) in renamed.items():
        if key in out and out[key] != value:
            raise OSDPError(
                f"{what}[{given!r}] = {value!r} but {what}[{key!r}] = {out[key]!r}: {given!r} is a tied use of "
                f"{key.split('[')[0]!r} (one weight, one set of slices); give it once, under {key!r}"
            )
        out[key] = value
    return out


def unit_candidates(model: nn.Module, leaves=()) -> list[str]:
    """Module paths of the units, in module order: the modules that own parameters
    directly, and the ``leaves`` ([Note: leaf modules] in module_tree.py), whose inner
    modules are not units."""
    return [path for path, _, _ in unit_params(model, leaves)]


def mode_names(model: nn.Module, leaves=()) -> list[str]:
    """The names ``modes=`` and ``splits=`` take, one per unit, in module order: the unit
    candidates less the tied uses, which their owners name (a mode given to a tied use is
    its owner's; the two given different modes are refused)."""
    tied = tied_uses(model)
    return [name for name in unit_candidates(model, leaves) if name not in tied]


def _check_name(name, candidates: list[str], modules: dict, where: str) -> None:
    if isinstance(name, str) and name in candidates:
        return
    if isinstance(name, str) and name in modules:
        leaf = next((c for c in candidates if name.startswith(c + ".")), None)
        if leaf is not None:
            raise OSDPError(f"{where}: {name!r} is inside leaf module {leaf!r}, which is one unit: name {leaf!r}")
        inside = [c for c in candidates if c.startswith(name + ".") or name == ""][:4]
        raise OSDPError(
            f"{where}: {name!r} is a module that owns no parameters itself; units are the modules "
            f"that do, name those instead (e.g. {', '.join(map(repr, inside))}), or make it one unit "
            f"with leaf_modules=({name!r},)"
        )
    close = difflib.get_close_matches(str(name), candidates, n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f"; units are e.g. {', '.join(map(repr, candidates[:4]))}"
    raise OSDPError(f"{where}: {name!r} is not a unit of the model (units are module paths of modules that own parameters){hint}")


def _parse_modes(value, where: str) -> tuple[Mode, ...]:
    if isinstance(value, (str, Mode)):
        return (parse_mode(value, where),)
    if isinstance(value, (tuple, list)) and value:
        return tuple(parse_mode(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise OSDPError(f"{where}: expected 'dp', 'zdp', 'hpz', 'rep' or a non-empty sequence of them (one per slice), "
                    f"got {value!r}")


def resolve_config(
    model: nn.Module,
    *,
    plan,
    default_mode,
    modes,
    splits,
    prefetch_bytes,
    checkpoint_blocks,
    world_size: int,
    split_ops: dict | None = None,
    leaf_modules=None,
) -> ResolvedConfig:
    """``plan``: an ``osdp.contract.RuntimeConfig`` (a Plan's ``runtime_config()``) or
    None; the keyword arguments are the by-hand alternative. ``leaf_modules``: module
    classes or paths, each module one unit ([Note: leaf modules] in module_tree.py); a
    plan's leaves are its units with parameters below them that no unit of it owns."""
    fingerprint = None
    leaves = leaf_paths(model, leaf_modules)
    split_ops = mapping_arg(split_ops, "split_ops", "of split unit name -> registered split op name")
    if plan is not None:
        if modes or splits:
            raise OSDPError("give either plan= or modes=/splits=, not both: the plan already names every unit's modes")
        plan_world = plan.world_size
        if plan_world is not None and plan_world != world_size:
            raise PlanMismatchError(
                f"this plan was made for world size {plan_world}, the process group has "
                f"{world_size} ranks: plan again for {world_size}"
            )
        modes = dict(plan.unit_modes)
        if split_ops:
            raise OSDPError("give either plan= or split_ops=, not both: the plan names every split unit's op")
        split_ops = dict(plan.split_ops)
        if prefetch_bytes is None:
            prefetch_bytes = plan.prefetch_bytes
        if not checkpoint_blocks:
            checkpoint_blocks = tuple(plan.checkpoint_blocks)
        fingerprint = plan.fingerprint
        leaves = _plan_leaves(model, plan, leaves)
    else:  # by hand: the stock modules that are leaves by default too ([Note: leaf modules])
        leaves = leaf_paths(model, leaf_modules, defaults=True)
    modes = mapping_arg(modes, "modes", "of unit name -> 'dp'/'zdp' or one mode per slice, e.g. {'lm_head': 'dp'}")
    splits = mapping_arg(splits, "splits", "of unit name -> slice count g >= 1, e.g. {'lm_head': 4}")
    default = parse_mode(default_mode, "default_mode")
    candidates = unit_candidates(model, leaves)
    modules = dict(model.named_modules())
    # a tied pair is one unit, named after its owner: see [Note: tied row split]
    tied = tied_uses(model)
    _check_tied_uses(plan, tied)
    splits = _onto_owners(splits, tied, "splits")
    # every tied use's mode is its owner's: before, one given to the use of an unsplit owner
    # was dropped (modes={"lm_head": "dp"} on a tied Llama left the embedding zdp)
    modes = _onto_owners(modes, tied, "modes")

    slices: dict[str, int] = {}
    for name, g in splits.items():
        _check_name(name, candidates, modules, "splits")
        if name in leaves and g != 1:
            raise OSDPError(f"splits[{name!r}] = {g!r}: {name!r} is a leaf module, gathered whole (a split cuts "
                            "one module's weights into slices); drop it from leaf_modules to split its parts")
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1:
            raise OSDPError(f"splits[{name!r}] = {g!r}: the slice count must be an integer >= 1")
        slices[name] = int(g)

    per_unit: dict[str, tuple[Mode, ...]] = {}
    per_slice: dict[tuple[str, int], Mode] = {}
    for key, value in modes.items():
        match = _SLICE_NAME.fullmatch(key) if isinstance(key, str) else None
        if match and key not in candidates:
            base, i = match.group(1), int(match.group(2))
            _check_name(base, candidates, modules, f"modes[{key!r}]")
            if base not in slices:
                raise OSDPError(f"modes[{key!r}] names slice {i} of {base!r}, which is not split: add splits={{{base!r}: g}}")
            if i >= slices[base]:
                raise OSDPError(f"modes[{key!r}]: {base!r} has {slices[base]} slices (0..{slices[base] - 1})")
            per_slice[(base, i)] = parse_mode(value, f"modes[{key!r}]")
            continue
        _check_name(key, candidates, modules, "modes")
        unit_modes = _parse_modes(value, f"modes[{key!r}]")
        if len(unit_modes) > 1:
            if key in slices and slices[key] != len(unit_modes):
                raise OSDPError(
                    f"modes[{key!r}] gives {len(unit_modes)} per-slice modes but splits[{key!r}] = "
                    f"{slices[key]}: give one mode per slice, or one mode for all"
                )
            if key in leaves:
                raise OSDPError(f"modes[{key!r}] gives one mode per slice, but {key!r} is a leaf module, "
                                "gathered whole: give it one mode")
            slices[key] = len(unit_modes)
        per_unit[key] = unit_modes

    unit_modes: dict[str, tuple[Mode, ...]] = {}
    for name in candidates:
        g = slices.get(name, 1)
        chosen = per_unit.get(name, (default,))
        chosen = list(chosen * g if len(chosen) == 1 else chosen)
        for i in range(g):
            chosen[i] = per_slice.get((name, i), chosen[i])
        unit_modes[name] = tuple(chosen)
        _check_whole_rep(name, unit_modes[name], name in per_unit or any(k[0] == name for k in per_slice))

    if prefetch_bytes is not None and (isinstance(prefetch_bytes, bool) or not isinstance(prefetch_bytes, int) or prefetch_bytes < 0):
        raise OSDPError(f"prefetch_bytes must be an integer >= 0 (bytes), got {prefetch_bytes!r}")
    blocks = names_arg(checkpoint_blocks, "checkpoint_blocks")
    for block in blocks:
        if block not in modules:
            close = difflib.get_close_matches(str(block), list(modules), n=3)
            raise OSDPError(
                f"checkpoint block {block!r} is not a module path of the model"
                + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
            )
    for name, op_name in split_ops.items():
        _check_name(name, candidates, modules, "split_ops")
        if not isinstance(op_name, str):
            raise OSDPError(f"split_ops[{name!r}] = {op_name!r}: give a registered split op name (osdp.ops.registered_split_ops())")
        if len(unit_modes[tied.get(name, name)]) == 1:
            raise OSDPError(f"split_ops[{name!r}] names an op but {name!r} is not split: add splits={{{name!r}: g}}")
    return ResolvedConfig(unit_modes, prefetch_bytes, blocks, fingerprint, split_ops, leaves)


def _plan_leaves(model: nn.Module, plan, given: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's leaves (its units with parameters below them that no unit of it owns); ``leaf_modules=``
    given beside a plan must name the same ones."""
    leaves = leaf_paths(model, leaves_of_unit_names(model, plan.unit_modes))  # checked as given ones are
    if given and given != leaves:
        raise PlanMismatchError(
            f"leaf_modules= resolves to {list(given)} but the plan's leaf units are {list(leaves)}: drop "
            "leaf_modules= (the plan names its units), or plan again with these leaves"
        )
    return leaves


def _check_whole_rep(name: str, modes: tuple[Mode, ...], named: bool) -> None:
    """Only whole units may be ``rep`` (contract.py [Note: replicated units]): a split
    unit's slices take the sharded modes. ``named``: its modes were given for it (not
    inherited from ``default_mode``)."""
    if len(modes) == 1 or Mode.REP not in modes:
        return
    slices = [i for i, m in enumerate(modes) if m is Mode.REP]
    allowed = ", ".join(repr(m) for m in SHARDED_MODES)
    source = "" if named else f" (from default_mode={MODE_REP!r})"
    raise OSDPError(
        f"unit {name!r} is split into {len(modes)} slices and slice(s) {slices} would be {MODE_REP!r}{source}: "
        f"only whole units may be {MODE_REP!r} (a replicated unit gathers nothing, so splitting it saves "
        f"nothing); give its slices one of {allowed} (e.g. modes={{{name!r}: 'zdp'}}), or leave it unsplit "
        f"to make it {MODE_REP!r}"
    )


def _check_tied_uses(plan, tied: dict[str, str]) -> None:
    """A plan's ``tied_uses`` must be ties of this model."""
    for use, owner in (getattr(plan, "tied_uses", None) or {}).items():
        if tied.get(use) != owner:
            actual = f"is tied to {tied[use]!r}" if use in tied else "shares no weight with another module"
            raise PlanMismatchError(
                f"the plan says {use!r} is a tied use of {owner!r}, but in this model {use!r} {actual}: "
                "this plan was made for another model; make a plan for this one"
            )


def own_param_counts(model: nn.Module, leaves=()) -> dict[str, int]:
    """Unit path -> parameters it owns that no earlier unit owns (a tied second use
    owns none), in module order: what a plan's units price."""
    seen: set[int] = set()
    counts: dict[str, int] = {}
    for path, _, params in unit_params(model, leaves):
        own = {id(p): p for *_, p in params if id(p) not in seen}
        seen.update(own)
        counts[path] = sum(p.numel() for p in own.values())
    return counts


def check_plan_matches_model(model: nn.Module, plan: RuntimeConfig) -> None:
    """Every unit a plan names must be a module of ``model`` that owns the parameter
    count the plan priced (``param_bytes`` / element size), and every module owning
    parameters must be a unit of it (left out, it would run the default mode the plan
    never priced); a plan made for another model fails here, naming the first unit that
    differs. A RuntimeConfig without ``unit_param_bytes`` (made by hand) is not checked."""
    if not plan.unit_param_bytes:
        return
    counts = own_param_counts(model, leaves_of_unit_names(model, plan.unit_param_bytes))
    missing = [name for name, count in counts.items() if count and name not in plan.unit_param_bytes]
    if missing:
        raise PlanMismatchError(
            f"the plan (for model {plan.model_name!r}) leaves out {len(missing)} module(s) of this model that own "
            f"parameters ({', '.join(map(repr, missing[:6]))}{', ...' if len(missing) > 6 else ''}): it was made "
            "for another model or edited; make a plan for this one"
        )
    modules = dict(model.named_modules())
    elements = {p.element_size() for p in model.parameters()}
    if plan.param_dtype_bytes:
        elements.add(int(plan.param_dtype_bytes))
    model_name = plan.model_name
    for name, param_bytes in plan.unit_param_bytes.items():
        if name not in counts:
            what = "owns no parameters" if name in modules else "is not a module of this model"
            raise PlanMismatchError(
                f"the plan (for model {model_name!r}) names unit {name!r}, which {what}: this plan was "
                "made for another model; make a plan for this one"
            )
        have = counts[name]
        if not any(have * e == param_bytes for e in elements):
            each = ", ".join(f"{param_bytes / e:g}" for e in sorted(elements))
            raise PlanMismatchError(
                f"the plan (for model {model_name!r}) prices unit {name!r} at {param_bytes} bytes "
                f"({each} parameters), the model's module {name!r} owns {have} parameters: this plan was "
                "made for another model (or another size of it); make a plan for this one"
            )


def check_plan_layout(plan: RuntimeConfig, layout) -> None:
    """A plan made for one layout runs only on that one: [Note: plan and layout] in
    osdp/contract.py. ``layout``: the runtime's ShardLayout (world, shard, replicate and
    node levels). PlanMismatchError names the plan's value, the layout's, and what to
    pass; ``hpz`` units trivial on the layout are run as what they become, with a warning."""
    world, shard, replicas, node = layout.world.size, layout.shard.size, layout.replicate.size, layout.node.size
    plan_layout = getattr(plan, "layout", LAYOUT_FULL)
    plan_world, plan_node = plan.world_size, getattr(plan, "node_size", None)
    plan_shard = getattr(plan, "shard_size", None)
    given = (f"the layout given has {world} ranks ({replicas} replica(s) x shard group of {shard}, "
             f"nodes of {node})")
    if plan_world is not None and plan_world != world:
        raise PlanMismatchError(
            f"this plan was made for world size {plan_world}, the process group has {world} ranks: plan again "
            f"for {world}, or pass a process_group= or mesh= of {plan_world} ranks (the layout given: "
            f"{replicas} replica(s) x shard group of {shard})"
        )
    if plan_layout == LAYOUT_FULL and replicas > 1:
        raise PlanMismatchError(
            f"this plan shards every unit over all {plan_world or world} ranks (layout 'full'), {given}: pass "
            f"process_group= (or a 1-D mesh) instead of the 2-D mesh, or plan with PlannerSettings(layout='hsdp')"
        )
    if plan_layout != LAYOUT_FULL and plan_shard is not None and plan_shard != shard:
        replicate = (plan_world or world) // plan_shard
        raise PlanMismatchError(
            f"this plan is an 'hsdp' plan with shard groups of {plan_shard} ranks ({replicate} replicas), {given}: "
            f"pass mesh=init_device_mesh(device, ({replicate}, {plan_shard}), mesh_dim_names=('replicate', 'shard'))"
        )
    if plan_layout == LAYOUT_FULL and plan_node is not None and plan_node != node:
        raise PlanMismatchError(
            f"this plan was made for nodes of {plan_node} ranks within the shard group (node_size={plan_node}), "
            f"{given}: pass node_size={plan_node} (or run under torchrun with {plan_node} ranks per node, "
            f"LOCAL_WORLD_SIZE={plan_node}), or plan again for node_size={node}"
        )
    trivial = {name: effective_mode(MODE_HPZ, node, shard) for name, modes in plan.unit_modes.items()
               if MODE_HPZ in modes and effective_mode(MODE_HPZ, node, shard) != MODE_HPZ}
    if trivial:
        becomes = next(iter(trivial.values()))
        why = ("the shard group is one node" if becomes != "dp" else "every node is one rank")
        names = sorted(trivial)
        warnings.warn(
            f"the plan's hpz units ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}; {len(names)} in all) "
            f"run as {becomes} on this layout: node_size={node} and a shard group of {shard} ranks, so {why} "
            "([Note: modes per level] in osdp/contract.py); pass node_size= (ranks per node) to re-gather within "
            "the node",
            stacklevel=4,  # the OSDP(...) call
        )
