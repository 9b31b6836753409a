"""The metrics endpoint of a process: where it serves :data:`wormhole.plugins.events.REGISTRY`
(``metrics.listen``, ``--metrics HOST:PORT``), and the address of each subscriber process
``wormhole run`` starts. Part of the plugin contract: the subscriber processes it runs serve
their metrics here too."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from wormhole.core.errors import ConfigError
from wormhole.plugins.events import REGISTRY

log = logging.getLogger("wormhole.metrics")

DEFAULT_LISTEN = "127.0.0.1:9464"


@dataclass(frozen=True)
class Listen:
    """Where metrics are served, and the option that said so (for messages)."""

    host: str
    port: int
    option: str = "metrics.listen"


def parse_listen(text: str, option: str = "metrics.listen") -> Listen:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 picks a free one)."""
    host, sep, port = str(text).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"{option}: {text!r} is not HOST:PORT; write e.g. {DEFAULT_LISTEN} "
            f"(port 0: a free port)"
        )
    return Listen(host, int(port), option)


class MetricsServer:
    """The HTTP endpoint (``/metrics``) of :data:`REGISTRY`, on a thread of its own."""

    def __init__(self, listen: Listen) -> None:
        from prometheus_client import start_http_server

        try:
            self.server, self.thread = start_http_server(
                listen.port, listen.host, registry=REGISTRY
            )
        except OSError as exc:
            raise ConfigError(
                f"{listen.option}: cannot serve metrics on {listen.host}:{listen.port} "
                f"({exc.strerror or exc}); choose a free port (another process serves there?), "
                f"or port 0 for any free one"
            ) from exc
        self.host = listen.host
        self.port = int(self.server.server_address[1])
        log.info("serving metrics on http://%s:%d/metrics", _url_host(self.host), self.port)

    @property
    def address(self) -> str:
        return f"{_url_host(self.host)}:{self.port}"

    def close(self) -> None:
        """Stop serving, at once: the server's loop looks for a stop request only between
        connections or every half second, so it is woken with connections until it stops
        (a run with metrics would otherwise end up to half a second late)."""
        import socket

        stopper = threading.Thread(target=self.server.shutdown, name="metrics-stop", daemon=True)
        stopper.start()
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        deadline = time.monotonic() + 5.0
        while stopper.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection((host, self.port), timeout=0.5).close()
            stopper.join(0.02)
        self.server.server_close()
        self.thread.join(5)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(listen: Listen) -> MetricsServer:
    """Serve this process's metrics at ``listen`` until :meth:`MetricsServer.close`."""
    return MetricsServer(listen)


class SubscriberPorts:
    """The metrics address of each subscriber process ``wormhole run`` starts: the ports
    after the publisher's, one per (application, instance) in the order they first start
    (port 0: each picks a free port)."""

    def __init__(self, listen: Listen) -> None:
        self.listen = listen
        self.given: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()

    def address(self, application: str, instance: int) -> str:
        listen = self.listen
        with self.lock:
            port = self.given.get((application, instance))
            if port is None:
                port = 0 if listen.port == 0 else listen.port + 1 + len(self.given)
                self.given[(application, instance)] = port
        return f"{_url_host(listen.host)}:{port}"


__all__ = ["DEFAULT_LISTEN", "Listen", "MetricsServer", "SubscriberPorts", "parse_listen", "serve"]
