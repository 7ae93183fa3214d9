"""``osdp demo``: plan and train a small GPT on this machine with local gloo processes.

Profiles this machine, plans for the most samples per second within the memory limit
(per process), trains with the plan and prints measured against predicted: loss per
step, samples/s, peak memory (live-tensor tracking on CPU, the allocator on CUDA).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..sizes import format_bytes

DEMO_COMM_SIZES = (4096, 65536, 1 << 20, 4 << 20)  # enough for a model of a few MiB


def _say(rank: int, text: str = "") -> None:
    if rank == 0:
        print(text, flush=True)


def train_with_plan(rank, world, preset, memory, steps, cache_dir, quiet=False, reprofile=False):
    """One rank of the demo; returns a dict of what it measured (rank 0's is printed)."""
    import osdp
    from osdp.memtrack import LiveBytesTracker
    from osdp.models import GPT, example_batch, get_preset
    from osdp.models.gpt import counting_batch
    from osdp.planner.calibration import format_report
    from osdp.planner.cost_model import PlannerSettings

    say = (lambda *_: None) if quiet else (lambda text="": _say(rank, text))
    torch.manual_seed(0)
    config = get_preset(preset)
    model = GPT(config)
    say(f"== osdp demo: GPT preset {preset!r} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
        f"{world} gloo processes, {memory} per process")
    from osdp.planner.profile_cache import cache_path, reprofile_requested

    fresh = reprofile_requested(reprofile)
    how = "measuring again (--reprofile / OSDP_REPROFILE=1)" if fresh else "cached after the first run"
    say(f"-- profiling this machine and planning ({how}; cache {cache_path(cache_dir)})")
    plan = osdp.auto_plan(
        model, example_batch(config, 4), memory,
        settings=PlannerSettings(max_slices=4, checkpointing="auto"),
        comm_sizes=DEMO_COMM_SIZES, repeats=2, cache_dir=cache_dir, progress=not quiet, reprofile=reprofile,
    )
    say(str(plan))
    wrapped = osdp.OSDP(model, plan=plan)
    optim = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    batch = plan.batch_size  # the plan's batch: the memory prediction holds only for it
    say(f"\n-- training {steps} steps at batch {batch}/process (global {batch * world}); "
        "the data is learnable (each next token = previous + 1), so the loss falls")
    losses, step_s = [], []

    def train_step(step):
        idx, targets = counting_batch(config, batch, seed=1000 * step + rank)
        dist.barrier()
        start = time.perf_counter()
        loss = wrapped(idx, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        say(f"step {step:3d}  loss {losses[-1]:.4f}  {step_s[-1] * 1e3:8.1f} ms")

    for step in range(steps - 1):
        train_step(step)
    # the last step runs under the live-tensor tracker (it slows the step down, so it
    # is not timed): parameters, optimizer state and everything the step allocates
    state = [t for st in optim.state.values() for t in st.values() if torch.is_tensor(t)]
    with LiveBytesTracker(list(wrapped.parameters()) + state) as tracker:
        train_step(steps - 1)
    step_s.pop()
    ledger = wrapped.memory_stats()
    measured_s = statistics.median(step_s[1:] or step_s) if step_s else float("nan")
    peak = tracker.peak_bytes
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    p = plan.predicted
    say("\n-- measured vs predicted (median step time after the first; peak of the last step)")
    say(f"step time     {measured_s * 1e3:9.1f} ms   predicted {p.step_s * 1e3:9.1f} ms")
    say(f"samples/s     {batch * world / measured_s:9.1f}      predicted {p.samples_per_s:9.1f}")
    say(f"peak memory   {format_bytes(peak):>12}  predicted {format_bytes(p.peak_bytes):>12} "
        f"(limit {format_bytes(plan.memory_limit_bytes)})")
    say(f"OSDP buffers  {format_bytes(ledger['peak_total_bytes']):>12} peak of gathered weights + unsharded grads")
    checked = wrapped.step_memory()
    if checked is not None:
        say(f"memory check  every step within the limit; the last step peaked at {format_bytes(checked.peak_bytes)} "
            f"{checked.where} ({checked.source})")
    if plan.measured:
        say("\n-- auto mode's calibration (model.report(): predicted vs measured before training)")
        say(format_report(plan))
    return {"losses": losses, "step_s": measured_s, "peak_bytes": peak, "plan": plan.to_dict()}


def _demo_rank(rank, world, preset, memory, steps, cache_dir, reprofile=False):
    train_with_plan(rank, world, preset, memory, steps, cache_dir, reprofile=reprofile)


def run_demo(args) -> int:
    from ..errors import OSDPError
    from ..models import get_preset
    from ..sizes import parse_bytes

    get_preset(args.preset)  # fail fast, in this process, on a bad name
    parse_bytes(args.memory, "--memory")
    if args.world_size < 1 or args.steps < 1:
        raise OSDPError("--world-size and --steps must be positive integers")
    from ..launch import spawn

    try:
        spawn(_demo_rank, args.world_size, args.preset, args.memory, args.steps, None,
              bool(getattr(args, "reprofile", False)), backend="gloo")
    except RuntimeError as exc:
        # the worker's own error, one line (e.g. no plan fits the memory limit)
        last = str(exc).strip().splitlines()[-1]
        raise OSDPError(f"demo failed: {last}") from None
    return 0
