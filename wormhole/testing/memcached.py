"""A throwaway memcached server on a free loopback port.

memcached refuses to run as root, so as root it runs as ``nobody``. UDP is off
(``-U 0``). The server can be stopped and started again on the same port, or paused
(SIGSTOP) and resumed, to test what a sink does while a cache server is down or
does not answer.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wormhole.testing.helpers import ServerProcess, require, start_on_free_port


@dataclass
class MemcachedServer(ServerProcess):
    host: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes] = field(repr=False)
    extra_args: list[str] = field(default_factory=list, repr=False)

    @property
    def address(self) -> str:
        """``host:port``, as the ``memcache`` sink's ``servers`` option takes it."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def client(self, **kwargs: Any) -> Any:
        """A pymemcache ``Client`` for this server alone (needs ``pymemcache``)."""
        from pymemcache.client.base import Client

        options: dict[str, Any] = {"connect_timeout": 5, "timeout": 5, "allow_unicode_keys": True}
        options.update(kwargs)
        return Client((self.host, self.port), **options)

    def start(self) -> None:
        """Start (again) on the same port, empty; returns once it answers."""
        if self.process.poll() is None:
            return
        self.process = _spawn(self.directory, self.host, self.port, self.extra_args)
        _wait_ready(self)


def _user() -> list[str]:
    return ["-u", "nobody"] if os.geteuid() == 0 else []


def _spawn(directory: Path, host: str, port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    log = open(directory / "memcached.log", "ab")  # noqa: SIM115 - the server owns it
    try:
        return subprocess.Popen(
            ["memcached", *_user(), "-l", host, "-p", str(port), "-U", "0", *extra],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a memcached server at ``host:port`` answers a ``version`` command."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"version\r\n")
            return sock.recv(64).startswith(b"VERSION ")
    except OSError:
        return False


def _wait_ready(server: MemcachedServer, timeout: float = 30) -> None:
    server.wait_ready(
        "memcached",
        server.port,
        lambda: answers(server.host, server.port),
        server.directory / "memcached.log",
        timeout,
    )


def start_memcached(
    extra_args: list[str] | None = None,
) -> Generator[MemcachedServer, None, None]:
    """Start a server; yields it and stops it afterwards (a generator for fixtures)."""
    require(shutil.which("memcached") is not None, "memcached (Debian package memcached)")
    directory = Path(tempfile.mkdtemp(prefix="wormhole-memcached-"))
    extra = list(extra_args or [])
    started: list[MemcachedServer] = []

    def start(port: int) -> MemcachedServer:
        server = MemcachedServer(
            "127.0.0.1", port, directory, _spawn(directory, "127.0.0.1", port, extra), extra
        )
        started.append(server)
        _wait_ready(server)
        return server

    try:
        yield start_on_free_port(start)
    finally:
        for each in started:
            each.stop(kill=True)
        shutil.rmtree(directory, ignore_errors=True)
