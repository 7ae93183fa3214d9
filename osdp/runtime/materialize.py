"""Models built on the meta device: each unit is made real, initialized and cut to this
rank's shard before the next one, so the whole model never exists on one rank.

[Note: meta initialization]
``osdp.OSDP(model)`` where ``model`` was built under ``torch.device("meta")`` (its
parameters, or some of them, on meta). ``build_units`` walks the modules in
``model.modules()`` order, as it does for any model; for each module that directly
holds meta parameters or buffers, before its unit is built:

1. its meta parameters get storage on the runtime's device (``torch.utils.swap_tensors``:
   the objects stay, so a tied weight is still one parameter), filled with
   NaN (integers: their minimum) so that a value initialization never wrote is caught;
2. it is initialized: ``param_init_fn(module)`` when given, else its own
   ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` have one);
   a buffer is initialized by assigning it (``module.inv_freq = ...``) or, when it
   was given storage like the parameters (``materialize_buffers``), in place;
3. a parameter still holding the fill, or a buffer still on meta or holding it, is an
   OSDPError naming it and saying what to pass: nothing is left on meta silently;
4. once the unit has copied its shard, the parameters go back to meta: the transient
   is one module's parameters (a split op's whole weight, before its slices are cut).

A tied weight is made real again (and initialized again) when its second module comes:
the values its owner's unit holds are not touched, and the random numbers that
initialization draws are drawn as they were when the model was built normally.

Random numbers: module construction draws nothing on meta; initialization draws from
the generator of the device it runs on, one module at a time in ``modules()`` order. So
with the same ``torch.manual_seed`` on every rank (every rank initializes every unit,
each keeping its shard), a model whose initialization is each module's
``reset_parameters`` called once, with modules constructed in their ``modules()`` order
(plain ``nn.Linear``/``nn.Embedding``/``nn.LayerNorm`` stacks), equals bitwise the same
model built on the CPU and wrapped, tied weights included (the tied module's own init
ran in the normal build too, before the tie). What breaks the equality: a second
initialization pass after construction (``self.apply(self._init_weights)`` in
``__init__`` draws after every constructor has drawn: give that function as
``param_init_fn`` and the values follow the same law, not the same numbers), modules
constructed in another order than ``modules()`` lists them, a parent's
``reset_parameters`` that initializes its children, and a ``device`` other than CPU
(its generator is not the CPU's).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..errors import OSDPError
from .same_values import value_hash


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _fill(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return torch.iinfo(dtype).min


def _unset(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (made by ``_real``) still holds the fill everywhere it could."""
    fill = _fill(tensor.dtype)
    if tensor.is_meta:
        return True
    if fill is None or tensor.numel() == 0:
        return False
    return bool(torch.isnan(tensor).any()) if isinstance(fill, float) else bool((tensor == fill).any())


def _swap_in(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param`` holds ``data`` from now on, the same Python object (a tie stays a tie):
    ``Parameter.data =`` cannot move a tensor between meta and a real device."""
    torch.utils.swap_tensors(param, nn.Parameter(data, requires_grad=param.requires_grad))


def _real(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_like(tensor, device=device)
    fill = _fill(tensor.dtype)
    if fill is not None:
        out.fill_(fill)
    return out


class MetaInit:
    """Materialize and initialize one module's meta tensors at a time (see [Note: meta
    initialization]); ``param_init_fn``: ``fn(module)``, else ``reset_parameters()``."""

    def __init__(self, device: torch.device, param_init_fn=None, materialize_buffers: bool = True):
        if param_init_fn is not None and not callable(param_init_fn):
            raise OSDPError(f"param_init_fn must be a function of a module, got {param_init_fn!r}")
        self.device = torch.device(device)
        self.param_init_fn = param_init_fn
        self.materialize_buffers = materialize_buffers
        self._initialized: set[int] = set()  # parameters an earlier module initialized (tied)
        # (name, checksum) of each parameter initialized: [Note: the same values on every rank]
        self.value_hashes: list[tuple[str, int]] = []

    def materialize(self, path: str, module: nn.Module) -> None:
        """Give ``module``'s own meta parameters (and buffers) storage and initialize them;
        an OSDPError naming what its initialization left unset."""
        params = {k: p for k, p in module._parameters.items() if p is not None and p.is_meta}
        buffers = {k: b for k, b in module._buffers.items() if b is not None and b.is_meta}
        if not params and not buffers:
            return
        with torch.no_grad():
            for p in params.values():
                _swap_in(p, _real(p, self.device))
            if self.materialize_buffers:
                for k, b in buffers.items():
                    module._buffers[k] = _real(b, self.device)
        self._initialize(path, module, params, buffers)
        where = repr(path) if path else "the root module"
        # a tied weight's second module initializes it again only to draw as it drew
        checked = {k: p for k, p in params.items() if id(p) not in self._initialized}
        self._initialized.update(id(p) for p in params.values())
        self.value_hashes += [(f"{path}.{k}" if path else k, value_hash(p)) for k, p in checked.items()]
        for kind, names in (("parameter", checked), ("buffer", buffers)):
            for k in names:
                tensor = module._parameters[k] if kind == "parameter" else module._buffers.get(k)
                if tensor is not None and _unset(tensor):
                    raise OSDPError(
                        f"{kind} {k!r} of {where} ({type(module).__name__}) was built on the meta device and its "
                        f"initialization left it {'on meta' if tensor.is_meta else 'unset'}: pass "
                        "param_init_fn=fn, where fn(module) sets it (a buffer such as a rotary table: compute and "
                        "assign it), or build that module on a real device"
                    )

    def _initialize(self, path: str, module: nn.Module, params: dict, buffers: dict) -> None:
        with torch.no_grad():
            if self.param_init_fn is not None:
                self.param_init_fn(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            elif params:
                where = repr(path) if path else "the root module"
                raise OSDPError(
                    f"{where} ({type(module).__name__}) was built on the meta device and has no reset_parameters() "
                    f"to initialize its parameters {sorted(params)}: pass param_init_fn=fn, where fn(module) "
                    "initializes a module's own parameters (e.g. the model's _init_weights)"
                )

    @staticmethod
    def release(module: nn.Module, params) -> None:
        """Back to meta: the unit holds their values now (the objects stay, for ties)."""
        with torch.no_grad():
            for p in params:
                if not p.is_meta:
                    _swap_in(p, torch.empty_like(p, device="meta"))


def init_by_submodel(model: nn.Module, method: str = "_init_weights"):
    """A ``param_init_fn`` for a model built on the meta device that initializes each
    module as Hugging Face's ``initialize_weights`` does: with ``method`` of the nearest
    module around it (itself included) that has one. A composite model (Llava: a CLIP
    vision tower inside a Llama model) holds sub-models whose own ``_init_weights``
    initialize their modules; the outer model's alone leaves theirs unset (found by a
    helper: Llava's ``class_embedding``, refused at wrap as built on meta and never set)."""
    if not callable(getattr(model, method, None)):
        raise OSDPError(f"{type(model).__name__} has no {method}() to initialize its modules with")
    init_of: dict[int, object] = {}

    def walk(module: nn.Module, init) -> None:
        own = getattr(module, method, None)
        init = own if callable(own) else init
        init_of[id(module)] = init
        for child in module.children():
            walk(child, init)

    walk(model, None)
    return lambda module: init_of[id(module)](module)


# ---- other values than a fresh initialization: a model's skeleton and where its values come from
def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (ties
    kept: one meta tensor per tensor of ``model``); nothing of its data is copied."""
    memo = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(
            tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


class ValuesFrom:
    """A ``param_init_fn`` that fills the modules of ``model`` (the one being wrapped)
    from ``source`` instead of initializing them: ``source.fill(path, module)`` copies
    that module's own parameters and buffers (the ones of its name in the source)."""

    def __init__(self, model: nn.Module, source):
        self.paths = {id(m): path for path, m in model.named_modules()}
        self.source = source

    def __call__(self, module: nn.Module) -> None:
        self.source.fill(self.paths[id(module)], module)


def copy_own(module: nn.Module, path: str, value_of) -> None:
    """``module``'s own parameters and buffers <- ``value_of(full name)`` (None: skipped)."""
    with torch.no_grad():
        for kind in ("_parameters", "_buffers"):
            for key, tensor in getattr(module, kind).items():
                if tensor is None or tensor.is_meta:
                    continue
                value = value_of(f"{path}.{key}" if path else key, kind == "_buffers")
                if value is not None:
                    tensor.copy_(value)


class ModuleValues:
    """Values of a real (unwrapped) model, read where they are."""

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = dict(model.named_buffers(remove_duplicate=False))

    def fill(self, path: str, module: nn.Module) -> None:
        copy_own(module, path, lambda name, buffer: (self.buffers if buffer else self.params).get(name))
