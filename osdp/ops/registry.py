"""Registry of split ops, keyed by op name: each op is declared once, with the module
type it replaces, the axis it cuts and that axis's length, and the kernels it runs.
``describe``, the analytic descriptions, the cost model, the profiler and the runtime
all read this registry (no other place knows which modules split, or along what).

[Note: split op declaration]
A split op is a :class:`SplitModule` subclass with the class attributes

- ``op_name``: its key (recorded in descriptions and plans, per unit);
- ``module_type``: the exact module type it replaces;
- ``axis``: ``"in_features"``, ``"out_features"`` or ``"rows"``: what it cuts;
- ``kernels``: the names of the ``osdp.ops.kernels`` functions it computes with;
- ``default_for_type``: the op a ``splits={name: g}`` of that module type gets when no
  op is named (one per type; others are chosen by name, e.g. ``split_ops=``);
- ``planned``: whether the planner may choose it (the cost model prices matmul
  splits; an op it cannot price yet is run only when asked for);
- ``needs_weights_in_backward``: whether its backward reads the slices' weights (False:
  a slice is never gathered for backward, and a ``dp`` slice is not kept for it);
- ``tied_use_op``: when the split parameter is tied to another module's (an embedding
  and an LM head), the op that module runs on the SAME slices (it must cut the shared
  weight identically); None: a tied split is refused. See [Note: tied row split] in
  ``osdp/contract.py``;

and the classmethod ``axis_length(module)``. Registering is decorating it with
:func:`register_split_op`; adding a split op is one file and its test.

[Note: weight gradients a backward wants]
A split op's autograd Function writes its slices' weight gradients itself, into the
units' unsharded buffers that backward reduces into ``.grad``. A backward pass may not
want them: ``torch.autograd.grad(loss, x)`` for an input's gradient (adversarial
examples, saliency maps) leaves every ``.grad`` as it was in plain PyTorch, and the
step after it must not see weight gradients from it. The engine knows which nodes a
pass will run, but a leaf's accumulator cannot be asked under ``autograd.grad``, so the
Function takes each slice's flat shard through a view (:meth:`SplitModule.shard_inputs`)
and its backward asks, per slice, whether the engine will run that view's node
(:meth:`SplitModule.wanted_grads`); a slice it will not run gets no weight gradient (its
part of the input's gradient is computed as ever). A new op does the same: its
Function's last inputs are ``shard_inputs()``, and its backward takes the gradient
buffers from :meth:`SplitModule.slice_grads`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn

from ..contract import split_sizes  # noqa: F401 - part of the ops API
from ..errors import OSDPError

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime.scheduler import Scheduler
    from ..runtime.shard_unit import ShardUnit

_REGISTRY: dict[str, type["SplitModule"]] = {}  # op name -> op
_DEFAULTS: dict[type, str] = {}  # module type -> default op name


class SplitModule(nn.Module):
    """A module whose parameters are cut into ``g`` slices, each one shard unit.

    Subclasses implement:

    - ``check(module, g, name)`` (classmethod): raise :class:`OSDPError` when ``module``
      cannot be cut into ``g`` slices, saying what would work.
    - ``slice_tensors(module, g)`` (classmethod): per slice, an ordered dict
      ``attr -> tensor`` of the slice's parameters (what its unit flattens and shards).
    - ``merge(slices)`` (classmethod): the inverse, per-slice tensors back to the
      original module's parameters (``name -> tensor``), for full state dicts.
    - ``__init__(module, g)``: keep what ``forward`` needs (shapes, options).
    - ``forward``: compute with slices acquired from ``self.scheduler``; see
      :class:`osdp.runtime.scheduler.Scheduler` for the acquire/release protocol.
    """

    module_type: ClassVar[type]
    op_name: ClassVar[str]
    axis: ClassVar[str]  # "in_features", "out_features" or "rows"
    kernels: ClassVar[tuple[str, ...]] = ()
    default_for_type: ClassVar[bool] = True
    # the cost model can price it (a matmul split); False: the runtime runs it when
    # asked (splits=), the planner does not choose it
    planned: ClassVar[bool] = True
    # False when backward reads no weights (then the scheduler never gathers the
    # slices for backward and frees them after forward in either mode)
    needs_weights_in_backward: ClassVar[bool] = True
    # the op a module tied to the split weight runs on the same slices (None: refused)
    tied_use_op: ClassVar[str | None] = None

    def __init__(self, g: int):
        super().__init__()
        self.g = g
        self.scheduler: Scheduler | None = None
        self.units: list[ShardUnit] = []

    def bind(self, scheduler: "Scheduler", units: list["ShardUnit"]) -> None:
        """Called by the runtime once the slice units exist."""
        self.scheduler = scheduler
        self.units = list(units)
        # the slices' flat shards, inputs of the op's autograd Function (so its backward
        # runs even when x needs no grad); not registered: the optimizer sees the
        # original parameters (see [Note: original parameters] in shard_unit.py)
        self.flat_shards = [u.shard for u in units]

    def shard_inputs(self) -> list[torch.Tensor]:
        """The slices' flat shards as the op's autograd Function takes them (its last
        inputs): through a view each, [Note: weight gradients a backward wants]."""
        return [shard.view_as(shard) for shard in self.flat_shards]

    def wanted_grads(self, ctx) -> list[bool]:
        """Per slice, inside the Function's backward (``ctx``): whether this pass wants
        the slice's weight gradient (trainable, and the engine runs its shard's node)."""
        nodes = ctx.next_functions[-len(self.units):]
        return [unit.requires_grad and node is not None and torch._C._will_engine_execute_node(node)
                for unit, (node, _) in zip(self.units, nodes)]

    def slice_grads(self, unit: "ShardUnit", wanted: bool) -> tuple[list[torch.Tensor] | None, bool]:
        """``unit``'s unsharded gradient views and whether they hold one already (see
        ``Scheduler.grad_buffer``), or ``(None, False)``: no weight gradient this pass."""
        return self.scheduler.grad_buffer(unit) if wanted else (None, False)

    def refuse_create_graph(self) -> None:
        """Called by a backward that computes its input's gradient in place (``out=``
        kernels), which autograd cannot differentiate again: under ``create_graph`` it
        raised "functions with out=... arguments don't support automatic
        differentiation", naming no module."""
        if torch.is_grad_enabled():  # the engine runs a create_graph pass with grad mode on
            name = self.units[0].name.rpartition("[")[0] if self.units else type(self).__name__
            raise OSDPError(
                f"a backward with create_graph=True (a gradient penalty through autograd.grad) reached the split op "
                f"of {name!r}, whose backward cannot be differentiated again: leave {name!r} unsplit (no splits= "
                "entry), or take the gradient before it")

    @classmethod
    def axis_length(cls, module: nn.Module) -> int:
        """Length of the axis the op cuts (the most slices it can make)."""
        raise NotImplementedError

    @classmethod
    def check(cls, module: nn.Module, g: int, name: str) -> None:
        raise NotImplementedError

    @classmethod
    def slice_tensors(cls, module: nn.Module, g: int) -> list[dict[str, torch.Tensor]]:
        raise NotImplementedError

    @classmethod
    def merge(cls, slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


def register_split_op(cls: type[SplitModule]) -> type[SplitModule]:
    """Class decorator: register ``cls`` under ``cls.op_name`` (see [Note: split op
    declaration])."""
    if not (isinstance(cls, type) and issubclass(cls, SplitModule)):
        raise TypeError(f"{cls!r} is not a SplitModule subclass")
    existing = _REGISTRY.get(cls.op_name)
    if existing is not None and existing is not cls:
        raise OSDPError(f"a split op named {cls.op_name!r} is already registered ({existing.__name__})")
    default = _DEFAULTS.get(cls.module_type)
    if cls.default_for_type and default is not None and default != cls.op_name:
        raise OSDPError(
            f"{cls.module_type.__name__} already has default split op {default!r}; register {cls.op_name!r} "
            "with default_for_type = False (it is then chosen by name)"
        )
    _REGISTRY[cls.op_name] = cls
    if cls.default_for_type:
        _DEFAULTS[cls.module_type] = cls.op_name
    return cls


def unregister_split_op(op_name: str) -> None:
    """Remove a registered op (tests, experiments)."""
    cls = _REGISTRY.pop(op_name, None)
    if cls is not None and _DEFAULTS.get(cls.module_type) == op_name:
        del _DEFAULTS[cls.module_type]


def get_split_op(module: nn.Module, name: str = "", op_name: str | None = None) -> type[SplitModule]:
    """The split op named ``op_name`` (it must replace ``module``'s type), or the default
    op for ``module``'s exact type; an OSDPError naming the known ones otherwise."""
    if op_name is not None:
        op = _REGISTRY.get(op_name)
        if op is None:
            raise OSDPError(f"unit {name!r}: no split op named {op_name!r}; registered: {', '.join(sorted(_REGISTRY))}")
        if type(module) is not op.module_type:
            raise OSDPError(
                f"unit {name!r} is a {type(module).__name__}; split op {op_name!r} splits {op.module_type.__name__}"
            )
        return op
    default = _DEFAULTS.get(type(module))
    if default is None:
        known = ", ".join(sorted(t.__name__ for t in _DEFAULTS)) or "none"
        base = next((t for t in type(module).__mro__[1:] if t in _DEFAULTS), None)
        # ops are looked up by exact type: a subclass may compute otherwise (stock Gemma's
        # and BART's scaled word embeddings multiply the lookup), which a base's op would drop
        subclass = ("" if base is None else
                    f" (a subclass of {base.__name__}, whose split op would not run its own forward: "
                    "register an op for it, see 'Extending: a new split op' in the README)")
        raise OSDPError(
            f"unit {name!r} is a {type(module).__name__}, which has no split op{subclass}; "
            f"modules that can be split: {known}"
        )
    return _REGISTRY[default]


def default_split_op(module: nn.Module) -> type[SplitModule] | None:
    """The default op for ``module``'s exact type, or None."""
    name = _DEFAULTS.get(type(module))
    return None if name is None else _REGISTRY[name]


def default_split_op_for_kind(kind: str) -> type[SplitModule] | None:
    """The default op for a module kind (lower-case class name, as descriptions have it)."""
    for module_type, name in _DEFAULTS.items():
        if module_type.__name__.lower() == kind:
            return _REGISTRY[name]
    return None


def registered_split_ops() -> dict[str, type[SplitModule]]:
    """Op name -> op, every registered split op."""
    return dict(_REGISTRY)
