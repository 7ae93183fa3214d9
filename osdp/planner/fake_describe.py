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
osdp's GPT and on Hugging Face GPT-2, Llama and Mixtral; a grouped matmul in another
dtype than bf16, which its meta kernel refuses, gets its output from
``grouped_mm.any_dtype_on_fake``: [Note: grouped matmul]). What it cannot see: anything whose
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
A fake forward and backward cost a few milliseconds per operator whatever the shapes,
and the backward live-bytes tracker grows with the number of live tensors: a 70B Llama
(80 layers, 723 units) measured layer by layer takes 34 s on a 2-core machine, 2.4 s
measured as below (peak RSS of the process about 410 MiB either way; the model's 282 GB
of fp32 weights never exist). When the layers are alike,
describe_fake measures the model cut to 3 and to 4 layers instead (``repeat=True``, the
default) and writes out the full depth: layer 0 and the last layer as measured, every
layer in between a copy of layer 1 (renamed), the constant bytes extended by the
per-layer difference. It is used only when

- the blocks are the default ones and exactly one ``ModuleList`` holds parameters, with
  more than 4 children that no parameter ties to anything outside its own layer;
- the children have the same signature: the same module tree (names and types), the
  same parameter and buffer shapes, dtypes and ``requires_grad``, the same plain
  attributes (ints, floats, strings, ...: a sliding window, a layer kind) except the
  layer's own index, and a Hugging Face ``config.layer_types`` names one kind only;
- the two measurements agree: the 4-layer description is the 3-layer one with one more
  middle layer (everything before, after and at both ends equal field by field, layers
  1 and 2 of the 4-layer cut equal up to their names).

Otherwise (or when a cut model fails to run: a forward that needs all its layers) every
layer is measured. tests/planner/test_fake_describe.py checks that the
written-out description equals the one measured layer by layer, field by field.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

import torch
import torch.nn as nn

from ..errors import OSDPError
from ..module_tree import transformer_blocks
from . import grouped_mm
from .inputs import ExampleInputs, LossFn, as_example_inputs
from .model_desc import ModelDesc, _block_descs, describe_tensors


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
    """Fake stand-ins of the tensor arguments; one tensor passed twice stays one tensor
    (its bytes are counted once, as in a real run)."""
    fakes: dict[int, torch.Tensor] = {}

    def one(v):
        if id(v) not in fakes:
            fakes[id(v)] = _fake_like(fake_mode, v, device)
        return fakes[id(v)]

    return inputs.map_tensors(one)


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
    repeat: bool = True,
    name: str | None = None,
    blocks: list[str] | None = None,
    batch_size: int | None = None,
    measure_backward: bool = True,
    loss_fn: LossFn | None = None,
    leaf_modules=None,
) -> ModelDesc:
    """``describe(model, example_inputs, ...)`` measured on fake tensors: nothing of the
    model's size is allocated (see [Note: fake description equals the measured one]).

    ``model``: parameters on the meta device (``with torch.device("meta"): build()``),
    or real ones (then only their metadata is read). ``example_inputs``: as for
    ``describe``; tensors may be real, meta or fake (only shapes and dtypes are used).
    ``device``: the device type the fake tensors claim (it picks kernels, e.g. which
    attention kernel runs and what it saves). ``repeat``: measure alike layers once
    (see [Note: identical blocks]); False measures every layer, as do leaf modules
    (``leaf_modules``, named by path or class, are not renamed layer by layer)."""
    settings = dict(name=name, blocks=blocks, batch_size=batch_size, measure_backward=measure_backward,
                    loss_fn=loss_fn, leaf_modules=leaf_modules)
    device = torch.device(device)
    inputs = as_example_inputs(example_inputs)
    if repeat and blocks is None and not leaf_modules:
        layers = repeated_layers(model)
        if layers is not None:
            desc = _describe_repeated(model, inputs, device, settings, *layers)
            if desc is not None:
                return desc
    return _describe_all(model, inputs, device, settings)


def _describe_all(model: nn.Module, inputs: ExampleInputs, device: torch.device, settings: dict):
    """describe(model) on fake tensors, every layer measured."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    fake_mode = FakeTensorMode()
    with fake_parameters(model, fake_mode, device):
        fake_in = _fake_inputs(fake_mode, inputs, device)
        try:
            with fake_mode, grouped_mm.any_dtype_on_fake(), _unpacked_sequences():
                return describe_tensors(model, fake_in, **settings)
        except (DataDependentOutputException, torch._subclasses.fake_tensor.DynamicOutputShapeException) as exc:
            raise OSDPError(
                f"{type(model).__name__} cannot be described without real data: an operator's output "
                f"depends on tensor values ({exc}); describe it with real (small) weights instead"
                + _experts_hint(model)
            ) from None


def _experts_hint(model: nn.Module) -> str:
    """transformers' "eager" experts loop over the experts the tokens were routed to
    (``nonzero``); its grouped matmul runs on shapes alone."""
    if getattr(getattr(model, "config", None), "_experts_implementation", None) == "eager":
        return (", or build it with experts_implementation=\"grouped_mm\" (its experts run one by one over "
                "the tokens routed to them, a loop whose length depends on values)")
    return ""


# plain attributes that number a layer rather than shape it
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})


def _signature(layer: nn.Module) -> tuple:
    """What makes two layers measure alike: module tree, tensor shapes, plain attributes."""
    parts = []
    for path, module in layer.named_modules():
        plain = sorted(
            (k, v) for k, v in vars(module).items()
            if not k.startswith("_") and k not in _INDEX_ATTRIBUTES and k != "training"
            and isinstance(v, (bool, int, float, str, type(None)))
        )
        parts.append((path, type(module).__qualname__, tuple(plain)))
    for path, t in (*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)):
        parts.append((path, tuple(t.shape), t.dtype, t.requires_grad))
    return tuple(parts)


def repeated_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The path and ``ModuleList`` of alike layers that describe_fake may measure once,
    or None (see [Note: identical blocks] for the conditions)."""
    lists = [(path, m) for path, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and any(True for _ in m.parameters())]
    if len(lists) != 1:
        return None
    path, layers = lists[0]
    if len(layers) <= 4:
        return None
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(set(kinds)) > 1:
        return None
    owner: dict[int, int] = {}  # id(parameter) -> the one layer that holds it
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if owner.setdefault(id(p), i) != i:
                return None  # tied across layers
    prefix = f"{path}."
    if any(id(p) in owner for name, p in model.named_parameters(remove_duplicate=False)
           if not name.startswith(prefix)):
        return None  # tied to something outside the layers
    first = _signature(layers[0])
    if any(_signature(layer) != first for layer in layers):
        return None
    return path, layers


@contextlib.contextmanager
def _cut(layers: nn.ModuleList, count: int):
    """Inside: ``layers`` holds only its first ``count`` children (names unchanged)."""
    full = layers._modules
    layers._modules = type(full)(list(full.items())[:count])
    try:
        yield
    finally:
        layers._modules = full


def _renamed(op, prefix_from: str, prefix_to: str):
    def one(name):
        if name is not None and (name == prefix_from or name.startswith(prefix_from + ".")):
            return prefix_to + name[len(prefix_from):]
        return name

    return replace(op, name=one(op.name), block=one(op.block), tied_to=one(op.tied_to))


def _split(desc, path: str, count: int):
    """(ops before the layers, ops of each layer, ops after) or None if not in that shape."""
    prefix = f"{path}." if path else ""
    names = [f"{prefix}{i}" for i in range(count)]
    ops = list(desc.ops)
    layer_of = [names.index(op.block) if op.block in names else None for op in ops]
    inside = [i for i, layer in enumerate(layer_of) if layer is not None]
    if not inside or inside != list(range(inside[0], inside[-1] + 1)):
        return None
    per_layer = [[op for op, layer in zip(ops, layer_of) if layer == i] for i in range(count)]
    if sorted(layer_of[inside[0]: inside[-1] + 1]) != layer_of[inside[0]: inside[-1] + 1] or not all(per_layer):
        return None
    return ops[: inside[0]], per_layer, ops[inside[-1] + 1:]


def _describe_repeated(model, inputs, device, settings, path: str, layers: nn.ModuleList):
    """The full-depth description from cuts of 3 and 4 layers, or None when the two
    do not agree (see [Note: identical blocks])."""
    cuts = {}
    for count in (3, 4):
        with _cut(layers, count):
            try:
                cuts[count] = _describe_all(model, inputs, device, settings)
            except Exception:  # noqa: BLE001 - measuring every layer is always right
                return None
    three, four = _split(cuts[3], path, 3), _split(cuts[4], path, 4)
    if three is None or four is None:
        return None
    prefix = f"{path}." if path else ""

    def layer(ops, i, as_i):
        return [_renamed(op, f"{prefix}{i}", f"{prefix}{as_i}") for op in ops]

    (pre3, l3, post3), (pre4, l4, post4) = three, four
    agree = (
        pre3 == pre4 and post3 == post4 and l3[0] == l4[0] and l3[1] == l4[1]
        and layer(l3[2], 2, 3) == l4[3] and layer(l4[1], 1, 2) == l4[2]
    )
    inputs3 = {b.name: b.input_bytes_per_sample for b in cuts[3].blocks}
    inputs4 = {b.name: b.input_bytes_per_sample for b in cuts[4].blocks}
    agree = agree and inputs3.get(f"{prefix}0") == inputs4.get(f"{prefix}0") \
        and inputs3.get(f"{prefix}1") == inputs4.get(f"{prefix}1") == inputs4.get(f"{prefix}2") \
        and inputs3.get(f"{prefix}2") == inputs4.get(f"{prefix}3")
    if not agree:
        return None
    n = len(layers)
    ops = [*pre4, *l4[0]]
    for i in range(1, n - 1):
        ops += layer(l4[1], 1, i)
    ops += layer(l4[3], 3, n - 1) + post4
    block_inputs = {f"{prefix}0": inputs4[f"{prefix}0"], f"{prefix}{n - 1}": inputs4[f"{prefix}3"]}
    for i in range(1, n - 1):
        block_inputs[f"{prefix}{i}"] = inputs4[f"{prefix}1"]
    per_layer_constant = cuts[4].act_constant_bytes - cuts[3].act_constant_bytes
    return ModelDesc(
        name=cuts[4].name,
        ops=tuple(ops),
        blocks=_block_descs(ops, transformer_blocks(model), block_inputs),
        act_constant_bytes=cuts[4].act_constant_bytes + (n - 4) * per_layer_constant,
        # a returned cache grows with the layers; the logits do not
        output_bytes_per_sample=cuts[4].output_bytes_per_sample
        + (n - 4) * (cuts[4].output_bytes_per_sample - cuts[3].output_bytes_per_sample),
        loss_bytes_per_sample=cuts[4].loss_bytes_per_sample,
        meta={"repeated_layers": f"{prefix}1..{prefix}{n - 2} written out from {prefix}1 of a 4-layer cut"},
    )
