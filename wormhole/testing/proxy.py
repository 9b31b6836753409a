"""A TCP proxy for fault injection: a slow link, a stalled link, a cut connection.

::

    with ThrottlingProxy("127.0.0.1:7070", rate=256 * 1024) as proxy:
        subscriber = Subscriber("search", [proxy.address])   # instead of 127.0.0.1:7070
        ...
        proxy.pause()        # the link stalls: nothing is read or forwarded
        proxy.resume()
        proxy.cut()          # every current connection is closed, both ends
        proxy.set_rate(None) # full speed again

Each accepted connection gets its own connection to ``upstream`` and two pumps,
``up`` (client to upstream) and ``down`` (upstream to client). A pump reads only
as fast as its rate lets it forward, so a slow or paused link pushes back on the
sender the way a real one does: its socket buffers fill and its writes block.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Literal

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")

# Small receive buffers on the proxy's sockets: otherwise the kernel (which tunes
# loopback buffers up to several MiB) would absorb whole frames at full speed and the
# sender would never feel the slow link.
_RECEIVE_BUFFER = 64 * 1024


class _Link:
    """Settings of one direction, shared by every connection's pump in that direction."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.running = threading.Event()
        self.running.set()


class ThrottlingProxy:
    """Forwards TCP connections to ``upstream`` at ``rate`` bytes/s per connection and
    direction (None: unlimited); ``pause``, ``resume`` and ``cut`` inject faults."""

    def __init__(
        self,
        upstream: str | tuple[str, int],
        rate: float | None = None,
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        if isinstance(upstream, str):
            host, _, port = upstream.rpartition(":")
            upstream = (host.strip("[]"), int(port))
        self.upstream = upstream
        self.links: dict[Direction, _Link] = {d: _Link(rate) for d in DIRECTIONS}
        self.forwarded: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        """Bytes forwarded so far, per direction (counted as each chunk is sent on)."""
        self.accepted = 0
        """Connections accepted so far."""
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._refusing = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(listen)
        host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self.port: int = port
        self._start(self._accept, "proxy accept")

    # ------------------------------------------------------------- control
    def set_rate(self, rate: float | None, direction: Direction | None = None) -> None:
        """Bytes per second per connection (None: unlimited), one direction or both."""
        for d in (direction,) if direction else DIRECTIONS:
            self.links[d].rate = rate

    def pause(self, direction: Direction | None = None) -> None:
        """Stop reading and forwarding (one direction or both) until ``resume``."""
        for d in (direction,) if direction else DIRECTIONS:
            self.links[d].running.clear()

    def resume(self, direction: Direction | None = None) -> None:
        for d in (direction,) if direction else DIRECTIONS:
            self.links[d].running.set()

    def refuse(self) -> None:
        """Close every new connection at once (a server that is down) until ``accept``."""
        self._refusing.set()

    def accept(self) -> None:
        self._refusing.clear()

    def cut(self) -> None:
        """Close every current connection, both ends; new connections are accepted."""
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            _close(sock)

    @property
    def connections(self) -> int:
        """Open connections (each counts once, though it holds two sockets)."""
        with self._lock:
            return len(self._sockets) // 2

    def close(self) -> None:
        """Stop accepting, cut every connection and wait for the pumps to end."""
        self._closing.set()
        for link in self.links.values():
            link.running.set()
        _close(self._listener)
        self.cut()
        for thread in self._threads:
            thread.join(10)

    def __enter__(self) -> ThrottlingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- pumping
    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing.is_set():
                _close(client)
                continue
            try:
                family = socket.AF_INET6 if ":" in self.upstream[0] else socket.AF_INET
                server = socket.socket(family)
                # Set before connecting: the window scale is agreed in the handshake.
                server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
                server.connect(self.upstream)
            except OSError:
                _close(client)
                continue
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closing.is_set():
                    _close(client)
                    _close(server)
                    return
                self._sockets.update((client, server))
                self.accepted += 1
            self._start(self._pump, "proxy up", client, server, "up")
            self._start(self._pump, "proxy down", server, client, "down")

    def _pump(self, source: socket.socket, target: socket.socket, direction: Direction) -> None:
        link = self.links[direction]
        # When the link is free to carry the next byte; time it spent idle is not
        # saved up for a burst later.
        free_at = time.monotonic()
        try:
            while not self._closing.is_set():
                link.running.wait()
                rate = link.rate
                chunk = 65536 if rate is None else max(1, min(65536, int(rate / 20)))
                data = source.recv(chunk)
                if not data:
                    break
                if rate is not None:
                    now = time.monotonic()
                    free_at = max(free_at, now)
                    # A timed wait is what a slow link is; _closing ends it early.
                    if free_at > now:
                        self._closing.wait(free_at - now)
                    free_at += len(data) / rate
                link.running.wait()
                # Counted first: whoever receives these bytes sees them counted.
                with self._lock:
                    self.forwarded[direction] += len(data)
                target.sendall(data)
        except OSError:
            pass
        finally:
            # One side is gone: the other sees the connection close, as with a real cut.
            with self._lock:
                self._sockets.discard(source)
                self._sockets.discard(target)
            _close(source)
            _close(target)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


__all__ = ["ThrottlingProxy"]
