"""The Wormhole subscriber protocol, versions 1 and 2 (documented in docs/protocol.md).

A connection opens with a preamble from the subscriber, ``b"WORMHOLE"`` and the
protocol version as u16 big-endian, then carries frames both ways::

    frame := length u32 BE   type u8   body (length - 1 bytes)

Bodies are JSON (msgspec); update rows inside batches are the rows' raw JSON. The one
exception is ``columns`` (a log reader's range, a column at a time): a JSON head and then
binary buffers.

Version 2 adds log readers: a ``hello`` with ``mode: "read"`` opens a session that asks
for an external application's positions, reads one flow's range ``[from, to)`` and
commits datamarkers (frames 10 to 16). Subscriptions are the same in both versions, so
subscribers still say 1 and work with publishers of either.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import time
from typing import Annotated, Any

import msgspec

from wormhole.core.update import Update, UpdateColumns

PREAMBLE = b"WORMHOLE"
VERSION = 2
"""The newest protocol version this side speaks (registered with a publisher's address)."""
SUBSCRIBE_VERSION = 1
"""What subscribers say: nothing they use changed after version 1."""
VERSIONS = (1, 2)
READ_VERSION = 2
"""The first version with log readers (``hello.mode: "read"``)."""
_PREAMBLE_SIZE = len(PREAMBLE) + 2
_LENGTH = struct.Struct(">IB")
MAX_HEARTBEAT_MS = 3_600_000
"""The longest heartbeat interval (``transport.heartbeat_ms``, ``welcome.heartbeat_ms``)."""

HELLO = 1
WELCOME = 2
REFUSE = 3
NOTICE = 4
NOTICE_ACK = 5
BATCH = 6
ACK = 7
HEARTBEAT = 8
BYE = 9
OFFSETS = 10
POSITIONS = 11
READ = 12
READ_END = 13
COMMIT = 14
COMMITTED = 15
COLUMNS = 16

NAMES = {
    HELLO: "hello",
    WELCOME: "welcome",
    REFUSE: "refuse",
    NOTICE: "notice",
    NOTICE_ACK: "notice-ack",
    BATCH: "batch",
    ACK: "ack",
    HEARTBEAT: "heartbeat",
    BYE: "bye",
    OFFSETS: "offsets",
    POSITIONS: "positions",
    READ: "read",
    READ_END: "read-end",
    COMMIT: "commit",
    COMMITTED: "committed",
    COLUMNS: "columns",
}


class Hello(msgspec.Struct, kw_only=True):
    version: int
    application: str
    instance: str
    token: str = ""
    credits: int = 8
    mode: str = "subscribe"
    """``subscribe`` (version 1 and up), or ``read``: a log reader (version 2)."""


class Welcome(msgspec.Struct, kw_only=True):
    version: int
    publisher: str
    pipeline: str
    shards: int
    # Out of range, a subscriber would beat in a busy loop (0) or wait forever for silence.
    heartbeat_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEARTBEAT_MS)]
    datastore: str = ""
    """The publisher's part of the dataset (the pipeline file's ``datastore``)."""


class Refuse(msgspec.Struct, kw_only=True):
    reason: str
    fatal: bool = True


class Notice(msgspec.Struct, kw_only=True):
    id: int
    assigned: list[int]
    revoked: list[int]
    datamarkers: dict[int, int] = {}
    epoch: int = 0
    """The fencing epoch the publisher serves the application under (multiple-copy)."""


class NoticeAck(msgspec.Struct, kw_only=True):
    id: int


class BatchFrame(msgspec.Struct, kw_only=True):
    id: int
    first: int
    end: int
    appended_ns: int
    """CLOCK_MONOTONIC time the batch reached the publisher log (latency measurement)."""
    datamarkers: dict[int, int]
    updates: list[Update]


class _EncodedBatchFrame(msgspec.Struct, kw_only=True):
    """A ``BatchFrame`` whose updates are already encoded (for splitting one)."""

    id: int
    first: int
    end: int
    appended_ns: int
    datamarkers: dict[int, int]
    updates: list[msgspec.Raw]


class Ack(msgspec.Struct, kw_only=True):
    id: int
    datamarkers: dict[int, int]
    credits: int = 1


class Bye(msgspec.Struct, kw_only=True):
    reason: str = ""


class Offsets(msgspec.Struct, kw_only=True):
    """A log reader asks for the positions of its application."""


class Positions(msgspec.Struct, kw_only=True):
    first: int
    """The oldest retained seq of the publisher log."""
    end: int
    """The seq after the last update in the log."""
    datamarkers: dict[int, int]
    """The application's stored datamarkers, by shard."""
    shards: int
    datastore: str = ""


LAYOUTS = ("rows", "columns")


class Read(msgspec.Struct, kw_only=True):
    shard: int
    start: int = msgspec.field(name="from")
    end: int = msgspec.field(name="to")
    layout: str = "rows"
    """``rows``: ``batch`` frames; ``columns``: ``columns`` frames. A publisher that does not
    know the field answers with ``batch`` frames, which a reader must take as well."""


class ReadBatch(msgspec.Struct, kw_only=True):
    """A ``batch`` frame of a read: ``seqs[i]`` is the publisher-log seq of ``updates[i]``."""

    id: int
    first: int
    end: int
    appended_ns: int = 0
    datamarkers: dict[int, int] = {}
    seqs: list[int]
    updates: list[Update]


class ColumnsHead(msgspec.Struct, kw_only=True):
    """The JSON head of a ``columns`` frame: the buffers' sizes, in their order."""

    shard: int
    first: int
    end: int
    rows: int
    buffers: list[int]


class ReadEnd(msgspec.Struct, kw_only=True):
    shard: int
    start: int = msgspec.field(name="from")
    end: int = msgspec.field(name="to")
    updates: int
    """How many updates of the shard the range held (the ``batch`` frames sent for it)."""


class Commit(msgspec.Struct, kw_only=True):
    datamarkers: dict[int, int]


class Committed(msgspec.Struct, kw_only=True):
    datamarkers: dict[int, int]
    """The application's datamarkers once stored (a datamarker never moves back)."""


BODY_TYPES: dict[int, type[Any]] = {
    HELLO: Hello,
    WELCOME: Welcome,
    REFUSE: Refuse,
    NOTICE: Notice,
    NOTICE_ACK: NoticeAck,
    BATCH: BatchFrame,
    ACK: Ack,
    BYE: Bye,
    OFFSETS: Offsets,
    POSITIONS: Positions,
    READ: Read,
    READ_END: ReadEnd,
    COMMIT: Commit,
    COMMITTED: Committed,
}
_decoders = {kind: msgspec.json.Decoder(t) for kind, t in BODY_TYPES.items()}
_encode = msgspec.json.Encoder().encode


class ProtocolError(Exception):
    """The peer broke the protocol: close the connection with this reason."""


class PeerClosed(Exception):
    """The peer closed the connection."""


def encode(kind: int, body: Any = None) -> bytes:
    payload = b"" if body is None else _encode(body)
    return _LENGTH.pack(len(payload) + 1, kind) + payload


def encode_batches(
    first_id: int,
    first: int,
    end: int,
    appended_ns: int,
    datamarkers: dict[int, int],
    updates: list[Update],
    limit: int,
) -> list[tuple[bytes, int]]:
    """One publisher-log batch as ``batch`` frames of at most ``limit`` bytes each:
    ``(frame, number of updates)`` with ids from ``first_id`` on.

    A batch that fits is one frame. A larger one is cut between updates, every piece
    with the batch's ``first``, ``end`` and ``appended_ns``; only the last piece
    carries ``datamarkers``, since a flow reaches them only once all of it is
    processed. An update larger than ``limit`` on its own goes in a frame of its own.
    """
    whole = encode(
        BATCH,
        BatchFrame(
            id=first_id,
            first=first,
            end=end,
            appended_ns=appended_ns,
            datamarkers=datamarkers,
            updates=updates,
        ),
    )
    if len(whole) <= limit or len(updates) < 2:
        return [(whole, len(updates))]

    def piece(frame_id: int, marks: dict[int, int], raws: list[msgspec.Raw]) -> bytes:
        return encode(
            BATCH,
            _EncodedBatchFrame(
                id=frame_id,
                first=first,
                end=end,
                appended_ns=appended_ns,
                datamarkers=marks,
                updates=raws,
            ),
        )

    # Bytes around the updates, at most: the largest id any piece can get, datamarkers.
    overhead = len(piece(first_id + len(updates), datamarkers, []))
    groups: list[list[msgspec.Raw]] = [[]]
    size = overhead
    for update in updates:
        raw = msgspec.Raw(_encode(update))
        if groups[-1] and size + len(raw) + 1 > limit:
            groups.append([])
            size = overhead
        groups[-1].append(raw)
        size += len(raw) + 1  # and a comma
    last = len(groups) - 1
    return [
        (piece(first_id + i, datamarkers if i == last else {}, raws), len(raws))
        for i, raws in enumerate(groups)
    ]


_HEAD_SIZE = struct.Struct(">I")
_decode_columns_head = msgspec.json.Decoder(ColumnsHead).decode


def encode_columns(shard: int, first: int, end: int, columns: UpdateColumns) -> bytes:
    """A ``columns`` frame: head length (u32 BE), the JSON head, then the buffers."""
    buffers = columns.buffers()
    head = _encode(
        ColumnsHead(
            shard=shard,
            first=first,
            end=end,
            rows=columns.rows,
            buffers=[len(b) for b in buffers],
        )
    )
    size = _HEAD_SIZE.size + len(head) + sum(len(b) for b in buffers)
    return b"".join([_LENGTH.pack(size + 1, COLUMNS), _HEAD_SIZE.pack(len(head)), head, *buffers])


def decode_columns(payload: bytes) -> tuple[ColumnsHead, UpdateColumns]:
    """A ``columns`` frame's body; ProtocolError when it does not hold together."""
    view = memoryview(payload)
    try:
        (size,) = _HEAD_SIZE.unpack_from(view, 0)
        start = _HEAD_SIZE.size + size
        if start > len(view):
            raise ValueError("the head is longer than the frame")
        head = _decode_columns_head(view[_HEAD_SIZE.size : start])
        if sum(head.buffers) != len(view) - start or min(head.buffers, default=0) < 0:
            raise ValueError("the buffers do not add up to the frame")
        buffers: list[bytes | memoryview] = []
        for length in head.buffers:
            buffers.append(view[start : start + length])
            start += length
        return head, UpdateColumns.from_buffers(head.rows, buffers)
    except (struct.error, msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed columns frame: {exc}") from None


def preamble(version: int = SUBSCRIBE_VERSION) -> bytes:
    return PREAMBLE + struct.pack(">H", version)


def read_exactly(
    sock: socket.socket | ssl.SSLSocket, n: int, deadline: float | None = None
) -> bytes:
    """``n`` bytes; with a ``deadline`` (``time.monotonic()``), TimeoutError once it passes,
    however the bytes trickle in (the socket's own timeout is per read)."""
    chunks = []
    while n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise PeerClosed("connection closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_preamble(sock: socket.socket | ssl.SSLSocket, deadline: float | None = None) -> int:
    """The subscriber's protocol version; ProtocolError if this is not a Wormhole client."""
    data = read_exactly(sock, _PREAMBLE_SIZE, deadline)
    if data[: len(PREAMBLE)] != PREAMBLE:
        raise ProtocolError(f"not a Wormhole subscriber (first bytes {data[:8]!r})")
    version: int = struct.unpack(">H", data[len(PREAMBLE) :])[0]
    return version


def read_frame(
    sock: socket.socket | ssl.SSLSocket, max_frame: int, deadline: float | None = None
) -> tuple[int, Any]:
    """One frame: (type, decoded body or None)."""
    header = read_exactly(sock, _LENGTH.size, deadline)
    length, kind = _LENGTH.unpack(header)
    if length < 1:
        raise ProtocolError("frame of length 0")
    if length > max_frame:
        raise ProtocolError(f"oversize frame: {length} bytes (limit {max_frame})")
    body = read_exactly(sock, length - 1, deadline) if length > 1 else b""
    if kind == HEARTBEAT:
        return kind, None
    decoder = _decoders.get(kind)
    if decoder is None:
        raise ProtocolError(f"unknown frame type {kind}")
    try:
        return kind, decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {NAMES[kind]} frame: {exc}") from exc
    except RecursionError:
        # The decoder recurses once per level of JSON nesting.
        raise ProtocolError(f"malformed {NAMES[kind]} frame: JSON nested too deeply") from None


# One TLS record: an SSL socket's write waits for the whole of what it is given under
# one deadline, so it is fed a record at a time for the timeout to mean "no progress".
_TLS_CHUNK = 16 * 1024


def send_all(sock: socket.socket | ssl.SSLSocket, data: bytes) -> None:
    """Send all of ``data``; TimeoutError only if the peer takes no byte for the
    socket's timeout.

    ``sendall`` would bound the whole write by the timeout instead, so a large frame on a
    slow but working link would fail, and fail again each time it is sent.
    """
    view = memoryview(data)
    chunk = _TLS_CHUNK if isinstance(sock, ssl.SSLSocket) else len(view)
    while view:
        sent = sock.send(view[:chunk])
        view = view[sent:]


def close_socket(sock: socket.socket | ssl.SSLSocket) -> None:
    """Shut a connection down both ways (the peer sees EOF) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) to a tuple; ValueError with a clear message."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)
