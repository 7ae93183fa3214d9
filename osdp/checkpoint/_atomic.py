"""Atomic replacement of checkpoint files and directories, and rank-0-only steps whose
failure every rank hears about.

[Note: atomic checkpoints]
A checkpoint is written under a hidden sibling of its target (``.<name>.osdp-partial``)
and only renamed onto the target once every rank's data and the metadata are on disk
(fsynced). A crash or an error before that leaves the target as it was; the partial
directory is removed on error and replaced by the next save. Whatever is under the
partial name is never needed again. Replacing an existing directory uses
``renameat2(RENAME_EXCHANGE)`` where the kernel and filesystem allow it (one atomic
swap; the partial name then holds the old checkpoint, which is deleted). Otherwise the
old checkpoint is first renamed aside to the backup ``.<name>.osdp-old``, then the new
one onto the target. If that second rename fails, the backup is renamed back. After
success the backup is renamed to the partial name and deleted. So ``.osdp-old`` only
ever names a complete checkpoint, never a half-deleted one.

A crash between the two renames leaves no target and the backup, the last complete
checkpoint. The next save to the target renames the backup back before anything
else (:func:`recover_backup`). A backup beside a complete target (a crash after the
second rename) is stale, and that save deletes it. Loading a missing target whose backup
exists raises an error naming the backup and the ``mv`` that restores it. Loading
does not restore it itself: a load only reads, and a save into the same path
may be running in another job at that moment.

A single-file checkpoint is a temporary file next to the target and ``os.replace``.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import warnings

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


def recover_backup(path: str) -> None:
    """Before a save to ``path``: settle the backup an interrupted save left (see
    [Note: atomic checkpoints]): put it back if ``path`` is missing, delete it if
    ``path`` is a complete checkpoint."""
    old = _old_path(path)
    if not os.path.lexists(old):
        return
    if not os.path.lexists(path):
        os.rename(old, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    elif os.path.isfile(os.path.join(path, META_FILE)):
        shutil.rmtree(old)
    else:
        raise OSDPError(
            f"{old!r} is the backup an interrupted save left of checkpoint {path!r}, but {path!r} is not a "
            "checkpoint; move one of them away before saving there"
        )


def interrupted_save_error(path: str) -> OSDPError | None:
    """For a load of ``path`` that does not exist: the error that points to the backup
    an interrupted save left, if there is one."""
    old = _old_path(path)
    if os.path.lexists(path) or not os.path.isdir(old):
        return None
    return OSDPError(
        f"checkpoint {path!r} does not exist, but its backup {old!r} does: a save to it was interrupted "
        "between its two renames and the backup is the last complete checkpoint. Restore it with: "
        f"mv {shlex.quote(old)} {shlex.quote(path)} (the next osdp.checkpoint.save to this path also restores "
        "it before writing)"
    )


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
    elif not exchange_dirs(tmp, path):
        old = _old_path(path)
        if os.path.lexists(old):  # stale (recover_backup handles it before a save)
            shutil.rmtree(old)
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(old, path)  # the previous checkpoint goes back
            raise
        os.rename(old, tmp)  # the backup leaves its name before it is deleted
    fsync_dir(parent)
    # tmp now holds the previous checkpoint, if there was one: delete it; a failure here
    # does not fail the save (the new checkpoint is in place), the next save retries
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.lexists(tmp):
        warnings.warn(f"could not delete the previous checkpoint, now at {tmp!r}; the next save to {path!r} does")


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


def gather_to_rank0(comm, obj) -> list | None:
    """Every rank's ``obj`` on group rank 0 (in rank order); None elsewhere."""
    if comm.world_size == 1:
        return [obj]
    out = [None] * comm.world_size if comm.rank == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(comm.group, 0), group=comm.group)
    return out


def broadcast_from_rank0(comm, obj):
    box = [obj]
    if comm.world_size > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    return box[0]
