"""Telling a model's own code that it is sharded, so that it keeps the ranks in step.

[Note: ranks in lockstep]
Every gather and reduction is a collective: each rank must run the same units in the
same order, or a rank waits for a peer that never comes (a hang, or gloo's abort on a
size mismatch) or, worse, exchanges shards with a peer gathering another unit of the
same size (silently wrong weights). Models that run modules depending on data or on
random draws break that: LayerDrop skips layers at random per rank (stock Wav2Vec2,
WavLM, HuBERT, Data2VecAudio; ``layerdrop=0.1`` by default), and ``generate`` stops a
rank whose sequences are done while its peers go on.

Hugging Face models keep their ranks in step themselves when they see that a module is
sharded: ``transformers.distributed.fsdp.is_fsdp_managed_module(module)``, which reads
the ``_is_fsdp_managed_module`` attribute FSDP2's ``fully_shard`` sets, turns LayerDrop
off (every layer runs, as under FSDP2 and DeepSpeed ZeRO-3) and makes ``generate`` run
with ``synced_gpus`` (a finished rank keeps stepping until every rank is done). OSDP
sets that attribute, and ``_fsdp_use_orig_params`` (its parameters are the originals,
[Note: original parameters]), on every module of the wrapped model.

Not on modules inside compiled regions: Dynamo traces a module carrying the attribute as
an FSDP-managed one (its parameters graph inputs, its guards skipped), which the compiled
path is not built for. The modules that make these checks are the containers that loop
over the blocks (an encoder) and the top model (``generate``), outside the per-block
regions; under ``compile={"scope": "model"}`` none is marked.

A model's own data-dependent calls are not covered: a mixture of experts written with
one module per expert that calls only the experts its tokens were routed to gathers
different units on different ranks (and a ``rep`` expert left without a gradient on
one rank changes the size of its replicated bucket there). Make the block one unit,
``leaf_modules=(MoEBlock,)`` ([Note: leaf modules] in osdp/module_tree.py: every expert
gathered when the block's forward starts, an expert its tokens skipped reduces a zero
gradient), or call every expert on every rank, one routed no tokens on its empty slice
of them (tests/runtime/test_lockstep_moe.py has both), or keep the experts in one
module, as stock Mixtral and Qwen MoE do.

Ranks that fall out of step all the same are caught by the check in lockstep_check.py.
"""
from __future__ import annotations

import torch.nn as nn

from .compiled_regions import inside_any


def mark_lockstep(model: nn.Module, compiled_regions=()) -> None:
    """Set the sharded-module attributes on the modules of ``model`` outside
    ``compiled_regions`` (paths; ``""`` is the whole model)."""
    if "" in compiled_regions:
        return
    compiled = inside_any(compiled_regions)
    for path, module in model.named_modules():
        if not compiled(path):
            module._is_fsdp_managed_module = True
            module._fsdp_use_orig_params = True
