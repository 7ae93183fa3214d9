"""Model fidelity: predicted vs measured step time and peak memory for a grid of plans.

    python bench/fidelity.py            # 3 GPT families x {all dp, all zdp, searched, split}
    python bench/fidelity.py --quick    # one model

The cluster is profiled first (osdp.profile: collectives, per-unit compute fits), then for
each model and plan kind the planner predicts step time and peak memory at a fixed batch,
OSDP trains with exactly that plan, and the measurement is set beside the prediction:
median step time over timed steps; peak memory from the allocator on CUDA, from live
tensors on CPU (osdp.memtrack), max over ranks. Targets: step time within 10%, peak
memory within 5% and never above the limit. Writes fidelity_<device>.csv into --out-dir
(default bench/results); its peak_source column says which peak was measured.
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
import torch

from common import ROOT, measured_peak_bytes, median_step_s, spawn, wrap_peer

from osdp.models import GPTConfig

MODELS = {
    "N&D 12x128": GPTConfig(vocab_size=1024, seq_len=64, num_layers=12, hidden=128, heads=4),
    "W&S 2x768": GPTConfig(vocab_size=1024, seq_len=64, num_layers=2, hidden=768, heads=12),
    "I&C 6x128-512": GPTConfig(vocab_size=1024, seq_len=64, num_layers=6, hidden=128, heads=4,
                               block_hidden=(128, 512) * 3),
}
KINDS = ("all_dp", "all_zdp", "searched", "split4_mixed")
BATCH = 4


def plan_of_kind(desc, device, kind: str, batch: int):
    """A Plan of one kind at ``batch`` with the cost model's predictions."""
    from osdp.planner.cost_model import PlannerSettings, build_template
    from osdp.planner.planner import plan_from_schedule
    from osdp.planner.scheduler import Scheduled, _finish, schedule
    from osdp.planner.search import evaluate_assignment
    from osdp.planner.search_problem import SearchResult

    if kind == "searched":
        return plan_from_schedule(schedule(desc, device, PlannerSettings(max_slices=4), batch=batch))
    settings = PlannerSettings(max_slices=4)
    t = build_template(desc, device, settings)
    choice = []
    for i, op in enumerate(desc.ops):
        options = range(t.opt_begin[i, 0], t.opt_end[i, 0])
        if kind == "all_dp":
            want = (1, 0)
        elif kind == "all_zdp":
            want = (1, 1)
        else:  # every splittable op in 4 slices, half of them zdp; the rest zdp
            want = (4, 2) if 4 in {int(t.opt_slices[o]) for o in options} else (1, 1)
        match = [o for o in options if (int(t.opt_slices[o]), int(t.opt_zdp[o])) == want or op.tied_to]
        choice.append(match[0])
    variant = [0] * len(t.segments)
    problem = t.problem(batch)
    _, time_s, peak, peak_op = evaluate_assignment(problem, choice, variant)
    result = SearchResult(True, time_s, peak, peak_op, tuple(choice), tuple(variant))
    scheduled = _finish(t, batch, result, 0, 0.0)
    assert isinstance(scheduled, Scheduled)
    return plan_from_schedule(scheduled)


def _run(rank, world, model_name, limit_bytes, steps, cache_dir):
    from osdp.models import GPT, example_batch
    from osdp.planner.profiler import profile

    config = MODELS[model_name]
    torch.manual_seed(0)
    desc, cluster, run = profile(GPT(config), example_batch(config, BATCH), memory_limit=limit_bytes,
                                 cache_dir=cache_dir, progress=False, comm_sizes=(4096, 65536, 1 << 20, 8 << 20),
                                 repeats=2)
    device = cluster.for_run(run)
    rows = []
    for kind in KINDS:
        plan = plan_of_kind(desc, device, kind, BATCH)
        model = wrap_peer("osdp", config, plan=plan)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        peak = measured_peak_bytes(model, optim, config, BATCH)
        step_s = median_step_s(model, optim, config, BATCH, steps)
        rows.append(dict(kind=kind, predicted_step_s=plan.predicted.step_s, measured_step_s=step_s,
                         predicted_peak_bytes=plan.predicted.peak_bytes, measured_peak_bytes=peak,
                         limit_bytes=limit_bytes))
        del model, optim
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
    args = parser.parse_args(argv)
    # measured_peak_bytes (common.py): the allocator's peak on CUDA, live tensors on CPU
    peak_source = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "live_tensors"
    t_start = time.time()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    table = []
    print(f"{'model':<16} {'plan':<13} {'step ms pred':>12} {'meas':>8} {'err':>7}   "
          f"{'peak MiB pred':>13} {'meas':>8} {'err':>7}")
    for name in models:
        if args.budget_s is not None and time.time() - t_start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s reached; stopping before {name}")
            break
        rows = spawn(_run, args.world_size, name, int(args.limit_mib * 2**20), args.steps, args.cache_dir)[0]
        for r in rows:
            r.update(model=name, device=device, peak_source=peak_source,
                     step_err=r["predicted_step_s"] / r["measured_step_s"] - 1,
                     peak_err=r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1)
            table.append(r)
            print(f"{name:<16} {r['kind']:<13} {r['predicted_step_s'] * 1e3:12.1f} {r['measured_step_s'] * 1e3:8.1f} "
                  f"{r['step_err']:+7.1%}   {r['predicted_peak_bytes'] / 2**20:13.1f} "
                  f"{r['measured_peak_bytes'] / 2**20:8.1f} {r['peak_err']:+7.1%}", flush=True)
    if not table:
        print("no model measured within the budget; nothing written")
        return
    step_errs = [abs(r["step_err"]) for r in table]
    peak_errs = [abs(r["peak_err"]) for r in table]
    print(f"median |error|: step time {np.median(step_errs):.1%}, peak memory {np.median(peak_errs):.1%}; "
          f"within target: step {sum(e <= 0.10 for e in step_errs)}/{len(table)}, "
          f"peak {sum(e <= 0.05 for e in peak_errs)}/{len(table)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"fidelity_{device.replace(' ', '_')}.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
