"""``measure_plan``: time a plan on the runtime that will run it.

A deep copy of the (unwrapped) model is wrapped by ``osdp.OSDP`` with the plan, so what
is measured is what training runs: the real scheduler, prefetch window, coalescing of
small units, reduction queue and split ops. It trains with AdamW (the optimizer the
cost model prices; lr 0, the copy is thrown away) on the example inputs repeated or cut
to the plan's batch: ``warmup`` steps (the first records the use order and creates the
optimizer state), then ``steps`` timed steps, then one step under the peak-memory
tracker (live tensors on CPU, which slows it, so it is not timed; the allocator's peak
on CUDA). Every rank measures; the step reported is the median timed step with its own
phases (so forward + backward + optimizer = step), taken from the slowest rank (it
decides when a step is done for everyone); peak and group times are maxima over ranks.
Every rank holds the same ``Measurement``.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

from ..planner.calibration import Measurement, group_of
from ..planner.inputs import as_example_inputs, batch_loss


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
        if module is None:
            continue

        def hook(*_, name=name):  # returns None: a pre-hook's value would replace the inputs
            stamps.setdefault(name, time.perf_counter())

        handles.append(module.register_forward_pre_hook(hook))
    return stamps, handles


def measure_plan(module, plan, example_inputs, *, loss_fn=None, steps: int = 3, warmup: int = 2,
                 process_group=None, device=None, mixed_precision=None, coalesce_bytes=None,
                 group_times: bool = True) -> Measurement:
    """Train a copy of ``module`` wrapped with ``plan`` for a few steps and return what
    was measured (every rank calls it; all get the same numbers). Neither ``module`` nor
    the random number generators' states change (dropout in the copy draws from a
    forked state). ``group_times``: also time the forward of every unit group (module
    hooks that read the clock; on CUDA they do not synchronize, so group times there
    are launch times)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        return _measure(module, plan, example_inputs, loss_fn, steps, warmup, process_group, device,
                        mixed_precision, coalesce_bytes, group_times)


def _measure(module, plan, example_inputs, loss_fn, steps, warmup, process_group, device, mixed_precision,
             coalesce_bytes, group_times) -> Measurement:
    from ..api import OSDP
    from ..memtrack import LiveBytesTracker

    inputs = as_example_inputs(example_inputs)
    example_batch = inputs.batch_size()
    batch = plan.batch_size
    inputs = inputs if batch == example_batch else inputs.with_batch(batch)
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if cuda:
        _sync(torch.device("cuda"))
        base_bytes = torch.cuda.memory_allocated()
    replica = copy.deepcopy(module)
    model = OSDP(replica, plan=plan, process_group=process_group, device=device, mixed_precision=mixed_precision,
                 coalesce_bytes=coalesce_bytes)
    dev = model.device
    inputs = inputs.map_batched(lambda t: t.to(dev))
    optim = torch.optim.AdamW(model.parameters(), lr=0.0)
    group = process_group

    def one_step(timed: list | None, stamps=None) -> None:
        dist.barrier(group)
        _sync(dev)
        if stamps is not None:
            stamps.clear()
        t0 = time.perf_counter()
        loss = batch_loss(inputs.call(model), loss_fn, batch, example_batch)
        _sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        _sync(dev)
        t3 = time.perf_counter()
        if timed is not None:
            timed.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2, t1))

    for _ in range(warmup):
        one_step(None)
    names = [u.name for u in plan.units]
    stamps, handles = _group_stamps(model, names) if group_times else ({}, [])
    timed, per_group = [], []
    try:
        for _ in range(steps):
            one_step(timed, stamps)
            order = sorted(stamps, key=stamps.__getitem__)
            groups: dict[str, float] = {}
            for i, name in enumerate(order):
                end = stamps[order[i + 1]] if i + 1 < len(order) else timed[-1][4]
                groups[group_of(name)] = groups.get(group_of(name), 0.0) + end - stamps[name]
            per_group.append(groups)
    finally:
        for h in handles:
            h.remove()
    # peak of one steady step
    if cuda:
        _sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        one_step(None)
        peak = torch.cuda.max_memory_allocated(dev) - base_bytes
        peak_source = "torch.cuda.max_memory_allocated (less what was allocated before the copy)"
    else:
        state = [t for st in optim.state.values() for t in st.values() if torch.is_tensor(t)]
        with LiveBytesTracker(list(model.parameters()) + list(model.buffers()) + state) as tracker:
            one_step(None)
        peak = tracker.peak_bytes
        peak_source = "live tensors (osdp.memtrack.LiveBytesTracker)"
    # the median step with its own phases (so they add up to it), then the slowest
    # rank's: it decides when a step is done for everyone
    median_step = sorted(timed)[(len(timed) - 1) // 2][:4]
    group_names = sorted({g for groups in per_group for g in groups})
    group_medians = [statistics.median(groups.get(g, 0.0) for groups in per_group) for g in group_names]
    row = torch.tensor(list(median_step) + [float(peak)] + group_medians, dtype=torch.float64)
    if dist.is_initialized():
        rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, row, group=group)
        slowest = max(rows, key=lambda r: float(r[0]))
        highest = torch.stack(rows).max(dim=0).values  # peak and group times: max over ranks
        row = torch.cat([slowest[:4], highest[4:]])
    values = row.tolist()
    del model, optim, replica
    return Measurement(
        step_s=values[0], forward_s=values[1], backward_s=values[2], optimizer_s=values[3], peak_bytes=values[4],
        batch_size=int(batch), steps=int(steps), peak_source=peak_source,
        groups=dict(zip(group_names, values[5:])),
    )
