"""A mixture of experts at equal memory per device: OSDP's plan vs FSDP2 ZeRO-3 and
ZeRO-2 and DDP on a stock Hugging Face model:

- ``mixtral`` (default): ``MixtralForCausalLM``, each layer's experts one module of 3-D
  weights run by a grouped matmul; the model's own loss with the router's
  load-balancing term;
- ``switch``: ``SwitchTransformersForConditionalGeneration``, one module per expert,
  only those some token was routed to called: OSDP runs its sparse MLPs as leaf modules
  ([Note: leaf modules] in osdp/module_tree.py), DDP looks for unused parameters, and
  FSDP2 (``fully_shard`` per block) is run once apart, in processes of its own: its
  reduce-scatter carries only the parameters with a gradient, so ranks that routed
  differently exchange different sizes (gloo aborts); the bench reports how it ended.

    python bench/moe.py                 # tight, middle and loose budgets, 2 ranks
    python bench/moe.py --model switch --budgets middle

As bench/throughput.py does for the GPT families: every peer runs at the largest batch
whose measured peak fits the budget (a multiple of the model's fp32 parameter bytes P),
OSDP at the batch its plan chose (auto mode at the budget, its peak measured and
checked); FSDP2 shards each block and the root. Samples/s are medians over timed
steps, every peer's steps interleaved in one run; ratios are OSDP / peer. Runs gloo on
CPU, NCCL on GPU. Writes bench/results/moe[_switch]_<device>.csv.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import (ROOT, HFWorkload, osdp_at_plan, peer_at_largest_batch, spawn, time_interleaved, train_step,
                    wrap_peer, write_csv)

# Mixtral scaled to a 2-core CPU: 4 layers, 8 experts of 128 -> 256 -> 128, top 2
MIXTRAL = HFWorkload("MixtralForCausalLM", "MixtralConfig", seq_len=64, vocab_size=1024, hidden_size=128,
                     intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                     output_router_logits=True, router_aux_loss_coef=0.02, attn_implementation="sdpa")
# Switch Transformers as large: 4 encoder and 4 decoder layers, every other one sparse,
# 8 experts of 128 -> 256 -> 128, top 1 (no token dropped: the capacity holds them all)
SWITCH = HFWorkload("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", seq_len=64,
                    block_lists=("encoder.block", "decoder.block"), leaves=("SwitchTransformersSparseMLP",),
                    vocab_size=1024, d_model=128, d_kv=32, d_ff=256, num_layers=4, num_decoder_layers=4,
                    num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, num_heads=4, num_experts=8,
                    expert_capacity=4096, router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0,
                    pad_token_id=0)
WORKLOADS = {"mixtral": MIXTRAL, "switch": SWITCH}
BUDGETS = {"tight": 3.0, "middle": 4.5, "loose": 8.0}  # x fp32 parameter bytes
PEERS = ("osdp", "fsdp_zero3", "fsdp_zero2", "ddp")
# FSDP2 aborts the process on a model whose ranks call different experts (see the docstring)
_BATCH = 1  # the batch FSDP2 is run apart at: few tokens, so the ranks route differently
RUNS_APART = {"switch": ("fsdp_zero3", "fsdp_zero2")}


def _run(rank, world, name, budget_bytes, steps, cache_dir):
    import osdp
    from osdp.planner.cost_model import PlannerSettings

    workload = WORKLOADS[name]
    rows, runs = [], []
    for peer in PEERS:
        start = time.perf_counter()
        if peer in RUNS_APART.get(name, ()):
            continue
        if peer == "osdp":
            torch.manual_seed(0)
            x = workload.tokens(4, seed=0)
            try:
                plan = osdp.auto_plan(workload.build(), {"input_ids": x, "labels": x}, budget_bytes,
                                      cache_dir=cache_dir, settings=PlannerSettings(max_slices=8), progress=False,
                                      comm_sizes=(4096, 65536, 1 << 20, 8 << 20), repeats=2,
                                      leaf_modules=workload.leaf_classes() or None)
            except osdp.InfeasiblePlanError:
                plan = None
            row, model, optim = osdp_at_plan(peer, workload, plan, start)
            rows.append(row)
            if model is None:
                continue
            modes = sorted(model.unit_modes().values())
            row["plan"] = ", ".join(f"{modes.count(m)}x {m}" for m in sorted(set(modes)))
        else:
            row, model, optim = peer_at_largest_batch(peer, workload, budget_bytes)
            rows.append(row)
            if model is None:
                continue
        runs.append((rows[-1], model, optim))
    time_interleaved(runs, workload, steps, world)
    return rows


def _train_two_steps(rank, world, name, peer):
    """``peer`` trains ``name`` for two steps at batch ``_BATCH``, each rank its own tokens
    (a process of its own)."""
    workload = WORKLOADS[name]
    model = wrap_peer(peer, workload)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for seed in range(2):
        train_step(model, optim, workload, _BATCH, seed=seed + 10 * rank)
    return "trained"


def _apart(name: str, peer: str, world: int) -> str:
    """How ``peer`` ended on ``name``, run in processes of their own (it may abort them)."""
    try:
        return spawn(_train_two_steps, world, name, peer)[0]
    except Exception as exc:  # noqa: BLE001 - a rank aborted: how is the result (its stderr says why)
        lines = str(exc).strip().splitlines()
        return f"failed: {lines[-1][:200] if lines else type(exc).__name__}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    parser.add_argument("--budgets", help=f"comma-separated subset of: {', '.join(BUDGETS)}")
    parser.add_argument("--out", help="CSV path (default bench/results/moe_<device>.csv)")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="mixtral")
    args = parser.parse_args(argv)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    budgets = {k: BUDGETS[k] for k in args.budgets.split(",")} if args.budgets else BUDGETS
    workload = WORKLOADS[args.model]
    param_bytes = sum(p.numel() for p in workload.build().parameters()) * 4
    print(f"{workload.model_class} (stock transformers), {param_bytes / 2**20:.1f} MiB of fp32 parameters, "
          f"{args.world_size} ranks on {device}; medians of {args.steps} interleaved steps", flush=True)
    table = []
    for peer in RUNS_APART.get(args.model, ()):
        outcome = _apart(args.model, peer, args.world_size)
        print(f"{peer}, run apart at batch {_BATCH}, each rank its own tokens: {outcome}", flush=True)
        table.append(dict(budget="-", peer=peer, batch=0, plan=outcome, device=device))
    for label, factor in budgets.items():
        budget = int(factor * param_bytes)
        rows = spawn(_run, args.world_size, args.model, budget, args.steps, args.cache_dir)[0]
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
    stem = "moe" if args.model == "mixtral" else f"moe_{args.model}"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{stem}_{device.replace(' ', '_')}.csv"
    write_csv(out, [{k: r.get(k, "") for k in ("budget", "budget_bytes", "peer", "batch", "peak_bytes", "fits",
                                                "step_s", "samples_per_s", "predicted_samples_per_s", "plan",
                                                "bench_s", "device")} for r in table])


if __name__ == "__main__":
    main()
