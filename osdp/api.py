"""``ShardedModel``: a model wrapped so that it trains with a per-unit OSDP plan (the
runtime side of ``osdp.OSDP``, which ``osdp/entry.py`` makes public with auto mode)."""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from .contract import RuntimeConfig, default_prefetch_bytes
from .checkpoint import full_state_dict as gathered_state_dict
from .errors import ConfigError, OSDPError, PlanMismatchError
from .memtrack import cpu_allocator_window, resident_tensors
from .module_tree import with_self
from .planner.calibration import format_report
from .planner.inputs import argument_tensors, forward_signature, sample_shapes
from .planner.plan import plan_from_arg
from .runtime.build import build_units, register_params
from .runtime.activation_checkpoint import apply_checkpointing
from .runtime.collectives import DEFAULT_TIMEOUT_S, CommContext, is_collective_failure
from .runtime.compile_config import CompileConfig
from .runtime.compiled import (compile_regions, fused_layer_fast_path_off, install as install_compiled,
                               mark_sharded_grads)
from .runtime.config import check_plan_layout, check_plan_matches_model, own_param_counts, resolve_config
from .runtime.direct import DirectBinding, DirectGradHooks, direct_units
from .runtime.grad_norm import check_norm_args, global_grad_norm, install_torch_clip_guard
from .runtime.hooks import ModuleBinding
from .runtime.lockstep import mark_lockstep
from .runtime.lockstep_check import LockstepCheck
from .runtime.foreign_reads import ForeignReadCheck
from .runtime.same_values import check_same_values, value_hash
from .runtime.optimizer_steps import HeldGradientsCheck, OptimizerSteps, PieceShapeCheck
from .runtime.ledger import MemoryLedger
from .runtime.materialize import MetaInit, has_meta
from .runtime.mesh import ShardLayout
from .runtime.mixed_precision import MixedPrecision, check_plan_dtypes
from .runtime.options import RuntimeOptions
from .runtime.modes import Mode
from .runtime.peak import StepMemory, StepMemoryCheck, make_monitor, step_peak_readable
from .runtime.scheduler import Scheduler
from .runtime.state_dict import build_layout
from .runtime.trainable import PlannedFrozenCheck, follow_requires_grad
from .runtime.view import ShardedView

log = logging.getLogger("osdp")


# the wrapped model's methods that would save its parameters as this rank holds them
_SAVING_METHODS = ("save_pretrained", "push_to_hub")


class ShardedModel(nn.Module):
    """The runtime of a plan: ``osdp.OSDP`` without auto mode (``osdp/entry.py`` adds
    it, one layer above: this module never imports the planner's measuring side).

    ``ShardedModel(module, plan)`` or ``ShardedModel(module, default_mode="zdp",
    modes={...}, splits={...})``. What it applies, in order:

    1. resolves every unit's per-slice modes (``plan.unit_modes()`` or the keyword
       arguments; units not named follow ``default_mode``) and checks the plan's world
       size, then checks that every rank resolved the same configuration;
    2. replaces each split unit by its split op (``osdp.ops``; ``nn.Linear`` is cut along
       ``in_features``, ``nn.Embedding`` by rows), its slices named ``f"{name}[{i}]"``;
    3. flattens each unit's parameters into one buffer sharded evenly across ranks (a
       ``rep`` unit's: whole on every rank);
       ``model.named_parameters()`` then yields the ORIGINAL parameters by their
       original names, each this rank's piece of it (a view of the shard, keeping the
       original ndim; a split parameter is one piece over its slices; a rep unit's
       parameter is whole, in its original shape), so optimizer parameter groups are
       built by name as with FSDP2; see [Note: original parameters] and [Note: split
       parameters];
    4. moves the shards and the (replicated) buffers to ``device``;
    5. wraps ``checkpoint_blocks`` in non-reentrant activation checkpointing;
    6. hooks every module into the stream scheduler.

    ``modes``: unit name -> ``"dp"``/``"zdp"``/``"hpz"``/``"rep"`` or one mode per slice (the
    length is the slice count; slices take ``"dp"``/``"zdp"``/``"hpz"`` only); slice names
    ``"name[i]"`` may also be keys. ``"rep"`` replicates a whole unit as DDP does (its
    parameters whole and in their original shapes on every rank, never gathered, gradients
    all-reduced in buckets): see [Note: replicated units] in ``osdp/contract.py``.
    ``splits``: unit name -> slice count. ``split_ops``: unit name -> registered split op
    name (``osdp.ops``), for a split unit cut another way than its type's default (e.g.
    ``"linear_out_features"``).
    ``prefetch_bytes``: the prefetch window (default: twice the largest
    unit's gathered bytes).
    ``leaf_modules``: module classes and/or module paths, each such module ONE unit of
    every parameter below it, gathered when its forward starts whatever its submodules
    do inside (DeepSpeed's ``set_z3_leaf_modules``): a mixture of experts that calls
    only the experts its tokens were routed to keeps the ranks in step this way. Modes
    name the leaf (``modes={"layers.0.moe": "dp"}``); a leaf is not split and runs
    eager. ``nn.MultiheadAttention`` is a leaf without being named (its forward reads
    its ``out_proj`` weight itself). See [Note: leaf modules] in ``osdp/module_tree.py``.

    Plan checks: every unit the plan names must be a module of ``module`` owning the
    parameter count the plan priced, the plan's dtypes must match ``mixed_precision``
    (:class:`PlanMismatchError` otherwise), and a forward whose batch (dim 0 of the first
    tensor argument) exceeds ``plan.batch_size`` raises :class:`OSDPError`.

    The runtime options below (device, mixed precision, timeout, coalescing, memory
    check, compile) are checked once into ``model.options``, an
    :class:`osdp.RuntimeOptions`; ``ShardedModel(m, plan, **model.options.as_kwargs())``
    runs another model the same way.

    ``mixed_precision``: :class:`osdp.runtime.mixed_precision.MixedPrecision` (gathers and
    compute in ``param_dtype``, reduction in ``reduce_dtype``, fp32 shards; see
    [Note: mixed precision]). ``timeout_s``: bound on every wait for a collective (a
    dead or hung peer raises ``CollectiveTimeoutError``, an OSDPError, naming the
    collective and unit; compiled, its own group's timeout: [Note: compiled collective
    timeouts]). ``coalesce_bytes``: small units' collectives are coalesced up
    to this many bytes (0: off; see [Note: coalesced small units]).

    Layout: ``process_group`` (default: the default group) shards every unit over its
    ranks (1-D); ``mesh``, a ``DeviceMesh`` with dims ``("replicate", "shard")``, shards
    over ``"shard"`` and replicates over ``"replicate"`` (HSDP: gradients reduced within
    the shard group, then all-reduced across replicas, averaged over every rank).
    ``node_size``: ranks per node within the shard group, for ``"hpz"`` units (default
    from ``LOCAL_WORLD_SIZE``; see [Note: shard layout] in ``osdp/runtime/mesh.py`` and
    [Note: modes per level] in ``osdp/contract.py``). A plan's ``world_size`` is the
    layout's rank count (replicas included); a plan runs only on the layout it was made
    for (its ``layout`` and ``node_size``: [Note: plan and layout] in ``osdp/contract.py``),
    and auto mode plans for the layout given.

    Memory check: with a memory limit (``memory_limit``, else the plan's), every step's
    measured peak is checked at the end of the step and going over raises
    ``MemoryLimitExceeded`` naming the unit at the peak; ``step_memory()`` is the last
    step's measurement, ``memory_check=False`` (or ``OSDP_MEMORY_CHECK=0``) turns it off.
    See [Note: measured peak] in ``osdp/runtime/peak.py``.

    Lockstep: every rank must call the same modules in the same order (each gather is a
    collective); Hugging Face models are told they are sharded, so that LayerDrop and
    ``generate`` keep their ranks in step, and at the end of each backward the ranks
    compare the collectives they issued, and the optimizer steps they took on the
    parameters since the previous check: ranks out of step raise
    ``RanksOutOfStepError`` from ``backward()`` (``lockstep_check=False`` or
    ``OSDP_LOCKSTEP_CHECK=0``: off). See [Note: ranks in lockstep] in
    ``osdp/runtime/lockstep.py``, [Note: lockstep check] in ``lockstep_check.py`` and
    [Note: optimizer steps in lockstep] in ``optimizer_steps.py``. With fp16 compute,
    scale the loss with ``osdp.GradScaler(model)``, not ``torch.amp.GradScaler``.

    A model built on the meta device (``with torch.device("meta"): model = ...``) is made
    real one module at a time, each initialized and cut to this rank's shard before the
    next: by ``param_init_fn(module)`` when given, else the module's own
    ``reset_parameters()``; seed every rank alike first. See [Note: meta initialization]
    in ``osdp/runtime/materialize.py`` (what equals a CPU build bitwise, and buffers).

    Gradient accumulation: ``no_sync()`` / ``set_requires_gradient_sync(False)`` keep
    unsharded fp32 gradients across micro-batches (no reduce-scatter, no rep bucket
    all-reduce) until a backward runs with sync on; ``micro_batch(i)`` applies the plan's
    ``gradient_sync`` policy over ``accumulation_steps`` micro-batches.
    """

    def __init__(
        self,
        module: nn.Module,
        plan=None,
        *,
        default_mode: str | Mode = "zdp",
        modes: dict | None = None,
        splits: dict | None = None,
        split_ops: dict | None = None,
        process_group=None,
        mesh=None,
        node_size: int | None = None,
        device: torch.device | str | None = None,
        prefetch_bytes: int | None = None,
        checkpoint_blocks: tuple[str, ...] = (),
        sync_module_states: bool = False,
        mixed_precision: MixedPrecision | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        coalesce_bytes: int | None = None,
        memory_limit=None,
        memory_check: bool = True,
        param_init_fn=None,
        compile=None,
        lockstep_check: bool = True,
        leaf_modules=None,
    ):
        super().__init__()
        check_wrappable(module)
        options = RuntimeOptions.from_args(
            device=device, mixed_precision=mixed_precision, coalesce_bytes=coalesce_bytes, timeout_s=timeout_s,
            sync_module_states=sync_module_states, memory_limit=memory_limit, memory_check=memory_check,
            compile=compile, lockstep_check=lockstep_check)
        self.options = options
        self.layout = ShardLayout.from_arg(process_group, mesh, node_size)
        group = self.layout.world.group
        self._init_plan(module, plan, options.mixed_precision)
        config = resolve_config(
            module,
            plan=self._run,
            default_mode=default_mode,
            modes=modes,
            splits=splits,
            split_ops=split_ops,
            prefetch_bytes=prefetch_bytes,
            checkpoint_blocks=checkpoint_blocks,
            world_size=self.layout.world.size,
            leaf_modules=leaf_modules,
        )
        self._init_comm(module, group, config, options)
        if not options.sync_module_states and not has_meta(module):  # [Note: the same values on every rank]
            check_same_values(self._comm, [(name, value_hash(p)) for name, p in module.named_parameters()])
        self._init_units(module, config, options.mixed_precision, param_init_fn)
        self._init_scheduler(config, options)
        if self.compile_config is None:
            self._init_hooks(config)
        else:
            self._init_compiled(config, options.timeout_s)
        self._init_memory_check(options)
        self.compiled_regions = (compile_regions(self.module, self.compile_config, self._built, self.prefetch_bytes,
                                                 self._region_classes, self.coalesce_bytes)
                                 if self.compile_config is not None else [])
        mark_lockstep(self.module, self.compiled_regions)  # [Note: ranks in lockstep]
        _show_forward_signature(self, self._forward_signature)

    # the runtime options it was built with (self.options), by their keyword names
    @property
    def device(self) -> torch.device:
        return self.options.device

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        return self.options.mixed_precision

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    @property
    def compile_config(self) -> CompileConfig | None:
        return self.options.compile

    # ---- construction, in order ----------------------------------------------------------
    def _init_plan(self, module, plan, mixed_precision) -> None:
        """``self.plan`` (given, or loaded from a path) and the typed ``self._run`` the
        runtime executes, checked against the model and dtypes."""
        plan = plan_from_arg(plan)  # a Plan, or the path of a plan file (loaded), or a dict
        run = _runtime_config(plan)
        if run is not None:
            check_plan_matches_model(module, run)
            param_bytes = next((p.element_size() for p in module.parameters() if p.is_floating_point()), 4)
            check_plan_dtypes(run, mixed_precision, param_bytes)
            check_plan_layout(run, self.layout)  # [Note: plan and layout] in contract.py
        self.plan = plan  # what the user gave (or auto mode made); the runtime reads self._run
        self._run = run
        # auto mode's example inputs, per argument the shape of one sample (_check_batch)
        self.planned_sample_shapes: dict[str, tuple[int, ...]] | None = None
        self._forward_signature = forward_signature(module)  # the model's own, before any swap

    def _init_comm(self, module, group, config, options: RuntimeOptions):
        """The comm context; every rank must have resolved the same configuration."""
        self.plan_fingerprint = config.fingerprint
        self._state_keys = list(module.state_dict().keys())
        self._view: ShardedView | None = None  # built on first use, see _sharded_view
        self._comm = CommContext(self.layout.shard.group, self.device, options.timeout_s, layout=self.layout)
        self._check_same_config(config, own_param_counts(module, config.leaves), options.mixed_precision,
                                options.coalesce_bytes)
        if options.sync_module_states:
            if has_meta(module):
                raise ConfigError("sync_module_states=True broadcasts rank 0's weights, and this model is on the "
                                  "meta device (no weights yet): seed every rank alike (torch.manual_seed) before "
                                  "wrapping, so that every rank initializes the same values")
            with torch.no_grad():
                for tensor in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)

    def _init_units(self, module, config, mixed_precision, param_init_fn) -> None:
        """Split ops swapped in, parameters flattened into sharded units (a model built on
        the meta device made real one module at a time: [Note: meta initialization] in
        osdp/runtime/materialize.py), buffers moved."""
        meta_init = MetaInit(self.device, param_init_fn) if has_meta(module) else None
        if param_init_fn is not None and meta_init is None:
            raise ConfigError("param_init_fn= initializes a model built on the meta device; this one has no "
                              "meta parameters or buffers (it is initialized already): drop param_init_fn")
        self._built = build_units(module, config.unit_modes, self._comm.rank, self._comm.world_size, self.device,
                                  mixed_precision, config.split_ops, meta_init, config.leaves)
        if meta_init is not None:  # [Note: the same values on every rank]
            check_same_values(self._comm, meta_init.value_hashes)
        for unit in self._built.units:
            unit.norm_group = self._comm.group  # [Note: global gradient norm] in grad_norm.py
        run = self._run
        self._planned_frozen = PlannedFrozenCheck(self._built.units, run.frozen_units if run is not None else (),
                                                  run.model_name if run is not None else "")
        for mod in module.modules():
            mod._osdp_wrapped = True  # see _refuse_wrapped
        install_torch_clip_guard()  # see [Note: global gradient norm]
        module.to(self.device)  # buffers; the shards already live there
        register_params(self._built)
        self._adopt_tree(module)

    def _adopt_tree(self, module: nn.Module) -> None:
        """[Note: one module tree] The wrapper's children, parameters and buffers ARE
        the wrapped model's (the same dicts), so walks over the tree name what
        ``named_parameters()`` names, without a ``module.`` prefix: Hugging Face's
        ``get_parameter_names(model, ALL_LAYERNORM_LAYERS)``, ``named_modules()`` +
        ``isinstance`` rules, ``model.get_submodule("blocks.0")``. The wrapped model is
        ``self.module``, an attribute outside the tree (registering it would prefix every
        name); ``train``/``eval`` reach it through :meth:`train`."""
        self.__dict__["module"] = module
        self._modules = module._modules
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set

    def __deepcopy__(self, memo):
        raise OSDPError(
            "a wrapped model cannot be copied (copy.deepcopy, torch.optim.swa_utils.AveragedModel): each rank holds "
            "pieces of its units, tied to its process group. For an average of the weights (EMA, SWA) keep one of "
            "this rank's pieces: ema = [p.detach().clone() for p in model.parameters()], updated by "
            "e.lerp_(p.detach(), 1 - decay) for each pair, copied into the parameters under torch.no_grad() to "
            "evaluate; model.full_state_dict() gives the whole weights")

    def __reduce_ex__(self, protocol):
        raise OSDPError("a wrapped model cannot be pickled (torch.save(model)): save its weights with "
                        "osdp.checkpoint (save, or save_full for one file of the whole model)")

    def train(self, mode: bool = True):
        super().train(mode)
        self.module.training = mode  # outside the tree: see [Note: one module tree]
        return self

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.cuda()``, ``.half()`` and the like: the buffers only; a change to
        the parameters is refused (they are views of the sharded flat buffers: moved or
        cast, they would no longer be what the runtime gathers and the optimizer steps)."""
        for name, param in self.named_parameters():
            moved = fn(param)
            if moved is not param and (moved.device != param.device or moved.dtype != param.dtype
                                       or moved.data_ptr() != param.data_ptr()):
                raise OSDPError(
                    f"cannot move or cast the parameters of an OSDP model ({name!r}: {param.dtype} on "
                    f"{param.device} -> {moved.dtype} on {moved.device}): they are views of the sharded flat "
                    "buffers; wrap with device= (and mixed_precision= for a compute dtype) instead"
                )
        for module in self.module.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = fn(buf)
        return self

    def _init_scheduler(self, config, options: RuntimeOptions) -> None:
        window = config.prefetch_bytes
        if window is None:
            window = default_prefetch_bytes(max(u.gathered_bytes for u in self._built.units))
        self._ledger = MemoryLedger(self.device)
        lockstep = None
        if (options.lockstep_check_on and self.layout.world.size > 1
                and LockstepCheck.applies_to(self.layout.world.group)):
            steps = OptimizerSteps(p for _, p in _unique_params(self._built.units))
            lockstep = LockstepCheck(self.layout.world.group, options.timeout_s, steps)
            self._comm.issued = lockstep.log  # [Note: lockstep check]
        self._scheduler = Scheduler(self._built.units, self._comm, self._ledger, window, options.coalesce_bytes,
                                    lockstep=lockstep)
        params = _unique_params(self._built.units)
        self._step_checks = (HeldGradientsCheck((p for _, p in params), self._scheduler.held_gradients),
                             PieceShapeCheck(params))
        split_units = {id(u) for _, units in self._built.splits.values() for u in units}
        self._scheduler.mark_coalescible([u for u in self._built.units if id(u) not in split_units])
        self.coalesce_bytes = self._scheduler.coalesce_bytes

    def _init_hooks(self, config) -> None:
        """Modules compute with views of the gathered buffers, or with the parameters
        of direct rep units ([Note: direct replicated units]); split ops drive the
        scheduler themselves; checkpointed blocks recompute."""
        # a leaf's rep unit stays hooked: an expert its tokens skipped gets no gradient,
        # so the per-parameter hooks of a direct unit would never all fire
        direct = direct_units([b for b in self._built.bindings if b[1] not in self._built.leaves])
        self._bindings = []
        for mod, path, entries in self._built.bindings:
            if all(unit in direct for unit, _ in entries):
                binding = DirectBinding(mod, path, entries, self._ledger)
            else:
                binding = ModuleBinding(mod, path, entries, self._scheduler)
            binding.set_views()
            self._bindings.append(binding)
        self._direct_grad_hooks = DirectGradHooks(direct, self._scheduler)
        for split_module, units in self._built.splits.values():
            split_module.bind(self._scheduler, units)
        hooked = {b.path: b for b in self._bindings if isinstance(b, ModuleBinding)}
        apply_checkpointing(self.module, config.checkpoint_blocks, self._scheduler.end_recompute,
                            lambda path: hooked[path].recomputing() if path in hooked else contextlib.nullcontext())
        self.checkpoint_blocks = config.checkpoint_blocks
        runners: dict = {}  # unit -> the modules that gather it ([Note: weights read outside their unit])
        for binding in self._bindings:
            for unit, _ in binding.entries:
                runners.setdefault(unit, set()).add(id(binding.module))
        for split_module, units in self._built.splits.values():
            for unit in units:
                runners.setdefault(unit, set()).add(id(split_module))
        self._foreign_reads = ForeignReadCheck(self.module, runners)  # the first forward's

    def _init_compiled(self, config, timeout_s: float) -> None:
        """The compiled path: modules gather through collectives the compiler sees, no
        hooks, no scheduler at run time; see [Note: compiled units] in
        osdp/runtime/compiled.py."""
        self._region_classes = install_compiled(self.module, self._built, self.layout, config.checkpoint_blocks,
                                                   timeout_s)
        self.checkpoint_blocks = config.checkpoint_blocks
        self._bindings = []
        self._foreign_reads = None
        mark_sharded_grads(self._built.units)

    def _init_memory_check(self, options: RuntimeOptions) -> None:
        """The per-step peak check (osdp/runtime/peak.py): against ``memory_limit``, else
        the plan's; nothing is measured without a limit or with ``memory_check=False``
        (or ``OSDP_MEMORY_CHECK=0``)."""
        limit, predicted = self._limit_and_prediction()
        self._memory_check = None
        if limit is None or not options.memory_check_on:
            return
        if not step_peak_readable(self.device, self.compile_config is not None):
            log.info("compile=: the per-step memory check needs the CUDA allocator's statistics; not measured on %s",
                     self.device)
            return
        self._memory_check = self._step_memory_check(limit, predicted)

    def _limit_and_prediction(self) -> tuple:
        """(the limit a step is checked against: ``memory_limit``, else the plan's; the
        plan's predicted peak), each None where there is none."""
        limit = getattr(self.plan, "memory_limit_bytes", None)
        if self.options.memory_limit_bytes is not None:
            limit = self.options.memory_limit_bytes
        return limit, getattr(getattr(self.plan, "predicted", None), "peak_bytes", None)

    def _step_memory_check(self, limit, predicted) -> StepMemoryCheck:
        units = self._built.units
        # gathered buffers are resized outside the dispatcher and counted from the ledger;
        # a rep unit's compute buffer is the shard itself or a static cast copy: followed
        monitor = make_monitor(self._ledger, self.device, limit, predicted,
                               tensors=[u.shard for u in units] + [u.gathered for u in units if u.casts]
                               + list(self.module.buffers()),
                               ignored_storages=[u.gathered.untyped_storage() for u in units if not u.replicated],
                               assumed_loss=getattr(self.plan, "assumed_loss", ""))
        return StepMemoryCheck(monitor, [p for u in units for p in u.params] + [u.shard for u in units])

    def _check_same_config(self, config, param_counts, mixed_precision, coalesce_bytes) -> None:
        """All ranks must run the same plan on the same model: compare a hash of what each
        resolved (per-unit modes and parameter counts, window, blocks, dtypes)."""
        core = {
            "units": {k: [m.value for m in v] for k, v in config.unit_modes.items()},
            "split_ops": dict(sorted(config.split_ops.items())),
            "prefetch_bytes": config.prefetch_bytes,
            "checkpoint_blocks": list(config.checkpoint_blocks),
            "coalesce_bytes": coalesce_bytes,
            "mixed_precision": repr(mixed_precision),
        }
        digest = int(hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:15], 16)
        params = int(hashlib.sha256(json.dumps(param_counts, sort_keys=True).encode()).hexdigest()[:15], 16)
        if self._comm.world_size == 1:
            return
        every = self._comm.all_gather_object_hash(digest, "all-gather of the configuration hash")
        every_params = self._comm.all_gather_object_hash(params, "all-gather of the parameter-count hash")
        if len(set(every_params)) != 1:
            raise PlanMismatchError(
                "ranks wrap different models: the parameter counts of their modules differ between "
                "ranks (every rank must build the same model before wrapping it)"
            )
        if len(set(every)) != 1:
            raise PlanMismatchError(
                "ranks resolved different OSDP configurations (plan, modes, splits, prefetch, "
                "checkpoint blocks, mixed precision or coalescing differ between ranks): compute the "
                "plan once and broadcast it"
            )

    # ---- running ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            self._check_params_in_place()
        if self.plan is not None:
            self._check_batch(args, kwargs)
        policy = self.mixed_precision
        if policy is not None:
            args, kwargs = policy.cast_inputs(args, kwargs)
        if self._memory_check is not None:
            self._memory_check.begin_forward()  # checks the step before; see [Note: measured peak]
        if not torch.compiler.is_compiling():
            self._planned_frozen.check()  # [Note: units planned frozen]
        if self.compile_config is not None:  # nothing to schedule: see [Note: compiled units]
            try:
                with fused_layer_fast_path_off():  # [Note: fused layer fast path]
                    output = self.module(*args, **kwargs)
            except RuntimeError as exc:  # [Note: compiled collective timeouts]
                if not is_collective_failure(exc):
                    raise
                raise self._comm.failure("a collective of the compiled forward", exc) from exc
        else:
            for unit in follow_requires_grad(self._built.units):  # [Note: trainability follows the parameters]
                self._direct_grad_hooks.hook(unit)
            check = self._foreign_reads
            if check is not None and not torch.compiler.is_compiling():  # not under an outer torch.compile
                output = self._checked_forward(check, args, kwargs)
            else:
                output = self._scheduled_forward(args, kwargs)
        return output if policy is None else policy.cast_output(output)

    def _check_params_in_place(self) -> None:
        """The wrapper refuses ``.to()`` and casts (``_apply``); a module inside it cast
        or moved swaps its parameters' data, which the runtime then neither gathers nor
        hands gradients to: refused here, before a forward computes with the shards as if
        nothing happened (found by a helper: silent under no_grad, torch's "assign a
        gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'" in backward)."""
        for unit in self._built.units:
            param = unit.replaced_param()
            if param is None:
                continue
            where = f"parameter {param._osdp_name!r} (unit {unit.name!r}) is no longer this rank's piece of its unit"
            if param.dtype == unit.shard.dtype and param.device == unit.shard.device:
                raise OSDPError(
                    f"{where}: its data was replaced (p.data = ..., or a new tensor assigned), which OSDP cannot "
                    "follow. Update parameters in place, as optimizers do: p.data.add_(...), or "
                    "`with torch.no_grad(): p -= lr * p.grad`")
            raise OSDPError(
                f"{where}: a module of the wrapped model was cast or moved after wrapping (now {param.dtype} on "
                f"{param.device}; model.unwrapped.to(...), submodule.half()), which OSDP cannot follow. Cast "
                "or move the model before wrapping (device= on OSDP), or compute in another dtype with "
                "mixed_precision=osdp.MixedPrecision(param_dtype=...)")

    def _checked_forward(self, check: ForeignReadCheck, args, kwargs):
        """The first forward that completes runs under ``check`` ([Note: weights read
        outside their unit] in osdp/runtime/foreign_reads.py)."""
        marking = [b for b in self._bindings if isinstance(b, ModuleBinding)]
        check.bound = {id(b.module) for b in marking}
        for binding in marking:
            binding.read_check = check
        try:
            with check:
                output = self._scheduled_forward(args, kwargs)
        finally:
            for binding in marking:
                binding.read_check = None
        self._foreign_reads = None
        return output

    def _scheduled_forward(self, args, kwargs):
        self._scheduler.begin_forward()
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            self._scheduler.recover()  # see [Note: recovery after an exception]
            if self._memory_check is not None:
                self._memory_check.abort()
            raise
        self._scheduler.end_forward()
        return output

    def _check_batch(self, args, kwargs) -> None:
        limit = self.batch_size
        if not limit:
            return
        first = next(iter(argument_tensors(args, kwargs)), None)
        if first is None or first.dim() == 0:
            return
        if first.shape[0] > limit:
            raise OSDPError(
                f"batch of {first.shape[0]} samples per device exceeds the plan's batch_size={limit}: "
                "the plan's memory prediction holds only up to that batch (use model.batch_size "
                "samples per device, or plan again for a bigger batch)"
            )
        planned = self.planned_sample_shapes
        if planned:  # auto mode: planned for samples of the example's size
            for name, shape in sample_shapes(self._forward_signature, args, kwargs).items():
                example = planned.get(name)
                if example is not None and len(example) == len(shape) and any(
                        s > e for s, e in zip(shape, example)):
                    where = f"argument {name}" if name.isdigit() else repr(name)
                    raise OSDPError(
                        f"{where}: samples of shape {shape} are larger than the example's {example}, which auto "
                        "mode planned memory for (a longer sequence holds more activations: the plan's memory "
                        "prediction does not hold). Give example_inputs of the largest samples you train with "
                        "(the longest sequence), or pad and cut to the example's size")

    # ---- gradient accumulation -------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Off: backward keeps (and adds to) unsharded fp32 gradients instead of
        reduce-scattering them; on (default): the next backward reduce-scatters. See
        [Note: gradient accumulation]."""
        self._check_sync_off(not requires_gradient_sync)
        self._scheduler.sync_gradients = bool(requires_gradient_sync)

    def _check_sync_off(self, off: bool) -> None:
        if off and self.compile_config is not None:
            raise ConfigError("gradient sync off (no_sync / set_requires_gradient_sync(False)) is not available "
                              "with compile=: every compiled backward reduces its gradients. "
                              "Accumulate with sync on (the same gradients, more communication) or run eager")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and the gradients that backward passes with sync off
        accumulated and none has reduced yet are dropped too (they are not in ``.grad``:
        ``optimizer.zero_grad()`` cannot see them). See [Note: held gradients at a step]
        in osdp/runtime/optimizer_steps.py."""
        super().zero_grad(set_to_none)
        self._scheduler.drop_held_gradients()

    @property
    def requires_gradient_sync(self) -> bool:
        return self._scheduler.sync_gradients

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches whose backward runs inside accumulate without communication."""
        self._check_sync_off(True)
        previous = self._scheduler.sync_gradients
        self._scheduler.sync_gradients = False
        try:
            yield
        finally:
            self._scheduler.sync_gradients = previous

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the plan's; 1 without a plan)."""
        return 1 if self._run is None else int(self._run.accumulation_steps)

    @property
    def gradient_sync(self) -> str:
        """``"last"``: reduce-scatter only in the last micro-batch; ``"every"``: each."""
        return "last" if self._run is None else self._run.gradient_sync

    @contextlib.contextmanager
    def micro_batch(self, index: int):
        """Run micro-batch ``index`` (0-based, of ``accumulation_steps``) with the plan's
        gradient sync policy: ``with model.micro_batch(i): model(x).backward()``."""
        if not 0 <= index < self.accumulation_steps:
            why = ("" if self._run is not None and self._run.accumulation_steps > 1 else
                   f": model.accumulation_steps is {self.accumulation_steps} "
                   + ("without a plan" if self._run is None else "in this plan")
                   + " (a plan made with accumulation sets it); to accumulate by hand, run the micro-batches' "
                   "backward under `with model.no_sync():` and the last one outside it, or call backward on each")
            raise OSDPError(f"micro-batch index {index} out of range 0..{self.accumulation_steps - 1}{why}")
        sync = self.gradient_sync == "every" or index == self.accumulation_steps - 1
        sync = sync or self.compile_config is not None  # compiled: every backward reduces (same gradients)
        previous = self._scheduler.sync_gradients
        self._scheduler.sync_gradients = sync
        try:
            yield
        finally:
            self._scheduler.sync_gradients = previous

    @property
    def batch_size(self) -> int | None:
        """The per-device (micro-)batch the plan was made for (None without a plan)."""
        return None if self._run is None else self._run.batch_size

    # ---- original parameters --------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The original parameters by their original names (no ``module.`` prefix):
        this rank's piece of each; see [Note: original parameters]."""
        for name, param in _unique_params(self._built.units):
            yield (f"{prefix}.{name}" if prefix else name), param

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """This rank's sharded state: ``{original name: local piece}`` for parameters
        (tied names share one piece) and the full persistent buffers, under the original
        model's keys. For a full (gathered) state dict use ``osdp.checkpoint``. Not for
        ``torch.distributed.checkpoint``: the pieces are plain tensors under the same keys
        on every rank, which it would save once as if replicated ([Note: no torch DCP of
        the local state])."""
        if args:
            raise OSDPError("state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        _refuse_torch_dcp("state_dict")
        out = destination if destination is not None else {}
        for key, tensor in self._local_state().items():
            out[prefix + key] = tensor if keep_vars else tensor.detach()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load what :meth:`state_dict` returned on this rank (same plan and world size);
        a full state dict goes through ``osdp.checkpoint.load_full_state_dict``."""
        if assign:
            raise OSDPError("assign=True is not supported: the parameters are views of the flat shards")
        _refuse_torch_dcp("load_state_dict")
        mine = self._local_state()
        missing = [k for k in mine if k not in state_dict]
        unexpected = [k for k in state_dict if k not in mine]
        if strict and (missing or unexpected):
            raise OSDPError(
                f"state dict keys do not match this OSDP model: missing {missing[:6]}, unexpected {unexpected[:6]}"
            )
        for key, tensor in mine.items():
            if key in state_dict and tuple(state_dict[key].shape) != tuple(tensor.shape):
                full = getattr(tensor, "_osdp_full_shape", None)
                hint = (
                    " (that is the full parameter: load full state dicts with osdp.checkpoint.load_full_state_dict)"
                    if full is not None and tuple(state_dict[key].shape) == tuple(full) else ""
                )
                raise OSDPError(
                    f"state dict entry {key!r} has shape {tuple(state_dict[key].shape)}, this rank's piece has "
                    f"{tuple(tensor.shape)}{hint}"
                )
        with torch.no_grad():
            for key, tensor in mine.items():
                if key in state_dict:
                    tensor.copy_(state_dict[key])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _local_state(self) -> dict[str, torch.Tensor]:
        """Original state-dict order: each parameter's local piece under each of its
        names (tied names share it), the buffers whole."""
        pieces = {key: param for unit in self._built.units
                  for slot, param in zip(unit.slots, unit.params) for key in slot.fqns}
        return {key: pieces[key] if key in pieces else self.module.get_buffer(key) for key in self._state_keys}

    # ---- gradient clipping -----------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the gradients of all ranks by their global ``norm_type``-norm (a
        collective: call on every rank) and return that norm, the same on every rank.
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see only this
        rank's shards and is refused; see [Note: global gradient norm]."""
        norm_type = check_norm_args(max_norm, norm_type)
        self._scheduler.wait_reduce_scatters()
        params = list(self.parameters())
        replicated = [p for u in self._built.units if u.replicated for p in u.params]
        total = global_grad_norm(params, norm_type, self._comm.group, self.device, foreach, replicated)
        if error_if_nonfinite and not torch.isfinite(total):
            raise OSDPError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it "
                "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    # ---- inspection ---------------------------------------------------------------
    @property
    def unwrapped(self) -> nn.Module:
        """The wrapped module (with split ops swapped in and parameters sharded)."""
        return self.module

    def __getattr__(self, name: str):
        """Only a missing attribute comes here (nn.Module's lookup of parameters, buffers
        and submodules first): one the wrapped model has is named with where it is, so
        that ``model.generate(...)`` says ``model.unwrapped.generate(...)``. Not passed
        through silently: a wrapped model's own methods see this rank's pieces of the
        parameters, which is right for a forward (generate) and wrong for one that saves
        or counts them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("module")  # outside the tree: [Note: one module tree]
            if wrapped is None or name.startswith("__") or not hasattr(wrapped, name):
                raise
        kind = type(wrapped).__name__
        if name in _SAVING_METHODS:
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}: the wrapped {kind}'s {name} would write this "
                "rank's pieces of the parameters; save with osdp.checkpoint.save_hf(model, directory) (every "
                "rank calls it; from_pretrained loads the directory), or a peft model's adapters from the "
                "gathered state dict: peft.get_peft_model_state_dict(model.unwrapped, "
                "state_dict=osdp.checkpoint.full_state_dict(model)) on rank 0") from None
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r}; the wrapped {kind} has: use "
            f"model.unwrapped.{name} (its forwards run on the shards, as model(...) does; its parameters are "
            "this rank's pieces)") from None

    def unit_names(self) -> list[str]:
        """Shard units in module order; a split unit ``name`` appears as ``name[i]``."""
        return [u.name for u in self._built.units]

    def unit_modes(self) -> dict[str, str]:
        return {u.name: u.mode.value for u in self._built.units}

    def tied_modules(self) -> dict[str, str]:
        """Module path -> the unit whose (tied) parameters it computes with."""
        return dict(self._built.tied)

    def forward_order(self) -> list[str] | None:
        """Unit uses in the order recorded in the first forward (None before it)."""
        return self._scheduler.forward_order

    @property
    def prefetch_bytes(self) -> int:
        return self._scheduler.prefetch_bytes

    def gathered_units(self) -> list[str]:
        """Units whose gathered weights are allocated now."""
        return self._scheduler.gathered_units()

    def report(self, file=None) -> str:
        """Print (to ``file``, default stdout) and return the plan's predictions beside
        what was measured on the runtime: per phase (forward, backward, optimizer), the
        step, peak memory and per unit group, with the calibration's decision and
        fitted factors (auto mode; see [Note: calibrate and re-plan] in osdp/auto.py)."""
        text = format_report(self.plan if hasattr(self.plan, "units") else None)
        print(text, file=file or sys.stdout, flush=True)
        return text

    def memory_stats(self) -> dict:
        """Ledger of OSDP's transient buffers since the last reset: ``peak_gathered_bytes``,
        ``peak_grad_bytes`` (unsharded gradients), ``peak_total_bytes``, ``current_*``,
        ``unit_peak_gathered_bytes`` / ``unit_peak_grad_bytes`` (per unit),
        ``all_gathers`` / ``reduce_scatters`` (counts per unit), ``all_reduces`` (per rep
        unit: the bucket all-reduces it rode in), ``gathered_units``,
        ``replica_copy_bytes`` (rep units' static compute copies under mixed precision,
        not transient: not in the totals); on CUDA also ``cuda_max_memory_allocated``."""
        stats = self._ledger.stats()
        stats["replica_copy_bytes"] = sum(u.replica_copy_bytes for u in self._built.units)
        return stats

    def reset_memory_stats(self) -> None:
        self._ledger.reset()

    def step_memory(self) -> StepMemory | None:
        """The measured memory of the last finished step: ``peak_bytes``, ``unit_at_peak``
        / ``phase_at_peak``, ``limit_bytes``, ``predicted_peak_bytes``, ``source``
        (None before the first step ends, or without a memory limit). A step ends at the
        optimizer step over this model's parameters, the next forward, or
        :meth:`end_step`; see [Note: measured peak] in ``osdp/runtime/peak.py``."""
        return None if self._memory_check is None else self._memory_check.monitor.last

    @contextlib.contextmanager
    def measuring_memory(self, optimizer=None):
        """Measure the peak memory of the one step run inside (forward, backward and the
        optimizer step), with the runtime's own tracker ([Note: measured peak]), whether
        or not the per-step check is on; nothing is checked against a limit::

            with model.measuring_memory(optim) as measured:
                model(x).sum().backward(); optim.step()
            measured[0].peak_bytes

        Yields a list that holds the step's :class:`StepMemory` once the block exits.
        ``optimizer``: its state made before the block (an earlier step) is counted.
        For tools that measure a plan's memory without paying the check's cost on every
        step (bench/regret.py); where the check is on, its own measurement is returned (and
        checked against the limit). A model compiled on CPU is measured by the allocator
        (the runtime's tracker cannot see inside compiled code; [Note: CPU allocator
        peak] in osdp/memtrack.py): no unit at the peak, and nothing while another
        profiler records (the list stays empty)."""
        measured: list[StepMemory] = []
        if self.compile_config is not None and not step_peak_readable(self.device, compiled=True):
            with cpu_allocator_window(resident_tensors(self.module, optimizer, grads=True)) as peak:
                yield measured
            if peak[0] is not None:
                limit, predicted = self._limit_and_prediction()
                measured.append(StepMemory(step=0, peak_bytes=int(peak[0]), unit_at_peak="", phase_at_peak="",
                                           limit_bytes=limit, predicted_peak_bytes=predicted,
                                           source="cpu allocator (profiler memory reports; compiled)"))
            return
        own = self._memory_check is None
        check = self._step_memory_check(None, None) if own else self._memory_check
        if own and optimizer is not None:
            check.monitor.track(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))
        self._memory_check, steps_before = check, check.monitor.steps
        try:
            yield measured
            check.end_step()  # the window closes here unless an optimizer step closed it
        finally:
            if own:
                check.abort()
                check.close()
                self._memory_check = None
        if check.monitor.steps > steps_before:
            measured.append(check.monitor.last)

    def end_step(self) -> StepMemory | None:
        """End the step's memory measurement now and check it against the memory limit
        (``MemoryLimitExceeded`` when over): for loops without a ``torch.optim``
        optimizer, or after the last step."""
        return None if self._memory_check is None else self._memory_check.end_step()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The original model's state dict, gathered (a collective: call on every rank);
        the same as ``osdp.checkpoint.full_state_dict(model)``."""
        return gathered_state_dict(self, rank0_only)

    def _sharded_view(self) -> ShardedView:
        """The model as ``osdp.checkpoint`` reads it, pending gradient reductions finished
        (their results are part of the state)."""
        self._scheduler.wait_reduce_scatters()
        if self._view is None:
            layout = build_layout(self.module, self._built, list(self._state_keys))
            self._view = ShardedView(self.module, self._built, self._comm, tuple(self._state_keys), layout)
        return self._view


def _refuse_torch_dcp(method: str) -> None:
    """[Note: no torch DCP of the local state]
    ``torch.distributed.checkpoint`` saves a plain tensor found under the same key on
    every rank once, as replicated, and loads that one copy into every rank: OSDP's local
    pieces (flat ranges of the parameters, not DTensors) would come back as rank 0's on
    every rank, silently. Its ``get_state_dict`` / ``set_state_dict`` and a model passed
    to ``dcp.save`` as a Stateful call :meth:`OSDP.state_dict` from inside the package, so
    those calls are refused here; ``dcp.save(model.state_dict())`` cannot be seen and is
    not refused. ``osdp.checkpoint.save`` / ``load`` write through DCP the pieces' boxes
    of the original tensors (any world size or plan on load)."""
    frame = sys._getframe(2)
    for _ in range(40):  # DCP's own frames lie a few calls up
        if frame is None:
            return
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            raise OSDPError(
                f"torch.distributed.checkpoint called model.{method}(): OSDP's state_dict is this rank's pieces as "
                "plain tensors under the same keys on every rank, which torch's DCP saves once as if replicated "
                "(every rank would load rank 0's pieces). Save and load with osdp.checkpoint.save(model, optimizer, "
                "path) / osdp.checkpoint.load(...), which write DCP checkpoints of the original tensors")
        frame = frame.f_back


def _show_forward_signature(wrapper: ShardedModel, signature: inspect.Signature | None) -> None:
    """Make ``inspect.signature(wrapper.forward)`` the wrapped model's: libraries read
    it to choose what to pass (Hugging Face's Trainer keeps only the dataset columns the
    forward names; with ``*args, **kwargs`` it drops them all). ``inspect`` reads a
    method's signature from its class's function, so the wrapper gets a subclass of its
    own whose forward declares it (as FSDP2's ``fully_shard`` gives each module a class)."""
    if signature is None:
        return
    base = type(wrapper)

    def forward(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    forward.__signature__ = with_self(signature)
    forward.__doc__ = base.forward.__doc__
    wrapper.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                      "__qualname__": base.__qualname__})


def _unique_params(units) -> list[tuple[str, nn.Parameter]]:
    """(original name, local piece) of every parameter once: a split op's cut parameter
    spans its slice units ([Note: split parameters] in osdp/runtime/split_params.py)."""
    seen: set[int] = set()
    out = []
    for unit in units:
        for name, param in zip(unit.param_names, unit.params):
            if id(param) not in seen:
                seen.add(id(param))
                out.append((name, param))
    return out


def _runtime_config(plan) -> RuntimeConfig | None:
    """The typed config the runtime executes: an ``osdp.contract.RuntimeConfig`` as it
    is, or a plan's ``runtime_config()``."""
    if plan is None or isinstance(plan, RuntimeConfig):
        return plan
    to_config = getattr(plan, "runtime_config", None)
    if not callable(to_config):
        raise OSDPError(
            f"plan must be an osdp Plan, an osdp.contract.RuntimeConfig, the path of a plan JSON file or None; "
            f"got a {type(plan).__name__}"
        )
    return to_config()


def check_wrappable(module: nn.Module) -> None:
    """Refuse a module that cannot be wrapped, before anything changes (the options are
    checked by ``RuntimeOptions.from_args``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise OSDPError("OSDP needs torch.distributed initialized (dist.init_process_group) before wrapping")
    _refuse_wrapped(module)
    _refuse_parameter_adapters(module)
    if not any(True for _ in module.parameters()):
        raise OSDPError(
            f"{type(module).__name__} has no parameters: there is nothing to shard (OSDP wraps "
            "models with parameters; run a parameter-free module as it is)"
        )


def _refuse_parameter_adapters(module: nn.Module) -> None:
    """peft's LoRA on a parameter (``LoraConfig(target_parameters=...)``, a MoE's 3-D
    expert weights) registers a parametrization on the base module at every forward and
    reads its adapters' weights without calling their modules: OSDP gathers a unit when
    its module is called and keeps the gathered weights beside the shards, so the
    adapters read freed buffers and the parametrization would take the shard for the
    weight (it raised 'setStorage ... out of bounds for storage of size 0')."""
    for path, sub in module.named_modules():
        if type(sub).__name__ == "ParamWrapper" and type(sub).__module__.startswith("peft."):
            raise OSDPError(
                f"cannot wrap this {type(module).__name__}: {path!r} is peft's LoRA on the parameter "
                f"{getattr(sub, 'parameter_name', '?')!r} (LoraConfig(target_parameters=...)), which swaps a "
                "parametrization in at every forward and reads its adapters' weights without calling their "
                "modules; OSDP shards a unit as its module is called. Put the adapters on modules instead "
                "(LoraConfig(target_modules=[...]): nn.Linear layers, trained exactly under OSDP)"
            )


def _refuse_wrapped(module: nn.Module) -> None:
    """Refuse a module that an OSDP wrapper already owns (itself, a part of it, or a
    model containing one): wrapping again would rebuild its units under the first
    wrapper and break it. Checked before anything is changed."""
    for path, sub in module.named_modules():
        if isinstance(sub, ShardedModel) or getattr(sub, "_osdp_wrapped", False):
            where = f"its submodule {path!r}" if path else "it"
            raise OSDPError(
                f"cannot wrap this {type(module).__name__}: {where} is already wrapped by osdp.OSDP (each "
                "module can belong to one OSDP model; wrap the unwrapped model once, or train the existing wrapper)"
            )
