"""``describe(model, example_inputs)``: the model's ``ModelDesc``, measured on this
process. A model with parameters on the meta device (or ``fake=True``) is measured on
fake tensors (``osdp.planner.fake_describe``), any other on its real tensors
(``osdp.planner.model_desc.describe_tensors``). The description types and the
measurement live in ``model_desc``, below both, so that the fake path and this entry
import it one way; their names are re-exported here, where callers import them from.
``describe_gpt(config)`` builds the same description analytically."""
from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from ..memtrack import storage_bytes
from .fake_describe import describe_fake, has_meta_parameters
from .inputs import LossFn
from .model_desc import (BlockDesc, ModelDesc, OpDesc, describe_tensors, module_kind, storage_key, vocab_split_op,
                         with_dtype)

__all__ = ["BlockDesc", "ModelDesc", "OpDesc", "describe", "module_kind", "storage_key", "vocab_split_op",
           "with_dtype"]


def describe(
    model: nn.Module,
    example_inputs,
    *,
    name: str | None = None,
    blocks: list[str] | None = None,
    batch_size: int | None = None,
    measure_backward: bool = True,
    loss_fn: LossFn | None = None,
    fake: bool | None = None,
    leaf_modules=None,
) -> ModelDesc:
    """Describe ``model`` by running one forward of ``example_inputs`` (twice when the
    batch can be halved, to separate per-sample bytes from constant ones).

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments
    (Hugging Face: ``{"input_ids": x, "labels": y}``), ``ExampleInputs(args, kwargs)`` or
    one tensor; see [Note: example inputs and the loss] in ``osdp/planner/inputs.py``.
    ``blocks``: module paths that may be checkpointed (default: children of every
    ModuleList). ``batch_size``: the batch of ``example_inputs`` (default: dim 0 of the
    first tensor). ``measure_backward``: also run a backward to measure each unit's
    backward transients; its loss is ``loss_fn(output)`` when given, else
    ``output.loss`` (a ``ModelOutput``) or the output tensor (its sum if not a scalar).
    ``fake``: measure on fake tensors, allocating nothing of the model's size (see
    ``osdp.planner.fake_describe``); default: when a parameter or buffer is on the meta
    device. ``leaf_modules``: module classes or paths, each one unit of every parameter
    below it, as ``osdp.OSDP(leaf_modules=...)`` runs them ([Note: leaf modules] in
    ``osdp/module_tree.py``).
    """
    settings = dict(name=name, blocks=blocks, batch_size=batch_size, measure_backward=measure_backward,
                    loss_fn=loss_fn, leaf_modules=leaf_modules)
    if fake or (fake is None and has_meta_parameters(model)):
        desc = describe_fake(model, example_inputs, **settings)
    else:
        desc = describe_tensors(model, example_inputs, **settings)
    # the runtime leaves buffers whole on every rank (GPT-Neo's causal masks: 4 MiB a
    # layer at 2048 positions); each storage once, on meta too
    return replace(desc, buffer_bytes=float(storage_bytes(model.buffers())))
