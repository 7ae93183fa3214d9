"""Per-rank body of ``test_lockstep.py``: stock Hugging Face code that runs different
modules on different ranks unless it knows the model is sharded ([Note: ranks in
lockstep] in osdp/runtime/lockstep.py).

- LayerDrop: Wav2Vec2 with ``layerdrop=0.5``, every rank drawing its own skips (seeded
  apart); HF runs every layer of a sharded model, so the reference is single-process
  training with ``layerdrop=0``.
- ``generate``: each rank its own prompt and ``max_new_tokens``; the rank done first
  must keep stepping (``synced_gpus``) while its peer generates."""
from __future__ import annotations

import torch

import osdp

from . import other_models_cases as oc

LAYERS, LAYERDROP = 4, 0.5


def rank_seed(rank: int) -> int:
    return 1000 + rank


def build_wav2vec2(layerdrop: float):
    return oc.build("wav2vec2", num_hidden_layers=LAYERS, layerdrop=layerdrop)


def train_wav2vec2(model, world: int, rank: int | None) -> list[float]:
    return oc.train(model, "wav2vec2", world, rank)


def build_llama():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def prompt(rank: int) -> torch.Tensor:
    return torch.tensor([[3, 4, 5 + rank]])


def new_tokens(rank: int) -> int:
    return 2 + 4 * rank  # rank 0 is done four forwards before rank 1


def generate(model, rank: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt(rank), max_new_tokens=new_tokens(rank), do_sample=False, pad_token_id=0)


def run(rank: int, world: int) -> dict:
    from transformers.distributed.fsdp import is_fsdp_managed_module

    out = {}
    model = osdp.OSDP(build_wav2vec2(LAYERDROP), default_mode="zdp", timeout_s=60)
    out["marked"] = is_fsdp_managed_module(model.unwrapped.wav2vec2.encoder)
    torch.manual_seed(rank_seed(rank))  # each rank draws its own skips
    out["losses"] = train_wav2vec2(model, world, rank)
    out["state"] = model.full_state_dict(rank0_only=False)
    llama = osdp.OSDP(build_llama(), default_mode="zdp", timeout_s=60).eval()
    out["tokens"] = generate(llama.unwrapped, rank)
    return out
