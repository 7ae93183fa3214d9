"""Checkpoints of OSDP-wrapped models: full state dicts and sharded DCP checkpoints.

- :func:`full_state_dict` / :func:`save_full`: the original model's state dict on rank 0
  (loadable into the plain, unwrapped model with ``load_state_dict(strict=True)``).
- :func:`load_full_state_dict` / :func:`load_full`: a full state dict back into an OSDP
  model; every rank keeps its shard.
- :func:`save` / :func:`load`: sharded checkpoints with optimizer state through
  ``torch.distributed.checkpoint`` (every rank writes only its shard), loadable at
  another world size or with another plan (modes, splits).
- :func:`load_hf` / :func:`save_hf`: Hugging Face safetensors checkpoint directories,
  read straight into the shards and written one unit at a time ([Note: Hugging Face
  checkpoints] in ``hf.py``).

Every function is a collective over the model's process group (with a 2-D mesh: all
of the mesh's ranks): call it on every rank.

[Note: checkpoints of replicated layouts]
With replicas (HSDP, see [Note: shard layout] in ``osdp/runtime/mesh.py``) every
replica holds the same shards, so only the ranks of replica 0 (replicate rank 0) write
their boxes: each piece of each tensor is stored exactly once, by one rank, whatever
the number of replicas. Replicated entries (buffers, per-parameter optimizer tensors)
are written by the layout's rank 0, and so are the tensors of ``rep`` units (whole on
every rank: contract.py [Note: replicated units]), parameters and element-wise
optimizer state alike; every rank reads them whole. What is stored names original
parameters only, so a checkpoint of a 2-D layout loads into 1-D layouts, any other 2-D
layout or one rank, and the other way round: every rank (every replica) reads its
boxes. Checkpoint collectives (DCP planning, agreement on errors, metadata) run over all
the layout's ranks; boxes are computed from each unit's holder rank (its shard rank, 0
for a rep unit: [Note: holder rank] in ``osdp/runtime/shard_unit.py``), so a checkpoint
saved with rep units loads into a plan without them and the other way round.

[Note: sharded checkpoint representation]
The checkpoint is a directory in DCP format plus ``osdp_meta.pt``. Keys name ORIGINAL
parameters, never units, so nothing in it depends on the plan or the world size:

- ``model.<fqn>``: original parameter ``fqn`` (its first name if tied) with its
  original shape; each rank writes the boxes its flat shards hold (see
  [Note: parameter layout] in ``osdp/runtime/state_dict.py`` and
  [Note: chunked tensors in DCP] in ``_dcp.py``); padding is never written.
- ``model.<buffer>``: persistent buffers, written once (replicated).
- ``optim.<fqn>.<key>``: optimizer state. A state tensor with the shard's shape
  (AdamW ``exp_avg``/``exp_avg_sq``) is element-wise: mapped to ``fqn``'s elements
  exactly like the parameter. Any other tensor (AdamW ``step``) is per parameter and
  replicated: it must be equal for every unit holding a piece of ``fqn``; on load
  every unit takes it from its parameters (which must agree). Python numbers in the
  state go to the metadata.
- ``osdp_meta.pt`` (``torch.save``, read with ``weights_only=True``): format version,
  the model fingerprint (original parameter names and shapes, tied names, buffers),
  optimizer class, its param-group hyperparameters and which state keys each parameter
  has, ``step``, ``extra`` (rank 0's; plain containers, numbers, strings, tensors),
  ``checksums`` (where each stored chunk is and its crc32; see
  [Note: checkpoint integrity] in ``_integrity.py``), and for information the world
  size and unit modes it was saved with.

Loading validates everything (fingerprint, optimizer class and groups, keys, shapes)
before changing anything, reads into fresh buffers (verifying every stored chunk it
reads against its checksum), and only then copies into the shards, the buffers and the
optimizer (``optimizer.load_state_dict``, so torch's own dtype/device rules for each
state apply). A failed load leaves model and optimizer as they were, and its error
leads with the cause (see [Note: checkpoint errors] in ``_integrity.py``). Saving is
atomic: see [Note: atomic checkpoints] in ``_atomic.py``.
"""
from __future__ import annotations

import math
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointCorruptedError, OSDPError, PlanMismatchError, UnverifiedCheckpointWarning
from ..runtime.view import ShardedView
from ..runtime.state_dict import (
    Layout,
    check_full_state_dict,
    local_range,
    local_shards_from_full,
)
from ..runtime.state_dict import full_state_dict as _gather_full_state_dict
from . import _atomic
from ._atomic import META_FILE, agree, broadcast_from_rank0, gather_to_rank0, on_rank0
from ._view import prepare as _prepare
from ._view import world as _world
from ._optim_state import optimizer_units as _optimizer_units
from ._optim_state import param_states, same_state, unit_state
from .hf import load_hf, save_hf
from ._dcp import ChunkedTensor, ChunkLoadPlanner, ChunkSavePlanner, flat_index, range_boxes
from ._integrity import ALGORITHM, ChecksumWriter, VerifyingReader, dcp_errors

__all__ = ["save", "load", "full_state_dict", "load_full_state_dict", "save_full", "load_full", "load_hf", "save_hf"]

FORMAT = "osdp-sharded"
FORMAT_VERSION = 2  # 2: per-chunk checksums; 1 (no checksums) still loads, with a warning


# ---- helpers --------------------------------------------------------------------------
def _chunked(view: ShardedView, layout: Layout, fqn: str, flat_of, saving: bool = False) -> ChunkedTensor:
    """This rank's boxes of original tensor ``fqn``; ``flat_of(unit index)`` is the
    rank's flat local tensor of that unit (the shard or an element-wise state). A unit's
    boxes are those of its holder rank (``unit.shard_rank``; a rep unit holds all of
    them); ``saving``: a rep unit's boxes only on the layout's rank 0, which writes them
    once (see [Note: checkpoints of replicated layouts])."""
    info = layout.params[fqn]
    chunks = []
    writes_replicas = _world(view).rank == 0
    for piece in info.pieces:
        unit = view.built.units[piece.unit]
        if saving and unit.replicated and not writes_replicas:
            continue
        rank = unit.shard_rank
        part = local_range(piece, rank, unit.shard_numel)
        if part is None:
            continue
        a, b = part
        base = piece.offset - rank * unit.shard_numel  # shard index of the piece's element 0
        flat = flat_of(piece.unit)
        for offsets, sizes in range_boxes(a, b, piece.box_sizes):
            start = base + flat_index(offsets, piece.box_sizes)
            box = flat.narrow(0, start, math.prod(sizes)).view(sizes)
            chunks.append((tuple(o + p for o, p in zip(offsets, piece.box_offsets)), box))
    return ChunkedTensor(torch.Size(info.shape), info.dtype, chunks)


def _optimizer_class(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _diff_fingerprint(saved: dict, mine: dict) -> str | None:
    """What differs between two model fingerprints, or None."""
    problems = []
    for kind in ("params", "buffers"):
        a, b = saved.get(kind, {}), mine.get(kind, {})
        only_ckpt = [k for k in a if k not in b]
        only_model = [k for k in b if k not in a]
        shapes = [f"{k}: checkpoint {a[k]} vs model {b[k]}" for k in a if k in b and list(a[k]) != list(b[k])]
        word = "parameters" if kind == "params" else "buffers"
        if only_ckpt:
            problems.append(f"{word} only in the checkpoint: {only_ckpt[:6]}{' ...' if len(only_ckpt) > 6 else ''}")
        if only_model:
            problems.append(f"{word} only in the model: {only_model[:6]}{' ...' if len(only_model) > 6 else ''}")
        if shapes:
            problems.append(f"{word} with other shapes: {'; '.join(shapes[:6])}{' ...' if len(shapes) > 6 else ''}")
    if saved.get("tied", {}) != mine.get("tied", {}):
        problems.append(f"tied parameters differ: checkpoint {saved.get('tied', {})} vs model {mine.get('tied', {})}")
    return "; ".join(problems) or None


# ---- full state dicts -------------------------------------------------------------------
def full_state_dict(model, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The original model's state dict (names, shapes, order; CPU tensors), gathered.

    On rank 0 (every rank if ``rank0_only=False``); other ranks get ``{}``. Loadable into
    the unwrapped model with ``load_state_dict(strict=True)``."""
    view = _prepare(model)
    layout = view.layout
    state = _gather_full_state_dict(
        view.module, view.built, view.comm, list(view.state_keys), rank0_only, layout=layout
    )
    return {} if rank0_only and _world(view).rank != 0 else state  # replicas' shard rank 0 too


def load_full_state_dict(model, state_dict: dict[str, torch.Tensor] | None) -> None:
    """Load a full (original-names) state dict into an OSDP model; every rank keeps its
    shard. Either every rank passes the state dict (each reads it, no communication), or
    only rank 0 does (others pass None) and each tensor is broadcast from rank 0.
    Strict: keys and shapes must match the original model; nothing changes on error."""
    view = _prepare(model)
    layout = view.layout
    comm, built = _world(view), view.built  # every rank of the layout
    device = comm.device  # collectives run there (NCCL needs device tensors)
    src = torch.distributed.get_global_rank(comm.group, 0) if comm.world_size > 1 else 0
    have = torch.tensor([0 if state_dict is None else 1], dtype=torch.int64, device=device)
    if comm.world_size > 1:
        torch.distributed.all_reduce(have, op=torch.distributed.ReduceOp.MIN, group=comm.group)
    everyone = bool(have.item())
    error = None
    if everyone or comm.rank == 0:
        problem = "rank 0 has no state dict" if state_dict is None else check_full_state_dict(layout, state_dict)
        if problem is not None:
            error = PlanMismatchError(f"cannot load this state dict into the model: {problem}")
    agree(comm, error)

    def value_of(name: str, like: torch.Tensor) -> torch.Tensor:
        """``state_dict[name]`` as ``like``'s dtype: this rank's, or rank 0's broadcast."""
        if everyone:
            return state_dict[name].detach().to(like.dtype)
        if comm.rank == 0:
            tensor = state_dict[name].detach().to(device, like.dtype).contiguous()
        else:
            tensor = torch.empty(like.shape, dtype=like.dtype, device=device)
        if comm.world_size > 1:
            torch.distributed.broadcast(tensor, src=src, group=comm.group)
        return tensor

    new = [torch.zeros_like(u.shard) for u in built.units]
    for fqn, info in layout.params.items():
        tensor = value_of(fqn, torch.empty(info.shape, dtype=info.dtype, device="meta"))
        local_shards_from_full(layout, built, fqn, tensor, new)
    buffers = dict(view.module.named_buffers())
    new_buffers = {name: value_of(name, buffers[name]) for name in layout.buffers}
    with torch.no_grad():
        for unit, shard in zip(built.units, new):
            unit.shard.copy_(shard)
        for name, value in new_buffers.items():
            buffers[name].copy_(value)


def save_full(model, path: str) -> None:
    """Gather the full state dict and write it on rank 0 as one ``torch.save`` file,
    atomically (temporary file + ``os.replace``)."""
    state = full_state_dict(model, rank0_only=True)
    on_rank0(_world(_prepare(model)), lambda: _atomic.atomic_torch_save(state, path))


def load_full(model, path: str) -> None:
    """Rank 0 reads a full state dict file (``weights_only``) and every rank takes its
    shard (:func:`load_full_state_dict`)."""
    world = _world(_prepare(model))
    state = on_rank0(world, lambda: _read_full(path))
    load_full_state_dict(model, state if world.rank == 0 else None)


def _read_full(path: str) -> dict:
    """A ``save_full`` file, or a CheckpointCorruptedError naming it: a truncated file
    made torch.load raise a bare ``OSError: [Errno 22] Invalid argument``. (The file
    has no checksums, unlike a sharded checkpoint: a flipped bit loads.)"""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no full checkpoint file at {path!r} (osdp.checkpoint.save_full writes one)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointCorruptedError(
            f"{path!r} is not a readable full checkpoint ({type(exc).__name__}: {exc}): truncated or damaged; "
            f"write it again with osdp.checkpoint.save_full, or load a sharded checkpoint (osdp.checkpoint.load)"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointCorruptedError(f"{path!r} holds a {type(state).__name__}, not a state dict")
    return state


# ---- sharded checkpoints ----------------------------------------------------------------
def _sharded_state(view: ShardedView, optimizer, layout: Layout) -> tuple[dict, dict | None]:
    """DCP state dict (key -> ChunkedTensor) and the optimizer part of the metadata."""
    units, rank0 = view.built.units, _world(view).rank == 0
    state = {f"model.{fqn}": _chunked(view, layout, fqn, lambda i: units[i].shard.detach(), saving=True)
             for fqn in layout.params}
    buffers = dict(view.module.named_buffers())
    for name in layout.buffers:
        state[f"model.{name}"] = ChunkedTensor.whole(buffers[name].detach().cpu(), present=rank0)
    if optimizer is None:
        return state, None
    unit_states = {i: unit_state(units[i], optimizer) for i in _optimizer_units(view, optimizer)}
    kinds: dict[str, dict] = {}
    for fqn, info in layout.params.items():
        states = [unit_states.get(p.unit) for p in info.pieces]
        if all(s is None for s in states):
            continue
        if any(s is None for s in states) or len({tuple(sorted(s)) for s in states}) != 1:
            raise OSDPError(f"optimizer state of {fqn!r} differs between the units holding it; cannot save it")
        kinds[fqn] = {}
        for key in states[0]:
            values = [s[key] for s in states]
            shards = [units[p.unit].shard for p in info.pieces]
            if all(isinstance(v, torch.Tensor) and v.shape == sh.shape for v, sh in zip(values, shards)):
                by_unit = {p.unit: s[key].detach() for p, s in zip(info.pieces, states)}
                state[f"optim.{fqn}.{key}"] = _chunked(view, layout, fqn, by_unit.__getitem__, saving=True)
                kinds[fqn][key] = ("elementwise", str(values[0].dtype))
            elif all(isinstance(v, torch.Tensor) for v in values):
                if not all(v.shape == values[0].shape and torch.equal(v.cpu(), values[0].cpu()) for v in values):
                    raise OSDPError(f"optimizer state {key!r} of {fqn!r} differs between the units holding it")
                state[f"optim.{fqn}.{key}"] = ChunkedTensor.whole(values[0].detach().cpu(), present=rank0)
                kinds[fqn][key] = ("tensor", str(values[0].dtype), list(values[0].shape))
            else:
                if any(v != values[0] for v in values):
                    raise OSDPError(f"optimizer state {key!r} of {fqn!r} differs between the units holding it")
                kinds[fqn][key] = ("value", values[0])
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
    return state, {"class": _optimizer_class(optimizer), "param_groups": groups,
                   "group_params": _group_members(view, layout, optimizer), "state": kinds}


def _written_once(view: ShardedView, state: dict) -> dict:
    """Only replica 0 writes its boxes: see [Note: checkpoints of replicated layouts]."""
    if view.comm.layout.replicate.rank == 0:
        return state
    return {key: ChunkedTensor(obj.size, obj.dtype, []) for key, obj in state.items()}


def save(model, optimizer, path: str, *, step: int | None = None, extra=None) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``'s state, if given) to the
    directory ``path`` with ``torch.distributed.checkpoint``: every rank writes only its
    shards, under original parameter names (see [Note: sharded checkpoint
    representation]). Atomic: ``path`` holds the previous checkpoint until the new one
    is complete. ``step`` and ``extra`` (rank 0's) come back from :func:`load`."""
    view = _prepare(model)
    layout = view.layout
    comm = _world(view)
    path = os.path.abspath(path)
    state, optim_meta = _sharded_state(view, optimizer, layout)
    state = _written_once(view, state)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": layout.fingerprint(),
        "optimizer": optim_meta,
        "step": step,
        "extra": extra,
        "world_size": comm.world_size,
        "shard_size": view.comm.world_size,  # for information: the layout it was saved with
        "replicas": view.comm.layout.replicate.size,
        "unit_modes": {u.name: u.mode.value for u in view.built.units},
    }
    tmp = _atomic.partial_path(path)

    def prepare():
        _atomic.recover_backup(path)
        _atomic.check_replaceable(path)
        _atomic.fresh_dir(tmp)

    on_rank0(comm, prepare)
    try:
        writer = _writer(tmp)
        with dcp_errors("saving", path):
            dcp.save(state, storage_writer=writer, planner=ChunkSavePlanner(), process_group=comm.group)
        if getattr(writer, "records", None) is None:
            raise OSDPError(f"internal: the storage writer {type(writer).__name__} recorded no checksums")
        chunks = gather_to_rank0(comm, writer.records)
        if comm.rank == 0:
            meta["checksums"] = {"algorithm": ALGORITHM, "chunks": [r for rank in chunks for r in rank]}

        def finish():
            _atomic.atomic_torch_save(meta, os.path.join(tmp, META_FILE))
            _atomic.replace_dir(tmp, path)

        on_rank0(comm, finish)
    except Exception:
        # every failure above is raised on every rank (DCP and on_rank0 agree), so the
        # cleanup can be collective: no rank goes on while the partial directory exists
        on_rank0(comm, lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise


def _writer(path: str):
    """The DCP storage writer (a function so tests can inject failures)."""
    return ChecksumWriter(path, sync_files=True)


def read_metadata(path: str) -> dict:
    """The ``osdp_meta.pt`` of a sharded checkpoint (no collective)."""
    file = os.path.join(path, META_FILE)
    if not os.path.isfile(file):
        raise _atomic.interrupted_save_error(path) or OSDPError(
            f"{path!r} is not an OSDP sharded checkpoint (no {META_FILE})"
        )
    meta = torch.load(file, map_location="cpu", weights_only=True)
    if meta.get("format") != FORMAT or meta.get("version") not in (1, FORMAT_VERSION):
        raise PlanMismatchError(
            f"{path!r} has checkpoint format {meta.get('format')!r} v{meta.get('version')}; "
            f"this OSDP reads {FORMAT!r} v1 to v{FORMAT_VERSION}"
        )
    if meta["version"] >= 2 and meta.get("checksums", {}).get("algorithm") != ALGORITHM:
        raise PlanMismatchError(f"{path!r} has checksums of an unknown kind; this OSDP verifies {ALGORITHM}")
    return meta


def _group_members(view: ShardedView, layout: Layout, optimizer) -> list[list[str]]:
    """Each param group's parameters by their canonical names, in the group's order."""
    names = {id(p): layout.aliases.get(name, name) for unit in view.built.units
             for p, name in zip(unit.params, unit.param_names)}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _saved_group_of(view: ShardedView, optimizer, layout: Layout, saved: dict) -> list[int] | str:
    """[Note: param groups by their parameters] For each of the optimizer's param
    groups, the saved group holding the same parameters, or what differs. A group's
    hyperparameters (its lr, weight decay) belong to its parameters: matched by position
    alone, groups built in another order would load the biases' zero weight decay onto
    the weights. A checkpoint written before the groups' parameters were saved matches
    by position (the group counts checked)."""
    if "group_params" not in saved:
        return list(range(len(optimizer.param_groups)))
    unclaimed: dict[frozenset, list[int]] = {}
    for j, members in enumerate(saved["group_params"]):
        unclaimed.setdefault(frozenset(members), []).append(j)
    order = []
    for i, members in enumerate(_group_members(view, layout, optimizer)):
        candidates = unclaimed.get(frozenset(members))
        if not candidates:
            shown = ", ".join(sorted(members)[:4]) + (", ..." if len(members) > 4 else "")
            saved_sizes = ", ".join(str(len(m)) for m in saved["group_params"])
            return (f"its param group {i} holds {len(members)} parameters ({shown}), which no param group of the "
                    f"checkpoint holds (its groups hold {saved_sizes} parameters): build the optimizer's groups "
                    "with the parameters they had when it was saved, in any order")
        order.append(candidates.pop(0))
    return order


def _check_optimizer(view: ShardedView, optimizer, layout: Layout, saved: dict | None) -> str | None:
    if saved is None:
        return "the checkpoint has no optimizer state (it was saved with optimizer=None); pass optimizer=None"
    if saved["class"] != _optimizer_class(optimizer):
        return f"the checkpoint has {saved['class']} state, the optimizer is a {_optimizer_class(optimizer)}"
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        return (
            f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, "
            f"this optimizer has {len(optimizer.param_groups)}"
        )
    order = _saved_group_of(view, optimizer, layout, saved)
    if isinstance(order, str):
        return order
    for i in _optimizer_units(view, optimizer):
        fqns = sorted({p.fqn for p in layout.unit_pieces[i]})
        keys = {tuple(sorted(saved["state"][f])) if f in saved["state"] else None for f in fqns}
        if len(keys) > 1:
            return f"unit {view.built.units[i].name!r} takes parameters {fqns} whose saved optimizer states differ"
    return None


def load(model, optimizer, path: str) -> dict:
    """Load a sharded checkpoint written by :func:`save` into ``model`` (and
    ``optimizer``, if given; build it over ``model.parameters()`` as for training).
    World size and plan may differ from the saving run: DCP reads each rank's boxes
    from whatever saved chunks overlap them. Raises PlanMismatchError naming what
    differs when the checkpoint is from another model; nothing changes on any error.
    Like ``Optimizer.load_state_dict``, the param groups' hyperparameters (lr, betas,
    ...) are the checkpoint's afterwards; set new ones after loading. Each group takes
    those of the saved group holding the same parameters, whatever the order the groups
    were built in ([Note: param groups by their parameters]). Returns ``{"step": ...,
    "extra": ...}`` as given to :func:`save`."""
    view = _prepare(model)
    layout = view.layout
    comm, units = _world(view), view.built.units
    path = os.path.abspath(path)
    meta = on_rank0(comm, lambda: read_metadata(path))
    meta = broadcast_from_rank0(comm, meta)
    error = None
    problem = _diff_fingerprint(meta["fingerprint"], layout.fingerprint())
    if problem is not None:
        error = PlanMismatchError(f"checkpoint {path!r} is from another model: {problem}")
    elif optimizer is not None:
        problem = _check_optimizer(view, optimizer, layout, meta["optimizer"])
        if problem is not None:
            error = PlanMismatchError(f"cannot load checkpoint {path!r} into this optimizer: {problem}")
    agree(comm, error)
    checksums = meta.get("checksums")
    if checksums is None and comm.rank == 0:
        warnings.warn(
            UnverifiedCheckpointWarning(
                f"checkpoint {path!r} has no checksums (format v{meta['version']}, written before OSDP checked "
                "its data): its data is loaded unverified; save it again to add checksums"
            ),
            stacklevel=2,
        )

    # fresh buffers: nothing is touched until DCP has read (and verified) everything
    new_shards = [torch.zeros_like(u.shard) for u in units]
    state = {f"model.{fqn}": _chunked(view, layout, fqn, new_shards.__getitem__) for fqn in layout.params}
    names = {f"model.{fqn}": f"parameter {fqn!r}" for fqn in layout.params}  # for errors
    buffers = dict(view.module.named_buffers())
    new_buffers = {name: torch.empty_like(buffers[name], device="cpu") for name in layout.buffers}
    state.update({f"model.{name}": ChunkedTensor.whole(t) for name, t in new_buffers.items()})
    names.update({f"model.{name}": f"buffer {name!r}" for name in layout.buffers})
    new_optim: dict[int, dict] = {}  # unit -> state
    scalars: dict[tuple[str, str], torch.Tensor] = {}
    if optimizer is not None:
        kinds = meta["optimizer"]["state"]
        elementwise: dict[tuple[int, str], torch.Tensor] = {}
        for i in _optimizer_units(view, optimizer):
            fqns = [p.fqn for p in layout.unit_pieces[i]]
            if fqns and fqns[0] in kinds:
                new_optim[i] = {}
        for fqn, keys in kinds.items():
            info = layout.params[fqn]
            for key, kind in keys.items():
                names[f"optim.{fqn}.{key}"] = f"optimizer state {key!r} of parameter {fqn!r}"
                if kind[0] == "elementwise":
                    dtype = getattr(torch, kind[1].split(".")[-1])
                    for p in info.pieces:
                        if (p.unit, key) not in elementwise:
                            elementwise[(p.unit, key)] = torch.zeros(units[p.unit].shard_numel, dtype=dtype)
                    state[f"optim.{fqn}.{key}"] = _chunked(view, layout, fqn, lambda u, k=key: elementwise[(u, k)])
                elif kind[0] == "tensor":
                    dtype = getattr(torch, kind[1].split(".")[-1])
                    scalars[(fqn, key)] = torch.empty(kind[2], dtype=dtype)
                    state[f"optim.{fqn}.{key}"] = ChunkedTensor.whole(scalars[(fqn, key)])
    reader = VerifyingReader(path, None if checksums is None else checksums["chunks"], names)
    with dcp_errors("loading", path):
        dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=comm.group)

    # a unit's state: element-wise tensors from the staging buffers; per-parameter ones
    # (AdamW step) from its parameters, which must agree
    error = None
    for i, flat_state in new_optim.items():
        for fqn in sorted({p.fqn for p in layout.unit_pieces[i]}):
            for key, kind in meta["optimizer"]["state"][fqn].items():
                if kind[0] == "elementwise":
                    flat_state[key] = elementwise[(i, key)]
                    continue
                value = scalars[(fqn, key)] if kind[0] == "tensor" else kind[1]
                if key in flat_state and not same_state(flat_state[key], value):
                    error = PlanMismatchError(
                        f"cannot load checkpoint {path!r}: unit {units[i].name!r} takes parameters whose "
                        f"optimizer state {key!r} differs"
                    )
                flat_state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    agree(comm, error)

    # everything read and checked: now change the model and the optimizer
    with torch.no_grad():
        for unit, shard in zip(units, new_shards):
            unit.shard.copy_(shard)
        for name, value in new_buffers.items():
            buffers[name].copy_(value)
    if optimizer is not None:
        elementwise_keys = {i: {k for k in st if (i, k) in elementwise} for i, st in new_optim.items()}
        _load_optimizer(view, optimizer, meta["optimizer"], new_optim, elementwise_keys)
    return {"step": meta["step"], "extra": meta["extra"]}


def _load_optimizer(view: ShardedView, optimizer, saved: dict, new_state: dict[int, dict], elementwise: dict[int, set]) -> None:
    """Through ``optimizer.load_state_dict`` (torch's per-state dtype/device rules)."""
    units = view.built.units
    index: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    groups = []
    order = _saved_group_of(view, optimizer, view.layout, saved)  # checked: a list
    for j, group in zip(order, optimizer.param_groups):
        new_group = dict(saved["param_groups"][j])
        new_group["params"] = [index[id(p)] for p in group["params"]]
        if "param_names" in group:
            new_group["param_names"] = list(group["param_names"])
        groups.append(new_group)
    by_param: dict[int, dict] = {}
    for i, flat in new_state.items():
        param_states(units[i], flat, elementwise[i], by_param)
    state = {index[key]: st for key, st in by_param.items() if key in index}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
