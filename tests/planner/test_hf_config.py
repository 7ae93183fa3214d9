"""``osdp plan --hf-config``: a Hugging Face config.json (or a shipped name) built on
the meta device and described on fake tensors; bad files are one line, exit 2."""
from __future__ import annotations

import json
import resource
import time

import pytest

pytest.importorskip("transformers", reason="--hf-config needs `pip install transformers`")

import torch  # noqa: E402

from osdp.cli import main  # noqa: E402
from osdp.models.hf_config import (  # noqa: E402
    DESCRIBE_BATCH, available_hf_configs, describe_hf_config, load_hf_config, resolve_hf_config,
)
from osdp.planner.description import describe  # noqa: E402
from osdp.planner.plan import Plan  # noqa: E402



def assert_same(fake, real):
    """Every field of every unit and block, the constant bytes and the name."""
    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    for got, want in zip(fake.ops, real.ops):
        assert got == want, got.name
    assert (fake.blocks, fake.act_constant_bytes, fake.name) == (real.blocks, real.act_constant_bytes, real.name)

TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 97, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32, "tie_word_embeddings": False,
}
SEQ = 8


def cli_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("osdp: error: ") and "Traceback" not in err, err
    return err.strip()


def write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("layers", [2, 6])
def test_hf_config_description_equals_the_real_model(tmp_path, layers):
    import transformers

    path = write(tmp_path, {**TINY_LLAMA, "num_hidden_layers": layers})
    fake = describe_hf_config(path, seq_len=SEQ)
    torch.manual_seed(0)
    real_model = transformers.AutoModelForCausalLM.from_config(load_hf_config(path))
    ids, labels = (torch.randint(0, 97, (DESCRIBE_BATCH, SEQ)) for _ in range(2))
    real = describe(real_model, {"input_ids": ids, "labels": labels, "use_cache": False}, name="config")
    assert_same(fake, real)
    assert fake.param_count == sum(p.numel() for p in real_model.parameters())


def test_cli_plans_a_config_file(tmp_path, capsys):
    path = write(tmp_path, TINY_LLAMA)
    out = tmp_path / "plan.json"
    argv = ["plan", "--hf-config", path, "--seq", str(SEQ), "--memory", "2GiB", "--world-size", "2",
            "--backend", "python", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "model.layers.*.mlp.down_proj" in text and "lm_head" in text
    plan = Plan.load(str(out))
    assert plan.fingerprint == describe_hf_config(path, seq_len=SEQ).fingerprint()


def test_shipped_configs_resolve_by_short_name():
    names = available_hf_configs()
    assert names == ["gpt2", "llama-2-13b", "llama-2-70b", "llama-2-7b", "llama-3-70b", "llama-3-8b", "mistral-7b",
                     "mixtral-8x7b"]
    for name in names:
        assert resolve_hf_config(name).name == f"{name}.json"
        assert load_hf_config(name).model_type in ("gpt2", "llama", "mistral", "mixtral")


@pytest.mark.parametrize(
    "content,expected",
    [
        (None, "no such file, and not a shipped config (gpt2, llama-2-13b"),
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ({"hidden_size": 8}, 'has no "model_type"'),
        ({"model_type": "no-such-model"}, "unknown model_type 'no-such-model'"),
        ({**TINY_LLAMA, "hidden_size": 10, "num_attention_heads": 3}, "is not a valid llama config: The hidden size (10)"),
        ({"model_type": "t5", "d_model": 8}, "model_type 't5' has no causal LM in transformers"),
    ],
    ids=["missing", "not-json", "not-object", "no-model-type", "unknown-type", "invalid", "no-causal-lm"],
)
def test_bad_config_is_one_line_exit_2(tmp_path, capsys, content, expected):
    path = str(tmp_path / "missing.json") if content is None else write(tmp_path, content)
    assert expected in cli_error(["plan", "--hf-config", path], capsys)


def test_hf_config_with_shape_flags_or_too_long_seq_is_refused(tmp_path, capsys):
    path = write(tmp_path, TINY_LLAMA)
    assert "drop --layers, --hidden" in cli_error(["plan", "--hf-config", path, "--layers", "3", "--hidden", "8"], capsys)
    assert "exceeds the model's context length 32" in cli_error(["plan", "--hf-config", path, "--seq", "64"], capsys)
    assert "is a directory" in cli_error(["plan", "--hf-config", str(tmp_path)], capsys)


def llama_param_count(c: dict) -> int:
    """By hand: embedding + layers * (q, k, v, o with GQA + gate, up, down + 2 norms) +
    final norm + head (none when tied); a mixture of experts (Mixtral) has
    ``num_local_experts`` gate, up and down projections and a router in place of one MLP."""
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = h // heads
    attention = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    experts = c.get("num_local_experts")
    mlp = 3 * h * inter if experts is None else experts * 3 * h * inter + experts * h
    layer = attention + mlp + 2 * h
    embedding = c["vocab_size"] * h
    head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * h
    return embedding + c["num_hidden_layers"] * layer + h + head


LLAMA_70B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
}


def test_70b_llama_is_described_without_allocating_it(tmp_path):
    path = write(tmp_path, LLAMA_70B)
    start = time.perf_counter()
    desc = describe_hf_config(path, seq_len=4096)
    seconds = time.perf_counter() - start
    assert desc.param_count == llama_param_count(LLAMA_70B)
    assert desc.param_bytes == 4 * desc.param_count  # fp32: about 282 GB, none of it allocated
    assert len(desc.ops) == 1 + 80 * 9 + 2 and len(desc.blocks) == 80
    per_layer = [op.param_count for op in desc.ops if op.block == "model.layers.41"]
    assert per_layer == [8192, 8192 * 8192, 8192 * 1024, 8192 * 1024, 8192 * 8192, 8192,
                         8192 * 28672, 8192 * 28672, 28672 * 8192]
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak_rss_bytes < 8 * 2**30, peak_rss_bytes
    assert seconds < 120, seconds


@pytest.mark.slow
def test_70b_alike_layers_written_out_equal_every_layer_measured(tmp_path):
    """The shortcut of [Note: identical blocks] at full scale (about a minute)."""
    from osdp.models.hf_config import meta_causal_lm
    from osdp.planner.fake_describe import describe_fake

    path = write(tmp_path, LLAMA_70B)
    model = meta_causal_lm(load_hf_config(path))
    ids = torch.empty(DESCRIBE_BATCH, 2048, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    repeated = describe_fake(model, inputs)
    assert "repeated_layers" in repeated.meta
    assert_same(repeated, describe_fake(model, inputs, repeat=False))


@pytest.mark.slow
@pytest.mark.parametrize("name,published", [
    ("llama-2-7b", 6.74e9), ("llama-2-13b", 13.02e9), ("llama-2-70b", 68.98e9), ("llama-3-8b", 8.03e9),
    ("llama-3-70b", 70.55e9), ("mistral-7b", 7.24e9), ("mixtral-8x7b", 46.70e9), ("gpt2", 124.44e6),
])
def test_shipped_configs_have_the_published_sizes(name, published):
    desc = describe_hf_config(name)
    if name != "gpt2":
        data = json.loads(resolve_hf_config(name).read_text())
        assert desc.param_count == llama_param_count(data)
    assert desc.param_count == pytest.approx(published, rel=0.001)
