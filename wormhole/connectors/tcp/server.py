"""The publisher end of the TCP transport: a listener and one session per subscriber."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.options import TcpOptions
from wormhole.core.errors import StateError
from wormhole.plugins.components import Frame, PublisherView
from wormhole.plugins.processes import SubscriberProcesses

log = logging.getLogger("wormhole.tcp")

HANDSHAKE_TIMEOUT = 10.0
ADDRESS_FILE = "publisher.addr"


class _Notice:
    __slots__ = ("body", "revoked")

    def __init__(self, body: p.Notice) -> None:
        self.body = body
        self.revoked = body.revoked


class _Piece:
    """The rest of a split batch: frames already encoded and recorded in flight."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class TcpSession:
    """One connected subscriber: frames go out in order, acks and heartbeats come in."""

    def __init__(
        self,
        server: TcpTransport,
        sock: socket.socket,
        peer: str,
        hello: p.Hello,
    ) -> None:
        self.server = server
        self.hub = server.hub
        self.options = server.options
        self.sock = sock
        self.peer = peer
        self.application = hello.application
        self.name = f"{hello.application}/{hello.instance}@{peer}"
        self.instance = hello.instance
        self.window = min(hello.credits, self.options.credits)
        self.credits = self.window
        self.cond = threading.Condition()
        self.outbox: deque[Frame | _Notice | _Piece] = deque()
        self.data_queued = 0
        self.handling = False
        """A frame left the outbox and is not yet recorded in flight (see ``idle``)."""
        self.closed = False
        self.close_reason = ""
        self.next_frame_id = 1
        self.inflight: deque[tuple[int, int]] = deque()  # (frame id, updates)
        self.notices: dict[int, list[int]] = {}
        self.next_notice_id = 1
        self.pending_datamarkers: dict[int, int] = {}
        self.owned: set[int] = set()
        """The shards the subscriber owns as of the frames sent so far (sender thread only)."""
        self.updates_since_datamarker = 0
        self.last_datamarker = time.monotonic()
        self.send_lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.said_last = False  # a refuse or bye went out: nothing may follow it

    def start(self) -> None:
        threading.Thread(target=self._receive, name=f"recv {self.name}", daemon=True).start()
        threading.Thread(target=self._send, name=f"send {self.name}", daemon=True).start()

    # ----------------------------------------------------- SubscriberSession
    def notice(self, assigned: list[int], revoked: list[int], datamarkers: dict[int, int]) -> None:
        with self.cond:
            if self.closed:
                return
            notice_id = self.next_notice_id
            self.next_notice_id += 1
            if revoked:
                self.notices[notice_id] = revoked
                # Datamarkers still held back (sent every N updates or T ms) go out
                # before the revoke, so the next owner starts exactly where this one stopped.
                self.outbox.append(Frame(self.application, [], {}, 0, 0))
                self.data_queued += 1
            self.outbox.append(
                _Notice(
                    p.Notice(
                        id=notice_id,
                        assigned=assigned,
                        revoked=revoked,
                        datamarkers=datamarkers,
                        epoch=self.hub.epoch(self.application),
                    )
                )
            )
            self.cond.notify_all()

    timed_delivery = True
    """``deliver`` takes a ``deadline`` (see ``SubscriberSession.deliver``)."""

    def deliver(
        self, frame: Frame, stop: threading.Event, deadline: float | None = None
    ) -> bool | None:
        with self.cond:
            while self.data_queued >= self.options.credits and not self.closed:
                if stop.is_set():
                    return False
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self.cond.wait(min(0.1, remaining))
                else:
                    self.cond.wait(0.1)
            if self.closed:
                return True  # its flows were moved back to their datamarkers
            self.outbox.append(frame)
            self.data_queued += 1
            self.cond.notify_all()
        return True

    # ------------------------------------------------------------- sending
    def _write(self, data: bytes, last: bool = False) -> None:
        with self.send_lock:
            if self.said_last:
                return
            self.said_last = last
            # The socket's timeout (heartbeat_timeout_ms) bounds each wait for the
            # subscriber to take bytes, not the whole frame: a slow link is not a dead one.
            p.send_all(self.sock, data)
            self.last_sent = time.monotonic()

    def _send(self) -> None:
        heartbeat = self.options.heartbeat_ms / 1000.0
        interval = self.options.datamarker_interval_ms / 1000.0
        try:
            while True:
                with self.cond:
                    while not self.closed:
                        ready = self.outbox and (
                            isinstance(self.outbox[0], _Notice) or self.credits > 0
                        )
                        if ready:
                            break
                        now = time.monotonic()
                        idle_datamarkers = (
                            self.pending_datamarkers
                            and not self.outbox
                            and self.credits > 0
                            and now - self.last_datamarker >= interval
                        )
                        if idle_datamarkers:
                            break
                        if now - self.last_sent >= heartbeat:
                            break
                        self.cond.wait(min(heartbeat, interval) / 2)
                    if self.closed:
                        return
                    item: Frame | _Notice | _Piece | None = None
                    if self.outbox and (isinstance(self.outbox[0], _Notice) or self.credits > 0):
                        item = self.outbox.popleft()
                        if isinstance(item, Frame):
                            self.data_queued -= 1
                            self.handling = True
                        if not isinstance(item, _Notice):
                            self.credits -= 1
                        self.cond.notify_all()
                    elif self.pending_datamarkers and not self.outbox and self.credits > 0:
                        item = Frame(self.application, [], {}, 0, 0)
                        self.handling = True
                        self.credits -= 1
                if item is None:
                    self._write(p.encode(p.HEARTBEAT))
                elif isinstance(item, _Notice):
                    self._owns(item.body)
                    self._write(p.encode(p.NOTICE, item.body))
                elif isinstance(item, _Piece):
                    self._write(item.data)
                else:
                    self._write(self._batch(item))
        except OSError as exc:
            self.close(f"send failed: {exc}")
        except Exception as exc:  # pragma: no cover - a bug; keep serving the others
            log.exception("%s: sender failed", self.name)
            self.close(f"sender failed: {exc!r}")

    def _owns(self, notice: p.Notice) -> None:
        self.owned.update(notice.assigned)
        self.owned.difference_update(notice.revoked)
        # The batch queued just before a revoke took these along; whatever came after it
        # is no longer the subscriber's to acknowledge.
        for shard in notice.revoked:
            self.pending_datamarkers.pop(shard, None)

    def _batch(self, frame: Frame) -> bytes:
        # A frame built from the caravan's snapshot of the owners can reach the outbox
        # after a notice that revoked one of its shards. Its datamarker for that shard
        # must not travel, nor wait here until the shard comes back to this subscriber:
        # acknowledged then, it would move the flow past updates the subscriber dropped.
        # Frames and notices go out in order, so what the subscriber owns when it
        # processes this frame is ``owned`` now.
        owned = self.owned
        datamarkers_in = frame.datamarkers
        if not owned.issuperset(datamarkers_in):
            datamarkers_in = {s: v for s, v in datamarkers_in.items() if s in owned}
        # Datamarkers go out every N updates or T ms per connection, not with every frame.
        self.pending_datamarkers.update(datamarkers_in)
        self.updates_since_datamarker += len(frame.updates)
        now = time.monotonic()
        datamarkers: dict[int, int] = {}
        if (
            self.updates_since_datamarker >= self.options.datamarker_updates
            or now - self.last_datamarker >= self.options.datamarker_interval_ms / 1000.0
            or not frame.updates
        ):
            datamarkers = self.pending_datamarkers
            self.pending_datamarkers = {}
            self.updates_since_datamarker = 0
            self.last_datamarker = now
        first_id = self.next_frame_id
        pieces = p.encode_batches(
            first_id,
            frame.first_seq,
            frame.end_seq,
            frame.appended_ns,
            datamarkers,
            frame.updates,
            int(self.options.max_batch_frame),
        )
        self.next_frame_id += len(pieces)
        with self.cond:
            self.inflight.extend((first_id + i, count) for i, (_, count) in enumerate(pieces))
            # The rest of a split batch goes next, ahead of anything queued meanwhile
            # (a revoke must not overtake it), each piece taking a credit.
            self.outbox.extendleft(_Piece(data) for data, _ in reversed(pieces[1:]))
            self.handling = False
            self.cond.notify_all()
        return pieces[0][0]

    # ----------------------------------------------------------- receiving
    def _receive(self) -> None:
        max_frame = int(self.options.max_frame)
        try:
            while not self.closed:
                kind, body = p.read_frame(self.sock, max_frame)
                if kind == p.ACK:
                    self._ack(body)
                elif kind == p.NOTICE_ACK:
                    with self.cond:
                        shards = self.notices.pop(body.id, [])
                    if shards:
                        self.hub.revoked(self.application, self, shards)
                elif kind == p.HEARTBEAT:
                    pass
                elif kind == p.BYE:
                    self.close(f"left{': ' + body.reason if body.reason else ''}")
                    return
                else:
                    raise p.ProtocolError(f"unexpected {p.NAMES.get(kind, kind)} frame")
        except TimeoutError:
            self.close(
                f"missed heartbeats: nothing received for {self.options.heartbeat_timeout_ms} ms"
            )
        except p.PeerClosed:
            self.close("connection closed by the subscriber")
        except p.ProtocolError as exc:
            log.warning("%s: %s; closing the connection", self.name, exc)
            self._refuse(str(exc))
            self.close(str(exc))
        except OSError as exc:
            self.close(f"connection lost: {exc}")

    def _ack(self, ack: p.Ack) -> None:
        updates = 0
        with self.cond:
            while self.inflight and self.inflight[0][0] <= ack.id:
                updates += self.inflight.popleft()[1]
            # Never more credit than the window: a confused client cannot open it wider.
            self.credits = min(self.credits + max(ack.credits, 0), self.window)
            self.cond.notify_all()
        # The hub ignores datamarkers of flows this session no longer holds.
        self.hub.acknowledge(self.application, self, ack.datamarkers, updates)

    def _refuse(self, reason: str) -> None:
        with contextlib.suppress(OSError):
            self._write(p.encode(p.REFUSE, p.Refuse(reason=reason, fatal=False)), last=True)

    def close(self, reason: str) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            self.cond.notify_all()
        p.close_socket(self.sock)
        self.hub.detach(self, reason)
        self.server.forget(self)

    def flush(self) -> None:
        """Send datamarkers held back (every N updates or T ms) now."""
        with self.cond:
            if not self.closed:
                self.outbox.append(Frame(self.application, [], {}, 0, 0))
                self.data_queued += 1
                self.cond.notify_all()

    def idle(self) -> bool:
        """Everything sent was acknowledged and nothing waits to be sent."""
        with self.cond:
            return self.closed or (not self.outbox and not self.handling and not self.inflight)

    def bye(self, reason: str) -> None:
        with contextlib.suppress(OSError):
            self._write(p.encode(p.BYE, p.Bye(reason=reason)), last=True)
        self.close(reason)


class TcpTransport:
    """Listens for subscribers; `wormhole run` also starts the applications' subscribers."""

    protocol_version = p.VERSION
    """The subscriber protocol it speaks (registered with the publisher's address)."""

    def __init__(self, options: TcpOptions) -> None:
        self.options = options
        self.hub: PublisherView = None  # type: ignore[assignment]
        self.listener: socket.socket | None = None
        self.address = ""
        self.sessions: set[TcpSession] = set()
        self.readers: set[Any] = set()
        """Log readers' sessions (:class:`wormhole.connectors.tcp.ranges.ReaderSession`)."""
        self.sessions_lock = threading.Lock()
        self.stopping = threading.Event()
        self.tls: ssl.SSLContext | None = None
        self.processes: SubscriberProcesses | None = None
        self.spawn = options.spawn
        self.publisher_id = f"{socket.gethostname()}:{os.getpid()}"

    # ------------------------------------------------------------- start
    def start(self, hub: PublisherView) -> None:
        self.hub = hub
        if self.options.tls is not None:
            try:
                self.tls = self.options.tls.server_context()
            except (OSError, ssl.SSLError) as exc:
                raise StateError(
                    f"transport.tls: cannot load the certificate or key ({exc}); check the paths"
                ) from exc
        host, port = p.parse_address(self.options.listen)
        try:
            listener = socket.create_server(
                (host, port),
                family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                reuse_port=False,
            )
        except OSError as exc:
            raise StateError(
                f"transport.listen: cannot listen on {self.options.listen} ({exc.strerror}); "
                f"choose another address or port"
            ) from exc
        self.listener = listener
        bound = listener.getsockname()
        self.address = (
            f"{bound[0]}:{bound[1]}" if ":" not in bound[0] else f"[{bound[0]}]:{bound[1]}"
        )
        path = hub.pipeline.state_dir / ADDRESS_FILE
        path.write_text(self.address + "\n")
        log.info("listening for subscribers on %s%s", self.address, " (TLS)" if self.tls else "")
        threading.Thread(target=self._accept, name="tcp accept", daemon=True).start()
        self.processes = SubscriberProcesses(hub, "tcp", self._publisher_args)
        if self.spawn and hub.local_subscribers:
            for app in hub.applications.values():
                if app.config.sink is None:
                    continue
                for index in range(app.config.subscribers):
                    self.processes.spawn(app.name, index)

    def _accept(self) -> None:
        assert self.listener is not None
        while not self.stopping.is_set():
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(
                target=self._handshake, args=(sock, peer), name=f"handshake {peer}", daemon=True
            ).start()

    def _handshake(self, raw: socket.socket, peer: str) -> None:
        greeted = self._greet(raw, peer)
        if greeted is None:
            return
        sock, hello = greeted
        if hello.mode == "read":
            self._serve_reader(sock, peer, hello)
        else:
            self._serve_subscriber(sock, peer, hello)

    def _greet(self, raw: socket.socket, peer: str) -> tuple[socket.socket, p.Hello] | None:
        """Read the preamble and hello, answer with a welcome; None when the connection was
        refused or closed (and logged)."""
        sock: socket.socket = raw
        # For the whole handshake, not per read: a client trickling bytes in is closed too.
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(HANDSHAKE_TIMEOUT)
            if self.tls is not None:
                sock = self.tls.wrap_socket(raw, server_side=True)
            version = p.read_preamble(sock, deadline)
            if version not in p.VERSIONS:
                self._refuse(
                    sock,
                    peer,
                    f"protocol version {version} is not supported; this "
                    f"publisher speaks versions {', '.join(map(str, p.VERSIONS))}",
                )
                return None
            kind, hello = p.read_frame(sock, 1 << 16, deadline)
            if kind != p.HELLO:
                raise p.ProtocolError(f"expected hello, got {p.NAMES.get(kind, kind)}")
            problem = self._hello_problem(version, hello)
            if problem:
                self._refuse(sock, peer, problem)
                return None
            sock.sendall(self._welcome(version))
            sock.settimeout(self.options.heartbeat_timeout_ms / 1000.0)
        except p.PeerClosed:
            # A port probe or health check: connected and left without a word.
            log.debug("connection from %s closed before its hello", peer)
            p.close_socket(sock)
            return None
        except TimeoutError:
            log.warning(
                "closing connection from %s: no complete handshake within %gs",
                peer,
                HANDSHAKE_TIMEOUT,
            )
            p.close_socket(sock)
            return None
        except (p.ProtocolError, ssl.SSLError, OSError) as exc:
            log.warning("closing connection from %s: %s", peer, exc)
            p.close_socket(sock)
            return None
        return sock, hello

    def _hello_problem(self, version: int, hello: p.Hello) -> str | None:
        """Why this hello is refused (None: it is not)."""
        if hello.version != version or hello.credits < 1:
            return (
                f"bad hello: version {hello.version} (preamble said "
                f"{version}), credits {hello.credits} (must be at least 1)"
            )
        token = self.options.token
        if token and not hmac.compare_digest(hello.token.encode(), token.encode()):
            return "authentication failed: wrong token"
        reader = hello.mode == "read"
        problem = self._check_mode(hello) if reader or hello.mode != "subscribe" else None
        if problem:
            return problem
        if not reader and hello.application not in self.hub.applications:
            known = ", ".join(sorted(self.hub.applications))
            return f"unknown application {hello.application!r}; this pipeline has: {known}"
        return None

    def _welcome(self, version: int) -> bytes:
        return p.encode(
            p.WELCOME,
            p.Welcome(
                version=version,
                publisher=self.publisher_id,
                pipeline=self.hub.pipeline.name,
                shards=self.hub.shards,
                heartbeat_ms=self.options.heartbeat_ms,
                datastore=self.hub.pipeline.datastore,
            ),
        )

    def _serve_reader(self, sock: socket.socket, peer: str, hello: p.Hello) -> None:
        """Serve a log reader (mode ``read``) on this thread until it leaves."""
        from wormhole.connectors.tcp.ranges import ReaderSession

        reader_session = ReaderSession(self, sock, peer, hello)
        with self.sessions_lock:
            if self.stopping.is_set():
                p.close_socket(sock)
                return
            self.readers.add(reader_session)
        try:
            reader_session.run()
        finally:
            with self.sessions_lock:
                self.readers.discard(reader_session)

    def _serve_subscriber(self, sock: socket.socket, peer: str, hello: p.Hello) -> None:
        """Attach a subscriber's session to its application and start it."""
        session = TcpSession(self, sock, peer, hello)
        with self.sessions_lock:
            if self.stopping.is_set():
                p.close_socket(sock)
                return
            self.sessions.add(session)
        self.hub.attach(hello.application, session)
        session.start()

    def _check_mode(self, hello: p.Hello) -> str | None:
        """Why a hello of another mode than ``subscribe`` is refused (None: it is not)."""
        if hello.mode != "read":
            return f"bad hello: unknown mode {hello.mode!r} (subscribe or read)"
        if hello.version < p.READ_VERSION:
            return f"bad hello: mode 'read' needs protocol version {p.READ_VERSION}"
        pipeline = self.hub.pipeline
        app = pipeline.applications.get(hello.application)
        if app is None or not app.external:
            external = sorted(n for n, a in pipeline.applications.items() if a.external)
            what = "unknown application" if app is None else "not an external application"
            return (
                f"{what} {hello.application!r}: only external applications are read by range "
                f"(external ones here: {', '.join(external) or 'none'}); declare it with "
                f"'external: true' so the publisher keeps the log for it"
            )
        if pipeline.mode == "multiple-copy":
            return (
                "range reads are not served in multiple-copy delivery: copies number their "
                "logs differently, so a reader's positions would not carry over"
            )
        return None

    def _refuse(self, sock: socket.socket, peer: str, reason: str) -> None:
        log.warning("refusing subscriber at %s: %s", peer, reason)
        with contextlib.suppress(OSError):
            sock.sendall(p.encode(p.REFUSE, p.Refuse(reason=reason, fatal=True)))
        p.close_socket(sock)

    def forget(self, session: TcpSession) -> None:
        with self.sessions_lock:
            self.sessions.discard(session)

    # ----------------------------------------------------------- children
    def _publisher_args(self) -> list[str]:
        host, port = p.parse_address(self.address)
        address = f"127.0.0.1:{port}" if host in ("0.0.0.0", "::") else self.address
        return ["--publisher", address]

    def add_application(self, app: Any) -> None:
        """An application added to a running pipeline: start its subscribers (if this
        publisher runs them). Library subscribers of it may now connect."""
        hub = self.hub
        if not (self.spawn and hub is not None and hub.local_subscribers):
            return
        if app.config.sink is None or self.processes is None:
            return
        for index in range(app.config.subscribers):
            self.processes.spawn(app.name, index)

    def remove_application(self, name: str) -> None:
        """An application taken out of a running pipeline: its subscribers finish what
        they hold and leave."""
        with self.sessions_lock:
            sessions = [s for s in self.sessions if s.application == name]
        for session in sessions:
            session.flush()
        deadline = time.monotonic() + self.options.drain_timeout_s
        while time.monotonic() < deadline and not all(s.idle() for s in sessions):
            time.sleep(0.01)
        if self.processes is not None:
            self.processes.stop(
                deadline + 1.0, application=name, stall=self.options.drain_timeout_s
            )
        for session in sessions:
            session.bye("application removed from the pipeline")

    # -------------------------------------------------------------- stop
    def stop(self, drain: bool = True) -> None:
        self.stopping.set()
        deadline = time.monotonic() + (self.options.drain_timeout_s if drain else 1.0)
        with self.sessions_lock:
            sessions = list(self.sessions)
        if drain:
            # Subscribers finish what they hold and acknowledge it, datamarkers
            # held back for batching included.
            for session in sessions:
                session.flush()
            while time.monotonic() < deadline and not all(s.idle() for s in sessions):
                time.sleep(0.01)
        # Subscriber processes leave.
        if self.processes is not None:
            self.processes.stop(deadline, stall=self.options.drain_timeout_s if drain else 1.0)
        with self.sessions_lock:
            sessions = list(self.sessions)
        for session in sessions:
            session.bye("publisher stopping")
        with self.sessions_lock:
            readers = list(self.readers)
        for reader in readers:
            p.close_socket(reader.sock)
        if self.listener is not None:
            self.listener.close()
        with contextlib.suppress(FileNotFoundError, AttributeError):
            (self.hub.pipeline.state_dir / ADDRESS_FILE).unlink()


def read_address(state_dir: Path) -> str | None:
    try:
        return (state_dir / ADDRESS_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


__all__ = ["TcpSession", "TcpTransport", "read_address"]
_ = Any
