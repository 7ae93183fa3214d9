"""How a wrapped model runs, apart from its plan (what to shard, and how) and its layout
(which ranks): one typed record, checked once, that the runtime keeps
(``model.options``) and the plan measurer (``osdp/profiler/plans.py``) and auto mode hand
on instead of the same keywords each. ``ShardedModel``/``osdp.OSDP`` keep taking these as
keywords (FSDP2's habit); :meth:`RuntimeOptions.as_kwargs` gives them back."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..contract import DEFAULT_COALESCE_BYTES
from ..errors import OSDPError
from ..sizes import parse_bytes
from .args import device_arg
from .collectives import DEFAULT_TIMEOUT_S
from .compile_config import CompileConfig
from .mixed_precision import MixedPrecision


# ``osdp.OSDP`` keywords that are runtime options (``memory_limit`` is one too, but auto
# mode reads it as the planning budget: the wrapper takes it on its own)
OPTION_KEYWORDS = ("device", "mixed_precision", "coalesce_bytes", "timeout_s", "sync_module_states", "memory_check",
                   "compile", "lockstep_check")


def default_device() -> torch.device:
    """This process's GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class RuntimeOptions:
    """``device``: where shards, gathers and compute live. ``mixed_precision``: gather
    and compute dtypes ([Note: mixed precision]). ``coalesce_bytes``: small units'
    collectives are coalesced up to this size (0: off). ``timeout_s``: bound on every
    wait for a collective. ``sync_module_states``: broadcast rank 0's weights at wrap
    time. ``memory_limit_bytes``/``memory_check``: the per-step peak check (None: the
    plan's limit). ``compile``: the compiled path's settings, None for eager.
    ``lockstep_check``: the ranks compare the collectives they issued at the end of each
    backward ([Note: lockstep check] in lockstep_check.py)."""

    device: torch.device
    mixed_precision: MixedPrecision | None = None
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    sync_module_states: bool = False
    memory_limit_bytes: int | None = None
    memory_check: bool = True
    compile: CompileConfig | None = None
    lockstep_check: bool = True

    @classmethod
    def from_args(cls, *, device=None, mixed_precision=None, coalesce_bytes=None, timeout_s=DEFAULT_TIMEOUT_S,
                  sync_module_states: bool = False, memory_limit=None, memory_check: bool = True,
                  compile=None, lockstep_check: bool = True) -> RuntimeOptions:
        """The keywords of ``osdp.OSDP`` that are runtime options, checked: each bad one
        raises an OSDPError naming it and what would be right."""
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise OSDPError(f"mixed_precision must be an osdp MixedPrecision, got {type(mixed_precision).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise OSDPError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if coalesce_bytes is None:
            coalesce_bytes = DEFAULT_COALESCE_BYTES
        if isinstance(coalesce_bytes, bool) or not isinstance(coalesce_bytes, int) or coalesce_bytes < 0:
            raise OSDPError(f"coalesce_bytes must be an integer >= 0 (bytes), got {coalesce_bytes!r}")
        for name, flag in (("sync_module_states", sync_module_states), ("memory_check", memory_check),
                           ("lockstep_check", lockstep_check)):
            if not isinstance(flag, bool):
                raise OSDPError(f"{name} must be True or False, got {flag!r}")
        return cls(
            device=device_arg(device) if device is not None else default_device(),
            mixed_precision=mixed_precision,
            coalesce_bytes=coalesce_bytes,
            timeout_s=float(timeout_s),
            sync_module_states=sync_module_states,
            memory_limit_bytes=parse_bytes(memory_limit, "memory_limit") if memory_limit is not None else None,
            memory_check=memory_check,
            compile=CompileConfig.from_arg(compile),
            lockstep_check=lockstep_check,
        )

    @property
    def memory_check_on(self) -> bool:
        """The per-step check runs unless turned off here or by ``OSDP_MEMORY_CHECK=0``."""
        return self.memory_check and os.environ.get("OSDP_MEMORY_CHECK", "1") != "0"

    @property
    def lockstep_check_on(self) -> bool:
        """The end-of-backward comparison runs unless turned off here or by
        ``OSDP_LOCKSTEP_CHECK=0``."""
        return self.lockstep_check and os.environ.get("OSDP_LOCKSTEP_CHECK", "1") != "0"

    def replace(self, **changes) -> RuntimeOptions:
        return dataclasses.replace(self, **changes)

    def as_kwargs(self) -> dict:
        """These options as ``ShardedModel``/``osdp.OSDP`` keywords."""
        return dict(device=self.device, mixed_precision=self.mixed_precision, coalesce_bytes=self.coalesce_bytes,
                    timeout_s=self.timeout_s, sync_module_states=self.sync_module_states,
                    memory_limit=self.memory_limit_bytes, memory_check=self.memory_check, compile=self.compile,
                    lockstep_check=self.lockstep_check)
