"""Where a model's repeated blocks are: read by the planner (checkpointable blocks) and
by the compiled runtime (the regions it compiles one by one); and the signature a
module's stand-in forward shows."""
from __future__ import annotations

import difflib
import inspect

import torch.nn as nn

from .errors import OSDPError, a_type


def transformer_blocks(model: nn.Module) -> list[str]:
    """The children of every ``nn.ModuleList`` (transformer layers), by path."""
    return [
        f"{name}.{i}" if name else str(i)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for i, _ in enumerate(module)
    ]


# [Note: leaf modules]
# A unit is a module that owns parameters, gathered when its own forward starts. Code
# that calls submodules depending on data breaks that: a mixture of experts written with
# one module per expert calls only the experts its tokens were routed to, so the ranks
# would gather different units. A *leaf module* (DeepSpeed's ``set_z3_leaf_modules``;
# FSDP2's ``fully_shard`` on the MoE block) is ONE unit: every parameter below it, in one
# flat buffer, gathered when the leaf's forward starts and released when it ends, whatever
# its submodules do inside; the units inside it are not units of their own. Its slots are
# named by their dotted path below the leaf (``experts.3.w1.weight``); a parameter below
# it used elsewhere too (tied across the leaf's border) is refused, as is splitting it.
# Leaves are named by module class or path (``leaf_paths``); a plan names them as units,
# and a plan unit with parameters below it that no unit of the plan owns is a leaf
# (``leaves_of_unit_names``).
# Gradients: every rank reduces the whole unit, so a parameter below the leaf that took
# no part in this step's forward on any rank (an expert no token was routed to) gets a
# zero gradient, as when the code calls it on an empty batch and as ZeRO-3 gives it, not
# the None that one process (or DDP) would leave: an optimizer with momentum or weight
# decay moves it all the same. Kept so because a checkpoint stores one optimizer state
# per unit (osdp/checkpoint/_optim_state.py): a unit whose parameters stepped unequally
# would not fit it. (Giving None needs the ranks to agree on what was used, a small
# collective per leaf and backward; tried, and left out for that reason.)
# The compiled path runs a leaf on its own submodules with their parameters swapped
# for the gathered views ([Note: compiled leaves] in osdp/runtime/compiled.py).
# Some stock modules are leaves by default (``leaf_paths(defaults=True)``, as OSDP and
# the planner resolve by-hand and planned units): their forward reads a submodule's
# weight itself, not through that submodule's forward, so as units of their own the
# weight would be read outside its unit and refused ([Note: weights read outside their
# unit] in osdp/runtime/foreign_reads.py). ``nn.MultiheadAttention`` (and so every
# ``nn.Transformer`` layer) computes with ``out_proj.weight`` inside
# ``F.multi_head_attention_forward``. A default leaf whose parameters are tied outside
# it is left to that check. A plan names its leaves itself.
DEFAULT_LEAF_CLASSES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def leaf_paths(model: nn.Module, leaf_modules, *, defaults: bool = False) -> tuple[str, ...]:
    """The module paths ``leaf_modules`` names (module classes and/or paths), and with
    ``defaults`` every module of a ``DEFAULT_LEAF_CLASSES`` class ([Note: leaf
    modules]); outermost only (a leaf inside another is part of it), in module order; an
    OSDPError for a name that is not a module path or a class no module of the model is."""
    if leaf_modules is None:
        leaf_modules = ()
    elif isinstance(leaf_modules, (str, type)) or not hasattr(leaf_modules, "__iter__"):
        raise OSDPError(f"leaf_modules must be a tuple or list of module classes or module paths, got "
                        f"{leaf_modules!r} ({a_type(leaf_modules)}): pass ({leaf_modules!r},) for one")
    wanted = list(leaf_modules)
    modules = dict(model.named_modules())
    classes = []
    for item in wanted:
        if isinstance(item, type) and issubclass(item, nn.Module):
            if not any(isinstance(m, item) for m in modules.values()):
                raise OSDPError(f"leaf_modules: no module of {type(model).__name__} is a {item.__name__}")
            classes.append(item)
        elif isinstance(item, str):
            if item not in modules or item == "":
                close = difflib.get_close_matches(item, list(modules), n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                what = "the whole model cannot be one leaf" if item == "" else "is not a module path of the model"
                raise OSDPError(f"leaf_modules: {item!r} {what}{hint}")
        else:
            raise OSDPError(f"leaf_modules lists module classes (nn.Module subclasses) or module paths (strings), "
                            f"got {item!r} ({a_type(item)})")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    paths = []
    for path, module in modules.items():
        if not path or any(path.startswith(p + ".") for p in paths):
            continue
        if path in wanted or isinstance(module, tuple(classes)):
            if not any(p is not None for p in module.parameters()):
                raise OSDPError(f"leaf_modules: {path!r} ({type(module).__name__}) has no parameters; a leaf is "
                                "the unit of every parameter below it")
            _check_own_parameters(model, path, names)
            paths.append(path)
        elif defaults and isinstance(module, DEFAULT_LEAF_CLASSES) and _tied_outside(model, path, names) is None:
            paths.append(path)
    return tuple(paths)


def _tied_outside(model: nn.Module, leaf: str, names: dict[int, list[str]]) -> tuple[str, str] | None:
    """A parameter below ``leaf`` that is also used outside it (its name below the leaf,
    its name outside), or None. ``names``: id(parameter) -> every name of it in ``model``."""
    for name, p in model.get_submodule(leaf).named_parameters(prefix=leaf, remove_duplicate=False):
        outside = [n for n in names[id(p)] if not n.startswith(leaf + ".")]
        if outside:
            return name[len(leaf) + 1:], outside[0]
    return None


def _check_own_parameters(model: nn.Module, leaf: str, names: dict[int, list[str]]) -> None:
    """A leaf is gathered as one unit: no parameter below it may be used outside it."""
    tied = _tied_outside(model, leaf, names)
    if tied is not None:
        inside, outside = tied
        raise OSDPError(
            f"leaf module {leaf!r}: its parameter {inside!r} is also {outside!r}, outside it; a leaf is gathered "
            "as one unit, so its parameters must be its own: leave the tied modules out of leaf_modules"
        )


def leaves_of_unit_names(model: nn.Module, names) -> tuple[str, ...]:
    """The leaves among a plan's unit names: modules of ``model`` with parameters below
    them (in submodules) that no named module owns ([Note: leaf modules]); a leaf may own
    parameters itself too (stock Mamba's mixer: ``A_log`` and ``D`` beside its
    projections)."""
    modules = dict(model.named_modules())
    owned = {id(p) for name in names if name in modules for p in modules[name]._parameters.values() if p is not None}
    leaves = []
    for name in names:
        module = modules.get(name)
        if module is None or not name:
            continue
        below = [p for sub, child in module.named_modules() if sub for p in child._parameters.values() if p is not None]
        if below and not any(id(p) in owned for p in below):
            leaves.append(name)
    return tuple(leaves)


UnitParam = tuple[str, nn.Module, str, nn.Parameter]  # (name below the unit, owner module, attr, parameter)


def subtree_params(module: nn.Module) -> list[UnitParam]:
    """Every parameter below ``module`` as a leaf computes with it, a tied one under each
    module holding it: ``(dotted name below it, owner module, attr, parameter)``."""
    return [(f"{sub}.{attr}" if sub else attr, owner, attr, p)
            for sub, owner in module.named_modules() for attr, p in owner._parameters.items() if p is not None]


def unit_params(model: nn.Module, leaves=()) -> list[tuple[str, nn.Module, list[UnitParam]]]:
    """Per unit in module order: ``(path, module, [(name, owner, attr, param)])``, every
    parameter the unit's module computes with (``name``: its path below the unit, ``attr``
    on ``owner``; for an ordinary unit, the module's own parameters with ``name ==
    attr``). Tied parameters are listed under each module using them, as ``_parameters``
    has them; a leaf lists those of its whole subtree ([Note: leaf modules])."""
    leaves = tuple(leaves)
    units = []
    for path, module in model.named_modules():
        if any(path.startswith(leaf + ".") for leaf in leaves):
            continue
        if path in leaves:
            params = subtree_params(module)
        else:
            params = [(attr, module, attr, p) for attr, p in module._parameters.items() if p is not None]
        if params:
            units.append((path, module, params))
    return units


def signature_or_none(fn) -> inspect.Signature | None:
    """``inspect.signature(fn)``, None where it has none to read (a builtin's)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def with_self(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` (a bound method's) as its class's function declares it: ``self``
    first. A function's ``__signature__`` is what ``inspect.signature`` shows of the
    methods bound from it."""
    first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return signature.replace(parameters=[first, *signature.parameters.values()])
