"""One segment of the publisher log: the file ``log.<session>.<roll>`` and its index.

A segment is a segment header record followed by batch (and batch part) records, framed by
:mod:`wormhole.plugins.framing`. Beside it, ``index.<session>.<roll>`` lists each batch record
once: its first seq, update count, byte offset, length, kind and the largest source time
(``ts_ms``) of the updates up to it. It is what a reader uses to find the record holding a seq
(an offset index) and the first update at or after a time (a time index), as Kafka's
``LogSegment`` keeps an ``OffsetIndex`` and a ``TimeIndex`` beside each log file.

An index file is a 34-byte header (``WHIX``, version, session, roll, first seq, CRC of the
segment's header record) and then one 37-byte entry per record (:class:`Entry`'s fields,
little-endian, and the entry's CRC-32).

The segment file is the source of truth and the index only a cache of it: the index is
written without fsync, and every load checks it against the segment (its header names the
segment's first seq and the CRC of its header record; each entry has its own CRC and must
follow the one before it, byte for byte and seq for seq; the last must match the record
header at its offset). Loading keeps the entries that pass and scans the segment's record
headers from where they end, so an index that is missing, short, torn, corrupt, ahead of the
segment's data or behind a segment that has grown since costs a scan of the part it does not
cover, never an update.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

from wormhole.core.errors import LogCorruptError
from wormhole.plugins.framing import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    fsync_directory,
    log_file_key,
    read_record_at,
)

log = logging.getLogger("wormhole.publisher_log")

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
_INDEX_HEADER = struct.Struct("<4sHQQQI")  # magic, version, session, roll, first seq, header CRC
_ENTRY = struct.Struct("<QIQIBq")  # first, n_updates, offset, length, kind, max_ts
_ENTRY_CRC = struct.Struct("<I")
ENTRY_SIZE = _ENTRY.size + _ENTRY_CRC.size
_SCAN_WINDOW = 1 << 16


class SegmentHeader(msgspec.Struct):
    """The payload of a segment's first record (JSON)."""

    session: int
    roll: int
    first_seq: int
    checkpoint: msgspec.Raw


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


def remove_orphan_indexes(directory: Path) -> None:
    """Delete index files whose segment is gone (a crash between the two deletions)."""
    for path in directory.glob("index.*"):
        segment = path.with_name("log" + path.name[5:])
        if log_file_key(segment.name) is not None and not segment.exists():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def index_path(path: Path) -> Path:
    """Where the index of segment ``path`` (``log.<session>.<roll>``) lives."""
    return path.with_name("index" + path.name[3:])


def max_ts(updates: Iterable[object]) -> int:
    """The largest ``ts_ms`` of ``updates`` for an index entry (:data:`NO_TS` if none has one)."""
    best = NO_TS
    for update in updates:
        ts = update.ts_ms  # type: ignore[attr-defined]
        if ts is not None and ts > best:
            best = ts
    return best


class Segment:
    """A segment file of the publisher log, its extent and its index.

    ``entries`` is None until :meth:`load_index` (a rolled segment of an earlier session) and
    grows with :meth:`appended` while the segment is written. Entries are only ever added, so
    a reader may keep the list it got and bisect it without a lock.
    """

    def __init__(
        self,
        path: Path,
        session: int,
        roll: int,
        first_seq: int,
        size: int,
        entries: list[Entry] | None = None,
        header_crc: int | None = None,
    ) -> None:
        self.path = path
        self.session = session
        self.roll = roll
        self.first_seq = first_seq
        self.end_seq: int | None = None
        """Where the next segment starts; None while this is the newest."""
        self.size = size
        """The file's size as last known (where the records written so far end)."""
        self.entries = entries
        self.header_crc = header_crc
        self.whole = size
        self.end = first_seq
        """The seq after its last update."""
        self.max_ts = NO_TS
        """Where the whole records end (less than ``size`` only in a damaged segment)."""
        self.fd: int | None = None
        """Open for appending while this is the segment being written."""
        self._indexed = 0  # entries already in the index file
        self._index_fd: int | None = None
        self.indexed_bytes = 0
        """Where the entries in the index file end."""
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def index(self) -> list[Entry] | None:
        """The entries, if loaded (``(first, count, offset, ...)`` each)."""
        return self.entries

    @property
    def index_path(self) -> Path:
        return index_path(self.path)

    def __repr__(self) -> str:
        return f"Segment({self.name}, first_seq={self.first_seq}, size={self.size})"

    # ------------------------------------------------------------------ open
    @classmethod
    def open_rolled(cls, path: Path, session: int, roll: int) -> Segment:
        """A segment written before (not the newest one), with where it ends.

        Reads the last entry of its index when that ends where the file does. Otherwise it
        rebuilds the index where the file does not cover it, reading those records for their
        times (as Kafka rebuilds a missing time index), and writes it back. ``whole`` is where
        its whole records end: the file's size unless it is damaged. The entries are loaded
        when first read (:meth:`load_index`).
        """
        with open(path, "rb") as f:
            fd = f.fileno()
            first_seq, header_crc, header_end = _read_segment_header(fd, path)
            size = os.fstat(fd).st_size
            segment = cls(path, session, roll, first_seq, size, None, header_crc)
            last = _last_entry(path, header_crc, size)
            if last is not None and _on_disk(fd, last):
                segment.end = last.first + last.n_updates
                return segment
            entries, whole, indexed = load_entries(path, fd, header_crc, header_end, size)
            entries = _with_times(path, f, entries)
        segment.entries = entries
        segment.whole = whole
        segment._indexed = indexed
        segment.end = entries[-1].first + entries[-1].n_updates if entries else first_seq
        segment.write_index()
        if whole == size:
            segment.entries = None  # loaded again when read, not held for every segment
            segment._indexed = 0
        return segment

    def load_index(self) -> list[Entry]:
        """The entries of this segment (loaded from its index file the first time)."""
        entries = self.entries
        if entries is not None:
            return entries
        with self._lock:
            if self.entries is None:
                with open(self.path, "rb", buffering=0) as f:
                    fd = f.fileno()
                    _, header_crc, header_end = _read_segment_header(fd, self.path)
                    entries, whole, _ = load_entries(
                        self.path, fd, header_crc, header_end, self.size
                    )
                self.whole = whole
                if whole != self.size:
                    raise LogCorruptError(
                        str(self.path),
                        whole,
                        f"the segment ends inside a record ({self.size} bytes)",
                    )
                self.entries = entries
            return self.entries

    # ----------------------------------------------------------------- write
    @classmethod
    def create(
        cls, path: Path, session: int, roll: int, first_seq: int, header_record: bytes
    ) -> Segment:
        """A new segment holding its header record, durable (file and directory), open for
        appending. An index left by an earlier file of that name is removed first."""
        with contextlib.suppress(FileNotFoundError):
            index_path(path).unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            write_all(fd, header_record)
            os.fsync(fd)
            fsync_directory(str(path.parent))
        except BaseException:
            os.close(fd)
            raise
        crc = HEADER.unpack_from(header_record)[4]
        segment = cls(path, session, roll, first_seq, len(header_record), [], crc)
        segment.fd = fd
        return segment

    def write(self, records: list[bytes], sync: bool) -> None:
        """Write ``records`` at the end of the segment (and fdatasync it with ``sync``); they
        count once :meth:`appended`. On a write error the file is cut back to its last whole
        record, so writing the same records again appends cleanly; the error propagates."""
        fd = self.fd
        assert fd is not None, f"{self.name} is not open for writing"
        try:
            for record in records:
                write_all(fd, record)
            if sync:
                os.fdatasync(fd)
        except OSError:
            try:
                os.ftruncate(fd, self.size)
            except OSError as exc:  # pragma: no cover - the disk refuses even to shrink
                log.error("cannot cut %s back to %d bytes: %s", self.path, self.size, exc)
            raise

    def sync(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)

    def close(self, sync: bool = True) -> None:
        """Stop writing: fsync (unless just done) and close the file, write the index."""
        if self.fd is not None:
            if sync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
        self.write_index()
        self._close_index()

    def appended(self, records: list[tuple[int, int, int, int, int]]) -> None:
        """Records written at the end of the segment: ``(first seq, count, record bytes,
        kind, largest ts_ms of its updates)`` each."""
        assert self.entries is not None
        running = self.max_ts
        offset = self.size
        for first, count, length, kind, ts in records:
            if ts > running:
                running = ts
            self.entries.append(Entry(first, count, offset, length - HEADER_SIZE, kind, running))
            offset += length
            self.end = first + count
        self.max_ts = running
        # ``whole`` first: a reader that checks ``whole < size`` in between sees no damage.
        self.whole = offset
        self.size = offset

    def write_index(self) -> None:
        """Append the entries not yet in the index file (rewrite it if it holds others).

        The index is a cache, written without fsync; a failure to write it is only logged by
        the caller's next load, which scans what the index does not cover.
        """
        entries = self.entries
        if entries is None or self.header_crc is None or self._indexed == len(entries):
            return
        path = self.index_path
        start = self._indexed
        fd = self._index_fd
        try:
            if start == 0 or fd is None:
                if fd is not None:
                    os.close(fd)
                    self._index_fd = None
                flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if start == 0 else 0)
                fd = os.open(path, flags, 0o644)
                self._index_fd = fd
                os.lseek(fd, _INDEX_HEADER.size + start * ENTRY_SIZE, os.SEEK_SET)
            data = [_pack(e) for e in entries[start:]]
            if start == 0:
                os.lseek(fd, 0, os.SEEK_SET)
                data.insert(
                    0,
                    _INDEX_HEADER.pack(
                        INDEX_MAGIC,
                        INDEX_VERSION,
                        self.session,
                        self.roll,
                        self.first_seq,
                        self.header_crc,
                    ),
                )
            write_all(fd, b"".join(data))
        except OSError:
            self._indexed = 0  # rewrite it whole next time
            self._close_index()
            return
        finally:
            if self.fd is None:  # only the segment being written keeps its index open
                self._close_index()
        self._indexed = len(entries)
        self.indexed_bytes = entries[-1].end

    def _close_index(self) -> None:
        if self._index_fd is not None:
            os.close(self._index_fd)
            self._index_fd = None

    def remove_files(self) -> bool:
        """Delete the segment and its index; False if the segment was already gone."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.index_path.unlink()
        return True

    # ------------------------------------------------------------------ read
    def entry_for(self, position: int) -> Entry:
        """The batch record holding update ``position``."""
        entries = self.load_index()
        if self.whole < self.size:
            raise LogCorruptError(
                str(self.path), self.whole, f"the segment ends inside a record ({self.size} bytes)"
            )
        i = bisect.bisect_right(entries, (position, 1 << 62)) - 1
        # Skip checkpoint-only records (count 0) that share a start seq.
        while i + 1 < len(entries) and entries[i][0] + entries[i][1] <= position:
            i += 1
        if i < 0:
            raise LogCorruptError(str(self.path), 0, f"no record holds seq {position}")
        entry = entries[i]
        if not entry.first <= position < entry.first + entry.n_updates:
            raise LogCorruptError(
                str(self.path),
                entry.offset,
                f"no record holds seq {position} (records end at "
                f"{entry.first + entry.n_updates}): the segment is missing data",
            )
        return entry


def _pack(entry: Entry) -> bytes:
    body = _ENTRY.pack(*entry)
    return body + _ENTRY_CRC.pack(zlib.crc32(body))


def _read_segment_header(fd: int, path: Path) -> tuple[int, int, int]:
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
        return _read_segment_header(f.fileno(), path)


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
    if len(data) < _INDEX_HEADER.size or key is None:
        return []
    magic, version, session, roll, _first_seq, crc = _INDEX_HEADER.unpack_from(data)
    if (magic, version, (session, roll), crc) != (INDEX_MAGIC, INDEX_VERSION, key, header_crc):
        return []
    entries: list[Entry] = []
    offset = header_end
    seq = None
    ts = NO_TS
    unpack, crc_of = _ENTRY.unpack_from, zlib.crc32
    body_size = _ENTRY.size
    for at in range(_INDEX_HEADER.size, len(data) - ENTRY_SIZE + 1, ENTRY_SIZE):
        (stored,) = _ENTRY_CRC.unpack_from(data, at + body_size)
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


def _last_entry(path: Path, header_crc: int, size: int) -> Entry | None:
    """The last entry of ``path``'s index if it is whole and ends where the segment does."""
    try:
        with open(index_path(path), "rb") as f:
            head = f.read(_INDEX_HEADER.size)
            end = f.seek(0, os.SEEK_END)
            n = (end - _INDEX_HEADER.size) // ENTRY_SIZE
            if len(head) < _INDEX_HEADER.size or n <= 0:
                return None
            f.seek(_INDEX_HEADER.size + (n - 1) * ENTRY_SIZE)
            data = f.read(ENTRY_SIZE)
    except OSError:
        return None
    magic, version, session, roll, _first_seq, crc = _INDEX_HEADER.unpack(head)
    if (magic, version, (session, roll), crc) != (
        INDEX_MAGIC,
        INDEX_VERSION,
        log_file_key(path.name),
        header_crc,
    ):
        return None
    if len(data) < ENTRY_SIZE:
        return None
    (stored,) = _ENTRY_CRC.unpack_from(data, _ENTRY.size)
    if zlib.crc32(data[: _ENTRY.size]) != stored:
        return None
    entry = Entry(*_ENTRY.unpack_from(data))
    return entry if entry.kind in BATCH_KINDS and entry.end == size else None


def _on_disk(fd: int, entry: Entry) -> bool:
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


def _with_times(path: Path, f: BinaryIO, entries: list[Entry]) -> list[Entry]:
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
    if entries and not _on_disk(fd, entries[-1]):
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
