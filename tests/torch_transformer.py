"""torch.testing._internal.distributed._tensor.common_dtensor's Transformer, written out:
that module needs ``expecttest``, which this project does not install. A model OSDP's
authors did not design: tied embedding and head, LayerNorms, causal SDPA, a 4x MLP,
dropout, the same module names (``layers.N.attention.wq``, ``feed_forward.w1``, ...)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TiedTransformer(nn.Module):
    """Returns fp32 logits: a training loop brings its own loss."""

    def __init__(self, vocab=101, seq=32, dim=64, layers=3, heads=4, p=0.1):
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.dropout = nn.Dropout(p)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, p) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads, p):
        super().__init__()
        self.heads, self.p = heads, p
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, name, nn.Linear(dim, dim, bias=False))
        self.feed_forward = nn.Module()
        self.feed_forward.w1, self.feed_forward.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        a, (b, s, d) = self.attention, x.shape
        y = self.attention_norm(x)
        q, k, v = (w(y).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (a.wq, a.wk, a.wv))
        y = F.scaled_dot_product_attention(q, k, v, None, self.p if self.training else 0.0, True)
        h = x + self.drop(a.wo(y.transpose(1, 2).reshape(b, s, d)))
        f = self.feed_forward
        return h + self.drop(f.w2(F.gelu(f.w1(self.ffn_norm(h)))))
