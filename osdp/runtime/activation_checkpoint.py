"""Activation checkpointing of whole modules (``plan.checkpoint_blocks``).

Non-reentrant ``torch.utils.checkpoint`` around the module's forward. The recompute
runs the module's forward again inside backward; the scheduler sees it as a recompute
(see [Note: activation checkpointing]) and gathers ``zdp`` units again for it.

[Note: checkpointing and key/value caches]
A Hugging Face decoder layer called with a key/value cache (``use_cache=True``, the
default of ``GPT2LMHeadModel`` and ``LlamaForCausalLM``) appends its keys and values to
the cache object in forward; the recompute in backward would append them a second time
and attend over twice the sequence (a shape mismatch, or wrong gradients). Hugging
Face's own gradient checkpointing turns the cache off in training; so does this: when
any block is checkpointed and the model has ``config.use_cache``, it is set to False
(with a warning). A forward that passes ``use_cache=True`` explicitly still fails.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("osdp.runtime")


def apply_checkpointing(model: nn.Module, blocks: tuple[str, ...], on_recompute_end=None,
                        recompute_context=None) -> None:
    """The eager path's checkpointing (the compiled path's is a region class, [Note: one
    code object per region plan] in compiled_regions.py). ``on_recompute_end()``:
    called when a block's forward run by checkpoint returns or stops (in backward, the
    recompute's end: the memory ledger labels what follows). ``recompute_context(path)``:
    a context manager around the recompute of the block at ``path``, which runs the
    block's forward without its own module hooks."""
    if blocks:
        disable_kv_cache(model)
    for path in blocks:
        module = model.get_submodule(path)
        inner = module.forward

        def run(*args, _inner=inner, **kwargs):
            try:
                return _inner(*args, **kwargs)
            finally:  # also when checkpoint stops the recompute early (an exception)
                if on_recompute_end is not None:
                    on_recompute_end()

        def contexts(_path=path):
            recompute = recompute_context(_path) if recompute_context is not None else contextlib.nullcontext()
            return contextlib.nullcontext(), recompute

        def forward(*args, _inner=inner, _run=run, _contexts=contexts, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_run, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        module.forward = forward


def disable_kv_cache(model: nn.Module) -> None:
    """See [Note: checkpointing and key/value caches]."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        log.warning("%s: checkpointed blocks recompute their forward, which a key/value cache "
                    "would see twice: setting config.use_cache = False", type(model).__name__)
        config.use_cache = False
