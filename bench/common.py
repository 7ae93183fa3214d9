"""Shared pieces of the training benchmarks: spawning gloo/NCCL ranks, the peers
(OSDP, FSDP2 ZeRO-3 and ZeRO-2, DDP), one training step, and measured peak memory."""
from __future__ import annotations

import contextlib
import csv
import math
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
import osdp  # noqa: E402
from osdp.memtrack import LiveBytesTracker, cpu_own_peak, cuda_own_peak, resident_tensors  # noqa: E402
from osdp.models import GPT, GPTConfig, example_batch  # noqa: E402
from osdp.rank_agreement import max_over_ranks  # noqa: E402

PEERS = ("osdp", "fsdp_zero3", "fsdp_zero2", "ddp", "osdp_ckpt", "fsdp_zero3_ckpt")


def write_csv(path, rows: list[dict]) -> None:
    """``rows`` (dicts with the same keys) as a CSV at ``path``, its folder made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def device_for(rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class HFWorkload:
    """A stock Hugging Face LM as a bench's model (``config`` of the functions below is a
    ``GPTConfig`` of osdp's GPT, or one of these): tokens of ``seq_len``, the model's own
    loss (``model(input_ids=x, labels=x).loss``, the output held through backward), the
    layers under ``block_lists`` (module paths of ModuleLists) as the blocks FSDP2 shards
    and checkpoints. ``leaves``: transformers classes OSDP runs as leaf modules ([Note:
    leaf modules] in osdp/module_tree.py), whose submodules run depending on the data
    (DDP then looks for unused parameters)."""

    def __init__(self, model_class: str, config_class: str, seq_len: int, block_lists=("model.layers",),
                 leaves=(), **config):
        self.model_class, self.config_class, self.seq_len, self.config = model_class, config_class, seq_len, config
        self.block_lists, self.leaves = tuple(block_lists), tuple(leaves)

    def build(self) -> torch.nn.Module:
        with _without_bench_dir():
            import transformers

            transformers.logging.set_verbosity_error()
            config = getattr(transformers, self.config_class)(**self.config)
            return getattr(transformers, self.model_class)(config)

    def blocks(self, model) -> list[torch.nn.Module]:
        return [block for path in self.block_lists for block in model.get_submodule(path)]

    def leaf_classes(self) -> tuple[type, ...]:
        with _without_bench_dir():
            import transformers

            return tuple(getattr(transformers, name) for name in self.leaves)

    def tokens(self, batch: int, seed: int, device=None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config["vocab_size"], (batch, self.seq_len), generator=gen).to(device)

    def forward(self, model, batch: int, seed: int, device=None):
        """The model's output (a ``ModelOutput``); its ``.loss`` is the training loss.
        A training loop holds the output through backward (``out = model(**batch);
        out.loss.backward()``), and so does ``train_step``: the logits stay live, as OSDP's
        planner prices them ([Note: example inputs and the loss] in osdp/planner/inputs.py)."""
        x = self.tokens(batch, seed, device)
        return model(input_ids=x, labels=x)


@contextlib.contextmanager
def _without_bench_dir():
    """transformers looks for the ``kernels`` package (Hugging Face's kernel hub) as it
    imports and builds models, and bench/kernels.py, on sys.path while a bench runs,
    would be found in its place (it parses the command line as it is imported)."""
    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        yield
    finally:
        sys.path[:] = saved


def _build(config):
    """osdp's GPT of a GPTConfig, or an HFWorkload's model, and its blocks."""
    model = GPT(config) if isinstance(config, GPTConfig) else config.build()
    return model, (model.blocks if isinstance(config, GPTConfig) else config.blocks(model))


def wrap_peer(peer: str, config: GPTConfig | HFWorkload, plan=None, checkpoint: bool = False,
              compile: dict | None = None):
    """A fresh model (same seed everywhere) wrapped as ``peer``; returns the module.
    ``compile``: ``torch.compile`` keyword arguments (``backend``, ``mode``, ``dynamic``,
    ``fullgraph``; OSDP's ``scope`` too) for the compiled peers: OSDP's ``compile=`` as
    given (``CompileConfig``'s default scope unless it names one), FSDP2's blocks each
    ``.compile()``-d after ``fully_shard`` (torchtitan's per-block compile; FSDP2's
    hooks stay eager around each block's graph)."""
    device = device_for(dist.get_rank())
    torch.manual_seed(0)
    model, blocks = _build(config)
    if peer == "osdp":
        import osdp

        leaves = config.leaf_classes() if isinstance(config, HFWorkload) and config.leaves else None
        return osdp.OSDP(model, plan=plan, device=device, compile=compile, leaf_modules=leaves)
    model = model.to(device)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: type(m) is type(blocks[0]))
    if peer in ("fsdp_zero3", "fsdp_zero2"):
        from torch.distributed.fsdp import fully_shard

        reshard = peer == "fsdp_zero3"
        for block in blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        if compile is not None:
            for block in blocks:
                block.compile(**compile)
        return model
    if compile is not None:
        raise ValueError(f"compile= is for osdp, fsdp_zero3 and fsdp_zero2, not {peer!r}")
    if peer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        unused = isinstance(config, HFWorkload) and bool(config.leaves)  # experts no token reached
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       find_unused_parameters=unused)
    raise ValueError(f"unknown peer {peer!r}; one of {PEERS}")


def train_step(model, optim, config, batch: int, seed: int) -> float:
    device = device_for(dist.get_rank())
    if isinstance(config, GPTConfig):
        loss = model(*example_batch(config, batch, seed=seed, device=device))
    else:
        out = config.forward(model, batch, seed, device)  # held through backward, as loops do
        loss = out.loss
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def allocator_peak_bytes(model, optim, config, batch: int) -> int:
    """Peak bytes of one training step by the allocator (its own reports to the profiler
    on CPU, [Note: CPU allocator peak] in osdp/memtrack.py; ``max_memory_allocated`` on
    CUDA), eager or compiled alike, max over ranks: the one measure that compares a
    compiled step's memory with an eager one's."""
    resident = resident_tensors(model, optim, grads=True)
    if torch.cuda.is_available():
        _, peak = cuda_own_peak(torch.cuda.current_device(), resident,
                                lambda: train_step(model, optim, config, batch, seed=2))
    else:
        _, peak = cpu_own_peak(resident, lambda: train_step(model, optim, config, batch, seed=2))
    return int(max_over_ranks(float(peak)))


def measured_peak_bytes(model, optim, config, batch: int, warm_up: bool = True, compiled: bool = False) -> int:
    """Peak bytes of one steady-state training step (after a warm-up step that creates
    the optimizer state; ``warm_up=False`` when an earlier step of this model and
    optimizer did), max over ranks: allocator peak on CUDA, live tensors on CPU.

    The allocator's peak is device-wide, and a bench keeps several peers (and auto
    mode's leftovers) alive in one process: on CUDA what other tensors held before the
    step is taken off (``osdp.memtrack.cuda_own_peak``, as the plan measurer does; the
    H200 run of bench/compile.py measured 153.5 MiB for a plan made for 80.9 MiB, with
    auto mode's trials run before it in the process: the likely cause, not verified).
    As on CPU, this peer's state is what its parameters, buffers and optimizer reach; a
    wrapper's own persistent buffers beside them are not counted (unverified on a GPU).
    ``compiled``: the model runs compiled code, which only the allocator sees on CPU."""
    if warm_up:
        train_step(model, optim, config, batch, seed=1)
    if torch.cuda.is_available():
        _, peak = cuda_own_peak(torch.cuda.current_device(), resident_tensors(model, optim),
                                lambda: train_step(model, optim, config, batch, seed=2))
    elif compiled and not isinstance(model, osdp.OSDP):
        # compiled code allocates beneath the dispatcher, where the live-tensor tracker
        # cannot see: the allocator's reports ([Note: CPU allocator peak] in osdp/memtrack.py;
        # a compiled OSDP model's measuring_memory reads them too)
        _, peak = cpu_own_peak(resident_tensors(model, optim, grads=True),
                               lambda: train_step(model, optim, config, batch, seed=2))
    elif isinstance(model, osdp.OSDP):
        # the runtime's incremental tracker: the same bytes as LiveBytesTracker (tests/
        # runtime/test_peak.py), at about 1.2x a step instead of about 4x
        with model.measuring_memory(optim) as measured:
            train_step(model, optim, config, batch, seed=2)
        peak = measured[0].peak_bytes
    else:
        with LiveBytesTracker(resident_tensors(model, optim)) as tracker:
            train_step(model, optim, config, batch, seed=2)
        peak = tracker.peak_bytes
    return int(max_over_ranks(float(peak)))


def median_step_s(model, optim, config, batch: int, steps: int, warm_up: bool = True) -> float:
    """Median wall time of ``steps`` training steps (after one warm-up; ``warm_up=False``
    when the model and optimizer just stepped at ``batch``), max over ranks."""
    return interleaved_step_s([(model, optim, batch)], config, steps, warm_up=warm_up)[0]


def interleaved_step_s(runs, config, rounds: int, warm_up: bool = True) -> list[float]:
    """Median wall time of one training step for each ``(model, optimizer, batch)`` in
    ``runs`` (one warm-up each unless ``warm_up=False``), their steps interleaved
    (``timed_rounds``)."""
    for model, optim, batch in runs if warm_up else ():
        train_step(model, optim, config, batch, seed=0)
    return timed_rounds([lambda r, m=model, o=optim, b=batch: train_step(m, o, config, b, seed=10 + r)
                         for model, optim, batch in runs], rounds)


def timed_rounds(fns, rounds: int) -> list[float]:
    """Median wall time of each ``fn(round)`` in ``fns``, called in rounds, interleaved
    (fn 1, fn 2, ..., then from fn 2: none always follows the same one) so that a load
    that drifts slows them alike: their ratios are taken in one run. Every call starts
    at a barrier and is timed to the device's completion. Max over ranks of each median."""
    times = [[] for _ in fns]
    for r in range(rounds):
        for i in [(j + r) % len(fns) for j in range(len(fns))]:
            dist.barrier()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fns[i](r)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - start)
    return max_over_ranks([statistics.median(x) for x in times])


def osdp_at_plan(peer: str, config, plan, start: float):
    """OSDP run with ``plan`` (auto mode's, at a budget; None: no plan fits) as ``peer``,
    at the plan's batch: its row (``peer``, ``batch``, ``peak_bytes`` measured,
    ``predicted_samples_per_s``, ``bench_s`` since ``start``), model and optimizer; no
    model without a plan."""
    if plan is None:
        return dict(peer=peer, batch=0, peak_bytes=0, step_s=0.0, samples_per_s=0.0), None, None
    model = wrap_peer("osdp", config, plan=plan)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = measured_peak_bytes(model, optim, config, plan.batch_size)
    return dict(peer=peer, batch=plan.batch_size, peak_bytes=peak, predicted_samples_per_s=plan.predicted.samples_per_s,
                bench_s=time.perf_counter() - start), model, optim


def peer_at_largest_batch(peer: str, config, budget_bytes: int):
    """A peer other than OSDP (``_ckpt``: checkpointing every block) at the largest batch
    whose measured peak fits ``budget_bytes``: its row (``peer``, ``batch``,
    ``peak_bytes``, ``bench_s``), model and optimizer; no model when no batch fits."""
    start = time.perf_counter()
    base, checkpoint = peer.removesuffix("_ckpt"), peer.endswith("_ckpt")
    batch, peak = largest_fitting_batch(base, config, budget_bytes, checkpoint=checkpoint)
    if batch == 0:
        return dict(peer=peer, batch=0, peak_bytes=peak, step_s=0.0, samples_per_s=0.0), None, None
    model = wrap_peer(base, config, checkpoint=checkpoint)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return dict(peer=peer, batch=batch, peak_bytes=peak, bench_s=time.perf_counter() - start), model, optim


def time_interleaved(runs, config, steps: int, world: int) -> None:
    """``runs``: (row, model, optimizer) of every peer that fits; their steps timed
    interleaved (``interleaved_step_s``: the ratios are taken in one run, so a load that
    drifts over the minutes the batch searches took slows them alike), each row given
    its ``step_s`` and ``samples_per_s``."""
    step_times = interleaved_step_s([(m, o, r["batch"]) for r, m, o in runs], config, steps)
    for (row, _, _), step_s in zip(runs, step_times):
        row.update(step_s=step_s, samples_per_s=row["batch"] * world / step_s)


def largest_fitting_batch(peer, config, budget_bytes, max_batch=256, checkpoint=False):
    """The largest batch whose measured peak fits ``budget_bytes`` for a peer (see
    :func:`largest_fitting_batch_of`)."""
    model = wrap_peer(peer, config, checkpoint=checkpoint)
    return largest_fitting_batch_of(model, config, budget_bytes, max_batch)


def largest_fitting_batch_of(model, config, budget_bytes, max_batch=256, optim=None, peaks=None):
    """The largest batch whose measured peak fits ``budget_bytes``, with its peak; (0,
    peak at 1) if none. One measured step per probe (plus one warm-up step in all). The
    peak grows about linearly with the batch (activations), so the next probe is the
    secant's guess through the last two measurements, and the answer is only taken once
    ``b`` fits and ``b + 1`` was measured not to (or ``b`` is ``max_batch``): exact like
    bisection, in about half the probes (4-6 instead of 8-10 between 1 and 32).
    ``optim`` and ``peaks`` (batch -> measured peak) carry over between calls for the
    same model: a second budget reuses the first one's probes."""
    optim = optim if optim is not None else torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = peaks if peaks is not None else {}

    def peak(b):
        if b not in peaks:
            peaks[b] = measured_peak_bytes(model, optim, config, b, warm_up=not optim.state)
        return peaks[b]

    if peak(1) > budget_bytes:
        return 0, peaks[1]
    lo, hi = 1, None  # lo fits; hi (when known) does not
    last = (1, peaks[1])
    guess = 2
    while hi is None or hi - lo > 1:
        guess = min(max(guess, lo + 1), max_batch if hi is None else hi - 1)
        if guess <= lo:  # lo is max_batch
            break
        fits = peak(guess) <= budget_bytes
        if fits:
            lo = guess
        else:
            hi = guess
        (b0, p0), last = last, (guess, peaks[guess])
        slope = (peaks[guess] - p0) / (guess - b0) if guess != b0 else 0.0
        if slope > 0:
            guess = guess + math.floor((budget_bytes - peaks[guess]) / slope)
            # the secant can stall next to the boundary: probe the neighbour instead
            guess = guess if guess not in peaks else (lo + 1 if hi is None or guess < lo else (lo + hi) // 2)
        else:
            guess = lo * 2 if hi is None else (lo + hi) // 2
    return lo, peaks[lo]
