"""Sharded checkpoints across the eager and compiled paths on 2 gloo ranks: a run
resumed from a checkpoint continues the uninterrupted run's losses whichever path saved
it and whichever loads it, also when the loading model has compiled already (its graphs
must read the loaded values, not the ones they were traced with). Run inside one spawn
(tests/runtime/test_compiled.py)."""
from __future__ import annotations

import torch

import osdp
import osdp.checkpoint as ckpt
from osdp.models.gpt import GPT, GPTConfig, example_batch
from runtime.compiled_cases import EPS, LOCAL_BATCH, LR, mean_over_ranks

CONFIG = GPTConfig(vocab_size=96, seq_len=8, num_layers=2, hidden=32, heads=4, tie_embeddings=True)
STEPS = 4
SAVED_AT = 2  # the checkpoint holds the state after this many steps
# three plans, so that every load reshards: the saving run's, and two resuming ones
PLAN_SAVED = {"default_mode": "zdp", "modes": {"blocks.0.attn.c_attn": "dp", "ln_f": "rep"}}
PLAN_COMPILED = {"modes": {"blocks.1.mlp.c_fc": ["zdp", "dp"]}, "splits": {"blocks.1.mlp.c_fc": 2}}
PLAN_EAGER = {"default_mode": "zdp"}


def _model(plan: dict, compile_arg=None):
    torch.manual_seed(0)
    model = osdp.OSDP(GPT(CONFIG), compile=compile_arg, **plan)
    named = dict(model.named_parameters())
    decay = [p for n, p in named.items() if p.dim() >= 2]
    other = [p for n, p in named.items() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                              lr=LR, eps=EPS)
    return model, optim


def _steps(model, optim, rank: int, world: int, steps) -> list[float]:
    losses = []
    for step in steps:
        idx, tgt = example_batch(CONFIG, LOCAL_BATCH * world, seed=20 + step)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = model(idx[mine], tgt[mine])
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        losses.append(mean_over_ranks(loss, world))
    return losses


def run_checkpoint_resume(rank: int, world: int, directory: str) -> dict:
    """Eager OSDP trains STEPS steps, saving after SAVED_AT; a compiled model with
    another plan trains two steps of its own (it compiles), loads that checkpoint and
    trains on from SAVED_AT; it saves at the end, and an eager model with a third plan,
    loading that, must hold the uninterrupted run's final state."""
    torch._dynamo.reset()
    saving, optim = _model(PLAN_SAVED)
    losses = _steps(saving, optim, rank, world, range(SAVED_AT))
    ckpt.save(saving, optim, f"{directory}/eager", step=SAVED_AT)
    losses += _steps(saving, optim, rank, world, range(SAVED_AT, STEPS))
    final = saving.full_state_dict(rank0_only=False)

    compiled, optim = _model(PLAN_COMPILED, {"backend": "aot_eager"})
    _steps(compiled, optim, rank, world, range(7, 9))  # other batches: other weights, compiled graphs
    meta = ckpt.load(compiled, optim, f"{directory}/eager")
    resumed = _steps(compiled, optim, rank, world, range(SAVED_AT, STEPS))
    ckpt.save(compiled, optim, f"{directory}/compiled", step=STEPS)

    eager, optim = _model(PLAN_EAGER)
    ckpt.load(eager, optim, f"{directory}/compiled")
    loaded = eager.full_state_dict(rank0_only=False)
    return {"losses": losses, "resumed": resumed, "step": meta.get("step"),
            "compiled_vs_final": max((compiled.full_state_dict(rank0_only=False)[k] - v).abs().max().item()
                                     for k, v in final.items()),
            "loaded_vs_final": max((loaded[k] - v).abs().max().item() for k, v in final.items()),
            "optim_step": [int(s["step"]) for s in optim.state_dict()["state"].values()]}
