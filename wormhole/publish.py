"""``LogWriter``: a durable local log for applications that publish their own updates.

An application writes its events to a log on its own disk, so a network outage or
a stopped pipeline loses nothing; a ``filelog`` source reads the log and hands
the events to Wormhole::

    from wormhole.publish import LogWriter

    with LogWriter("data/riders/gps-1", publisher_id="rider-gps") as log:
        seq = log.publish("rider_location", key={"rider": 42},
                          after={"rider": 42, "lat": 12.97, "lon": 77.59})
        log.flush()        # durable on disk when this returns

Layout (as kdb+ RT publishers lay theirs out): the directory is the publisher's
*session directory*; every start of a writer opens a new session number and
writes ``log.<session>.<roll>`` files, rolled at ``roll_size``. Every message is
stamped with the publisher id and a sequence number. Readers deliver each
``(publisher_id, seq)`` once, so

* a publisher restarted from its last checkpoint (``start_seq=checkpoint + 1``)
  may write messages again without them being delivered twice, and
* two publishers writing the same stream (same publisher id, same sequence
  numbers) to two directories give high availability: either may fail.

Records are length + CRC framed (:mod:`wormhole.plugins.framing`): a file header
record naming the publisher, then message records each holding a batch of
messages with consecutive sequence numbers.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec

from wormhole.core.update import OPS
from wormhole.plugins.framing import (
    KIND_FILE_HEADER,
    KIND_MESSAGES,
    FileHeader,
    TornTail,
    frame,
    fsync_directory,
    log_file_key,
    read_records,
)


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One published message, as stored (the file-log line format's fields)."""

    table: str
    op: str = "c"
    key: dict[str, Any]
    after: Any = None
    before: Any = None
    ts_ms: int | None = None


_encoder = msgspec.json.Encoder()


class LogWriter:
    """Append messages to a publisher session directory. Not thread-safe: one per thread.

    ``publish`` buffers; ``flush`` writes the buffer as one record and (with
    ``fsync``) makes it durable before returning. A full buffer (``batch_size``
    messages) is flushed automatically, and ``close`` flushes.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        publisher_id: str,
        *,
        roll_size: int = 1 << 30,
        fsync: bool = True,
        start_seq: int | None = None,
        batch_size: int = 1000,
    ) -> None:
        if not publisher_id:
            raise ValueError("publisher_id must be a non-empty string")
        self.directory = Path(directory)
        self.publisher_id = publisher_id
        self.roll_size = roll_size
        self.fsync = fsync
        self.batch_size = batch_size
        self.directory.mkdir(parents=True, exist_ok=True)
        self.session = self._next_session()
        self.roll = 0
        self.next_seq = start_seq if start_seq is not None else self._last_seq() + 1
        if self.next_seq < 1:
            raise ValueError("start_seq must be >= 1")
        self._buffer: list[Message] = []
        self._fd = -1
        self._size = 0
        self._open_file()

    # ------------------------------------------------------------------ setup
    def _next_session(self) -> int:
        marker = self.directory / ".session"
        sessions = [k[0] for p in self.directory.iterdir() if (k := log_file_key(p.name))]
        with contextlib.suppress(FileNotFoundError, ValueError):
            sessions.append(int(marker.read_text().strip()))
        session = max(sessions, default=-1) + 1
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(f"{session}\n")
        os.replace(tmp, marker)
        return session

    def _last_seq(self) -> int:
        files = sorted(
            (k, p) for p in self.directory.iterdir() if (k := log_file_key(p.name)) is not None
        )
        for _, path in reversed(files):
            last = 0
            with open(path, "rb") as f:
                try:
                    for record in read_records(f, str(path)):
                        if record.kind == KIND_MESSAGES and record.count:
                            last = record.first + record.count - 1
                except TornTail:
                    pass
            if last:
                return last
        return 0

    def _open_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        path = self.directory / f"log.{self.session}.{self.roll}"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        header = _encoder.encode(FileHeader(self.publisher_id, self.session, self.roll))
        record = frame(KIND_FILE_HEADER, 0, 0, header)
        os.write(self._fd, record)
        self._size = len(record)
        if self.fsync:
            os.fsync(self._fd)
            fsync_directory(str(self.directory))

    # ---------------------------------------------------------------- writing
    def publish(
        self,
        table: str,
        key: dict[str, Any],
        after: dict[str, Any] | None = None,
        *,
        op: str = "c",
        before: dict[str, Any] | None = None,
        ts_ms: int | None = None,
    ) -> int:
        """Buffer one message; returns its sequence number."""
        if op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, not {op!r}")
        if not isinstance(key, dict) or not key:
            raise ValueError("key must be a non-empty dict of key columns")
        if op != "d" and after is None:
            raise ValueError(f"op {op!r} needs the row after the change (after=...)")
        if op == "d" and after is not None:
            raise ValueError("a delete has no row after the change: pass the old row as before=")
        self._buffer.append(
            Message(table=table, op=op, key=key, after=after, before=before, ts_ms=ts_ms)
        )
        seq = self.next_seq + len(self._buffer) - 1
        if len(self._buffer) >= self.batch_size:
            self.flush()
        return seq

    def flush(self) -> int:
        """Write buffered messages; returns the last sequence number now on disk."""
        if self._buffer:
            first = self.next_seq
            record = frame(KIND_MESSAGES, first, len(self._buffer), _encoder.encode(self._buffer))
            try:
                view = memoryview(record)
                while view:
                    view = view[os.write(self._fd, view) :]
                if self.fsync:
                    os.fdatasync(self._fd)
            except OSError:
                # No half record left behind: flush() again appends cleanly.
                os.ftruncate(self._fd, self._size)
                raise
            self.next_seq += len(self._buffer)
            self._size += len(record)
            self._buffer.clear()
            if self._size >= self.roll_size:
                self.roll += 1
                self._open_file()
        return self.next_seq - 1

    @property
    def last_seq(self) -> int:
        """The sequence number of the last message made durable by flush."""
        return self.next_seq - 1

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
