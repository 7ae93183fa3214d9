"""The compiled path on one rank, against the plain model: stock-model shapes that
broke it (found by a helper on stock VisionEncoderDecoder and MarianMT)."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import osdp

pytestmark = pytest.mark.usefixtures("one_rank_group")

COMPILE = {"backend": "aot_eager"}


class _Positions(nn.Embedding):
    """As stock Marian's and Pegasus's sinusoidal positions: a decorated forward that
    calls ``super().forward``."""

    @torch.no_grad()
    def forward(self, positions):
        return super().forward(positions) * 0.5


class _Net(nn.Module):
    """A pooler computed and never used (as a ViT encoder's under VisionEncoderDecoder)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 8)
        self.positions = _Positions(6, 8)
        self.mix = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, idx):
        hidden = torch.relu(self.mix(self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))))
        self.pooler(hidden[:, 0])  # its output reaches no loss
        return self.head(hidden)


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def test_compiled_matches_eager_on_decorated_super_forward_and_an_unused_output():
    """A decorated forward calling super() refused the plain stand-in ("super(type, obj):
    obj must be an instance or subtype of type"): the decorator's wrapper hid the
    ``__class__`` cell. An unused output's parameters got no gradient and the compiled
    path's gradient marker failed on None ("'NoneType' object has no attribute
    '_osdp_sharded'"). Both now train as the plain model, the pooler's gradient None."""
    torch._dynamo.reset()
    idx = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(1))
    plain, wrapped = _net(), osdp.OSDP(_net(), default_mode="zdp", compile=COMPILE)
    for model in (plain, wrapped):
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    grads = dict(wrapped.named_parameters())
    for name, param in plain.named_parameters():
        if name.startswith("pooler") or name.startswith("positions"):
            assert param.grad is None and grads[name].grad is None, name
        else:
            torch.testing.assert_close(grads[name].grad.reshape(-1)[: param.numel()],
                                       param.grad.reshape(-1), rtol=1e-5, atol=1e-6, msg=name)


class _WithHelper(nn.Module):
    """As stock Funnel's attention: the forward calls a method of the module that reads
    the module's own parameter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.r_bias = nn.Parameter(torch.randn(8))

    def shifted(self, x):
        return x + self.r_bias

    def forward(self, x):
        return self.shifted(self.lin(x))


class _HelperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = _WithHelper()
        self.head = nn.Linear(8, 3)

    def forward(self, x, scale: float = 1.0):
        return self.head(self.att(x)) * scale


def _helper_net() -> _HelperNet:
    torch.manual_seed(0)
    return _HelperNet()


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_runs_a_helper_method_reading_its_modules_weight(scope):
    """The method was bound back to the module itself under dynamo, whose weight is the
    freed stand-in: refused as a read outside the module's forward (eager and plain
    torch.compile run it; found by a helper on Funnel)."""
    torch._dynamo.reset()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plain, wrapped = _helper_net(), osdp.OSDP(_helper_net(), default_mode="zdp", compile={**COMPILE, "scope": scope})
    for model in (plain, wrapped):
        model(x).pow(2).sum().backward()
    grads = dict(wrapped.named_parameters())  # one rank: each a flat shard, the whole of it
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad.reshape(-1)[: param.numel()], param.grad.reshape(-1),
                                   rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_model_keeps_its_forward_signature(scope):
    """Hugging Face's generate reads the model's forward signature (which keyword
    arguments it passes on): the compiled region's forward showed ``(*args, **kwargs)``,
    and Idefics3's generate(pixel_values=...) refused its own arguments (found by a
    helper). The wrapper and the wrapped model both show the model's."""
    wrapped = osdp.OSDP(_helper_net(), default_mode="zdp", compile={**COMPILE, "scope": scope})
    expected = inspect.signature(_helper_net().forward)
    assert inspect.signature(wrapped.unwrapped.forward) == expected
    assert inspect.signature(wrapped.forward) == expected
