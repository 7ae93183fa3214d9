"""A Hugging Face checkpoint's layout against the model's: which checkpoint tensors make
each parameter, read lazily, and the checkpoint layout to write back.

[Note: checkpoint layout]
transformers 5 holds some weights otherwise than the checkpoints published for them and
than ``save_pretrained`` writes: a mixture of experts keeps each layer's experts as 3-D
tensors (``mlp.experts.gate_up_proj``, experts x 2I x H) where the checkpoint has one
2-D tensor per expert and projection (``block_sparse_moe.experts.3.w1.weight`` and
``w3``), and some names changed (``block_sparse_moe`` -> ``mlp``). ``from_pretrained``
converts by the model's conversion mapping (``transformers.conversion_mapping``), and
a ``load_hf`` by state-dict names found none of Mixtral's, Qwen-MoE's, OLMoE's or
DeepSeek-V3's expert weights. ``checkpoint_sources`` reads the same mapping (renames
first, then at most one converter a key, as transformers does) and makes each model
tensor a *source*: a checkpoint tensor, or a stack (``MergeModulelist``) or
concatenation (``Concatenate``) of sources, which reads a box of the model tensor by
reading only the rows of the checkpoint tensors under it: each rank still reads only
what its shards hold. Other conversion operations raise, naming them. ``save_hf``
writes the checkpoint layout (``to_checkpoint_layout``: transformers' own
``revert_weight_conversion``, as ``save_pretrained`` does), so that what OSDP saves
loads wherever the published checkpoints do.
"""
from __future__ import annotations

import math
import re

import torch

from ..errors import OSDPError


class Source:
    """A model tensor as read from the checkpoint."""

    shape: tuple[int, ...]

    def read(self, handles: dict, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets`` / ``sizes`` of the tensor (``handles``: file -> open
        safetensors file)."""
        raise NotImplementedError

    def keys(self) -> list[str]:
        """The checkpoint keys it reads."""
        raise NotImplementedError


class KeySource(Source):
    def __init__(self, file: str, key: str, shape):
        self.file, self.key, self.shape = file, key, tuple(shape)

    def read(self, handles, offsets, sizes):
        if not self.shape:
            return handles[self.file].get_tensor(self.key)
        return handles[self.file].get_slice(self.key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]

    def keys(self):
        return [self.key]


class _Combined(Source):
    """A source made of ``parts`` along ``dim``."""

    parts: list[Source]
    dim: int

    def keys(self):
        return [k for p in self.parts for k in p.keys()]


class StackSource(_Combined):
    """``torch.stack(parts, dim)`` (transformers' ``MergeModulelist``)."""

    def __init__(self, parts: list[Source], dim: int, name: str):
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise OSDPError(f"cannot stack the checkpoint tensors of {name!r}: their shapes differ ({sorted(shapes)})")
        self.parts, self.dim = parts, dim
        part = parts[0].shape
        self.shape = part[:dim] + (len(parts),) + part[dim:]

    def read(self, handles, offsets, sizes):
        d = self.dim
        rest_offsets, rest_sizes = offsets[:d] + offsets[d + 1:], sizes[:d] + sizes[d + 1:]
        return torch.stack([self.parts[i].read(handles, rest_offsets, rest_sizes)
                            for i in range(offsets[d], offsets[d] + sizes[d])], dim=d)


class CatSource(_Combined):
    """``torch.cat(parts, dim)`` (transformers' ``Concatenate``)."""

    def __init__(self, parts: list[Source], dim: int, name: str):
        others = {p.shape[:dim] + p.shape[dim + 1:] for p in parts}
        if len(others) != 1:
            raise OSDPError(f"cannot concatenate the checkpoint tensors of {name!r} along dim {dim}: their other "
                            f"dims differ ({sorted(others)})")
        self.parts, self.dim = parts, dim
        self.shape = parts[0].shape[:dim] + (sum(p.shape[dim] for p in parts),) + parts[0].shape[dim + 1:]

    def read(self, handles, offsets, sizes):
        d, lo, hi, start, pieces = self.dim, offsets[self.dim], offsets[self.dim] + sizes[self.dim], 0, []
        for part in self.parts:
            a, b = max(lo, start), min(hi, start + part.shape[d])
            if a < b:
                pieces.append(part.read(handles, offsets[:d] + (a - start,) + offsets[d + 1:],
                                        sizes[:d] + (b - a,) + sizes[d + 1:]))
            start += part.shape[d]
        return torch.cat(pieces, dim=d)


def _converts(module) -> bool:
    """Whether ``module`` is a Hugging Face model of a transformers that converts
    checkpoint layouts (one with ``transformers.conversion_mapping``)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401 - the check
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def _mapping(module):
    """transformers' renaming of a checkpoint key for ``module`` (key -> (model name, the
    converter source pattern it matched or None)) and its converters, or None."""
    if not _converts(module):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return lambda key: rename_source_key(key, renamings, converters), converters


def _list_index(pattern: str, key: str) -> int:
    """The module list index of checkpoint ``key`` at the ``*`` of the converter's source
    ``pattern`` that matched it (0 for a pattern without one)."""
    if "*" not in pattern:
        return 0
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if found is None:  # transformers matched it by a regex this reading does not see
        raise OSDPError(f"cannot tell the module list index of checkpoint key {key!r} from the pattern {pattern!r} "
                        "transformers converts it by")
    return int(found.group(1))


def _converted(name: str, converter, found: dict[str, list[tuple[int, Source]]]) -> Source:
    """The source of ``name`` from the checkpoint tensors ``found`` (per source pattern,
    (module list index, source)) by ``converter``'s operations."""
    indices = {p: sorted(i for i, _ in found.get(p, [])) for p in converter.source_patterns}
    count = max(len(v) for v in indices.values())
    for pattern, held in indices.items():
        absent = sorted(set(range(max(count, max(held, default=-1) + 1))) - set(held))
        if absent:  # one expert's tensor lost, or the list numbered from 1
            raise OSDPError(f"the checkpoint tensors of {name!r} are incomplete: {pattern!r} for module list "
                            f"indices {absent} missing")
        if len(set(held)) != len(held):
            raise OSDPError(f"the checkpoint holds several tensors for one place of {name!r} ({pattern!r})")
    values: list = [[s for _, s in sorted(found.get(p, []), key=lambda item: item[0])]
                    for p in converter.source_patterns]
    for op in converter.operations:
        kind = type(op).__name__
        if kind == "MergeModulelist":
            values = [StackSource(parts, op.dim, name) for parts in values]
        elif kind == "Concatenate":
            values = [CatSource(values, op.dim, name)]
        else:
            raise OSDPError(
                f"the checkpoint holds {name!r} in another layout, converted by {kind}, which load_hf does not "
                "read (it reads stacks and concatenations of checkpoint tensors): load the model with "
                "from_pretrained before wrapping it (every rank holds it whole until then)"
            )
    if len(values) != 1 or not isinstance(values[0], Source):
        raise OSDPError(f"the checkpoint tensors of {name!r} ({converter.source_patterns}) do not make one tensor")
    return values[0]


def checkpoint_sources(module, files: dict[str, str], shapes: dict[str, tuple]) -> dict[str, Source]:
    """Model tensor name -> its source in the checkpoint (``files``: key -> file;
    ``shapes``: key -> shape); see [Note: checkpoint layout]."""
    mapping = _mapping(module)
    if mapping is None:
        return {key: KeySource(files[key], key, shape) for key, shape in shapes.items()}
    rename, converters = mapping
    sources: dict[str, Source] = {}
    grouped: dict[str, tuple] = {}  # converted name -> (converter, {pattern: [(index, source)]})
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    for key, shape in shapes.items():
        name, pattern = rename(key)
        source = KeySource(files[key], key, shape)
        if pattern is None:
            sources[name] = source
            continue
        found = grouped.setdefault(name, (by_pattern[pattern], {}))[1].setdefault(pattern, [])
        found.append((_list_index(pattern, key), source))
    for name, (converter, found) in grouped.items():
        sources[name] = _converted(name, converter, found)
    return sources


def to_checkpoint_layout(module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (model names, each complete) in the checkpoint layout, as
    ``save_pretrained`` writes them; unchanged for a model without a conversion mapping."""
    if not _converts(module):
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(module, tensors)


def read_box(source: Source, handles: dict, offsets, sizes, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` (row-major) of the box ``offsets`` / ``sizes`` of ``source``:
    the rows of the box that hold them."""
    if not sizes:
        return source.read(handles, (), ()).reshape(-1)[a:b]
    row = math.prod(sizes[1:])
    r0, r1 = a // row, -(-b // row)
    box = source.read(handles, (offsets[0] + r0, *offsets[1:]), (r1 - r0, *sizes[1:]))
    return box.reshape(-1)[a - r0 * row:b - r0 * row]
