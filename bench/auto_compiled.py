"""Auto mode with ``compile=`` ([Note: compiled plans] in osdp/compiled_choice.py): the
plan is calibrated and chosen on eager steps, then its finalists measured compiled;
prints ``model.report()``, whose rows put the calibrated prediction beside the eager
measurement, with the compiled step and the finalists above them.

    python bench/auto_compiled.py                 # 2 gloo ranks, GPT 4x128, 48 MiB
    python bench/auto_compiled.py --layers 12 --limit-mib 64
"""
from __future__ import annotations

import argparse
import time

from common import spawn

from osdp.models import GPTConfig


def _run(rank, world, config, limit_mib, budget_s):
    import torch

    import osdp
    from osdp.models import GPT, example_batch

    torch.manual_seed(0)
    idx, tgt = example_batch(config, 4)
    start = time.perf_counter()
    model = osdp.OSDP(GPT(config), memory_limit=f"{limit_mib}MiB", example_inputs=(idx, tgt), compile=True,
                      auto_kwargs={"use_plan_cache": False, "progress": False,
                                   **({"budget_s": budget_s} if budget_s is not None else {})})
    return model.report(), time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--limit-mib", type=int, default=48)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="auto mode's planning budget (default: its own, 60 s; the compiled finalists are "
                        "outside it)")
    args = parser.parse_args(argv)
    config = GPTConfig(vocab_size=1024, seq_len=64, num_layers=args.layers, hidden=128, heads=4)
    report, took = spawn(_run, args.world_size, config, args.limit_mib, args.budget_s)[0]
    print(report)
    print(f"auto mode with compile=True took {took:.0f} s ({args.world_size} ranks, GPT {args.layers}x128, "
          f"{args.limit_mib} MiB)")


if __name__ == "__main__":
    main()
