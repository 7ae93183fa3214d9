"""Describe a model without allocating it: the measured ``describe`` run on fake tensors.

``describe_fake(model, example_inputs)`` (or ``describe(model, ...)`` of a model whose
parameters are on the meta device) gives every parameter and buffer a ``FakeTensor``
stand-in of the same shape, dtype and ``requires_grad`` on ``device`` (default cpu),
turns the example inputs into fake tensors too, and runs ``describe`` unchanged under
``FakeTensorMode``: the same hooks, the same saved-tensor hooks, the same
``FlopCounterMode``, the same live-bytes tracker for backward transients. Fake tensors
carry shapes, dtypes, strides and storage identity (views share their base's storage)
but no memory, so a 70B model is described in seconds on a laptop. The model's own
parameters and buffers are put back afterwards (still on meta, never materialized).

[Note: fake description equals the measured one]
describe reads only shapes, dtypes, storage identity (``storage_key``), storage sizes,
FLOPs (from shapes) and the order in which modules run and tensors die; fake tensors
keep all of these, so a fake description equals a real one field by field (tested on
osdp's GPT and on Hugging Face GPT-2 and Llama). What it cannot see: anything whose
shape depends on tensor values (``nonzero``, boolean masks, ``.item()``-driven control
flow) raises under fake mode (``DataDependentOutputException``); describe then says so.
Code that checks for fake tensors takes its tracing path: Hugging Face models cannot
read fake position ids and would assume packed sequences (an explicit causal mask,
repeated GQA keys and values); describe_fake takes them as one sequence per row, as
default position ids are (``_unpacked_sequences``). Explicit packed position ids or an
``attention_mask`` argument are described as a traced run sees them (mask kept), which
can be more than a real run on all-ones values.
Kernels are chosen for ``device`` (default cpu): a fake ``scaled_dot_product_attention``
saves what the cpu kernel saves (flash attention for cpu: O(seq) logsumexp, like the
GPU flash kernel), not what another backend would.

[Note: identical blocks]
``describe_fake`` runs every layer: per-layer repetition is not exploited, because each
layer costs a few milliseconds under fake mode (a 70B Llama, 80 layers, forward and
backward at two batch sizes, takes well under a minute) and a measured layer-by-layer
description needs no proof that the layers are alike.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn

from ..errors import OSDPError
from .inputs import ExampleInputs, LossFn, as_example_inputs


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (no storage:
    only a fake run can describe it)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _fake_like(fake_mode, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor with ``tensor``'s shape, strides and dtype on ``device``; a real
    tensor keeps its device (``from_tensor`` records metadata only, copies no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor):
        return tensor
    if tensor.is_meta:
        with fake_mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return fake_mode.from_tensor(tensor)


@contextlib.contextmanager
def fake_parameters(model: nn.Module, fake_mode, device: torch.device):
    """Inside: every parameter and buffer of ``model`` is a fake tensor (tied parameters
    stay one object); on exit the originals are put back."""
    fakes: dict[int, torch.Tensor] = {}  # id(original) -> its fake (ties stay ties)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for key, value in list(table.items()):
                    if value is None:
                        continue
                    fake = fakes.get(id(value))
                    if fake is None:
                        fake = _fake_like(fake_mode, value.detach(), device)
                        if is_param:
                            fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                        fakes[id(value)] = fake
                    swapped.append((table, key, value))
                    table[key] = fake
        yield
    finally:
        for table, key, value in reversed(swapped):
            table[key] = value


def _fake_inputs(fake_mode, inputs: ExampleInputs, device: torch.device) -> ExampleInputs:
    def one(v):
        return _fake_like(fake_mode, v, device) if isinstance(v, torch.Tensor) else v

    return ExampleInputs(tuple(one(v) for v in inputs.args), {k: one(v) for k, v in inputs.kwargs.items()})


@contextlib.contextmanager
def _unpacked_sequences():
    """Hugging Face models look at the position ids for packed sequences (several
    sequences in one row) and, when they cannot read them (fake tensors count as
    tracing), build an explicit causal mask instead of SDPA's ``is_causal``: a different
    kernel path and more saved bytes than a real run. Inside, fake position ids are
    taken as one sequence per row (what default position ids are), so that the fake run
    takes the path a real one takes. See [Note: fake description equals the measured one]."""
    from torch._subclasses.fake_tensor import FakeTensor

    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return

    def unpacked(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor):
            return None
        return find(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


def describe_fake(
    model: nn.Module,
    example_inputs,
    *,
    device: str | torch.device = "cpu",
    name: str | None = None,
    blocks: list[str] | None = None,
    batch_size: int | None = None,
    measure_backward: bool = True,
    loss_fn: LossFn | None = None,
) -> "ModelDesc":  # noqa: F821
    """``describe(model, example_inputs, ...)`` measured on fake tensors: nothing of the
    model's size is allocated (see [Note: fake description equals the measured one]).

    ``model``: parameters on the meta device (``with torch.device("meta"): build()``),
    or real ones (then only their metadata is read). ``example_inputs``: as for
    ``describe``; tensors may be real, meta or fake (only shapes and dtypes are used).
    ``device``: the device type the fake tensors claim (it picks kernels, e.g. which
    attention kernel runs and what it saves)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from .description import describe

    device = torch.device(device)
    inputs = as_example_inputs(example_inputs)
    fake_mode = FakeTensorMode()
    with fake_parameters(model, fake_mode, device):
        fake_in = _fake_inputs(fake_mode, inputs, device)
        try:
            with fake_mode, _unpacked_sequences():
                return describe(
                    model, fake_in, name=name, blocks=blocks, batch_size=batch_size,
                    measure_backward=measure_backward, loss_fn=loss_fn, fake=False,
                )
        except (DataDependentOutputException, torch._subclasses.fake_tensor.DynamicOutputShapeException) as exc:
            raise OSDPError(
                f"{type(model).__name__} cannot be described without real data: an operator's output "
                f"depends on tensor values ({exc}); describe it with real (small) weights instead"
            ) from None
