"""``rep`` units in one process (a 1-rank gloo group): configuration errors, what a rep
unit's parameters are, views that stay valid across optimizer steps, the measured
step peak, and plans naming rep units. The multi-rank behaviour is in test_rep.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import osdp
from osdp.contract import RuntimeConfig
from osdp.errors import OSDPError
from osdp.models import GPT, GPTConfig, example_batch

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

CFG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)


def gpt():
    torch.manual_seed(0)
    return GPT(CFG)


# ---- only whole units may be rep ------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,where",
    [
        ({"modes": {"blocks.0.mlp.c_fc": ("rep", "zdp")}}, r"slice\(s\) \[0\] would be 'rep':"),
        ({"modes": {"blocks.0.mlp.c_fc": "rep"}, "splits": {"blocks.0.mlp.c_fc": 2}}, r"slice\(s\) \[0, 1\]"),
        ({"default_mode": "rep", "splits": {"blocks.0.mlp.c_fc": 3}}, r"\[0, 1, 2\] would be 'rep' \(from default_mode='rep'\)"),
        ({"modes": {"blocks.0.mlp.c_fc[1]": "rep"}, "splits": {"blocks.0.mlp.c_fc": 2}}, r"slice\(s\) \[1\]"),
    ],
)
def test_rep_slices_are_refused_naming_the_unit_and_what_is_allowed(kwargs, where):
    with pytest.raises(OSDPError) as info:
        osdp.OSDP(gpt(), **kwargs)
    message = str(info.value)
    assert "unit 'blocks.0.mlp.c_fc' is split into" in message
    assert "only whole units may be 'rep'" in message and "one of 'dp', 'zdp', 'hpz'" in message
    import re

    assert re.search(where, message), message


def test_rep_slices_in_a_plan_are_refused():
    plan = RuntimeConfig(unit_modes={"blocks.0.mlp.c_fc": ("dp", "rep")}, world_size=1, fingerprint="fake")
    with pytest.raises(OSDPError, match=r"unit 'blocks.0.mlp.c_fc' is split into 2 slices and slice\(s\) \[1\]"):
        osdp.OSDP(gpt(), plan)


def test_unknown_mode_message_lists_rep():
    with pytest.raises(OSDPError, match=r"mode 'ddp' is not one of 'dp', 'zdp', 'hpz', 'rep'"):
        osdp.OSDP(gpt(), modes={"wte": "ddp"})


def test_plan_with_rep_units_runs_them():
    modes = {name: ("rep",) for name in ("wte", "ln_f", "lm_head")}
    modes["blocks.0.mlp.c_fc"] = ("zdp", "dp")
    model = osdp.OSDP(gpt(), RuntimeConfig(unit_modes=modes, world_size=1, fingerprint="fake"))
    got = model.unit_modes()
    assert got["wte"] == got["ln_f"] == got["lm_head"] == "rep"
    assert got["blocks.0.mlp.c_fc[0]"] == "zdp" and got["blocks.0.attn.c_attn"] == "zdp"  # the default
    model(*example_batch(CFG, 2)).backward()
    assert model.memory_stats()["all_reduces"] == {"wte": 1, "ln_f": 1, "lm_head": 1}


# ---- parameters, views, steps -----------------------------------------------------------------
class Scalars(nn.Module):
    """A 0-d parameter, a vector and a matrix in one unit."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.bias = nn.Parameter(torch.linspace(-1, 1, 6))
        self.weight = nn.Parameter(torch.linspace(-2, 2, 24).view(4, 6))

    def forward(self, x):
        return ((x @ self.weight.t()) * self.scale).sum() + self.bias.square().sum()


def test_rep_parameters_keep_original_shapes_except_0d():
    model = osdp.OSDP(Scalars(), default_mode="rep")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # whole and original, as under DDP; a 0-d parameter is (1,) (a 0-d piece would look
    # like a per-parameter optimizer state such as AdamW's step in checkpoints)
    assert shapes == {"scale": (1,), "bias": (6,), "weight": (4, 6)}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes


def test_rep_unit_trains_like_plain_pytorch_and_views_follow_the_master():
    torch.manual_seed(0)
    plain = Scalars()
    model = osdp.OSDP(Scalars(), default_mode="rep")
    unit = model._built.units[0]
    # compute reads the master flat itself: same storage, nothing gathered
    assert unit.gathered.untyped_storage().data_ptr() == unit.shard.untyped_storage().data_ptr()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).backward()
        plain(x).backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad.view_as(q.grad), q.grad), name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        # the module computes with views of the master: updated in place by the step
        assert torch.equal(model.module.weight, plain.weight.detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach().view_as(q), q.detach()), name
    stats = model.memory_stats()
    assert stats["all_gathers"] == {} and stats["reduce_scatters"] == {} and stats["current_grad_bytes"] == 0


def test_load_state_dict_into_rep_units_takes_full_tensors():
    model = osdp.OSDP(gpt(), default_mode="rep", modes={"blocks.0.attn.c_attn": "zdp"})
    plain = gpt()
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(-1)
    local = {k: v for k, v in plain.state_dict().items()}
    local["blocks.0.attn.c_attn.weight"] = model.state_dict()["blocks.0.attn.c_attn.weight"]  # a sharded piece
    local["blocks.0.attn.c_attn.bias"] = model.state_dict()["blocks.0.attn.c_attn.bias"]
    model.load_state_dict(local)
    full = model.full_state_dict()
    for key, value in plain.state_dict().items():
        if not key.startswith("blocks.0.attn.c_attn."):
            assert torch.equal(full[key], value), key


def test_mixed_precision_copy_is_kept_and_recast_only_after_a_step():
    from osdp.runtime.mixed_precision import MixedPrecision

    model = osdp.OSDP(gpt(), default_mode="rep", mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    units = model._built.units
    assert all(u.gathered.dtype == torch.bfloat16 and u.shard.dtype == torch.float32 for u in units)
    assert model.memory_stats()["replica_copy_bytes"] == 2 * sum(u.numel for u in units)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = example_batch(CFG, 2)
    model(*batch).backward()
    copies = [u.gathered.clone() for u in units]
    assert all(torch.equal(c, u.shard.detach().bfloat16()) for c, u in zip(copies, units))
    model(*batch).backward()  # no step in between: nothing is cast again, nothing changes
    assert all(torch.equal(c, u.gathered) for c, u in zip(copies, units))
    opt.step()
    assert all(torch.equal(c, u.gathered) for c, u in zip(copies, units))  # not recast by the step ...
    assert not all(torch.equal(u.gathered, u.shard.detach().bfloat16()) for u in units)
    model(*batch)
    assert all(torch.equal(u.gathered, u.shard.detach().bfloat16()) for u in units)  # ... at the next use


# ---- the measured step peak counts rep units' whole parameters ---------------------------------
class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x):
        return self.layers(x).square().mean()


def test_step_peak_counts_rep_parameters_grads_and_optimizer_state():
    """After a first step, a step's peak holds the parameters (P, whole), the .grad kept
    from the step before (P, no zero_grad), AdamW's two moments (2 P), and when the one
    bucket (P < 4 MiB) is issued at the end of backward the staging copy (P): >= 5 P
    (activations of 2 samples are far smaller). These fp32 rep units are direct ([Note:
    direct replicated units]): autograd adds the step's gradient into the kept .grad, so
    there is no gradient buffer beside it (the hook path's would make it 6 P)."""
    torch.manual_seed(0)
    model = osdp.OSDP(Wide(), default_mode="rep", modes={"layers.0": "rep"}, memory_limit=2**40)  # modes: no auto mode
    params = sum(p.numel() * 4 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 256)
    for _ in range(3):
        model(x).backward()
        opt.step()  # not zero_grad: the .grad of every rep unit stays
    assert model.step_memory() is not None
    assert 5 * params <= model.step_memory().peak_bytes < 6 * params
