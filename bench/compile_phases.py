"""Where a compiled step's time goes: forward, backward and optimizer step of OSDP eager
and compiled (each scope), one plan for all (every unit in ``--mode``), their steps
interleaved (2 gloo ranks by default).

    python bench/compile_phases.py                                   # N&D 12x128, zdp, batch 3
    python bench/compile_phases.py --model "W&S 2x768" --batch 20 --rounds 7
    python bench/compile_phases.py --no-compiled-coalescing          # compiled: small units' gathers alone

Medians over ``--rounds`` steps after 2 warm-up steps (the first compiles), per rank;
the ratio line is eager's step over each compiled variant's, on the slowest rank. Where
bench/compile.py compares the plans auto mode makes, this holds the plan fixed, so a
change to the compiled path is measured on its own ([Note: compiled small units
coalesced] in osdp/runtime/compiled_coalesce.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from common import device_for, spawn
from throughput import MODELS

VARIANTS = ("eager", "model", "blocks")
PHASES = ("forward", "backward", "optimizer", "step")


def _run(rank, world, model_name, batch, rounds, mode, compiled_coalescing):
    import osdp
    from osdp.models import GPT, example_batch

    config = MODELS[model_name]
    device = device_for(rank)
    runs = []
    for variant in VARIANTS:
        torch.manual_seed(0)
        compile_ = None if variant == "eager" else {"scope": variant, "dynamic": False}
        if compile_ is not None and not compiled_coalescing:  # inductor's own default for the key OSDP sets
            compile_["options"] = {"post_grad_custom_post_pass": None}
        model = osdp.OSDP(GPT(config), default_mode=mode, device=device, compile=compile_)
        runs.append((variant, model, torch.optim.AdamW(model.parameters(), lr=1e-4)))
    times = {variant: [] for variant in VARIANTS}
    for r in range(rounds + 2):
        for k in range(len(runs)):
            variant, model, optim = runs[(k + r) % len(runs)]  # rotated: no variant always first
            idx, targets = example_batch(config, batch, seed=r, device=device)
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(idx, targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            if r >= 2:
                times[variant].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    return {variant: [statistics.median(s[i] for s in samples) for i in range(len(PHASES))]
            for variant, samples in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="N&D 12x128", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--mode", default="zdp", choices=("dp", "zdp", "rep"))
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--no-compiled-coalescing", dest="compiled_coalescing", action="store_false",
                        help="compiled variants without the pass that merges small units' gathers (eager keeps "
                             "its coalescing)")
    args = parser.parse_args(argv)
    results = spawn(_run, args.world, args.model, args.batch, args.rounds, args.mode, args.compiled_coalescing)
    print(f"{args.model}, every unit {args.mode}, batch {args.batch}, {args.world} ranks, {args.rounds} rounds, "
          f"medians (ms); compiled coalescing {'on' if args.compiled_coalescing else 'off'}")
    print(f"  {'rank':>4} {'variant':>8}" + "".join(f"{p:>11}" for p in PHASES))
    for rank, out in enumerate(results):
        for variant, phases in out.items():
            print(f"  {rank:>4} {variant:>8}" + "".join(f"{t * 1e3:11.1f}" for t in phases))
    slowest = {v: max(out[v][-1] for out in results) for v in VARIANTS}
    print("  eager step / compiled step: " + ", ".join(f"{v} {slowest['eager'] / slowest[v]:.2f}x"
                                                     for v in VARIANTS[1:]))


if __name__ == "__main__":
    main()
