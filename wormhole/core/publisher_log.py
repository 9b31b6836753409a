"""The publisher log: the publisher's durable spool of decoded updates.

Layout of ``<state_dir>/log``::

    .session          the last session number used (text)
    log.<session>.<roll>
    index.<session>.<roll>   its index (a cache, see :mod:`wormhole.core.segment`)

Every start opens a new session (``log.<n+1>.0``); a segment rolls to
``log.<session>.<roll+1>`` when it passes ``roll_size`` bytes. Each segment begins
with a *segment header* record naming the first update sequence number it holds
and the source checkpoint at that point; every *batch* record carries its updates
and the source checkpoint after them. So the newest segment alone tells where the
source must resume, and the source is confirmed only after the batch that
contains its changes is on disk.

A batch whose record would exceed ``max_record`` bytes is written as several
*batch part* records followed by one batch record; only that last record carries
the checkpoint, so recovery cuts back an incomplete batch as a whole.

Updates are numbered by a publisher sequence number (``seq``) that runs across
sessions and rolls: a datamarker is a seq, meaning "every update before this one
was handled".
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
from msgspec import Raw

from wormhole.core.append_times import AppendTimes
from wormhole.core.errors import LogCorruptError, SourceError, StateError, file_problem
from wormhole.core.log_recovery import (
    check_continuity,
    read_session_file,
    recover_segment,
    write_session_file,
)

# Read from outside the publisher (offline_log); also importable from here, as they were.
from wormhole.core.offline_log import LogInfo as LogInfo
from wormhole.core.offline_log import inspect_log as inspect_log
from wormhole.core.offline_log import position_at_time as position_at_time
from wormhole.core.offline_log import read_log_range as read_log_range
from wormhole.core.segment import Segment, SegmentHeader, max_ts, remove_orphan_indexes
from wormhole.core.segment_format import KIND_BATCH, KIND_BATCH_PART, KIND_SEGMENT
from wormhole.core.update import Update
from wormhole.plugins.framing import (
    HEADER_SIZE,
    MAX_RECORD,
    fsync_directory,
    log_file_key,
    read_record_at,
)
from wormhole.plugins.framing import frame as make_frame

log = logging.getLogger("wormhole.publisher_log")

DEFAULT_ROLL_SIZE = 1 << 30
DEFAULT_MAX_RECORD = MAX_RECORD
"""The longest record payload written: what recovery accepts as whole (framing.MAX_RECORD)."""
DEFAULT_INDEX_INTERVAL = 0
"""Bytes of records appended between writes of the newest segment's index (0: every batch)."""


_updates_only_decoder = msgspec.json.Decoder(tuple[Any, list[Update]])
_row_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _row_decoder(row_type: type[Any]) -> msgspec.json.Decoder[Any]:
    decoder = _row_decoders.get(row_type)
    if decoder is None:
        decoder = _row_decoders[row_type] = msgspec.json.Decoder(tuple[Any, list[row_type]])  # type: ignore[valid-type]
    return decoder


_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Batch:
    """Updates ``first_seq .. first_seq + len(updates) - 1`` of the publisher log.

    ``end_seq`` may be past the last update: a batch whose updates were all
    filtered (or a checkpoint-only record) still moves positions forward.
    """

    first_seq: int
    updates: list[Update]
    end_seq: int
    appended_ns: int = 0
    """When the batch was appended (CLOCK_MONOTONIC ns); 0 when read back from disk."""

    @classmethod
    def of(cls, first_seq: int, updates: list[Update], appended_ns: int = 0) -> Batch:
        return cls(first_seq, updates, first_seq + len(updates), appended_ns)


@dataclass(slots=True)
class PreparedBatch:
    """A batch encoded and framed, its seqs reserved, not yet written."""

    first_seq: int
    updates: list[Update]
    checkpoint: Any
    checkpoint_raw: bytes
    records: list[tuple[int, int, bytes]]
    """``(first seq, count, framed record)``: one record, or the parts of a large batch."""
    max_ts: list[int]
    """The largest ``ts_ms`` of each record's updates (:data:`~wormhole.core.segment_format.NO_TS`
    for none), for the segment's time index."""


@dataclass
class Recovery:
    """What the log knew when it was opened."""

    checkpoint: Any
    next_seq: int
    session: int
    truncated: list[str] = field(default_factory=list)


class PublisherLog:
    """Append-only, segmented, CRC-framed spool of update batches.

    One thread appends (the tailer); any number of :class:`LogReader` read.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        roll_size: int = DEFAULT_ROLL_SIZE,
        fsync: bool = True,
        tail_updates: int = 262_144,
        max_record: int = DEFAULT_MAX_RECORD,
        index_interval: int = DEFAULT_INDEX_INTERVAL,
    ) -> None:
        if not 0 < max_record <= MAX_RECORD:
            raise ValueError(
                f"max_record {max_record} is outside 1 to {MAX_RECORD} (framing.MAX_RECORD), "
                f"the longest record recovery accepts as whole"
            )
        self.directory = Path(directory)
        self.roll_size = roll_size
        self.max_record = max_record
        self.fsync = fsync
        self.tail_updates = tail_updates
        self.index_interval = index_interval
        self.segments: list[Segment] = []
        self.next_seq = 0
        self._reserved = 0
        self.session = 0
        self.checkpoint: Any = None
        self.bytes_written = 0
        self.bytes_read = 0
        self._checkpoint_raw = b"null"
        self._active: Segment | None = None
        """The segment being written."""
        self._lock = threading.Lock()
        self.appended = threading.Condition(self._lock)
        # Recent batches kept in memory so that the lead caravan never re-reads them.
        self._tail: deque[Batch] = deque()
        self._tail_starts: deque[int] = deque()
        self._tail_count = 0
        self.append_times = AppendTimes()
        """When positions were appended (for lag in seconds, see :meth:`appended_at`)."""
        self.closed = False

    # ------------------------------------------------------------------ open
    def open(self) -> Recovery:
        """Recover the log (truncating a torn tail) and start a new session."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise file_problem(self.directory, exc, "create the publisher log directory") from exc
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise file_problem(self.directory, None, "write the publisher log directory")
        try:
            return self._recover()
        except OSError as exc:
            raise file_problem(
                exc.filename or self.directory, exc, "recover the publisher log"
            ) from exc

    def _recover(self) -> Recovery:
        truncated: list[str] = []
        found = sorted(
            (key, p)
            for p in self.directory.iterdir()
            if (key := log_file_key(p.name)) is not None and p.is_file()
        )
        remove_orphan_indexes(self.directory)
        last_session = read_session_file(self.directory)
        segments: list[Segment] = []
        checkpoint_raw = b"null"
        next_seq = 0
        # The newest segment holds the resume state; recover it, dropping segments
        # whose very header was torn (a crash right after the roll).
        while found:
            (session, roll), path = found[-1]
            last_session = max(last_session, session)
            state = recover_segment(session, roll, path, truncated)
            if state is None:
                found.pop()
                continue
            segment, checkpoint_raw, next_seq = state
            segments.append(segment)
            found.pop()
            break
        for (session, roll), path in reversed(found):
            last_session = max(last_session, session)
            segments.append(Segment.open_rolled(path, session, roll))
        segments.reverse()
        check_continuity(self.directory, segments)
        for older, newer in itertools.pairwise(segments):
            older.end_seq = newer.first_seq
        self.segments = segments
        self.next_seq = next_seq
        self._reserved = next_seq
        self._checkpoint_raw = checkpoint_raw
        self.checkpoint = msgspec.json.decode(checkpoint_raw)
        if segments:
            segments[-1].end_seq = next_seq
        self.session = last_session + 1
        write_session_file(self.directory, self.session)
        self._start_segment(self.session, 0)
        return Recovery(self.checkpoint, self.next_seq, self.session, truncated)

    def _start_segment(self, session: int, roll: int) -> None:
        if self.segments:
            self.segments[-1].end_seq = self.next_seq
        path = self.directory / f"log.{session}.{roll}"
        header = _encoder.encode(
            SegmentHeader(session, roll, self.next_seq, Raw(self._checkpoint_raw))
        )
        record = make_frame(KIND_SEGMENT, self.next_seq, 0, header)
        old = self._active
        try:
            if old is not None:
                # With log.fsync off the old segment's tail may still be in the page cache;
                # if the new header reached the disk first, a crash would leave a gap.
                old.sync()
            segment = Segment.create(path, session, roll, self.next_seq, record)
        except OSError as exc:
            raise StateError(
                f"cannot write the publisher log segment {path}: {exc.strerror}"
            ) from exc
        self._active = segment
        if old is not None:
            old.close(sync=False)
        with self._lock:
            self.segments.append(segment)

    # ---------------------------------------------------------------- append
    def prepare(self, updates: list[Update], checkpoint: Any) -> PreparedBatch:
        """Encode a batch and reserve its seqs, without writing it.

        Encoding holds the GIL and writing does not, so one thread can prepare
        the next batch while another commits this one. Batches must be committed
        in the order they were prepared.
        """
        first = self._reserved
        checkpoint_raw = _encoder.encode(checkpoint)
        payload = _encoder.encode((Raw(checkpoint_raw), updates))
        if len(payload) <= self.max_record:
            records = [(first, len(updates), make_frame(KIND_BATCH, first, len(updates), payload))]
            times = [max_ts(updates)]
        else:
            del payload  # over the bound (1 GiB by default): not worth holding twice
            records = self._split(first, updates, checkpoint_raw)
            times = [max_ts(updates[s - first : s - first + n]) for s, n, _ in records]
        self._reserved += len(updates)
        return PreparedBatch(first, updates, checkpoint, checkpoint_raw, records, times)

    def _split(
        self, first: int, updates: list[Update], checkpoint_raw: bytes
    ) -> list[tuple[int, int, bytes]]:
        """The records of a batch too large for one: parts, then the last with the checkpoint.

        Payloads are joined from each update's own encoding, byte for byte as the encoder
        writes them (``[checkpoint,[u1,u2]]``), so every record's size is known before it
        is built.
        """
        encoded = [_encoder.encode(u) for u in updates]
        overhead = max(len(b"[null,[]]"), len(checkpoint_raw) + len(b"[,[]]"))
        try:
            ranges = split_ranges([len(e) for e in encoded], overhead, self.max_record)
        except UpdateTooLarge as err:
            raise _too_large(updates[err.index], err.size, self.max_record) from None
        records = []
        for i, (start, stop) in enumerate(ranges):
            last = i == len(ranges) - 1
            payload = b"".join(
                (
                    b"[",
                    checkpoint_raw if last else b"null",
                    b",[",
                    b",".join(encoded[start:stop]),
                    b"]]",
                )
            )
            kind = KIND_BATCH if last else KIND_BATCH_PART
            seq = first + start
            records.append((seq, stop - start, make_frame(kind, seq, stop - start, payload)))
        return records

    def discard_prepared(self) -> None:
        """Forget batches prepared but not committed (the writer gave up on them)."""
        self._reserved = self.next_seq

    def commit(self, prepared: PreparedBatch) -> Batch:
        """Write a prepared batch; durable on return (per fsync).

        On a write error the segment is cut back to its last good record, so
        committing the same batch again appends cleanly; the error propagates.
        """
        segment = self._active
        assert segment is not None, "open() the log first"
        if prepared.first_seq != self.next_seq:
            raise RuntimeError(
                f"batch prepared at seq {prepared.first_seq} committed at {self.next_seq}"
            )
        updates = prepared.updates
        records = prepared.records
        segment.write([record for _, _, record in records], self.fsync)
        first = prepared.first_seq
        batch = Batch.of(first, updates, time.monotonic_ns())
        last = len(records) - 1
        appended = [
            (record_first, count, len(record), KIND_BATCH if i == last else KIND_BATCH_PART, ts)
            for i, ((record_first, count, record), ts) in enumerate(
                zip(records, prepared.max_ts, strict=True)
            )
        ]
        with self._lock:
            before = segment.size
            segment.appended(appended)
            self.bytes_written += segment.size - before
            self.next_seq = batch.end_seq
            self.append_times.mark(first, batch.appended_ns)
            self.checkpoint = prepared.checkpoint
            self._checkpoint_raw = prepared.checkpoint_raw
            if updates:
                self._tail.append(batch)
                self._tail_starts.append(first)
                self._tail_count += len(updates)
                while self._tail_count > self.tail_updates and len(self._tail) > 1:
                    old = self._tail.popleft()
                    self._tail_starts.popleft()
                    self._tail_count -= len(old.updates)
            self.appended.notify_all()
        if segment.size - segment.indexed_bytes >= self.index_interval:
            segment.write_index()
        if segment.size >= self.roll_size:
            self._start_segment(self.session, segment.roll + 1)
        return batch

    def append(self, updates: list[Update], checkpoint: Any) -> Batch:
        """Append a batch and the source checkpoint after it; durable on return (per fsync)."""
        prepared = self.prepare(updates, checkpoint)
        try:
            return self.commit(prepared)
        except OSError:
            self.discard_prepared()
            raise

    def sync(self) -> None:
        if self._active is not None:
            self._active.sync()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.appended.notify_all()
        if self._active is not None:
            self._active.close()
            self._active = None

    # ------------------------------------------------------------------ read
    @property
    def first_seq(self) -> int:
        """The oldest seq still retained."""
        with self._lock:
            return self.segments[0].first_seq if self.segments else self.next_seq

    def wait_for(self, seq: int, timeout: float) -> bool:
        """Block until an update at ``seq`` exists (or the log closes / time passes)."""
        with self._lock:
            if self.next_seq > seq or self.closed:
                return self.next_seq > seq
            self.appended.wait(timeout)
            return self.next_seq > seq

    def reader(self, position: int, row_type: type[Any] = Update) -> LogReader:
        """A reader from ``position``. ``row_type``: what updates read from disk are decoded
        as (a lighter struct with the fields of :class:`Update` a reader needs, such as
        :class:`wormhole.core.update.ColumnRow`); those still in memory are Updates."""
        return LogReader(self, position, row_type)

    def _from_tail(self, position: int) -> Batch | None:
        # Caller holds the lock.
        if not self._tail or position < self._tail_starts[0]:
            return None
        i = bisect.bisect_right(self._tail_starts, position) - 1
        batch = self._tail[i]
        if position >= batch.end_seq:
            return None  # a checkpoint-only gap; read the index instead
        return batch

    def appended_at(self, position: int) -> int:
        """When the update at ``position`` was appended (CLOCK_MONOTONIC ns): exact for the
        batches kept in memory, else to within a second or so (see :class:`AppendTimes`)."""
        with self._lock:
            tail, starts = self._tail, self._tail_starts
            if tail and position >= starts[0]:
                i = bisect.bisect_right(starts, position) - 1
                if position < tail[i].end_seq or i + 1 == len(tail):
                    return tail[i].appended_ns
                return tail[i + 1].appended_ns  # a checkpoint-only gap: the next batch
            return self.append_times.at(position)

    def locate(self, position: int) -> Batch | Segment | None:
        """Where the update at ``position`` is: a batch still in memory, else the segment that
        holds it; None when the log does not hold it yet. Raises LookupError when it was
        garbage-collected."""
        with self._lock:
            if position >= self.next_seq:
                return None
            if self.segments and position < self.segments[0].first_seq:
                raise LookupError(
                    f"position {position} is older than the oldest retained "
                    f"update {self.segments[0].first_seq}"
                )
            return self._from_tail(position) or self._segment_for(position)

    def count_read(self, size: int) -> None:
        """``size`` bytes were read from disk by a reader."""
        with self._lock:
            self.bytes_read += size

    def _segment_for(self, position: int) -> Segment:
        # Caller holds the lock. Empty segments share their first_seq with the next
        # one; the last segment starting at or before the position is the one.
        i = bisect.bisect_right([s.first_seq for s in self.segments], position) - 1
        if i < 0:
            raise LookupError(position)
        return self.segments[i]

    # -------------------------------------------------------------------- gc
    def collect_garbage(self, upto: int, keep: int = 0) -> list[str]:
        """Delete rolled segments whose updates are all before ``upto``.

        ``upto`` is the smallest datamarker of every flow; ``keep`` rolled
        segments that qualify are retained anyway (for replay).
        """
        with self._lock:
            done = [s for s in self.segments[:-1] if s.end_seq is not None and s.end_seq <= upto]
            if keep:
                done = done[: max(0, len(done) - keep)]
            for segment in done:
                self.segments.remove(segment)
            if done:
                self.append_times.forget_before(self.segments[0].first_seq)
        removed = []
        for segment in done:
            if not segment.remove_files():
                continue
            removed.append(segment.name)
            # Oldest first, each removal durable before the next: a crash in between leaves
            # the log without its oldest segments, never with a hole that open() rejects.
            fsync_directory(str(self.directory))
        if removed:
            log.info("garbage-collected publisher log segments %s", ", ".join(removed))
        return removed


class LogReader:
    """Reads batches in order from ``position``: from memory at the tail, else from disk."""

    def __init__(
        self, publisher_log: PublisherLog, position: int, row_type: type[Any] = Update
    ) -> None:
        self.publisher_log = publisher_log
        self.position = position
        self._decoder = _updates_only_decoder if row_type is Update else _row_decoder(row_type)
        self.bytes_read = 0
        self._file: BinaryIO | None = None
        self._file_path: Path | None = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def read(self) -> Batch | None:
        """The next batch at or after the position, or None when caught up."""
        found = self.publisher_log.locate(self.position)
        if found is None:
            return None
        batch = found if isinstance(found, Batch) else self._read_disk(found, self.position)
        if batch.first_seq < self.position:
            cut = self.position - batch.first_seq
            batch = Batch(self.position, batch.updates[cut:], batch.end_seq, batch.appended_ns)
        self.position = batch.end_seq
        return batch

    def _open(self, segment: Segment) -> BinaryIO:
        if self._file_path != segment.path or self._file is None:
            self.close()
            self._file = open(segment.path, "rb")  # noqa: SIM115 - kept open across reads
            self._file_path = segment.path
        return self._file

    def _read_disk(self, segment: Segment, position: int) -> Batch:
        entry = segment.entry_for(position)
        f = self._open(segment)
        record = read_record_at(f, str(segment.path), entry.offset)
        _, updates = self._decoder.decode(record.payload)
        size = HEADER_SIZE + len(record.payload)
        self.bytes_read += size
        self.publisher_log.count_read(size)
        if len(updates) != entry.n_updates or record.first != entry.first:
            raise LogCorruptError(
                str(segment.path), entry.offset, "record does not match its index"
            )
        return Batch.of(entry.first, updates)


class UpdateTooLarge(Exception):
    """Update ``index`` of a batch, ``size`` bytes encoded, fits no record."""

    def __init__(self, index: int, size: int) -> None:
        super().__init__(index, size)
        self.index = index
        self.size = size


def split_ranges(sizes: list[int], overhead: int, bound: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` slices of a batch's updates, each a record within ``bound``.

    ``sizes`` are the updates' encoded lengths; a record's payload is ``overhead`` bytes
    plus its updates and a comma between each two. Raises UpdateTooLarge for an update that
    does not fit a record on its own.
    """
    ranges = []
    start = 0
    used = overhead
    for i, size in enumerate(sizes):
        if overhead + size > bound:
            raise UpdateTooLarge(i, size)
        grown = used + size + (1 if i > start else 0)
        if grown > bound:
            ranges.append((start, i))
            start, grown = i, overhead + size
        used = grown
    ranges.append((start, len(sizes)))
    return ranges


def _too_large(update: Update, size: int, bound: int) -> SourceError:
    key = msgspec.json.encode(update.key).decode()
    if len(key) > 200:
        key = key[:200] + "…"
    at = f" at {update.position}" if update.position else ""
    return SourceError(
        f"an update too large for the publisher log: table {update.table or '?'}, key {key}"
        f"{at} encodes to {size:,} bytes, over the {bound:,}-byte limit of a record. It "
        f"cannot be published: leave its table out of the source, or keep values this "
        f"large out of the database"
    )
