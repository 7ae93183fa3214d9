"""Shared pieces of the training benchmarks: spawning gloo/NCCL ranks, the peers
(OSDP, FSDP2 ZeRO-3 and ZeRO-2, DDP), one training step, and measured peak memory."""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from osdp.launch import spawn  # noqa: E402,F401  (re-exported for the scripts)

# The benches measure peaks themselves (measured_peak_bytes) and record a plan over its
# budget instead of stopping at it; the per-step check (osdp/runtime/peak.py) would also
# add its CPU tracking cost (~1.23x, bench/peak_overhead.py) to every timed OSDP step and
# to none of FSDP2's. Spawned workers inherit this.
os.environ.setdefault("OSDP_MEMORY_CHECK", "0")
from osdp.memtrack import LiveBytesTracker  # noqa: E402
from osdp.models import GPT, GPTConfig, example_batch  # noqa: E402

PEERS = ("osdp", "fsdp_zero3", "fsdp_zero2", "ddp", "osdp_ckpt", "fsdp_zero3_ckpt")


def device_for(rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap_peer(peer: str, config: GPTConfig, plan=None, checkpoint: bool = False):
    """A fresh model (same seed everywhere) wrapped as ``peer``; returns the module."""
    device = device_for(dist.get_rank())
    torch.manual_seed(0)
    model = GPT(config)
    if peer == "osdp":
        import osdp

        return osdp.OSDP(model, plan=plan, device=device)
    model = model.to(device)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__ == "Block")
    if peer in ("fsdp_zero3", "fsdp_zero2"):
        from torch.distributed.fsdp import fully_shard

        reshard = peer == "fsdp_zero3"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return model
    if peer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    raise ValueError(f"unknown peer {peer!r}; one of {PEERS}")


def train_step(model, optim, config, batch: int, seed: int) -> float:
    device = device_for(dist.get_rank())
    idx, targets = example_batch(config, batch, seed=seed, device=device)
    loss = model(idx, targets)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _state_tensors(model, optim):
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for st in optim.state.values() for t in st.values() if torch.is_tensor(t)]
    return tensors


def measured_peak_bytes(model, optim, config, batch: int) -> int:
    """Peak bytes of one steady-state training step (after a warm-up step that creates
    the optimizer state), max over ranks: allocator peak on CUDA, live tensors on CPU."""
    train_step(model, optim, config, batch, seed=1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_step(model, optim, config, batch, seed=2)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        with LiveBytesTracker(_state_tensors(model, optim)) as tracker:
            train_step(model, optim, config, batch, seed=2)
        peak = tracker.peak_bytes
    t = torch.tensor([float(peak)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def median_step_s(model, optim, config, batch: int, steps: int) -> float:
    """Median wall time of ``steps`` training steps (after one warm-up), max over ranks."""
    train_step(model, optim, config, batch, seed=0)
    times = []
    for s in range(steps):
        dist.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, optim, config, batch, seed=10 + s)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def largest_fitting_batch(peer, config, budget_bytes, max_batch=256, checkpoint=False):
    """The largest batch whose measured peak fits ``budget_bytes`` for a peer (see
    :func:`largest_fitting_batch_of`)."""
    model = wrap_peer(peer, config, checkpoint=checkpoint)
    return largest_fitting_batch_of(model, config, budget_bytes, max_batch)


def largest_fitting_batch_of(model, config, budget_bytes, max_batch=256):
    """The largest batch whose measured peak fits ``budget_bytes`` (doubling, then
    bisection; one measured step per probe), with its peak; (0, peak at 1) if none."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = {}

    def fits(b):
        peaks[b] = measured_peak_bytes(model, optim, config, b)
        return peaks[b] <= budget_bytes

    if not fits(1):
        return 0, peaks[1]
    lo, hi = 1, None
    while hi is None and lo < max_batch:
        nxt = min(lo * 2, max_batch)
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, peaks[lo]
