"""Memory ledger: live gathered-weight and unsharded-gradient bytes, per unit and in
total, with peaks. It counts what the runtime allocates on purpose (the transient
buffers OSDP adds on top of sharded states), so peaks can be checked against the plan
on any device; on CUDA the stats also carry ``torch.cuda.max_memory_allocated``.
A ``rep`` unit gathers nothing; its gradient bytes are its unsharded gradient buffer
and, while its bucket is in flight, its share of the bucket's staging copy (both under
the unit's name), see [Note: replicated buckets] in reduce.py.
"""
from __future__ import annotations

from collections import defaultdict

import torch


class MemoryLedger:
    def __init__(self, device: torch.device):
        self.device = device
        self.gathered: dict[str, int] = {}  # unit -> live gathered bytes
        self.grads: dict[str, int] = {}  # unit -> live unsharded gradient bytes
        self.current_gathered_bytes = 0
        self.current_grad_bytes = 0
        self.all_gathers: dict[str, int] = defaultdict(int)  # unit -> count since reset
        self.reduce_scatters: dict[str, int] = defaultdict(int)
        self.all_reduces: dict[str, int] = defaultdict(int)  # rep unit -> bucket all-reduces it rode in
        # what computes now, (unit, phase): ("h.0", "forward"), ("", "optimizer step");
        # read by the step peak monitor at every new maximum (osdp/runtime/peak.py)
        self.in_flight: tuple[str, str] = ("", "")
        self.use_listeners: list = []  # called after every note_use (CUDA peak sampling)
        self.reset()

    def reset(self) -> None:
        self.peak_gathered_bytes = self.current_gathered_bytes
        self.peak_grad_bytes = self.current_grad_bytes
        self.peak_total_bytes = self.current_gathered_bytes + self.current_grad_bytes
        self.unit_peak_gathered_bytes = dict(self.gathered)
        self.unit_peak_grad_bytes = dict(self.grads)
        self.all_gathers.clear()
        self.reduce_scatters.clear()
        self.all_reduces.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peaks(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.current_gathered_bytes)
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.current_grad_bytes)
        self.peak_total_bytes = max(self.peak_total_bytes, self.current_gathered_bytes + self.current_grad_bytes)

    def gather(self, unit: str, nbytes: int) -> None:
        assert unit not in self.gathered, f"{unit} gathered twice"
        self.gathered[unit] = nbytes
        self.current_gathered_bytes += nbytes
        self.all_gathers[unit] += 1
        self.unit_peak_gathered_bytes[unit] = max(self.unit_peak_gathered_bytes.get(unit, 0), nbytes)
        self._peaks()

    def free(self, unit: str) -> None:
        self.current_gathered_bytes -= self.gathered.pop(unit)

    def grad_alloc(self, unit: str, nbytes: int) -> None:
        self.grads[unit] = self.grads.get(unit, 0) + nbytes
        self.current_grad_bytes += nbytes
        self.unit_peak_grad_bytes[unit] = max(self.unit_peak_grad_bytes.get(unit, 0), self.grads[unit])
        self._peaks()

    def grad_free(self, unit: str, nbytes: int) -> None:
        self.current_grad_bytes -= nbytes
        self.grads[unit] -= nbytes
        if not self.grads[unit]:
            del self.grads[unit]

    def note_use(self, unit: str, phase: str) -> None:
        """A use of ``unit`` (``phase``: forward, recompute, backward) begins computing;
        ``unit=""`` for a phase outside units (optimizer step)."""
        self.in_flight = (unit, phase)
        for listener in self.use_listeners:
            listener()

    def reduce_scattered(self, unit: str) -> None:
        self.reduce_scatters[unit] += 1

    def all_reduced(self, unit: str) -> None:
        """A rep unit's gradient went into a replicated bucket's all-reduce."""
        self.all_reduces[unit] += 1

    def stats(self) -> dict:
        stats = {
            "peak_gathered_bytes": self.peak_gathered_bytes,
            "peak_grad_bytes": self.peak_grad_bytes,
            "peak_total_bytes": self.peak_total_bytes,
            "current_gathered_bytes": self.current_gathered_bytes,
            "current_grad_bytes": self.current_grad_bytes,
            "gathered_units": sorted(self.gathered),
            "unit_peak_gathered_bytes": dict(self.unit_peak_gathered_bytes),
            "unit_peak_grad_bytes": dict(self.unit_peak_grad_bytes),
            "all_gathers": dict(self.all_gathers),
            "reduce_scatters": dict(self.reduce_scatters),
            "all_reduces": dict(self.all_reduces),
        }
        if self.device.type == "cuda":
            stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
            stats["cuda_memory_allocated"] = torch.cuda.memory_allocated(self.device)
        return stats
