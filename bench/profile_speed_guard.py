"""Does a profile cache filled on a busy machine mislead a later profile on a quiet one?
([Note: profile cache] in osdp/planner/profile_cache.py, its speed check.)

One process profiles a GPT's units, each profile reading and writing a cache directory
as said, and reads the compute rate its profile gives the planner
(``DeviceInfo.flops_per_s``, the model's FLOPs over its per-sample forward time):

  quiet        an empty cache, the machine quiet: the truth
  busy         an empty cache while ``--load`` background processes (one thread each)
               multiply matrices: what the profile measures there, and how many compute
               entries it caches (none when the machine's speed changed or stayed noisy)
  busy, old    the same with the speed check off (the stamp made constant: the cache
               before the check), into a directory of its own: its entries are cached
  quiet+cache  quiet again, reading the "busy, old" cache with the check on: the
               stamps disagree with the machine now, so it measures again
  quiet+old    the same with the check off: the busy numbers, reused

Each row prints its rate over the quiet one and whether the profile timed the units
(False: it read them from the cache). ``--rounds`` repeats them and prints medians.

    python bench/profile_speed_guard.py [--rounds 3] [--load 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from osdp.models import GPT, GPTConfig, example_batch  # noqa: E402
from osdp.planner import profile_cache  # noqa: E402
from osdp.planner.profile_cache import ProfileCache  # noqa: E402
from osdp.profiler import hardware  # noqa: E402

CONFIG = GPTConfig(vocab_size=2048, seq_len=128, num_layers=4, hidden=128, heads=4)
LOAD = "import torch\ntorch.set_num_threads(1)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


def _profile(model, inputs, cache_dir) -> tuple[float, bool]:
    """(the profile's compute rate, whether it timed the units)."""
    timed = []
    real = hardware.profile_compute

    def counting(*args, **kwargs):
        timed.append(1)
        return real(*args, **kwargs)

    hardware.profile_compute = counting
    try:
        profiled = hardware.profile(model, inputs, memory_limit="1GiB", cache_dir=cache_dir, progress=False)
    finally:
        hardware.profile_compute = real
    return profiled.device.flops_per_s, bool(timed)


def _busy(processes: int):
    return [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(processes)]


def _cached_compute(cache_dir) -> int:
    return len(ProfileCache.open(cache_dir).sections["compute"])


def _check_off():
    """The speed check off: every stamp the same (the cache as it was before it)."""
    return mock.patch.object(profile_cache, "speed_now", lambda device, group=None: profile_cache.Speed(1e9, False))


def one_round(model, inputs, load: int) -> dict:
    with tempfile.TemporaryDirectory() as quiet_dir, tempfile.TemporaryDirectory() as busy_dir, \
            tempfile.TemporaryDirectory() as old_dir:
        rows = {"quiet": _profile(model, inputs, quiet_dir)}
        workers = _busy(load)
        try:
            time.sleep(1.0)  # the load running before the profiles start
            rows["busy"] = _profile(model, inputs, busy_dir)
            with _check_off():
                rows["busy, old"] = _profile(model, inputs, old_dir)
        finally:
            for worker in workers:
                worker.kill()
                worker.wait()
        rows["busy cached"] = _cached_compute(busy_dir)
        time.sleep(1.0)
        copy = shutil.copytree(old_dir, f"{quiet_dir}/old-copy")  # each quiet reader gets the busy cache
        rows["quiet+cache"] = _profile(model, inputs, old_dir)
        with _check_off():
            rows["quiet+old"] = _profile(model, inputs, copy)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=int, default=2, help="background processes multiplying matrices")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    inputs = example_batch(CONFIG, 4)
    rounds = [one_round(model, inputs, args.load) for _ in range(args.rounds)]
    print(f"GPT {CONFIG.num_layers}x{CONFIG.hidden}, batch 4, one process, {os.cpu_count()} cores, "
          f"{args.load} background processes while busy; {args.rounds} rounds, medians")
    print(f"  compute entries the busy profile cached (each round): {[r['busy cached'] for r in rounds]}")
    print(f"  {'profile':<12} {'GFLOP/s':>9} {'/ quiet':>8}  timed the units (each round)")
    quiet = statistics.median(r["quiet"][0] for r in rounds)
    for name in ("quiet", "busy", "busy, old", "quiet+cache", "quiet+old"):
        rate = statistics.median(r[name][0] for r in rounds)
        print(f"  {name:<12} {rate * 1e-9:>9.2f} {rate / quiet:>7.2f}x  {[r[name][1] for r in rounds]}")


if __name__ == "__main__":
    main()
