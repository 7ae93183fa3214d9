"""The runtime's host cost per unit: a GPT whose arithmetic is negligible (hidden 32,
8 tokens), so a step is the wrapper's own work, OSDP with every unit ``zdp``, ``dp`` or
``rep`` against DDP and FSDP2 (per block + root), their steps interleaved.

    python bench/unit_overhead.py                  # 2 gloo ranks, 12 layers, 31 rounds
    python bench/unit_overhead.py --world-size 1 --layers 24

Prints each peer's median step and, for OSDP, (step - DDP's step) / units: the host
time a unit adds (the H200 run's calibration fitted 0.37 ms a unit, and small models ran
3x slower than the uncalibrated prediction: bench/results/gpu_20261127). Medians over
``--rounds`` interleaved steps, the slowest rank's; ratios are taken in one run.
"""
from __future__ import annotations

import argparse

from common import interleaved_step_s, spawn, wrap_peer

from osdp.models import GPTConfig

MODES = ("zdp", "dp", "rep")


def _run(rank, world, config, batch, rounds):
    import torch

    import osdp

    runs, names, units = [], [], 0
    for peer in ("ddp", "fsdp_zero3"):
        model = wrap_peer(peer, config)
        runs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch))
        names.append("fsdp2" if peer == "fsdp_zero3" else peer)
    for mode in MODES:
        torch.manual_seed(0)
        model = osdp.OSDP(osdp.models.GPT(config), default_mode=mode, memory_check=False)
        units = len(model.unit_modes())
        runs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch))
        names.append(f"osdp {mode}")
    return dict(zip(names, interleaved_step_s(runs, config, rounds))), units


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args(argv)
    config = GPTConfig(vocab_size=64, seq_len=8, num_layers=args.layers, hidden=32, heads=2)
    steps, units = spawn(_run, args.world_size, config, args.batch, args.rounds)[0]
    print(f"{args.world_size} ranks, GPT {args.layers}x32, batch {args.batch}, {units} OSDP units, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"  {'peer':<10} {'step ms':>8} {'x DDP':>6} {'us/unit over DDP':>17}")
    for name, step_s in steps.items():
        extra = f"{(step_s - steps['ddp']) / units * 1e6:17.0f}" if name.startswith("osdp") else ""
        print(f"  {name:<10} {step_s * 1e3:8.2f} {step_s / steps['ddp']:6.2f} {extra}")


if __name__ == "__main__":
    main()
