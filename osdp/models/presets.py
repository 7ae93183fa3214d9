"""Named model configs: the paper's three families at paper scale, plus small ones
that train on a laptop CPU.

Paper families (Section 3.1): narrow & deep (N&D), wide & shallow (W&S), inconsistent &
consecutive (I&C: blocks of different widths). GPT-2's vocabulary as in minGPT; the
paper gives neither the sequence length nor the I&C widths: we use 512 tokens (so that
the N&D models train without checkpointing at 8 GiB, as in the paper's Figure 5) and
I&C blocks alternating between two widths.
"""
from __future__ import annotations

from ..errors import ConfigError
from .gpt import GPTConfig

_GPT2_VOCAB = 50257
_SEQ = 512

PRESETS: dict[str, GPTConfig] = {
    # narrow & deep
    "nd-48x1024": GPTConfig(_GPT2_VOCAB, _SEQ, 48, 1024, 16),
    "nd-96x1024": GPTConfig(_GPT2_VOCAB, _SEQ, 96, 1024, 16),
    "nd-64x1536": GPTConfig(_GPT2_VOCAB, _SEQ, 64, 1536, 16),
    # wide & shallow
    "ws-2x12288": GPTConfig(_GPT2_VOCAB, _SEQ, 2, 12288, 96),
    "ws-4x8192": GPTConfig(_GPT2_VOCAB, _SEQ, 4, 8192, 64),
    "ws-8x6144": GPTConfig(_GPT2_VOCAB, _SEQ, 8, 6144, 48),
    # inconsistent & consecutive
    "ic-16x1024-4096": GPTConfig(
        _GPT2_VOCAB, _SEQ, 16, 1024, 16, block_hidden=(1024, 4096) * 8
    ),
    "ic-8x2048-8192": GPTConfig(
        _GPT2_VOCAB, _SEQ, 8, 2048, 32, block_hidden=(2048, 8192) * 4
    ),
    # GPT-3 175B shape (planning only)
    "gpt3-96x12288": GPTConfig(_GPT2_VOCAB, 2048, 96, 12288, 96),
    # small models that run on this machine
    "tiny": GPTConfig(512, 64, 2, 64, 4),
    "small": GPTConfig(2048, 128, 4, 256, 8),
    "tiny-ic": GPTConfig(512, 64, 4, 64, 4, block_hidden=(64, 128, 64, 128)),
    "tiny-ws": GPTConfig(512, 64, 1, 512, 8),
}


def get_preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}"
        ) from None
