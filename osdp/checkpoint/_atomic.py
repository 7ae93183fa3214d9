"""Atomic replacement of checkpoint files and directories, and rank-0-only steps whose
failure every rank hears about.

[Note: atomic checkpoints]
A checkpoint is written under a hidden sibling of its target (``.<name>.osdp-partial``)
and only renamed onto the target once every rank's data and the metadata are on disk
(fsynced). A crash or an error before that leaves the target as it was; the partial
directory is removed on error and replaced by the next save. Replacing an existing
directory uses ``renameat2(RENAME_EXCHANGE)`` where the kernel and filesystem allow it
(one atomic swap); otherwise the old checkpoint is first renamed aside to
``.<name>.osdp-old`` and deleted after the new one is in place (a crash between the two
renames leaves the old checkpoint intact there, never a half-written one at the target).
A single-file checkpoint is a temporary file next to the target and ``os.replace``.
"""
from __future__ import annotations

import ctypes
import os
import shutil

import torch
import torch.distributed as dist

from ..errors import OSDPError, PlanMismatchError

META_FILE = "osdp_meta.pt"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def partial_path(path: str) -> str:
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.osdp-partial")


def _old_path(path: str) -> str:
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.osdp-old")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def check_replaceable(path: str) -> None:
    """Refuse to overwrite something that is not an OSDP checkpoint directory."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        raise OSDPError(f"{path!r} exists and is not a checkpoint directory; refusing to replace it")
    if os.listdir(path) and not os.path.exists(os.path.join(path, META_FILE)):
        raise OSDPError(f"{path!r} is a non-empty directory without an OSDP checkpoint; refusing to replace it")


def fresh_dir(path: str) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path)
    os.makedirs(path)


def replace_dir(tmp: str, path: str) -> None:
    """Move the finished directory ``tmp`` onto ``path`` (see [Note: atomic checkpoints])."""
    parent = os.path.dirname(os.path.abspath(path))
    fsync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif exchange_dirs(tmp, path):
        shutil.rmtree(tmp)  # now holds the old checkpoint
    else:
        old = _old_path(path)
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    fsync_dir(parent)


exchange_dirs = _exchange  # a module attribute so tests can force the fallback


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, ``os.replace``."""
    path = os.path.abspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.osdp-partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(head)


def on_rank0(comm, fn):
    """Run ``fn`` on group rank 0 only; every rank raises if it failed (no rank is left
    waiting in a later collective). Returns ``fn``'s result on rank 0, None elsewhere."""
    result, error = None, None
    if comm.rank == 0:
        try:
            result = fn()
        except Exception as exc:  # reported to every rank below
            error = exc
    agree(comm, error)
    return result


def agree(comm, error: BaseException | None) -> None:
    """A collective: every rank raises if any rank has an ``error``. The rank that had
    it raises it; the others raise the same class if it is an OSDPError (else an
    OSDPError) naming the rank and the message."""
    mine = None if error is None else (type(error).__name__, str(error))
    reports = [mine] * comm.world_size
    if comm.world_size > 1:
        dist.all_gather_object(reports, mine, group=comm.group)
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            name, text = report
            cls = {c.__name__: c for c in (OSDPError, PlanMismatchError)}.get(name, OSDPError)
            raise cls(f"rank {rank}: {name}: {text}")


def broadcast_from_rank0(comm, obj):
    box = [obj]
    if comm.world_size > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    return box[0]
