"""Per-rank body of ``test_lockstep_moe.py``: a mixture of experts written the way users
write one, one ``nn.Linear`` per expert, top-1 routing ([Note: ranks in lockstep] in
osdp/runtime/lockstep.py), in two ways:

- every expert called on every rank, one routed no tokens on its empty slice of them:
  the ranks gather the same units in the same order whatever the routing, and an
  expert without tokens on one rank reduces a zero gradient there;
- only the experts routed some tokens called (``SkippingMoE``, the common idiom): the
  ranks stay in step only when the block is one unit, ``leaf_modules=(SkippingMoE,)``
  ([Note: leaf modules] in osdp/module_tree.py); with a unit per expert the ranks gather
  different experts (gloo aborts on the size mismatch, or the lockstep check raises)."""
from __future__ import annotations

import torch
import torch.nn as nn

import osdp

from . import split_batch_loop

DIM, EXPERTS, LOCAL_BATCH, STEPS = 16, 4, 4, 4


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x):
        gates = torch.softmax(self.router(x), -1)
        route = gates.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero().flatten()  # may be empty: the expert still runs
            out = out.index_add(0, rows, expert(x[rows]) * gates[rows, i:i + 1])
        return x + out


class SkippingMoE(MoE):
    """Calls only the experts some token was routed to."""

    def forward(self, x):
        gates = torch.softmax(self.router(x), -1)
        route = gates.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (route == i).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * gates[rows, i:i + 1])
        return x + out


class Net(nn.Module):
    def __init__(self, block=MoE):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.moe = nn.ModuleList([block(), block()])
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.moe:
            x = block(x)
        return self.head(x)


def build(block=MoE) -> Net:
    torch.manual_seed(0)
    return Net(block)


def batch(step: int, world: int) -> dict:
    """All ranks' inputs ``x`` and classes ``y``, split between the ranks along dim 0."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(LOCAL_BATCH * world, 8, generator=gen)
    x[:LOCAL_BATCH] += 3.0  # rank 0's rows apart: the ranks route differently
    return {"x": x, "y": torch.randint(0, 3, (LOCAL_BATCH * world,), generator=gen)}


def experts_used(model: Net, x) -> list[set[int]]:
    """Per MoE block, the experts ``x``'s rows are routed to (plain model, no grad)."""
    used = []
    with torch.no_grad():
        h = model.inp(x)
        for block in model.moe:
            used.append(set(block.router(h).argmax(-1).tolist()))
            h = block(h)
    return used


def unrouted_somewhere(world: int) -> bool:
    """Whether some expert gets no token of any rank in some step of plain training."""
    model = build(SkippingMoE)
    optim = torch.optim.AdamW(model.parameters(), lr=split_batch_loop.LR, eps=split_batch_loop.EPS)
    for step in range(STEPS):
        data = batch(step, world)
        if any(len(used) < EXPERTS for used in experts_used(model, data["x"])):
            return True
        nn.functional.cross_entropy(model(data["x"]), data["y"]).backward()
        optim.step()
        optim.zero_grad()
    return False


def _user_loss(model, part: dict):
    return nn.functional.cross_entropy(model(part["x"]), part["y"])


def train(model, world: int, rank: int | None) -> list[float]:
    """The user's own loss outside the model; ``rank`` None: one process, the mean of
    the ranks' losses."""
    return split_batch_loop.train(model, lambda step: batch(step, world), STEPS, world, rank, loss_of=_user_loss)


MODES = {
    "zdp": {},
    "dp": {"default_mode": "dp"},
    "rep_experts": {"modes": {f"moe.{b}.experts.{i}": "rep" for b in range(2) for i in range(EXPERTS)}},
}
# the skipping block as one unit: by class, by path, in each mode
LEAF_MODES = {
    "leaf_zdp": {"leaf_modules": (SkippingMoE,)},
    "leaf_dp": {"leaf_modules": ("moe.0", "moe.1"), "default_mode": "dp"},
    "leaf_rep": {"leaf_modules": (SkippingMoE,), "modes": {"moe.0": "rep", "moe.1": "rep"}},
    "leaf_mixed": {"leaf_modules": (SkippingMoE,), "modes": {"moe.0": "dp", "inp": "rep"}},
    # a leaf's block recomputed in backward: the recompute calls the same experts
    "leaf_checkpointed": {"leaf_modules": (SkippingMoE,), "checkpoint_blocks": ("moe.0", "moe.1"),
                          "modes": {"moe.1": "dp"}},
    # compiled ([Note: compiled leaves] in osdp/runtime/compiled.py): the routing's
    # nonzero breaks the graph inside the leaf; a rep leaf gives its unrouted experts a
    # zero gradient as eagerly (computing with its own parameters, they got none)
    "leaf_zdp_compiled": {"leaf_modules": (SkippingMoE,), "compile": {"backend": "aot_eager"}},
    "leaf_rep_compiled": {"leaf_modules": (SkippingMoE,), "modes": {"moe.0": "rep", "moe.1": "dp"},
                          "compile": {"backend": "aot_eager", "scope": "model"}},
    "leaf_checkpointed_compiled": {"leaf_modules": (SkippingMoE,), "checkpoint_blocks": ("moe.0", "moe.1"),
                                   "modes": {"moe.1": "dp"}, "compile": {"backend": "aot_eager"}},
}


def run(rank: int, world: int) -> dict:
    out = {}
    for name, kwargs in MODES.items():
        model = osdp.OSDP(build(), **kwargs)
        out[name] = {"losses": train(model, world, rank), "state": model.full_state_dict(rank0_only=False)}
    for name, kwargs in LEAF_MODES.items():
        torch._dynamo.reset()
        model = osdp.OSDP(build(SkippingMoE), **kwargs)
        out[name] = {"losses": train(model, world, rank), "state": model.full_state_dict(rank0_only=False),
                     "units": model.unit_names()}
    return out


def _profile_loss(out):
    return out.square().mean()


def run_auto(rank: int, world: int, cache_dir: str) -> dict:
    """Auto mode with the skipping blocks as leaves: described, profiled, planned and
    measured on 2 ranks that route differently, then trained."""
    x = batch(100, world)["x"][rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    model = osdp.OSDP(build(SkippingMoE), memory_limit="4MiB", example_inputs=(x,), loss_fn=_profile_loss,
                      leaf_modules=(SkippingMoE,),
                      auto_kwargs={"cache_dir": cache_dir, "budget_s": 20, "progress": False, "batch": LOCAL_BATCH})
    return {"units": [u.name for u in model.plan.units], "modes": model.unit_modes(),
            "losses": train(model, world, rank), "state": model.full_state_dict(rank0_only=False)}


def run_layouts(rank: int, world: int) -> dict:
    """Leaves on 4 ranks as 2 nodes x 2: HSDP (a replicate x shard mesh) and full
    sharding with hpz units, each rank its own routing."""
    from .hsdp_cases import layout_kwargs

    out = {}
    for layout in ("hsdp", "full_node2"):
        for name, modes in (("hpz", {"default_mode": "hpz"}), ("mixed", {"modes": {"moe.0": "hpz", "moe.1": "dp"}})):
            model = osdp.OSDP(build(SkippingMoE), leaf_modules=(SkippingMoE,), **modes, **layout_kwargs(layout))
            out[f"{layout}-{name}"] = {"losses": train(model, world, rank),
                                       "state": model.full_state_dict(rank0_only=False)}
    return out
