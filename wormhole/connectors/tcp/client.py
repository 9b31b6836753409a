"""The subscriber library: an application's end of the TCP transport.

::

    import wormhole

    sub = wormhole.Subscriber(app="search", publishers=["10.0.0.5:7070"], token="...")

    @sub.on_shard_notice
    def notice(assigned, revoked): ...

    @sub.on_updates
    def handle(flow, batch): ...   # returning acknowledges; raising retries the batch

    sub.run()                      # or: await sub.run_async()

One connection carries all of the subscriber's flows. A reader thread keeps the
socket drained and answers heartbeats while handlers run; the publisher sends at
most ``credits`` batches ahead of the acknowledgements, so memory stays bounded
however slow the handlers are. A handler that raises gets the same batch again
(with backoff) until it returns. Per flow (shard), batches arrive in order. If
the connection drops, the subscriber reconnects (trying each publisher in turn)
and resumes from its datamarkers; a refusal the publisher calls fatal (wrong
token, unknown application, version mismatch) raises :class:`SubscriberRefused`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.core.subscriber import Handlers

log = logging.getLogger("wormhole.subscriber")


class SubscriberRefused(WormholeError):
    """The publisher refused this subscriber for a reason retrying cannot fix."""


class _Closed(Exception):
    pass


class Subscriber(Handlers):
    def __init__(
        self,
        app: str,
        publishers: list[str] | str | Callable[[], list[str]],
        token: str = "",
        *,
        instance: str | None = None,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        credits: int = 8,
        heartbeat_ms: int = 1000,
        heartbeat_timeout_ms: int = 3000,
        reconnect: bool = True,
        max_backoff: float = 10.0,
        max_frame: int = 1 << 30,
    ) -> None:
        self.app = app
        # A callable is asked again before every connection attempt (an address
        # that changes when the publisher restarts).
        self._publishers = publishers if callable(publishers) else None
        self.publishers = (
            publishers()
            if callable(publishers)
            else [publishers]
            if isinstance(publishers, str)
            else list(publishers)
        )
        if not self.publishers:
            raise ValueError("publishers: give at least one host:port")
        for address in self.publishers:
            p.parse_address(address)
        self.token = token
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.tls = tls
        self.server_name = server_name
        self.credits = credits
        self.heartbeat = heartbeat_ms / 1000.0
        self.heartbeat_timeout = heartbeat_timeout_ms / 1000.0
        self.reconnect = reconnect
        self.max_backoff = max_backoff
        self.max_frame = max_frame
        self.assigned: set[int] = set()
        self.publisher: str | None = None
        self.processed = 0
        self.frame_appended_ns = 0
        """When the batch being handled reached the publisher log (CLOCK_MONOTONIC ns)."""
        self._init_handlers()
        self._stop = threading.Event()
        self._beat_interval = self.heartbeat
        self._silence = self.heartbeat_timeout
        self._connected = False
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()

    # --------------------------------------------------------------- run
    def stop(self) -> None:
        """Finish the batch in hand, acknowledge it, leave; ``run`` then returns."""
        self._stop.set()

    def run(self) -> None:
        """Serve until ``stop()``; reconnects on connection loss (with backoff)."""
        backoff = Backoff(log, first=0.2, cap=self.max_backoff, stop=self._stop)
        attempt = 0
        while not self._stop.is_set():
            if self._publishers is not None:
                self.publishers = self._publishers() or self.publishers
            address = self.publishers[attempt % len(self.publishers)]
            attempt += 1
            self._connected = False
            try:
                self._serve(address)
                backoff.reset()
            except SubscriberRefused:
                raise
            except (OSError, p.PeerClosed, p.ProtocolError, _Closed) as exc:
                self._lose_shards()
                if self._stop.is_set():
                    return
                if not self.reconnect:
                    raise
                if self._connected:
                    backoff.reset()  # it worked until now: retry soon
                if not backoff.wait("publisher %s: %s; reconnecting in %.1fs", address, exc):
                    return

    def _lose_shards(self) -> None:
        if self.assigned:
            revoked = sorted(self.assigned)
            self.assigned.clear()
            for fn in self._notice_handlers:
                fn([], revoked)

    # ------------------------------------------------------------ session
    def _connect(self, address: str) -> socket.socket:
        host, port = p.parse_address(address)
        raw = socket.create_connection((host, port), timeout=self.heartbeat_timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        if self.tls is not None:
            sock = self.tls.wrap_socket(raw, server_hostname=self.server_name or host)
        try:
            body = self._hello(sock, address)
        except BaseException:
            # Closed now, not whenever the exception (which a log handler may keep) is freed.
            p.close_socket(sock)
            raise
        self.publisher = address
        # Beat at least as often as the publisher asks, whatever this side was told,
        # and give it at least three of its own intervals before calling it silent.
        self._beat_interval = min(self.heartbeat, body.heartbeat_ms / 1000.0)
        self._silence = max(self.heartbeat_timeout, 3 * body.heartbeat_ms / 1000.0)
        self._connected = True
        log.info(
            "connected to publisher %s (%s) as %s/%s",
            address,
            body.publisher,
            self.app,
            self.instance,
        )
        return sock

    def _hello(self, sock: socket.socket, address: str) -> p.Welcome:
        """Say hello; the publisher's welcome (a refusal raises)."""
        sock.sendall(p.preamble())
        sock.sendall(
            p.encode(
                p.HELLO,
                p.Hello(
                    version=p.VERSION,
                    application=self.app,
                    instance=self.instance,
                    token=self.token,
                    credits=self.credits,
                ),
            )
        )
        kind, body = p.read_frame(sock, 1 << 20)
        if kind == p.REFUSE:
            sock.close()
            if body.fatal:
                raise SubscriberRefused(f"publisher {address} refused {self.app}: {body.reason}")
            raise _Closed(f"refused: {body.reason}")
        if kind != p.WELCOME:
            raise p.ProtocolError(f"expected welcome, got {p.NAMES.get(kind, kind)}")
        welcome: p.Welcome = body
        return welcome

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise _Closed("not connected")
        with self._send_lock:
            sock.sendall(data)

    def _serve(self, address: str) -> None:
        sock = self._connect(address)
        self._sock = sock
        inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        closed = threading.Event()
        lost = threading.Event()
        reader = threading.Thread(
            target=self._read,
            args=(sock, inbox, closed, lost),
            name="subscriber reader",
            daemon=True,
        )
        beater = threading.Thread(
            target=self._beat, args=(closed,), name="subscriber heartbeat", daemon=True
        )
        reader.start()
        beater.start()
        try:
            while True:
                if self._stop.is_set():
                    # The batch in hand was acknowledged; frames not yet handled are
                    # sent again to the flows' next owner.
                    self._leave("subscriber stopping")
                    return
                try:
                    kind, body = inbox.get(timeout=0.1)
                except queue.Empty:
                    continue
                if kind in (p.BATCH, p.NOTICE) and lost.is_set():
                    # They can no longer be acknowledged: the publisher sends them
                    # again to whoever owns the flow next. Writing them now could
                    # interleave with that owner. Dropped: the reader's reason for the loss
                    # follows them.
                    continue
                if kind == p.BATCH:
                    self._batch(body)
                elif kind == p.NOTICE:
                    self._notice(body)
                elif kind == p.REFUSE:
                    if body.fatal:
                        raise SubscriberRefused(f"publisher {address}: {body.reason}")
                    raise _Closed(f"publisher closed the connection: {body.reason}")
                elif kind == p.BYE:
                    raise _Closed(f"publisher said goodbye: {body.reason}")
                elif kind == -1:
                    raise body
        finally:
            closed.set()
            self._sock = None
            self._lose_shards()
            p.close_socket(sock)

    def _leave(self, reason: str) -> None:
        with contextlib.suppress(OSError, _Closed):
            self._send(p.encode(p.BYE, p.Bye(reason=reason)))

    def _read(
        self,
        sock: socket.socket,
        inbox: queue.Queue[tuple[int, Any]],
        closed: threading.Event,
        lost: threading.Event,
    ) -> None:
        sock.settimeout(self._silence)
        try:
            while not closed.is_set():
                kind, body = p.read_frame(sock, self.max_frame)
                if kind != p.HEARTBEAT:
                    inbox.put((kind, body))
        except TimeoutError:
            lost.set()
            silent = f"{self._silence:.1f}s"
            inbox.put((-1, _Closed(f"missed heartbeats: nothing from the publisher for {silent}")))
        except (OSError, p.PeerClosed, p.ProtocolError) as exc:
            lost.set()
            if not closed.is_set():
                inbox.put((-1, exc if isinstance(exc, Exception) else _Closed(str(exc))))

    def _beat(self, closed: threading.Event) -> None:
        frame = p.encode(p.HEARTBEAT)
        while not closed.wait(self._beat_interval):
            try:
                self._send(frame)
            except (OSError, _Closed):
                return

    # -------------------------------------------------------- processing
    def _notice(self, notice: p.Notice) -> None:
        self.assigned.update(notice.assigned)
        self.assigned.difference_update(notice.revoked)
        for fn in self._notice_handlers:
            fn(list(notice.assigned), list(notice.revoked))
        # Frames are handled in order, so every batch sent before this notice is done.
        self._send(p.encode(p.NOTICE_ACK, p.NoticeAck(id=notice.id)))

    def _batch(self, frame: p.BatchFrame) -> None:
        assigned = self.assigned
        updates = frame.updates
        if updates and any(u.shard not in assigned for u in updates):
            # Only flows this subscriber owns: others are re-sent to their owner.
            updates = [u for u in updates if u.shard in assigned]
        self.frame_appended_ns = frame.appended_ns
        if updates:
            self._handle(updates)
        self.processed += len(updates)
        datamarkers = {s: pos for s, pos in frame.datamarkers.items() if s in assigned}
        self._send(p.encode(p.ACK, p.Ack(id=frame.id, datamarkers=datamarkers, credits=1)))

    def _stopped_while_retrying(self, exc: Exception) -> BaseException:
        return _Closed("stopped while retrying a batch")

    def latency(self) -> float:
        """Seconds since the batch being handled reached the publisher log.

        Meaningful when subscriber and publisher share a machine (one monotonic clock).
        """
        return (time.monotonic_ns() - self.frame_appended_ns) / 1e9
