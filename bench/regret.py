"""Regret of the planner's pick: how far it is from the best plan that could be run.

    python bench/regret.py            # 3 GPT families x 2 budgets, 2 gloo ranks
    python bench/regret.py --quick    # the families at half width, fewer timed steps

For each GPT family scaled to this machine (bench/throughput.py's MODELS; with --quick
the same families at half the width, QUICK_MODELS) and each
budget (tight and middle, as multiples of the fp32 parameter bytes), a population of
plans is measured in the same run: all-dp, all-zdp, both with every block
checkpointed (FSDP-like), all-rep (DDP), a half-and-half split of the layers, seeded
random dp/zdp mixes and random mixes with the widest Linears split in 2 or 4 slices
(13 plans), each at its own largest batch whose MEASURED peak fits the budget (secant
probes, the answer b checked to fit and b + 1 not to); where fewer than 12 of them fit
the budget (tight ones), seeded random mixes with every block checkpointed fill the cell
up to 12 (``reserve``); and the planner's pick (auto mode: profile + plan
at the budget, run at the plan's batch). Then the pick and the 3 best plans of that
first pass are timed again with their steps interleaved, and
regret = best interleaved samples/s among them / the pick's - 1 (a ratio taken in one
run: the load of a shared machine drifts by more than the target between plans timed
minutes apart). A finalist that runs the pick's own configuration (same unit modes,
checkpointed blocks, window, coalescing and batch) is not an alternative: the two
measure one plan's timing noise, printed as such.
Writes bench/results/regret_<device>.csv
(model,budget,plan,batch,samples_per_s,peak_bytes,budget_bytes,is_pick,...): samples_per_s
is the interleaved value regret compares, empty for plans that were not finalists (their
first-pass value is in first_pass_samples_per_s).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import random
import statistics
import time
from pathlib import Path

import torch

from common import ROOT, interleaved_step_s, largest_fitting_batch_of, measured_peak_bytes, median_step_s, spawn
from physical_limit import physical_limit
from throughput import BUDGETS, GPT_params, MODELS

REGRET_BUDGETS = {k: BUDGETS[k] for k in ("tight", "middle")}
# --quick: each family at half the width (a quarter of the parameters, budgets shrinking
# with them). A measured step at the middle budget's largest all-zdp batch costs 0.53x,
# 0.22x and 0.29x of the full-width one on this 2-core CPU; at full width the picks'
# auto mode alone (about 70 measured steps a cell) took 7 of --quick's 21.5 minutes
QUICK_MODELS = {
    "N&D 12x64": dataclasses.replace(MODELS["N&D 12x128"], hidden=64),
    "W&S 2x384": dataclasses.replace(MODELS["W&S 2x768"], hidden=384),
    "I&C 6x64-256": dataclasses.replace(MODELS["I&C 6x128-512"], hidden=64, block_hidden=(64, 256) * 3),
}
ALL_MODELS = {**MODELS, **QUICK_MODELS}
RANDOM_MIXES = 5  # with the 8 fixed plans: 13 plans per cell beside the pick
FINALISTS = 3  # the best plans of the first pass, measured again beside the pick
FINAL_ROUNDS = 5  # interleaved steps of each finalist (and of the physical-limit rounds)
MIN_FITTING = 12  # population plans per cell that fit its budget
RESERVE_MIXES = 12  # checkpointed random mixes, measured only in a cell short of MIN_FITTING


def _units_and_blocks(model) -> tuple[list[str], tuple[str, ...]]:
    """The model's unit names and its blocks' names (all of them checkpointed)."""
    from osdp.runtime.config import unit_candidates

    return unit_candidates(model), tuple(f"blocks.{i}" for i in range(len(model.blocks)))


def _random_modes(seed: int, names) -> dict[str, str]:
    """A seeded dp/zdp mode for each of ``names``, the same on every rank."""
    rng = random.Random(seed)
    return {n: rng.choice(("dp", "zdp")) for n in names}


def population(model) -> dict[str, dict]:
    """Plan name -> OSDP keyword arguments (same on every rank: seeded)."""
    units, blocks = _units_and_blocks(model)
    linears = sorted((n for n in units if isinstance(model.get_submodule(n), torch.nn.Linear)),
                     key=lambda n: -model.get_submodule(n).weight.numel())
    half = len(units) // 2
    plans = {
        "all_dp": {"default_mode": "dp"},
        "all_zdp": {"default_mode": "zdp"},
        "all_zdp_ckpt": {"default_mode": "zdp", "checkpoint_blocks": blocks},
        "all_dp_ckpt": {"default_mode": "dp", "checkpoint_blocks": blocks},
        "all_rep": {"default_mode": "rep"},  # DDP ([Note: replicated units])
        "dp_first_half": {"modes": {n: ("dp" if i < half else "zdp") for i, n in enumerate(units)}},
    }
    for seed in range(RANDOM_MIXES):
        plans[f"random{seed}"] = {"modes": _random_modes(seed, units)}
    for seed, g in ((100, 2), (101, 4)):
        widest = [n for n in linears[:2] if model.get_submodule(n).in_features >= g]
        plans[f"random{seed}_split{g}"] = {
            "modes": _random_modes(seed, [n for n in units if n not in widest]),
            "splits": {n: g for n in widest},
        }
    return plans


def reserve(model) -> dict[str, dict]:
    """Plan name -> OSDP keyword arguments of the plans that fill a cell up to
    MIN_FITTING: seeded random dp/zdp mixes with every block checkpointed. At a tight
    budget all-dp, all-rep and the mixes without checkpointing may not fit at any batch
    (N&D 12x128 and W&S 2x768 at 3x P: 11 and 10 of 13); these hold the fewest
    activations and do (N&D 12x64 tight: the 6 it tried all fit at b2-3, and the cell still
    had 8)."""
    units, blocks = _units_and_blocks(model)
    return {f"random{seed}_ckpt": {"modes": _random_modes(seed, units), "checkpoint_blocks": blocks}
            for seed in range(200, 200 + RESERVE_MIXES)}


def fits(row, budget_bytes) -> bool:
    """Whether a row ran at some batch with its measured peak within the budget."""
    return bool(row["batch"]) and row["peak_bytes"] <= budget_bytes


def fitting(rows, budget_bytes) -> int:
    """Population plans (not the pick) in ``rows`` whose measured peak fits the budget."""
    return sum(1 for r in rows if not r["is_pick"] and fits(r, budget_bytes))


def _pick(config, budget_bytes, cache_dir, world, steps):
    """The planner's pick at ``budget_bytes`` (auto mode) and its first-pass row."""
    import osdp
    from osdp.models import GPT, example_batch
    from osdp.planner.cost_model import PlannerSettings

    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        plan = osdp.auto_plan(GPT(config), example_batch(config, 4), budget_bytes, cache_dir=cache_dir,
                              settings=PlannerSettings(max_slices=8, checkpointing="auto"), progress=False,
                              comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2,
                              use_plan_cache=False)  # every run measures its pick (the default budget)
    except osdp.InfeasiblePlanError:
        return None, None
    plan_s = time.perf_counter() - start
    torch.manual_seed(0)
    model = osdp.OSDP(GPT(config), plan=plan)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = measured_peak_bytes(model, optim, config, plan.batch_size)
    # warm: the peak's two steps ran at this batch
    step_s = median_step_s(model, optim, config, plan.batch_size, steps, warm_up=False)
    return plan, dict(plan="pick", batch=plan.batch_size, peak_bytes=peak, step_s=step_s,
                      samples_per_s=plan.batch_size * world / step_s, is_pick=True,
                      predicted_samples_per_s=plan.predicted.samples_per_s,
                      predicted_peak_bytes=plan.predicted.peak_bytes, bench_s=plan_s, summary=_summary(plan))


def _summary(plan) -> str:
    """What the pick is, in a few words (for the CSV)."""
    dp = sum(m == "dp" for u in plan.units for m in u.modes)
    slices = sum(len(u.modes) for u in plan.units)
    split = sum(u.slices > 1 for u in plan.units)
    choice = plan.calibration.measured_choice or {}
    kept = next((i for i, c in enumerate(choice.get("candidates", [])) if c["plan"] == choice.get("kept")), 0)
    return (f"{dp}/{slices} slices dp, {split} units split, {len(plan.checkpoint_blocks)} blocks checkpointed; "
            f"measured choice kept candidate {kept} of {len(choice.get('candidates', [])) or 1}")


def _run(rank, world, model_name, budgets, steps, max_batch, cache_dir):
    """Every budget of one model in one spawn: a population plan is built once and its
    measured peaks serve every budget's batch search."""
    from osdp.models import GPT

    config = ALL_MODELS[model_name]
    rows = {label: [] for label in budgets}
    picks = {}
    for label, budget_bytes in budgets.items():
        picks[label], row = _pick(config, budget_bytes, cache_dir, world, steps)
        if row is not None:
            rows[label].append(row)
    torch.manual_seed(0)
    plans = population(GPT(config))
    for name, kwargs in plans.items():
        _first_pass(name, kwargs, config, budgets, rows, world, steps, max_batch)
    torch.manual_seed(0)
    for name, kwargs in reserve(GPT(config)).items():  # every rank sees the same rows
        short = {label: b for label, b in budgets.items() if fitting(rows[label], b) < MIN_FITTING}
        if not short:
            break
        plans[name] = kwargs
        _first_pass(name, kwargs, config, short, rows, world, steps, max_batch)
    for label, budget_bytes in budgets.items():
        if picks[label] is not None:
            _final_round(rows[label], plans, picks[label], config, world, budget_bytes, FINAL_ROUNDS)
    return rows


def _first_pass(name, kwargs, config, budgets, rows, world, steps, max_batch):
    """One population plan at each budget: its largest fitting batch (measured peaks;
    one model serves every budget, the probes carry over) and a few timed steps there."""
    import osdp
    from osdp.models import GPT

    torch.manual_seed(0)
    model = osdp.OSDP(GPT(config), **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = {}
    for label, budget_bytes in budgets.items():
        start = time.perf_counter()
        batch, peak = largest_fitting_batch_of(model, config, budget_bytes, max_batch, optim=optim, peaks=peaks)
        if batch == 0:
            rows[label].append(dict(plan=name, batch=0, peak_bytes=peak, step_s=0.0, samples_per_s=0.0,
                                    is_pick=False))
            continue
        # warm: the batch search's probes stepped this model, ``batch`` among them
        step_s = median_step_s(model, optim, config, batch, steps, warm_up=False)
        rows[label].append(dict(plan=name, batch=batch, peak_bytes=peak, step_s=step_s,
                                samples_per_s=batch * world / step_s, is_pick=False,
                                bench_s=time.perf_counter() - start))


def _final_round(rows, plans, plan, config, world, budget_bytes, rounds):
    """Measure the pick and the FINALISTS best fitting plans of the first pass again,
    their steps interleaved: regret is a ratio, and two plans timed minutes apart on a
    shared machine differ by more than the regret target (the same plan measured twice
    in one cell differed by 5%). Their rows get the interleaved samples/s."""
    import osdp
    from osdp.models import GPT

    start = time.perf_counter()
    fitting = sorted((r for r in rows if not r["is_pick"] and fits(r, budget_bytes)),
                     key=lambda r: -r["samples_per_s"])[:FINALISTS]
    finals = [next(r for r in rows if r["is_pick"])] + fitting
    runs = []
    for r in finals:
        torch.manual_seed(0)
        model = osdp.OSDP(GPT(config), plan=plan) if r["is_pick"] else osdp.OSDP(GPT(config), **plans[r["plan"]])
        runs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4), r["batch"]))
    for r, step_s in zip(finals, interleaved_step_s(runs, config, rounds)):
        r.update(first_pass_samples_per_s=r["samples_per_s"], step_s=step_s,
                 samples_per_s=r["batch"] * world / step_s, interleaved=True)
    # a finalist that runs the pick's very configuration is not an alternative to it:
    # the two measure the timing noise of one plan (N&D tight: 11% apart in 5 rounds,
    # 0.5% apart in 15), reported as such, not as regret
    pick_config = _configuration(runs[0][0], runs[0][2])
    for r, (model, _, batch) in zip(finals[1:], runs[1:]):
        r["same_as_pick"] = _configuration(model, batch) == pick_config
    # the pick against its physical limit (bench/physical_limit.py), in rounds of its own
    model, optim, batch = runs[0]
    limit = physical_limit(model, optim, config, batch, rounds)
    finals[0].update(compute_only_s=limit["compute_only_s"], comm_only_s=limit["comm_only_s"],
                     limit_ratio=limit["ratio"], limit_step_s=limit["step_s"],
                     final_s=time.perf_counter() - start)


def _configuration(model, batch) -> tuple:
    """What an ``osdp.OSDP`` model runs, as its public accessors resolve it: unit modes
    (split units by slice), checkpointed blocks, prefetch window, coalescing, batch."""
    return (tuple(sorted(model.unit_modes().items())), tuple(model.checkpoint_blocks), model.prefetch_bytes,
            model.coalesce_bytes, batch)


def regret(rows, budget) -> tuple[float | None, str]:
    """(best fitting samples/s / the pick's - 1, best plan's name); None without a pick.
    A plan that runs the pick's own configuration is not an alternative (``same_as_pick``)."""
    pick = next((r for r in rows if r["is_pick"]), None)
    fitting = [r for r in rows if fits(r, budget) and not r.get("same_as_pick")]
    if any(r.get("interleaved") for r in fitting):  # the ratio measured in one run
        fitting = [r for r in fitting if r.get("interleaved")]
    if pick is None or not fitting or not pick["samples_per_s"]:
        return None, ""
    best = max(fitting, key=lambda r: r["samples_per_s"])
    return best["samples_per_s"] / pick["samples_per_s"] - 1, best["plan"]


def csv_rows(rows) -> list[dict]:
    """``rows`` of one cell as the CSV writes them. Where the cell has interleaved rows,
    ``samples_per_s`` is what ``regret`` compares: the interleaved value of the pick and
    the finalists, left empty for the other plans, whose first-pass value (timed minutes
    apart on a shared machine, not comparable with the interleaved ones) goes to
    ``first_pass_samples_per_s`` only."""
    out = [dict(r) for r in rows]
    if any(r.get("interleaved") for r in out):
        for r in out:
            if not r.get("interleaved") and r["batch"]:
                r.update(first_pass_samples_per_s=r["samples_per_s"], samples_per_s="")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="QUICK_MODELS (half width), 2 timed steps in the first pass, batch cap 32")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(ALL_MODELS)}")
    parser.add_argument("--budgets", help=f"comma-separated subset of: {', '.join(REGRET_BUDGETS)}")
    parser.add_argument("--out", help="CSV path (default bench/results/regret_<device>[_quick].csv)")
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.quick else 5)
    max_batch = args.max_batch or (32 if args.quick else 128)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    models = QUICK_MODELS if args.quick else MODELS
    if args.models:
        unknown = [k for k in args.models.split(",") if k not in ALL_MODELS]
        if unknown:
            parser.error(f"--models: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(ALL_MODELS)}")
        models = {k: ALL_MODELS[k] for k in args.models.split(",")}
    budgets = REGRET_BUDGETS
    if args.budgets:
        unknown = [k for k in args.budgets.split(",") if k not in REGRET_BUDGETS]
        if unknown:
            parser.error(f"--budgets: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(REGRET_BUDGETS)}")
        budgets = {k: REGRET_BUDGETS[k] for k in args.budgets.split(",")}
    table, regrets = [], []
    started = time.perf_counter()
    for name, config in models.items():
        param_bytes = sum(p.numel() for p in GPT_params(config)) * 4
        cells = {label: int(factor * param_bytes) for label, factor in budgets.items()}
        by_budget = spawn(_run, args.world_size, name, cells, steps, max_batch, args.cache_dir)[0]
        for label, budget in cells.items():
            rows = by_budget[label]
            value, best = regret(rows, budget)
            pick = next((r for r in rows if r["is_pick"]), None)
            for r in rows:
                r.update(model=name, budget=label, budget_bytes=budget, device=device,
                         fits=fits(r, budget))
            table.extend(csv_rows(rows))
            if value is not None:
                regrets.append(value)
            fit = sum(r["fits"] for r in rows)
            if fitting(rows, budget) < MIN_FITTING:
                print(f"{name} {label}: only {fitting(rows, budget)} population plans fit the budget, with "
                      f"{RESERVE_MIXES} reserve plans tried (want {MIN_FITTING})", flush=True)
            print(f"{name:<16} {label:<6} budget {budget / 2**20:6.1f} MiB  {fit}/{len(rows)} plans fit  "
                  f"pick: b={pick['batch'] if pick else '-'} {pick['samples_per_s'] if pick else 0:.1f}/s "
                  f"peak {pick['peak_bytes'] / 2**20 if pick else 0:.1f} MiB"
                  f"{'' if not pick or pick['peak_bytes'] <= budget else ' OVER BUDGET'}  "
                  f"best: {best} -> regret {f'{value:.1%}' if value is not None else '-'}"
                  + (f"; pick step {pick['limit_step_s'] * 1e3:.0f} ms / max(compute-only "
                     f"{pick['compute_only_s'] * 1e3:.0f}, comm-only {pick['comm_only_s'] * 1e3:.0f}) = "
                     f"{pick['limit_ratio']:.2f}" if pick and "limit_ratio" in pick else ""), flush=True)
            for twin in (r for r in rows if r.get("same_as_pick")):
                print(f"    {twin['plan']} runs the pick's configuration: measured "
                      f"{twin['samples_per_s'] / pick['samples_per_s'] - 1:+.1%} from it (timing noise, not regret)")
    if regrets:
        print(f"regret over {len(regrets)} cells: median {statistics.median(regrets):.1%}, worst {max(regrets):.1%} "
              f"({time.perf_counter() - started:.0f} s)")
    ratios = [r["limit_ratio"] for r in table if "limit_ratio" in r]
    if ratios:
        print(f"pick's step / physical limit over {len(ratios)} cells: median {statistics.median(ratios):.2f}, "
              f"worst {max(ratios):.2f}")
    out = Path(args.out) if args.out else \
        ROOT / "bench" / "results" / f"regret_{device.replace(' ', '_')}{'_quick' if args.quick else ''}.csv"
    fields = ["model", "budget", "plan", "batch", "samples_per_s", "peak_bytes", "budget_bytes", "is_pick", "fits",
              "step_s", "predicted_samples_per_s", "predicted_peak_bytes", "bench_s", "device", "interleaved",
              "first_pass_samples_per_s", "limit_step_s", "compute_only_s", "comm_only_s", "limit_ratio", "same_as_pick",
              "final_s", "summary"]
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
