"""Plain helpers behind the pytest fixtures (usable without pytest, too)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import pytest
import yaml

from wormhole.core.update import Envelope, Update

if TYPE_CHECKING:
    from wormhole.plugins.components import Source


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    """Skip the calling test when ``what`` is missing; under CI=true, fail instead."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"{what} is required in CI but is not available", pytrace=False)
    pytest.skip(f"{what} is not available")


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    It is chosen below the kernel's ephemeral range: a server that is stopped and started
    again on its port (a restarted database, a relay that cuts its clients) must get it
    back, and a port in the ephemeral range can meanwhile become the local end of any
    outgoing connection on the machine.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, 10_001)


def write_pipeline(path: str | os.PathLike[str], pipeline: dict[str, Any]) -> Path:
    """Write a pipeline dict as YAML; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return target


@dataclass
class CliResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (
            f"wormhole {' '.join(self.args)} -> exit {self.returncode}\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wormhole.cli", *args]


def start_cli(
    *args: str,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Start ``wormhole ARGS`` in the background, stdout and stderr captured as text."""
    return subprocess.Popen(
        cli_command(*args),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_cli(
    *args: str,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> CliResult:
    """Run ``wormhole ARGS`` in a subprocess and capture its output."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        cli_command(*args),
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(list(args), proc.returncode, proc.stdout, proc.stderr)


_envelope_decoder = msgspec.json.Decoder(Envelope)


def read_envelopes(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every envelope in a jsonl sink's file, as dicts (``[]`` if it does not exist).

    Each complete line is checked against the envelope contract on the way. A last line
    without its newline is not read: a write still in progress while a test polls the
    file, or a tail cut by ``kill -9`` that the sink removes when it starts again.
    """
    out = []
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # only the last line can lack its newline
                _envelope_decoder.decode(line)  # raises if a line breaks the contract
                out.append(msgspec.json.decode(line))
    except FileNotFoundError:
        return []
    return out


def children(parents: set[int], marker: bytes) -> list[int]:
    """The processes whose parent is in ``parents`` and whose command line holds ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid in parents and marker in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def subscriber_pids(parent: int) -> list[int]:
    """The ``wormhole subscribe`` processes that the ``wormhole run`` process ``parent`` started."""
    return children({parent}, b"subscribe")


S = TypeVar("S")


class ServerProcess:
    """Process control shared by the throwaway servers (``self.process``): stop (SIGTERM, or
    SIGKILL with ``kill``), pause (SIGSTOP: connections stay open, nothing answers) and
    resume (SIGCONT)."""

    process: subprocess.Popen[bytes]

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot exit
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(timeout=30)

    def pause(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGSTOP)

    def wait_ready(
        self, name: str, port: int, answers: Callable[[], bool], log: Path, timeout: float
    ) -> None:
        """Return once ``answers()``; fail with the tail of ``log`` if the server exits, or
        kill it after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not answers():
            if self.process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"{name} on port {port} exited with {self.process.returncode}:\n{tail}"
                )
            if time.monotonic() > deadline:
                self.stop(kill=True)
                raise RuntimeError(f"{name} on port {port} did not answer in {timeout}s")
            time.sleep(0.02)  # polling a starting server: nothing to wait on

    def resume(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)


def start_on_free_port(start: Callable[[int], S], attempts: int = 5) -> S:
    """``start(port)`` on a free port, again on another if it fails with RuntimeError:
    another process may have taken the port since :func:`free_port` saw it free."""
    for attempt in range(attempts):
        try:
            return start(free_port())
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def read_updates(source: Source, count: int, timeout: float = 30) -> list[Update]:
    """The next ``count`` updates of an open ``source``; fails after ``timeout`` seconds."""
    updates: list[Update] = []
    deadline = time.monotonic() + timeout
    while len(updates) < count:
        assert time.monotonic() < deadline, f"{len(updates)} of {count} updates: {updates!r:.4000}"
        batch = source.read(0.2)
        if batch is not None:
            updates.extend(batch.updates)
    return updates
