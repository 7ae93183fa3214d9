"""Planner benchmark: search time against model size, C++ core vs Python reference.

    python bench/planner.py                 # 12..192 layers at hidden 12288, full batch sweep
    python bench/planner.py --quick         # fewer sizes, fewer repeats

For GPT models of 12 to 192 layers at hidden 12288 (seq 2048, the GPT-3 shape) on the
8xH100 profile scaled to 256 ranks at 80 GiB (so that 192 layers fit), splitting up to 16 and per-block
checkpointing, it times the whole plan (template, feasibility probes, batch sweep) with
each search backend and prints medians and the C++/Python speed ratio. Writes
bench/results/planner.csv.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from osdp.models import GPTConfig  # noqa: E402
from osdp.planner.cluster import load_cluster  # noqa: E402
from osdp.planner.cost_model import PlannerSettings  # noqa: E402
from osdp.planner.gpt_desc import describe_gpt  # noqa: E402
from osdp.planner.run import RunSettings  # noqa: E402
from osdp.planner.scheduler import schedule  # noqa: E402


def time_plan(desc, device, settings, backend, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = schedule(desc, device, settings, backend=backend)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--world-size", type=int, default=256)
    parser.add_argument("--memory-gib", type=float, default=80)
    parser.add_argument("--python-max-layers", type=int, default=96, help="skip the slow reference above this")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner.csv"))
    args = parser.parse_args(argv)

    layers = [12, 48, 96] if args.quick else [12, 24, 48, 96, 144, 192]
    repeats = 1 if args.quick else 3
    run = RunSettings(world_size=args.world_size, memory_limit_bytes=args.memory_gib * 2**30)
    device = load_cluster("h100-nvlink").for_run(run)  # one link level: see [Note: link levels]
    settings = PlannerSettings(max_slices=16, checkpointing="auto")
    rows = []
    print(f"hidden {args.hidden}, seq 2048, {device.name} scaled to {args.world_size} ranks at {args.memory_gib:g} GiB, "
          f"max 16 slices, per-block checkpointing, full batch sweep; median of {repeats}")
    print(f"{'layers':>6} {'ops':>5} {'batch':>5} {'searches':>8} {'cpp s':>8} {'python s':>9} {'py/cpp':>7}")
    for n in layers:
        desc = describe_gpt(GPTConfig(vocab_size=50257, seq_len=2048, num_layers=n, hidden=args.hidden, heads=96))
        cpp_s, res = time_plan(desc, device, settings, "cpp", repeats)
        py_s = None
        if n <= args.python_max_layers:
            py_s, py_res = time_plan(desc, device, settings, "python", 1)
            assert py_res.batch == res.batch and py_res.result.time_s == res.result.time_s, "backends disagree"
        ratio = f"{py_s / cpp_s:7.1f}" if py_s else "      -"
        print(f"{n:>6} {len(desc.ops):>5} {res.batch:>5} {res.searches:>8} {cpp_s:>8.3f} "
              f"{(f'{py_s:9.3f}' if py_s else '        -')} {ratio}")
        rows.append(dict(layers=n, ops=len(desc.ops), batch=res.batch, searches=res.searches,
                         cpp_s=cpp_s, python_s=py_s if py_s else "", ratio=py_s / cpp_s if py_s else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
