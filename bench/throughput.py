"""Throughput at equal memory per device: OSDP's plan vs FSDP2 ZeRO-3, ZeRO-2 and DDP,
and OSDP with planned (per-block) checkpointing vs FSDP2 ZeRO-3 checkpointing every block.

    python bench/throughput.py            # 3 GPT families x 3 budgets, 2 ranks
    python bench/throughput.py --quick    # one model, one budget

For each GPT family scaled to this machine and each memory budget (tight, middle, loose,
as multiples of the model's fp32 parameter bytes P), every peer runs at the largest
batch whose *measured* peak fits the budget (live-tensor tracking on CPU, the allocator
peak on CUDA); OSDP runs at the batch its plan chose (auto mode: profile + plan at the
budget) and its measured peak is checked against the budget. Samples/s are medians over
timed steps, every peer's steps interleaved in one run (a drifting load slows them
alike); ratios are OSDP / peer.
Runs gloo on CPU, NCCL on GPU. Writes bench/results/throughput_<device>.csv and a PNG.
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

from common import PEERS, ROOT, osdp_at_plan, peer_at_largest_batch, spawn, time_interleaved

from osdp.models import GPTConfig

# GPT families scaled to a 2-core CPU (fp32, vocab 1024, seq 64)
MODELS = {
    "N&D 12x128": GPTConfig(vocab_size=1024, seq_len=64, num_layers=12, hidden=128, heads=4),
    "W&S 2x768": GPTConfig(vocab_size=1024, seq_len=64, num_layers=2, hidden=768, heads=12),
    "I&C 6x128-512": GPTConfig(vocab_size=1024, seq_len=64, num_layers=6, hidden=128, heads=4,
                               block_hidden=(128, 512) * 3),
}
BUDGETS = {"tight": 3.0, "middle": 4.5, "loose": 8.0}  # x fp32 parameter bytes


def _run(rank, world, model_name, budget_bytes, steps, cache_dir):
    import osdp
    from osdp.models import GPT, example_batch
    from osdp.planner.cost_model import PlannerSettings

    config = MODELS[model_name]
    rows = []
    plans = {}
    # OSDP in auto mode: profile, plan at the budget, run at the plan's batch
    for peer, checkpointing in (("osdp", "none"), ("osdp_ckpt", "auto")):
        torch.manual_seed(0)
        try:
            plans[peer] = osdp.auto_plan(GPT(config), example_batch(config, 4), budget_bytes, cache_dir=cache_dir,
                                         settings=PlannerSettings(max_slices=8, checkpointing=checkpointing),
                                         progress=False, comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2)
        except osdp.InfeasiblePlanError:
            plans[peer] = None
    runs = []  # (row, model, optim) of every peer that fits, timed together below
    for peer in PEERS:
        start = time.perf_counter()
        if peer in plans:
            row, model, optim = osdp_at_plan(peer, config, plans[peer], start)
            rows.append(row)
            if model is None:
                continue
        else:
            row, model, optim = peer_at_largest_batch(peer, config, budget_bytes)
            rows.append({**row, "predicted_samples_per_s": ""})
            if model is None:
                continue
        runs.append((rows[-1], model, optim))
    time_interleaved(runs, config, steps, world)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--models", help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--budgets", help=f"comma-separated subset of: {', '.join(BUDGETS)}")
    parser.add_argument("--out", help="CSV path (default bench/results/throughput_<device>.csv)")
    args = parser.parse_args(argv)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    budgets = {"middle": BUDGETS["middle"]} if args.quick else BUDGETS
    if args.models:
        models = {k: MODELS[k] for k in args.models.split(",")}
    if args.budgets:
        budgets = {k: BUDGETS[k] for k in args.budgets.split(",")}
    table = []
    for name, config in models.items():
        param_bytes = sum(p.numel() for p in GPT_params(config)) * 4
        for label, factor in budgets.items():
            budget = int(factor * param_bytes)
            rows = spawn(_run, args.world_size, name, budget, args.steps, args.cache_dir)[0]
            # OSDP against the best peer that fits, without checkpointing; OSDP with
            # (planned) checkpointing against FSDP ZeRO-3 with checkpointing on every block
            best_peer = max((r for r in rows if r["peer"] in ("fsdp_zero3", "fsdp_zero2", "ddp") and r["batch"]),
                            key=lambda r: r["samples_per_s"], default=None)
            osdp_row = rows[0]
            ckpt_rows = {r["peer"]: r for r in rows if r["peer"].endswith("ckpt")}
            for r in rows:
                r.update(model=name, budget=label, budget_bytes=budget, device=device,
                         fits=bool(r["batch"]) and r["peak_bytes"] <= budget)
                table.append(r)
            ratio = (osdp_row["samples_per_s"] / best_peer["samples_per_s"]) if best_peer and osdp_row["batch"] else None
            o, f = ckpt_rows["osdp_ckpt"], ckpt_rows["fsdp_zero3_ckpt"]
            ckpt_ratio = o["samples_per_s"] / f["samples_per_s"] if o["batch"] and f["batch"] else None
            print(f"{name:<16} {label:<6} budget {budget / 2**20:7.1f} MiB  " + "  ".join(
                f"{r['peer']}: b={r['batch']} {r['samples_per_s']:.1f}/s peak {r['peak_bytes'] / 2**20:.1f}MiB"
                for r in rows), flush=True)
            print(f"    OSDP / best peer: {f'{ratio:.2f}x' if ratio else '-'} ({best_peer['peer'] if best_peer else 'none fits'});"
                  f" OSDP+ckpt / FSDP+ckpt: {f'{ckpt_ratio:.2f}x' if ckpt_ratio else '-'}", flush=True)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"throughput_{device.replace(' ', '_')}.csv"
    fields = ["model", "budget", "budget_bytes", "peer", "batch", "peak_bytes", "fits", "step_s", "samples_per_s",
              "predicted_samples_per_s", "bench_s", "device"]
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {out}")
    _plot(table, out.with_suffix(".png"))


def GPT_params(config):
    from osdp.models import GPT

    return GPT(config).parameters()


def _plot(table, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({(r["model"], r["budget"]) for r in table}, key=lambda g: (g[0], list(BUDGETS).index(g[1])))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / len(PEERS)
    for i, peer in enumerate(PEERS):
        values = [next((r["samples_per_s"] for r in table if (r["model"], r["budget"]) == g and r["peer"] == peer), 0)
                  for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=peer)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{m}\n{b}" for m, b in groups], fontsize=7)
    ax.set_ylabel("samples/s (measured)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
