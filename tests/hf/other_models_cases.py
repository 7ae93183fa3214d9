"""Per-rank body of ``test_other_models.py``: stock Hugging Face models of other shapes
than the decoder-only LMs of hf_cases.py: BERT masked LM (a prediction head that owns
the bias its tied decoder adds), T5 (one shared embedding used by the encoder, the
decoder and the head), ViT (image patches, a classification head), Wav2Vec2 (CTC over
audio; its positional convolution's weight under ``weight_norm``, a parametrization),
mixtures of experts (Mixtral, DeepSeek-V3, GPT-OSS: experts as 3-D weights; Switch
Transformers: a module per expert, only routed ones called), Gemma 2 (soft-capped logits,
a scaled word embedding that calls ``super().forward``)."""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import osdp

from runtime import split_batch_loop

LOCAL_BATCH, STEPS = 2, 3


# kind -> (model class, config class, config) in transformers: tiny, no dropout
MODELS = {
    "bert": ("BertForMaskedLM", "BertConfig", dict(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
    "wav2vec2": ("Wav2Vec2ForCTC", "Wav2Vec2Config", dict(
        vocab_size=20, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
        ctc_loss_reduction="mean")),
    # a mixture of experts: 4 experts as 3-D weights of one module, run by a grouped
    # matmul, top-2 routing and its load-balancing loss in the loss
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        output_router_logits=True, router_aux_loss_coef=0.02)),
    # MLA attention, a dense first layer, routed experts beside a shared one, a router
    # limited to the best group of experts
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=32, rope_scaling=None)),
    # another: experts with biases, attention sinks, sliding and full attention layers
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        output_router_logits=True, router_aux_loss_coef=0.02, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    # experts as one module each, only those routed some token called (an expert_hit
    # loop): the ranks stay in step with the sparse MLP a leaf module (LEAVES)
    "switch": ("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", dict(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, expert_capacity=64, num_layers=2, num_sparse_encoder_layers=1,
        num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=4, num_experts=4, router_jitter_noise=0.0,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
    # logit soft-capping, sliding and full attention, a scaled word embedding whose
    # forward calls super().forward (an nn.Embedding subclass)
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=4,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, attention_dropout=0.0)),
    # a state-space model: its mixer computes with its children's weights (conv1d,
    # dt_proj) without calling them, so the mixer is a leaf module (LEAVES)
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(
        vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, use_cache=False)),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5)),
}


# kind -> the transformers class each of whose modules is one unit ([Note: leaf modules])
LEAVES = {"switch": "SwitchTransformersSparseMLP", "mamba": "MambaMixer"}
# kind -> the splits of its "split" case: T5's shared embedding by rows, which its encoder
# and decoder embeddings (Embeddings of the same weight) and its head (a Linear) follow
SPLITS = {"t5": {"splits": {"shared": 2}, "modes": {"shared[1]": "dp"}},
          # the experts by groups, two phases ([Note: experts split] in osdp/ops/split_experts.py)
          "mixtral": {"splits": {"model.layers.0.mlp.experts": 4, "model.layers.1.mlp.experts": 8},
                      "modes": {"model.layers.0.mlp.experts[1]": "dp", "model.layers.0.mlp.experts[3]": "dp"}},
          "deepseek_v3": {"splits": {"model.layers.1.mlp.experts": 4, "model.layers.2.mlp.experts": 2},
                          "modes": {"model.layers.2.mlp.experts": "dp"}}}


def build(kind: str, **config):
    """The stock model of ``kind`` from a fixed seed; ``config`` overrides its config."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model_class, config_class, defaults = MODELS[kind]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**defaults, **config}))


def _batch(kind: str, step: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(50 + step)
    n = LOCAL_BATCH * world
    if kind == "wav2vec2":  # 800 samples of audio, 5 CTC labels
        return {"input_values": torch.randn(n, 800, generator=gen),
                "labels": torch.randint(1, 20, (n, 5), generator=gen)}
    if kind == "vit":
        return {"pixel_values": torch.randn(n, 3, 16, 16, generator=gen),
                "labels": torch.randint(0, 5, (n,), generator=gen)}
    tokens = torch.randint(1, 100, (n, 10), generator=gen)
    labels = torch.randint(1, 100, (n, 6), generator=gen) if kind in ("t5", "switch") else tokens
    return {"input_ids": tokens, "labels": labels}


def train(model, kind: str, world: int, rank: int | None) -> list[float]:
    """STEPS AdamW steps; ``rank`` None: single process, the mean of the ranks' losses,
    with a zero gradient for a leaf module's parameter no token reached, as OSDP reduces
    a leaf ([Note: leaf modules]) where one process would leave None."""
    leaves = [p for m in model.modules() if type(m).__name__ == LEAVES.get(kind) for p in m.parameters()]
    return split_batch_loop.train(model, lambda step: _batch(kind, step, world), STEPS, world, rank,
                                  zero_grad_of=leaves if rank is None else ())


def run_models(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """Per (model, path): the losses and the full state after training."""
    out = {}
    for kind, path in cases:
        torch._dynamo.reset()
        compile_arg = {"backend": "aot_eager"} if path == "compiled" else None
        plain = build(kind)
        extra = {"leaf_modules": tuple({type(m) for m in plain.modules() if type(m).__name__ == LEAVES[kind]})
                 } if kind in LEAVES else {}
        if path == "split":
            extra.update(SPLITS[kind])
        model = osdp.OSDP(plain, default_mode="zdp", compile=None if path == "split" else compile_arg, **extra)
        counters.clear()
        out[f"{kind}-{path}"] = {"losses": train(model, kind, world, rank),
                                 "state": model.full_state_dict(rank0_only=False), "units": model.unit_names(),
                                 "breaks": [str(k)[:300] for k in counters["graph_break"]]}
    return out
