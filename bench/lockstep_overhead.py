"""What the lockstep check costs a step (osdp/runtime/lockstep_check.py, [Note: lockstep check]).

Two ranks on gloo (real collectives), two copies of a GPT preset wrapped alike, one with
``lockstep_check=True`` and one with ``False``; their steps alternate, so machine noise
hits both alike. Prints rank 0's median step of each and the median of the per-pair
ratios (checked / unchecked); a step is forward, backward and AdamW.

    python bench/lockstep_overhead.py --preset tiny --steps 30
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import osdp  # noqa: E402
from osdp.launch import spawn  # noqa: E402
from osdp.models import GPT, example_batch, get_preset  # noqa: E402


def run(rank: int, world: int, preset: str, steps: int, batch: int, mode: str) -> dict:
    torch.set_num_threads(1)
    config = get_preset(preset)
    models, optims = {}, {}
    for check in (True, False):
        torch.manual_seed(0)
        models[check] = osdp.OSDP(GPT(config), default_mode=mode, lockstep_check=check)
        optims[check] = torch.optim.AdamW(models[check].parameters(), lr=1e-4)
    times = {True: [], False: []}
    for step in range(steps + 2):  # the first two: warm-up (the order is recorded in the first)
        for check in ((True, False) if step % 2 else (False, True)):
            idx, targets = example_batch(config, batch, seed=step * world + rank)
            start = time.perf_counter()
            models[check](idx, targets).backward()
            optims[check].step()
            optims[check].zero_grad()
            if step >= 2:
                times[check].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--mode", default="zdp", choices=("zdp", "dp"))
    args = parser.parse_args()
    times = spawn(run, 2, args.preset, args.steps, args.batch, args.mode)[0]
    on, off = times[True], times[False]
    ratios = [a / b for a, b in zip(on, off)]
    print(f"preset {args.preset}, batch {args.batch}, {args.mode}, 2 gloo ranks, {len(on)} step pairs (rank 0)")
    print(f"  lockstep check on : median step {statistics.median(on) * 1e3:8.2f} ms")
    print(f"  lockstep check off: median step {statistics.median(off) * 1e3:8.2f} ms")
    print(f"  median ratio on/off: {statistics.median(ratios):.3f}  "
          f"(median difference {statistics.median(a - b for a, b in zip(on, off)) * 1e3:+.2f} ms)")


if __name__ == "__main__":
    main()
