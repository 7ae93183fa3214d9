"""A unit's weights read outside its module's forward: caught on the first forward.

[Note: weights read outside their unit]
OSDP gathers a unit's weights when ITS module's forward starts and frees them (zdp) or
keeps them for backward (dp) after; the module's parameter attributes are views of that
gathered buffer. A module that reads a child's weight without calling the child breaks
this: stock Hugging Face Mamba's mixer convolves with ``self.conv1d.weight`` and
projects with ``self.dt_proj.weight`` itself, every SSM layer of the kind does, and so
does code that concatenates its projections' weights. Each child is a unit of its own,
not gathered then: the read finds a freed buffer (``setStorage: ... out of bounds for
storage of size 0``, raised deep inside the model), or, worse, a buffer still gathered
for a prefetch or a dp use, whose values are right but whose gradient reaches no
reduction, so the weight would never train. The fix is the user's: make the reading
module one unit, ``leaf_modules=(MambaMixer,)`` ([Note: leaf modules] in
osdp/module_tree.py), which gathers every parameter below it when its forward starts.

So the first forward of an eager model runs under :class:`ForeignReadCheck`, a
``TorchFunctionMode``: the tensors installed as a sharded unit's module attributes are
marked with their unit and name (hooks.py), global module hooks keep the modules
running, and an operator given a marked tensor while no module that computes with its
unit is running raises, naming the reading module, the weight and the ``leaf_modules=``
that would work. Replicated units are not checked: their attributes hold whole weights.
Cost: the first forward only.

Always on, outside the first forward: while none of its modules runs, a sharded unit's
attribute is a :class:`FreedWeight`, a tensor with the weight's shape, dtype and device
but no data, whose every operator raises :class:`ConfigError` naming the weight and its
module (hooks.py installs it at wrap time and once its module's forward returns). The
view of the freed buffer that stood there before turned a read on a later forward, in a
backward, in a user's hook or in ``model.apply(init_fn)`` into ``setStorage: ... out of
bounds`` or, through an operator that trusts its input's size (``weight.sum()``), a
segmentation fault. Metadata (``dtype``, ``shape``, ``device``) still reads. The
compiled path installs them too (compiled.py): a unit's module computes through a
stand-in holding the views, so only a read through the module itself finds it, where
this rank's piece of the parameter stood and failed on its shape deep inside dynamo;
dynamo traces the metadata reads without a graph break and raises the operator's error.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..errors import ConfigError

SLOT_MARK = "_osdp_slot"  # on an installed attribute tensor: (unit, the parameter's full name)
# what a read of a weight's metadata calls, right on a view of a freed buffer too (stock
# Mamba's block casts its input to ``self.norm.weight.dtype``): property getters
# (``dtype``, ``shape``, ``device``, ...) and these methods
_METADATA = frozenset({"__get__", "size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point",
                       "is_complex", "is_contiguous", "get_device", "type"})


def mark(tensor, unit, name: str) -> None:
    """Mark ``tensor``, installed as the attribute ``name`` of a module computing with
    ``unit``, for the check."""
    setattr(tensor, SLOT_MARK, (unit, name))


class FreedWeight(torch.Tensor):
    """What a sharded unit's weight attribute holds while none of its modules runs: its
    metadata, no data; every operator on it raises (see the Note above)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # operators reach __torch_dispatch__

    @staticmethod
    def __new__(cls, like: torch.Tensor, unit, module_path: str, attr: str):
        """``attr`` of the module at ``module_path`` (a leaf's: a dotted path below it)."""
        freed = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                    device=like.device)
        name = f"{module_path}.{attr}" if module_path else attr
        freed.unit_name, freed.weight_name, freed.module_path = unit.name, name, module_path
        mark(freed, unit, name)  # the first forward's check names the reader ([Note: weights read outside ...])
        return freed

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        freed = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, FreedWeight))
        module = repr(freed.module_path) if freed.module_path else "the model"
        raise ConfigError(
            f"{func.__name__} read {freed.weight_name!r} (unit {freed.unit_name!r}) outside the forward of its module "
            f"{module}: OSDP gathers a unit's weights only while a module computing with them runs; each rank holds "
            "only its shard otherwise. A module that computes with a child's weight without calling the child: "
            "make it one unit, leaf_modules=(ItsClass,). To read the values: model.full_state_dict(); to "
            "initialize them: param_init_fn= on a model built on the meta device, or before wrapping. See "
            "[Note: weights read outside their unit] in osdp/runtime/foreign_reads.py")

    def __repr__(self):
        return (f"FreedWeight({self.weight_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}: "
                "gathered only while its module runs)")

    def __deepcopy__(self, memo):  # copy.deepcopy of a wrapped model copies no data here either
        return self


class ForeignReadCheck(TorchFunctionMode):
    """Raises :class:`ConfigError` when an operator reads a sharded unit's attribute
    while none of ``runners[unit]`` (the modules computing with it) is running."""

    def __init__(self, model: nn.Module, runners: dict):
        super().__init__()
        self.runners = runners  # unit -> ids of the modules that gather it
        self.paths = {id(m): path for path, m in model.named_modules()}
        self.running: Counter = Counter()  # module id -> calls in progress
        self.stack: list[nn.Module] = []
        # modules whose forward ends at OSDP's post-forward (their binding calls exited()),
        # not at torch's global forward hook, which runs before a module's own hooks:
        # those registered before wrapping run with the weights still gathered
        self.bound: set[int] = set()
        self._handles = []

    def __enter__(self):
        self.running.clear()  # a first forward that raised left its modules "running"
        self.stack.clear()
        self._handles = [register_module_forward_pre_hook(self._enter_module),
                         register_module_forward_hook(self._exit_module)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def _enter_module(self, module, args):
        self.running[id(module)] += 1
        self.stack.append(module)

    def _exit_module(self, module, args, output):
        if id(module) not in self.bound:
            self.exited(module)

    def exited(self, module: nn.Module) -> None:
        self.running[id(module)] -= 1
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _METADATA:
            return func(*args, **kwargs)
        for value in tree_flatten((args, kwargs))[0]:
            slot = getattr(value, SLOT_MARK, None)
            if slot is not None and not any(self.running[m] for m in self.runners.get(slot[0], ())):
                raise ConfigError(self._message(*slot))
        return func(*args, **kwargs)

    def _reader(self, owner_path: str) -> nn.Module | None:
        """The innermost running module that contains the module ``owner_path``."""
        for module in reversed(self.stack):
            path = self.paths.get(id(module))
            if path is not None and (path == "" or owner_path == path or owner_path.startswith(path + ".")):
                return module
        return None

    def _message(self, unit, name: str) -> str:
        reader = self._reader(name.rpartition(".")[0])
        if reader is None:
            where, fix = "outside any module that contains it", "Read it inside its own module's forward"
        elif not self.paths[id(reader)]:  # the model itself: it cannot be a leaf
            where = f"in the forward of the model ({type(reader).__name__}) itself"
            fix = ("Compute with it through a module that holds it (a head reading an embedding's weight: an "
                   "nn.Linear whose weight is that embedding's, a tied use OSDP gathers there)")
        else:
            path = self.paths[id(reader)]
            where = (f"in the forward of {path!r} ({type(reader).__name__}), outside the forward of its own module "
                     f"{name.rpartition('.')[0]!r}")
            fix = (f"Make {path!r} one unit: leaf_modules=({type(reader).__name__},) (or the path {path!r}) gathers "
                   "every parameter below it when its forward starts")
        return (
            f"{name!r} (unit {unit.name!r}) was read {where}: OSDP gathers a unit's weights only while its own "
            f"module runs, so there they are freed or another use's, and their gradient would reach no reduction. "
            f"{fix}; or keep the unit whole on every rank, modes={{{unit.name!r}: 'rep'}} (in auto mode "
            f"settings=osdp.planner.PlannerSettings(rep_units=({unit.name!r},)); its full size in memory, read "
            "anywhere). See [Note: weights read outside their unit] in osdp/runtime/foreign_reads.py"
        )
