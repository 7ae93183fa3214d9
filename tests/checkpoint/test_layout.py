"""In-process checks (a 1-rank gloo group): the box decomposition, the parameter layout
of split units, and save/load with buffers and frozen parameters."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.nn as nn

import osdp
import osdp.checkpoint as ck
from osdp.checkpoint._dcp import flat_index, range_boxes
from osdp.errors import OSDPError
from osdp.models import GPT, GPTConfig
from osdp.runtime.state_dict import box_view

CFG = GPTConfig(vocab_size=97, seq_len=8, num_layers=2, hidden=10, heads=2)


pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def test_range_boxes_cover_exactly_the_range_in_order():
    rng = random.Random(0)
    shapes = [(), (7,), (1, 1), (5, 3), (3, 1, 4), (2, 3, 4, 5), (4, 1, 1, 3)]
    for shape in shapes:
        numel = math.prod(shape)
        ids = torch.arange(numel).view(shape)
        ranges = {(0, numel)} | {tuple(sorted(rng.sample(range(numel + 1), 2))) for _ in range(30) if numel > 1}
        for a, b in ranges:
            boxes = list(range_boxes(a, b, shape))
            got = []
            for offsets, sizes in boxes:
                region = ids
                for dim, (o, s) in enumerate(zip(offsets, sizes)):
                    region = region.narrow(dim, o, s)
                flat = region.reshape(-1).tolist()
                assert flat == list(range(flat[0], flat[0] + len(flat))), "a box must be a contiguous run"
                assert flat_index(offsets, shape) == flat[0]
                got.extend(flat)
            assert got == list(range(a, b)), (shape, a, b)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_split_pieces_are_the_slices_boxes():
    torch.manual_seed(0)
    original = GPT(CFG)
    torch.manual_seed(0)
    model = osdp.OSDP(GPT(CFG), splits={"blocks.0.mlp.c_fc": 4, "wte": 3})
    layout = ck._prepare(model).layout
    fc = layout.params["blocks.0.mlp.c_fc.weight"]
    assert [(p.box_offsets, p.box_sizes) for p in fc.pieces] == [
        ((0, 0), (40, 3)),
        ((0, 3), (40, 3)),
        ((0, 6), (40, 2)),
        ((0, 8), (40, 2)),
    ]
    assert [p.unit for p in layout.params["blocks.0.mlp.c_fc.bias"].pieces] == [fc.pieces[0].unit]
    wte = layout.params["wte.weight"]
    assert [(p.box_offsets, p.box_sizes) for p in wte.pieces] == [((0, 0), (33, 10)), ((33, 0), (32, 10)), ((65, 0), (32, 10))]
    # each piece's flat range of its unit is the box of the original tensor
    for info in layout.params.values():
        full = original.state_dict()[info.fqn]
        for piece in info.pieces:
            unit = model._built.units[piece.unit]
            flat = unit.shard.detach()[piece.offset : piece.offset + piece.numel]
            assert torch.equal(flat.view(piece.box_sizes), box_view(full, piece))
    state = ck.full_state_dict(model)
    for key, value in original.state_dict().items():
        assert torch.equal(state[key], value), key


class BufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.out(self.frozen(torch.relu(self.norm(self.inp(x))))).square().mean()


def _step(model, opt, seed):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
    model(x).backward()
    opt.step()
    opt.zero_grad()


def test_buffers_and_frozen_parameters_round_trip(tmp_path):
    torch.manual_seed(0)
    model = osdp.OSDP(BufferNet(), splits={"out": 3})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for seed in range(2):
        _step(model, opt, seed)
    path = str(tmp_path / "ckpt")
    ck.save(model, opt, path, step=2)
    saved = ck.full_state_dict(model)
    assert int(saved["norm.num_batches_tracked"]) == 2
    _step(model, opt, 2)
    reference = ck.full_state_dict(model)

    torch.manual_seed(1)
    other = osdp.OSDP(BufferNet(), default_mode="dp", splits={"out": 3})  # same math: exact
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    assert ck.load(other, other_opt, path)["step"] == 2
    loaded = ck.full_state_dict(other)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    assert not any(p.requires_grad for p in other.module.frozen.parameters())
    _step(other, other_opt, 2)
    resumed = ck.full_state_dict(other)
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_errors_name_the_problem(tmp_path):
    model = osdp.OSDP(GPT(CFG))
    with pytest.raises(OSDPError, match="OSDP-wrapped"):
        ck.save(GPT(CFG), None, str(tmp_path / "x"))
    with pytest.raises(OSDPError, match="not an OSDP sharded checkpoint"):
        ck.load(model, None, str(tmp_path))
    foreign = torch.optim.AdamW(GPT(CFG).parameters())
    with pytest.raises(OSDPError, match="not one of this OSDP model's parameters"):
        ck.save(model, foreign, str(tmp_path / "y"))
    assert not os.path.exists(tmp_path / "y")


def test_split_op_whose_slices_are_not_boxes_is_refused():
    from osdp.runtime.modes import Mode
    from osdp.runtime.shard_unit import ParamSlot, ShardUnit
    from osdp.runtime.state_dict import _split_pieces

    class Interleaved:  # slice i holds the columns i, i + 2, i + 4: not a box
        @classmethod
        def merge(cls, slices):
            return {"weight": torch.stack([s["weight"] for s in slices], dim=2).reshape(4, 6)}

    units = [
        ShardUnit(f"m[{i}]", [ParamSlot("weight", (), torch.Size([4, 3]), 0, 12)], [torch.zeros(4, 3)], Mode.ZDP, 0, 1, torch.device("cpu"), True)
        for i in range(2)
    ]
    with pytest.raises(OSDPError, match="not one box"):
        _split_pieces("m", Interleaved(), units, {id(u): i for i, u in enumerate(units)})
