"""Models shipped with OSDP: a minGPT-style GPT and named configs."""
from .gpt import GPT, GPTConfig, counting_batch, example_batch
from .presets import PRESETS, get_preset

__all__ = ["GPT", "GPTConfig", "counting_batch", "example_batch", "PRESETS", "get_preset"]
