"""The measured peak memory of every step, checked against the memory limit.

``StepPeakMonitor`` measures one *step window* at a time: a window opens at a forward
and closes at the end of the step (the post-hook of an optimizer step over this model's
parameters, the next forward, or ``model.end_step()``). At close it yields a
``StepMemory`` and :func:`check_step` raises ``MemoryLimitExceeded`` when the measured
peak is over the limit.

[Note: measured peak]
What "the peak of a step" is, per device, and what it costs:

* CPU (``CpuPeakMonitor``): there is no allocator statistic, so live tensors are
  followed with a ``TorchDispatchMode`` (``osdp.memtrack.StepPeakTracker``): every
  storage an operator produced or wrote, at its current size, kept incrementally (a
  dict update per output, a weakref callback per free), plus the parameter shards and
  optimizer state (tracked when the window opens and at each optimizer step), plus the
  ledger's gathered bytes: the runtime resizes gathered buffers with
  ``untyped_storage().resize_`` outside the dispatcher, so those storages are excluded
  from the tracker and counted from the ledger instead (exact, O(1)). Bytes are storage
  bytes, as the memory model counts them; the C allocator's own overhead (malloc
  headers, arenas) is not memory the plan controls and is not counted. Tensors made
  before the window opened and never produced or written by an operator inside it (the
  input batch built before ``forward``, which the embedding only reads) are not counted
  either. An independent count of every storage an operator produces or receives agrees
  (tests/runtime/test_peak.py: on a tiny stock Llama it finds the input batch beside the
  tracker, nothing else; on a 6-layer one, 2 gloo ranks, the two were within 0.03 MiB of
  ~320 MiB, either way, on 7 plans). The mode stays pushed from the
  forward to the end of the step, because autograd runs backward under the modes that
  were active when ``backward()`` was called; a dispatch mode the user enters *inside*
  that window and leaves after it closes would be popped in the wrong order, so the
  monitor pops itself only when it is on top of the stack and otherwise leaves the
  stack alone and marks the step ``complete=False``.
  Cost: one Python call per ATen operator while the window is open. Measured with
  ``bench/peak_overhead.py`` (GPT "small", a fake group of 8, batch 3, one thread,
  alternating steps on this 2-core CPU): 16 us per operator, 1741 operators, step
  117.8 -> 146.3 ms, ratio 1.23 (median of pairs); about half of it is the cost of any
  Python dispatch mode (a no-op mode measured on the plain model), half the tracking.
  The relative cost falls as operators grow (bigger layers, bigger batches). Step
  times measured for calibration include it; ``memory_check=False`` removes it.
* CUDA (``CudaPeakMonitor``; NOT RUN on this project's machines, tested only with a
  fake ``torch.cuda``): ``torch.cuda.max_memory_allocated`` since the window opened
  (``reset_peak_memory_stats`` at open). The caching allocator rounds every block up
  to 512 bytes and serves requests of up to 1 MiB from 2 MiB segments, larger ones
  from segments rounded to 2 MiB (20 MiB for 1-10 MiB requests), and may hand out a
  whole block when the remainder is too small to split (under 1 MiB): allocated bytes
  therefore exceed the sum of tensor sizes by up to 511 B per tensor and up to 1 MiB
  per large block. That rounding is real memory and stays in the measured peak (the
  planner's ``constant_bytes`` is where it is paid for). Fragmentation (reserved but
  unallocated bytes) is reported as ``reserved_peak_bytes``: over the limit while
  the allocated peak is within it gives a ``MemoryFragmentationWarning`` (the cache
  could have been returned, ``torch.cuda.empty_cache``, and the allocator frees its
  cache before failing an allocation), not an error. The CUDA context itself is
  outside the allocator and outside both numbers. The unit at the peak is the unit
  whose start showed the highest ``memory_allocated`` (sampled at every use begin,
  a stats read without synchronization). Cost: those reads; no Python per operator.
  Allocator statistics are per device, so two models trained on one device in one
  process see each other's bytes.

``limit_bytes`` is the limit the model was wrapped with: ``OSDP(memory_limit=...)``,
else the plan's ``memory_limit_bytes``. Without either nothing is measured.
"""
from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.optim.optimizer as _optim
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..errors import MemoryFragmentationWarning, MemoryLimitExceeded
from ..memtrack import StepPeakTracker
from ..sizes import format_bytes
from .ledger import MemoryLedger


def step_peak_readable(device: torch.device, compiled: bool) -> bool:
    """Whether every step's peak can be measured on ``device`` (the per-step check):
    eager steps always; compiled ones on CUDA only (the allocator's statistics): the CPU
    tracker is a dispatch mode, which compiled code runs beneath (inductor allocates
    outside the dispatcher). One compiled CPU step at a time can be measured from the
    allocator's reports to the profiler, at about twice its time (``model.measuring_memory``,
    the plan trials: [Note: CPU allocator peak] in osdp/memtrack.py)."""
    return not compiled or device.type == "cuda"


@dataclass(frozen=True)
class StepMemory:
    """The measured memory of one step window, beside what was promised."""

    step: int  # windows closed before this one (0: the first measured step)
    peak_bytes: int  # measured (see [Note: measured peak])
    unit_at_peak: str  # the unit computing at the peak ("" outside units)
    # "forward", "after forward" (outside units after it: the loss after the head),
    # "recompute", "backward", "after backward" (of a direct rep unit, or "" at the end),
    # "optimizer step", ""
    phase_at_peak: str
    limit_bytes: float | None
    predicted_peak_bytes: float | None
    source: str  # "live tensors (cpu)" or "cuda allocator"
    reserved_peak_bytes: int | None = None  # CUDA: the allocator's reserved bytes at their peak
    operators: int = 0  # CPU: operators the tracker saw in the window
    complete: bool = True  # False: the tracker was not active for the whole window
    # the loss the plan priced when auto mode assumed it (Plan.assumed_loss); "" otherwise
    assumed_loss: str = ""

    @property
    def over_limit(self) -> bool:
        return self.limit_bytes is not None and self.peak_bytes > self.limit_bytes

    @property
    def headroom_bytes(self) -> float | None:
        """limit - measured peak (negative: over)."""
        return None if self.limit_bytes is None else self.limit_bytes - self.peak_bytes

    @property
    def prediction_error(self) -> float | None:
        """measured / predicted - 1 (positive: the model predicted too little)."""
        if not self.predicted_peak_bytes:
            return None
        return self.peak_bytes / self.predicted_peak_bytes - 1.0

    @property
    def where(self) -> str:
        if self.phase_at_peak == "after forward":
            return f"after unit {self.unit_at_peak!r}'s forward, outside units (e.g. the loss after the head)"
        if self.phase_at_peak == "after backward" and self.unit_at_peak:
            # a direct rep unit's gradient hook ([Note: direct replicated units]): the
            # backward of the module before it runs next
            return f"after unit {self.unit_at_peak!r}'s backward"
        if self.unit_at_peak:
            return f"in unit {self.unit_at_peak!r} ({self.phase_at_peak})"
        return f"in the {self.phase_at_peak}" if self.phase_at_peak else "outside any unit"


def check_step(step: StepMemory) -> None:
    """``MemoryLimitExceeded`` when ``step`` went over its limit; a
    ``MemoryFragmentationWarning`` when only the CUDA reserved bytes did."""
    if step.limit_bytes is None:
        return
    if step.over_limit:
        raise MemoryLimitExceeded(_over_message(step), step)
    if step.reserved_peak_bytes is not None and step.reserved_peak_bytes > step.limit_bytes:
        warnings.warn(
            f"step {step.step}: the CUDA caching allocator reserved {format_bytes(step.reserved_peak_bytes)} at "
            f"its peak, over the memory limit {format_bytes(step.limit_bytes)}, while the allocated peak "
            f"{format_bytes(step.peak_bytes)} stayed within it: fragmentation or cached blocks (set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or leave room with a lower memory limit)",
            MemoryFragmentationWarning, stacklevel=3,
        )


def _over_message(step: StepMemory) -> str:
    over = step.peak_bytes - step.limit_bytes
    text = (f"step {step.step}: measured peak memory {format_bytes(step.peak_bytes)} ({step.source}) is over the "
            f"memory limit {format_bytes(step.limit_bytes)} by {format_bytes(over)}, {step.where}")
    if step.assumed_loss:
        # [Note: example inputs and the loss]: the plan priced a loss auto mode guessed
        text += (f"; auto mode was given no loss_fn and planned for a loss it assumed ({step.assumed_loss}): pass "
                 "loss_fn=lambda output: <the scalar loss your loop computes> to osdp.OSDP so that the plan prices "
                 "your loss")
    if step.predicted_peak_bytes:
        # a plan whose predicted peak is limit * predicted / measured would have fit, if the
        # model misses by the same factor
        safe = math.floor(step.limit_bytes * step.predicted_peak_bytes / step.peak_bytes)
        text += (f"; the plan predicted {format_bytes(step.predicted_peak_bytes)} ({step.prediction_error:+.1%} "
                 f"measured against predicted). {'Or lower' if step.assumed_loss else 'Lower'} the batch size, or "
                 f"plan again with a lower memory limit (memory_limit={safe} bytes, {format_bytes(safe)}, leaves "
                 "room for what the model missed)")
    else:
        text += f"; {'or ' if step.assumed_loss else ''}lower the batch size, or plan again with a lower memory limit"
    if not step.complete:
        text += " (the tracker was not active for the whole step: the true peak may be higher)"
    return text


class StepPeakMonitor:
    """One step window at a time: ``open()`` (idempotent), ``close() -> StepMemory``."""

    source = ""
    assumed_loss = ""  # Plan.assumed_loss of the plan checked (make_monitor)

    def __init__(self, ledger: MemoryLedger, limit_bytes: float | None, predicted_peak_bytes: float | None):
        self.ledger = ledger
        self.limit_bytes = None if limit_bytes is None else float(limit_bytes)
        self.predicted_peak_bytes = None if predicted_peak_bytes is None else float(predicted_peak_bytes)
        self.is_open = False
        self.steps = 0
        self.last: StepMemory | None = None

    def open(self) -> None:
        if not self.is_open:
            self.is_open = True
            self._open()

    def close(self) -> StepMemory | None:
        """End the window; None when none was open."""
        if not self.is_open:
            return None
        self.is_open = False
        step = self._close()
        self.last = step
        self.steps += 1
        return step

    def track(self, tensors) -> None:
        """Tensors made outside the window (optimizer state); CPU only."""

    def _step(self, peak_bytes, where, **extra) -> StepMemory:
        unit, phase = where if where else ("", "")
        return StepMemory(self.steps, int(peak_bytes), unit, phase, self.limit_bytes, self.predicted_peak_bytes,
                          self.source, assumed_loss=self.assumed_loss, **extra)


class CpuPeakMonitor(StepPeakMonitor):
    source = "live tensors (cpu)"

    def __init__(self, ledger, limit_bytes, predicted_peak_bytes, tensors=(), ignored_storages=()):
        super().__init__(ledger, limit_bytes, predicted_peak_bytes)
        self.tracker = StepPeakTracker(external=lambda: ledger.current_gathered_bytes,
                                       where=lambda: ledger.in_flight)
        for storage in ignored_storages:
            self.tracker.ignore(storage)
        self.tracker.track(tensors)
        self._complete = True

    def track(self, tensors) -> None:
        self.tracker.track(tensors)

    def _open(self) -> None:
        self._complete = True
        if not any(mode is self.tracker for mode in _get_current_dispatch_mode_stack()):
            self.tracker.__enter__()
        self.tracker.reset_peak()

    def _close(self) -> StepMemory:
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is self.tracker:
            self.tracker.__exit__(None, None, None)
        else:  # popped by someone else, or another mode on top: never pop another mode
            self._complete = False
        t = self.tracker
        return self._step(t.peak_bytes, t.peak_where, operators=t.operators, complete=self._complete)


class CudaPeakMonitor(StepPeakMonitor):
    """UNVERIFIED on hardware (no GPU here): tested with a fake ``cuda`` namespace."""

    source = "cuda allocator"

    def __init__(self, ledger, limit_bytes, predicted_peak_bytes, device, cuda=None):
        super().__init__(ledger, limit_bytes, predicted_peak_bytes)
        self.device = device
        self.cuda = cuda if cuda is not None else torch.cuda
        self._sampled_bytes = -1
        self._sampled_where: tuple[str, str] = ("", "")
        ledger.use_listeners.append(self._sample)

    def _sample(self) -> None:
        if not self.is_open:
            return
        allocated = self.cuda.memory_allocated(self.device)
        if allocated > self._sampled_bytes:
            self._sampled_bytes = allocated
            self._sampled_where = self.ledger.in_flight

    def _open(self) -> None:
        self.cuda.reset_peak_memory_stats(self.device)
        self._sampled_bytes = -1
        self._sampled_where = self.ledger.in_flight

    def _close(self) -> StepMemory:
        peak = self.cuda.max_memory_allocated(self.device)
        reserved = self.cuda.max_memory_reserved(self.device)
        return self._step(peak, self._sampled_where, reserved_peak_bytes=int(reserved))


def make_monitor(ledger: MemoryLedger, device: torch.device, limit_bytes, predicted_peak_bytes, tensors=(),
                 ignored_storages=(), cuda=None, assumed_loss: str = "") -> StepPeakMonitor:
    if device.type == "cuda":
        monitor = CudaPeakMonitor(ledger, limit_bytes, predicted_peak_bytes, device, cuda)
    else:
        monitor = CpuPeakMonitor(ledger, limit_bytes, predicted_peak_bytes, tensors, ignored_storages)
    monitor.assumed_loss = assumed_loss
    return monitor


class StepMemoryCheck:
    """The runtime's per-step check: a window opens at every forward and closes (then is
    checked) at the end of the step: the post-hook of a ``torch.optim`` optimizer step
    over this model's parameters, the next forward, or :meth:`end_step`."""

    def __init__(self, monitor: StepPeakMonitor, params):
        self.monitor = monitor
        self._param_ids = {id(p) for p in params}
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> holds our params
        me = weakref.ref(self)

        def pre(optimizer, args, kwargs):
            check = me()
            if check is not None:
                check._before_optimizer_step(optimizer)

        def post(optimizer, args, kwargs):
            check = me()
            if check is not None and check._ours(optimizer):
                check.end_step()

        handles = [_optim.register_optimizer_step_pre_hook(pre),
                   _optim.register_optimizer_step_post_hook(post)]
        self._finalizer = weakref.finalize(self, _remove_hooks, handles)

    def close(self) -> None:
        """Remove the global optimizer hooks now (else when this check is collected)."""
        self._finalizer()

    def _ours(self, optimizer) -> bool:
        known = self._optimizers.get(optimizer)
        if known is None:
            known = any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])
            self._optimizers[optimizer] = known
        return known

    def _before_optimizer_step(self, optimizer) -> None:
        if not (self.monitor.is_open and self._ours(optimizer)):
            return
        self.monitor.ledger.note_use("", "optimizer step")
        # state loaded outside a window (a checkpoint) is followed from here on
        self.monitor.track(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))

    def begin_forward(self) -> None:
        """Close (and check) the window of the previous step, open this one's."""
        self.end_step()
        self.monitor.open()

    def end_step(self) -> StepMemory | None:
        step = self.monitor.close()
        if step is not None:
            check_step(step)
        return step

    def abort(self) -> None:
        """A forward raised: end the window unchecked (its peak is not a step's)."""
        self.monitor.close()


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()
