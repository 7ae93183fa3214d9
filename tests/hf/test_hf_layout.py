"""The lazy checkpoint sources of [Note: checkpoint layout] (osdp/checkpoint/hf_layout.py):
any box of a stacked and concatenated source, read through safetensors slicing, equals
that box of the tensor torch.stack and torch.cat make of the whole checkpoint tensors;
a conversion it does not read is named."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from osdp.checkpoint.hf_layout import CatSource, KeySource, StackSource, _converted, read_box
from osdp.errors import OSDPError

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

EXPERTS, ROWS, COLS = 3, 5, 4


@pytest.fixture
def checkpoint(tmp_path):
    """Mixtral's layout in small: per expert a w1 and a w3 of ROWS x COLS."""
    gen = torch.Generator().manual_seed(0)
    tensors = {f"e.{i}.{w}": torch.randn(ROWS, COLS, generator=gen) for i in range(EXPERTS) for w in ("w1", "w3")}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    with safe_open(path, framework="pt") as handle:
        yield tensors, path, {path: handle}


def test_every_box_of_a_stack_of_concatenations_is_read_as_torch_makes_it(checkpoint):
    tensors, path, handles = checkpoint
    stacks = [StackSource([KeySource(path, f"e.{i}.{w}", (ROWS, COLS)) for i in range(EXPERTS)], 0, "gate_up")
              for w in ("w1", "w3")]
    source = CatSource(stacks, 1, "gate_up")  # experts x 2 ROWS x COLS
    whole = torch.cat([torch.stack([tensors[f"e.{i}.{w}"] for i in range(EXPERTS)]) for w in ("w1", "w3")], 1)
    assert source.shape == tuple(whole.shape)
    rng = random.Random(0)
    for _ in range(200):
        offsets = tuple(rng.randrange(n) for n in whole.shape)
        sizes = tuple(rng.randint(1, n - o) for n, o in zip(whole.shape, offsets))
        box = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert torch.equal(source.read(handles, offsets, sizes), box)
        a = rng.randrange(box.numel())
        b = rng.randint(a + 1, box.numel())
        assert torch.equal(read_box(source, handles, offsets, sizes, a, b), box.reshape(-1)[a:b])


def test_a_conversion_it_does_not_read_is_named(checkpoint):
    _, path, _ = checkpoint

    class Chunk:
        dim = 0

    converter = SimpleNamespace(source_patterns=["e.*.w1"], operations=[Chunk()])
    found = {"e.*.w1": [(i, KeySource(path, f"e.{i}.w1", (ROWS, COLS))) for i in range(EXPERTS)]}
    with pytest.raises(OSDPError, match="converted by Chunk, which load_hf does not read"):
        _converted("gate_up", converter, found)
