"""Per-rank scenarios of the integrity and error tests (``test_integrity.py``), and the
helpers that damage a saved checkpoint at a known place.

A DCP data file (``__<rank>_<n>.distcp``) is a concatenation of ``torch.save`` blobs,
one per saved chunk, at the byte ranges DCP's ``.metadata`` records; each blob is a zip
archive whose ``.../data/0`` record holds the chunk's elements, uncompressed.
:func:`element_byte` finds the file position of one element of one saved chunk from
that metadata and the zip headers alone (nothing from ``osdp.checkpoint``), so the
tests flip bytes that are certainly tensor data, and read the damage back with plain
DCP as the reference.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import zipfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from osdp.errors import OSDPError

from . import ckpt_cases as cc

# the damaged chunks: written by rank 1 (its data file __1_0.distcp)
PARAM_FQN = "blocks.0.mlp.c_fc.weight"  # a split parameter (4 slices under PLAN_A)
PARAM_KEY = f"model.{PARAM_FQN}"
ADAM_FQN = "blocks.0.attn.c_attn.weight"
ADAM_KEY = f"optim.{ADAM_FQN}.exp_avg_sq"
DAMAGED_FILE = "__1_0.distcp"
ELEMENT = 1  # which element of the chunk


# ---- locating and damaging saved chunks ----------------------------------------------
def saved_chunks(path: str) -> dict[str, list[tuple[tuple[int, ...], str, int, int]]]:
    """DCP key -> [(chunk offsets, data file, byte offset, byte length)], from ``.metadata``."""
    md = dcp.FileSystemReader(path).read_metadata()
    out: dict = {}
    for index, info in md.storage_data.items():
        out.setdefault(index.fqn, []).append((tuple(index.offset), info.relative_path, info.offset, info.length))
    return out


def element_byte(path: str, file: str, offset: int, length: int, element: int, itemsize: int = 4) -> int:
    """Position in ``file`` of the first byte of element ``element`` of the chunk stored
    at ``[offset, offset + length)``."""
    with open(os.path.join(path, file), "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    assert info.compress_type == zipfile.ZIP_STORED
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    assert (element + 1) * itemsize <= info.file_size, "the chunk has no such element"
    return offset + start + element * itemsize


def flip(path: str, key: str, file: str = DAMAGED_FILE, element: int = ELEMENT) -> tuple[int, ...]:
    """Flip one exponent bit of element ``element`` of ``key``'s largest chunk stored in
    ``file`` (float32, little-endian: byte 3 holds the sign and the exponent's top bits).
    Returns the chunk's offsets."""
    offsets, _, start, length = max((c for c in saved_chunks(path)[key] if c[1] == file), key=lambda c: c[3])
    position = element_byte(path, file, start, length, element) + 3
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x01]))
    return offsets


def drop_dcp_entry(path: str, key: str) -> None:
    """Remove ``key`` from DCP's ``.metadata`` (as if it came from another save)."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        md = pickle.load(f)
    del md.state_dict_metadata[key]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    with open(file, "wb") as f:
        pickle.dump(md, f)


def read_plain(path: str, key: str, shape) -> torch.Tensor:
    """``key`` read with plain DCP in this process (no verification of any kind)."""
    state = {key: torch.zeros(shape)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state[key]


def report(fn) -> dict | None:
    """What an exception from ``fn()`` looks like to a user (picklable), or None."""
    try:
        fn()
    except Exception as exc:
        cause = exc.__cause__
        return dict(
            type=type(exc).__name__,
            osdp=isinstance(exc, OSDPError),
            message=str(exc),
            cause=None if cause is None else type(cause).__name__,
        )
    return None


# ---- world size 2 ---------------------------------------------------------------------
def run_w2(rank, world_size, root):
    import osdp.checkpoint as ck

    out = {}
    good = os.path.join(root, "good")
    model, opt = cc.wrap(cc.PLAN_A)
    cc.train(model, opt, range(2))
    ck.save(model, opt, good, step=2)
    out["saved_full"] = ck.full_state_dict(model)
    del model, opt
    one = dist.new_group([0])  # a 1-rank group: loading a 2-rank checkpoint at world size 1

    # a model and optimizer with state of their own: failed loads must not touch them
    victim, victim_opt = cc.wrap(cc.PLAN_A, seed=41)
    cc.train(victim, victim_opt, range(1))
    before = cc.unit_state(victim, victim_opt)

    # clean loads, resharded (other plan; one rank): the checksums raise no false alarm
    other, other_opt = cc.wrap(cc.PLAN_B, seed=42)
    out["clean_plan_b"] = (ck.load(other, other_opt, good)["step"], ck.full_state_dict(other))
    if rank == 0:
        single, single_opt = cc.wrap(cc.PLAN_B, seed=43, group=one)
        out["clean_one_rank"] = (ck.load(single, single_opt, good)["step"], ck.full_state_dict(single))

    # one flipped bit in a parameter's data and one in AdamW's exp_avg_sq
    damaged = {"param": (PARAM_KEY, PARAM_FQN), "adam": (ADAM_KEY, ADAM_FQN)}
    for name, (key, fqn) in damaged.items():
        path = os.path.join(root, f"bad_{name}")
        if rank == 0:
            shutil.copytree(good, path)
            out[f"{name}_offsets"] = flip(path, key)
            shape = out["saved_full"][fqn].shape  # AdamW's state has the parameter's shape
            out[f"{name}_plain"] = (read_plain(good, key, shape), read_plain(path, key, shape))
        dist.barrier()
        out[f"err_{name}"] = report(lambda: ck.load(victim, victim_opt, path))
        out[f"err_{name}_plan_b"] = report(lambda: ck.load(other, other_opt, path))
        if rank == 0:
            out[f"err_{name}_one_rank"] = report(lambda: ck.load(single, single_opt, path))
        dist.barrier()

    # failed loads lead with their cause: a missing data file, a truncated one, a key
    # that DCP's metadata lacks, a failed write
    broken = {n: os.path.join(root, n) for n in ("missing", "truncated", "no_key")}
    if rank == 0:
        for path in broken.values():
            shutil.copytree(good, path)
        os.remove(os.path.join(broken["missing"], DAMAGED_FILE))
        file = os.path.join(broken["truncated"], DAMAGED_FILE)
        os.truncate(file, os.path.getsize(file) // 2)
        drop_dcp_entry(broken["no_key"], "optim.wte.weight.exp_avg")
    dist.barrier()
    for name, path in broken.items():
        out[f"err_{name}"] = report(lambda: ck.load(victim, victim_opt, path))
    original_writer = ck._writer
    ck._writer = lambda p: cc._FailingWriter(p, sync_files=False)
    try:
        out["err_write"] = report(lambda: ck.save(victim, victim_opt, os.path.join(root, "never")))
    finally:
        ck._writer = original_writer

    out["unchanged"] = (before, cc.unit_state(victim, victim_opt))
    dist.barrier()
    return out
