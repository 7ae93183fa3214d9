"""``osdp.describe`` on Hugging Face GPT-2 and Llama (built from configs, random weights)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="Hugging Face model tests need `pip install transformers`")

import torch  # noqa: E402

from osdp.models.hf import causal_lm_loss, example_batch, gpt2_model, hf_loss, llama_model  # noqa: E402
from osdp.planner.description import describe  # noqa: E402

BATCH = 4


def _gpt2_layer(i):
    p = f"transformer.h.{i}"
    return [f"{p}.ln_1", f"{p}.attn.c_attn", f"{p}.attn.c_proj", f"{p}.ln_2", f"{p}.mlp.c_fc", f"{p}.mlp.c_proj"]


def _llama_layer(i):
    p = f"model.layers.{i}"
    return [
        f"{p}.input_layernorm",  # registered after self_attn / mlp, runs first
        *(f"{p}.self_attn.{n}_proj" for n in "qkvo"),
        f"{p}.post_attention_layernorm",
        *(f"{p}.mlp.{n}_proj" for n in ("gate", "up", "down")),
    ]


def _described(build, **overrides):
    torch.manual_seed(0)
    model = build(**overrides)
    return model, describe(model, example_batch(model, BATCH))


def test_gpt2_units_in_execution_order_conv1d_splittable_tied_head():
    model, desc = _described(gpt2_model, n_layer=3, n_embd=16, n_head=4)
    names = [op.name for op in desc.ops]
    assert names == ["transformer.wte", "transformer.wpe", *_gpt2_layer(0), *_gpt2_layer(1), *_gpt2_layer(2),
                     "transformer.ln_f", "lm_head"]
    ops = {op.name: op for op in desc.ops}
    for name, module in model.named_modules():
        if type(module).__name__ == "Conv1D":
            op = ops[name]
            assert (op.kind, op.splittable, op.in_features) == ("conv1d", True, module.weight.shape[0]), name
            assert module.weight.shape[0] == module.nx
    assert ops["transformer.h.1.mlp.c_proj"].in_features == 4 * 16
    assert ops["transformer.h.0.attn.c_attn"].in_features == 16
    assert not ops["transformer.ln_f"].splittable
    # the embedding splits by rows (the vocabulary); lm_head reuses wte's weight: a second
    # use, no parameters, split the same way (its out_features are wte's rows)
    wte = ops["transformer.wte"]
    assert (wte.splittable, wte.in_features, wte.split_op) == (True, 97, "embedding_rows")
    head = ops["lm_head"]
    assert (head.tied_to, head.param_count, head.splittable, head.in_features, head.split_op) == (
        "transformer.wte", 0, True, 97, "linear_out_features")
    assert desc.param_count == sum(p.numel() for p in model.parameters())
    assert desc.param_bytes == 4 * desc.param_count
    assert [b.name for b in desc.blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    # the vocabulary-sized logits and their loss are the biggest saved activations
    assert head.act_bytes_per_sample >= 8 * 97 * 4
    assert ops["transformer.h.0.mlp.c_fc"].flops_per_sample == pytest.approx(2 * 8 * 16 * 64)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_units_in_execution_order_linears_splittable(tied):
    model, desc = _described(llama_model, tie_word_embeddings=tied)
    names = [op.name for op in desc.ops]
    assert names == ["model.embed_tokens", *_llama_layer(0), *_llama_layer(1), "model.norm", "lm_head"]
    ops = {op.name: op for op in desc.ops}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            op = ops[name]
            assert (op.kind, op.splittable, op.in_features) == ("linear", True, module.in_features), name
    assert ops["model.layers.0.mlp.down_proj"].in_features == 24
    assert ops["model.layers.0.self_attn.k_proj"].param_count == 8 * 16  # GQA: 2 kv heads of 4
    assert ops["model.norm"].kind == "llamarmsnorm" and not ops["model.norm"].splittable
    head = ops["lm_head"]
    # the vocabulary head is cut along its out_features (the vocabulary), tied or not
    assert (head.splittable, head.in_features, head.split_op) == (True, 97, "linear_out_features")
    if tied:
        assert (head.tied_to, head.param_count) == ("model.embed_tokens", 0)
    else:
        assert (head.tied_to, head.param_count) == (None, 97 * 16)
    assert desc.param_count == sum(p.numel() for p in model.parameters())
    assert [b.name for b in desc.blocks] == ["model.layers.0", "model.layers.1"]


def test_loss_forward_is_hf_logits_plus_cross_entropy():
    """The narrowed forward is the Hugging Face model's own forward plus a plain loss;
    hf_loss gives the same on an ordinary Hugging Face model."""
    import transformers

    torch.manual_seed(0)
    model = gpt2_model()
    assert isinstance(model, transformers.GPT2LMHeadModel)
    raw = transformers.GPT2LMHeadModel(model.config)
    raw.load_state_dict(model.state_dict())
    idx, targets = example_batch(model, 3, seq_len=5, seed=1)
    logits = raw(input_ids=idx).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 97).double(), targets.reshape(-1))
    torch.testing.assert_close(model(idx, targets).double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(hf_loss(raw, idx, targets), model(idx, targets), rtol=0, atol=0)
    torch.testing.assert_close(hf_loss(model, idx, targets), model(idx, targets), rtol=0, atol=0)
    torch.testing.assert_close(model(idx), logits, rtol=0, atol=0)
    assert causal_lm_loss(logits, targets).dtype == torch.float32
    assert idx.shape == targets.shape == (3, 5) and idx.dtype == torch.int64


@pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py
def test_t5_shared_embedding_is_the_unit_its_first_use_gathers():
    """T5 reads its ``shared`` embedding only through the encoder's and decoder's
    embeddings tied to it; describe raised KeyError('shared'). Now the encoder's, the
    first to run, stands for the owner ([Note: units that never ran] in model_desc.py),
    and a plan of it runs: every module the runtime makes a unit of is priced."""
    import transformers

    import osdp
    import osdp.planner as planner

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0, dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(1, 50, (BATCH, 6), generator=torch.Generator().manual_seed(0))
    desc = describe(model, {"input_ids": ids, "labels": ids})
    names = [op.name for op in desc.ops]
    assert names[0] == "shared" and "encoder.embed_tokens" not in names
    ops = {op.name: op for op in desc.ops}
    assert ops["shared"].param_count == 50 * 16 and ops["shared"].tied_to is None
    assert ops["decoder.embed_tokens"].tied_to == "shared" and ops["lm_head"].tied_to == "shared"
    assert desc.param_count == sum(p.numel() for p in model.parameters())
    cluster = planner.load_cluster("titan-rtx-pcie3")
    plan = planner.make_plan(desc, cluster.for_run(planner.RunSettings(world_size=1, memory_limit_bytes=2**30)))
    assert "shared" in plan.unit_modes()
    wrapped = osdp.OSDP(model, plan.runtime_config(), memory_check=False)  # the plan check passes
    assert wrapped(input_ids=ids[:plan.batch_size], labels=ids[:plan.batch_size]).loss.isfinite()
