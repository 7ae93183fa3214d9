"""A mixture of experts at equal memory per device: OSDP's plan vs FSDP2 ZeRO-3 and
ZeRO-2 and DDP on a stock Hugging Face ``MixtralForCausalLM`` (each layer's experts one
module of 3-D weights, run by a grouped matmul; the model's own loss with the router's
load-balancing term).

    python bench/moe.py                 # tight, middle and loose budgets, 2 ranks
    python bench/moe.py --budgets middle

As bench/throughput.py does for the GPT families: every peer runs at the largest batch
whose measured peak fits the budget (a multiple of the model's fp32 parameter bytes P),
OSDP at the batch its plan chose (auto mode at the budget, its peak measured and
checked); FSDP2 shards each decoder layer and the root. Samples/s are medians over timed
steps, every peer's steps interleaved in one run; ratios are OSDP / peer. Runs gloo on
CPU, NCCL on GPU. Writes bench/results/moe_<device>.csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import (ROOT, HFWorkload, measured_peak_bytes, peer_at_largest_batch, spawn, time_interleaved, wrap_peer,
                    write_csv)

# Mixtral scaled to a 2-core CPU: 4 layers, 8 experts of 128 -> 256 -> 128, top 2
MIXTRAL = HFWorkload("MixtralForCausalLM", "MixtralConfig", seq_len=64, vocab_size=1024, hidden_size=128,
                     intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                     output_router_logits=True, router_aux_loss_coef=0.02, attn_implementation="sdpa")
BUDGETS = {"tight": 3.0, "middle": 4.5, "loose": 8.0}  # x fp32 parameter bytes
PEERS = ("osdp", "fsdp_zero3", "fsdp_zero2", "ddp")


def _run(rank, world, budget_bytes, steps, cache_dir):
    import osdp
    from osdp.planner.cost_model import PlannerSettings

    rows, runs = [], []
    for peer in PEERS:
        start = time.perf_counter()
        if peer == "osdp":
            torch.manual_seed(0)
            x = MIXTRAL.tokens(4, seed=0)
            try:
                plan = osdp.auto_plan(MIXTRAL.build(), {"input_ids": x, "labels": x}, budget_bytes,
                                      cache_dir=cache_dir, settings=PlannerSettings(max_slices=8), progress=False,
                                      comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2)
            except osdp.InfeasiblePlanError:
                rows.append(dict(peer=peer, batch=0, peak_bytes=0, step_s=0.0, samples_per_s=0.0))
                continue
            model = wrap_peer("osdp", MIXTRAL, plan=plan)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
            batch = plan.batch_size
            peak = measured_peak_bytes(model, optim, MIXTRAL, batch)
            modes = sorted(model.unit_modes().values())
            rows.append(dict(peer=peer, batch=batch, peak_bytes=peak, bench_s=time.perf_counter() - start,
                             predicted_samples_per_s=plan.predicted.samples_per_s,
                             plan=", ".join(f"{modes.count(m)}x {m}" for m in sorted(set(modes)))))
        else:
            row, model, optim = peer_at_largest_batch(peer, MIXTRAL, budget_bytes)
            rows.append(row)
            if model is None:
                continue
        runs.append((rows[-1], model, optim))
    time_interleaved(runs, MIXTRAL, steps, world)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--budgets", help=f"comma-separated subset of: {', '.join(BUDGETS)}")
    parser.add_argument("--out", help="CSV path (default bench/results/moe_<device>.csv)")
    args = parser.parse_args(argv)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    budgets = {k: BUDGETS[k] for k in args.budgets.split(",")} if args.budgets else BUDGETS
    param_bytes = sum(p.numel() for p in MIXTRAL.build().parameters()) * 4
    print(f"Mixtral (stock transformers), {param_bytes / 2**20:.1f} MiB of fp32 parameters, {args.world_size} ranks "
          f"on {device}; medians of {args.steps} interleaved steps", flush=True)
    table = []
    for label, factor in budgets.items():
        budget = int(factor * param_bytes)
        rows = spawn(_run, args.world_size, budget, args.steps, args.cache_dir)[0]
        osdp_row = rows[0]
        for r in rows:
            r.update(budget=label, budget_bytes=budget, device=device,
                     fits=bool(r["batch"]) and r["peak_bytes"] <= budget)
            table.append(r)
        print(f"{label:<6} budget {budget / 2**20:6.1f} MiB  " + "  ".join(
            f"{r['peer']}: b={r['batch']} {r['samples_per_s']:.1f}/s peak {r['peak_bytes'] / 2**20:.1f} MiB"
            for r in rows), flush=True)
        if osdp_row["batch"]:
            ratios = [f"{r['peer']} {osdp_row['samples_per_s'] / r['samples_per_s']:.2f}x" if r["batch"]
                      else f"{r['peer']} does not fit" for r in rows[1:]]
            print(f"    OSDP plan: {osdp_row['plan']}; OSDP / peer: {', '.join(ratios)}", flush=True)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"moe_{device.replace(' ', '_')}.csv"
    write_csv(out, [{k: r.get(k, "") for k in ("budget", "budget_bytes", "peer", "batch", "peak_bytes", "fits",
                                                "step_s", "samples_per_s", "predicted_samples_per_s", "plan",
                                                "bench_s", "device")} for r in table])


if __name__ == "__main__":
    main()
