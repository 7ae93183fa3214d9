"""Analytic description of the package's GPT (``osdp.models.GPT``) from its config.

Gives the same units, in the same order, with the same parameter counts, FLOPs and
saved-activation bytes that ``describe`` measures on a real forward (a test checks it),
so models far larger than this machine can be planned.

Per block (s = seq, h = width, a = heads, e = element bytes), saved per sample:
    ln_1, ln_2    s h e (input) + 2 s * 4 (fp32 mean and rstd); ln_1's input is the
                  block's input (``block_input_bytes_per_sample``; a bridge's too)
    attn.c_attn   s h e (input) + 3 s h e (q, k, v) + a s^2 e (softmax output); also
                  carries the attention matmuls' 4 s^2 h FLOPs
    attn.c_proj   s h e (input)
    mlp.c_fc      s h e (input) + r s h e (GELU input)
    mlp.c_proj    r s h e (input)
The embedding saves the token ids (s * 8); the head saves its input, the logits
and the targets for the loss: s h e + s V e + s * 8. Of those, the s V e logits
(``logits_bytes_per_sample``) are what a vocabulary-split head with the fused loss never
holds (docs/design/cost_model.md's [Note: fused vocabulary-split loss]).

Split axes come from the op registry, as describe() reads them: the embeddings by rows
(``wte``: the vocabulary, ``wpe``: the positions), every Linear by its default op,
except the head, cut along the vocabulary (its out_features) by the registered
Linear op with that axis; a tied head (``tie_embeddings``) has wte's axis and follows
wte's choice (docs/design/cost_model.md's [Note: tied weights]).

Backward transients (describe's [Note: backward transients]), per sample, each plus
s * 8 bytes; measured values of describe() are equal, except attention's which is an
upper bound within s h e of them (its peak moves between the softmax backward and
the qkv backward with the shape):
    wte, wpe      s h e            ln_*          3 s w e           ln_f     2 s w e
    attn.c_attn   max(2 a s^2 + 2 s w, a s^2 + 3 s w) e            attn.c_proj  2 s w e
    mlp.c_fc      (2 r + 1) s w e  mlp.c_proj    (r + 1) s w e     bridges  (w_in + w) s e
    lm_head       2 s V e
"""
from __future__ import annotations

import torch.nn as nn

from ..models.gpt import GPTConfig
from ..ops import default_split_op_for_kind
from .model_desc import BlockDesc, ModelDesc, OpDesc, vocab_split_op


def describe_gpt(config: GPTConfig, dtype_bytes: int = 4, name: str | None = None) -> ModelDesc:
    s, e, a, r, vocab = config.seq_len, dtype_bytes, config.heads, config.mlp_ratio, config.vocab_size
    widths = config.widths
    ops: list[OpDesc] = []
    blocks: list[BlockDesc] = []

    ids = s * 8  # int64 token ids, saved by the embedding (and the targets, by the loss)

    split = default_split_op_for_kind("linear")  # the registry says along which axis

    def linear(path, fan_in, fan_out, act, grad, extra_flops=0.0, bias=True, block=None, block_input=0.0):
        count = fan_in * fan_out + (fan_out if bias else 0)
        axis = {"in_features": fan_in, "out_features": fan_out}[split.axis] if split.planned else 0
        ops.append(OpDesc(path, "linear", count, count * e, act, 2.0 * s * fan_in * fan_out + extra_flops,
                          splittable=axis >= 2, in_features=axis if axis >= 2 else 0, block=block,
                          act_grad_bytes_per_sample=grad + ids, split_op=split.op_name if axis >= 2 else "",
                          param_tensors=2 if bias else 1,
                          tensor_numels=(fan_in * fan_out, fan_out) if bias else (),
                          block_input_bytes_per_sample=block_input))

    def layernorm(path, h, grad_widths, block=None, block_input=0.0):
        ops.append(OpDesc(path, "layernorm", 2 * h, 2 * h * e, s * h * e + 2 * s * 4, 0.0, False, block=block,
                          act_grad_bytes_per_sample=grad_widths * s * h * e + ids, param_tensors=2,
                          tensor_numels=(h, h), block_input_bytes_per_sample=block_input))

    rows = default_split_op_for_kind("embedding")

    def embedding(path, num, width):
        axis = num if rows is not None and rows.planned and num >= 2 else 0
        ops.append(OpDesc(path, "embedding", num * width, num * width * e, ids if path == "wte" else 0.0, 0.0,
                          splittable=axis >= 2, in_features=axis, act_grad_bytes_per_sample=s * width * e + ids,
                          split_op=rows.op_name if axis else "", param_tensors=1))

    h0 = config.hidden
    embedding("wte", vocab, h0)
    embedding("wpe", s, h0)
    inputs = (h0,) + widths[:-1]
    for i, (w_in, h) in enumerate(zip(inputs, widths)):
        if w_in != h:
            first = len(ops)
            # its saved input is its block's input ([Note: checkpointed block input])
            linear(f"bridges.{i}", w_in, h, s * w_in * e, (w_in + h) * s * e, block=f"bridges.{i}",
                   block_input=s * w_in * e)
            blocks.append(BlockDesc(f"bridges.{i}", first, 1, s * w_in * e))
        b = f"blocks.{i}"
        first = len(ops)
        scores, sh = a * s * s * e, s * h * e
        layernorm(f"{b}.ln_1", h, 3, b, block_input=sh)  # it saves the block's input
        linear(f"{b}.attn.c_attn", h, 3 * h, 4 * sh + scores, max(2 * scores + 2 * sh, scores + 3 * sh),
               extra_flops=4.0 * s * s * h, block=b)
        linear(f"{b}.attn.c_proj", h, h, sh, 2 * sh, block=b)
        layernorm(f"{b}.ln_2", h, 3, b)
        linear(f"{b}.mlp.c_fc", h, r * h, sh + r * sh, (2 * r + 1) * sh, block=b)
        linear(f"{b}.mlp.c_proj", r * h, h, r * sh, (r + 1) * sh, block=b)
        blocks.append(BlockDesc(b, first, len(ops) - first, sh))
    layernorm("ln_f", widths[-1], 2)
    head_act = s * widths[-1] * e + s * vocab * e + ids
    head_grad = 2 * s * vocab * e
    head_split = vocab_split_op(nn.Linear)
    head_axis = vocab if head_split is not None and vocab >= 2 else 0
    if config.tie_embeddings:
        head_axis = head_axis if ops[0].splittable else 0
        count = 0
    else:
        count = widths[-1] * vocab
    ops.append(OpDesc("lm_head", "linear", count, count * e, head_act, 2.0 * s * widths[-1] * vocab,
                      splittable=head_axis >= 2, in_features=head_axis,
                      tied_to="wte" if config.tie_embeddings else None,
                      act_grad_bytes_per_sample=head_grad,
                      split_op=head_split.op_name if head_axis else "",
                      logits_bytes_per_sample=float(s * vocab * e) if head_axis else 0.0,
                      param_tensors=0 if config.tie_embeddings else 1))
    label = name or f"GPT-{config.num_layers}x{config.hidden}"
    return ModelDesc(name=label, ops=tuple(ops), blocks=tuple(blocks))
