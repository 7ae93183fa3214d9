"""Profiler: measure what the cost model needs on the real hardware and process group.

    desc, cluster, run = osdp.profiler.profile(model, example_inputs, memory_limit="8GiB")
    device = cluster.for_run(run)          # or: osdp.profiler.profile(...).device

What is measured is hardware, a ``ClusterProfile`` (links, compute, overheads; savable
with ``cluster.save(path)`` and loadable with ``osdp.planner.load_cluster(path)``), apart from
the run it was measured under, a ``RunSettings`` (this process group's world size and
the memory limit): see [Note: hardware apart from the run] in ``cluster.py``. The
measured links are one level, ``links["intra"]``, over the ranks of the group
(``node_size`` = world size).

* collectives: all-gather and reduce-scatter times over message sizes (4 KiB..256 MiB by
  default), fitted to the ring model t = (N-1) a + (N-1)/N S b (see device.CollectiveCost);
* compute: forward and backward time of every unit at several batch sizes, fitted to
  intercept + slope * batch, shared by units of the same shape (``shape_key``);
* splitting: forward + backward time of the widest splittable unit split in g slices
  (the runtime's slice ops) relative to the unsplit matmul;
* activation bytes per sample: through ``describe`` (saved-tensor hooks).

These are the hardware's numbers, timed apart from the runtime. What the runtime adds on
top (its per-unit overhead, how much communication it really hides, the compute of a
step as the wrapped model runs it, the memory a step really peaks at) is fitted from
steps of the wrapped model (``osdp.profiler.measure_plan``; auto mode does it): see
[Note: what the profiler fits] in ``calibration.py``.

Every rank measures (so contention is real) and rank 0's numbers are broadcast: all
ranks plan from identical inputs. Results are cached on disk (``profile_cache.py``,
[Note: profile cache]: ``$OSDP_CACHE_DIR`` or ~/.cache/osdp, keyed by machine, torch
version, dtype and backend, entries expire, noisy measurements are re-measured and not
cached, entries measured at another speed of the machine than now are measured again,
``reprofile=True`` / ``$OSDP_REPROFILE=1`` bypass it): compute fits per unit shape
(the shape key holds the unit's kind, size, FLOPs and activation bytes, so a changed
model re-measures only its changed units), collectives per world size.

[Note: compute of a model on meta]
A model built on the meta device has no weights to time its units with, and nothing
may make it whole on one rank. Its description is fake-tensor work (describe_fake); its
compute is priced from FLOPs: every op at the rate of its widest splittable matmul
(timed alone at the example batch's tokens; DeviceInfo's op overhead per op), no
per-unit fits. Auto mode then measures it wrapped, on the runtime, and calibration fits
the compute scales, the per-unit overhead and the rest to those steps ([Note: what the
profiler fits] in calibration.py): what per-op fits would have said about ops slower
per FLOP than a matmul (norms, softmax) is averaged into the scales.

[Note: timing units]
Forward time of a unit runs from its forward pre-hook to the next unit's (work between
units belongs to the unit before it, as in describe's attribution). Backward time of a
unit runs from the moment the gradient of the next unit's parameters is accumulated to
the moment its own is: in reverse order, that interval holds its own backward and that of
the work attributed to it in forward.
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import OSDPError
from ..ops import MatmulSplit, registered_split_ops
from ..contract import gradient_collective
from ..rank_agreement import max_over_ranks
from ..sizes import format_bytes, parse_bytes
from ..torch_names import all_gather_flat, reduce_scatter_flat
from ..planner.cost_model import shape_key
from ..planner.description import ModelDesc, describe
from ..planner.inputs import as_example_inputs, batch_loss
from ..planner.cluster import ClusterProfile
from ..planner.device import CollectiveCost, ComputeFit, DeviceInfo
from ..planner.profile_cache import (ProfileCache, gflops, machine_key, speed_now, steady, steady_speed,
                                     timed_samples)
from ..planner.run import RunSettings

log = logging.getLogger("osdp.profile")
DEFAULT_COMM_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB .. 64 MiB
FULL_COMM_SIZES = tuple(4096 * 2**i for i in range(17))  # 4 KiB .. 256 MiB


class Progress:
    """A progress bar on a terminal, log lines otherwise (silent on ranks > 0)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {what[:40]:<40}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            log.info("%s %d/%d: %s", self.label, self.done, self.total, what)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares intercept and slope, slope clamped at >= 0 and intercept at >= 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


# ---- collectives -------------------------------------------------------------------

def profile_collectives(group=None, sizes=DEFAULT_COMM_SIZES, repeats: int = 3, device=None,
                        progress: Progress | None = None, noisy: set | None = None) -> tuple[CollectiveCost, CollectiveCost]:
    """Fit alpha/beta of all-gather and of the gradient reduction on ``group`` (all ranks
    call): the reduction is timed with the collective the runtime uses on this device
    (reduce-scatter, or all-reduce on gloo: contract.gradient_collective). Noisy sizes
    are re-measured (``profile_cache.steady``, all ranks together); ``noisy`` collects
    ``"comm"`` when one stayed noisy."""
    world = dist.get_world_size(group)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    all_reduce = gradient_collective(torch.device(device).type) == "all_reduce"
    if world == 1:
        return CollectiveCost(0.0, 0.0), CollectiveCost(0.0, 0.0)
    fits = []
    for op in ("all_gather", "reduce_scatter"):
        xs, ys = [], []
        for size in sizes:
            elems = max(world, size // 4 // world * world)
            full = torch.zeros(elems, device=device)
            shard = torch.zeros(elems // world, device=device)
            def once(op=op, full=full, shard=shard):
                if op == "all_gather":
                    all_gather_flat(full, shard, group=group)
                elif all_reduce:
                    dist.all_reduce(full, group=group)
                else:
                    reduce_scatter_flat(shard, full, group=group)

            # the first run warms up buffers and connections (timed_samples drops it)
            kept = steady(lambda once=once: timed_samples(once, repeats, sync=lambda: _sync(device),
                                                          before=lambda: dist.barrier(group)),
                          f"{op} of {format_bytes(elems * 4)}", agree=lambda s: max_over_ranks(s, group))
            if kept.noisy and noisy is not None:
                noisy.add("comm")
            samples = list(kept.samples)
            # the slowest rank decides when a collective is done for everyone
            xs.append(elems * 4)
            ys.append(max_over_ranks(statistics.median(samples), group))
            if progress:
                progress.step(f"{op} {format_bytes(elems * 4)}")
        intercept, slope = _fit_line(xs, ys)
        fits.append(CollectiveCost(alpha_s=intercept / (world - 1), beta_s_per_byte=slope * world / (world - 1)))
    return fits[0], fits[1]


# ---- compute -----------------------------------------------------------------------

def _unit_modules(model: nn.Module, desc: ModelDesc) -> list[tuple[str, nn.Module]]:
    modules = dict(model.named_modules())
    return [(op.name, modules[op.name]) for op in desc.ops]


def time_units(model, inputs, desc: ModelDesc, loss_fn=None, repeats: int = 3,
               example_batch: int | None = None, totals: list | None = None) -> dict[str, tuple[float, float]]:
    """Median (forward_s, backward_s) per unit for one forward + backward of ``inputs``
    (example inputs, see [Note: example inputs and the loss]; the loss as describe's).
    ``example_batch``: the batch ``loss_fn`` was written for (for its error message).
    ``totals``: gets each repeat's forward + backward seconds (for the noise check)."""
    inputs = as_example_inputs(inputs)
    batch = inputs.batch_size()
    units = _unit_modules(model, desc)
    device = next(model.parameters()).device
    stamps_f: dict[str, float] = {}
    stamps_b: dict[str, float] = {}
    handles = []
    def stamp(table, name, last=False):
        def hook(*_):  # returns None: a pre-hook's return value would replace the inputs
            _sync(device)
            if last:
                table[name] = time.perf_counter()
            else:
                table.setdefault(name, time.perf_counter())
        return hook

    for name, module in units:
        handles.append(module.register_forward_pre_hook(stamp(stamps_f, name)))
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params:
            handles.append(params[0].register_post_accumulate_grad_hook(stamp(stamps_b, name)))
        else:  # a leaf module ([Note: leaf modules]): its backward ends with its last gradient
            handles += [p.register_post_accumulate_grad_hook(stamp(stamps_b, name, last=True))
                        for p in module.parameters() if p.requires_grad]
    samples = {name: ([], []) for name, _ in units}
    try:
        for rep in range(repeats + 1):
            stamps_f.clear()
            stamps_b.clear()
            model.zero_grad(set_to_none=True)
            loss = batch_loss(inputs.call(model), loss_fn, batch, example_batch or batch)
            _sync(device)
            fwd_end = time.perf_counter()
            loss.backward()
            _sync(device)
            if not rep:
                continue
            if totals is not None and stamps_f:
                totals.append(time.perf_counter() - min(stamps_f.values()))
            order = [n for n, _ in units if n in stamps_f]
            order.sort(key=stamps_f.__getitem__)
            for i, name in enumerate(order):
                end = stamps_f[order[i + 1]] if i + 1 < len(order) else fwd_end
                samples[name][0].append(end - stamps_f[name])
            # backward: from the next unit's gradient (or the start) to this unit's
            previous = fwd_end
            for name in reversed(order):
                if name in stamps_b:
                    samples[name][1].append(stamps_b[name] - previous)
                    previous = stamps_b[name]
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return {n: (statistics.median(f) if f else 0.0, statistics.median(b) if b else 0.0) for n, (f, b) in samples.items()}


def profile_compute(model, example_inputs, desc: ModelDesc, batches, loss_fn=None, repeats=3,
                    skip_keys=(), progress: Progress | None = None, noisy: set | None = None,
                    time_limit_s: float | None = None) -> dict[str, ComputeFit]:
    """Fits per shape key (units of equal shape pooled) for keys not in ``skip_keys``.
    A batch whose repeats are noisy is re-measured (``profile_cache.steady``, local:
    no collective); ``noisy`` collects ``"compute"`` when one stayed noisy.
    ``time_limit_s``: the batches are timed largest first, and once two are and this
    much time has passed, the rest are not (a line still fits two points)."""
    example_inputs = as_example_inputs(example_inputs)
    example_batch = example_inputs.batch_size()
    per_batch = {}
    started = time.perf_counter()
    for b in sorted(batches, reverse=True):
        if time_limit_s is not None and len(per_batch) >= 2 and time.perf_counter() - started > time_limit_s:
            log.info("compute timed at batches %s only: %.1f s of the %.1f s allowed are spent", sorted(per_batch),
                     time.perf_counter() - started, time_limit_s)
            break
        inputs = example_inputs if b == example_batch else example_inputs.with_batch(b)
        attempts = []

        def measure(inputs=inputs, attempts=attempts):
            totals = []
            attempts.append(time_units(model, inputs, desc, loss_fn, repeats, example_batch, totals))
            return totals

        kept = steady(measure, f"compute at batch {b}")
        per_batch[b] = attempts[kept.index]
        if kept.noisy and noisy is not None:
            noisy.add("compute")
        if progress:
            progress.step(f"compute at batch {b}")
    by_key: dict[str, list[str]] = {}
    for op in desc.ops:
        if shape_key(op) not in skip_keys:
            by_key.setdefault(shape_key(op), []).append(op.name)
    fits = {}
    for key, names in by_key.items():
        xs, yf, yb = [], [], []
        for b in per_batch:
            for name in names:
                xs.append(b)
                yf.append(per_batch[b][name][0])
                yb.append(per_batch[b][name][1])
        fi, fs = _fit_line(xs, yf)
        bi, bs = _fit_line(xs, yb)
        fits[key] = ComputeFit(fi, fs, bi, bs)
    return fits


def profile_split_efficiency(in_features: int, out_features: int, tokens: int, slices=(2, 4, 8, 16),
                             device=None, dtype=torch.float32, repeats: int = 5,
                             split_op: str = "linear_in_features", noisy: set | None = None) -> dict[str, float]:
    """Forward + backward time of a matmul split by ``split_op`` (a registered
    ``osdp.ops`` op; its own slice math and kernels: fp32 accumulate, slices as views)
    relative to the unsplit one, per slice count; ``noisy`` collects ``"split"`` when a
    timing stayed noisy after re-measures (``profile_cache.steady``)."""
    op = registered_split_ops()[split_op or "linear_in_features"]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x = torch.randn(tokens, in_features, device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, device=device, dtype=dtype)
    dy = torch.randn(tokens, out_features, device=device, dtype=dtype)
    axis = in_features if op.cut == "in" else out_features

    def unsplit():
        torch.nn.functional.linear(x, w)
        torch.mm(dy, w)
        torch.mm(dy.t(), x)

    def split(g):
        op.timed_step(x, w, dy, g)

    def timed(fn):
        kept = steady(lambda: timed_samples(fn, repeats, sync=lambda: _sync(device)), f"split timing of {split_op}")
        if kept.noisy and noisy is not None:
            noisy.add("split")
        return kept.median

    base = timed(unsplit)
    return {str(g): timed(lambda g=g: split(g)) / base for g in slices if g <= axis}


def matmul_flops_per_s(in_features: int, out_features: int, tokens: int, device, noisy: set | None = None,
                       dtype=torch.float32, repeats: int = 5) -> float:
    """FLOPs per second of one ``[tokens, in] @ [in, out]`` product on ``device`` (the
    median of ``repeats``, re-measured while noisy)."""
    x = torch.randn(tokens, in_features, device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, device=device, dtype=dtype)
    kept = steady(lambda: timed_samples(lambda: torch.nn.functional.linear(x, w), repeats,
                                        sync=lambda: _sync(device)), "matmul rate")
    if kept.noisy and noisy is not None:
        noisy.add("compute")
    return 2.0 * tokens * in_features * out_features / kept.median


# ---- cache and driver -----------------------------------------------------------------

def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{os.cpu_count()}cores"


def _cached(cache: ProfileCache, rank: int, process_group, distributed: bool, wanted) -> dict:
    """``{(section, key): value}`` of the ``wanted`` (section, key) pairs the cache holds,
    read on rank 0 and broadcast: every rank then measures the same things (an entry
    expiring between two ranks' reads would otherwise make them issue different
    collectives)."""
    found = None
    if rank == 0:
        found = {(section, key): v for section, key in wanted if (v := cache.get(section, key)) is not None}
    if distributed:
        box = [found]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                   group=process_group)
        found = box[0]
    return found


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: its parameters' device (the CPU without parameters); a
    model on meta, this process's GPU, else the CPU (where its values will be)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "meta":
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Profiled(NamedTuple):
    """What ``profile`` returns: the model, this cluster's hardware as measured, and the
    run it was measured under (``desc, cluster, run = osdp.profiler.profile(...)``)."""

    desc: ModelDesc
    cluster: ClusterProfile
    run: RunSettings

    @property
    def device(self) -> DeviceInfo:
        """The cost model's input for the measured run: ``cluster.for_run(run)``."""
        return self.cluster.for_run(self.run)


def profile(
    model: nn.Module,
    example_inputs,
    *,
    memory_limit=None,
    process_group=None,
    batches=None,
    loss_fn=None,
    comm_sizes=None,
    repeats: int = 3,
    cache_dir=None,
    use_cache: bool = True,
    reprofile: bool = False,
    progress: bool = True,
    compute_time_s: float | None = None,
    leaf_modules=None,
) -> Profiled:
    """Describe ``model`` and measure this cluster: ``(desc, cluster, run)``, see
    ``Profiled``. Every rank of ``process_group`` calls it (collectively); all get rank
    0's numbers. ``memory_limit``: the run's limit per device, a number of bytes (int or
    float) or a string with a unit ('8GiB', '16GB'; see osdp.sizes); default the GPU's
    total memory, required on CPU.

    ``example_inputs``: positional arguments (tuple), keyword arguments (dict, e.g.
    ``{"input_ids": x, "labels": y}`` for a Hugging Face model) or
    ``ExampleInputs(args, kwargs)``; ``loss_fn(output) -> scalar`` when the output is
    neither a tensor nor has a ``.loss``. describe and the compute timing run backward on
    the same loss; see [Note: example inputs and the loss] in ``osdp/planner/inputs.py``.

    ``cache_dir`` / ``use_cache`` / ``reprofile`` (or ``$OSDP_REPROFILE=1``): the
    profile cache, see [Note: profile cache] in ``osdp/planner/profile_cache.py``.
    ``compute_time_s``: how long the compute timing may go on once two batches are
    timed (auto mode's budget: [Note: planning budget]). ``leaf_modules``: modules that
    are one unit each, as the runtime will run them ([Note: leaf modules] in
    osdp/module_tree.py)."""
    inputs = as_example_inputs(example_inputs)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(process_group) if distributed else 1
    rank = dist.get_rank(process_group) if distributed else 0
    on_meta = next((p.is_meta for p in model.parameters()), False)  # [Note: compute of a model on meta]
    device = compute_device(model)
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        capacity_source = "torch.cuda.get_device_properties(...).total_memory"
    elif memory_limit is None:
        raise OSDPError("profile needs memory_limit on CPU (e.g. memory_limit='8GiB')")
    limit = parse_bytes(capacity if memory_limit is None else memory_limit, "memory_limit")
    if device.type != "cuda":  # a CPU device has no memory of its own to read: the run's limit stands in
        capacity, capacity_source = limit, "the memory_limit given to osdp.profile (CPU: no device memory to read)"
    desc = describe(model, inputs, loss_fn=loss_fn, leaf_modules=leaf_modules)
    dtype = str(next(model.parameters()).dtype)
    label = _device_label(device)
    backend = dist.get_backend(process_group) if distributed else "none"
    example_batch = inputs.batch_size()
    batches = tuple(batches or sorted({max(1, example_batch // 4), max(1, example_batch // 2), example_batch}))
    comm_sizes = tuple(comm_sizes or (FULL_COMM_SIZES if device.type == "cuda" else DEFAULT_COMM_SIZES))

    start_speed = speed_now(device, process_group) if use_cache else None
    cache = ProfileCache.open(cache_dir, enabled=use_cache and rank == 0, reprofile=reprofile,
                              speed=start_speed.flops_per_s if use_cache else None)
    compute_key = machine_key(device, dtype, backend)  # see [Note: profile cache]
    comm_key = f"{compute_key}|world={world}|{gradient_collective(torch.device(device).type)}"
    shape_keys = sorted({shape_key(op) for op in desc.ops})
    found = _cached(cache, rank, process_group, distributed,
                    [("comm", comm_key)] + [("compute", f"{compute_key}|{key}") for key in shape_keys])
    cached_fits = {key: ComputeFit(**found[("compute", f"{compute_key}|{key}")]) for key in shape_keys
                   if ("compute", f"{compute_key}|{key}") in found}
    if cache.stale_speeds:
        stamps = ", ".join(sorted({gflops(s) for s in cache.stale_speeds}))
        log.info("profile: %d cached measurements were taken with the reference matmul at %s, it runs at %s now: "
                 "measuring them again", len(cache.stale_speeds), stamps, gflops(start_speed.flops_per_s))
    todo_keys = set(shape_keys) - set(cached_fits)
    need_comm = world > 1 and ("comm", comm_key) not in found
    steps = (2 * len(comm_sizes) if need_comm else 0) + (len(batches) if todo_keys else 0) + 1
    bar = Progress(steps, "osdp profile", enabled=progress and rank == 0)
    noisy: set[str] = set()  # measurements that stayed noisy: used, not cached

    if need_comm:
        ag, rs = profile_collectives(process_group, comm_sizes, repeats, device, bar, noisy)
        comm = {"all_gather": ag.__dict__, "reduce_scatter": rs.__dict__}
    else:
        comm = found.get(("comm", comm_key), {"all_gather": {"alpha_s": 0.0, "beta_s_per_byte": 0.0},
                                             "reduce_scatter": {"alpha_s": 0.0, "beta_s_per_byte": 0.0}})
    fits = dict(cached_fits)
    if todo_keys and not on_meta:
        fits.update(profile_compute(model, inputs, desc, batches, loss_fn, repeats, set(cached_fits), bar, noisy,
                                    time_limit_s=compute_time_s))
    # split efficiency is a matmul's: ops split otherwise (an embedding's rows) are left out
    splittable = [op for op in desc.ops if op.splittable and op.param_count
                  and issubclass(registered_split_ops().get(op.split_op or "linear_in_features", MatmulSplit), MatmulSplit)]
    widest = max(splittable, key=lambda op: op.param_count, default=None)
    tokens = example_batch * max(1, round(widest.flops_per_sample / (2 * widest.param_count))) if widest else 0
    if widest:  # OpDesc.in_features is the length of the axis its split op cuts
        axis, other = widest.in_features, widest.param_count // widest.in_features
        k, n = (axis, other) if registered_split_ops()[widest.split_op or "linear_in_features"].cut == "in" else (other, axis)
    split_key = f"{compute_key}|{widest.split_op}|{k}x{n}x{tokens}" if widest else ""
    split = {}
    if widest:
        split = _cached(cache, rank, process_group, distributed, [("split", split_key)]).get(("split", split_key))
    split_measured = split is None
    if split_measured:
        split = profile_split_efficiency(k, n, tokens, device=device, split_op=widest.split_op, noisy=noisy)
    bar.step("split efficiency")

    total_flops = sum(op.flops_per_sample for op in desc.ops)
    if on_meta:  # no unit timed: every op at the widest matmul's rate
        fits = {}
        slope = total_flops / matmul_flops_per_s(k, n, tokens, device, noisy) if widest else 0.0
    else:
        slope = sum(fits[shape_key(op)].fwd_per_sample_s for op in desc.ops)
    measured = {
        "name": f"{world}x {label} ({backend})",
        "node_size": world,
        "device_memory_bytes": capacity,
        "links": {"intra": {"all_gather": comm["all_gather"], "reduce_scatter": comm["reduce_scatter"],
                            # on gloo the gradient collective timed is an all-reduce: say so
                            # (replicated units' all-reduce is priced from it, [Note:
                            # replicated units] in osdp/contract.py)
                            **({"all_reduce": comm["reduce_scatter"]}
                               if gradient_collective(torch.device(device).type) == "all_reduce" else {})}},
        "flops_per_s": total_flops / slope if slope > 0 and total_flops > 0 else 1e12,
        "op_overhead_s": (statistics.median([f.fwd_intercept_s for f in fits.values()]) if fits
                          else DeviceInfo.op_overhead_s),
        "slice_overhead_s": 0.0,  # measured as split_efficiency instead
        "split_efficiency": split,
        "op_compute": {k: v.__dict__ for k, v in fits.items()},
        "sources": {
            "measured": f"osdp.profile on {label}, {dtype}, {backend}, world size {world}",
            "node_size": "the ranks of the measured process group (one link level over all of them)",
            "device_memory_bytes": capacity_source,
        },
    }
    end_speed = speed_now(device, process_group) if use_cache else None
    if distributed:  # identical inputs on every rank: rank 0's measurement
        box = [measured]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group)
        measured = box[0]
    # rank 0's numbers, as broadcast; noisy ones are not kept, nor any when the machine's speed changed
    if rank == 0 and use_cache and steady_speed(start_speed, end_speed, "profiling"):
        cache.speed = min(start_speed.flops_per_s, end_speed.flops_per_s)  # the entries' stamp
        if need_comm and "comm" not in noisy:
            cache.put("comm", comm_key, dict(measured["links"]["intra"]))
        if "compute" not in noisy and not on_meta:
            for key in todo_keys:
                cache.put("compute", f"{compute_key}|{key}", measured["op_compute"][key])
        if split_measured and "split" not in noisy:
            cache.put("split", split_key, measured["split_efficiency"])
        cache.save()
    return Profiled(desc, ClusterProfile.from_dict(measured, where="measured profile"), RunSettings(world, limit))

