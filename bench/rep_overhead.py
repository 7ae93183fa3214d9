"""The runtime's own cost of replicated units: OSDP with every unit ``rep`` against torch
DDP, the same model and batch, their steps interleaved (2 gloo ranks).

    python bench/rep_overhead.py                       # N&D 12x128 at batches 1, 5, 10
    python bench/rep_overhead.py --model "W&S 2x768" --batches 2,8 --rounds 21

Both run the same arithmetic (whole parameters, one all-reduce of the gradients per
4 MiB bucket), so step / DDP's step is what OSDP's runtime adds. Three OSDP variants:
``direct`` (the default: fp32 rep units compute with their parameters, [Note: direct
replicated units] in osdp/runtime/direct.py), ``hooked`` (every rep unit forced onto
the per-use hook path, the way a mixed-precision rep unit runs), and DDP. Medians over
``--rounds`` interleaved steps, the slowest rank's; ratios are taken in one run.
"""
from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

from common import interleaved_step_s, spawn, wrap_peer
from throughput import MODELS


def _run(rank, world, model_name, batches, rounds):
    import osdp
    import osdp.api
    from osdp.models import GPT

    config = MODELS[model_name]
    out = []
    for batch in batches:
        runs = []
        for variant in ("direct", "hooked"):
            hooked = mock.patch.object(osdp.api, "direct_units", side_effect=lambda bindings: set())
            with hooked if variant == "hooked" else contextlib.nullcontext():
                torch.manual_seed(0)
                model = osdp.OSDP(GPT(config), default_mode="rep")
            runs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4), batch))
        ddp = wrap_peer("ddp", config)
        runs.append((ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), batch))
        out.append((batch, interleaved_step_s(runs, config, rounds)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="N&D 12x128", help=f"one of: {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,5,10")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    for batch, (direct, hooked, ddp) in spawn(_run, args.world_size, args.model, batches, args.rounds)[0]:
        print(f"{args.model} b={batch}: OSDP all-rep direct {direct * 1e3:.1f} ms, hooked {hooked * 1e3:.1f} ms, "
              f"DDP {ddp * 1e3:.1f} ms; direct / DDP {direct / ddp:.3f}, hooked / DDP {hooked / ddp:.3f}", flush=True)


if __name__ == "__main__":
    main()
