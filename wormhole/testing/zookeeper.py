"""A throwaway ZooKeeper server (standalone) on a free loopback port (or a test host's address).

Runs the Debian ``zookeeper`` package's jars with ``java`` in a temp dir: a
``zoo.cfg`` with ``dataDir``, ``clientPort``, ``clientPortAddress=127.0.0.1`` and
the admin server off. The server can be stopped and started again on the same
port with its data (a restarted ZooKeeper), or paused (SIGSTOP) past a session
timeout.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import ServerProcess, require, start_on_free_port

JARS = Path("/usr/share/java")
CONF = Path("/etc/zookeeper/conf")


@dataclass
class ZooKeeperServer(ServerProcess):
    host: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    prefix: tuple[str, ...] = ()
    """What the server's command runs under (``ip netns exec HOST``: on a test host)."""

    @property
    def hosts(self) -> str:
        """``host:port``, as kazoo and the ``registry.hosts`` option take it."""
        return f"{self.host}:{self.port}"

    def client(self, **kwargs: Any) -> Any:
        """A started kazoo ``KazooClient`` for this server (needs ``kazoo``); stop it after."""
        from kazoo.client import KazooClient

        client = KazooClient(hosts=self.hosts, **kwargs)
        client.start(timeout=30)
        return client

    def start(self) -> None:
        """Start (again) on the same port with the same data; returns once it answers."""
        if self.process.poll() is None:
            return
        self.process = _spawn(self.directory, self.prefix)
        _wait_ready(self)


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a ZooKeeper server at ``host:port`` serves requests (``srvr``)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"srvr")
            return b"Mode:" in sock.recv(4096)
    except OSError:
        return False


def _spawn(directory: Path, prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    classpath = f"{JARS}/*:{CONF}"
    log = open(directory / "zookeeper.log", "ab")  # noqa: SIM115 - the server owns it
    try:
        return subprocess.Popen(
            [
                *prefix,
                "java",
                "-Xmx256m",
                f"-Dzookeeper.log.dir={directory}",
                "-cp",
                classpath,
                "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                str(directory / "zoo.cfg"),
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()


def _wait_ready(server: ZooKeeperServer, timeout: float = 60) -> None:
    server.wait_ready(
        "ZooKeeper",
        server.port,
        lambda: answers(server.host, server.port),
        server.directory / "zookeeper.log",
        timeout,
    )


def start_zookeeper(
    host: str = "127.0.0.1", prefix: Sequence[str] = ()
) -> Generator[ZooKeeperServer, None, None]:
    """Start a server listening on ``host``, its command run under ``prefix`` (for a test
    host of :mod:`wormhole.testing.netns`: its address and ``Network.command(name, [])``);
    yields it and stops it afterwards (a generator for fixtures)."""
    require(
        shutil.which("java") is not None and any(JARS.glob("zookeeper-3*.jar")),
        "ZooKeeper (Debian package zookeeper) and java",
    )
    directory = Path(tempfile.mkdtemp(prefix="wormhole-zookeeper-"))
    started: list[ZooKeeperServer] = []

    def start(port: int) -> ZooKeeperServer:
        (directory / "data").mkdir(exist_ok=True)
        (directory / "zoo.cfg").write_text(
            f"dataDir={directory / 'data'}\n"
            f"clientPort={port}\n"
            f"clientPortAddress={host}\n"
            "tickTime=500\n"
            "minSessionTimeout=1000\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=srvr,ruok\n"
        )
        server = ZooKeeperServer(host, port, directory, _spawn(directory, prefix), tuple(prefix))
        started.append(server)
        _wait_ready(server)
        return server

    try:
        server = start_on_free_port(start)
        yield server
    finally:
        for each in started:
            each.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)
