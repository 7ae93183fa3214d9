"""The CUDA path (comm streams, events, NCCL) on one GPU: OSDP training vs the same
model trained plainly on the GPU. Skipped without CUDA (see tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from . import parity_cases as pc
from .dist_harness import free_port


def _train(rank, world_size, port):
    import os

    import torch.distributed as dist

    import osdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        results = {}
        for name in ("all_zdp", "split_mixed", "checkpoint_split"):
            case = next(c for c in pc.CASES if c.name == name)
            ref = pc.make_model(case.model).to(device)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=pc.LR, eps=pc.EPS)
            model = pc.make_model(case.model)
            wrapped = osdp.OSDP(model, device=device, **case.kwargs(model))
            opt = torch.optim.AdamW(wrapped.parameters(), lr=pc.LR, eps=pc.EPS)
            losses, ref_losses = [], []
            for step in range(5):
                batch = tuple(t.to(device) for t in pc.global_batch(case.model, step, 1))
                for m, o, out in ((wrapped, opt, losses), (ref, ref_opt, ref_losses)):
                    loss = m(*batch)
                    loss.backward()
                    o.step()
                    o.zero_grad()
                    out.append(loss.item())
            stats = wrapped.memory_stats()
            results[name] = (losses, ref_losses, stats["cuda_max_memory_allocated"], stats["current_gathered_bytes"])
        return results
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_cuda_streams_path_matches_plain_training():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        results = pool.apply(_train, (0, 1, free_port()))
    for name, (losses, ref_losses, max_alloc, current) in results.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5, msg=name)
        assert max_alloc > 0 and current == 0, name


def _measure_on(backend, port):
    """measure_plans on one rank of ``backend``: on NCCL its per-rank rows travel in a
    tensor on the GPU (NCCL has no CPU tensors; the first GPU run failed there,
    bench/results/gpu_20261127)."""
    import os

    import torch.distributed as dist

    from osdp.models import GPT, GPTConfig, example_batch
    from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster
    from osdp.planner.cost_model import PlannerSettings
    from osdp.planner.description import describe
    from osdp.planner.run import RunSettings
    from osdp.planner.uniform_plan import uniform_plan
    from osdp.profiler.plans import measure_plans
    from osdp.rank_agreement import collective_device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden=32, heads=2)
        module, inputs = GPT(config), example_batch(config, 2)
        cluster = load_cluster(DEFAULT_CLUSTER).for_run(RunSettings(world_size=1, memory_limit_bytes=64 << 20))
        plan = uniform_plan(describe(module, inputs), cluster, PlannerSettings(), 2, slices=1, zdp_slices=1)
        (measured,) = measure_plans(module, [plan], inputs, device=device, steps=2, warmup=2, group_times=False)
        return str(collective_device()), measured.step_s, measured.peak_bytes
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_measure_plans_on_nccl():
    import torch.multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        where, step_s, peak = pool.apply(_measure_on, ("nccl", free_port()))
    assert where == "cuda:0" and step_s > 0 and peak > 0
