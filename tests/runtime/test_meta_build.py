"""A model built on the meta device wraps without ever existing whole ([Note: meta
initialization] in osdp/runtime/materialize.py): bitwise the CPU-built model's initial
weights and training on 1, 2 and 3 ranks (tied, split and rep units), one module's
parameters at a time in memory, and every way initialization can leave something unset
is an error naming it."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import osdp
from osdp.errors import ConfigError, OSDPError
from osdp.memtrack import LiveBytesTracker
from osdp.models import GPT, GPTConfig, example_batch

from . import meta_cases as mc
from .dist_harness import spawn

single = pytest.mark.usefixtures("one_rank_group")


def _wrap(meta: bool, **kwargs):
    """Seeded as a user does: a CPU model before it is built (construction draws), a meta
    one before it is wrapped (wrapping initializes)."""
    if meta:
        with torch.device("meta"):
            model = mc.Net()
    torch.manual_seed(0)
    return osdp.OSDP(model if meta else mc.Net(), **kwargs)


@single
@pytest.mark.parametrize("config", sorted(mc.CONFIGS))
def test_meta_build_equals_cpu_build_bitwise(config):
    cpu, meta = _wrap(False, **mc.CONFIGS[config]), _wrap(True, **mc.CONFIGS[config])
    a, b = cpu.full_state_dict(), meta.full_state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    idx, tgt = mc.batch(0, 2)
    assert torch.equal(cpu(idx, tgt), meta(idx, tgt))
    assert not any(t.is_meta for t in list(meta.parameters()) + list(meta.buffers()))


# 3 ranks (uneven shards, about 14 s) with the slow tests; the default run trains on 2
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_meta_build_trains_like_the_cpu_build_on_several_ranks(world_size):
    runs = spawn(mc.run, world_size)
    for name in mc.CONFIGS:
        for rank_result in runs:
            cpu, meta = rank_result[name]
            assert cpu["names"] == meta["names"]
            for key in cpu["init"]:
                assert torch.equal(cpu["init"][key], meta["init"][key]), (name, key)
            assert cpu["losses"] == meta["losses"], name
            for key in cpu["final"]:
                assert torch.equal(cpu["final"][key], meta["final"][key]), (name, key)


@single
def test_meta_build_holds_one_module_at_a_time():
    """Eight 1 MiB Linears: wrapping the meta model never holds more than a couple of
    them beside the shards (the whole model would be 8 MiB)."""
    layer_bytes = 512 * 512 * 4
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])
    torch.manual_seed(0)
    with LiveBytesTracker() as tracker:
        wrapped = osdp.OSDP(model)
    shards = sum(p.numel() * 4 for p in wrapped.parameters())  # one rank: the whole model, sharded
    assert tracker.peak_bytes <= shards + 3 * layer_bytes, tracker.peak_bytes


@single
def test_gpt_on_meta_with_its_init_function_trains():
    config = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=16, heads=2, tie_embeddings=True)
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(0)
    wrapped = osdp.OSDP(model, modes={"wte": ("zdp", "dp")}, param_init_fn=GPT.init_module)
    stds = {n: p.float().std().item() for n, p in wrapped.named_parameters() if p.dim() >= 2 and p.numel() > 100}
    assert all(0.015 < s < 0.025 for s in stds.values()), stds  # GPT-2's N(0, 0.02)
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        loss = wrapped(*example_batch(config, 4, seed=step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.w


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.fc(x) + self.table


@single
@pytest.mark.parametrize("case", ["no reset_parameters", "init forgets a parameter", "buffer left unset",
                                  "sync_module_states", "param_init_fn on a real model"])
def test_what_initialization_leaves_unset_is_named(case):
    def meta(cls):
        with torch.device("meta"):
            return cls()

    if case == "no reset_parameters":
        model, kwargs = meta(lambda: nn.Sequential(nn.Linear(4, 4), NoReset())), {}
        error, text = OSDPError, "'1' (NoReset) was built on the meta device and has no reset_parameters()"
    elif case == "init forgets a parameter":
        model, kwargs = meta(lambda: nn.Linear(4, 4)), {"param_init_fn": lambda m: nn.init.ones_(m.weight)}
        error, text = OSDPError, "parameter 'bias' of the root module (Linear) was built on the meta device"
    elif case == "buffer left unset":
        model, kwargs = meta(WithTable), {}
        error, text = OSDPError, "buffer 'table' of the root module (WithTable) was built on the meta device"
    elif case == "sync_module_states":
        model, kwargs = meta(lambda: nn.Linear(4, 4)), {"sync_module_states": True}
        error, text = ConfigError, "sync_module_states=True broadcasts rank 0's weights"
    else:
        model, kwargs = nn.Linear(4, 4), {"param_init_fn": lambda m: None}
        error, text = ConfigError, "param_init_fn= initializes a model built on the meta device"
    with pytest.raises(error) as info:
        osdp.OSDP(model, **kwargs)
    assert text in str(info.value)


@single
def test_a_buffer_set_by_param_init_fn_is_kept():
    with torch.device("meta"):
        model = WithTable()

    def init(module):
        if isinstance(module, WithTable):
            module.table = torch.arange(4.0) * 2  # computed, as a rotary table is
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    wrapped = osdp.OSDP(model, param_init_fn=init)
    assert torch.equal(wrapped.module.table, torch.arange(4.0) * 2)


class _Tower(nn.Module):
    """A sub-model with its own initialization (as Llava's CLIP vision tower)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.class_embedding = nn.Parameter(torch.empty(4))  # only _init_weights sets it

    def _init_weights(self, module):
        for p in module.parameters(recurse=False):
            p.fill_(2.0)


class _Composite(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = _Tower()
        self.head = nn.Linear(4, 3)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.fill_(1.0)
            module.bias.fill_(0.0)

    def forward(self, x):
        return self.head(self.tower.proj(x) + self.tower.class_embedding)


@single
def test_a_composite_model_on_meta_is_initialized_by_each_submodels_init():
    """The outer model's _init_weights alone left the sub-model's own parameter unset
    (refused: built on meta and never set); init_by_submodel gives each module the
    _init_weights of the nearest module around it, as Hugging Face's initialize_weights."""
    with torch.device("meta"):
        outer_only = _Composite()
    with pytest.raises(OSDPError, match=r"'class_embedding' of 'tower'.*left it unset"):
        osdp.OSDP(outer_only, param_init_fn=outer_only._init_weights)
    with torch.device("meta"):
        model = _Composite()
    wrapped = osdp.OSDP(model, param_init_fn=osdp.init_by_submodel(model))
    state = wrapped.full_state_dict()
    assert torch.equal(state["tower.proj.weight"], torch.full((4, 4), 2.0))
    assert torch.equal(state["tower.class_embedding"], torch.full((4,), 2.0))
    assert torch.equal(state["head.weight"], torch.ones(3, 4)) and torch.equal(state["head.bias"], torch.zeros(3))
    with pytest.raises(OSDPError, match=r"Linear has no _init_weights\(\)"):
        osdp.init_by_submodel(nn.Linear(2, 2))
