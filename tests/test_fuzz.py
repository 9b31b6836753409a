"""Garbage frames and garbage pipeline files get a clear error, never a hang or a traceback.

Real processes and sockets throughout: a `wormhole publish` process takes garbage from raw
client sockets while a well-behaved subscriber goes on receiving; a `wormhole.Subscriber` (and a
`wormhole subscribe` process) takes garbage from a fake publisher socket; `wormhole validate`
reads random pipeline files.
"""

from __future__ import annotations

import contextlib
import io
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
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from tcp_support import LibrarySubscriber, Process, tcp_pipeline

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp import server
from wormhole.connectors.tcp.client import Subscriber, SubscriberRefused
from wormhole.core.pipeline import load_pipeline
from wormhole.core.publisher import Publisher
from wormhole.publish import LogWriter
from wormhole.testing import free_port, run_cli, wait_until

TOKEN = "s3cret"
SHARDS = 16
HEARTBEAT_MS = 100
HEARTBEAT_TIMEOUT_MS = 400
CLOSE_WITHIN = 3.0
"""Seconds a connection fed garbage may stay open: the longest timeout involved plus slack for a
loaded machine. Longer counts as a hang."""

FUZZ = settings(
    deadline=None,
    # Explaining a failure traces every line it runs: far too slow around processes.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
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
    | st.text(st.characters(exclude_categories=()), max_size=12),
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
    """The frames in ``data``, which must be well formed whatever the other side sent."""
    frames = []
    offset = 0
    while offset < len(data):
        length, kind = struct.unpack_from(">IB", data, offset)
        body = data[offset + 5 : offset + 4 + length]
        assert len(body) == length - 1, f"a torn frame: {data[offset:]!r}"
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

    def _ensure_subscriber(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            return
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

    def connection(self) -> socket.socket:
        """The subscriber's next connection, its preamble and hello read."""
        deadline = time.monotonic() + 10
        while True:
            # A refused subscriber may still be on its way out: look again while waiting.
            self._ensure_subscriber()
            self.listener.settimeout(0.2)
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                assert time.monotonic() < deadline, "the subscriber did not connect again"
                continue
            conn.settimeout(5)
            try:
                assert p.read_preamble(conn) == p.SUBSCRIBE_VERSION
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
            assert str(exc).startswith(f"publisher {self.address}"), str(exc)

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


# ================================================================= pipeline files
MINIMAL_PIPELINE = "pipeline: x\nsource: {type: filelog, path: data}\napplications: {a: {}}\n"
ENV = {"FUZZ_SET": "16", "FUZZ_EMPTY": "", "FUZZ_TEXT": "a b:{c}"}
"""Set while `wormhole validate` runs; FUZZ_UNSET is never set."""

odd_strings = st.sampled_from(
    [
        "",
        "~",
        "null",
        "1GiB",
        "64MB",
        "-1",
        "0x10",
        "1e400",
        "nan",
        "127.0.0.1:0",
        "[::1]:7070",
        "host:",
        "earliest",
        "latest",
        "2026-11-22T10:00:00Z",
        "2026-13-45",
        "a\x00b",
        "../../etc",
        "{application}-{subscriber}",
    ]
)
interpolations = st.sampled_from(
    [
        "${FUZZ_SET}",
        "${FUZZ_UNSET}",
        "${FUZZ_EMPTY}",
        "${FUZZ_EMPTY:-8}",
        "${FUZZ_UNSET:-}",
        "${FUZZ_TEXT}",
        "$$",
        "$${FUZZ_SET}",
        "${",
        "${}",
        "${1BAD}",
        "${FUZZ_UNSET:-${FUZZ_SET}}",
        "$",
        "${FUZZ_SET",
    ]
)
yaml_text = st.builds(
    "".join, st.lists(st.text(max_size=6) | interpolations | odd_strings, max_size=3)
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | yaml_text
)
yaml_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.integers() | st.none(), inner, max_size=3)
    ),
    max_leaves=6,
)
names = st.sampled_from(["orders", "a", "b.c-d_1", "9", "-bad", "has space", ""]) | yaml_text


def _registry() -> Any:
    from wormhole.plugins.manager import default_registry

    return default_registry()


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` 19 times in 20, anything the 20th: files with a problem or two reach deeper
    into validation than files with nothing right."""
    return st.integers(0, 19).flatmap(lambda i: yaml_values if i == 19 else valid)


def _option_value(field: Any) -> st.SearchStrategy[Any]:
    from pydantic_core import PydanticUndefined, to_jsonable_python

    default = field.get_default(call_default_factory=True)
    plausible = (
        st.just(json.loads(json.dumps(to_jsonable_python(default))))
        if default is not PydanticUndefined
        else yaml_text
    )
    return mostly(plausible) | odd_strings


@st.composite
def components(draw: st.DrawFn, kind: str) -> Any:
    """A component of ``kind``: a real type with some of its real options (mostly their
    defaults), sometimes a wrong type, a missing type, or not a mapping at all."""
    registered = _registry().components[kind]
    type_name = draw(mostly(st.sampled_from(sorted(registered))))
    options: dict[str, Any] = {"type": type_name}
    spec = registered.get(type_name) if isinstance(type_name, str) else None
    fields = spec.spec.options.model_fields if spec is not None else {}
    for option, field in fields.items():
        if field.is_required() or draw(st.integers(0, 3)) == 3:
            options[option] = draw(_option_value(field))
    if draw(st.integers(0, 9)) == 9:
        options.update(draw(st.dictionaries(st.text(max_size=6), yaml_values, max_size=1)))
    if draw(st.integers(0, 19)) == 19:
        options.pop("type", None)
    return options


where_texts = st.one_of(
    st.text(alphabet="()'\"`=<>!,%_ aAndotrisulk0123.-", max_size=30),
    st.sampled_from(
        ["status = 'active' and amount > 100", "a in (1, 2", "not not a is null", "'unterminated"]
    ),
    # Nesting as deep as the parser recurses, and deeper.
    st.builds(lambda n: "(" * n + "a = 1" + ")" * n, st.integers(50, 2000)),
    st.builds(lambda n: "not " * n + "a = 1", st.integers(50, 2000)),
)


def mapping(
    fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...] = ()
) -> st.SearchStrategy[Any]:
    """Some of ``fields`` (all of ``required``), mostly with their own values; rarely an
    unknown key or not a mapping at all."""
    known = st.fixed_dictionaries(
        {k: mostly(v) for k, v in fields.items() if k in required},
        optional={k: mostly(v) for k, v in fields.items() if k not in required},
    )
    extra = st.integers(0, 9).flatmap(
        lambda i: (
            st.dictionaries(st.text(max_size=6), yaml_values, max_size=1) if i == 9 else st.just({})
        )
    )
    return mostly(st.builds(lambda e, k: {**e, **k}, extra, known))


good_names = st.sampled_from(["orders", "a", "b.c-d_1", "9"])
applications = mapping(
    {
        "start": st.sampled_from(["earliest", "latest"])
        | st.builds(lambda v: {"position": v}, st.integers(-1, 2**64) | scalars)
        | st.builds(lambda v: {"time": v}, st.integers(-1, 2**64) | scalars | odd_strings),
        "filter": mapping(
            {
                "tables": st.lists(yaml_text),
                "ops": st.lists(st.sampled_from(["c", "u", "d", "r", "t", "x"])),
                "plugins": st.lists(components("filter"), max_size=2),
                "where": where_texts | st.dictionaries(yaml_text, where_texts, max_size=2),
                "columns": st.lists(yaml_text) | st.dictionaries(yaml_text, st.lists(yaml_text)),
            }
        ),
        "sink": components("sink"),
        "subscribers": st.integers(-1, 2000),
        "external": st.booleans(),
    }
)
pipelines = mapping(
    {
        "pipeline": mostly(good_names),
        "state_dir": yaml_text,
        "dataset": mapping({"shards": st.integers(-1, 70000) | yaml_text}),
        "source": components("source"),
        "transport": components("transport"),
        "delivery": mapping(
            {
                "mode": st.sampled_from(["single-copy", "multiple-copy", "other"]),
                "datamarker_interval_ms": st.integers(-1, 2**64),
                "store": components("datamarker_store"),
                "max_caravans": st.integers(-1, 2000),
                "merge_distance": st.integers(-1, 2**64),
                "slow_flow_ms": st.integers(-1, 2**64),
            }
        ),
        "log": mapping(
            {
                "roll_size": st.integers(-1, 2**64) | odd_strings,
                "fsync": st.booleans(),
                "keep_rolled": st.integers(-1, 2**64),
                "tail_updates": st.integers(-1, 2**64),
            }
        ),
        "applications": st.dictionaries(good_names | names, applications, min_size=1, max_size=3),
    },
    required=("pipeline", "source", "applications"),
)


def _dump(document: Any) -> str:
    import yaml

    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True)


def laughs(levels: int, width: int) -> str:
    """Anchors whose aliases expand to ``width ** levels`` values."""
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


alias_files = st.one_of(
    # A value inside itself: a mapping, a list, or deeper down.
    st.sampled_from(
        [
            MINIMAL_PIPELINE + "dataset: &d {shards: *d}\n",
            MINIMAL_PIPELINE.replace("{a: {}}", "&apps {a: *apps}"),
            "&root [*root]\n",
            "pipeline: x\nsource: &s {type: filelog, path: [*s]}\napplications: {a: {}}\n",
        ]
    ),
    st.builds(lambda n: "a: " + "[" * n + "]" * n + "\n", st.integers(50, 1500)),
    st.builds(lambda n: "".join(f"{'  ' * i}k{i}:\n" for i in range(n)), st.integers(50, 400)),
    st.builds(laughs, st.integers(2, 9), st.integers(2, 10)).map(lambda t: MINIMAL_PIPELINE + t),
)


@st.composite
def pipeline_files(draw: st.DrawFn) -> bytes:
    """The bytes of a pipeline file: random structure under the real keys, then maybe mangled
    as text (malformed YAML) or as bytes (not UTF-8)."""
    how = draw(st.sampled_from(["yaml", "yaml", "yaml", "edited", "text", "bytes", "aliases"]))
    if how == "text":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    if how == "aliases":
        return draw(alias_files).encode()
    text = _dump(draw(pipelines))
    if how == "edited":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(text)))
            cut = draw(st.integers(0, 8))
            text = (
                text[:at]
                + draw(
                    st.sampled_from(
                        [
                            "",
                            ":",
                            "- ",
                            "{",
                            "[",
                            "'",
                            '"',
                            "\t",
                            "&a ",
                            "*a",
                            "!!python/object ",
                            "\n  ",
                            "${",
                        ]
                    )
                )
                + text[at + cut :]
            )
    data = text.encode("utf-8", "surrogatepass")
    if how == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return data


def where_app(where: str) -> str:
    return "{a: {filter: {where: '" + where + "'}}}"


def validate(path: Path) -> tuple[int, str, str]:
    """`wormhole validate PATH` in process: exit code, stdout, stderr."""
    from wormhole.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", str(path)])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def pipeline_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in [*ENV, "FUZZ_UNSET", "WORMHOLE_LOG_LEVEL"]}
    os.environ.update(ENV)
    os.environ.pop("FUZZ_UNSET", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_validate_exits_0_or_2_on_any_pipeline_file_and_names_the_problem(
    pipeline_env: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("pipelines") / "fuzz.yml"

    @settings(FUZZ, max_examples=FUZZ.max_examples * 10)
    @given(pipeline_files())
    # Regressions, each a RecursionError traceback and exit 1: a value inside itself through a
    # YAML alias; YAML nested deeper than its parser recurses; a where nested deeper than its.
    @example((MINIMAL_PIPELINE + "dataset: &d {shards: *d}\n").encode())
    @example(b"a: " + b"[" * 1000 + b"]" * 1000)
    @example(
        MINIMAL_PIPELINE.replace("{a: {}}", where_app("(" * 400 + "a = 1" + ")" * 400)).encode()
    )
    @example(MINIMAL_PIPELINE.replace("{a: {}}", where_app("not " * 400 + "a = 1")).encode())
    # Regression: an AssertionError traceback for an option error under an application whose
    # name holds a line break.
    @example(
        MINIMAL_PIPELINE.replace(
            "{a: {}}", '{"a\\nb": {sink: {type: jsonl, path: x, y: 1}}}'
        ).encode()
    )
    def check(data: bytes) -> None:
        path.write_bytes(data)
        started = time.monotonic()
        code, out, err = validate(path)
        # Generous for a loaded machine: a hang (aliases expanding to 10**9 values) is far longer.
        assert time.monotonic() - started < 20, "validate took more than 20 s"
        event(f"exit {code}")
        assert code in (0, 2), f"exit {code}\n{err}"
        assert "Traceback" not in err
        if code == 0:
            assert out.startswith(f"{path}: valid.")
        else:
            assert str(path) in err, err

    check()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            (MINIMAL_PIPELINE + "# caf\xe9\n").encode("latin-1"),
            "cannot read",
            id="not-utf-8",
        ),
        pytest.param(b"pipeline: [x\nsource: {", "malformed YAML: line", id="malformed-yaml"),
        # Regression: ten aliases of ten aliases, nine levels deep, expanded to 10**9 values
        # and never finished.
        pytest.param(
            (MINIMAL_PIPELINE + laughs(9, 10)).encode(),
            "more than 100,000 values once YAML aliases are expanded",
            id="aliases-of-aliases",
        ),
        pytest.param(
            MINIMAL_PIPELINE.replace("{a: {}}", "&apps {a: *apps}").encode(),
            "applications.a: contains itself",
            id="alias-inside-its-anchor",
        ),
        pytest.param(
            MINIMAL_PIPELINE.replace(
                "{a: {}}", where_app("(" * 400 + "a = 1" + ")" * 400)
            ).encode(),
            "applications.a.filter.where: cannot parse",
            id="deep-where",
        ),
        # Regression: valid, then a traceback in the publisher when the first subscriber
        # connected (a socket timeout that does not fit).
        pytest.param(
            (
                MINIMAL_PIPELINE + "transport: {type: tcp, heartbeat_timeout_ms: 10000000000000}\n"
            ).encode(),
            "transport.heartbeat_timeout_ms: input should be less than or equal to 86400000",
            id="heartbeat-timeout-out-of-range",
        ),
        # Regression: valid, then `wormhole run` died with an OverflowError traceback.
        pytest.param(
            (MINIMAL_PIPELINE + "transport: {type: inprocess, drain_timeout_s: 1e300}\n").encode(),
            "transport.drain_timeout_s: must be at most 31,536,000 (a year)",
            id="duration-past-a-year",
        ),
        pytest.param(
            (MINIMAL_PIPELINE + "transport: {type: inprocess, drain_timeout_s: .inf}\n").encode(),
            "transport.drain_timeout_s: input should be a finite number",
            id="infinite-duration",
        ),
        pytest.param(
            (MINIMAL_PIPELINE + "transport: {type: tcp, drain_timeout_s: .nan}\n").encode(),
            "transport.drain_timeout_s: input should be a finite number",
            id="nan-duration",
        ),
    ],
)
def test_wormhole_validate_reports_a_broken_file_with_exit_2_and_no_traceback(
    tmp_path: Path, text: bytes, expected: str
) -> None:
    path = tmp_path / "broken.yml"
    path.write_bytes(text)
    result = run_cli("validate", str(path), cwd=tmp_path, timeout=20)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert str(path) in result.stderr and expected in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("garbage", "warning"),
    [
        pytest.param(
            welcome() + notice_all() + frame(p.BATCH, b'{"id":1,"x":' + nested(3000) + b"}"),
            "malformed batch frame: JSON nested too deeply",
            id="deep-json",
        ),
        pytest.param(
            welcome(heartbeat_ms=0), "malformed welcome frame: Expected `int` >= 1", id="no-beat"
        ),
        pytest.param(
            welcome() + struct.pack(">IB", (1 << 32) - 1, p.BATCH),
            "oversize frame: 4294967295 bytes",
            id="4-GiB-frame",
        ),
    ],
)
def test_wormhole_subscribe_fed_garbage_reconnects_and_stops_on_a_fatal_refusal(
    tmp_path: Path, garbage: bytes, warning: str
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    port = listener.getsockname()[1]
    pipeline = tcp_pipeline(
        tmp_path, port, {"h": {"sink": {"type": "jsonl", "path": str(tmp_path / "h.jsonl")}}}
    )
    subscriber = Process(
        "subscribe", str(pipeline), "--app", "h", "--publisher", f"127.0.0.1:{port}", cwd=tmp_path
    )
    try:
        for reply in (garbage, json_frame(p.REFUSE, {"reason": "go away", "fatal": True})):
            conn, _ = listener.accept()
            conn.settimeout(10)
            p.read_preamble(conn)
            assert p.read_frame(conn, 1 << 16)[0] == p.HELLO
            conn.sendall(reply)
            closed_by_peer(conn, CLOSE_WITHIN)
        assert subscriber.proc.wait(30) == 2
        refused = f"error: publisher 127.0.0.1:{port} refused h: go away"
        wait_until(lambda: refused in subscriber.stderr, 10, "the refusal in its stderr")
    finally:
        subscriber.kill()
        listener.close()
    assert "Traceback" not in subscriber.stderr, subscriber.stderr
    assert warning in subscriber.stderr, subscriber.stderr
