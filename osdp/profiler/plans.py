"""``measure_plan``: time a plan on the runtime that will run it.

The model is wrapped by ``osdp.OSDP`` with the plan, so what is measured is what
training runs: the real scheduler, prefetch window, coalescing of small units, reduction
queue and split ops. It trains with AdamW (the optimizer the cost model prices; lr 0:
the weights do not move) on the example inputs repeated or cut to the plan's batch,
``accumulation_steps`` micro-batches per step (``OSDP.micro_batch``): ``warmup`` steps
(the first records the use order and creates the optimizer state), then ``steps`` timed
steps. The peak memory is read in the last warm-up step, a steady one (the runtime's own
tracker of live tensors on CPU, which slows it by about 5%, so it is not timed; the
allocator's peak on CUDA, and on CPU for a compiled step, from the profiler's memory
reports); with fewer than 2 warm-up steps, in one more step after the timed ones. Every rank measures; the step reported is the median timed step with its own
phases (so forward + backward + optimizer = step), taken from the slowest rank (it
decides when a step is done for everyone); peak and group times are maxima over ranks.
Every rank holds the same ``Measurement``.

[Note: one trial at a time]
No plan is measured on a copy of the model: the model may not fit twice, or not even
once whole (built on the meta device). A trial is the model's skeleton (its structure
on meta, ``meta_skeleton``) wrapped with the plan, its units filled one module at a time
([Note: meta initialization]) from a value source: the model's own tensors when it is a
real model, else the trial before it (its shards gathered unit by unit,
``ShardValues``), the first one from the wrapped model the caller holds. Only one trial
lives at a time (the next is built from it, then it is closed): plans are measured one
after the other, not with their steps interleaved, so a load that drifts between two
measurements is not cancelled out. While a trial is built from the one before, both
shards are alive (no optimizer state, no gradients: far below a step's peak). A ``TrialPool`` keeps the last trial for the next
call: a plan timed again runs on it warm (no rebuild, no warm-up, its peak read the
first time), and it is the value source of the next trial.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from ..planner.calibration import Measurement, group_of
from ..planner.inputs import as_example_inputs, batch_loss
from ..api import ShardedModel
from ..errors import OSDPError
from ..memtrack import cpu_own_peak, cuda_own_peak, resident_tensors
from ..rank_agreement import collective_device
from ..runtime.options import RuntimeOptions
from ..runtime.peak import step_peak_readable
from ..runtime.materialize import ModuleValues, ValuesFrom, has_meta, meta_skeleton
from ..runtime.state_dict import ShardValues

__all__ = ["TrialPool", "measure_plan", "measure_plans"]


def forked_rng():
    """``torch.random.fork_rng`` over the CPU's and the current CUDA device's streams:
    what runs inside draws nothing from the caller's."""
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else [])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_stamps(model, names):
    """Forward pre-hooks on the plan's unit modules: a stamp per module per step."""
    modules = dict(model.unwrapped.named_modules())
    stamps: dict[str, float] = {}
    handles = []
    for name in names:
        module = modules.get(name)
        # a vocabulary-split head computes its fused loss outside its call (no hook would
        # fire), and a hook of its own would turn the fused loss off (fuses_loss)
        if module is None or hasattr(module, "fuses_loss"):
            continue

        def hook(*_, name=name):  # returns None: a pre-hook's value would replace the inputs
            stamps.setdefault(name, time.perf_counter())

        handles.append(module.register_forward_pre_hook(hook))
    return stamps, handles


def measure_plan(module, plan, example_inputs, **kwargs) -> Measurement:
    """Train a copy of ``module`` wrapped with ``plan`` for a few steps and return what
    was measured (every rank calls it; all get the same numbers); ``measure_plans`` of
    one plan, see there for the keyword arguments."""
    return measure_plans(module, [plan], example_inputs, **kwargs)[0]


class TrialPool:
    """The one live trial ([Note: one trial at a time]) and where the next one's values
    come from: ``holder``, a wrapped model holding the values of a model on the meta
    device, until the first trial is built from it (then dropped: the trial holds them),
    then the live trial; without a holder, the model's own tensors (cheaper than
    gathering a trial's shards)."""

    def __init__(self, holder=None):
        self.holder = holder
        self.from_shards = holder is not None  # the values live in wrapped models, not in the model
        self.current: _Trial | None = None

    def trial(self, make, plan, module, compile=None) -> tuple[_Trial, bool]:
        """The trial of ``plan`` (compiled per ``compile``): the live one when it runs
        that (warm: True), else ``make(source)``, the live one closed after (before, when
        not its source)."""
        current = self.current
        if current is not None and current.plan.plan_hash() == plan.plan_hash() and current.compile == compile:
            return current, True
        if not self.from_shards:
            self.close()  # the model's own tensors: nothing needs the live trial
            source = ModuleValues(module)
        else:  # built from the live trial's shards (or the holder's), freed after
            self.strip()  # only its shards are needed beside the new trial, each freed once used
            source = ShardValues(self.values(), release=True)
        trial = make(source)
        del source
        self.close()
        had_holder, self.current, self.holder = self.holder is not None, trial, None
        if had_holder:
            gc.collect()  # the holder's shards: see close()
        return trial, False

    def close(self) -> None:
        """Close the live trial; the values of a model on meta go with it, unless the
        holder still has them. A wrapped model is a web of reference cycles (its hooks
        and scheduler refer back to it): collected now, not whenever the collector runs
        next, so that no two trials' shards and optimizer states are alive at once
        (measured: a 162M GPT's auto mode peaked 1.9x the training of its pick without)."""
        if self.current is not None:
            self.current.close()
            self.current = None
            gc.collect()

    def strip(self) -> None:
        """Before a model is built from :meth:`values`: the live trial keeps its shards
        only."""
        if self.current is not None:
            self.current.strip()

    def values(self):
        """The wrapped model that holds a meta model's values now: the live trial, else
        the holder (None: a real model's values are its own)."""
        return self.holder if self.current is None else self.current.model


def measure_plans(module, plans, example_inputs, *, loss_fn=None, steps: int = 3, warmup: int = 2,
                  process_group=None, device=None, mixed_precision=None, coalesce_bytes=None, layout=None,
                  group_times: bool = True, pool: TrialPool | None = None, compile=None) -> list[Measurement]:
    """Measure several plans of ``module``, one after the other, each on a trial built
    from ``module``'s skeleton ([Note: one trial at a time]). Neither ``module`` nor the
    random number generators' states change (dropout in the trials draws from a forked
    state). ``group_times``: also time the forward of every unit group (module hooks that
    read the clock; on CUDA they do not synchronize, so group times there are launch
    times). ``pool``: the live trial and value source across calls (required for a
    ``module`` on the meta device, whose values a wrapped model holds:
    ``TrialPool(holder=wrapped)``); without one, ``module``'s own tensors, and the trial
    is closed at the end. ``compile``: the trials run compiled (``OSDP(compile=...)``,
    [Note: compiled units]); their first warm-up step compiles (the trial's ``first_step_s``),
    no group times (a clock-reading hook inside a compiled block is a graph break), and
    on CPU their peak is the allocator's (the live-tensor tracker is a dispatch mode,
    which compiled code runs beneath: [Note: CPU allocator peak] in osdp/memtrack.py)."""
    if compile is not None:
        group_times = False
    if has_meta(module) and (pool is None or pool.values() is None):
        raise OSDPError("measure_plans of a model on the meta device needs its values: a pool holding the wrapped "
                        "model that has them, TrialPool(holder=wrapped)")
    # memory_check=False: the peak is measured in a step of its own; a plan over its
    # limit is what calibration is there to find, not an error mid-measurement
    options = RuntimeOptions.from_args(device=device, mixed_precision=mixed_precision, coalesce_bytes=coalesce_bytes,
                                       memory_check=False, compile=compile)
    own = pool is None
    if own:
        pool = TrialPool()
    out = []
    try:
        with forked_rng():
            for plan in plans:
                def make(source, plan=plan):
                    return _Trial(module, plan, example_inputs, loss_fn, process_group, layout, options, source)

                trial, warm = pool.trial(make, plan, module, options.compile)
                if not warm:
                    for k in range(warmup):
                        # the first step records the use order and makes AdamW's state
                        # (and compiles): the second is the first steady one
                        row = trial.step(measure_peak=k >= 1 and k == warmup - 1)
                        if k == 0:
                            trial.first_step_s = row[0]
                trial.begin_round()
                if group_times:
                    trial.hook_groups()
                try:
                    for _ in range(steps):
                        trial.timed_step()
                finally:
                    trial.unhook()
                out.append(trial.result())
    finally:
        if own:
            pool.close()
    return out


class _Trial:
    """One plan on its own wrapped copy of the model, with its optimizer and inputs."""

    def __init__(self, module, plan, example_inputs, loss_fn, group, layout, options: RuntimeOptions, source):
        inputs = as_example_inputs(example_inputs)
        self.example_batch = inputs.batch_size()
        self.plan, self.batch, self.loss_fn, self.group = plan, plan.batch_size, loss_fn, group
        inputs = inputs if self.batch == self.example_batch else inputs.with_batch(self.batch)
        # on the caller's layout (its mesh and node size) when it has one
        where = {"mesh": layout} if layout is not None else {"process_group": group}
        skeleton = meta_skeleton(module)
        self.model = ShardedModel(skeleton, plan=plan, **where, **options.as_kwargs(),
                                  param_init_fn=ValuesFrom(skeleton, source))
        self.compile = options.compile
        self.first_step_s: float | None = None
        self.dev = self.model.device
        self.inputs = inputs.map_tensors(lambda t: t.to(self.dev))  # packed image patches too
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.0)
        self.timed: list[tuple] = []
        self.peak: tuple[float, str] | None = None  # (bytes, how they were read)
        self.per_group: list[dict] = []
        self.stamps: dict[str, float] | None = None
        self.handles: list = []

    def step(self, measure_peak: bool = False) -> tuple:
        """One training step; ``measure_peak``: its peak memory is kept (``self.peak``)."""
        if measure_peak:
            return self._measured_step()
        dist.barrier(self.group)
        _sync(self.dev)
        if self.stamps is not None:
            self.stamps.clear()
        t0 = mark = time.perf_counter()
        forward_s = backward_s = 0.0
        first_t1 = t0
        for i in range(self.model.accumulation_steps):  # the plan's micro-batches, its gradient sync
            with self.model.micro_batch(i):
                loss = batch_loss(self.inputs.call(self.model), self.loss_fn, self.batch, self.example_batch)
                _sync(self.dev)
                t1 = time.perf_counter()
                loss.backward()
                _sync(self.dev)
            t2 = time.perf_counter()
            forward_s += t1 - mark  # contiguous intervals: the phases add up to the step
            backward_s += t2 - t1
            mark = t2
            first_t1 = t1 if i == 0 else first_t1  # group times: the first micro-batch's forward
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        _sync(self.dev)
        t3 = time.perf_counter()
        return t3 - t0, forward_s, backward_s, t3 - t2, first_t1

    def begin_round(self) -> None:
        """A new measurement: the timed steps of earlier ones are not part of it."""
        self.timed, self.per_group = [], []

    def hook_groups(self) -> None:
        self.stamps, self.handles = _group_stamps(self.model, [u.name for u in self.plan.units])

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.stamps = [], None

    def timed_step(self) -> None:
        row = self.step()
        self.timed.append(row)
        if self.stamps is not None:
            order = sorted(self.stamps, key=self.stamps.__getitem__)
            groups: dict[str, float] = {}
            for i, name in enumerate(order):
                end = self.stamps[order[i + 1]] if i + 1 < len(order) else row[4]
                groups[group_of(name)] = groups.get(group_of(name), 0.0) + end - self.stamps[name]
            self.per_group.append(groups)

    def _resident(self) -> list[torch.Tensor]:
        return resident_tensors(self.model, self.optim)

    def _measured_step(self) -> tuple:
        """A step whose peak bytes (this copy's states and what the step adds) are kept."""
        if not step_peak_readable(self.dev, self.compile is not None):  # compiled on CPU: see measure_plans
            row, peak = cpu_own_peak(self._resident(), self.step)
            self.peak = ((peak, "the CPU allocator's bytes (profiler memory reports, osdp.memtrack.cpu_own_peak)")
                         if peak is not None else (0.0, "not measured: compiled on CPU, and another profiler is "
                                                         "recording (osdp.memtrack.cpu_own_peak)"))
            return row
        if self.dev.type == "cuda":
            row, peak = cuda_own_peak(self.dev, self._resident(), self.step)
            self.peak = (peak, "torch.cuda.max_memory_allocated (less what other tensors held before the step)")
            return row
        # the runtime's own tracker, the one its memory check reads: the same bytes as
        # osdp.memtrack.LiveBytesTracker (tests/runtime/test_peak.py), at a sixth of its
        # cost (I&C 6x128-512 all zdp b14, 2 ranks: +5% on a step against +30%)
        with self.model.measuring_memory(self.optim) as measured:
            row = self.step()
        self.peak = (measured[0].peak_bytes, "live tensors (the runtime's step tracker, osdp.memtrack.StepPeakTracker)")
        return row

    def result(self) -> Measurement:
        steps = len(self.timed)
        if self.peak is None:
            self._measured_step()
        peak, peak_source = self.peak
        # the median step with its own phases (so they add up to it), then the slowest
        # rank's: it decides when a step is done for everyone
        median_step = sorted(self.timed)[(len(self.timed) - 1) // 2][:4]
        group_names = sorted({g for groups in self.per_group for g in groups})
        group_medians = [statistics.median(groups.get(g, 0.0) for groups in self.per_group) for g in group_names]
        row = torch.tensor(list(median_step) + [float(peak)] + group_medians, dtype=torch.float64)
        if dist.is_initialized():
            row = row.to(collective_device(self.group))
            rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, row, group=self.group)
            slowest = max(rows, key=lambda r: float(r[0]))
            highest = torch.stack(rows).max(dim=0).values  # peak and group times: max over ranks
            row = torch.cat([slowest[:4], highest[4:]])
        values = row.tolist()
        return Measurement(
            step_s=values[0], forward_s=values[1], backward_s=values[2], optimizer_s=values[3],
            peak_bytes=values[4], batch_size=int(self.batch), steps=int(steps), peak_source=peak_source,
            groups=dict(zip(group_names, values[5:])),
        )

    def strip(self) -> None:
        """Keep the wrapped model's shards only (the values the next trial is built
        from): its optimizer state and gradients go."""
        self.optim = None
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        gc.collect()

    def close(self) -> None:
        self.model = self.optim = None
