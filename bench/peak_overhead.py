"""What the per-step peak check costs on CPU (osdp/runtime/peak.py, [Note: measured peak]).

Two copies of a GPT preset wrapped with the same plan on a fake process group of
``--world-size`` ranks (torch.testing._internal.distributed.fake_pg: real compute, no
communication), one with ``memory_check=True`` and one with ``False``; their steps
alternate, so machine noise hits both alike. Prints the median step of each, the median
of the per-pair ratios, and the cost per operator the tracker saw.

    python bench/peak_overhead.py --preset small --steps 20
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import osdp  # noqa: E402
from osdp.models import GPT, example_batch, get_preset  # noqa: E402
from osdp.planner import make_plan  # noqa: E402
from osdp.planner.cluster import DEFAULT_CLUSTER, load_cluster  # noqa: E402
from osdp.planner.cost_model import PlannerSettings  # noqa: E402
from osdp.planner.description import describe  # noqa: E402
from osdp.planner.run import RunSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--memory-mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    config = get_preset(args.preset)
    torch.manual_seed(0)
    desc = describe(GPT(config), example_batch(config, 2))
    device = load_cluster(DEFAULT_CLUSTER).with_(constant_bytes=0).for_run(
        RunSettings(world_size=args.world_size, memory_limit_bytes=args.memory_mib << 20))
    plan = make_plan(desc, device, PlannerSettings(max_slices=4))
    models, optims = {}, {}
    for check in (True, False):
        torch.manual_seed(0)
        models[check] = osdp.OSDP(GPT(config), plan=plan, memory_check=check)
        optims[check] = torch.optim.AdamW(models[check].parameters(), lr=1e-4)
    times = {True: [], False: []}

    def step(check, seed):
        idx, targets = example_batch(config, plan.batch_size, seed=seed)
        start = time.perf_counter()
        models[check](idx, targets).backward()
        optims[check].step()
        optims[check].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for check in (True, False):
        step(check, 0)  # warm-up: optimizer state
    for s in range(args.steps):
        order = (True, False) if s % 2 == 0 else (False, True)
        for check in order:
            times[check].append(step(check, s + 1))
    ratios = [a / b for a, b in zip(times[True], times[False])]
    on, off = statistics.median(times[True]), statistics.median(times[False])
    measured = models[True].step_memory()
    per_op_us = (on - off) / max(measured.operators, 1) * 1e6
    print(f"{args.preset}, fake group of {args.world_size}, batch {plan.batch_size}, {args.steps} alternating steps, "
          f"{args.threads} thread(s)")
    print(f"step with the check   {on * 1e3:8.2f} ms (median)")
    print(f"step without          {off * 1e3:8.2f} ms (median)")
    print(f"ratio                 {statistics.median(ratios):8.3f} (median of per-pair ratios)")
    print(f"operators per step    {measured.operators:8d}  -> {per_op_us:.1f} us per operator")
    print(f"measured peak {measured.peak_bytes} B {measured.where}; predicted {plan.predicted.peak_bytes:.0f} B "
          f"({measured.prediction_error:+.2%}); limit {plan.memory_limit_bytes:.0f} B")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
