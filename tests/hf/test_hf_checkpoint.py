"""Hugging Face safetensors checkpoints straight into and out of the shards
(``osdp.checkpoint.load_hf`` / ``save_hf``, [Note: Hugging Face checkpoints]): stock
``transformers`` GPT-2, Llama, Mixtral and Switch Transformers (tiny configs, ``save_pretrained``) loaded into models
built on the meta device give the pretrained model's logits, on 1 and 2 ranks, split,
tied and rep units included; ``save_hf`` -> ``from_pretrained`` is the same model; every
bad input is one error that changes nothing."""
from __future__ import annotations

import json
import os

import pytest
import torch

import osdp
import osdp.checkpoint as ckpt
from osdp.errors import OSDPError

from runtime.dist_harness import spawn

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402 - after the importorskip

VOCAB = 101


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM, config


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel, config


def mixtral():
    """Its checkpoint holds one tensor per expert and projection (``block_sparse_moe.
    experts.2.w1.weight``), the model one 3-D tensor per layer (``mlp.experts.
    gate_up_proj``): [Note: checkpoint layout]. 3 experts: on 2 ranks the experts unit's
    shard boundary falls inside an expert's w1 (the unit: gate_up_proj then down_proj)."""
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=36, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM, config


def switch():
    """A module per expert, each rank calling only its routed ones: run with the sparse
    MLPs as leaf modules ([Note: leaf modules] in osdp/module_tree.py), each one unit."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, expert_capacity=64, num_layers=2, num_sparse_encoder_layers=1,
        num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=4, num_experts=4, decoder_start_token_id=0,
        pad_token_id=0)
    return transformers.SwitchTransformersForConditionalGeneration, config


MODELS = {"llama": llama, "gpt2": gpt2, "mixtral": mixtral, "switch": switch}
# split (in features; the tied GPT-2 embedding by rows, its head following), rep, dp, zdp
PLANS = {
    "llama": dict(splits={"model.layers.0.mlp.down_proj": 2}, modes={"model.norm": "rep", "lm_head": "dp"}),
    "gpt2": dict(modes={"transformer.wte": ("zdp", "dp"), "transformer.ln_f": "rep"},
                 splits={"transformer.h.0.mlp.c_fc": 2}),
    # the first layer's experts split by experts (3 groups of one, gate_up then down)
    "mixtral": dict(splits={"model.layers.0.self_attn.o_proj": 2, "model.layers.0.mlp.experts": 6},
                    modes={"model.layers.0.mlp.experts": "dp", "model.layers.1.mlp.experts": "rep"}),
    "switch": dict(modes={"encoder.block.1.layer.1.mlp": "dp", "decoder.block.1.layer.2.mlp": "rep"},
                   splits={"shared": 2}),
}
LEAVES = {"switch": "SwitchTransformersSparseMLP"}


def pretrained(name: str, path) -> torch.nn.Module:
    cls, config = MODELS[name]()
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(path)
    return model


def on_meta(name: str, **kwargs):
    cls, config = MODELS[name]()
    with torch.device("meta"):
        model = cls(config)
    torch.manual_seed(1)  # other weights than the checkpoint's: load_hf must replace them all
    if name in LEAVES:
        kwargs["leaf_modules"] = (getattr(transformers, LEAVES[name]),)
    return osdp.OSDP(model, param_init_fn=model._init_weights, **kwargs).eval()


def tokens():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def logits(model):
    decoder = getattr(model, "unwrapped", model).config.is_encoder_decoder
    with torch.no_grad():
        return model(input_ids=tokens(), **({"decoder_input_ids": tokens()} if decoder else {})).logits


single = pytest.mark.usefixtures("one_rank_group")


@single
@pytest.mark.parametrize("name", sorted(MODELS))
def test_load_hf_into_a_meta_model_gives_the_pretrained_logits(name, tmp_path):
    ref = pretrained(name, tmp_path / "ckpt")
    plain = on_meta(name)  # no splits: the same products, bitwise
    ckpt.load_hf(plain, tmp_path / "ckpt")
    assert torch.equal(logits(plain), logits(ref))
    planned = on_meta(name, **PLANS[name])  # split matmuls accumulate in another order
    ckpt.load_hf(planned, tmp_path / "ckpt")
    torch.testing.assert_close(logits(planned), logits(ref), rtol=1e-6, atol=1e-6)


@single
@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_hf_then_from_pretrained_is_the_same_model(name, tmp_path):
    ref = pretrained(name, tmp_path / "ckpt")
    model = on_meta(name, **PLANS[name])
    ckpt.load_hf(model, tmp_path / "ckpt")
    ckpt.save_hf(model, tmp_path / "out")
    # the keys save_pretrained writes (Mixtral's per expert: [Note: checkpoint layout])
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(
        load_file(tmp_path / "ckpt" / "model.safetensors"))
    cls, _ = MODELS[name]()
    back = cls.from_pretrained(tmp_path / "out").eval()
    mine, theirs = back.state_dict(), ref.state_dict()
    assert list(mine) == list(theirs)
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key


@single
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_sharded_checkpoint_with_an_index_round_trips(name, tmp_path):
    """Mixtral's index lists the per-expert keys its files hold ([Note: checkpoint layout])."""
    ref = pretrained(name, tmp_path / "ckpt")
    model = on_meta(name, **PLANS[name])
    ckpt.load_hf(model, tmp_path / "ckpt")
    ckpt.save_hf(model, tmp_path / "sharded", max_shard_size="40KB")
    files = sorted(os.listdir(tmp_path / "sharded"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(f in files for f in shards)
    assert sorted(index["weight_map"]) == sorted(load_file(tmp_path / "ckpt" / "model.safetensors"))
    for file in shards:  # each file holds what the index says it does
        assert sorted(load_file(tmp_path / "sharded" / file)) == sorted(
            k for k, f in index["weight_map"].items() if f == file)
    again = on_meta(name, **PLANS[name])
    ckpt.load_hf(again, tmp_path / "sharded")
    torch.testing.assert_close(logits(again), logits(ref), rtol=1e-6, atol=1e-6)


def _shards(model):
    return [u.shard.detach().clone() for u in model._built.units]


@single
@pytest.mark.parametrize("case", ["not a directory", "no checkpoint in it", "a key missing", "an unexpected key",
                                  "a wrong shape"])
def test_bad_checkpoints_are_one_clear_error_and_change_nothing(case, tmp_path):
    pretrained("llama", tmp_path / "ckpt")
    target = tmp_path / "ckpt"
    state = load_file(target / "model.safetensors")
    if case == "not a directory":
        target, text = target / "model.safetensors", "is not a directory: load_hf reads a Hugging Face checkpoint"
    elif case == "no checkpoint in it":
        (tmp_path / "empty").mkdir()
        target, text = tmp_path / "empty", "holds neither model.safetensors nor model.safetensors.index.json"
    elif case == "a key missing":
        del state["model.norm.weight"]
        save_file(state, target / "model.safetensors")
        text = "keys missing from the checkpoint: ['model.norm.weight']"
    elif case == "an unexpected key":
        state["model.extra.weight"] = torch.zeros(3)
        save_file(state, target / "model.safetensors")
        text = "keys the model does not have: ['model.extra.weight']"
    else:
        state["model.norm.weight"] = torch.ones(33)
        save_file(state, target / "model.safetensors")
        text = "'model.norm.weight' is [33] in the checkpoint, [32] in the model"
    model = on_meta("llama", **PLANS["llama"])
    before = _shards(model)
    with pytest.raises(OSDPError) as info:
        ckpt.load_hf(model, target)
    assert text in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _shards(model)))


@single
@pytest.mark.parametrize("case", ["an expert missing", "an expert of another shape"])
def test_bad_expert_tensors_are_one_clear_error_and_change_nothing(case, tmp_path):
    pretrained("mixtral", tmp_path / "ckpt")
    state = load_file(tmp_path / "ckpt" / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.experts.1.w3.weight"
    if case == "an expert missing":
        del state[key]
        text = (r"the checkpoint tensors of 'model.layers.1.mlp.experts.gate_up_proj' are incomplete: "
                r"'.experts.\*.w3.weight' for module list indices \[1\] missing")
    else:
        state[key] = torch.zeros(35, 32)
        text = "cannot stack the checkpoint tensors of 'model.layers.1.mlp.experts.gate_up_proj'"
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    model = on_meta("mixtral", **PLANS["mixtral"])
    before = _shards(model)
    with pytest.raises(OSDPError, match=text):
        ckpt.load_hf(model, tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, _shards(model)))


@single
def test_a_meta_rotary_table_left_unset_is_named():
    cls, config = llama()
    with torch.device("meta"):
        model = cls(config)

    def weights_only(module):  # initializes every parameter, not the rotary embedding's table
        if "RotaryEmbedding" not in type(module).__name__:
            model._init_weights(module)

    with pytest.raises(OSDPError, match="buffer 'inv_freq' of 'model.rotary_emb' .* was built on the meta device"):
        osdp.OSDP(model, param_init_fn=weights_only)


def _two_ranks(rank, world_size, path):
    out = {}
    for name in sorted(MODELS):
        model = on_meta(name, **PLANS[name])
        ckpt.load_hf(model, os.path.join(path, name))
        out[name] = logits(model)
    return out


def test_load_hf_on_two_ranks(tmp_path):
    refs = {name: logits(pretrained(name, tmp_path / name)) for name in sorted(MODELS)}
    for result in spawn(_two_ranks, 2, str(tmp_path)):
        for name, ref in refs.items():
            torch.testing.assert_close(result[name], ref, rtol=1e-6, atol=1e-6)
