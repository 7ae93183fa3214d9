"""Hugging Face checkpoints (safetensors) straight into and out of the shards.

[Note: Hugging Face checkpoints]
``load_hf(model, path)`` fills an OSDP-wrapped model (built on the meta device or not;
split, tied and rep units alike) from a checkpoint directory holding
``model.safetensors`` or a sharded ``model.safetensors.index.json``, as written by
``save_pretrained``. Keys are the wrapped model's state-dict names (a tied parameter by
any of its names; Hugging Face leaves a tied head out), or the checkpoint layout that
transformers converts from (a mixture of experts' tensors one per expert: [Note:
checkpoint layout] in hf_layout.py). Everything is checked before
anything changes: a key missing, one unexpected or a shape that differs is one error
naming them all. Then every rank reads, through safetensors' own slicing (no
hand-written parsing), for each piece of each parameter only the rows that hold its
elements of its shard (its box of a split slice; a rep unit's whole): at most a
parameter's piece at a time beyond the shards, into fresh buffers that are copied into
the shards only once every rank has read everything.

``save_hf(model, path)`` writes the same layout back (the checkpoint layout, as
``save_pretrained`` does): every rank takes part in gathering
one unit at a time; rank 0 assembles each parameter, and writes a file as soon as the
parameters planned for it are complete (files of at most ``max_shard_size``, the
index beside them when there are several, the wrapped model's ``config.json`` when it
is a Hugging Face model), so rank 0 holds at most one file's tensors and one split op.
A tied parameter is written under its first name only (safetensors stores no shared
tensors; ``from_pretrained`` ties it again from its config). The directory is replaced
atomically ([Note: atomic checkpoints] in ``_atomic.py``).
"""
from __future__ import annotations

import json
import math
import os
import shutil

import torch

from ..errors import OSDPError, PlanMismatchError
from ..runtime.state_dict import box_view, listed, local_range
from ..sizes import parse_bytes
from . import _atomic
from ._atomic import agree, on_rank0
from ._view import prepare, world
from .hf_layout import checkpoint_sources, read_box, to_checkpoint_layout

__all__ = ["load_hf", "save_hf"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401 - a dependency of transformers
        from safetensors import safe_open
    except ImportError as exc:
        raise OSDPError("osdp.checkpoint.load_hf/save_hf need the safetensors package: pip install safetensors") from exc
    return safe_open


# ---- reading -------------------------------------------------------------------------------
def checkpoint_files(path) -> dict[str, str]:
    """Key -> the safetensors file holding it, of the checkpoint directory ``path``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise OSDPError(f"{path!r} is not a directory: load_hf reads a Hugging Face checkpoint directory "
                        f"(with {SINGLE_FILE} or {INDEX_FILE}, as save_pretrained writes)")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OSDPError(f"{index!r} is not a safetensors index (a JSON object with a 'weight_map'): {exc}") from exc
        files = {key: os.path.join(path, name) for key, name in weight_map.items()}
        absent = sorted({f for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise OSDPError(f"{index!r} names files that do not exist: {absent[:4]}")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        safe_open = _safetensors()
        with safe_open(single, framework="pt") as f:
            return {key: single for key in f.keys()}
    found = sorted(os.listdir(path))[:8]
    raise OSDPError(f"{path!r} holds neither {SINGLE_FILE} nor {INDEX_FILE} (it has {found}): not a Hugging Face "
                    "safetensors checkpoint (a .bin checkpoint: load it with transformers and save_pretrained it "
                    "with safe_serialization=True)")


def _shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    safe_open = _safetensors()
    shapes = {}
    for name in sorted(set(files.values())):
        with safe_open(name, framework="pt") as f:
            for key in f.keys():
                if files.get(key) == name:
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _match(layout, sources: dict) -> tuple[dict[str, str], str | None]:
    """Parameter or buffer name -> its name among ``sources`` (the checkpoint's tensors
    as the model names them: [Note: checkpoint layout] in hf_layout.py); and what does
    not match (keys missing, unexpected, shapes that differ), or None."""
    keys, missing, wrong = {}, [], []
    for fqn, info in layout.params.items():
        key = next((k for k in (fqn, *info.aliases) if k in sources), None)
        if key is None:
            missing.append(fqn)
            continue
        keys[fqn] = key
        if tuple(sources[key].shape) != tuple(info.shape):
            wrong.append(f"{_named(key, sources)} is {list(sources[key].shape)} in the checkpoint, "
                         f"{list(info.shape)} in the model")
    for name, shape in layout.buffers.items():
        if name not in sources:
            missing.append(name)
            continue
        keys[name] = name
        if tuple(sources[name].shape) != tuple(shape):
            wrong.append(f"{_named(name, sources)} is {list(sources[name].shape)} in the checkpoint, "
                         f"{list(shape)} in the model")
    known = set(keys.values()) | set(layout.aliases)
    unexpected = [k for name, source in sources.items() if name not in known for k in source.keys()]
    problems = []
    if missing:
        problems.append(f"keys missing from the checkpoint: {listed(missing)}")
    if unexpected:
        problems.append(f"keys the model does not have: {listed(unexpected)}")
    problems += wrong[:8]
    return keys, "; ".join(problems) or None


def _named(name: str, sources: dict) -> str:
    """``name``, and the checkpoint keys it is read from when they are others."""
    keys = sources[name].keys()
    return repr(name) if keys == [name] else f"{name!r} (from {listed(keys)})"


def load_hf(model, path) -> None:
    """Fill the OSDP-wrapped ``model`` from the Hugging Face checkpoint directory ``path``
    (every rank calls it): see [Note: Hugging Face checkpoints]. Nothing changes on an
    error, which every rank raises."""
    view = prepare(model)
    layout, units = view.layout, view.built.units
    comm = world(view)
    keys, sources, error = {}, {}, None
    try:
        files = checkpoint_files(path)
        sources = checkpoint_sources(view.module, files, _shapes(files))
        keys, problem = _match(layout, sources)
        if problem is not None:
            error = PlanMismatchError(f"cannot load checkpoint {os.fspath(path)!r} into this model: {problem}")
    except OSDPError as exc:
        error = exc
    except Exception as exc:  # a damaged file: safetensors' own error, with the path
        error = OSDPError(f"cannot read checkpoint {os.fspath(path)!r}: {type(exc).__name__}: {exc}")
    agree(comm, error)
    new = [torch.zeros_like(u.shard) for u in units]
    buffers = dict(view.module.named_buffers())
    new_buffers = {}
    safe_open = _safetensors()
    error = None
    try:
        handles = {name: safe_open(name, framework="pt") for name in sorted(set(files.values()))}
        with torch.no_grad():
            for fqn, info in layout.params.items():
                source = sources[keys[fqn]]
                for piece in info.pieces:
                    unit = units[piece.unit]
                    part = local_range(piece, unit.shard_rank, unit.shard_numel)
                    if part is None:
                        continue
                    a, b = part
                    start = piece.offset + a - unit.shard_rank * unit.shard_numel
                    new[piece.unit][start:start + (b - a)].copy_(
                        read_box(source, handles, piece.box_offsets, piece.box_sizes, a, b))
            for name in layout.buffers:
                value = sources[name].read(handles, (0,) * len(sources[name].shape), sources[name].shape)
                new_buffers[name] = value.to(buffers[name].device, buffers[name].dtype)
    except Exception as exc:
        error = OSDPError(f"cannot read checkpoint {os.fspath(path)!r}: {type(exc).__name__}: {exc}")
    agree(comm, error)
    with torch.no_grad():  # everything read on every rank: now the model changes
        for unit, shard in zip(units, new):
            unit.shard.copy_(shard)
        for name, value in new_buffers.items():
            buffers[name].copy_(value)


# ---- writing -------------------------------------------------------------------------------
def _plan_files(layout, dtype, max_bytes: int) -> list[list[str]]:
    """The names each file holds, in state-dict order, at most ``max_bytes`` a file (a
    larger tensor alone)."""
    files, current, size = [], [], 0
    for fqn, info in layout.params.items():
        nbytes = math.prod(info.shape) * (dtype or info.dtype).itemsize
        if current and size + nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(fqn)
        size += nbytes
    files.append(current + list(layout.buffers))
    return files


def save_hf(model, path, *, max_shard_size="5GB", dtype: torch.dtype | None = None) -> None:
    """Write the OSDP-wrapped ``model`` as a Hugging Face checkpoint directory ``path``
    (every rank calls it) that ``from_pretrained`` loads: see [Note: Hugging Face
    checkpoints]. ``dtype``: the tensors' dtype in the files (default: the parameters')."""
    _safetensors()
    from safetensors.torch import save_file

    view = prepare(model)
    layout, units, comm = view.layout, view.built.units, world(view)
    path = os.path.abspath(os.fspath(path))
    plan = _plan_files(layout, dtype, parse_bytes(max_shard_size, "max_shard_size"))
    names = [SINGLE_FILE] if len(plan) == 1 else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
                                                  for i in range(len(plan))]
    tmp = _atomic.partial_path(path)

    def start():
        _atomic.recover_backup(path)
        _atomic.check_replaceable(path)
        _atomic.fresh_dir(tmp)

    on_rank0(comm, start)
    try:
        file_keys = _write_files(view, layout, units, comm, plan, names, tmp, dtype, save_file)

        def finish():
            if len(plan) > 1:
                total = sum(math.prod(layout.params[f].shape) * (dtype or layout.params[f].dtype).itemsize
                            for f in layout.params)
                index = {"metadata": {"total_size": total},
                         "weight_map": {key: name for keys, name in zip(file_keys, names) for key in keys}}
                with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                    json.dump(index, f, indent=2)
            config = getattr(view.module, "config", None)
            if hasattr(config, "save_pretrained"):
                config.save_pretrained(tmp)
            _atomic.replace_dir(tmp, path)

        on_rank0(comm, finish)
    except Exception:
        on_rank0(comm, lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise


def _write_files(view, layout, units, comm, plan, names, tmp, dtype, save_file) -> list[list[str]]:
    """Gather unit after unit (every rank); rank 0 fills each parameter's tensor and
    writes a file once all of its tensors are complete, in the checkpoint layout
    ([Note: checkpoint layout] in hf_layout.py). A write that fails on rank 0 stops the
    writing, not the gathers (the other ranks are in them); every rank raises it after
    the last. Returns the keys of each file (rank 0)."""
    rank0, error, file_keys = comm.rank == 0, None, []
    full: dict[str, torch.Tensor] = {}
    todo = {fqn: len(info.pieces) for fqn, info in layout.params.items()}
    file_of = {key: i for i, keys in enumerate(plan) for key in keys}
    waiting = [set(keys) for keys in plan]
    written = 0

    def write_ready():
        nonlocal written, error
        while error is None and written < len(plan) and not waiting[written]:
            try:
                tensors = to_checkpoint_layout(view.module, {key: full.pop(key) for key in plan[written]})
                file_keys.append(list(tensors))
                save_file({key: t.contiguous() for key, t in tensors.items()}, os.path.join(tmp, names[written]),
                          metadata={"format": "pt"})
            except Exception as exc:
                error = OSDPError(f"cannot write {names[written]!r} of the checkpoint: {type(exc).__name__}: {exc}")
            written += 1

    if rank0:
        buffers = dict(view.module.named_buffers())
        for name in layout.buffers:
            full[name] = buffers[name].detach().cpu().clone()
            waiting[file_of[name]].discard(name)
    for unit, pieces in zip(units, layout.unit_pieces):
        flat = unit.shard.detach() if unit.replicated else view.comm.all_gather_sync(unit.shard.detach())
        if not rank0 or error is not None:
            continue
        flat = flat.cpu()
        for piece in pieces:
            if piece.fqn not in full:
                full[piece.fqn] = torch.empty(layout.params[piece.fqn].shape, dtype=dtype or flat.dtype)
            box_view(full[piece.fqn], piece).copy_(flat[piece.offset:piece.offset + piece.numel].view(piece.box_sizes))
            todo[piece.fqn] -= 1
            if todo[piece.fqn] == 0:
                waiting[file_of[piece.fqn]].discard(piece.fqn)
        write_ready()
    if rank0:
        write_ready()  # a file of buffers only
    agree(comm, error)
    return file_keys
