"""``OSDP(..., compile=...)``'s settings: which regions are compiled, what goes to
``torch.compile``, and which of inductor's passes are refused ([Note: compiled units] in
compiled.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .compiled_coalesce import SmallUnitCoalescing
from .compiled_prefetch import WindowPrefetch

SCOPES = ("blocks", "model")
# inductor settings that choose the comm/compute reordering: given by the user, they win
_OVERLAP_KEYS = ("reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes")
_COALESCE_KEY = "post_grad_custom_post_pass"  # inductor's: given by the user, it wins


@dataclass(frozen=True)
class CompileConfig:
    """How ``OSDP(..., compile=...)`` compiles: see [Note: compiled units].

    ``scope``: ``"model"`` (the default) compiles the wrapped model's forward as one
    region, so that every gather is prefetched and every reduction overlapped across
    blocks; ``"blocks"`` compiles each transformer block (the children of every
    ``nn.ModuleList``) and, on its own, each unit's module outside them (torchtitan's
    habit: shorter compiles, a recompile costs one block, but each graph's first gather
    and last reduction wait are exposed); measured in [Note: compile scope] in
    compiled_regions.py. ``mode``, ``fullgraph``, ``dynamic``,
    ``backend`` and ``options`` (inductor's settings, e.g. its collective bucketing and
    comm/compute reordering passes) go to ``torch.compile`` as given. ``overlap``: with
    the inductor backend, issue each gather while the unit before it computes and run
    each gradient reduction under the backward compute that follows, within the plan's
    prefetch window ([Note: compiled prefetch] in compiled_prefetch.py); left out when
    ``options`` set inductor's ``reorder_for_compute_comm_overlap`` passes themselves.
    ``outside_backend``: the backend of the regions outside the blocks
    (``scope="blocks"``), [Note: units outside the blocks]; None: ``backend``."""

    scope: str = "model"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: object = "inductor"
    options: dict | None = None
    overlap: bool = True
    outside_backend: object = None

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ConfigError(f"CompileConfig(scope={self.scope!r}): use one of {SCOPES}")
        if self.mode is not None and self.options is not None:
            raise ConfigError("CompileConfig: give mode= or options=, not both (torch.compile takes one of them)")

    @classmethod
    def from_arg(cls, value) -> CompileConfig | None:
        """``compile=``: None/False (eager), True (the default scope), a scope name, a
        dict of fields or a CompileConfig."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, str):
            return cls(scope=value)
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, cls):
            return value
        raise ConfigError(f"compile={value!r}: use True, one of {SCOPES}, a dict of CompileConfig fields or an "
                          "osdp.CompileConfig")

    def refuse_unsafe_comm_reordering(self) -> None:
        """[Note: comm reordering across ranks] Inductor's iterative comm/compute
        reordering passes (``sink_waits_iterative``,
        ``reorder_communication_preserving_peak_memory``) may, with
        ``torch._inductor.config_comms``'s defaults, move collectives past one another
        (``*_unsafe_collectives_reorder``, "must be used with runtime estimations aligned
        across ranks"). A unit's graph differs between ranks (a rank's shard may be one
        parameter's view, another's a concatenation of pieces and padding), so the passes
        decide differently per rank and the ranks issue collectives in different orders:
        measured on 2 gloo ranks (W&S 2x768 GPT), gloo aborted with "Received data size
        doesn't match expected size"; NCCL would hang. Refused here, naming the fix."""
        from torch._inductor import config as inductor_config, config_comms

        options = self.options or {}
        overlap = options.get("reorder_for_compute_comm_overlap", inductor_config.reorder_for_compute_comm_overlap)
        passes = options.get("reorder_for_compute_comm_overlap_passes",
                             inductor_config.reorder_for_compute_comm_overlap_passes)
        flags = {"sink_waits_iterative": "sink_waits_iterative_unsafe_collectives_reorder",
                 "reorder_communication_preserving_peak_memory": "reorder_iterative_unsafe_collectives_reorder"}
        unsafe = [flags[p] for p in passes if overlap and isinstance(p, str) and p in flags
                  and getattr(config_comms, flags[p])]
        if unsafe:
            raise ConfigError(
                f"compile options run inductor's {', '.join(p for p in passes if p in flags)} with "
                f"torch._inductor.config_comms.{' and .'.join(unsafe)} = True: they may reorder collectives differently "
                "on each rank (a unit's graph differs between ranks), and the ranks then mismatch or hang. Set "
                f"{' and '.join(f'torch._inductor.config_comms.{u} = False' for u in unsafe)} on every rank before "
                "wrapping, or leave these passes out")

    def torch_compile_kwargs(self, window_bytes: int | None = None, coalesce_bytes: int = 0) -> dict:
        """``torch.compile``'s keyword arguments; ``window_bytes``: the prefetch window
        of the overlap pass (None: no pass); ``coalesce_bytes``: small units' gathers
        are merged up to this size ([Note: compiled small units coalesced] in
        compiled_coalesce.py; 0: not), unless ``options`` set inductor's
        ``post_grad_custom_post_pass`` themselves."""
        kwargs = {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}
        options = dict(self.options) if self.options is not None else None
        ours = {}
        if self.overlap and window_bytes is not None and not any(key in (options or {}) for key in _OVERLAP_KEYS):
            ours.update(reorder_for_compute_comm_overlap=True,
                        reorder_for_compute_comm_overlap_passes=[WindowPrefetch(window_bytes)])
        if coalesce_bytes > 0 and _COALESCE_KEY not in (options or {}):
            ours[_COALESCE_KEY] = SmallUnitCoalescing(coalesce_bytes)
        if ours and self.backend == "inductor":
            if options is None and self.mode not in (None, "default"):
                from torch._inductor import list_mode_options

                options = list_mode_options(self.mode, self.dynamic)  # torch.compile takes mode or options
                kwargs["mode"] = None
            options = {**(options or {}), **ours}
        if options is not None:
            kwargs["options"] = options
        return kwargs

    def outside_compile_kwargs(self, window_bytes: int | None = None, coalesce_bytes: int = 0) -> dict:
        """``torch.compile``'s keyword arguments for a unit outside the blocks."""
        if self.outside_backend is None or self.outside_backend == self.backend:
            return self.torch_compile_kwargs(window_bytes, coalesce_bytes)
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.outside_backend}
