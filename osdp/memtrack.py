"""Peak memory of live tensors on any device, CPU included.

On CUDA ``torch.cuda.max_memory_allocated`` is the measure. On CPU there is no allocator
statistic, so ``LiveBytesTracker`` follows every storage that an operator produces
(through a ``TorchDispatchMode``) plus the tensors handed to it at the start (parameters,
optimizer state), and samples the sum of their current sizes after every operator —
``resize_`` frees (FSDP-style) and reallocations included. Storages die with their last
tensor (weak references). Same idea as ``torch.distributed._tools.mem_tracker``,
reduced to the one number the fidelity benchmark needs.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytesTracker(TorchDispatchMode):
    """``with LiveBytesTracker(initial=tensors) as t: ...; t.peak_bytes``"""

    def __init__(self, initial=()):
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        for tensor in initial:
            self._track(tensor)
        self._sample()

    def _track(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's memory is its shard
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._live:
            self._live[key] = weakref.ref(storage, lambda _r, key=key: self._live.pop(key, None))

    def _sample(self) -> None:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        self.current_bytes = total
        self.peak_bytes = max(self.peak_bytes, total)

    def track(self, tensors) -> None:
        """Follow tensors created outside the mode (e.g. optimizer state after step 1)."""
        for tensor in tensors:
            self._track(tensor)
        self._sample()

    def reset_peak(self) -> None:
        self._sample()
        self.peak_bytes = self.current_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            self._track(leaf)
        for leaf in tree_flatten((args, kwargs))[0]:  # in-place results, resized inputs
            self._track(leaf)
        self._sample()
        return out


class IntervalPeakTracker(LiveBytesTracker):
    """Live bytes with a peak per named interval: set ``interval`` to a name and every
    sample after that counts toward that name's peak, together with the bytes of
    ``extra()`` at the moment of the peak (e.g. gradients accumulated so far)."""

    def __init__(self, initial=(), extra=lambda: 0):
        self.interval = None
        self.extra = extra
        self.peaks: dict[str, tuple[int, int]] = {}
        super().__init__(initial)

    def _sample(self) -> None:
        super()._sample()
        if self.interval is not None and self.current_bytes > self.peaks.get(self.interval, (-1, 0))[0]:
            self.peaks[self.interval] = (self.current_bytes, self.extra())
