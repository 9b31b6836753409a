"""Log readers (protocol version 2): an external application's flows read by range.

A reader connects like a subscriber, says ``hello`` with ``mode: "read"``, and then asks,
one request at a time:

- ``offsets`` -> ``positions``: the log's extent and the application's stored datamarkers;
- ``read {shard, from, to}`` -> ``batch`` frames with that shard's updates of ``[from, to)``
  (each with the ``seqs`` of its updates), then ``read-end``; with ``layout: "columns"``,
  ``columns`` frames instead (the updates a column at a time, see
  :class:`wormhole.core.update.UpdateColumns`);
- ``commit {datamarkers}`` -> ``committed``: the application's datamarkers, stored durably
  at the publisher, which keeps its log from them on.

Publisher side: :class:`ReaderSession`. Reader side: :class:`TcpRemoteLog`, the ``tcp``
transport's ``remote_log`` (the Spark source's network mode uses it on executors).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from wormhole.connectors.tcp import protocol as p
from wormhole.core.update import ColumnRow, Update, UpdateColumns, columns_of, split_columns
from wormhole.plugins.components import (
    Datamarker,
    LogBatch,
    LogPositions,
    RemoteLogError,
    RemoteLogRequest,
)

if TYPE_CHECKING:
    from wormhole.connectors.tcp.server import TcpTransport

log = logging.getLogger("wormhole.tcp")

WAIT_FOR_RANGE_S = 10.0
"""How long a read waits for the end of its range to be in the log (a reader that saw
positions from a publisher a moment ago asks for nothing later than that)."""
READ_SEND_TIMEOUT_S = 60.0
"""A reader that takes no byte of its range for this long is closed."""
FRAME_UPDATES = 2000
"""Updates per ``batch`` frame of a read, at most (and at most ``max_batch_frame`` bytes)."""


class ReadBatch(msgspec.Struct, kw_only=True):
    """A ``batch`` frame of a read: ``seqs[i]`` is the publisher-log seq of ``updates[i]``."""

    id: int
    first: int
    end: int
    appended_ns: int = 0
    datamarkers: dict[int, int] = {}
    seqs: list[int]
    updates: list[Update]


_decode_read_batch = msgspec.json.Decoder(ReadBatch).decode


class ReaderSession:
    """The publisher's end of one log reader's connection, served on its own thread."""

    def __init__(self, server: TcpTransport, sock: socket.socket, peer: str, hello: Any) -> None:
        self.server = server
        self.hub = server.hub
        self.sock = sock
        self.application = hello.application
        self.name = f"{hello.application}/{hello.instance}@{peer} (reader)"
        self.next_frame_id = 1

    def run(self) -> None:
        max_frame = int(self.server.options.max_frame)
        try:
            while not self.server.stopping.is_set():
                try:
                    kind, body = p.read_frame(self.sock, max_frame)
                except TimeoutError:
                    return  # an idle reader: it connects again for its next request
                for name in ("range_cache", "column_cache"):
                    cache: RangeCache | None = getattr(self.server, name, None)
                    if cache is not None:
                        cache.expire()
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
        self.sock.settimeout(self.server.options.heartbeat_timeout_ms / 1000.0)

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
        limit = int(self.server.options.max_batch_frame)
        count = 0
        seqs: list[int] = []
        updates: list[Update] = []
        size = 0
        first_of_frame = start
        application = self.application
        cache = _cache_of(self.server, "range_cache", CACHE_UPDATES)

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
        limit = int(self.server.options.max_batch_frame)
        application = self.application
        cache = _cache_of(self.server, "column_cache", int(self.server.options.read_cache))

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


CACHE_UPDATES = 1 << 18
"""Updates the cache of ``rows`` reads holds at most (about 128 MiB of rows of 500 bytes)."""
FRAME_ROWS = 8192
"""Updates per ``columns`` frame of a read, at most (and at most ``max_batch_frame`` bytes)."""
CACHE_SECONDS = 60.0
"""A cached batch is dropped this long after it was made, if its flows have not all taken
their part by then."""
BUILD_WAIT_S = 5.0
"""How long a reader waits for another that is making the entry it needs, before making its
own."""

_Entry = tuple[int, dict[int, Any]]
"""``(end seq, parts by shard)``: what a reader at the entry's position needs of a batch."""


class _Making:
    """An entry a reader is making: the others wait for it and take what it made."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: _Entry | None = None
        """What was made, for the waiters (None: failed, or only for the reader's own use)."""


class RangeCache:
    """Publisher-log batches split by shard, shared by the log readers of one publisher.

    Readers of one micro-batch each read one flow of the same range, a few side by side: the
    first to reach a batch decodes and splits it, the others wait for it and take their
    shard's part. An entry is dropped once every shard with a part in it has taken it (the
    flows of a micro-batch read each batch once), or ``seconds`` after it was made. Entries
    weigh what the reader says (updates, or bytes); a new entry that does not fit is not kept
    (a range larger than the cache is then partly cached for every flow, rather than evicted
    ahead of each).
    """

    def __init__(self, capacity: int = CACHE_UPDATES, seconds: float = CACHE_SECONDS) -> None:
        self.capacity = capacity
        self.seconds = seconds
        self.lock = threading.Lock()
        self.entries: dict[int, tuple[float, int, _Entry, set[int]]] = {}
        """By position, oldest first: (made at, weight, entry, shards yet to take theirs)."""
        self.weight = 0
        self.making: dict[int, _Making] = {}
        self._sweeper: threading.Timer | None = None

    def get(self, first: int, shard: int | None = None) -> _Entry | None:
        with self.lock:
            entry = self.entries.get(first)
            if entry is None:
                return None
            if shard is not None:
                self._taken(first, entry, shard)
        return entry[2]

    def get_or_make(
        self,
        first: int,
        shard: int,
        make: Callable[[], tuple[_Entry, int | None]],
    ) -> _Entry:
        """The entry at ``first`` for ``shard``'s reader, made by ``make`` (``(entry, weight,
        or None when it is only for this reader)``) unless another reader is making it: then
        what that one made."""
        while True:
            with self.lock:
                entry = self.entries.get(first)
                if entry is not None:
                    self._taken(first, entry, shard)
                    return entry[2]
                making = self.making.get(first)
                if making is None:
                    making = self.making[first] = _Making()
                    break
            if not making.done.wait(BUILD_WAIT_S):
                break  # it takes too long: make it here too
            with self.lock:
                entry = self.entries.get(first)
                if entry is not None:
                    self._taken(first, entry, shard)
                    return entry[2]
            if making.value is not None:
                return making.value  # made, not kept (no room): shared all the same
            # It failed, or made it for its own application only: make it here.
        try:
            value, weight = make()
            if weight is not None:
                making.value = value
                self.put(first, value, weight, exclude=shard)
            return value
        finally:
            with self.lock:
                if self.making.get(first) is making:
                    del self.making[first]
            making.done.set()

    def put(self, first: int, value: _Entry, weight: int, exclude: int | None = None) -> None:
        """Keep ``value`` if it fits; ``exclude``: a shard whose reader already has its part."""
        waiting = set(value[1]) - {exclude}
        now = time.monotonic()
        with self.lock:
            self._expire(now)
            if first in self.entries or not waiting or self.weight + weight > self.capacity:
                return
            self.entries[first] = (now, weight, value, waiting)
            self.weight += weight
            if self._sweeper is None:
                self._sweeper = threading.Timer(self.seconds, self._sweep)
                self._sweeper.daemon = True
                self._sweeper.start()

    def expire(self) -> None:
        """Drop the entries made more than ``seconds`` ago."""
        with self.lock:
            self._expire(time.monotonic())

    def _sweep(self) -> None:
        # Readers that went quiet send no request: a timer drops what they left.
        with self.lock:
            self._sweeper = None
            self._expire(time.monotonic())
            if self.entries:
                self._sweeper = threading.Timer(self.seconds, self._sweep)
                self._sweeper.daemon = True
                self._sweeper.start()

    def _expire(self, now: float) -> None:
        # Entries are kept in the order they were made: the oldest come first.
        while self.entries:
            first, (made, weight, _, _) = next(iter(self.entries.items()))
            if now - made <= self.seconds:
                return
            del self.entries[first]
            self.weight -= weight

    def _taken(self, first: int, entry: tuple[float, int, _Entry, set[int]], shard: int) -> None:
        waiting = entry[3]
        waiting.discard(shard)
        if not waiting:
            del self.entries[first]
            self.weight -= entry[1]


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


_caches_lock = threading.Lock()


def _cache_of(server: Any, name: str, capacity: int) -> RangeCache:
    """The publisher's cache ``name`` (one per kind of read), made on first use."""
    with _caches_lock:
        cache: RangeCache | None = getattr(server, name, None)
        if cache is None:
            cache = RangeCache(capacity)
            setattr(server, name, cache)
        return cache


class _Refused(Exception):
    """A request the reader cannot have: refuse it (fatal) and close."""


# --------------------------------------------------------------- reader side
class TcpRemoteLog:
    """A publisher's log over TCP, for one external application (``remote_log``).

    Each request opens its own connection (a Spark task reads one range; the driver asks
    for positions and commits once per micro-batch), so nothing idles between them.
    """

    def __init__(self, request: RemoteLogRequest) -> None:
        self.address = request.address
        self.application = request.application
        options = request.options
        host, _ = p.parse_address(self.address)
        self.host = host
        self.token = options.get("token", "")
        self.timeout = int(options.get("timeoutMs", "30000")) / 1000.0
        self.instance = options.get("instance") or f"{socket.gethostname()}-reader"
        self.tls: ssl.SSLContext | None = None
        self.server_name = options.get("tls.serverName") or None
        if any(key.startswith("tls.") for key in options):
            try:
                context = ssl.create_default_context(
                    ssl.Purpose.SERVER_AUTH, cafile=options.get("tls.ca") or None
                )
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                if options.get("tls.cert"):
                    context.load_cert_chain(options["tls.cert"], options.get("tls.key") or None)
            except (OSError, ssl.SSLError) as exc:
                raise RemoteLogError(
                    f"wormhole source: cannot load the TLS files of options tls.ca / tls.cert / "
                    f"tls.key ({exc}); check the paths on every machine of the job"
                ) from exc
            self.tls = context

    def close(self) -> None:
        pass

    def _connect(self) -> socket.socket | ssl.SSLSocket:
        host, port = p.parse_address(self.address)
        try:
            raw = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as exc:
            raise RemoteLogError(
                f"cannot reach the publisher at {self.address} from {socket.gethostname()} "
                f"({exc.strerror or exc}): check that it runs, that this address (option "
                f"publishers, or the address it registered) is reachable from here, and that "
                f"the port is open"
            ) from exc
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket | ssl.SSLSocket = raw
        try:
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(raw, server_hostname=self.server_name or host)
                except (ssl.SSLError, ssl.CertificateError) as exc:
                    raise RemoteLogError(
                        f"publisher {self.address}: TLS handshake failed ({exc}){self._tls_hint()}"
                    ) from exc
            hello = p.Hello(
                version=p.READ_VERSION,
                application=self.application,
                instance=self.instance,
                token=self.token,
                mode="read",
            )
            try:
                sock.sendall(p.preamble(p.READ_VERSION) + p.encode(p.HELLO, hello))
            except OSError as exc:
                # With TLS 1.3 a publisher that wants a client certificate turns the reader
                # away after the handshake: the reset shows here, or at the first read.
                raise RemoteLogError(
                    f"publisher {self.address}: connection lost ({exc.strerror or exc})"
                    f"{self._tls_hint()}"
                ) from exc
            kind, _ = self._frame(sock)
            if kind != p.WELCOME:
                raise p.ProtocolError(f"expected welcome, got {p.NAMES.get(kind, kind)}")
        except BaseException:
            p.close_socket(sock)
            raise
        return sock

    def _tls_hint(self) -> str:
        if self.tls is None:
            return (
                "; if the publisher uses TLS (transport.tls), give option tls.ca (and tls.cert "
                "and tls.key where it asks for client certificates)"
            )
        return (
            "; check options tls.ca, tls.serverName and, where the publisher asks for client "
            "certificates (transport.tls.client_ca), tls.cert and tls.key"
        )

    def _frame(self, sock: socket.socket | ssl.SSLSocket) -> tuple[int, Any]:
        try:
            kind, body = p.read_frame(sock, 1 << 30)
        except (p.PeerClosed, TimeoutError, OSError, p.ProtocolError) as exc:
            raise RemoteLogError(
                f"publisher {self.address}: connection lost ({exc or type(exc).__name__})"
                f"{self._tls_hint()}"
            ) from exc
        if kind == p.REFUSE:
            reason = body.reason
            if "protocol version" in reason and "not supported" in reason:
                reason += (
                    f"; reading by range needs protocol version {p.READ_VERSION}: upgrade the "
                    f"publisher"
                )
            raise RemoteLogError(f"publisher {self.address} refused {self.application}: {reason}")
        return kind, body

    @contextlib.contextmanager
    def _session(self) -> Iterator[socket.socket | ssl.SSLSocket]:
        sock = self._connect()
        try:
            yield sock
            with contextlib.suppress(OSError):
                sock.sendall(p.encode(p.BYE, p.Bye(reason="done")))
        finally:
            p.close_socket(sock)

    def _request(self, kind: int, body: Any, answer: int) -> Any:
        with self._session() as sock:
            sock.sendall(p.encode(kind, body))
            got, reply = self._frame(sock)
            if got != answer:
                raise RemoteLogError(
                    f"publisher {self.address}: expected {p.NAMES[answer]}, got "
                    f"{p.NAMES.get(got, got)}"
                )
            return reply

    def positions(self) -> LogPositions:
        body: p.Positions = self._request(p.OFFSETS, p.Offsets(), p.POSITIONS)
        return LogPositions(
            first=body.first,
            end=body.end,
            datamarkers=dict(body.datamarkers),
            shards=body.shards,
            datastore=body.datastore,
        )

    def commit(self, datamarkers: dict[int, int]) -> dict[int, int]:
        body: p.Committed = self._request(p.COMMIT, p.Commit(datamarkers=datamarkers), p.COMMITTED)
        return dict(body.datamarkers)

    def read(self, shard: int, start: int, end: int) -> Iterator[tuple[list[int], list[Update]]]:
        for kind, body in self._range(shard, start, end, "rows"):
            if kind != p.BATCH:
                raise RemoteLogError(
                    f"publisher {self.address}: shard {shard}: a columns frame in a read of rows"
                )
            yield body.seqs, body.updates

    def read_columns(self, shard: int, start: int, end: int) -> Iterator[UpdateColumns]:
        for kind, body in self._range(shard, start, end, "columns"):
            # A publisher from before columns answers with rows: made columns here.
            yield body if kind == p.COLUMNS else columns_of(body.seqs, body.updates)

    def _range(self, shard: int, start: int, end: int, layout: str) -> Iterator[tuple[int, Any]]:
        """The frames of a read, checked: every update of the shard, in order, each once."""
        if start >= end:
            return
        with self._session() as sock:
            sock.sendall(p.encode(p.READ, p.Read(shard=shard, start=start, end=end, layout=layout)))
            count = 0
            last = start - 1
            while True:
                kind, body = self._read_frame(sock)
                if kind == p.BATCH:
                    seqs: Any = body.seqs
                    if len(seqs) != len(body.updates) or any(
                        u.shard != shard for u in body.updates
                    ):
                        raise RemoteLogError(
                            f"publisher {self.address}: shard {shard}: a batch of the range "
                            f"[{start}, {end}) does not match its seqs or shard"
                        )
                    rows = len(seqs)
                elif kind == p.COLUMNS:
                    head, body = body
                    if head.shard != shard:
                        raise RemoteLogError(
                            f"publisher {self.address}: shard {shard}: a columns frame of "
                            f"shard {head.shard} in the range [{start}, {end})"
                        )
                    seqs = body.seqs()
                    rows = body.rows
                elif kind == p.READ_END:
                    if body.updates != count:
                        raise RemoteLogError(
                            f"publisher {self.address}: shard {shard}: the range [{start}, "
                            f"{end}) held {body.updates} updates, {count} arrived"
                        )
                    return
                elif kind == p.HEARTBEAT:
                    continue
                else:
                    raise RemoteLogError(
                        f"publisher {self.address}: unexpected {p.NAMES.get(kind, kind)} frame "
                        f"during a read"
                    )
                if rows:
                    if not (
                        last < seqs[0]
                        and seqs[-1] < end
                        and all(a < b for a, b in itertools.pairwise(seqs))
                    ):
                        raise RemoteLogError(
                            f"publisher {self.address}: shard {shard}: seqs out of order "
                            f"in the range [{start}, {end})"
                        )
                    last = seqs[-1]
                    yield kind, body
                count += rows

    def _read_frame(self, sock: socket.socket | ssl.SSLSocket) -> tuple[int, Any]:
        started = time.monotonic()
        try:
            header = p.read_exactly(sock, 5)
        except (p.PeerClosed, TimeoutError, OSError) as exc:
            raise RemoteLogError(
                f"publisher {self.address}: connection lost during a read after "
                f"{time.monotonic() - started:.1f} s ({exc or type(exc).__name__})"
            ) from exc
        length, kind = p._LENGTH.unpack(header)
        if length < 1:
            raise RemoteLogError(f"publisher {self.address}: frame of length 0")
        try:
            payload = p.read_exactly(sock, length - 1) if length > 1 else b""
        except (p.PeerClosed, TimeoutError, OSError) as exc:
            raise RemoteLogError(
                f"publisher {self.address}: connection lost during a read ({exc})"
            ) from exc
        if kind == p.BATCH:
            try:
                return kind, _decode_read_batch(payload)
            except msgspec.DecodeError as exc:
                raise RemoteLogError(f"publisher {self.address}: malformed batch: {exc}") from exc
        if kind == p.COLUMNS:
            try:
                return kind, p.decode_columns(payload)
            except p.ProtocolError as exc:
                raise RemoteLogError(f"publisher {self.address}: {exc}") from exc
        if kind == p.REFUSE:
            refuse = msgspec.json.decode(payload, type=p.Refuse)
            raise RemoteLogError(
                f"publisher {self.address} refused the read of {self.application}: {refuse.reason}"
            )
        decoder = p._decoders.get(kind)
        if decoder is None and kind != p.HEARTBEAT:
            raise RemoteLogError(f"publisher {self.address}: unknown frame type {kind}")
        return kind, (decoder.decode(payload) if decoder is not None else None)


def open_remote_log(request: RemoteLogRequest) -> TcpRemoteLog:
    return TcpRemoteLog(request)


__all__ = ["ReaderSession", "TcpRemoteLog", "open_remote_log"]
