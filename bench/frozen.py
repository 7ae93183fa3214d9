"""Frozen units priced as frozen ([Note: frozen units]): what a plan made knowing what is
frozen gains over one priced as if everything trained (the planner before), in one run.

    python bench/frozen.py            # a stock Llama, 2 gloo ranks, two freezing patterns
    python bench/frozen.py --quick    # fewer timed rounds

For each pattern (the head alone trains; LoRA-like: the attention's q and v projections and
the head train, everything else frozen) two plans at the planner's own best batch: auto
mode's (profiled, planned knowing what is frozen, calibrated), and one made from the same
profile and calibrated factors with every unit marked trainable (what the planner priced
before it read ``requires_grad``). Each plan trains the model (frozen as the
pattern says) for a few steps; their steps are timed interleaved (the load of a shared
machine drifts between plans timed apart) and medians quoted. Printed per pattern: each
plan's batch, predicted and measured peak against the budget, samples/s, and the ratio
frozen-aware / priced-trainable.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import time

import torch

from common import ROOT, _without_bench_dir, spawn

SEQ, VOCAB = 64, 4096
PATTERNS = {
    "head only": ("lm_head.",),
    "q,v + head": ("q_proj.", "v_proj.", "lm_head."),
}


def build(trained: tuple[str, ...]):
    with _without_bench_dir():  # bench/kernels.py is not Hugging Face's kernels package
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False))
    for name, p in model.named_parameters():
        p.requires_grad_(any(part in name for part in trained))
    return model


def tokens(batch: int, seed: int) -> dict:
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x, "labels": x}


def run(rank: int, world: int, budget: int, rounds: int, cache_dir: str):
    import osdp
    from osdp.planner import make_plan
    from osdp.planner.cost_model import PlannerSettings
    from osdp.planner.device import Calibration
    from osdp.profiler import profile

    rows = []
    for pattern, trained in PATTERNS.items():
        # frozen-aware: auto mode as a user runs it (profiled, planned, calibrated)
        aware = osdp.OSDP(build(trained), memory_limit=budget, example_inputs=tokens(2, 0),
                          auto_kwargs=dict(cache_dir=cache_dir, progress=False))
        # priced trainable: the same profile and calibrated factors, every unit trainable
        desc, cluster, run_settings = profile(build(trained), tokens(2, 0), memory_limit=budget,
                                              cache_dir=cache_dir, progress=False)
        device = cluster.for_run(run_settings)
        factors = aware.plan.calibration.factors
        if factors:
            device = device.with_(calibration=Calibration(**factors))
        as_trainable = dataclasses.replace(desc, ops=tuple(
            dataclasses.replace(op, trainable=True, in_backward=True) for op in desc.ops))
        plan = make_plan(as_trainable, device, PlannerSettings())
        runs = {"frozen-aware": aware, "priced trainable": osdp.OSDP(build(trained), plan=plan)}
        runs = {name: (model.plan, model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                             lr=1e-4))
                for name, model in runs.items()}
        times = {name: [] for name in runs}
        for r in range(rounds + 1):  # round 0 warms up (AdamW's state, the first gathers)
            for name, (plan, model, optim) in runs.items():
                start = time.perf_counter()
                out = model(**tokens(plan.batch_size, 10 * r + rank))  # held through the step, as priced
                out.loss.backward()
                optim.step()
                optim.zero_grad()
                del out
                elapsed = torch.tensor(time.perf_counter() - start)
                torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
                if r:
                    times[name].append(float(elapsed))
        for name, (plan, model, optim) in runs.items():
            with model.measuring_memory(optim) as measured:  # one more step, the runtime's tracker on
                out = model(**tokens(plan.batch_size, 1000 + rank))
                out.loss.backward()
                optim.step()
                optim.zero_grad()
                del out
            step = measured[0]
            rows.append(dict(pattern=pattern, plan=name, batch=plan.batch_size,
                             predicted=plan.predicted.peak_bytes, measured=step.peak_bytes,
                             predicted_at=plan.predicted.peak_op, measured_at=step.where,
                             predicted_samples_per_s=plan.predicted.samples_per_s,
                             modes=dict(collections.Counter(m for u in plan.units for m in u.modes)),
                             split={u.name: u.slices for u in plan.units if u.slices > 1},
                             breakdown={k: round(v * 2.0**-20, 2) for k, v in plan.predicted.breakdown.items() if v},
                             samples_per_s=plan.batch_size * world / statistics.median(times[name]),
                             trained=sum(p.numel() for p in model.parameters() if p.requires_grad)))
        del runs
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-mib", type=float, default=56.0)
    parser.add_argument("--cache-dir", default=str(ROOT / "bench" / "results" / ".profile-cache"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budget = int(args.budget_mib * 2**20)
    rounds = 3 if args.quick else 7
    rows = spawn(run, 2, budget, rounds, args.cache_dir)[0]
    mib = 2.0**-20
    print(f"# python bench/frozen.py{' --quick' if args.quick else ''}: stock Llama 4 x 256, vocabulary {VOCAB}, "
          f"seq {SEQ}, 2 gloo ranks, budget {args.budget_mib:g} MiB, {rounds} interleaved timed steps (medians)")
    print(f"{'pattern':12s} {'plan':17s} {'batch':>5s} {'pred MiB':>9s} {'meas MiB':>9s} {'samples/s':>10s}")
    for row in rows:
        print(f"{row['pattern']:12s} {row['plan']:17s} {row['batch']:5d} {row['predicted'] * mib:9.2f} "
              f"{row['measured'] * mib:9.2f} {row['samples_per_s']:10.1f}  predicted at {row['predicted_at']}, "
              f"measured {row['measured_at']}; predicted {row['predicted_samples_per_s']:.1f} samples/s, "
              f"modes {row['modes']}, split {row['split']}")
    for pattern in PATTERNS:
        aware, before = (next(r for r in rows if r["pattern"] == pattern and r["plan"] == p)
                         for p in ("frozen-aware", "priced trainable"))
        print(f"{pattern}: frozen-aware / priced trainable = {aware['samples_per_s'] / before['samples_per_s']:.2f}x "
              f"samples/s (batch {aware['batch']} vs {before['batch']}); measured peaks within the budget: "
              f"{aware['measured'] <= budget and before['measured'] <= budget}")


if __name__ == "__main__":
    main()
