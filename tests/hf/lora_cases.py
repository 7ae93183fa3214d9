"""Per-rank body of ``test_lora.py``: LoRA adapters (``peft``) on a stock Llama, the base
frozen, wrapped by OSDP, against single-process training of the same adapters."""
from __future__ import annotations

import torch

import osdp
import osdp.checkpoint as ckpt

from runtime import split_batch_loop

VOCAB, SEQ, LOCAL_BATCH, STEPS = 128, 12, 2, 3
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa")
PREFIX = "base_model.model.model.layers."
# the frozen base sharded (q_proj's base layer split in a dp and a zdp slice), an adapter
# dp, the rest zdp
PLAN = {"default_mode": "zdp",
        "modes": {f"{PREFIX}0.self_attn.q_proj.base_layer": ["dp", "zdp"],
                  f"{PREFIX}1.self_attn.v_proj.lora_B.default": "dp"},
        "splits": {f"{PREFIX}0.self_attn.q_proj.base_layer": 2}}


def lora_llama():
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    # init_lora_weights=False: B is random too, so that the adapters change the logits
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _batch(step: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(40 + step)
    tokens = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ), generator=gen)
    return {"input_ids": tokens, "labels": tokens}


def train(model, world: int, rank: int | None) -> list[float]:
    """STEPS AdamW steps on the trainable parameters (the adapters); ``rank`` None:
    single process, the mean of the ranks' losses."""
    return split_batch_loop.train(model, lambda step: _batch(step, world), STEPS, world, rank)


def run_lora(rank: int, world: int, compile_arg) -> dict:
    """Train the adapters wrapped (eager, or compiled with ``compile_arg``); their state
    as peft saves it, from the gathered full state dict (rank 0)."""
    import peft

    torch._dynamo.reset()
    model = osdp.OSDP(lora_llama(), compile=compile_arg, **PLAN)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    losses = train(model, world, rank)
    full = ckpt.full_state_dict(model)  # rank 0's, None elsewhere
    adapters = None if full is None else peft.get_peft_model_state_dict(model.unwrapped, state_dict=full)
    return {"losses": losses, "trainable": trainable, "adapters": adapters, "full": full}
