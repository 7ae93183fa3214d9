"""Regret of the planner's pick: how far it is from the best plan that could be run.

    python bench/regret.py            # 3 GPT families x 2 budgets, 2 gloo ranks
    python bench/regret.py --quick    # fewer timed steps, smaller batch cap

For each GPT family scaled to this machine (bench/throughput.py's MODELS) and each
budget (tight and middle, as multiples of the fp32 parameter bytes), a population of
plans is measured in the same run: all-dp, all-zdp, both with every block
checkpointed (FSDP-like), a half-and-half split of the layers, seeded random dp/zdp
mixes and random mixes with the widest Linears split in 2 or 4 slices, each at its own
largest batch whose MEASURED peak fits the budget (doubling then bisection), and the
planner's pick (auto mode: profile + plan at the budget, run at the plan's batch).
Regret = best measured samples/s among the plans that fit / the pick's - 1.
Writes bench/results/regret_<device>.csv
(model,budget,plan,batch,samples_per_s,peak_bytes,budget_bytes,is_pick,...).
"""
from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from pathlib import Path

import torch

from common import ROOT, largest_fitting_batch_of, measured_peak_bytes, median_step_s, spawn
from throughput import BUDGETS, GPT_params, MODELS

REGRET_BUDGETS = {k: BUDGETS[k] for k in ("tight", "middle")}
RANDOM_MIXES = 6


def population(model) -> dict[str, dict]:
    """Plan name -> OSDP keyword arguments (same on every rank: seeded)."""
    from osdp.runtime.config import unit_candidates

    units = unit_candidates(model)
    blocks = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
    linears = sorted((n for n in units if isinstance(model.get_submodule(n), torch.nn.Linear)),
                     key=lambda n: -model.get_submodule(n).weight.numel())
    half = len(units) // 2
    plans = {
        "all_dp": {"default_mode": "dp"},
        "all_zdp": {"default_mode": "zdp"},
        "all_zdp_ckpt": {"default_mode": "zdp", "checkpoint_blocks": blocks},
        "all_dp_ckpt": {"default_mode": "dp", "checkpoint_blocks": blocks},
        "dp_first_half": {"modes": {n: ("dp" if i < half else "zdp") for i, n in enumerate(units)}},
    }
    for seed in range(RANDOM_MIXES):
        rng = random.Random(seed)
        plans[f"random{seed}"] = {"modes": {n: rng.choice(("dp", "zdp")) for n in units}}
    for seed, g in ((100, 2), (101, 4)):
        rng = random.Random(seed)
        widest = [n for n in linears[:2] if model.get_submodule(n).in_features >= g]
        plans[f"random{seed}_split{g}"] = {
            "modes": {n: rng.choice(("dp", "zdp")) for n in units if n not in widest},
            "splits": {n: g for n in widest},
        }
    return plans


def _measure(model, config, batch, steps, budget):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = measured_peak_bytes(model, optim, config, batch)
    step_s = median_step_s(model, optim, config, batch, steps)
    return peak, step_s


def _run(rank, world, model_name, budget_bytes, steps, max_batch, cache_dir):
    import osdp
    from osdp.models import GPT, example_batch
    from osdp.planner.cost_model import PlannerSettings

    config = MODELS[model_name]
    rows = []
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        plan = osdp.auto_plan(GPT(config), example_batch(config, 4), budget_bytes, cache_dir=cache_dir,
                              settings=PlannerSettings(max_slices=8, checkpointing="auto"), progress=False,
                              comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2)
    except osdp.InfeasiblePlanError:
        plan = None
    plan_s = time.perf_counter() - start
    if plan is not None:
        torch.manual_seed(0)
        model = osdp.OSDP(GPT(config), plan=plan)
        peak, step_s = _measure(model, config, plan.batch_size, steps, budget_bytes)
        rows.append(dict(plan="pick", batch=plan.batch_size, peak_bytes=peak, step_s=step_s,
                         samples_per_s=plan.batch_size * world / step_s, is_pick=True,
                         predicted_samples_per_s=plan.predicted.samples_per_s,
                         predicted_peak_bytes=plan.predicted.peak_bytes, bench_s=plan_s))
        del model
    torch.manual_seed(0)
    for name, kwargs in population(GPT(config)).items():
        start = time.perf_counter()
        torch.manual_seed(0)
        model = osdp.OSDP(GPT(config), **kwargs)
        batch, peak = largest_fitting_batch_of(model, config, budget_bytes, max_batch)
        if batch == 0:
            rows.append(dict(plan=name, batch=0, peak_bytes=peak, step_s=0.0, samples_per_s=0.0, is_pick=False))
            continue
        _, step_s = _measure(model, config, batch, steps, budget_bytes)
        rows.append(dict(plan=name, batch=batch, peak_bytes=peak, step_s=step_s, samples_per_s=batch * world / step_s,
                         is_pick=False, bench_s=time.perf_counter() - start))
        del model
    return rows


def regret(rows, budget) -> tuple[float | None, str]:
    """(best fitting samples/s / the pick's - 1, best plan's name); None without a pick."""
    pick = next((r for r in rows if r["is_pick"]), None)
    fitting = [r for r in rows if r["batch"] and r["peak_bytes"] <= budget]
    if pick is None or not fitting or not pick["samples_per_s"]:
        return None, ""
    best = max(fitting, key=lambda r: r["samples_per_s"])
    return best["samples_per_s"] / pick["samples_per_s"] - 1, best["plan"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 timed steps, batch cap 32")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--models", help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--budgets", help=f"comma-separated subset of: {', '.join(REGRET_BUDGETS)}")
    parser.add_argument("--out", help="CSV path (default bench/results/regret_<device>.csv)")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 5)
    max_batch = args.max_batch or (32 if args.quick else 128)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    models = {k: MODELS[k] for k in args.models.split(",")} if args.models else MODELS
    budgets = {k: REGRET_BUDGETS[k] for k in args.budgets.split(",")} if args.budgets else REGRET_BUDGETS
    table, regrets = [], []
    started = time.perf_counter()
    for name, config in models.items():
        param_bytes = sum(p.numel() for p in GPT_params(config)) * 4
        for label, factor in budgets.items():
            budget = int(factor * param_bytes)
            rows = spawn(_run, args.world_size, name, budget, steps, max_batch, args.cache_dir)[0]
            value, best = regret(rows, budget)
            pick = next((r for r in rows if r["is_pick"]), None)
            for r in rows:
                r.update(model=name, budget=label, budget_bytes=budget, device=device,
                         fits=bool(r["batch"]) and r["peak_bytes"] <= budget)
                table.append(r)
            if value is not None:
                regrets.append(value)
            fit = sum(r["fits"] for r in rows)
            print(f"{name:<16} {label:<6} budget {budget / 2**20:6.1f} MiB  {fit}/{len(rows)} plans fit  "
                  f"pick: b={pick['batch'] if pick else '-'} {pick['samples_per_s'] if pick else 0:.1f}/s "
                  f"peak {pick['peak_bytes'] / 2**20 if pick else 0:.1f} MiB"
                  f"{'' if not pick or pick['peak_bytes'] <= budget else ' OVER BUDGET'}  "
                  f"best: {best} -> regret {f'{value:.1%}' if value is not None else '-'}", flush=True)
    if regrets:
        print(f"regret over {len(regrets)} cells: median {statistics.median(regrets):.1%}, worst {max(regrets):.1%} "
              f"({time.perf_counter() - started:.0f} s)")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"regret_{device.replace(' ', '_')}.csv"
    fields = ["model", "budget", "plan", "batch", "samples_per_s", "peak_bytes", "budget_bytes", "is_pick", "fits",
              "step_s", "predicted_samples_per_s", "predicted_peak_bytes", "bench_s", "device"]
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
