"""Per-rank body of ``test_freeze.py``: parameters frozen and unfrozen between steps
through ``requires_grad`` ([Note: trainability follows the parameters] in
osdp/runtime/trainable.py), against single-process training of the same schedule."""
from __future__ import annotations

import torch
import torch.distributed as dist

from osdp.errors import OSDPError

from . import parity_cases as pc

STEPS = 5
# split slices (dp, zdp) in block 0, a dp unit, rep units (direct: ln_f; frozen when
# wrapped: blocks.1.ln_1), a tied head, zdp elsewhere
PLAN = {"default_mode": "zdp", "modes": {"blocks.0.mlp.c_fc": ["dp", "zdp"], "blocks.1.attn.c_attn": "dp",
                                         "ln_f": "rep", "blocks.1.ln_1": "rep"},
        "splits": {"blocks.0.mlp.c_fc": 2}}
FROZEN_WHEN_WRAPPED = "blocks.1.ln_1."
# step -> (prefix of the parameters set, requires_grad)
SCHEDULE = {0: [("blocks.0.", False), ("ln_f.", False)], 2: [("blocks.0.", True), ("ln_f.", True),
                                                              (FROZEN_WHEN_WRAPPED, True)],
            3: [("blocks.1.attn.", False)]}


def _model():
    model = pc.make_model("tied")
    for name, p in model.named_parameters():
        if name.startswith(FROZEN_WHEN_WRAPPED):
            p.requires_grad_(False)
    return model


def _train(model, named_params, step_batch) -> list[float]:
    """The optimizer holds every parameter from the start (frozen ones are skipped while
    their .grad is None), as fine-tuning loops build it."""
    named = list(named_params())
    optim = torch.optim.SGD([p for _, p in named], lr=0.5)
    losses = []
    for step in range(STEPS):
        for prefix, flag in SCHEDULE.get(step, []):
            for name, p in named:
                if name.startswith(prefix):
                    p.requires_grad_(flag)
        loss = model(*step_batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def reference(world: int):
    model = _model()
    losses = _train(model, model.named_parameters, lambda s: pc.global_batch("tied", s, world))
    return [x.item() for x in losses], {k: v.clone() for k, v in model.state_dict().items()}


def osdp_run(rank: int, world: int) -> dict:
    import osdp

    model = osdp.OSDP(_model(), **PLAN)
    losses = _train(model, model.named_parameters, lambda s: pc._local(pc.global_batch("tied", s, world), rank))
    mean = []
    for loss in losses:
        dist.all_reduce(loss)
        mean.append(loss.item() / world)
    out = {"losses": mean, "state": model.full_state_dict(rank0_only=False)}
    # half a unit frozen: refused at the next forward, naming the unit and the parameters
    dict(model.named_parameters())["blocks.0.ln_2.weight"].requires_grad_(False)
    try:
        model(*pc._local(pc.global_batch("tied", 0, world), rank))
        out["mixed"] = "accepted"
    except OSDPError as exc:
        out["mixed"] = str(exc)
    return out
