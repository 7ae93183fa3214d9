"""Checksums of the chunks a sharded checkpoint stores, verified on every read; DCP's
failures turned into one error that leads with its cause.

[Note: checkpoint integrity]
What is checksummed: every DCP write item, i.e. one chunk (key, chunk offsets) of one
tensor, as the bytes it occupies in its data file: ``[offset, offset + length)`` of a
``__<rank>_<n>.distcp`` file, as DCP's storage info records it. Those bytes are one
``torch.save`` blob (zip headers, the pickled tensor description, the elements).
Each rank's :class:`ChecksumWriter` reads back the ranges it has just written and
takes their crc32 (zlib); ``save`` gathers the records on rank 0, which stores them in
``osdp_meta.pt`` (``checksums``) before the directory is renamed into place. They
travel with the checkpoint and are as atomic as the rest of it.

Why this is exact when a load reshards (another world size or plan reads parts of
saved chunks): DCP's FileSystemReader never reads part of a stored chunk. For every
read item, whole box or part, it takes the stored chunk's whole byte range,
``torch.load``s the blob and narrows the tensor afterwards. So every load depends
only on whole stored ranges, and those are the ranges that were checksummed.
:class:`VerifyingReader` reads each range once, checks its length and crc32, and gives
DCP the verified bytes (its ``_slice_file`` hook), whatever the loading run's world
size or plan. A checksum of the stored bytes, not of tensor values, also covers the
blob's header (shape, dtype) and needs no deserialization. If a later DCP stops
reading through ``_slice_file``, ``read_data`` still reads and checks every range its
plan used before it returns, so no chunk is used unverified (it is just read twice).

Checks run before the read (a chunk that ``osdp_meta.pt`` has no record of, or that
DCP's ``.metadata`` places somewhere other than where it was written) and on every
read. A failure raises CheckpointCorruptedError naming the parameter or optimizer
state, the chunk's offsets and the data file. DCP reads into ``load``'s fresh buffers,
so the model and the optimizer are not changed. crc32 detects accidental damage (bit
rot, a truncated or mixed-up copy), not deliberate tampering. ``osdp_meta.pt``
itself (step, extra, hyperparameters) has no checksum of its own.

Checkpoints written before checksums (format version 1) still load, with an
UnverifiedCheckpointWarning on rank 0. To refuse them, make that warning an error with
``warnings.simplefilter("error", UnverifiedCheckpointWarning)``; saving the model again
adds checksums. Refusing them outright would strand every existing checkpoint. Their
chunks are still checked for truncation.

[Note: checkpoint errors]
A failure on any rank inside DCP reaches every rank as a CheckpointException that holds
each failing rank's exception. Its message is a wall of DCP frames with the cause at
the bottom. :func:`dcp_errors` raises one error instead. Its first line is the cause:
the lowest failing rank's exception, as ``Type: message``, with the ranks that failed
the same way. Different causes on other ranks follow, one line each. The cause is
chained (``raise ... from``). On the rank where it happened that is the original
exception with its traceback; elsewhere it is a copy carrying that traceback as a note.
An OSDPError cause keeps its class (a CheckpointCorruptedError stays one). Every rank
raises the same message.
"""
from __future__ import annotations

import contextlib
import io
import os
import traceback
import zlib
from typing import NamedTuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointCorruptedError, OSDPError

ALGORITHM = "zlib.crc32"
_BLOCK_BYTES = 1 << 24


class ChunkRecord(NamedTuple):
    """Where one saved chunk is and what its bytes were. Stored as a plain tuple."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32: int


def _crc32(stream, offset: int, length: int) -> tuple[int, int]:
    """(crc32, bytes there) of ``[offset, offset + length)`` of an open binary file."""
    stream.seek(offset)
    crc, got = 0, 0
    while got < length:
        block = stream.read(min(_BLOCK_BYTES, length - got))
        if not block:
            break
        crc, got = zlib.crc32(block, crc), got + len(block)
    return crc, got


class ChecksumWriter(dcp.FileSystemWriter):
    """FileSystemWriter that records, per item written, where its bytes are and their
    crc32 as written (:attr:`records`; see [Note: checkpoint integrity])."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.records: list[tuple] | None = None

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        chunks = {item.index: item.tensor_data.chunk for item in plan.items if item.tensor_data is not None}
        by_file: dict[str, list] = {}
        for result in future.wait():
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        records = []
        for file, results in by_file.items():
            with open(os.path.join(self.path, file), "rb") as stream:
                for result in results:
                    info, index = result.storage_data, result.index
                    crc, got = _crc32(stream, info.offset, info.length)
                    if got != info.length:
                        raise OSDPError(f"{file!r} is shorter than DCP just wrote it ({got} of {info.length} bytes)")
                    chunk = chunks.get(index)
                    records.append(
                        tuple(
                            ChunkRecord(
                                index.fqn,
                                tuple(index.offset) if index.offset is not None else (),
                                tuple(chunk.sizes) if chunk is not None else (),
                                file,
                                info.offset,
                                info.length,
                                crc,
                            )
                        )
                    )
        self.records = records
        return future


class VerifyingReader(dcp.FileSystemReader):
    """FileSystemReader that verifies every stored chunk it reads against the
    checksums saved with it (``records``; None: length checks only). ``names`` maps
    DCP keys to what errors call them ("parameter 'w'")."""

    def __init__(self, path, records: list | None, names: dict[str, str]):
        super().__init__(path)
        self._saved = None if records is None else {(r.key, r.offsets): r for r in map(ChunkRecord._make, records)}
        self._names = names
        self._expected: dict[tuple[str, int], tuple] = {}  # (file, offset) -> key, offsets, record, info
        self._verified: set[tuple[str, int]] = set()

    def read_data(self, plan, planner):
        self._expected, self._verified = {}, set()
        for item in plan.items:
            index = item.storage_index
            info = self.storage_data[index]
            offsets = tuple(index.offset) if index.offset is not None else ()
            record = self._record(index.fqn, offsets, info)
            self._expected[(info.relative_path, info.offset)] = (index.fqn, offsets, record, info)
        future = super().read_data(plan, planner)
        for place, (_, _, _, info) in self._expected.items():
            if place not in self._verified:  # DCP read it without _slice_file: check it now
                with open(os.path.join(self.path, info.relative_path), "rb") as stream:
                    self._check(stream, info)
        return future

    def _slice_file(self, file, sinfo):
        return io.BytesIO(self._check(file, sinfo))

    def _what(self, key: str, offsets: tuple) -> str:
        return f"{self._names.get(key, f'checkpoint entry {key!r}')}, chunk at offsets {list(offsets)}"

    def _record(self, key: str, offsets: tuple, info) -> ChunkRecord | None:
        if self._saved is None:
            return None
        record = self._saved.get((key, offsets))
        if record is None:
            raise CheckpointCorruptedError(
                f"{self._what(key, offsets)}: DCP's .metadata lists this chunk but osdp_meta.pt has no "
                "checksum for it: the two files are not from the same save"
            )
        if (record.file, record.offset, record.length) != (info.relative_path, info.offset, info.length):
            raise CheckpointCorruptedError(
                f"{self._what(key, offsets)}: DCP's .metadata places it in {info.relative_path!r} at bytes "
                f"{info.offset}..{info.offset + info.length}, it was saved in {record.file!r} at bytes "
                f"{record.offset}..{record.offset + record.length}: .metadata is damaged or from another save"
            )
        return record

    def _check(self, stream, info) -> bytes:
        """The stored bytes of one chunk, verified."""
        place = (info.relative_path, info.offset)
        if place not in self._expected:
            raise OSDPError(f"internal: DCP read {place} that the load plan does not use")
        key, offsets, record, _ = self._expected[place]
        stream.seek(info.offset)
        data = stream.read(info.length)
        end = info.offset + info.length
        if len(data) != info.length:
            raise CheckpointCorruptedError(
                f"data file {info.relative_path!r} is truncated: {self._what(key, offsets)} is stored at bytes "
                f"{info.offset}..{end} and only {len(data)} of its {info.length} bytes are there; restore the "
                "checkpoint from a complete copy"
            )
        if record is not None:
            crc = zlib.crc32(data)
            if crc != record.crc32:
                raise CheckpointCorruptedError(
                    f"{self._what(key, offsets)} (sizes {list(record.sizes)}) in data file "
                    f"{info.relative_path!r}, bytes {info.offset}..{end}, has crc32 {crc:#010x}, "
                    f"saved as {record.crc32:#010x}: the file changed after it was saved (disk or copy "
                    "damage); restore the checkpoint from a good copy"
                )
        self._verified.add(place)
        return data


# ---- errors ------------------------------------------------------------------------------
def _cause(error: BaseException) -> BaseException:
    """The exception that failed a rank: nested CheckpointExceptions unwrapped."""
    while isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    return error


def checkpoint_error(exc: CheckpointException, doing: str, path: str) -> tuple[OSDPError, BaseException]:
    """One error for a CheckpointException (see [Note: checkpoint errors]) and the
    cause to chain it to."""
    causes: dict[str, list[int]] = {}  # "Type: message" -> ranks, in rank order
    first: BaseException | None = None
    for rank, (error, trace) in sorted(exc.failures.items()):
        error = _cause(error)
        text = f"{type(error).__name__}: {error}".strip()
        causes.setdefault(text, []).append(rank)
        if first is None:
            first = error
            if error.__traceback__ is None and trace:  # a copy from another rank
                error.add_note(f"traceback on rank {rank}:\n" + "".join(traceback.format_list(trace)).rstrip())
    if first is None:
        return OSDPError(f"{doing} checkpoint {path!r} failed: {exc}"), exc

    def ranks(rs: list[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"

    items = list(causes.items())
    lines = [f"{doing} checkpoint {path!r} failed on {ranks(items[0][1])}: {items[0][0]}"]
    lines += [f"and on {ranks(rs)}: {text}" for text, rs in items[1:3]]
    if len(items) > 3:
        lines.append(f"(and {len(items) - 3} other causes on other ranks)")
    message = "\n".join(lines)
    error = OSDPError(message)
    if isinstance(first, OSDPError):
        with contextlib.suppress(TypeError):
            error = type(first)(message)
    return error, first


@contextlib.contextmanager
def dcp_errors(doing: str, path: str):
    """DCP raises CheckpointException (a BaseException, on every rank when any rank
    failed): raise one OSDPError that leads with the cause instead (``except
    Exception`` catches it)."""
    try:
        yield
    except CheckpointException as exc:
        error, cause = checkpoint_error(exc, doing, path)
        raise error from cause
