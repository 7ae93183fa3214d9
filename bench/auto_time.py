"""Wall time of auto mode (``osdp.OSDP(model, memory_limit=..., example_inputs=...)``) on
2 gloo ranks, at the default planning budget ([Note: planning budget]), for the GPTs
issue 32 timed (13M: 4 layers, hidden 512, seq 32; 101M: 12 layers, hidden 768, vocab
10240, seq 64) at 1 GiB and 20 GiB; then the same call again, as a restarted job makes
it (the plan from the cache of measured plans, [Note: measured plan cache]).

    python bench/auto_time.py [--models 13m,101m] [--limits 1GiB,20GiB] [--budget 60]

Prints rank 0's progress lines as they come, then a table: wall time of the first and
of the restarted call, the batch picked, the budget and what was cut. Target: within
the budget plus 20%.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, spawn, write_csv  # noqa: E402

os.environ.setdefault("OSDP_MEMORY_CHECK", "0")
import osdp  # noqa: E402
from osdp.models import GPT, GPTConfig, example_batch  # noqa: E402

MODELS = {
    "13m": GPTConfig(vocab_size=256, seq_len=32, num_layers=4, hidden=512, heads=8),
    "101m": GPTConfig(vocab_size=10240, seq_len=64, num_layers=12, hidden=768, heads=12),
}


def run(rank: int, world: int, name: str, limit: str, budget: float, cache_dir: str) -> dict:
    config = MODELS[name]
    out = {}
    for attempt in ("first", "restarted"):
        torch.manual_seed(0)
        model = GPT(config)
        started = time.perf_counter()
        wrapped = osdp.OSDP(model, memory_limit=limit, example_inputs=example_batch(config, 4),
                            auto_kwargs={"budget_s": budget, "cache_dir": cache_dir})
        out[attempt] = time.perf_counter() - started
        out["batch"] = wrapped.batch_size
        out["cuts"] = (wrapped.plan.calibration.budget or {}).get("cuts", [])
        del wrapped, model
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="13m,101m")
    p.add_argument("--limits", default="1GiB,20GiB")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--csv", default=str(ROOT / "bench" / "results" / "auto_time_cpu.csv"))
    args = p.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        with torch.device("meta"):
            params = sum(t.numel() for t in GPT(MODELS[name]).parameters())
        for limit in args.limits.split(","):
            print(f"\n== GPT {name} ({params / 1e6:.1f}M parameters) at {limit}, budget {args.budget:.0f} s", flush=True)
            with tempfile.TemporaryDirectory() as cache_dir:  # a fresh profile cache: the first call measures
                r = spawn(run, 2, name, limit, args.budget, cache_dir, backend="gloo")[0]
            rows.append({"model": name, "params_m": round(params / 1e6, 1), "limit": limit, "budget_s": args.budget,
                         "first_s": round(r["first"], 1), "restarted_s": round(r["restarted"], 1),
                         "batch": r["batch"], "cuts": " | ".join(r["cuts"])})
    print("\nmodel  limit   budget  first call  restarted  batch  within budget + 20%")
    for row in rows:
        ok = row["first_s"] <= 1.2 * row["budget_s"]
        print(f"{row['model']:<6} {row['limit']:<7} {row['budget_s']:5.0f} s {row['first_s']:8.1f} s "
              f"{row['restarted_s']:8.1f} s  {row['batch']:5d}  {'yes' if ok else 'NO'}")
        if row["cuts"]:
            print(f"       cut: {row['cuts']}")
    if args.csv:
        write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
