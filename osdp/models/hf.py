"""Small Hugging Face causal LMs (GPT-2, Llama, Mixtral) built from configs, for tests and demos.

No downloads: models are built from a config with random weights (seed with
``torch.manual_seed`` first). The returned model *is* the Hugging Face model (a
subclass of ``GPT2LMHeadModel`` / ``LlamaForCausalLM``), so module paths, parameter
names and the state dict are Hugging Face's (``transformer.h.0.mlp.c_fc``,
``model.layers.0.self_attn.q_proj``, ...); only ``forward`` is narrowed to what
``osdp.planner.describe`` and the trainers call: ``model(idx, targets=None)`` returns the mean
next-token cross-entropy when ``targets`` are given, else the logits. With the LM head
split along the vocabulary by OSDP, that loss is fused with the head (no logits); the
stock Hugging Face ``forward(input_ids, labels=...)`` (and :func:`hf_loss` on a model
not built here) still computes the whole logits itself.

``transformers`` is imported lazily; a clear ImportError says what to install.

    torch.manual_seed(0)
    model = gpt2_model(n_layer=4)
    idx, targets = example_batch(model, batch_size=8)
    loss = model(idx, targets)            # or hf_loss(any_hf_causal_lm, idx, targets)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# Tiny defaults: a few layers, small hidden, a small vocabulary (97, prime: uneven
# shards), eager attention and no dropout (deterministic, comparable across layouts).
GPT2_DEFAULTS = dict(
    vocab_size=97,
    n_positions=32,
    n_embd=12,
    n_layer=2,
    n_head=2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
    tie_word_embeddings=True,
    attn_implementation="eager",
)
LLAMA_DEFAULTS = dict(
    vocab_size=97,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    attention_dropout=0.0,
    bos_token_id=0,
    eos_token_id=0,
    tie_word_embeddings=False,
    attn_implementation="eager",
)
# a mixture of experts: Llama's attention, 4 experts in one module of 3-D weights (run
# by a grouped matmul: [Note: grouped matmul] in osdp/planner/grouped_mm.py), 2 a token
MIXTRAL_DEFAULTS = dict(LLAMA_DEFAULTS, num_local_experts=4, num_experts_per_tok=2)


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "osdp.models.hf needs the `transformers` package (Hugging Face): pip install transformers"
        ) from exc
    return transformers


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, T, V]`` against ``targets [B, T]`` (already
    shifted: ``targets[:, t]`` is the token after ``idx[:, t]``), computed in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class _LossForward:
    """Mixin placed before a Hugging Face ``*ForCausalLM`` class in the MRO."""

    # model(idx, targets) fuses the loss into a split head ([Note: fused head loss]);
    # a stock Hugging Face model (forward(input_ids, labels=...)) does not
    osdp_fuses_head_loss = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        head = getattr(self, "lm_head", None)
        if targets is not None and getattr(head, "fuses_loss", lambda: False)():
            # the head split along vocabulary by OSDP's runtime: the loss slice by slice from
            # the base model's last hidden states, no logits ([Note: fused head on split slices])
            hidden = self.base_model(input_ids=idx, use_cache=False)[0]
            return head.cross_entropy(hidden, targets)
        logits = super().forward(input_ids=idx, use_cache=False).logits
        return logits if targets is None else causal_lm_loss(logits, targets)


_LOSS_CLASSES: dict[type, type] = {}


def loss_class(hf_class: type) -> type:
    """``hf_class`` (a Hugging Face causal LM class) with ``forward(idx, targets=None)``;
    the class attribute ``hf_class`` names the original."""
    if hf_class not in _LOSS_CLASSES:
        # transformers picks the kernels a class may switch to (SDPA attention, grouped
        # matmul experts) by reading its module's source for their decorators: this
        # module has none, so the subclass says what its original can do (else a
        # Mixtral here ran its experts one by one in a loop)
        can = {f"_can_set_{kind}_implementation_cached_value": getattr(hf_class, f"_can_set_{kind}_implementation")()
               for kind in ("attn", "experts") if hasattr(hf_class, f"_can_set_{kind}_implementation")}
        _LOSS_CLASSES[hf_class] = type(
            f"{hf_class.__name__}WithLoss", (_LossForward, hf_class),
            {"__module__": __name__, "hf_class": hf_class, **can},
        )
    return _LOSS_CLASSES[hf_class]


def _build(config_class, model_class, defaults: dict, overrides: dict) -> nn.Module:
    settings = {**defaults, **overrides}
    config = config_class(**settings)
    return loss_class(model_class)(config)


def gpt2_model(**config_overrides) -> nn.Module:
    """A tiny ``GPT2LMHeadModel`` (tied ``wte``/``lm_head``; HF ``Conv1D`` projections)
    with random weights. ``config_overrides`` are ``GPT2Config`` fields."""
    tf = _transformers()
    return _build(tf.GPT2Config, tf.GPT2LMHeadModel, GPT2_DEFAULTS, config_overrides)


def llama_model(**config_overrides) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` (GQA, RMSNorm, SwiGLU, RoPE; ``nn.Linear`` without
    bias) with random weights. ``config_overrides`` are ``LlamaConfig`` fields."""
    tf = _transformers()
    return _build(tf.LlamaConfig, tf.LlamaForCausalLM, LLAMA_DEFAULTS, config_overrides)


def mixtral_model(**config_overrides) -> nn.Module:
    """A tiny ``MixtralForCausalLM`` (Llama's attention, a top-2 router over 4 experts
    held as 3-D weights by one module) with random weights. ``config_overrides`` are
    ``MixtralConfig`` fields."""
    tf = _transformers()
    return _build(tf.MixtralConfig, tf.MixtralForCausalLM, MIXTRAL_DEFAULTS, config_overrides)


def hf_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of any Hugging Face causal LM (or an ``OSDP`` wrapping one):
    ``model(input_ids=idx).logits``; for the models built here ``model(idx, targets)``
    (fused with the head when OSDP split it along the vocabulary)."""
    if _narrowed(model):
        return model(idx, targets)  # fused with a vocabulary-split head
    out = model(input_ids=idx, use_cache=False)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return causal_lm_loss(logits, targets)


def _narrowed(model: nn.Module) -> bool:
    inner = getattr(model, "unwrapped", model)  # OSDP exposes the wrapped module
    return isinstance(inner, _LossForward)


def example_batch(model_or_vocab, batch_size: int, seq_len: int = 8, seed: int = 0):
    """Random tokens ``(idx, targets)``, each ``[batch_size, seq_len]`` (int64), with
    ``targets`` the next tokens of ``idx``; the same for the same seed on every rank.
    ``model_or_vocab``: a model (its ``config.vocab_size``) or the vocabulary size."""
    if isinstance(model_or_vocab, int):
        vocab_size = model_or_vocab
    else:
        vocab_size = getattr(model_or_vocab, "unwrapped", model_or_vocab).config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
