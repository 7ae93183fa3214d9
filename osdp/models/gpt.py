"""A minGPT-style GPT with configs for the paper's three model families.

Blocks may have different hidden sizes (the "inconsistent & consecutive" family);
a Linear bridge maps between consecutive blocks whose widths differ. Dropout is off
so that training is deterministic and comparable across parallel layouts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64
    num_layers: int = 2
    hidden: int = 64
    heads: int = 4
    # per-block hidden sizes (inconsistent & consecutive models); empty: all `hidden`
    block_hidden: tuple[int, ...] = field(default=())
    mlp_ratio: int = 4
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "num_layers", "hidden", "heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        for i, width in enumerate(self.block_hidden):
            if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
                raise ConfigError(f"GPTConfig.block_hidden[{i}] must be a positive integer, got {width!r}")
        if self.block_hidden and len(self.block_hidden) != self.num_layers:
            raise ConfigError(
                f"GPTConfig.block_hidden has {len(self.block_hidden)} entries; "
                f"it needs one per layer ({self.num_layers}) or none"
            )
        for width in self.widths:
            if width % self.heads:
                raise ConfigError(
                    f"hidden size {width} is not divisible by heads={self.heads}; "
                    "pick a hidden size that is a multiple of the head count"
                )
        if self.tie_embeddings and self.widths[-1] != self.hidden:
            raise ConfigError("tie_embeddings needs the last block's width equal to `hidden`")

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(self.block_hidden) if self.block_hidden else (self.hidden,) * self.num_layers


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.c_attn(x).split(hidden, dim=2)
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        # explicit softmax attention: deterministic on CPU and the same math everywhere
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hidden // self.heads)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, hidden: int, ratio: int):
        super().__init__()
        self.c_fc = nn.Linear(hidden, ratio * hidden)
        self.c_proj = nn.Linear(ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, blocks (with width bridges), final LayerNorm, head.

    ``forward(idx, targets=None)`` returns logits, or the mean cross-entropy loss when
    targets are given (fused with the head, no logits kept, when the runtime replaced
    ``lm_head`` by a vocabulary-split op whose ``fuses_loss()`` says so).
    """

    # the planner counts the logits a split head never holds ([Note: fused head loss])
    osdp_fuses_head_loss = True

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        widths = config.widths
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(w, config.heads, config.mlp_ratio) for w in widths)
        # bridges[i] maps the input of block i to its width (Identity where equal)
        inputs = (config.hidden,) + widths[:-1]
        self.bridges = nn.ModuleList(
            nn.Identity() if w_in == w else nn.Linear(w_in, w) for w_in, w in zip(inputs, widths)
        )
        self.ln_f = nn.LayerNorm(widths[-1])
        self.lm_head = nn.Linear(widths[-1], config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self.init_module)

    @staticmethod
    def init_module(module: nn.Module) -> None:
        """GPT-2's initialization of one module's own parameters: the ``param_init_fn``
        of a GPT built on the meta device (``osdp.OSDP(meta_gpt, ...,
        param_init_fn=GPT.init_module)``; [Note: meta initialization])."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ConfigError(f"sequence length {seq} exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for bridge, block in zip(self.bridges, self.blocks):
            x = block(bridge(x))
        x = self.ln_f(x)
        if targets is not None and getattr(self.lm_head, "fuses_loss", lambda: False)():
            # the head split along vocabulary (by OSDP's runtime): the loss slice by slice,
            # no [batch, seq, vocab] logits ([Note: fused head on split slices])
            return self.lm_head.cross_entropy(x, targets)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def example_batch(config: GPTConfig, batch: int, seed: int = 0, device=None):
    """(idx, targets) of random tokens: deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
    idx = idx.to(device) if device is not None else idx
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def counting_batch(config: GPTConfig, batch: int, seed: int = 0, device=None):
    """(idx, targets) where every next token is the previous one + 1 (mod vocab), from a
    random start: a task a GPT learns in a few steps, so training visibly works."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (batch, 1), generator=gen)
    idx = (start + torch.arange(config.seq_len + 1)) % config.vocab_size
    idx = idx.to(device) if device is not None else idx
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
