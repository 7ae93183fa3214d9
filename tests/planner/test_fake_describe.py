"""describe() on fake tensors (a model on the meta device) equals describe() on real
tensors, field by field; alike layers measured once equal every layer measured."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from osdp.errors import OSDPError
from osdp.models import GPT, GPTConfig, get_preset
from osdp.models import example_batch as gpt_batch
from osdp.planner.description import describe
from osdp.planner.fake_describe import describe_fake, repeated_layers

BATCH = 4


def assert_same(fake, real):
    """Every field of every unit and block, the constant bytes and the name."""
    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    for got, want in zip(fake.ops, real.ops):
        for field in dataclasses.fields(want):
            assert getattr(got, field.name) == getattr(want, field.name), (got.name, field.name)
    assert fake.blocks == real.blocks
    assert fake.act_constant_bytes == real.act_constant_bytes
    assert fake.name == real.name
    assert fake == real


def _gpt(config):
    def build():
        return GPT(config)

    return build, lambda model: gpt_batch(config, BATCH)


def _hf(builder_name, **overrides):
    hf = pytest.importorskip("osdp.models.hf")
    pytest.importorskip("transformers")
    builder = getattr(hf, builder_name)

    def build():
        return builder(**overrides)

    return build, lambda model: hf.example_batch(model.config.vocab_size, BATCH)


def _stock(model_class, config_class, **config):
    """A stock transformers model, its own loss (``labels``)."""
    hf = pytest.importorskip("osdp.models.hf")
    transformers = pytest.importorskip("transformers")

    def build():
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))

    def batch_of(model):
        idx, _ = hf.example_batch(model.config.vocab_size, BATCH)
        return {"input_ids": idx, "labels": idx}

    return build, batch_of


CASES = {
    "osdp-gpt-tiny": lambda: _gpt(get_preset("tiny")),
    "osdp-gpt-tied-widths": lambda: _gpt(GPTConfig(tie_embeddings=True, block_hidden=(128, 64), heads=4)),
    "hf-gpt2-eager": lambda: _hf("gpt2_model"),
    "hf-gpt2-sdpa": lambda: _hf("gpt2_model", attn_implementation="sdpa", n_layer=3),
    "hf-llama-eager": lambda: _hf("llama_model"),
    "hf-llama-sdpa-gqa": lambda: _hf("llama_model", attn_implementation="sdpa"),
    "hf-llama-tied": lambda: _hf("llama_model", tie_word_embeddings=True),
    "hf-mixtral": lambda: _hf("mixtral_model"),  # fp32 grouped matmul: [Note: grouped matmul]
    # a router whose group scores die in the forward: [Note: saved and still alive]
    "hf-deepseek-v3": lambda: _stock(
        "DeepseekV3ForCausalLM", "DeepseekV3Config", vocab_size=97, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        max_position_embeddings=32, rope_scaling=None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fake_description_equals_real_field_by_field(case):
    build, batch_of = CASES[case]()
    torch.manual_seed(0)
    real_model = build()
    with torch.device("meta"):
        meta_model = build()
    inputs = batch_of(real_model)
    real = describe(real_model, inputs)
    fake = describe(meta_model, inputs)  # meta parameters: described on fake tensors
    assert_same(fake, real)
    # nothing materialized, nothing left behind: the meta model is as it was
    assert all(t.is_meta and type(t) in (torch.Tensor, nn.Parameter)
               for t in (*meta_model.parameters(), *meta_model.buffers()))
    assert [n for n, _ in meta_model.named_parameters()] == [n for n, _ in real_model.named_parameters()]



def test_a_meta_hugging_face_model_without_labels_is_priced_with_its_loops_loss():
    """A loop that computes its own loss from ``out.logits`` calls the model without
    ``labels=``; auto mode's assumed cross-entropy over the logits describes the meta
    model on fake tensors, and equals the real model's description field by field."""
    transformers = pytest.importorskip("transformers")
    from osdp.models.hf import LLAMA_DEFAULTS
    from osdp.planner.inputs import AssumedLoss

    config = transformers.LlamaConfig(**{**LLAMA_DEFAULTS, "attn_implementation": "sdpa"})
    torch.manual_seed(0)
    real_model = transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, config.vocab_size, (BATCH, 8))}
    fake = describe(meta_model, inputs, loss_fn=AssumedLoss(announce=False))
    assert_same(fake, describe(real_model, inputs, loss_fn=AssumedLoss(announce=False)))
    summed = describe(real_model, inputs, loss_fn=lambda out: out.logits.float().sum())
    logits_per_sample = inputs["input_ids"].shape[1] * real_model.config.vocab_size * 4
    extra = fake.loss_bytes_per_sample - summed.loss_bytes_per_sample  # [Note: the loss's moment]
    assert extra >= 2.5 * logits_per_sample, "the cross-entropy's log-probabilities and gradients"

def test_fake_true_on_a_real_model_reads_metadata_only():
    torch.manual_seed(0)
    config = get_preset("tiny")
    model = GPT(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fake = describe(model, gpt_batch(config, BATCH), fake=True)
    assert_same(fake, describe(model, gpt_batch(config, BATCH)))
    for n, p in model.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p, before[n]) and p.grad is None, n


def test_meta_inputs_are_accepted():
    config = get_preset("tiny")
    with torch.device("meta"):
        model = GPT(config)
    idx, targets = gpt_batch(config, BATCH)
    from_real = describe(model, (idx, targets))
    from_meta = describe(model, (idx.to("meta"), targets.to("meta")))
    assert_same(from_meta, from_real)
    # one tensor passed twice stays one storage (counted once), as in a real run
    torch.manual_seed(0)
    real_twice = describe(GPT(config), (idx, idx))
    meta_idx = idx.to("meta")
    assert_same(describe(model, (meta_idx, meta_idx)), real_twice)
    assert real_twice != from_real


# ---- alike layers measured once -------------------------------------------------------

def _six_layer_cases():
    hf = pytest.importorskip("osdp.models.hf")
    return {
        "osdp-gpt": (lambda: GPT(GPTConfig(seq_len=32, hidden=48, heads=3, num_layers=6, vocab_size=97)), 97),
        "hf-gpt2": (lambda: hf.gpt2_model(n_layer=6), 97),
        "hf-llama-sdpa": (lambda: hf.llama_model(num_hidden_layers=7, attn_implementation="sdpa"), 97),
    }


# Llama (about 10 s) with the slow tests: its description is checked field by field above
@pytest.mark.parametrize("case", ["osdp-gpt", "hf-gpt2", pytest.param("hf-llama-sdpa", marks=pytest.mark.slow)])
def test_alike_layers_written_out_equal_every_layer_measured(case):
    build, vocab = _six_layer_cases()[case]
    with torch.device("meta"):
        model = build()
    assert repeated_layers(model) is not None
    inputs = gpt_batch(GPTConfig(vocab_size=vocab, seq_len=8), BATCH)
    repeated = describe_fake(model, inputs)
    assert "repeated_layers" in repeated.meta  # the shortcut was taken...
    full = describe_fake(model, inputs, repeat=False)
    assert "repeated_layers" not in full.meta
    assert_same(repeated, full)  # ...and changed nothing


def test_layers_of_different_widths_are_each_measured():
    config = GPTConfig(num_layers=6, block_hidden=(64, 128) * 3, heads=4)
    with torch.device("meta"):
        model = GPT(config)
    assert repeated_layers(model) is None
    desc = describe_fake(model, gpt_batch(config, BATCH))
    assert "repeated_layers" not in desc.meta
    torch.manual_seed(0)
    assert_same(desc, describe(GPT(config), gpt_batch(config, BATCH)))


def test_layer_signature_sees_shapes_and_plain_attributes():
    def stack(**changes):
        layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        for key, value in changes.items():
            setattr(layers[3], key, value)
        return nn.Sequential(nn.Linear(4, 8), layers)

    assert repeated_layers(stack())[0] == "1"
    assert repeated_layers(stack(bias=None)) is None  # a parameter fewer
    assert repeated_layers(stack(sliding_window=4096)) is None  # a plain attribute of its own
    assert repeated_layers(stack(layer_idx=3)) is not None  # its index is not a difference


class _Odd(nn.Module):
    """Layers alike in shape whose work depends on their index (every third one squares
    its input): the signature cannot see it, the 3- and 4-layer cuts disagree."""

    def __init__(self, index):
        super().__init__()
        self.layer_idx = index
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y * y if self.layer_idx % 3 == 2 else torch.relu(y)


class _OddStack(nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.layers = nn.ModuleList(_Odd(i) for i in range(n))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def test_layers_that_act_differently_fall_back_to_every_layer():
    torch.manual_seed(0)
    real = _OddStack()
    with torch.device("meta"):
        model = _OddStack()
    x = torch.randn(BATCH, 8)
    assert repeated_layers(model) is not None  # alike by their signature
    desc = describe(model, (x,))
    assert "repeated_layers" not in desc.meta  # but the cuts disagree: measured in full
    assert_same(desc, describe(real, (x,)))


def test_value_dependent_model_is_one_clear_error():
    class Gather(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y[y > 0].sum()

    with torch.device("meta"):
        model = Gather()
    with pytest.raises(OSDPError, match="depends on tensor values"):
        describe(model, (torch.randn(BATCH, 4),))


class _NeedsAllLayers(_OddStack):
    def forward(self, x):
        if len(self.layers) != 6:
            raise RuntimeError("this model runs with all of its 6 layers")
        return super().forward(x)


def test_model_that_cannot_run_cut_is_measured_in_full():
    torch.manual_seed(0)
    real = _NeedsAllLayers()
    with torch.device("meta"):
        model = _NeedsAllLayers()
    x = torch.randn(BATCH, 8)
    desc = describe(model, (x,))
    assert "repeated_layers" not in desc.meta
    assert_same(desc, describe(real, (x,)))
