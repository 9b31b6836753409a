"""Helpers for TCP transport tests: processes, logs, a library subscriber in a thread,
a subscriber speaking the protocol by hand, and a publisher end in the test process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.client import Subscriber
from wormhole.connectors.tcp.server import TcpTransport
from wormhole.core.hub import ApplicationRuntime, FlowState, Hub
from wormhole.core.pipeline import load_pipeline
from wormhole.testing import write_pipeline
from wormhole.testing.helpers import cli_command


def tcp_pipeline(
    tmp_path: Path,
    port: int,
    applications: dict[str, Any],
    source_options: dict[str, Any] | None = None,
    **transport: Any,
) -> Path:
    source = {"type": "filelog", "path": str(tmp_path / "data"), "poll_interval_ms": 20}
    return write_pipeline(
        tmp_path / "tcp.yml",
        {
            "pipeline": "tcp",
            "state_dir": str(tmp_path / "state"),
            "source": {**source, **(source_options or {})},
            "transport": {"type": "tcp", "listen": f"127.0.0.1:{port}", **transport},
            "delivery": {"datamarker_interval_ms": 50},
            "applications": applications,
        },
    )


class Process:
    """A `wormhole` subprocess whose stderr is collected as it runs."""

    def __init__(
        self,
        *args: str,
        cwd: Path,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """``prefix``: what the command runs under (``ip netns exec HOST``: on a test host)."""
        self.args = args
        self.proc = subprocess.Popen(
            [*prefix, *cli_command(*args)],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []
        # Each stream has one reader (`communicate` would read stderr too, and take lines
        # from under this one's feet).
        self._readers = [
            threading.Thread(target=self._collect, args=(stream, lines), daemon=True)
            for stream, lines in (
                (self.proc.stderr, self.stderr_lines),
                (self.proc.stdout, self.stdout_lines),
            )
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _collect(stream: Any, lines: list[str]) -> None:
        with stream:
            for line in stream:
                lines.append(line)

    @property
    def stdout(self) -> str:
        return "".join(self.stdout_lines)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 60) -> int:
        self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(5)
        return self.proc.returncode

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class LibrarySubscriber:
    """A wormhole.Subscriber running in a thread of the test, recording what it sees."""

    def __init__(self, app: str, port: int, **options: Any) -> None:
        self.notices: list[tuple[float, list[int], list[int]]] = []
        self.updates: list[Any] = []
        self.lock = threading.Lock()
        self.sub = Subscriber(app, [f"127.0.0.1:{port}"], **options)
        self.sub.on_shard_notice(self._notice)
        self.sub.on_updates(self._updates)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _notice(self, assigned: list[int], revoked: list[int]) -> None:
        with self.lock:
            self.notices.append((time.monotonic(), assigned, revoked))

    def _updates(self, flow: Any, batch: list[Any]) -> None:
        with self.lock:
            self.updates.extend(batch)

    def _run(self) -> None:
        try:
            self.sub.run()
        except BaseException as exc:
            self.error = exc

    def start(self) -> LibrarySubscriber:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.sub.stop()
        self.thread.join(30)

    def owned(self) -> set[int]:
        return set(self.sub.assigned)


class RawSubscriber:
    """The subscriber protocol spoken by hand, so a test decides when each frame is
    read and acknowledged (and the publisher's timeouts must be long: no heartbeats)."""

    def __init__(self, address: str, app: str, credits: int = 8) -> None:
        host, port = p.parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.sendall(p.preamble())
        hello = p.Hello(
            version=p.SUBSCRIBE_VERSION, application=app, instance="raw", credits=credits
        )
        self.sock.sendall(p.encode(p.HELLO, hello))
        kind, _ = p.read_frame(self.sock, 1 << 30)
        assert kind == p.WELCOME, p.NAMES.get(kind, kind)
        self.owned: set[int] = set()

    def read(self, expected: int) -> Any:
        """The next frame other than a heartbeat, which must be of type ``expected``."""
        while True:
            kind, body = p.read_frame(self.sock, 1 << 30)
            if kind != p.HEARTBEAT:
                break
        assert kind == expected, f"got {p.NAMES.get(kind, kind)}, expected {p.NAMES[expected]}"
        return body

    def notice(self) -> p.Notice:
        """Read a notice, take it on and confirm it."""
        notice: p.Notice = self.read(p.NOTICE)
        self.owned |= set(notice.assigned)
        self.owned -= set(notice.revoked)
        self.sock.sendall(p.encode(p.NOTICE_ACK, p.NoticeAck(id=notice.id)))
        return notice

    def ack(self, batch: p.BatchFrame) -> None:
        """Acknowledge a batch as the protocol says: datamarkers of owned shards only."""
        datamarkers = {s: v for s, v in batch.datamarkers.items() if s in self.owned}
        self.sock.sendall(p.encode(p.ACK, p.Ack(id=batch.id, datamarkers=datamarkers)))

    def leave(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(p.encode(p.BYE, p.Bye(reason="test")))
        p.close_socket(self.sock)


@contextlib.contextmanager
def publisher_end(
    tmp_path: Path, shards: int, **transport: Any
) -> Iterator[tuple[Hub, ApplicationRuntime, TcpTransport]]:
    """A real hub and TCP transport in the test process, listening, for application
    ``a`` with flows at 0: no tailer and no caravan, so the test delivers frames."""
    path = write_pipeline(
        tmp_path / "hub.yml",
        {
            "pipeline": "hub",
            "state_dir": str(tmp_path / "state"),
            "dataset": {"shards": shards},
            "source": {"type": "filelog", "path": str(tmp_path / "data")},
            "transport": {"type": "tcp", "heartbeat_timeout_ms": 120_000, **transport},
            "applications": {"a": {}},
        },
    )
    pipeline = load_pipeline(path)
    pipeline.state_dir.mkdir(parents=True, exist_ok=True)
    app = ApplicationRuntime(
        config=pipeline.applications["a"],
        flows=[FlowState("a", shard, 0, 0, 0) for shard in range(shards)],
        filter=None,
    )
    hub = Hub(pipeline, {"a": app})
    hub.local_subscribers = False
    server = TcpTransport(pipeline.transport.options)
    server.start(hub)
    try:
        yield hub, app, server
    finally:
        server.stop(drain=False)


def stop_all(processes: list[Process]) -> None:
    """SIGCONT (a paused one too) and SIGTERM to every process still running, then wait for
    each; one that does not exit within 60 s is killed."""
    for process in processes:
        if process.proc.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.proc.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.proc.kill()
            process.wait(10)
