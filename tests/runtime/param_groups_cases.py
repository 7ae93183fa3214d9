"""Weight-decay grouping idioms users write in their own loops, on split, tied and rep
units: the models, the idioms, and the per-rank body of the 2-rank AdamW parity run
(``test_param_groups.py``).

An idiom maps ``(name, parameter)`` to "decays or not". On the wrapped model it must
give every original parameter the class it gets on the unwrapped one: a split weight
that fell out of the decay group trained silently wrong (issue 35: grad norm off by
3e-4 after 3 steps, loss by 2e-5)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import parity_cases as pc

STEPS = 5
WEIGHT_DECAY = 0.1
MAX_NORM = 0.05  # clips every step


def osdp_kwargs(key: str) -> dict:
    """Split (in features, out features with a bias, embedding rows; tied on "tied"),
    rep and plain units side by side."""
    splits = {"blocks.0.mlp.c_fc": 4, "blocks.1.attn.c_attn": 3, "wte": 3}
    modes = {"blocks.0.ln_1": "rep", "blocks.1.mlp.c_proj": "rep", "blocks.0.attn.c_proj": "dp",
             "wte": ("zdp", "dp", "zdp")}
    return {"splits": splits, "modes": modes, "split_ops": {"blocks.1.attn.c_attn": "linear_out_features"}}


def hf_decay_names(model) -> set[str]:
    """Hugging Face Trainer's rule: not inside a LayerNorm, no ``bias`` in the name."""
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
    from transformers.trainer_pt_utils import get_parameter_names

    return {n for n in get_parameter_names(model, ALL_LAYERNORM_LAYERS) if "bias" not in n}


def idioms(hf_names: set[str]) -> dict:
    """name -> ``decays(name, param)``; ``hf_names``: the HF rule's set, taken from the
    model before wrapping as a user's script does."""
    return {
        "endswith weight": lambda n, p: n.endswith("weight"),
        "endswith .weight": lambda n, p: n.endswith(".weight"),
        "hf get_parameter_names": lambda n, p: n in hf_names,
        "nanoGPT ndim >= 2": lambda n, p: p.dim() >= 2,
    }


def grouping(named_params, hf_names) -> dict[str, dict[str, bool]]:
    """Per idiom, ``{name: decays}`` over ``named_params`` (a list: every entry counts)."""
    return {idiom: {n: rule(n, p) for n, p in named_params} for idiom, rule in idioms(hf_names).items()}


def _optimizer(named_params, hf_names):
    named = list(named_params)
    decay = [p for n, p in named if n in hf_names]
    rest = [p for n, p in named if n not in hf_names]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
                             lr=pc.LR, eps=pc.EPS)


def reference(key: str, world_size: int):
    """Single process on the whole global batch: losses, clipped norms, final state."""
    model = pc.make_model(key)
    opt = _optimizer(model.named_parameters(), hf_decay_names(model))
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*pc.global_batch(key, step, world_size))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def osdp_run(rank: int, world_size: int, key: str):
    import osdp

    model = pc.make_model(key)
    hf_names = hf_decay_names(model)  # before wrapping, as a training script computes it
    wrapped = osdp.OSDP(model, **osdp_kwargs(key))
    out = {"grouping": grouping(list(wrapped.named_parameters()), hf_names),
           "hf_names_wrapped": sorted(hf_decay_names(wrapped))}
    opt = _optimizer(wrapped.named_parameters(), hf_names)
    losses, norms = [], []
    for step in range(STEPS):
        loss = wrapped(*pc._local(pc.global_batch(key, step, world_size), rank))
        loss.backward()
        norms.append(wrapped.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach().clone())
        losses.append(loss.item() / world_size)
    out.update(losses=losses, norms=norms, state=wrapped.full_state_dict())
    assert all(math.isfinite(x) for x in losses)
    return out


def runs(world_size: int) -> dict:
    """Every rank's result of both models, in one spawn per model."""
    from .dist_harness import spawn

    return {key: spawn(osdp_run, world_size, key) for key in ("uneven", "tied")}
