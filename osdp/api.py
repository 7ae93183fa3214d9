"""``osdp.OSDP``: wrap a model so that it trains with a per-unit OSDP plan."""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import OSDPError, PlanMismatchError
from .runtime.build import build_units
from .runtime.checkpoint import apply_checkpointing
from .runtime.collectives import CommContext
from .runtime.config import resolve_config
from .runtime.hooks import ModuleBinding
from .runtime.ledger import MemoryLedger
from .runtime.modes import Mode
from .runtime.scheduler import Scheduler
from .runtime.state_dict import full_state_dict


def auto_plan(*args, **kwargs):
    raise NotImplementedError("planner integration pending")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class OSDP(nn.Module):
    """Optimal Sharded Data Parallel.

    ``OSDP(module, plan)`` or ``OSDP(module, default_mode="zdp", modes={...}, splits={...})``.
    What it applies, in order:

    1. resolves every unit's per-slice modes (``plan.unit_modes()`` or the keyword
       arguments; units not named follow ``default_mode``) and checks the plan's world
       size, then checks that every rank resolved the same configuration;
    2. replaces each split unit by its split op (``osdp.ops``; ``nn.Linear`` is cut along
       ``in_features``, ``nn.Embedding`` by rows), its slices named ``f"{name}[{i}]"``;
    3. flattens each unit's parameters into one buffer sharded evenly across ranks
       (``model.parameters()`` then yields the local shards, one nn.Parameter per unit,
       named ``<module path>.flat_shard`` or ``<path>.flat_shards.<i>`` for slices);
    4. moves the shards and the (replicated) buffers to ``device``;
    5. wraps ``checkpoint_blocks`` in non-reentrant activation checkpointing;
    6. hooks every module into the stream scheduler.

    ``modes``: unit name -> ``"dp"``/``"zdp"`` or one mode per slice (the length is the
    slice count); slice names ``"name[i]"`` may also be keys. ``splits``: unit name ->
    slice count. ``prefetch_bytes``: the prefetch window (default: twice the largest
    unit's gathered bytes).
    """

    def __init__(
        self,
        module: nn.Module,
        plan=None,
        *,
        default_mode: str | Mode = "zdp",
        modes: dict | None = None,
        splits: dict | None = None,
        process_group=None,
        device: torch.device | str | None = None,
        prefetch_bytes: int | None = None,
        checkpoint_blocks: tuple[str, ...] = (),
        sync_module_states: bool = False,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise OSDPError("OSDP needs torch.distributed initialized (dist.init_process_group) before wrapping")
        if isinstance(module, OSDP):
            raise OSDPError("this module is already wrapped in OSDP")
        group = process_group if process_group is not None else dist.group.WORLD
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = torch.device(device) if device is not None else _default_device()
        config = resolve_config(
            module,
            plan=plan,
            default_mode=default_mode,
            modes=modes,
            splits=splits,
            prefetch_bytes=prefetch_bytes,
            checkpoint_blocks=checkpoint_blocks,
            world_size=world_size,
        )
        self.plan_fingerprint = config.fingerprint
        self._state_keys = list(module.state_dict().keys())
        self._comm = CommContext(group, self.device)
        self._check_same_config(config)
        if sync_module_states:
            with torch.no_grad():
                for tensor in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)

        self._built = build_units(module, config.unit_modes, rank, world_size, self.device)
        self.module = module.to(self.device)  # buffers; the shards already live there
        if not self._built.units:
            raise OSDPError(f"{type(module).__name__} has no parameters: there is nothing to shard")
        window = config.prefetch_bytes
        if window is None:
            window = 2 * max(u.gathered_bytes for u in self._built.units)
        self._ledger = MemoryLedger(self.device)
        self._scheduler = Scheduler(self._built.units, self._comm, self._ledger, window)
        self._bindings = []
        for mod, path, entries in self._built.bindings:
            binding = ModuleBinding(mod, path, entries, self._scheduler)
            binding.set_views()
            self._bindings.append(binding)
        for split_module, units in self._built.splits.values():
            split_module.bind(self._scheduler, units)
            if not split_module.needs_weights_in_backward:
                for unit in units:
                    unit.backward_needs_weights = False
        apply_checkpointing(self.module, config.checkpoint_blocks)
        self.checkpoint_blocks = config.checkpoint_blocks

    def _check_same_config(self, config) -> None:
        """All ranks must run the same plan: compare a hash of what each resolved."""
        core = {
            "units": {k: [m.value for m in v] for k, v in config.unit_modes.items()},
            "prefetch_bytes": config.prefetch_bytes,
            "checkpoint_blocks": list(config.checkpoint_blocks),
        }
        digest = int(hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:15], 16)
        if self._comm.world_size == 1:
            return
        mine = torch.tensor([digest], dtype=torch.int64, device=self.device)
        every = torch.empty(self._comm.world_size, dtype=torch.int64, device=self.device)
        self._comm.all_gather(every, mine).wait()
        if len(set(every.tolist())) != 1:
            raise PlanMismatchError(
                "ranks resolved different OSDP configurations (plan, modes, splits, prefetch or "
                "checkpoint blocks differ between ranks): compute the plan once and broadcast it"
            )

    # ---- running ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._scheduler.begin_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            self._scheduler.end_forward()

    # ---- inspection ---------------------------------------------------------------
    @property
    def unwrapped(self) -> nn.Module:
        """The wrapped module (with split ops swapped in and parameters sharded)."""
        return self.module

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

    def memory_stats(self) -> dict:
        """Ledger of OSDP's transient buffers since the last reset: ``peak_gathered_bytes``,
        ``peak_grad_bytes`` (unsharded gradients), ``peak_total_bytes``, ``current_*``,
        ``unit_peak_gathered_bytes`` / ``unit_peak_grad_bytes`` (per unit),
        ``all_gathers`` / ``reduce_scatters`` (counts per unit), ``gathered_units``; on
        CUDA also ``cuda_max_memory_allocated``."""
        return self._ledger.stats()

    def reset_memory_stats(self) -> None:
        self._ledger.reset()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The original model's state dict, gathered (a collective: call on every rank)."""
        self._scheduler.wait_reduce_scatters()
        return full_state_dict(self.module, self._built, self._comm, self._state_keys, rank0_only)
