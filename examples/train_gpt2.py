"""Train a GPT-2 with OSDP under torchrun: auto mode, AdamW with two parameter groups,
gradient clipping, gradient accumulation, sharded checkpoints with resume, logging and
a clean exit.

    torchrun --nproc_per_node 2 --standalone examples/train_gpt2.py --steps 20
    torchrun --nproc_per_node 2 --standalone examples/train_gpt2.py --steps 40 --resume

The model is a stock Hugging Face ``GPT2LMHeadModel`` (tiny by default: a few layers, a
small vocabulary) built from a config, no download; without ``transformers`` (or with
``--model osdp``) it is ``osdp.models.GPT``, the same architecture. The data is
synthetic and learnable (every sequence counts up by one from a random start), a pure
function of (seed, step, micro-batch, rank), so a resumed run sees exactly the batches
the uninterrupted run would have seen. On this CPU the defaults run in seconds.

What each piece does:

1. ``dist.init_process_group`` from torchrun's environment (gloo on CPU, NCCL on GPU).
2. ``osdp.OSDP(model, memory_limit=..., example_inputs={"input_ids": x, "labels": x})``
   profiles the model through its keyword forward, backward on ``output.loss``, plans
   on rank 0 and broadcasts the plan; ``model.batch_size`` is the micro-batch per rank
   and ``model.accumulation_steps`` the micro-batches per optimizer step (the planner
   picks them for ``--global-batch``, or ``--micro-batch`` fixes the micro-batch).
3. AdamW over ``model.named_parameters()``, which yields the ORIGINAL names, each once
   (``transformer.h.0.attn.c_attn.weight``, a split weight too): no weight decay for
   biases and norms.
4. Each step: ``with model.micro_batch(i)`` for every micro-batch (gradients are
   reduce-scattered in the last one only), ``model.clip_grad_norm_`` (the global norm,
   the same on every rank), ``optimizer.step``.
5. ``osdp.checkpoint.save`` every ``--save-every`` steps (sharded, atomic, with the
   optimizer state); ``--resume`` loads the newest checkpoint in ``--ckpt-dir`` (any
   world size or plan) and goes on from its step.
6. ``osdp.launch.run_main(main)``: the exit code of ``main``, and ``osdp.launch.finish``
   (barrier, destroy_process_group, flush, ``os._exit``): no gloo teardown abort.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

import osdp
import osdp.planner
import osdp.checkpoint as ckpt
from osdp.launch import run_main

log = logging.getLogger("train_gpt2")
CKPT_PATTERN = re.compile(r"^step_(\d+)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("auto", "hf", "osdp"), default="auto",
                   help="hf: transformers GPT2LMHeadModel; osdp: osdp.models.GPT; auto: hf if installed")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to reach (counted from 0, across resumes)")
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step over all ranks")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per rank per micro-batch (default: the planner chooses)")
    p.add_argument("--memory", default="256MiB", help="per-device memory the plan must fit in")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping threshold (global norm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="checkpoints/train_gpt2")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints (and one at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--metrics", default=None, help="rank 0 appends one JSON line per step to this file")
    p.add_argument("--cache-dir", default=None, help="profile cache (default $OSDP_CACHE_DIR or ~/.cache/osdp)")
    return p.parse_args(argv)


# ---- model and data ------------------------------------------------------------------
def build_model(args):
    """(model, kind, loss(model, tokens)): the stock HF GPT-2 or osdp's GPT."""
    kind = args.model
    if kind == "auto":
        try:
            import transformers  # noqa: F401
            kind = "hf"
        except ImportError:
            kind = "osdp"
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if kind == "hf":
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(
            vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers,
            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )
        model = transformers.GPT2LMHeadModel(config)

        def loss(model, tokens):  # HF shifts the labels inside: next-token loss
            return model(input_ids=tokens, labels=tokens).loss

        def example(tokens):
            return {"input_ids": tokens, "labels": tokens}
    else:
        from osdp.models import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, num_layers=args.layers,
                              hidden=args.hidden, heads=args.heads))

        def loss(model, tokens):
            return model(tokens[:, :-1], tokens[:, 1:])

        def example(tokens):
            return (tokens[:, :-1], tokens[:, 1:])
    return model, kind, loss, example


def batch_for(args, step: int, micro: int, rank: int, size: int) -> torch.Tensor:
    """Counting sequences from random starts; a pure function of its arguments."""
    gen = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 1009 + micro) * 1013 + rank)
    length = args.seq_len if args.model != "osdp" else args.seq_len + 1
    start = torch.randint(0, args.vocab, (size, 1), generator=gen)
    return (start + torch.arange(length)) % args.vocab


def no_decay(name: str) -> bool:
    """Biases and norm weights: ``...bias``, modules named ln_*/…norm…."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    return parts[-1] == "bias" or module.startswith("ln") or "norm" in module


def make_optimizer(model, args):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not no_decay(n)]
    plain = [p for n, p in named if no_decay(n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": plain, "weight_decay": 0.0}],
        lr=args.lr,
    ), (len(decay), len(plain))


# ---- checkpoints -----------------------------------------------------------------------
def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in ckpt_dir.glob("step_*") if (m := CKPT_PATTERN.match(p.name)) and p.is_dir()]
    return max(found)[1] if found else None


# ---- main ------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(message)s", datefmt="%H:%M:%S")
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the world size {world}")

    model, kind, loss_of, example = build_model(args)
    args.model = kind
    log.info("model: %s GPT-2, %d layers, hidden %d, %.2fM parameters; %d ranks (%s)",
             "Hugging Face" if kind == "hf" else "osdp.models", args.layers, args.hidden,
             sum(p.numel() for p in model.parameters()) / 1e6, world, backend)

    # auto mode: profile, plan on rank 0, broadcast; the plan picks micro-batch and
    # accumulation for --global-batch, or runs --micro-batch with as many micro-batches
    # as the global batch needs
    share = args.global_batch // world
    if args.micro_batch is not None:
        if share % args.micro_batch:
            raise SystemExit(f"--micro-batch {args.micro_batch} must divide the per-rank batch {share}")
        auto = dict(batch=args.micro_batch)
        settings = osdp.planner.PlannerSettings(accumulation_steps=share // args.micro_batch)
    else:
        auto, settings = dict(global_batch=args.global_batch), osdp.planner.PlannerSettings()
    model = osdp.OSDP(
        model,
        memory_limit=args.memory,
        example_inputs=example(batch_for(args, 0, 0, 0, min(share, 4))),
        settings=settings,
        auto_kwargs=dict(auto, cache_dir=args.cache_dir, progress=rank == 0),
    )
    micro, accum = model.batch_size, model.accumulation_steps
    log.info("plan: micro-batch %d x %d accumulation steps per rank; %s", micro, accum,
             ", ".join(f"{m} {n}" for m, n in _count_modes(model.unit_modes())))

    optimizer, (n_decay, n_plain) = make_optimizer(model, args)
    log.info("AdamW: %d parameter pieces with weight decay %.2g, %d (biases, norms) without",
             n_decay, args.weight_decay, n_plain)

    ckpt_dir = Path(args.ckpt_dir)
    start = 0
    if args.resume:
        path = newest_checkpoint(ckpt_dir)
        if path is None:
            log.info("--resume: no checkpoint in %s, starting from step 0", ckpt_dir)
        else:
            start = int(ckpt.load(model, optimizer, str(path))["step"])
            log.info("resumed from %s (step %d)", path, start)

    metrics = open(args.metrics, "a", buffering=1) if args.metrics and rank == 0 else None  # line-buffered
    try:
        for step in range(start, args.steps):
            started = time.perf_counter()
            total = torch.zeros((), device=model.device)
            for i in range(accum):
                tokens = batch_for(args, step, i, rank, micro).to(model.device)
                with model.micro_batch(i):  # reduce-scatter only after the last micro-batch
                    loss = loss_of(model, tokens) / accum
                    loss.backward()
                total += loss.detach()
            grad_norm = model.clip_grad_norm_(args.max_norm)  # global, the same on every rank
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(total)
            step_s = time.perf_counter() - started
            record = {"step": step + 1, "loss": total.item() / world, "grad_norm": float(grad_norm),
                      "step_ms": step_s * 1e3, "samples_per_s": args.global_batch / step_s}
            if metrics:
                metrics.write(json.dumps(record) + "\n")
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                log.info("step %4d  loss %.4f  grad norm %.3f  %7.1f ms  %8.1f samples/s", *record.values())
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                path = ckpt_dir / f"step_{step + 1:06d}"
                ckpt.save(model, optimizer, str(path), step=step + 1)
                log.info("saved %s", path)
    finally:
        if metrics:
            metrics.close()  # finish() leaves with os._exit: Python does not flush files after it
    return 0


def _count_modes(modes: dict) -> list[tuple[int, str]]:
    counts: dict[str, int] = {}
    for mode in modes.values():
        counts[mode] = counts.get(mode, 0) + 1
    return [(n, f"{m} units") for m, n in sorted(counts.items())]


if __name__ == "__main__":
    run_main(main)
