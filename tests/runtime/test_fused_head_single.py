"""The fused head + loss of a vocabulary-split head in one process (a 1-rank gloo group):
``SplitLinearOut.cross_entropy`` ([Note: fused head on split slices] in
osdp/ops/fused_head.py) against plain PyTorch (``F.cross_entropy`` of the whole
logits), and the promise that no [tokens, vocab] tensor is ever allocated."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import osdp
from osdp.errors import ConfigError
from osdp.models import GPT, GPTConfig, example_batch
from osdp.ops.split_linear_out import SplitLinearOut

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

UNTIED = GPTConfig(vocab_size=4099, seq_len=16, num_layers=1, hidden=16, heads=2)
TIED = GPTConfig(vocab_size=4099, seq_len=16, num_layers=1, hidden=16, heads=2, tie_embeddings=True)
BATCH = 4


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any operator returns (bytes), and the operator."""

    def __init__(self):
        super().__init__()
        self.bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.bytes:
                self.bytes, self.op = t.untyped_storage().nbytes(), func
        return out


def _wrapped(config, **kwargs):
    torch.manual_seed(0)
    return osdp.OSDP(GPT(config), **kwargs)


def _plain(config):
    torch.manual_seed(0)
    return GPT(config)


SPLITS = {
    "untied": (UNTIED, dict(default_mode="dp", modes={"lm_head": ("zdp", "dp", "zdp", "dp")},
                            split_ops={"lm_head": "linear_out_features"})),
    "tied": (TIED, dict(default_mode="zdp", modes={"wte": ("dp", "zdp", "dp")})),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_fused_step_never_allocates_tokens_by_vocab(name):
    config, kwargs = SPLITS[name]
    idx, targets = example_batch(config, BATCH)
    logits_bytes = idx.numel() * config.vocab_size * 4
    model = _wrapped(config, **kwargs)
    assert isinstance(model.module.lm_head, SplitLinearOut)
    with LargestAllocation() as fused:
        model(idx, targets).backward()
    # the largest slice's logits would be a quarter / a third of it; the chunked backward
    # block is [tokens, rows of a slice] at most
    assert fused.bytes < logits_bytes / 2, (fused.bytes, fused.op, logits_bytes)
    # the control: the same model unsplit materializes the logits (the check can fail)
    with LargestAllocation() as whole:
        _plain(config)(idx, targets).backward()
    assert whole.bytes >= logits_bytes, (whole.bytes, whole.op)


@pytest.mark.parametrize("name", list(SPLITS))
def test_fused_loss_and_gradients_match_pytorch_with_ignored_tokens(name):
    config, kwargs = SPLITS[name]
    idx, targets = example_batch(config, BATCH, seed=1)
    targets[:, :3] = -100  # ignored, as F.cross_entropy's default ignore_index
    ref = _plain(config)
    ref_loss = ref(idx, targets)
    ref_loss.backward()
    model = _wrapped(config, **kwargs)
    loss = model(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # lr 1: the parameters carry the gradients
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    state = model.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


class BareHead(nn.Module):
    """Hidden states straight into a head: the loss is the head's cross-entropy."""

    def __init__(self, bias=False, vocab=37, hidden=8):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)

    def forward(self, x, targets, **kw):
        return self.lm_head.cross_entropy(x, targets, **kw)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_and_input_gradient_match_pytorch(reduction):
    torch.manual_seed(1)
    ref = BareHead()
    torch.manual_seed(1)
    head = osdp.OSDP(BareHead(), modes={"lm_head": ("zdp", "dp", "zdp")}, split_ops={"lm_head": "linear_out_features"})
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, 37, (3, 5))
    targets[0, 0] = 7
    targets[1, 2] = -1  # a custom ignore_index
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.no_grad():
        weight = ref.lm_head.weight.clone()
    ref_loss = F.cross_entropy((x_ref @ weight.t()).transpose(1, 2), targets, ignore_index=-1, reduction=reduction)
    loss = head(x, targets, ignore_index=-1, reduction=reduction)
    assert loss.shape == ref_loss.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    grad = torch.linspace(0.5, 2.0, ref_loss.numel()).reshape(ref_loss.shape)
    loss.backward(grad)
    ref_loss.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-7)


def test_a_biased_head_or_label_smoothing_is_refused_by_name():
    head = osdp.OSDP(BareHead(bias=True), modes={"lm_head": ("dp", "dp")}, split_ops={"lm_head": "linear_out_features"})
    x, targets = torch.randn(4, 8), torch.randint(0, 37, (4,))
    with pytest.raises(ConfigError, match="bias"):
        head(x, targets)
    plain = osdp.OSDP(BareHead(), modes={"lm_head": ("dp", "dp")}, split_ops={"lm_head": "linear_out_features"})
    with pytest.raises(ConfigError, match="label_smoothing"):
        plain(x, targets, label_smoothing=0.1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_narrowed_forward_uses_the_fused_loss(family):
    hf = pytest.importorskip("osdp.models.hf")
    pytest.importorskip("transformers")
    build = {"llama": lambda: hf.llama_model(vocab_size=1009), "gpt2": lambda: hf.gpt2_model(vocab_size=1009)}[family]
    # Llama: untied head split along vocabulary; GPT-2: the tied wte/lm_head pair split by rows
    kwargs = (dict(modes={"lm_head": ("zdp", "dp", "zdp")}, split_ops={"lm_head": "linear_out_features"})
              if family == "llama" else dict(modes={"transformer.wte": ("dp", "zdp")}))
    idx, targets = hf.example_batch(1009, batch_size=3, seq_len=8)
    torch.manual_seed(0)
    ref = build()
    ref_loss = hf.hf_loss(ref, idx, targets)
    ref_loss.backward()
    torch.manual_seed(0)
    model = osdp.OSDP(build(), default_mode="zdp", **kwargs)
    assert hasattr(model.module.lm_head, "cross_entropy")
    logits_bytes = idx.numel() * 1009 * 4
    with LargestAllocation() as fused:
        loss = hf.hf_loss(model, idx, targets)
        loss.backward()
    assert fused.bytes < logits_bytes, (fused.bytes, fused.op)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    state = model.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
