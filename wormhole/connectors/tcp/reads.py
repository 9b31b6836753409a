"""Log readers (protocol version 2), publisher side: an external application's flows read
by range (see :mod:`wormhole.connectors.tcp.ranges` for the requests).

:class:`ReadService` serves the readers of one publisher and owns the caches they share;
each connection is a :class:`ReaderSession`, served on its handshake's thread.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.options import TcpOptions
from wormhole.connectors.tcp.protocol import ReadBatch
from wormhole.connectors.tcp.range_cache import CACHE_UPDATES, RangeCache
from wormhole.core.update import ColumnRow, Update, UpdateColumns, split_columns
from wormhole.plugins.components import Datamarker, LogBatch, PublisherView

log = logging.getLogger("wormhole.tcp")

WAIT_FOR_RANGE_S = 10.0
"""How long a read waits for the end of its range to be in the log (a reader that saw
positions from a publisher a moment ago asks for nothing later than that)."""
READ_SEND_TIMEOUT_S = 60.0
"""A reader that takes no byte of its range for this long is closed."""
FRAME_UPDATES = 2000
"""Updates per ``batch`` frame of a read, at most (and at most ``max_batch_frame`` bytes)."""
FRAME_ROWS = 8192
"""Updates per ``columns`` frame of a read, at most (and at most ``max_batch_frame`` bytes)."""


class ReadService:
    """The log readers of one publisher: their sessions, and the caches they share (one per
    layout of read: ``rows`` by updates, ``columns`` by bytes)."""

    def __init__(self, options: TcpOptions, stopping: threading.Event) -> None:
        self.options = options
        self.stopping = stopping
        """Set when the publisher stops: no reader is served after it."""
        self.hub: PublisherView = None  # type: ignore[assignment]
        self.readers: set[ReaderSession] = set()
        self.lock = threading.Lock()
        self.range_cache = RangeCache(CACHE_UPDATES)
        self.column_cache = RangeCache(int(options.read_cache))

    def start(self, hub: PublisherView) -> None:
        self.hub = hub

    def serve(self, sock: socket.socket, peer: str, hello: p.Hello) -> None:
        """Serve a log reader (mode ``read``) on this thread until it leaves."""
        session = ReaderSession(self, sock, peer, hello)
        with self.lock:
            if self.stopping.is_set():
                p.close_socket(sock)
                return
            self.readers.add(session)
        try:
            session.run()
        finally:
            with self.lock:
                self.readers.discard(session)

    def expire(self) -> None:
        """Drop what the caches hold for longer than they keep it."""
        self.range_cache.expire()
        self.column_cache.expire()

    def close(self) -> None:
        """Close every reader's connection (the publisher stops)."""
        with self.lock:
            readers = list(self.readers)
        for reader in readers:
            p.close_socket(reader.sock)


class ReaderSession:
    """The publisher's end of one log reader's connection, served on its own thread."""

    def __init__(self, service: ReadService, sock: socket.socket, peer: str, hello: Any) -> None:
        self.service = service
        self.hub = service.hub
        self.options = service.options
        self.sock = sock
        self.application = hello.application
        self.name = f"{hello.application}/{hello.instance}@{peer} (reader)"
        self.next_frame_id = 1

    def run(self) -> None:
        max_frame = int(self.options.max_frame)
        try:
            while not self.service.stopping.is_set():
                try:
                    kind, body = p.read_frame(self.sock, max_frame)
                except TimeoutError:
                    return  # an idle reader: it connects again for its next request
                self.service.expire()
                if kind == p.OFFSETS:
                    self._send(p.encode(p.POSITIONS, self._positions()))
                elif kind == p.READ:
                    self._read(body)
                elif kind == p.COMMIT:
                    self._send(p.encode(p.COMMITTED, p.Committed(datamarkers=self._commit(body))))
                elif kind == p.HEARTBEAT:
                    continue
                elif kind == p.BYE:
                    return
                else:
                    raise p.ProtocolError(f"unexpected {p.NAMES.get(kind, kind)} frame")
        except _Refused as exc:
            log.warning("%s: %s", self.name, exc)
            self._refuse(str(exc), fatal=True)
        except p.PeerClosed:
            pass
        except p.ProtocolError as exc:
            log.warning("%s: %s; closing the connection", self.name, exc)
            self._refuse(str(exc), fatal=False)
        except OSError as exc:
            log.info("%s: connection lost: %s", self.name, exc)
        finally:
            p.close_socket(self.sock)

    # ----------------------------------------------------------- requests
    def _positions(self) -> p.Positions:
        first, end = self.hub.log_range()
        stored = self.hub.stored_datamarkers()
        shards = self.hub.shards
        return p.Positions(
            first=first,
            end=end,
            datamarkers={
                shard: stored[(self.application, shard)].position
                for shard in range(shards)
                if (self.application, shard) in stored
            },
            shards=shards,
            datastore=self.hub.pipeline.datastore,
        )

    def _read(self, request: p.Read) -> None:
        shard, start, end = request.shard, request.start, request.end
        if not 0 <= shard < self.hub.shards or not 0 <= start <= end:
            raise _Refused(
                f"bad read: shard {shard} (0 to {self.hub.shards - 1}), range [{start}, {end})"
            )
        if request.layout not in p.LAYOUTS:
            raise _Refused(f"bad read: layout {request.layout!r} (rows or columns)")
        first, log_end = self.hub.log_range()
        if start < first and start < end:
            raise _Refused(
                f"shard {shard}: updates {start} to {min(end, first) - 1} are no longer "
                f"retained (the publisher log starts at {first}); the reader's positions are "
                f"older than the log: start it from a new checkpoint, or keep the log for it "
                f"(an external application's datamarkers hold the log back)"
            )
        if end > log_end and not self.hub.wait_for_log(end - 1, WAIT_FOR_RANGE_S):
            _, log_end = self.hub.log_range()
            raise _Refused(
                f"shard {shard}: updates {log_end} to {end - 1} are not in the publisher log "
                f"(it ends at {log_end}): the reader's positions come from another log"
            )
        self.sock.settimeout(READ_SEND_TIMEOUT_S)
        if request.layout == "columns":
            count = self._read_columns(shard, start, end)
        else:
            count = self._read_rows(shard, start, end)
        done = p.ReadEnd(shard=shard, start=start, end=end, updates=count)
        self._send(p.encode(p.READ_END, done))
        self.sock.settimeout(self.options.heartbeat_timeout_ms / 1000.0)

    def _walk(
        self,
        shard: int,
        start: int,
        end: int,
        cache: RangeCache,
        split: Callable[[LogBatch], tuple[dict[int, Any], int | None]],
        row_type: type[Any] = Update,
    ) -> Iterator[Any]:
        """The shard's part of every publisher-log batch from ``start`` until ``end``, as
        ``split`` makes it from a batch (``(parts by shard, weight to cache them by, or
        None not to)``), through ``cache``: the flows of one range split each batch once."""
        cursor: Any = None
        position = start
        try:
            while position < end:

                def make(at: int = position) -> tuple[tuple[int, dict[int, Any]], int | None]:
                    nonlocal cursor
                    if cursor is None:
                        cursor = self.hub.read_log(at, row_type)
                    cursor.position = at
                    try:
                        batch = cursor.read()
                    except LookupError as exc:
                        raise _Refused(f"shard {shard}: {exc}") from None
                    if batch is None:
                        raise _Refused(
                            f"shard {shard}: the publisher log ends at {at}, before the end "
                            f"of the range {end}"
                        )
                    # The entry holds the updates from ``at`` on (the batch is cut there
                    # when a range starts inside it): what any reader at ``at`` needs.
                    try:
                        parts, weight = split(batch)
                    except ValueError as exc:  # an update the reader cannot be given
                        raise _Refused(f"shard {shard}: {exc}") from None
                    return (batch.end_seq, parts), weight

                hit = cache.get_or_make(position, shard, make)
                end_seq, parts = hit
                yield parts.get(shard)
                position = end_seq
        finally:
            if cursor is not None:
                cursor.close()

    def _read_rows(self, shard: int, start: int, end: int) -> int:
        limit = int(self.options.max_batch_frame)
        count = 0
        seqs: list[int] = []
        updates: list[Update] = []
        size = 0
        first_of_frame = start
        application = self.application
        cache = self.service.range_cache

        def split(batch: LogBatch) -> tuple[dict[int, Any], int | None]:
            return _split(batch.first_seq, batch.updates), len(batch.updates)

        for part in self._walk(shard, start, end, cache, split):
            for seq, update in zip(*(part or ((), ())), strict=True):
                if seq >= end:
                    break
                if seq < start:
                    continue
                if update.audience and update.audience != application:
                    continue  # a backfill for another application
                seqs.append(seq)
                updates.append(update)
                size += len(update.before) + len(update.after) + 200
                if len(updates) >= FRAME_UPDATES or size >= limit // 2:
                    self._send_updates(first_of_frame, seq + 1, seqs, updates, limit)
                    count += len(updates)
                    first_of_frame = seq + 1
                    seqs, updates, size = [], [], 0
        if updates:
            self._send_updates(first_of_frame, end, seqs, updates, limit)
            count += len(updates)
        return count

    def _read_columns(self, shard: int, start: int, end: int) -> int:
        limit = int(self.options.max_batch_frame)
        application = self.application
        cache = self.service.column_cache

        def split(batch: LogBatch) -> tuple[dict[int, Any], int | None]:
            updates = batch.updates
            if updates and (updates[0].audience or updates[-1].audience):
                # A backfill's batch, for one application: split for this one, not cached.
                return split_columns(batch.first_seq, updates, application), None
            parts = split_columns(batch.first_seq, updates)
            return parts, sum(part.nbytes for part in parts.values())

        count = 0
        pending: list[UpdateColumns] = []
        rows = size = 0
        first_of_frame = start
        for part in self._walk(shard, start, end, cache, split, ColumnRow):
            if part is None or not part.rows:
                continue
            if part.first_seq() < start or part.last_seq() >= end:
                seqs = part.seqs()
                part = part.slice(bisect.bisect_left(seqs, start), bisect.bisect_left(seqs, end))
                if not part.rows:
                    continue
            while part.rows:
                room = FRAME_ROWS - rows
                if part.rows <= room:
                    piece, part = part, part.slice(0, 0)
                else:  # a large batch's part: cut at the frame's row limit
                    piece, part = part.slice(0, room), part.slice(room, part.rows)
                pending.append(piece)
                rows += piece.rows
                size += piece.nbytes
                if rows >= FRAME_ROWS or size >= limit // 2:
                    next_first = piece.last_seq() + 1
                    self._send_columns(shard, first_of_frame, next_first, pending, limit)
                    count += rows
                    first_of_frame = next_first
                    pending, rows, size = [], 0, 0
        if pending:
            self._send_columns(shard, first_of_frame, end, pending, limit)
            count += rows
        return count

    def _send_columns(
        self, shard: int, first: int, end: int, parts: list[UpdateColumns], limit: int
    ) -> None:
        columns = UpdateColumns.concat(parts)
        frame = p.encode_columns(shard, first, end, columns)
        if len(frame) > limit and columns.rows > 1:
            half = columns.rows // 2
            middle = columns.seqs()[half]
            self._send_columns(shard, first, middle, [columns.slice(0, half)], limit)
            self._send_columns(shard, middle, end, [columns.slice(half, columns.rows)], limit)
            return
        self._send(frame)

    def _send_updates(
        self, first: int, end: int, seqs: list[int], updates: list[Update], limit: int
    ) -> None:
        body = ReadBatch(id=self.next_frame_id, first=first, end=end, seqs=seqs, updates=updates)
        frame = p.encode(p.BATCH, body)
        if len(frame) > limit and len(updates) > 1:
            half = len(updates) // 2
            self._send_updates(first, seqs[half], seqs[:half], updates[:half], limit)
            self._send_updates(seqs[half], end, seqs[half:], updates[half:], limit)
            return
        self.next_frame_id += 1
        self._send(frame)

    def _commit(self, request: p.Commit) -> dict[int, int]:
        shards = self.hub.shards
        bad = [s for s in request.datamarkers if not 0 <= s < shards]
        if bad:
            raise _Refused(f"bad commit: shards {bad} (this pipeline has 0 to {shards - 1})")
        _, log_end = self.hub.log_range()
        past = {s: v for s, v in request.datamarkers.items() if v > log_end}
        if past:
            raise _Refused(
                f"bad commit: datamarkers {past} point past the end of the publisher log "
                f"({log_end}): the reader's positions come from another log"
            )
        stored = self.hub.stored_datamarkers()
        merged: dict[int, int] = {}
        changed: list[Datamarker] = []
        for shard in range(shards):
            old = stored.get((self.application, shard))
            value = request.datamarkers.get(shard)
            current = old.position if old is not None else None
            if value is not None and (current is None or value > current):
                changed.append(Datamarker(self.application, shard, value))
                current = value
            if current is not None:
                merged[shard] = current
        if changed:
            self.hub.store_datamarkers(changed)
        return merged

    # ------------------------------------------------------------ sending
    def _send(self, data: bytes) -> None:
        p.send_all(self.sock, data)

    def _refuse(self, reason: str, fatal: bool) -> None:
        with contextlib.suppress(OSError):
            self._send(p.encode(p.REFUSE, p.Refuse(reason=reason, fatal=fatal)))


_Split = dict[int, tuple[list[int], list[Update]]]


def _split(first: int, batch: list[Update]) -> _Split:
    """A batch's updates by shard, with their seqs."""
    out: _Split = {}
    for seq, update in enumerate(batch, first):
        part = out.get(update.shard)
        if part is None:
            part = out[update.shard] = ([], [])
        part[0].append(seq)
        part[1].append(update)
    return out


class _Refused(Exception):
    """A request the reader cannot have: refuse it (fatal) and close."""


__all__ = ["FRAME_ROWS", "ReadBatch", "ReadService", "ReaderSession"]
