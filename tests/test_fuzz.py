"""Garbage frames and garbage pipeline files get a clear error, never a hang or a traceback.

Real processes and sockets throughout: a `wormhole publish` process takes garbage from raw
client sockets while a well-behaved subscriber goes on receiving; a `wormhole.Subscriber` (and a
`wormhole subscribe` process) takes garbage from a fake publisher socket; `wormhole validate`
reads random pipeline files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tcp_support import LibrarySubscriber, Process, tcp_pipeline

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp import server
from wormhole.connectors.tcp.client import Subscriber, SubscriberRefused
from wormhole.core.pipeline import load_pipeline
from wormhole.core.publisher import Publisher
from wormhole.publish import LogWriter
from wormhole.testing import free_port, wait_until

TOKEN = "s3cret"
SHARDS = 16
HEARTBEAT_MS = 100
HEARTBEAT_TIMEOUT_MS = 400
CLOSE_WITHIN = 3.0
"""Seconds a connection fed garbage may stay open: the longest timeout involved plus slack for a
loaded machine. A hang lasts until a test's own timeout."""

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # Enough for the suite's minute; set WORMHOLE_FUZZ_EXAMPLES=2000 for a longer hunt.
    max_examples=int(os.environ.get("WORMHOLE_FUZZ_EXAMPLES", "40")),
)


# ------------------------------------------------------------------ frame building
def frame(kind: int, body: bytes = b"") -> bytes:
    return struct.pack(">IB", len(body) + 1, kind) + body


def json_frame(kind: int, body: Any) -> bytes:
    return frame(kind, json.dumps(body).encode())


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hello(app: str = "a", token: str = TOKEN) -> bytes:
    body = {"version": 1, "application": app, "instance": "fuzz", "token": token}
    return p.preamble() + json_frame(p.HELLO, body)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
"""Any JSON value, with integers beyond 64 bits, NaN and infinities (written as JSON's
extensions, which a strict decoder refuses) and lone surrogates (escaped, refused too)."""

big_ints = st.integers(min_value=-(2**70), max_value=2**70)


def body_with(
    fields: dict[str, st.SearchStrategy[Any]], wrong: st.SearchStrategy[Any] = json_values
) -> st.SearchStrategy[dict[str, Any]]:
    """A frame body: every field of ``fields`` with a value of the right type (semantic edge
    cases), or some of them, each maybe ``wrong``, and maybe unknown keys."""
    mangled = st.builds(
        lambda extra, known: {**extra, **known},
        st.dictionaries(st.text(max_size=8), json_values, max_size=2),
        st.fixed_dictionaries({}, optional={k: v | wrong for k, v in fields.items()}),
    )
    return st.fixed_dictionaries(fields) | mangled


shard_maps = st.dictionaries(
    st.integers(-2, SHARDS + 2).map(str) | st.text(max_size=4), big_ints | json_values, max_size=4
)


def any_frame(bodies: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Frames that break the format itself, whoever sends them."""
    return st.one_of(
        st.builds(frame, st.integers(0, 255), bodies),
        # A length prefix announcing far more than the peer accepts, up to 4 GiB.
        st.builds(
            lambda length, kind: struct.pack(">IB", length, kind),
            st.integers(1 << 30, (1 << 32) - 1),
            st.integers(0, 255),
        ),
        st.just(struct.pack(">I", 0) + b"\x07"),  # length 0
        st.just(frame(p.HEARTBEAT, b"junk")),
        # JSON nested deeper than any decoder recurses.
        st.builds(
            lambda kind, depth: frame(
                kind, b'{"id":1,"datamarkers":{},"x":' + nested(depth) + b"}"
            ),
            st.sampled_from(list(p.NAMES)),
            st.integers(1_000, 30_000),
        ),
        st.binary(max_size=40),  # not a frame at all
    )


frame_bodies = st.one_of(
    st.binary(max_size=48), json_values.map(lambda v: json.dumps(v).encode()), st.just(b"{}")
)


def truncated(data: bytes, cut: int | None) -> bytes:
    return data if cut is None else data[: max(1, len(data) - cut)]


# ================================================================ the publisher side
hello_bodies = body_with(
    {
        "version": st.just(1) | big_ints,
        "application": st.sampled_from(["a", "b", "nope"]),
        "instance": st.text(max_size=12),
        "token": st.sampled_from([TOKEN, "", "guess"]),
        "credits": st.integers(-3, 2000) | big_ints,
    }
)

subscriber_frames = st.one_of(
    st.builds(
        json_frame,
        st.just(p.ACK),
        body_with({"id": big_ints, "datamarkers": shard_maps, "credits": big_ints}),
    ),
    st.builds(json_frame, st.just(p.NOTICE_ACK), body_with({"id": big_ints})),
    st.builds(json_frame, st.just(p.BYE), body_with({"reason": st.text(max_size=12)})),
    st.builds(json_frame, st.just(p.HELLO), hello_bodies),  # a second hello
    st.just(frame(p.HEARTBEAT)),
    any_frame(frame_bodies),
)


@st.composite
def client_garbage(draw: st.DrawFn) -> tuple[bytes, bool]:
    """What a broken client sends, and whether it then closes its sending side.

    Before a complete handshake it always does: a client that sends half a hello and waits is
    closed after the 10 s handshake deadline, which its own test checks.
    """
    opening = draw(st.sampled_from(["raw", "preamble", "hello", "session"]))
    cut = draw(st.none() | st.integers(1, 64))
    if opening == "raw":
        return draw(st.binary(min_size=1, max_size=96)), True
    frames = b"".join(draw(st.lists(subscriber_frames, max_size=5)))
    if opening == "preamble":
        version = draw(st.just(1) | st.integers(0, 65535))
        return truncated(p.PREAMBLE + struct.pack(">H", version) + frames, cut), True
    if opening == "hello":
        # Any first frame: a hello with wrong fields, an ack before any hello, garbage.
        first = draw(st.builds(json_frame, st.just(p.HELLO), hello_bodies) | subscriber_frames)
        return truncated(p.preamble() + first + frames, cut), True
    # A session (welcome sent) fed garbage; without the half-close it ends by heartbeat timeout.
    session = hello(draw(st.sampled_from(["a", "b"])))
    return session + truncated(frames, cut) if frames else session, draw(st.booleans())


def read_frames(data: bytes) -> list[tuple[int, Any]]:
    """The frames in ``data``: what a publisher sends must always be well formed."""
    frames = []
    offset = 0
    while offset < len(data):
        length, kind = struct.unpack_from(">IB", data, offset)
        body = data[offset + 5 : offset + 4 + length]
        assert len(body) == length - 1, f"publisher sent a torn frame: {data[offset:]!r}"
        frames.append((kind, None if kind == p.HEARTBEAT else json.loads(body)))
        offset += 4 + length
    return frames


def closed_by_peer(sock: socket.socket, within: float) -> bytes:
    """Everything the peer sent before it closed the connection; fails if it stays open."""
    deadline = time.monotonic() + within
    received = b""
    try:
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"connection still open after {within}s (got {received[:200]!r})"
            sock.settimeout(remaining)
            chunk = sock.recv(65536)
            if not chunk:
                return received
            received += chunk
    except ConnectionResetError:
        return received  # closed with our bytes unread: closed all the same
    except TimeoutError:
        raise AssertionError(f"connection still open after {within}s") from None
    finally:
        sock.close()


def peak_memory(pid: int) -> int:
    """The process's peak resident set, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


def write_riders(directory: Path, riders: int, start: int) -> None:
    with LogWriter(directory, publisher_id="gps", batch_size=2000) as writer:
        for rider in range(riders):
            writer.publish("rider_location", {"rider": rider}, {"rider": rider, "seq": start})


class PublisherUnderFire:
    """A `wormhole publish` process, and a well-behaved subscriber that must stay served."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        (tmp_path / "data").mkdir()
        pipeline = tcp_pipeline(
            tmp_path,
            self.port,
            {"a": {}, "b": {}},
            token=TOKEN,
            heartbeat_ms=HEARTBEAT_MS,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
        self.process = Process("publish", str(pipeline), cwd=tmp_path)
        self.good: LibrarySubscriber | None = None
        self.rounds = 0

    def start(self) -> None:
        wait_until(self._listening, 30, "the publisher to listen")
        self.good = LibrarySubscriber("a", self.port, token=TOKEN).start()
        self.deliver()
        self.baseline_memory = peak_memory(self.process.pid)

    def _listening(self) -> bool:
        assert self.process.proc.poll() is None, self.process.stderr
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        return False

    def deliver(self) -> None:
        """Publish one update per rider; the good subscriber must receive them all."""
        assert self.good is not None
        write_riders(self.tmp_path / "data" / "gps", 50, self.rounds)
        self.rounds += 1
        good = self.good

        def received() -> bool:
            with good.lock:
                seen = {(u.key["rider"], u.after_row()["seq"]) for u in good.updates}
            return all((r, self.rounds - 1) in seen for r in range(50))

        wait_until(received, 30, f"the good subscriber's updates of round {self.rounds}")
        assert good.error is None

    def send(self, data: bytes, half_close: bool) -> bytes:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        with contextlib.suppress(OSError):  # the publisher may close before it has read all
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        return closed_by_peer(sock, CLOSE_WITHIN)

    def check_clean(self) -> None:
        assert self.process.proc.poll() is None, f"publisher exited:\n{self.process.stderr}"
        assert "Traceback" not in self.process.stderr, self.process.stderr
        grown = peak_memory(self.process.pid) - self.baseline_memory
        assert grown < 64 << 20, f"publisher's peak memory grew by {grown:,} bytes"

    def stop(self) -> None:
        if self.good is not None:
            self.good.stop()
        self.process.stop()


@pytest.fixture(scope="module")
def publisher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PublisherUnderFire]:
    target = PublisherUnderFire(tmp_path_factory.mktemp("publisher"))
    try:
        target.start()
        yield target
    finally:
        target.stop()
    assert "Traceback" not in target.process.stderr, target.process.stderr


def test_garbage_from_clients_closes_their_connection_and_the_publisher_serves_on(
    publisher: PublisherUnderFire,
) -> None:
    @FUZZ
    @given(client_garbage())
    # Regression: JSON nested deeper than the decoder recurses, in a hello and after the
    # welcome, killed the connection's thread with a RecursionError traceback; the session
    # after the welcome then stayed open, its shards held, until the publisher stopped.
    @example((p.preamble() + frame(p.HELLO, b'{"x":' + nested(1100) + b"}"), True))
    @example(
        (hello() + frame(p.ACK, b'{"id":1,"datamarkers":{},"x":' + nested(1100) + b"}"), False)
    )
    def check(garbage: tuple[bytes, bool]) -> None:
        data, half_close = garbage
        replies = read_frames(publisher.send(data, half_close))
        # It answers a broken handshake with a refusal at most, and ends a broken session
        # with one (or a bye when it stops).
        kinds = [kind for kind, _ in replies]
        assert set(kinds) <= {p.WELCOME, p.REFUSE, p.NOTICE, p.BATCH, p.HEARTBEAT, p.BYE}
        if p.REFUSE in kinds:
            assert kinds.index(p.REFUSE) == len(kinds) - 1, "frames after a refuse"
            assert replies[-1][1]["reason"], "a refusal without a reason"
        publisher.check_clean()

    check()
    publisher.deliver()
    publisher.check_clean()


def test_nothing_follows_a_refuse_even_when_the_garbage_comes_with_the_hello(
    publisher: PublisherUnderFire,
) -> None:
    # Regression: the session's receiver wrote the refuse while its sender was writing the
    # first notice, so the notice could follow the refuse that should end the connection.
    for attempt in range(30):
        replies = read_frames(publisher.send(hello("b") + frame(214, b"x"), half_close=False))
        kinds = [kind for kind, _ in replies]
        assert kinds[-1] == p.REFUSE, f"attempt {attempt}: {kinds} (a frame after the refuse)"
        assert replies[-1][1]["reason"] == "unknown frame type 214"


def test_a_handshake_that_trickles_in_is_closed_at_the_handshake_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: the deadline was a timeout per read, so a client sending a byte every few
    # seconds held its connection (and a thread) for as long as it liked. In process, with a
    # short deadline, to keep the test quick.
    monkeypatch.setattr(server, "HANDSHAKE_TIMEOUT", 1.0)
    port = free_port()
    (tmp_path / "data").mkdir()
    pipeline = load_pipeline(tcp_pipeline(tmp_path, port, {"a": {}}))
    publisher = Publisher(pipeline, local_subscribers=False)
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: (tmp_path / "state" / server.ADDRESS_FILE).exists(), 30, "listening")
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for byte in hello():
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
                if time.monotonic() - started > 4:
                    break
        closed_by_peer(sock, max(0.1, 2.0 - (time.monotonic() - started)))
    finally:
        publisher.request_stop()
        thread.join(30)
    assert not thread.is_alive()


# =============================================================== the subscriber side
SUBSCRIBER_TIMEOUT_MS = 300

not_ints = json_values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))


def welcome(heartbeat_ms: int = HEARTBEAT_MS) -> bytes:
    body = {
        "version": 1,
        "publisher": "fake:1",
        "pipeline": "fuzz",
        "shards": SHARDS,
        "heartbeat_ms": heartbeat_ms,
    }
    return json_frame(p.WELCOME, body)


def notice_all() -> bytes:
    body = {"id": 1, "assigned": list(range(SHARDS)), "revoked": [], "datamarkers": {}}
    return json_frame(p.NOTICE, body)


welcome_bodies = body_with(
    {
        "version": st.just(1) | big_ints,
        "publisher": st.text(max_size=12),
        "pipeline": st.text(max_size=12),
        "shards": st.integers(-1, SHARDS) | big_ints,
        # Only intervals out of range or of the wrong type: a subscriber rightly waits three
        # intervals of silence before it calls a publisher gone.
        "heartbeat_ms": st.integers(max_value=0) | st.integers(min_value=p.MAX_HEARTBEAT_MS + 1),
    },
    wrong=not_ints,
)
shard_lists = st.lists(st.integers(-2, SHARDS + 2) | big_ints, max_size=5)
update_bodies = body_with(
    {
        "op": st.sampled_from(["c", "u", "d", "r", "t"]) | st.text(max_size=2),
        "key": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
        "before": json_values,
        "after": json_values,
        "table": st.text(max_size=8),
        "shard": st.integers(0, SHARDS - 1) | big_ints,
        "position": st.text(max_size=8),
        "txid": big_ints | st.none(),
        "ts_ms": big_ints | st.none(),
    }
)
publisher_frames = st.one_of(
    st.builds(json_frame, st.just(p.WELCOME), welcome_bodies),
    st.builds(
        json_frame,
        st.just(p.REFUSE),
        body_with({"reason": st.text(max_size=12), "fatal": st.booleans()}),
    ),
    st.builds(
        json_frame,
        st.just(p.NOTICE),
        body_with(
            {
                "id": big_ints,
                "assigned": shard_lists,
                "revoked": shard_lists,
                "datamarkers": shard_maps,
            }
        ),
    ),
    st.builds(
        json_frame,
        st.just(p.BATCH),
        body_with(
            {
                "id": big_ints,
                "first": big_ints,
                "end": big_ints,
                "appended_ns": big_ints,
                "datamarkers": shard_maps,
                "updates": st.lists(update_bodies, max_size=3),
            }
        ),
    ),
    st.builds(json_frame, st.just(p.BYE), body_with({"reason": st.text(max_size=12)})),
    st.just(frame(p.HEARTBEAT)),
    any_frame(frame_bodies),
)


@st.composite
def publisher_garbage(draw: st.DrawFn) -> bytes:
    """What a broken publisher sends a subscriber that has just said hello."""
    opening = draw(st.sampled_from(["raw", "welcome", "session"]))
    prefix = {"raw": b"", "welcome": welcome(), "session": welcome() + notice_all()}[opening]
    frames = b"".join(draw(st.lists(publisher_frames, min_size=1, max_size=5)))
    return prefix + truncated(frames, draw(st.none() | st.integers(1, 64)))


class FakePublisher:
    """A listening socket that feeds garbage to a `wormhole.Subscriber` run in a thread.

    Tracebacks (an uncaught exception in any thread, a log record with one) are collected,
    and so is how each subscriber ended; a refused one is replaced by a new one.
    """

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.tracebacks: list[str] = []
        self.ended: list[BaseException] = []
        self.thread: threading.Thread | None = None
        self.subscriber: Subscriber | None = None
        self._excepthook = threading.excepthook
        threading.excepthook = self._uncaught
        self._handler = _TracebackHandler(self.tracebacks)
        logging.getLogger().addHandler(self._handler)

    def _uncaught(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread else "?"
        self.tracebacks.append(f"thread {name}: {args.exc_type.__name__}: {args.exc_value}")
        self._excepthook(args)

    def _run(self, subscriber: Subscriber) -> None:
        try:
            subscriber.run()
        except BaseException as exc:
            self.ended.append(exc)

    def connection(self) -> socket.socket:
        """The subscriber's next connection, its preamble and hello read."""
        if self.thread is None or not self.thread.is_alive():
            if self.thread is not None:
                self.thread.join()
            self.subscriber = Subscriber(
                "a",
                [self.address],
                instance="fuzz",
                heartbeat_ms=HEARTBEAT_MS,
                heartbeat_timeout_ms=SUBSCRIBER_TIMEOUT_MS,
                max_backoff=0.05,
            )
            self.subscriber.on_updates(lambda flow, updates: None)
            self.thread = threading.Thread(target=self._run, args=(self.subscriber,), daemon=True)
            self.thread.start()
        while True:
            conn, _ = self.listener.accept()
            conn.settimeout(5)
            try:
                assert p.read_preamble(conn) == p.VERSION
                kind, body = p.read_frame(conn, 1 << 16)
            except (OSError, p.PeerClosed):
                conn.close()  # it gave up on an earlier attempt meanwhile
                continue
            assert kind == p.HELLO and body.application == "a"
            return conn

    def check_clean(self) -> None:
        assert not self.tracebacks, self.tracebacks
        for exc in self.ended:
            # The only way a reconnecting subscriber stops: a refusal the publisher calls fatal.
            assert isinstance(exc, SubscriberRefused), f"{type(exc).__name__}: {exc}"
            assert "refused a:" in str(exc)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.stop()
        if self.thread is not None:
            self.thread.join(10)
        self.listener.close()
        threading.excepthook = self._excepthook
        logging.getLogger().removeHandler(self._handler)


class _TracebackHandler(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.into.append(f"logged with a traceback: {record.getMessage()}")


@pytest.fixture(scope="module")
def fake_publisher() -> Iterator[FakePublisher]:
    fake = FakePublisher()
    try:
        yield fake
    finally:
        fake.close()
    fake.check_clean()


def test_garbage_from_a_publisher_makes_the_subscriber_reconnect_or_stop_with_a_clear_error(
    fake_publisher: FakePublisher,
) -> None:
    @FUZZ
    @given(publisher_garbage())
    # Regression: a first frame other than welcome or refuse left the connection open as long
    # as anything (a log handler keeping the warning's exception, say) held the traceback.
    @example(frame(p.HEARTBEAT))
    # Regression: a welcome's heartbeat_ms of 0 made the subscriber send heartbeats in a busy
    # loop; a huge one made it wait hours for silence (past 9e12, a traceback in its reader
    # thread and a hang: the timeout did not fit a socket's).
    @example(welcome(heartbeat_ms=0))
    @example(welcome(heartbeat_ms=p.MAX_HEARTBEAT_MS + 1))
    @example(welcome(heartbeat_ms=10**13))
    def check(garbage: bytes) -> None:
        conn = fake_publisher.connection()
        with contextlib.suppress(OSError):
            conn.sendall(garbage)
        # Then silence: whatever it made of the garbage, the subscriber lets go of this
        # connection within its heartbeat timeout, and does not flood it meanwhile.
        sent = closed_by_peer(conn, CLOSE_WITHIN)
        assert len(sent) < 16 << 10, f"the subscriber sent {len(sent):,} bytes"
        kinds = {kind for kind, _ in read_frames(sent)}
        assert kinds <= {p.ACK, p.NOTICE_ACK, p.HEARTBEAT, p.BYE}
        fake_publisher.check_clean()

    check()
