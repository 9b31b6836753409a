"""Log readers (protocol version 2), reader side: :class:`TcpRemoteLog`, the ``tcp``
transport's ``remote_log`` (the Spark source's network mode uses it on executors)."""

from __future__ import annotations

import contextlib
import itertools
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from wormhole.connectors.tcp import protocol as p
from wormhole.core.update import Update, UpdateColumns, columns_of
from wormhole.plugins.components import LogPositions, RemoteLogError, RemoteLogRequest

_decode_read_batch = msgspec.json.Decoder(p.ReadBatch).decode


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


__all__ = ["TcpRemoteLog", "open_remote_log"]
