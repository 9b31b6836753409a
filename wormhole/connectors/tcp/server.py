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
from pathlib import Path
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.options import TcpOptions
from wormhole.connectors.tcp.reads import ReadService
from wormhole.connectors.tcp.session import TcpSession
from wormhole.core.errors import StateError
from wormhole.plugins.components import PublisherView

log = logging.getLogger("wormhole.tcp")

HANDSHAKE_TIMEOUT = 10.0
ADDRESS_FILE = "publisher.addr"


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
        self.sessions_lock = threading.Lock()
        self.stopping = threading.Event()
        self.reads = ReadService(options, self.stopping)
        """Serves log readers (hello mode ``read``)."""
        self.tls: ssl.SSLContext | None = None
        self.publisher_id = f"{socket.gethostname()}:{os.getpid()}"

    # ------------------------------------------------------------- start
    def start(self, hub: PublisherView) -> None:
        self.hub = hub
        self.reads.start(hub)
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
            self.reads.serve(sock, peer, hello)
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

    def _serve_subscriber(self, sock: socket.socket, peer: str, hello: p.Hello) -> None:
        """Attach a subscriber's session to its application and start it."""
        session = TcpSession(self.hub, self.options, sock, peer, hello, self.forget)
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
    def subscriber_args(self) -> list[str] | None:
        """What the subscriber processes the engine starts need: this publisher's address
        (None with ``spawn: false``)."""
        if not self.options.spawn:
            return None
        host, port = p.parse_address(self.address)
        address = f"127.0.0.1:{port}" if host in ("0.0.0.0", "::") else self.address
        return ["--publisher", address]

    def add_application(self, app: Any) -> None:
        """An application added to a running pipeline: its subscribers may now connect (the
        engine starts those it runs)."""

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
        self.hub.stop_subscribers(deadline + 1.0, self.options.drain_timeout_s, name)
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
        if self.hub is not None:
            self.hub.stop_subscribers(deadline, self.options.drain_timeout_s if drain else 1.0)
        with self.sessions_lock:
            sessions = list(self.sessions)
        for session in sessions:
            session.bye("publisher stopping")
        self.reads.close()
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
