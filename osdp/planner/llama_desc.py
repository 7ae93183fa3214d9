"""Analytic description of a Llama-style decoder (Hugging Face ``LlamaForCausalLM``
layout) from its shape, beside gpt_desc.py's GPT: plans models far larger than this
machine (70B) without building them.

Units, in forward order, named by their Hugging Face module paths:
    model.embed_tokens
    model.layers.{i}.input_layernorm               RMSNorm (weight only)
    model.layers.{i}.self_attn.{q,k,v,o}_proj       no bias; k, v have n_kv_heads heads (GQA)
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp.{gate,up,down}_proj        SwiGLU: down(silu(gate(x)) * up(x))
    model.norm
    lm_head                                         untied, or tied to embed_tokens

[Note: Llama activations]
Per sample, with s = seq, h = hidden, f = intermediate, a = heads, c = kv heads,
d = h / a, V = vocab, e = element bytes; each saved tensor is counted once, at the unit
that creates or first reads it:
    input_layernorm, post_attention_layernorm, norm
                 s h e (input) + s * 4 (fp32 rstd)
    q_proj       s h e (its input: the normed x, read by k_proj and v_proj too)
    k_proj, v_proj   0 (the shared input is q_proj's)
    o_proj       attention as SDPA's flash / memory-efficient kernels keep it, O(s), no
                 s^2 scores: q and k after RoPE (s h e + s c d e), v (s c d e), the
                 output (s h e: o_proj's input too), the logsumexp (a s * 4, fp32);
                 GQA native (k, v not expanded to a heads, as flash-attention and SDPA's
                 enable_gqa keep them). RoPE's backward needs only cos/sin (buffers).
                 Carries the attention FLOPs: 2 s^2 h causal (QK^T and PV, half the
                 4 s^2 h of full attention: a causal kernel skips the masked blocks).
    gate_proj    s h e (its input, shared with up_proj) + s f e (its output, silu's input)
    up_proj      s f e (its output, read by the product)
    down_proj    s f e (silu's output, read by the product) + s f e (its input)
    embed_tokens s * 8 (token ids)
    lm_head      s h e + s V e (logits) + s * 8 (targets)
So a layer saves (6 s h + 2 s c d + 4 s f) e + (a + 2) s * 4 bytes: linear in s (a
test checks it). Backward transients (the gradients in flight while the unit's backward
runs, each plus s * 8 as gpt_desc counts them): a linear (fan_in + fan_out) s e, o_proj
with the attention's backward (3 s h + 2 s c d) e, an RMSNorm 3 s h e, lm_head 2 s V e,
the embedding s h e.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OSDPError
from ..ops import default_split_op_for_kind
from .model_desc import BlockDesc, ModelDesc, OpDesc


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden: int
    intermediate: int  # SwiGLU's own width (not a multiple of hidden in general)
    num_layers: int
    heads: int
    kv_heads: int  # grouped-query attention: kv_heads divides heads
    seq_len: int
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "intermediate", "num_layers", "heads", "kv_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OSDPError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise OSDPError(f"hidden {self.hidden} must be a multiple of heads {self.heads} (head dim = hidden / heads)")
        if self.heads % self.kv_heads:
            raise OSDPError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} (query groups)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf(cls, config: dict, seq_len: int | None = None) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` of a Llama-style model (keys
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, vocab_size, max_position_embeddings, tie_word_embeddings)."""
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in config]
        if missing:
            raise OSDPError(f"a Llama config.json needs {list(need)}; this one lacks {missing}")
        heads = config["num_attention_heads"]
        return cls(vocab_size=config["vocab_size"], hidden=config["hidden_size"],
                   intermediate=config["intermediate_size"], num_layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   seq_len=seq_len or config.get("max_position_embeddings", 4096),
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)))


# public shapes (Touvron et al. 2023, "Llama 2", Table 1 and the released config.json files)
LLAMA_PRESETS = {
    "llama2-7b": LlamaConfig(vocab_size=32000, hidden=4096, intermediate=11008, num_layers=32, heads=32,
                             kv_heads=32, seq_len=4096),
    "llama2-13b": LlamaConfig(vocab_size=32000, hidden=5120, intermediate=13824, num_layers=40, heads=40,
                              kv_heads=40, seq_len=4096),
    "llama2-70b": LlamaConfig(vocab_size=32000, hidden=8192, intermediate=28672, num_layers=80, heads=64,
                              kv_heads=8, seq_len=4096),
}


def llama_preset(name: str, seq_len: int | None = None) -> LlamaConfig:
    if name not in LLAMA_PRESETS:
        raise OSDPError(f"unknown Llama preset {name!r}; the presets are {sorted(LLAMA_PRESETS)}")
    config = LLAMA_PRESETS[name]
    return config if seq_len is None else LlamaConfig(**{**config.__dict__, "seq_len": seq_len})


def describe_llama(config: LlamaConfig, dtype_bytes: int = 4, name: str | None = None) -> ModelDesc:
    """The ``ModelDesc`` of a Llama-style model ([Note: Llama activations])."""
    s, e, h, f, vocab = config.seq_len, dtype_bytes, config.hidden, config.intermediate, config.vocab_size
    a, kvd = config.heads, config.kv_heads * config.head_dim
    ids = s * 8
    split = default_split_op_for_kind("linear")
    ops: list[OpDesc] = []
    blocks: list[BlockDesc] = []

    def linear(path, fan_in, fan_out, act, grad=None, extra_flops=0.0, block=None):
        count = fan_in * fan_out
        axis = {"in_features": fan_in, "out_features": fan_out}[split.axis] if split.planned else 0
        grad = (fan_in + fan_out) * s * e if grad is None else grad
        ops.append(OpDesc(path, "linear", count, count * e, act, 2.0 * s * fan_in * fan_out + extra_flops,
                          splittable=axis >= 2, in_features=axis if axis >= 2 else 0, block=block,
                          act_grad_bytes_per_sample=grad + ids, split_op=split.op_name if axis >= 2 else "",
                          param_tensors=1))

    def rmsnorm(path, block=None):
        ops.append(OpDesc(path, "rmsnorm", h, h * e, s * h * e + s * 4, 4.0 * s * h, False, block=block,
                          act_grad_bytes_per_sample=3 * s * h * e + ids, param_tensors=1))

    ops.append(OpDesc("model.embed_tokens", "embedding", vocab * h, vocab * h * e, ids, 0.0, False,
                      act_grad_bytes_per_sample=s * h * e + ids, param_tensors=1))
    for i in range(config.num_layers):
        b = f"model.layers.{i}"
        first = len(ops)
        rmsnorm(f"{b}.input_layernorm", b)
        linear(f"{b}.self_attn.q_proj", h, h, s * h * e, block=b)
        linear(f"{b}.self_attn.k_proj", h, kvd, 0.0, block=b)
        linear(f"{b}.self_attn.v_proj", h, kvd, 0.0, block=b)
        attention = (2 * s * h + 2 * s * kvd) * e + a * s * 4  # q, out; k, v (kv heads); logsumexp
        linear(f"{b}.self_attn.o_proj", h, h, attention, grad=(3 * s * h + 2 * s * kvd) * e,
               extra_flops=2.0 * s * s * h, block=b)
        rmsnorm(f"{b}.post_attention_layernorm", b)
        linear(f"{b}.mlp.gate_proj", h, f, s * h * e + s * f * e, block=b)
        linear(f"{b}.mlp.up_proj", h, f, s * f * e, block=b)
        linear(f"{b}.mlp.down_proj", f, h, 2 * s * f * e, block=b)
        blocks.append(BlockDesc(b, first, len(ops) - first, s * h * e))
    rmsnorm("model.norm")
    head_act = s * h * e + s * vocab * e + ids
    if config.tie_embeddings:
        ops.append(OpDesc("lm_head", "linear", 0, 0, head_act, 2.0 * s * h * vocab, False,
                          tied_to="model.embed_tokens", act_grad_bytes_per_sample=2 * s * vocab * e))
    else:
        linear("lm_head", h, vocab, head_act, grad=2 * s * vocab * e - ids)
    label = name or f"Llama-{config.num_layers}x{h}"
    return ModelDesc(name=label, ops=tuple(ops), blocks=tuple(blocks))
