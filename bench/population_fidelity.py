"""The cost model on a regret cell's population: predicted vs measured, plan by plan.

    python bench/population_fidelity.py --model "W&S 2x768" --budget middle

bench/regret.py measures a population of plans per cell (all-dp, all-zdp, all-rep,
random dp/zdp mixes, ...) at their own largest fitting batches. This bench takes one
cell's population at the batches its last run found (bench/results/regret_<device>.csv),
prices each plan as the planner would after calibrating (``osdp.auto_plan`` at the
cell's budget: its calibrated factors), and measures the plans and the pick with their
steps interleaved (``osdp.profiler.measure_plans``: the runtime, median step, slowest
rank). Each population plan runs the prefetch window that regret's ``osdp.OSDP(**kwargs)``
runs (the runtime's default), and is priced with it. It answers whether a regret miss
is the model ranking plans wrongly or the measurements of nearly equal plans spreading.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import time

import torch

from common import ROOT, spawn
from regret import ALL_MODELS, QUICK_MODELS, population, reserve
from throughput import BUDGETS, GPT_params


def _population_batches(csv_path, model: str, budget: str) -> dict[str, int]:
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["model"] == model and r["budget"] == budget]
    found = {r["plan"]: int(r["batch"]) for r in rows if r["plan"] != "pick" and int(r["batch"]) > 0}
    if not found:
        raise SystemExit(f"{csv_path} has no fitting population plan for {model!r} at {budget!r}: run regret.py first")
    return found


def _as_plan(base, kwargs, window_bytes):
    """The population plan ``kwargs`` (osdp.OSDP's modes / default_mode, unsplit) as a Plan."""
    mode = (lambda u: kwargs["default_mode"]) if "default_mode" in kwargs else \
        (lambda u: kwargs["modes"].get(u.name, "zdp"))
    units = tuple(dataclasses.replace(u, modes=(mode(u),)) for u in base.units)
    return dataclasses.replace(base, units=units, prefetch_bytes=int(window_bytes))


def _run(rank, world, model_name, label, batches, steps, cache_dir):
    import osdp
    from osdp.measured_choice import calibrated_device
    from osdp.models import GPT, example_batch
    from osdp.planner import calibration as cal
    from osdp.planner.cost_model import PlannerSettings
    from osdp.profiler.hardware import profile
    from osdp.planner.uniform_plan import uniform_plan
    from osdp.profiler import measure_plans

    config = ALL_MODELS[model_name]
    budget = int(BUDGETS[label] * sum(p.numel() for p in GPT_params(config)) * 4)
    settings = PlannerSettings(max_slices=8, checkpointing="auto")  # regret's pick settings
    inputs = example_batch(config, 4)
    torch.manual_seed(0)
    pick = osdp.auto_plan(GPT(config), inputs, budget, cache_dir=cache_dir, settings=settings, progress=False,
                          comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2)
    desc, cluster, run = profile(GPT(config), inputs, memory_limit=budget, cache_dir=cache_dir, progress=False,
                                 comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2)
    device = calibrated_device(cluster.for_run(run), pick)
    torch.manual_seed(0)
    kwargs = {**population(GPT(config)), **reserve(GPT(config))}  # the plans a regret cell may hold
    names, plans = [], []
    for name, batch in batches.items():
        if "split" in name:  # its slices are not a uniform plan's: left out
            continue
        torch.manual_seed(0)
        window = osdp.OSDP(GPT(config), **kwargs[name]).prefetch_bytes  # what regret runs
        checkpointed = "ckpt" in name
        base = uniform_plan(desc, device, settings, batch, checkpointed=checkpointed)
        names.append(name)
        plans.append(_as_plan(base, kwargs[name], window))
    names.append("pick")
    plans.append(pick)
    measured = measure_plans(GPT(config), plans, inputs, steps=steps, group_times=False)
    rows = []
    for name, plan, m in zip(names, plans, measured):
        sim = cal.simulate(cal.assignment_of(desc, device, plan), device)
        rows.append(dict(plan=name, batch=plan.batch_size, window_bytes=plan.prefetch_bytes,
                         measured_samples_per_s=m.samples_per_s(world), measured_step_s=m.step_s,
                         simulated_step_s=sim.step_s, simulated_samples_per_s=sim.samples_per_s(plan.batch_size, world),
                         measured_peak_bytes=m.peak_bytes, budget_bytes=budget))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="W&S 2x768", choices=list(ALL_MODELS))
    parser.add_argument("--budget", default="middle", choices=["tight", "middle"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--regret-csv", help="default: bench/results/regret_cpu.csv, regret_cpu_quick.csv for a "
                                             "--quick model")
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    args = parser.parse_args(argv)
    started = time.time()
    regret_csv = args.regret_csv or str(ROOT / "bench" / "results" /
                                        f"regret_cpu{'_quick' if args.model in QUICK_MODELS else ''}.csv")
    batches = _population_batches(regret_csv, args.model, args.budget)
    rows = spawn(_run, 2, args.model, args.budget, batches, args.steps, args.cache_dir)[0]
    print(f"{args.model} {args.budget}: each plan at its regret batch, its steps interleaved with the others' "
          f"({args.steps} rounds, medians); predicted = the calibrated step simulation")
    print(f"{'plan':<16} {'batch':>5} {'window MiB':>10} | {'measured/s':>10} {'predicted/s':>11} {'error':>7} | "
          f"{'peak MiB':>8}")
    for r in sorted(rows, key=lambda r: -r["measured_samples_per_s"]):
        err = r["simulated_step_s"] / r["measured_step_s"] - 1
        print(f"{r['plan']:<16} {r['batch']:>5} {r['window_bytes'] / 2**20:>10.1f} | "
              f"{r['measured_samples_per_s']:>10.2f} {r['simulated_samples_per_s']:>11.2f} {err:>+7.1%} | "
              f"{r['measured_peak_bytes'] / 2**20:>8.1f}")
    by_measured = [r["plan"] for r in sorted(rows, key=lambda r: -r["measured_samples_per_s"])]
    by_predicted = [r["plan"] for r in sorted(rows, key=lambda r: -r["simulated_samples_per_s"])]
    spread = max(r["measured_samples_per_s"] for r in rows) / min(r["measured_samples_per_s"] for r in rows) - 1
    print(f"fastest measured: {by_measured[0]}; fastest predicted: {by_predicted[0]} (measured rank "
          f"{by_measured.index(by_predicted[0]) + 1} of {len(rows)}); measured spread {spread:.1%}; "
          f"{time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
