"""The on-disk format of a publisher log segment and of its index, and reading them back.

A segment's records are framed by :mod:`wormhole.plugins.framing` (:data:`KIND_SEGMENT`
first, then :data:`BATCH_KINDS`); its index file is a header (:data:`INDEX_HEADER`) and one
:class:`Entry` per batch record, each with its CRC (see :mod:`wormhole.core.segment`).
:func:`load_entries` reads a segment's entries back from its index as far as it holds and from
its record headers after that.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

from wormhole.core.errors import LogCorruptError
from wormhole.plugins.framing import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    log_file_key,
    read_record_at,
)

KIND_SEGMENT = 1
KIND_BATCH = 2
# Kinds 3 and 4 are the LogWriter's.
KIND_BATCH_PART = 5
"""An early part of a batch too large for one record; the batch ends with a KIND_BATCH record."""
BATCH_KINDS = (KIND_BATCH, KIND_BATCH_PART)

NO_TS = -(1 << 63)
"""An entry's ``max_ts`` when none of its updates carries a source time."""
UNKNOWN_TS = (1 << 63) - 1
"""An entry's ``max_ts`` when it was built from record headers alone (its updates unread)."""

INDEX_MAGIC = b"WHIX"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<4sHQQQI")  # magic, version, session, roll, first seq, header CRC
ENTRY = struct.Struct("<QIQIBq")  # first, n_updates, offset, length, kind, max_ts
ENTRY_CRC = struct.Struct("<I")
ENTRY_SIZE = ENTRY.size + ENTRY_CRC.size
_SCAN_WINDOW = 1 << 16


class Entry(NamedTuple):
    """One batch record of a segment."""

    first: int
    n_updates: int
    offset: int
    length: int
    """Payload bytes (the record is ``HEADER_SIZE + length`` bytes)."""
    kind: int
    max_ts: int
    """The largest ``ts_ms`` of the updates of this record and every record before it in the
    segment (a time index, as Kafka's), :data:`NO_TS` if none, :data:`UNKNOWN_TS` for an
    entry built from record headers alone (its updates not read)."""

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + self.length


def index_path(path: Path) -> Path:
    """Where the index of segment ``path`` (``log.<session>.<roll>``) lives."""
    return path.with_name("index" + path.name[3:])


def pack_entry(entry: Entry) -> bytes:
    body = ENTRY.pack(*entry)
    return body + ENTRY_CRC.pack(zlib.crc32(body))


def read_segment_header(fd: int, path: Path) -> tuple[int, int, int]:
    """``(first seq, CRC, end offset)`` of a segment's header record, verified."""
    head = os.pread(fd, HEADER_SIZE, 0)
    if len(head) < HEADER_SIZE:
        raise LogCorruptError(str(path), 0, "empty segment in the middle of the log")
    magic, version, kind, length, crc, first, _count = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise LogCorruptError(str(path), 0, "bad record header")
    if kind != KIND_SEGMENT:
        raise LogCorruptError(str(path), 0, "segment does not start with its header")
    with os.fdopen(os.dup(fd), "rb") as f:
        read_record_at(f, str(path), 0)  # checks its length and CRC
    return first, crc, HEADER_SIZE + length


def read_header(path: Path) -> tuple[int, int, int]:
    """``(first seq, CRC, end offset)`` of the header record of segment ``path``."""
    with open(path, "rb", buffering=0) as f:
        return read_segment_header(f.fileno(), path)


def read_index(path: Path, header_crc: int, header_end: int, size: int) -> list[Entry]:
    """The entries of ``path``'s index file that match the segment, up to ``size`` bytes.

    Stops at the first entry that is torn, fails its CRC, does not follow the one before it
    or lies past ``size``; an index written for another segment (or none) gives no entries.
    """
    try:
        with open(index_path(path), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    except OSError:
        return []
    key = log_file_key(path.name)
    if len(data) < INDEX_HEADER.size or key is None:
        return []
    magic, version, session, roll, _first_seq, crc = INDEX_HEADER.unpack_from(data)
    if (magic, version, (session, roll), crc) != (INDEX_MAGIC, INDEX_VERSION, key, header_crc):
        return []
    entries: list[Entry] = []
    offset = header_end
    seq = None
    ts = NO_TS
    unpack, crc_of = ENTRY.unpack_from, zlib.crc32
    body_size = ENTRY.size
    for at in range(INDEX_HEADER.size, len(data) - ENTRY_SIZE + 1, ENTRY_SIZE):
        (stored,) = ENTRY_CRC.unpack_from(data, at + body_size)
        if crc_of(data[at : at + body_size]) != stored:
            break
        entry = Entry(*unpack(data, at))
        if entry.offset != offset or (seq is not None and entry.first != seq):
            break
        if entry.kind not in BATCH_KINDS or entry.end > size or entry.max_ts < ts:
            break
        ts = entry.max_ts
        entries.append(entry)
        offset = entry.end
        seq = entry.first + entry.n_updates
    return entries


def last_entry(path: Path, header_crc: int, size: int) -> Entry | None:
    """The last entry of ``path``'s index if it is whole and ends where the segment does."""
    try:
        with open(index_path(path), "rb") as f:
            head = f.read(INDEX_HEADER.size)
            end = f.seek(0, os.SEEK_END)
            n = (end - INDEX_HEADER.size) // ENTRY_SIZE
            if len(head) < INDEX_HEADER.size or n <= 0:
                return None
            f.seek(INDEX_HEADER.size + (n - 1) * ENTRY_SIZE)
            data = f.read(ENTRY_SIZE)
    except OSError:
        return None
    magic, version, session, roll, _first_seq, crc = INDEX_HEADER.unpack(head)
    if (magic, version, (session, roll), crc) != (
        INDEX_MAGIC,
        INDEX_VERSION,
        log_file_key(path.name),
        header_crc,
    ):
        return None
    if len(data) < ENTRY_SIZE:
        return None
    (stored,) = ENTRY_CRC.unpack_from(data, ENTRY.size)
    if zlib.crc32(data[: ENTRY.size]) != stored:
        return None
    entry = Entry(*ENTRY.unpack_from(data))
    return entry if entry.kind in BATCH_KINDS and entry.end == size else None


def on_disk(fd: int, entry: Entry) -> bool:
    """Whether the segment holds the record header ``entry`` describes."""
    head = os.pread(fd, HEADER_SIZE, entry.offset)
    if len(head) < HEADER_SIZE:
        return False
    magic, version, kind, length, _crc, first, count = HEADER.unpack(head)
    return (magic, version, kind, length, first, count) == (
        MAGIC,
        VERSION,
        entry.kind,
        entry.length,
        entry.first,
        entry.n_updates,
    )


class _Times(msgspec.Struct):
    ts_ms: int | None = None


_times_decoder = msgspec.json.Decoder(tuple[msgspec.Raw, list[_Times]])


def batch_times(payload: bytes | memoryview) -> tuple[msgspec.Raw, int]:
    """The checkpoint (raw JSON) of a batch record's payload and the largest ``ts_ms`` of its
    updates (:data:`NO_TS` if none), without decoding the rest of each update."""
    checkpoint, updates = _times_decoder.decode(payload)
    best = NO_TS
    for update in updates:
        ts = update.ts_ms
        if ts is not None and ts > best:
            best = ts
    return checkpoint, best


def with_times(path: Path, f: BinaryIO, entries: list[Entry]) -> list[Entry]:
    """``entries`` with the times of those built from record headers, read from the segment."""
    i = next((i for i, e in enumerate(entries) if e.max_ts == UNKNOWN_TS), len(entries))
    running = entries[i - 1].max_ts if i else NO_TS
    for k in range(i, len(entries)):
        entry = entries[k]
        _, ts = batch_times(read_record_at(f, str(path), entry.offset).payload)
        running = max(running, ts)
        entries[k] = entry._replace(max_ts=running)
    return entries


def load_entries(
    path: Path, fd: int, header_crc: int, header_end: int, size: int
) -> tuple[list[Entry], int, int]:
    """The batch records of the segment open at ``fd`` up to ``size`` bytes, the bytes of
    whole records and how many entries came from the index file: from the index file as far
    as it holds, then from the record headers.

    A tail that is cut short or zero-filled ends the whole records (a segment being written
    or torn by a crash); a bad header with data after it is corruption.
    """
    entries = read_index(path, header_crc, header_end, size)
    if entries and not on_disk(fd, entries[-1]):
        entries = []  # the index got ahead of the segment's data: rebuild it
    indexed = len(entries)
    start = entries[-1].end if entries else header_end
    seq = entries[-1].first + entries[-1].n_updates if entries else None
    entries_scanned, whole = scan_entries(path, fd, start, size, seq)
    entries.extend(entries_scanned)
    return entries, whole, indexed


def scan_entries(
    path: Path, fd: int, offset: int, size: int, seq: int | None = None
) -> tuple[list[Entry], int]:
    """Entries of the batch records from ``offset`` to ``size``, from their headers alone,
    and where the whole records end."""
    unpack = HEADER.unpack_from
    entries: list[Entry] = []
    # Headers are read through a window so that a segment of small records costs one read
    # per window, not one per record.
    window = b""
    window_at = 0
    while offset + HEADER_SIZE <= size:
        at = offset - window_at
        if at + HEADER_SIZE > len(window):
            window = os.pread(fd, _SCAN_WINDOW, offset)
            window_at, at = offset, 0
            if len(window) < HEADER_SIZE:
                break
        magic, version, kind, length, _crc, first, count = unpack(window, at)
        if magic != MAGIC or version != VERSION:
            if zero_from(fd, offset, size):
                break
            raise LogCorruptError(str(path), offset, "bad record header")
        if offset + HEADER_SIZE + length > size:
            break
        if kind in BATCH_KINDS:
            if seq is not None and first != seq:
                raise LogCorruptError(
                    str(path), offset, f"batch starts at seq {first}, expected {seq}"
                )
            entries.append(Entry(first, count, offset, length, kind, UNKNOWN_TS))
            seq = first + count
        offset += HEADER_SIZE + length
    return entries, offset


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        if n == 0:  # pragma: no cover - a zero-length write means no space
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def zero_from(fd: int, offset: int, size: int) -> bool:
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 20), offset)
        if not chunk or chunk.count(0) != len(chunk):
            return False
        offset += len(chunk)
    return True


__all__ = [
    "BATCH_KINDS",
    "ENTRY",
    "ENTRY_CRC",
    "ENTRY_SIZE",
    "INDEX_HEADER",
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "KIND_BATCH",
    "KIND_BATCH_PART",
    "KIND_SEGMENT",
    "NO_TS",
    "UNKNOWN_TS",
    "Entry",
    "batch_times",
    "index_path",
    "last_entry",
    "load_entries",
    "on_disk",
    "pack_entry",
    "read_header",
    "read_index",
    "read_segment_header",
    "scan_entries",
    "with_times",
    "write_all",
    "zero_from",
]
