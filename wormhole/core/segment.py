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
cover, never an update. The format, and reading it back, is :mod:`wormhole.core.segment_format`.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import msgspec

from wormhole.core.errors import LogCorruptError
from wormhole.core.segment_format import (
    ENTRY_SIZE,
    INDEX_HEADER,
    INDEX_MAGIC,
    INDEX_VERSION,
    NO_TS,
    Entry,
    index_path,
    last_entry,
    load_entries,
    on_disk,
    pack_entry,
    read_segment_header,
    with_times,
    write_all,
)
from wormhole.plugins.framing import (
    HEADER,
    HEADER_SIZE,
    fsync_directory,
    log_file_key,
)

log = logging.getLogger("wormhole.publisher_log")


class SegmentHeader(msgspec.Struct):
    """The payload of a segment's first record (JSON)."""

    session: int
    roll: int
    first_seq: int
    checkpoint: msgspec.Raw


def remove_orphan_indexes(directory: Path) -> None:
    """Delete index files whose segment is gone (a crash between the two deletions)."""
    for path in directory.glob("index.*"):
        segment = path.with_name("log" + path.name[5:])
        if log_file_key(segment.name) is not None and not segment.exists():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


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
            first_seq, header_crc, header_end = read_segment_header(fd, path)
            size = os.fstat(fd).st_size
            segment = cls(path, session, roll, first_seq, size, None, header_crc)
            last = last_entry(path, header_crc, size)
            if last is not None and on_disk(fd, last):
                segment.end = last.first + last.n_updates
                return segment
            entries, whole, indexed = load_entries(path, fd, header_crc, header_end, size)
            entries = with_times(path, f, entries)
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
                    _, header_crc, header_end = read_segment_header(fd, self.path)
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
                os.lseek(fd, INDEX_HEADER.size + start * ENTRY_SIZE, os.SEEK_SET)
            data = [pack_entry(e) for e in entries[start:]]
            if start == 0:
                os.lseek(fd, 0, os.SEEK_SET)
                data.insert(
                    0,
                    INDEX_HEADER.pack(
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


__all__ = ["Segment", "SegmentHeader", "max_ts", "remove_orphan_indexes"]
