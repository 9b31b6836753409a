"""The ``tcp`` transport's connection of a subscriber to one publisher: the handshake, a
reader thread that keeps the socket drained, heartbeats, and the frames turned into the
link's notices and batches, acknowledged once handled. Reconnecting, the flows and the
handlers are the subscriber layer's (:class:`wormhole.subscriber.link.Link`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any, Protocol

from wormhole.connectors.tcp import protocol as p
from wormhole.subscriber.link import ConnectionClosed, Link, LinkOwner, SubscriberRefused

log = logging.getLogger("wormhole.subscriber")


class TcpLinkOwner(LinkOwner, Protocol):
    """What a TCP link reads of its subscriber
    (:class:`wormhole.connectors.tcp.client.Subscriber`)."""

    app: str
    instance: str
    token: str
    tls: ssl.SSLContext | None
    server_name: str | None
    credits: int
    heartbeat: float
    heartbeat_timeout: float
    max_frame: int
    publisher: str | None


class TcpLink(Link):
    """One TCP connection of a subscriber: to one publisher (trying each address in turn)."""

    lost_errors = (p.PeerClosed, p.ProtocolError)
    owner: TcpLinkOwner

    def __init__(
        self, owner: TcpLinkOwner, datastore: str | None, addresses: Callable[[], list[str]]
    ) -> None:
        super().__init__(owner, datastore, addresses)
        self._beat_interval = owner.heartbeat
        self._silence = owner.heartbeat_timeout
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()

    # ------------------------------------------------------------ session
    def _connect(self, address: str) -> socket.socket:
        owner = self.owner
        host, port = p.parse_address(address)
        raw = socket.create_connection((host, port), timeout=owner.heartbeat_timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = raw
        if owner.tls is not None:
            sock = owner.tls.wrap_socket(raw, server_hostname=owner.server_name or host)
        try:
            body = self._hello(sock, address)
        except BaseException:
            # Closed now, not whenever the exception (which a log handler may keep) is freed.
            p.close_socket(sock)
            raise
        owner.publisher = address
        # Beat at least as often as the publisher asks, whatever this side was told,
        # and give it at least three of its own intervals before calling it silent.
        self._beat_interval = min(owner.heartbeat, body.heartbeat_ms / 1000.0)
        self._silence = max(owner.heartbeat_timeout, 3 * body.heartbeat_ms / 1000.0)
        self._connected = True
        log.info(
            "connected to publisher %s (%s%s) as %s/%s",
            address,
            body.publisher,
            f", datastore {body.datastore}" if body.datastore else "",
            owner.app,
            owner.instance,
        )
        return sock

    def _hello(self, sock: socket.socket, address: str) -> p.Welcome:
        """Say hello; the publisher's welcome (a refusal raises)."""
        owner = self.owner
        sock.sendall(p.preamble())
        sock.sendall(
            p.encode(
                p.HELLO,
                p.Hello(
                    version=p.SUBSCRIBE_VERSION,
                    application=owner.app,
                    instance=owner.instance,
                    token=owner.token,
                    credits=owner.credits,
                ),
            )
        )
        try:
            kind, body = p.read_frame(sock, 1 << 20)
        except p.ProtocolError as exc:
            raise p.ProtocolError(
                f"not a Wormhole publisher: its answer to the handshake is no Wormhole frame "
                f"({exc}); check the address"
            ) from None
        except p.PeerClosed:
            raise p.PeerClosed(
                "the connection was closed during the handshake: not a Wormhole publisher, or "
                "one that is stopping"
            ) from None
        if kind == p.REFUSE:
            sock.close()
            if body.fatal:
                raise SubscriberRefused(f"publisher {address} refused {owner.app}: {body.reason}")
            raise ConnectionClosed(f"refused: {body.reason}")
        if kind != p.WELCOME:
            raise p.ProtocolError(
                f"not a Wormhole publisher: it answered the handshake with "
                f"{p.NAMES.get(kind, kind)}, not a welcome"
            )
        welcome: p.Welcome = body
        return welcome

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionClosed("not connected")
        with self._send_lock:
            sock.sendall(data)

    def _serve(self, address: str) -> None:
        owner = self.owner
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
                if owner._stop.is_set():
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
                    raise ConnectionClosed(f"publisher closed the connection: {body.reason}")
                elif kind == p.BYE:
                    raise ConnectionClosed(f"publisher said goodbye: {body.reason}")
                elif kind == -1:
                    raise body
        finally:
            closed.set()
            self._sock = None
            self._lose_shards()
            p.close_socket(sock)

    def _leave(self, reason: str) -> None:
        with contextlib.suppress(OSError, ConnectionClosed):
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
                kind, body = p.read_frame(sock, self.owner.max_frame)
                if kind != p.HEARTBEAT:
                    inbox.put((kind, body))
        except TimeoutError:
            lost.set()
            silent = f"{self._silence:.1f}s"
            inbox.put(
                (
                    -1,
                    ConnectionClosed(f"missed heartbeats: nothing from the publisher for {silent}"),
                )
            )
        except (OSError, p.PeerClosed, p.ProtocolError) as exc:
            lost.set()
            if not closed.is_set():
                inbox.put((-1, exc if isinstance(exc, Exception) else ConnectionClosed(str(exc))))

    def _beat(self, closed: threading.Event) -> None:
        frame = p.encode(p.HEARTBEAT)
        while not closed.wait(self._beat_interval):
            try:
                self._send(frame)
            except (OSError, ConnectionClosed):
                return

    # -------------------------------------------------------- processing
    def _notice(self, notice: p.Notice) -> None:
        self.take_notice(notice.assigned, notice.revoked, notice.epoch)
        # Frames are handled in order, so every batch sent before this notice is done.
        self._send(p.encode(p.NOTICE_ACK, p.NoticeAck(id=notice.id)))

    def _batch(self, frame: p.BatchFrame) -> None:
        datamarkers = self.take_batch(frame.updates, frame.datamarkers, frame.appended_ns)
        self._send(p.encode(p.ACK, p.Ack(id=frame.id, datamarkers=datamarkers, credits=1)))


__all__ = ["TcpLink"]
