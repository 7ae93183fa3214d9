"""Model fidelity: predicted vs measured step time and peak memory for a grid of plans.

    python bench/fidelity.py            # 3 GPT families x {all dp, all zdp, searched, split,
                                        #   all zdp with every block checkpointed}
    python bench/fidelity.py --quick    # one model

The cluster is profiled first (osdp.profile: collectives, per-unit compute fits), then for
each model and plan kind the planner predicts step time and peak memory at a fixed batch,
OSDP trains with exactly that plan, and the measurement is set beside the prediction:
measured on the runtime by osdp.profiler.measure_plan (the wrapped model, real scheduler
and coalescing; the median step, slowest rank; peak memory of one step from the
allocator on CUDA, from live tensors on CPU). Then the model is calibrated as auto mode
does (osdp.planner.calibration.refit to the measurements of --calibrate-on, default the
searched plan and FSDP) and every plan predicted again: the table shows the additive
cost model and the step simulation, before and after. Targets: step time within 10%,
peak memory within 5% and never above the limit. Writes fidelity_<device>.csv into --out-dir
(default bench/results); its peak_source column says which peak was measured. Columns
uncal_* are the profile's model before calibration, cal_* after it (the targets' figures).
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
import torch

from common import ROOT, spawn

from osdp.models import GPTConfig

MODELS = {
    "N&D 12x128": GPTConfig(vocab_size=1024, seq_len=64, num_layers=12, hidden=128, heads=4),
    "W&S 2x768": GPTConfig(vocab_size=1024, seq_len=64, num_layers=2, hidden=768, heads=12),
    "I&C 6x128-512": GPTConfig(vocab_size=1024, seq_len=64, num_layers=6, hidden=128, heads=4,
                               block_hidden=(128, 512) * 3),
}
KINDS = ("all_dp", "all_zdp", "searched", "split4_mixed", "all_zdp_ckpt")
HALF = "all_zdp@half"  # FSDP at half the batch: a calibration reference, not a row of the table
SPLIT = "split_zdp@ref"  # FSDP with its splittable ops in slices (osdp.auto.split_reference): likewise
BATCH = 4


def _settings():
    from osdp.planner.cost_model import PlannerSettings

    # this bench steps torch's AdamW on CPU: its for-loop ([Note: optimizer step moment])
    return PlannerSettings(max_slices=4, optimizer_temporaries="per_tensor")


def plan_of_kind(desc, device, kind: str, batch: int):
    """A Plan of one kind at ``batch`` with the cost model's predictions."""
    from osdp.planner.planner import plan_from_schedule
    from osdp.planner.batch_sweep import schedule
    from osdp.planner.uniform_plan import uniform_plan

    settings = _settings()
    if kind == "searched":
        return plan_from_schedule(schedule(desc, device, settings, batch=batch))
    # split4_mixed: every splittable op in 4 slices, half of them zdp; the rest zdp.
    # all_zdp_ckpt: FSDP with every block checkpointed (recompute's activations and
    # gathers are priced nowhere else in this table)
    shape = {"all_dp": dict(slices=1, zdp_slices=0), "all_zdp": dict(slices=1, zdp_slices=1),
             "split4_mixed": dict(slices=4, zdp_slices=2),
             "all_zdp_ckpt": dict(slices=1, zdp_slices=1, checkpointed=True)}[kind]
    return uniform_plan(desc, device, settings, batch, **shape)


def _predict(desc, device, plan):
    """(additive step, simulated step, peak) of ``plan`` on ``device``."""
    from osdp.planner import calibration as cal
    from osdp.planner.cost_model import evaluate

    a = cal.assignment_of(desc, device, plan)
    est = evaluate(a.template, a.batch, a.option_index, a.variant)
    return est.step_s, cal.simulate(a, device).step_s, est.peak_bytes


def _run(rank, world, model_name, limit_bytes, steps, cache_dir, calibrate_on):
    from osdp.auto import split_reference
    from osdp.models import GPT, example_batch
    from osdp.planner import calibration as cal
    from osdp.profiler.hardware import profile
    from osdp.profiler import measure_plans

    config = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(config)
    inputs = example_batch(config, BATCH)
    desc, cluster, run = profile(model, inputs, memory_limit=limit_bytes,
                                 cache_dir=cache_dir, progress=False, comm_sizes=(4096, 65536, 1 << 20, 8 << 20),
                                 repeats=2)
    device = cluster.for_run(run)
    plans = {kind: plan_of_kind(desc, device, kind, BATCH) for kind in KINDS}
    # auto mode's references also measure FSDP at half the batch (it tells the runtime's
    # per-unit overhead from compute) and FSDP split (more unit uses and collectives per
    # FLOP); measured here for the calibration only
    plans[HALF] = plan_of_kind(desc, device, "all_zdp", max(1, BATCH // 2))
    split = split_reference(desc, device, _settings(), BATCH)
    if split is not None:
        plans[SPLIT] = split
    # every plan measured on the runtime (osdp.profiler.measure_plans: the wrapped model,
    # real scheduler and coalescing; steps interleaved across the plans; median step,
    # slowest rank; peak of one step)
    measured = dict(zip(plans, measure_plans(model, list(plans.values()), inputs, steps=steps, group_times=False)))
    # calibration as auto mode does it: refit to the measured plans of ``calibrate_on``
    # (the others are out of sample)
    calibrated = cal.refit(desc, device, [(plans[k], measured[k]) for k in calibrate_on if k in plans]) \
        if calibrate_on else None
    rows = []
    for kind in KINDS:
        m = measured[kind]
        row = dict(kind=kind, in_calibration=kind in calibrate_on, measured_step_s=m.step_s,
                   measured_peak_bytes=m.peak_bytes, limit_bytes=limit_bytes)
        for tag, dev in (("uncal_", device), ("cal_", calibrated)):
            if dev is None:
                continue
            step, sim, peak = _predict(desc, dev, plans[kind])
            row.update({f"{tag}predicted_step_s": step, f"{tag}simulated_step_s": sim, f"{tag}predicted_peak_bytes": peak})
        rows.append(row)
    if calibrated is not None:
        rows[0]["factors"] = repr(calibrated.calibration)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--limit-mib", type=float, default=512)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new model after this many seconds")
    parser.add_argument("--models", nargs="*", default=None, help=f"model names (default all): {list(MODELS)}")
    parser.add_argument("--calibrate-on", nargs="*", default=["searched", "all_zdp", HALF, SPLIT],
                        help=f"plan kinds whose measurements calibrate the model (as auto mode: its plan and FSDP at "
                             f"the batch and at half of it, {HALF!r}, and split, {SPLIT!r}); none: no calibration")
    args = parser.parse_args(argv)
    # measured_peak_bytes (common.py): the allocator's peak on CUDA, live tensors on CPU
    peak_source = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "live_tensors"
    t_start = time.time()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    if args.models:
        models = {k: MODELS[k] for k in args.models}
    calibrate_on = tuple(k for k in args.calibrate_on if k != "none")
    table = []
    print(f"{'model':<16} {'plan':<13} {'meas ms':>8} | {'pred':>8} {'err':>7} {'sim':>8} {'err':>7} | "
          f"{'cal pred':>8} {'err':>7} {'cal sim':>8} {'err':>7} | {'peak MiB meas':>13} {'pred':>7} {'err':>7} "
          f"{'cal':>7} {'err':>7}")
    for name in models:
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s reached; stopping before {name}")
            break
        rows = spawn(_run, args.world_size, name, int(args.limit_mib * 2**20), args.steps, args.cache_dir,
                     calibrate_on)[0]
        if "factors" in rows[0]:
            print(f"{name}: calibrated on {list(calibrate_on)}: {rows[0].pop('factors')}")
        for r in rows:
            r.update(model=name, device=device, peak_source=peak_source)
            for tag in ("uncal_", "cal_"):
                if f"{tag}predicted_step_s" in r:
                    r[f"{tag}step_err"] = r[f"{tag}predicted_step_s"] / r["measured_step_s"] - 1
                    r[f"{tag}sim_err"] = r[f"{tag}simulated_step_s"] / r["measured_step_s"] - 1
                    r[f"{tag}peak_err"] = r[f"{tag}predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
            table.append(r)
            cal = (f"{r['cal_predicted_step_s'] * 1e3:8.1f} {r['cal_step_err']:+7.1%} "
                   f"{r['cal_simulated_step_s'] * 1e3:8.1f} {r['cal_sim_err']:+7.1%}" if "cal_step_err" in r
                   else f"{'-':>8} {'':>7} {'-':>8} {'':>7}")
            cal_peak = (f"{r['cal_predicted_peak_bytes'] / 2**20:7.1f} {r['cal_peak_err']:+7.1%}" if "cal_peak_err" in r
                        else f"{'-':>7} {'':>7}")
            mark = "*" if r["in_calibration"] else " "
            print(f"{name:<16} {r['kind'] + mark:<13} {r['measured_step_s'] * 1e3:8.1f} | "
                  f"{r['uncal_predicted_step_s'] * 1e3:8.1f} {r['uncal_step_err']:+7.1%} "
                  f"{r['uncal_simulated_step_s'] * 1e3:8.1f} {r['uncal_sim_err']:+7.1%} | {cal} | "
                  f"{r['measured_peak_bytes'] / 2**20:13.1f} {r['uncal_predicted_peak_bytes'] / 2**20:7.1f} "
                  f"{r['uncal_peak_err']:+7.1%} {cal_peak}", flush=True)
    if not table:
        print("no model measured within the budget; nothing written")
        return
    print("(* calibrated on this plan's measurement; the others are out of sample)")
    for tag, label in (("uncal_", "before calibration"), ("cal_", "after calibration")):
        if f"{tag}step_err" not in table[0]:
            continue
        for key, what in (("step_err", "additive model"), ("sim_err", "step simulation")):
            errs = [abs(r[tag + key]) for r in table]
            out = [abs(r[tag + key]) for r in table if not r["in_calibration"]]
            print(f"{label}, {what}: step time |error| median {np.median(errs):.1%}, worst {max(errs):.1%}"
                  + (f"; out of sample median {np.median(out):.1%}, worst {max(out):.1%}" if out and tag == "cal_" else ""))
        peak_errs = [abs(r[tag + "peak_err"]) for r in table]
        print(f"{label}: peak memory |error| median {np.median(peak_errs):.1%}, worst {max(peak_errs):.1%}; "
              f"measured peak over the limit in {sum(r['measured_peak_bytes'] > r['limit_bytes'] for r in table)}"
              f"/{len(table)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"fidelity_{device.replace(' ', '_')}.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
