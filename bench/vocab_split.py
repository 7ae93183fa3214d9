"""Issue 15 item 4: the embedding / vocabulary head whole vs split vs split + fused loss,
measured on a W&S-shaped GPT (wide for its depth, tied embedding, vocabulary much larger
than the hidden size) scaled to this machine, 2 gloo ranks (NCCL on GPUs).

Variants, every other unit zdp (FSDP-like) so that only the embedding/head differs:
  whole       the tied wte/lm_head weight one unit, gathered whole; logits materialized
  split       wte split by rows into G slices (the head its tied use, cut along the
              vocabulary), but the loss is F.cross_entropy of the full logits
  split_fused the same split, loss fused with the head (SplitLinearOut.cross_entropy,
              [Note: fused head on split slices]): no [tokens, vocab] logits
For each: the largest batch whose measured peak (live tensors on CPU, max over ranks)
fits one budget (and, comparable across variants, the peak at batch 1), then the median step time of repeated steps at that batch
(memory_check=False: the per-step check is off while timing), the variants' timing
rounds interleaved.

    python bench/vocab_split.py            # writes bench/results/vocab_split_<device>.csv
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import (ROOT, GPT, GPTConfig, device_for, largest_fitting_batch_of, measured_peak_bytes, median_step_s,
                    spawn)

VARIANTS = ("whole", "split", "split_fused")


class GPTFullLogits(GPT):
    """The GPT with its loss always computed from the full logits (the unfused path)."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(variant: str, config: GPTConfig, slices: int):
    import osdp

    torch.manual_seed(0)
    model = (GPTFullLogits if variant == "split" else GPT)(config)
    kwargs = dict(default_mode="zdp", memory_check=False, device=device_for(dist.get_rank()))
    if variant != "whole":
        kwargs["modes"] = {"wte": ("zdp",) * slices}
    return osdp.OSDP(model, **kwargs)


def run(rank: int, world: int, config: GPTConfig, slices: int, budget_bytes: int, steps: int, max_batch: int,
        repeats: int):
    models, rows = {}, []
    for variant in VARIANTS:  # the batch each fits, and the peak at batch 1 (comparable)
        model = build(variant, config, slices)
        batch, peak = largest_fitting_batch_of(model, config, budget_bytes, max_batch)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        peak_b1 = measured_peak_bytes(model, optim, config, 1)
        models[variant] = (model, optim, batch)
        rows.append(dict(variant=variant, batch=batch, peak_bytes=peak, peak_b1_bytes=peak_b1))
    # timing: the variants interleaved, `repeats` rounds of `steps` steps each (a loaded
    # machine drifts; interleaving spreads the drift over all variants)
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant, (model, optim, batch) in models.items():
            if batch > 0:
                times[variant].append(median_step_s(model, optim, config, batch, steps))
    for r in rows:
        r["step_s"] = statistics.median(times[r["variant"]]) if times[r["variant"]] else float("nan")
        r["samples_per_s"] = world * r["batch"] / r["step_s"] if r["batch"] else 0.0
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--budget-mib", type=float, default=200.0)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round (median)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of timing, variants interleaved (median)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers, hidden=args.hidden,
                       heads=4, tie_embeddings=True)
    budget = int(args.budget_mib * 2**20)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = spawn(run, args.world, config, args.slices, budget, args.steps, args.max_batch, args.repeats,
                 backend=backend)[0]
    device = "gpu" if torch.cuda.is_available() else "cpu"
    base = rows[0]
    print(f"{config}, {args.world} ranks ({backend}), wte/lm_head in {args.slices} slices, "
          f"budget {args.budget_mib:.0f} MiB per rank, median of {args.repeats} interleaved rounds of "
          f"{args.steps} steps")
    print(f"{'variant':<12} {'batch':>5} {'peak MiB':>9} {'peak@1 MiB':>10} {'step s':>8} {'samples/s':>10} "
          f"{'peak@1/whole':>12} {'thpt/whole':>10}")
    for r in rows:
        r["peak_b1_vs_whole"] = r["peak_b1_bytes"] / base["peak_b1_bytes"]
        r["throughput_vs_whole"] = r["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else float("nan")
        print(f"{r['variant']:<12} {r['batch']:>5} {r['peak_bytes'] / 2**20:>9.2f} {r['peak_b1_bytes'] / 2**20:>10.2f} "
              f"{r['step_s']:>8.3f} {r['samples_per_s']:>10.2f} {r['peak_b1_vs_whole']:>12.2f} "
              f"{r['throughput_vs_whole']:>10.2f}")
    out = ROOT / "bench" / "results" / f"vocab_split_{device}.csv"
    with open(out, "w", newline="") as f:
        fields = ["variant", "vocab", "hidden", "layers", "seq", "slices", "world", "budget_bytes", "batch",
                  "steps", "repeats", "peak_bytes", "peak_b1_bytes", "step_s", "samples_per_s", "peak_b1_vs_whole", "throughput_vs_whole"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, vocab=args.vocab, hidden=args.hidden, layers=args.layers, seq=args.seq,
                            slices=args.slices, world=args.world, budget_bytes=budget,
                            steps=args.steps, repeats=args.repeats))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
