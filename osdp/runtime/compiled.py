"""The compiled path: ``OSDP(..., compile=...)`` runs every unit's gather, free and
reduce-scatter as collectives the compiler sees, so ``torch.compile`` traces whole
blocks with the plan's per-operator behaviour intact.

[Note: compiled units]
Eager OSDP drives each unit from module and autograd hooks around a stream scheduler
(hooks.py): the hooks resize storages, wait on events and keep per-unit state, none of
which dynamo traces, so ``torch.compile`` of an eager OSDP model breaks the graph at
every operator (31 breaks for 2 GPT layers), and the elementwise work between matmuls
is never fused. Two ways out were studied:

- FSDP2's: the hooks stay eager and the compiler gets what lies between them. FSDP2
  wraps whole blocks, so compiling each block leaves its hooks at the block boundaries
  (torchtitan's per-block compile); its traceable path (compiled autograd tracing the
  hooks, storage resizes made traceable) has been retired in favour of SimpleFSDP.
  OSDP's units are operators: hooks at unit boundaries are a graph per operator.
- SimpleFSDP's (torchtitan ``experiments/simple_fsdp``): the gather is a functional
  collective written into the forward (autograd's backward of an all-gather is the
  reduce-scatter), "free after forward, gather again for backward" is selective
  activation checkpointing of the gather with a must-recompute tag (the partitioner
  puts the recomputed gather into the backward graph), and "keep" is saving it.

OSDP takes the second, per unit, because it states the plan in the graph itself: a
unit's module (or a split op's slice) computes with views of
``all_gather(this rank's flat shard)``; a ``zdp`` unit's gather runs under a
must-recompute checkpoint, a ``dp`` unit's does not (its gathered buffer is saved for
backward), a ``rep`` unit's "gather" is the identity whose backward all-reduces; split
ops gather slice by slice; a checkpointed block recomputes everything except ``dp``
gathers. There are no hooks and no runtime state: the compiler sees every collective
and every operator, and may fuse the elementwise work around them.

The flat shard is rebuilt from the ORIGINAL parameters ([Note: original parameters] in
shard_unit.py, a copy of 1/N of the unit), so autograd hands each parameter its
gradient: ``p.grad`` accumulates across backward passes as in plain PyTorch, and
optimizers and parameter groups see what they see eagerly. :class:`GatherShard` casts
to the compute dtype, gathers, and in backward reduce-scatters in the reduce dtype and
averages over the shard group.

What the compiled path does not do (each refused with a clear error naming the unit):
hierarchical layouts (one shard group over all ranks only; ``hpz`` is then ``zdp`` or
``dp``, [Note: modes per level] in contract.py), split
ops without a compiled forward (the vocabulary row split of an embedding and its fused
head loss), turning gradient sync off (every compiled backward reduces its gradients).
There is no scheduler: with inductor, OSDP's own scheduling pass issues each gather
while the unit before it computes and runs each reduction under the compute after it,
within the plan's prefetch window ([Note: compiled prefetch] in compiled_prefetch.py;
``CompileConfig(overlap=False)`` leaves inductor's order, which waits for each
collective where it is issued). Bucketing is inductor's. Inductor's iterative
reordering passes (``sink_waits_iterative``,
``reorder_communication_preserving_peak_memory``) schedule by runtime estimates, which
are 0 on CPU. Measured, N&D 12x128, 2 gloo ranks, 9 interleaved steps, one process:
eager 359 ms, compiled 343 ms, compiled with those passes 344 ms; ``sink_waits`` alone
gained nothing either. Earlier runs that seemed to show a gain had hit dynamo's
recompile limit and ran partly eager (:func:`_forward_of`). Their risk across ranks is
[Note: comm reordering across ranks] in compile_config.py. On a GPU they are untried.
Two exceptions: rep units' gradients are all-reduced in eager's buckets by hooks
outside the graphs ([Note: rep gradients bucketed] in compiled_rep_grads.py), and on
gloo a sharded gradient is all-reduced and its shard kept ([Note: gloo reduce-scatter]).
Measured (N&D
12x128 GPT, batch 4, 26 rep + 50 zdp units, 2 gloo ranks on a 2-core CPU, 15
interleaved steps, medians, a quiet machine): eager 368 ms; compiled per-unit
all-reduces and reduce-scatters 448 ms; with both exceptions 395 ms; adding
``options={"bucket_all_gathers_fx": "all", "bucket_all_reduces_fx": "all"}`` 268 ms.
Those inductor passes are not the default: bucketing a graph's gathers may gather a
block's zdp units together, a peak the plan did not price (it assumes one at a time).

[Note: rep units uncopied]
A ``rep`` unit whose gradients the bucket all-reduces computes with its parameters
themselves (cast to the compute dtype where that differs), not with views of a flat
copy: rebuilding the flat buffer was a copy of every replicated weight in each forward
and a split of each gradient in backward. Measured (N&D 12x128 GPT, every unit ``rep``,
batch 3, 2 gloo ranks, 9 steps, medians): compiled backward 105 -> 88 ms against eager's
87, forward 39 -> 37 ms against eager's 35. A ``rep`` slice of a split op keeps the flat
path: its parameter is shared with the op's other slices.

[Note: units outside the blocks]
With ``scope="blocks"``, a unit outside the transformer blocks (embeddings, final
norm, head) is a region of one module. It needs a graph: run eagerly, a ``zdp`` unit's
gathered weight would be saved by its own operator for backward (the must-recompute
checkpoint governs only the gather), so it would be kept as ``dp`` keeps it.
``CompileConfig.outside_backend`` chooses how these regions are compiled: None (the
default) with ``backend``, as the blocks; ``"aot_eager"``: dynamo and AOT autograd with
the min-cut partitioner inductor also uses (the plan's recompute and collectives hold,
0 graph breaks) and aten operators run as traced, without generating code for one
matmul or lookup. Measured (N&D 12x128 at the bench's middle budget, its plan of 50
rep, 19 zdp and 7 dp units; 2 gloo ranks, 2-core CPU, cold caches, 15 interleaved
steps, medians, one run): first step 56.2 s -> 39.9 s with ``"aot_eager"`` outside,
steady step 254.7 -> 260.0 ms (eager OSDP 246.8 ms). The default keeps the step; a
short job, or auto mode compiling several trials, may take the compile time.
Dividing a sharded gradient by the group size before its reduce-scatter (so that the
division fuses into the kernel making the gradient, 5 fewer CPU kernels of 23 for that
model all-``zdp``, first step 42.0 -> 32.6 s) was measured too, and not kept: a weight's
gradient comes from a matmul, which fuses nothing, so the division became a pass over
the whole gradient instead of this rank's 1/N shard (steady step 260.0 -> 270.9 ms).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import types

import torch
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ..errors import ConfigError
from .activation_checkpoint import disable_kv_cache
from .compile_config import CompileConfig
from .compiled_collectives import (GatherShard, ReplicaGrad, checkpointed_block_policy, kept_group_name,
                                   recompute_gathers_policy, timed_group, traced_gather_name)
from .compiled_regions import (RegionClasses, compile_each, inside_any, region_paths, region_signature,
                               with_own_code)
from .compiled_rep_grads import ReplicaGradBucket
from .foreign_reads import FreedWeight
from .grad_norm import mark_sharded
from .modes import Mode
from .shard_unit import ShardUnit

__all__ = ["CompileConfig", "CompiledUnit", "compile_regions", "fused_layer_fast_path_off", "install",
           "mark_sharded_grads"]


# ---- one unit ----------------------------------------------------------------------------------
class CompiledUnit:
    """How one unit is gathered on the compiled path (static: the compiler guards on
    nothing that changes between steps)."""

    def __init__(self, unit: ShardUnit, mode: str, group, in_checkpointed_block: bool):
        self.unit = unit
        self.world = unit.shard_world if not unit.replicated else group.size()
        keep = mode == Mode.DP.value
        self.group_name = kept_group_name(group) if keep and not unit.replicated else group.group_name
        # [Note: a unit used twice in one graph] (compiled_collectives.py): a zdp unit's
        # calls gather under names of their own
        self.freed_between_calls = not keep and not unit.replicated
        # zdp: its own must-recompute region, unless a checkpointed block's policy decides
        self.recompute = mode == Mode.ZDP.value and not in_checkpointed_block
        self.compute_dtype = unit.param_dtype
        self.reduce_dtype = unit.reduce_dtype
        # where each parameter's local piece sits in the flat shard, in order; an empty
        # piece too, so that its parameter gets an (empty) gradient, as eagerly
        pieces = sorted((start, n, offset, i) for i, ((start, n), offset)
                        in enumerate(zip(unit.local_ranges, unit.param_offsets)))
        self.pieces = tuple((i, offset, n) for _, n, offset, i in pieces)
        self.pad = unit.shard_numel - sum(n for _, _, n in self.pieces)
        self.bucketed = False  # a rep unit whose gradients ReplicaGradBucket all-reduces
        # [Note: gloo reduce-scatter] gloo's reduce_scatter_tensor_coalesced (what the
        # functional reduce-scatter runs) was measured ~3-4 ms a call against ~0.7-2.4
        # ms for its all-reduce; eager OSDP all-reduces and keeps its shard on gloo too
        use_ar = os.environ.get("OSDP_COMPILED_GLOO_RS_AS_AR", "1") != "0"
        self.rank_if_all_reduce = (group.rank() if use_ar and not unit.replicated
                                   and c10d.get_backend(group) == "gloo" else None)

    def signature(self) -> tuple:
        """Everything the traced code reads from this unit, as plain values
        ([Note: one code object per region plan] in compiled_regions.py)."""
        unit = self.unit
        return (self.world, self.group_name, self.recompute, self.compute_dtype, self.reduce_dtype, self.pieces,
                self.pad, self.bucketed, self.rank_if_all_reduce, unit.replicated, unit.split_params is None,
                tuple((s.attr, s.offset, s.numel, tuple(s.shape)) for s in unit.slots),
                tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in unit.params))

    def local_flat(self) -> torch.Tensor:
        """This rank's flat shard rebuilt from the original parameters (a copy; autograd
        carries the gradient back into their ``.grad``)."""
        params = self.unit.params
        parts = [params[i].reshape(-1).narrow(0, offset, n) for i, offset, n in self.pieces]
        if self.pad:
            parts.append(params[0].new_zeros(self.pad))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _gather_now(self, group_name: str) -> torch.Tensor:
        if self.unit.replicated:  # group_name is self.group_name; a bucketed unit's gradient stays local
            return ReplicaGrad.apply(self.local_flat(), self.world, None if self.bucketed else group_name,
                                     self.compute_dtype, self.reduce_dtype)
        return GatherShard.apply(self.local_flat(), self.world, group_name, self.compute_dtype,
                                  self.reduce_dtype, self.rank_if_all_reduce)

    def call_group_name(self) -> str:
        """The name this call's gather gives the shard group ([Note: a unit used twice in
        one graph]): one of its own for each traced call of a zdp unit."""
        if self.freed_between_calls and torch.compiler.is_compiling():
            return traced_gather_name(self.group_name)
        return self.group_name

    def gathered(self) -> torch.Tensor:
        """The unit's full flat buffer in the compute dtype, for one call of its module."""
        group_name = self.call_group_name()
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._gather_now, group_name, use_reentrant=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, recompute_gathers_policy))
        return self._gather_now(group_name)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.unit.slots]

    def slot_tensors(self) -> list[torch.Tensor]:
        """What the module computes with, one tensor per slot in the compute dtype: the
        gathered buffer's views, or, for a bucketed ``rep`` unit (not a split op's
        slice), its own parameters ([Note: rep units uncopied])."""
        if self.bucketed and self.unit.split_params is None:
            # ``to`` returns the parameter itself where the dtype is already the compute one
            return [p.to(self.compute_dtype).view(s.shape) for p, s in zip(self.unit.params, self.unit.slots)]
        return self.views(self.gathered())


# ---- modules computing with units ---------------------------------------------------------------
class _ModuleWithViews:
    """A module as its forward sees it on the compiled path: the units' views under its
    parameter names, everything else the module's (its methods bound to this object, so
    that a helper method reads the views too). A new object per call, so a
    checkpointed block's forward mutates nothing outside itself (dynamo refuses side
    effects inside a checkpoint region).

    [Note: stand-ins that super() accepts]
    A forward that calls ``super().forward(...)`` (stock Gemma 2/3's and BART's scaled
    word embeddings: ``nn.Embedding.forward`` times a scale) needs ``self`` to be an
    instance of its class: zero-argument ``super()`` checks it. For such a class the
    stand-in is an instance of a subclass of both (:func:`stand_in_class`), made without
    running either ``__init__``: its methods are the class's own, found on the type and
    bound to the stand-in, and everything else still comes from ``__getattr__``. Other
    modules keep the plain stand-in, which dynamo traces as a user object."""

    def __init__(self, module: nn.Module, views: dict[str, torch.Tensor]):
        # One store per attribute: torch 2.11's dynamo breaks the graph on
        # ``self.__dict__.update`` (every call of every unit's module on an H200 run).
        for name, view in views.items():
            object.__setattr__(self, name, view)
        object.__setattr__(self, "_osdp_module", module)

    def __getattr__(self, name: str):
        module = self._osdp_module
        function = inspect.getattr_static(type(module), name, None)
        if isinstance(function, types.FunctionType) and name not in module.__dict__:
            # a method of the class: bound to the views (dynamo binds ``__func__.__get__``
            # back to the module itself, whose weights are freed: Funnel's helper read them)
            return function.__get__(self)
        return getattr(module, name)

    # a container's forward indexes itself: torch.nn.utils.parametrize's
    # ParametrizationList calls ``self[0](self.original)`` (Python finds these on the type)
    def __getitem__(self, index):
        return self._osdp_module[index]

    def __len__(self) -> int:
        return len(self._osdp_module)

    def __iter__(self):
        return iter(self._osdp_module)


def _calls_zero_arg_super(cls: type) -> bool:
    """Whether a method of ``cls`` (or of a base below ``nn.Module``) that a forward may
    call, not a dunder such as ``__init__``, calls ``super()`` with no arguments: its
    code reads the ``__class__`` cell. A decorated method's own code: a decorator's
    wrapper (``@torch.no_grad()``, stock Marian's and Pegasus's positional embeddings)
    reads only its own free variables."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            function = getattr(value, "__func__", value)
            if callable(function):
                function = inspect.unwrap(function)
            code = getattr(function, "__code__", None)
            if code is not None and "__class__" in code.co_freevars:
                return True
    return False


@functools.cache
def stand_in_class(cls: type) -> type:
    """The class of a module's stand-in ([Note: stand-ins that super() accepts]):
    :class:`_ModuleWithViews`, or a subclass of it and of ``cls`` where ``cls``'s code
    calls ``super()`` with no arguments."""
    if not _calls_zero_arg_super(cls):
        return _ModuleWithViews
    return type(f"{cls.__name__}WithViews", (_ModuleWithViews, cls), {"__module__": __name__})


class ModuleUnits:
    """A module's units and which of their slots its attributes read."""

    def __init__(self, entries: list[tuple[CompiledUnit, list[tuple[str, int]]]], base_forward, stand_in: type):
        self.entries = entries
        self.base_forward = base_forward
        self.stand_in = stand_in

    def signature(self) -> tuple:
        return tuple((cunit.signature(), tuple(slots)) for cunit, slots in self.entries)

    @staticmethod
    def slot_tensors(cunit: CompiledUnit) -> list[torch.Tensor]:
        return cunit.slot_tensors()

    def views(self) -> dict[str, torch.Tensor]:
        """Attribute name -> what the module computes with for this call."""
        views = {}
        for cunit, slots in self.entries:
            gathered = self.slot_tensors(cunit)
            for attr, i in slots:
                views[attr] = gathered[i]
        return views

    def forward(self, module: nn.Module, args, kwargs):
        return self.base_forward(self.stand_in(module, self.views()), *args, **kwargs)


class LeafUnits(ModuleUnits):
    """[Note: compiled leaves] A leaf module's unit ([Note: leaf modules] in
    osdp/module_tree.py) holds the parameters of its whole subtree, which its submodules
    read from themselves, where a stand-in of the leaf cannot reach. So the leaf's
    forward runs on the module itself with every submodule's parameters swapped for the
    gathered views for the call (``torch.nn.utils.stateless._reparametrize_module``, what
    ``torch.func.functional_call`` does: dynamo traces it, no graph break) and put back
    after. A ``rep`` leaf computes with a copy of its flat parameters: AOT autograd gave
    some of its parameters zero or wrong gradients when the swapped-in tensors were views
    of :class:`ReplicaGrad`'s output, itself a view of its input (measured on 2 ranks:
    experts' gradients 0 where eager's were not; a copy made them equal), and unlike
    other rep units a leaf cannot compute with its parameters themselves (an expert no
    token reached would get no gradient)."""

    @staticmethod
    def slot_tensors(cunit: CompiledUnit) -> list[torch.Tensor]:
        if not cunit.unit.replicated:
            return cunit.slot_tensors()
        flat = cunit.gathered()
        return cunit.views(flat.clone() if flat.dtype == cunit.unit.shard_dtype else flat)

    def forward(self, module: nn.Module, args, kwargs):
        with _reparametrize_module(module, self.views()):
            return self.base_forward(module, *args, **kwargs)


class SplitUnits:
    """A split op's slice units: the op computes slice by slice with their views."""

    def __init__(self, slices: list[CompiledUnit]):
        self.slices = slices

    def signature(self) -> tuple:
        return ("split",) + tuple(cunit.signature() for cunit in self.slices)

    def forward(self, module: nn.Module, args, kwargs):
        def slice_views(i: int) -> dict[str, torch.Tensor]:
            cunit = self.slices[i]
            return {s.attr: v for s, v in zip(cunit.unit.slots, cunit.slot_tensors())}

        return module.compiled_forward(slice_views, *args, **kwargs)


def _compiled_call(self, *args, **kwargs):
    return self._osdp_compiled.forward(self, args, kwargs)


def _forward_of(base: type):
    """A copy of :func:`_compiled_call` with a code object of its own, for one wrapped
    model's subclass of ``base``. A region's frame has its own code already ([Note: one
    code object per region plan] in compiled_regions.py) and inlines this; it is a frame
    of its own where dynamo resumes after a graph break inside a unit's module, and
    then one function shared by every model would be one cache for all of them."""
    name = f"forward_{base.__name__}"
    return with_own_code(_compiled_call, name, f"Compiled{base.__name__}.{name}")


def _swap_class(module: nn.Module, runner, classes: dict[type, type]) -> None:
    """Give ``module`` a subclass of its class whose forward runs ``runner``: one
    subclass per class and wrapped model (``classes``), so that the blocks of one type
    share their compiled code and two models never share a cache (:func:`_forward_of`)."""
    base = type(module)
    cls = classes.get(base)
    if cls is None:
        cls = classes[base] = type(f"Compiled{base.__name__}", (base,), {"forward": _forward_of(base),
                                                                        "__module__": base.__module__})
    module.__class__ = cls
    module.__dict__["_osdp_compiled"] = runner


# [Note: fused layer fast path]
# In eval under no_grad, torch's nn.TransformerEncoderLayer (and nn.MultiheadAttention)
# take a "fast path": one fused kernel (torch._transformer_encoder_layer_fwd) fed with
# the weights of the layer's children, read through the layer itself, not through the
# children's forwards. Eager OSDP never takes it (torch skips it where a submodule has
# hooks). The compiled path has no hooks: the kernel read the children's placeholders
# (FreedWeight) and every eval of a stock encoder layer was refused (found by a helper).
# A compiled model's forward runs with the fast path off, so each child computes with
# its gathered views, as in training; the flag is torch's own, put back after.
@contextlib.contextmanager
def fused_layer_fast_path_off():
    """torch's nn.TransformerEncoderLayer / MultiheadAttention fast path off while a
    compiled model runs ([Note: fused layer fast path])."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _refuse(built, layout) -> None:
    if layout.is_hierarchical:
        raise ConfigError(f"compile= runs one shard group over all ranks; this layout is {layout.describe()}: "
                          "drop mesh=/node_size= or run eager (compile=None)")
    for path, (module, _) in built.splits.items():
        if not hasattr(module, "compiled_forward"):
            raise ConfigError(f"split op {type(module).op_name!r} of {path!r} has no compiled forward (the "
                              "compiled path runs the matmul splits: linear_in_features, linear_out_features, "
                              "conv1d_nx): leave it unsplit, or run eager (compile=None)")


def install(model: nn.Module, built, layout, checkpoint_blocks: tuple[str, ...], timeout_s: float) -> RegionClasses:
    """Make every module that computes with units run the compiled path (module
    forwards swapped, no hooks) and checkpoint ``checkpoint_blocks`` with the policy
    that keeps ``dp`` gathers; its collectives time out after ``timeout_s`` ([Note:
    compiled collective timeouts] in compiled_collectives.py). The region classes
    returned are the ones :func:`compile_regions` adds to ([Note: one code object per
    region plan])."""
    _refuse(built, layout)
    group = timed_group(layout.world.group, timeout_s)
    inside = inside_any(checkpoint_blocks)
    cache: dict[ShardUnit, CompiledUnit] = {}
    classes: dict[type, type] = {}  # this model's swapped classes

    def compiled(unit: ShardUnit) -> CompiledUnit:
        if unit not in cache:  # a unit's name is its module's path (a slice's: path[i])
            # hpz on a flat layout is zdp (one node) or dp (one rank per node)
            mode = layout.effective_mode(unit.mode.value)
            cache[unit] = CompiledUnit(unit, mode, group, inside(unit.name.split("[")[0]))
        return cache[unit]

    for module, path, entries in built.bindings:
        for unit, slots in entries:
            for attr, i in slots:
                module.__dict__.pop(attr, None)  # eager views, if set
                if path not in built.leaves and not unit.replicated:
                    # its stand-in computes with the views; a read through the module itself
                    # (a parent computing with its child's weight) is refused naming the leaf
                    # that works, where this rank's piece failed on its shape deep inside
                    # dynamo ([Note: weights read outside their unit] in foreign_reads.py)
                    module.__dict__[attr] = FreedWeight(unit.views[i], unit, path, attr)
        runner = (LeafUnits if path in built.leaves else ModuleUnits)(
            [(compiled(u), slots) for u, slots in entries], _base_forward(module), stand_in_class(type(module)))
        _swap_class(module, runner, classes)
    for path, (module, units) in built.splits.items():
        _swap_class(module, SplitUnits([compiled(u) for u in units]), classes)
    if os.environ.get("OSDP_COMPILED_REP_BUCKET", "1") != "0":
        # before the signatures: it sets cunit.bucketed. Not a leaf's unit: computing with its
        # own parameters, an expert no token reached would get no gradient, where a leaf's
        # every parameter gets one (zero), as eagerly ([Note: leaf modules])
        _bucket_replica_grads([c for u, c in cache.items() if u.name not in built.leaves], group)
    regions = RegionClasses()
    if checkpoint_blocks:
        disable_kv_cache(model)
        policy = functools.partial(create_selective_checkpoint_contexts, checkpointed_block_policy)
        for path in checkpoint_blocks:
            block = model.get_submodule(path)
            regions.give(block, region_signature(block), context_fn=policy)
    return regions


def _bucket_replica_grads(cunits: list[CompiledUnit], group) -> ReplicaGradBucket | None:
    """Hand the gradients of ``rep`` units whose parameters no sharded unit shares to
    one :class:`ReplicaGradBucket` ([Note: rep gradients bucketed] in
    compiled_rep_grads.py)."""
    owners: dict[int, list[CompiledUnit]] = {}
    for cunit in cunits:
        for param in cunit.unit.params:
            owners.setdefault(id(param), []).append(cunit)
    entries, seen = [], set()
    for cunit in cunits:
        if not cunit.unit.replicated:
            continue
        params = [p for p in cunit.unit.params if p.requires_grad]
        if any(not c.unit.replicated for p in cunit.unit.params for c in owners[id(p)]):
            continue
        cunit.bucketed = True
        for param in params:
            if id(param) not in seen:
                seen.add(id(param))
                entries.append((param, cunit))
    if group.size() == 1:
        # the local gradient is the average: no hooks, no copies, no all-reduce. Measured
        # (N&D 12x128, every unit rep, batch 6, one rank, inductor on CPU, 15 interleaved
        # steps, medians): 114.8 ms with the bucket, 95.6 ms without
        return None
    return ReplicaGradBucket(group, entries) if entries else None


def mark_sharded_grads(units: list[ShardUnit]) -> None:
    """Mark each gradient as the eager runtime does when it hands one out, once autograd
    has accumulated it: a shard (sharded units) or whole on every rank (rep units), for
    [Note: global gradient norm] in grad_norm.py."""
    def hook(param, unit):
        if param.grad is None:  # the compiled backward gave it none (an output not in the loss): as eager
            return
        if unit.replicated:
            param.grad._osdp_replicated = True
        else:
            mark_sharded(param.grad, unit.norm_group)

    marked = {id(param): (param, unit) for unit in units for param in unit.params}  # a split parameter: once
    for param, unit in marked.values():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(functools.partial(hook, unit=unit))


def _base_forward(module: nn.Module):
    """The forward the module ran: its class's, or one set on the instance (taken off
    it, so that the swapped class's forward is found)."""
    own = module.__dict__.pop("forward", None)
    if own is None:
        return type(module).forward
    return lambda _module, *args, **kwargs: own(*args, **kwargs)


def compile_regions(model: nn.Module, config: CompileConfig, built, window_bytes: int,
                    regions: RegionClasses, coalesce_bytes: int = 0) -> list[str]:
    """Compile ``model`` per ``config.scope``, each region with its class from
    ``regions``; the paths compiled, in order. ``window_bytes``: the prefetch window
    ([Note: compiled prefetch]); ``coalesce_bytes``: small units' gathers merged up to
    it ([Note: compiled small units coalesced] in compiled_coalesce.py)."""
    config.refuse_unsafe_comm_reordering()
    unit_paths = [p for _, p, _ in built.bindings] + list(built.splits)
    blocks, outside = region_paths(model, unit_paths, config.scope)
    compile_each(model, blocks, regions, config.torch_compile_kwargs(window_bytes, coalesce_bytes))
    compile_each(model, outside, regions, config.outside_compile_kwargs(window_bytes, coalesce_bytes))
    return blocks + outside
