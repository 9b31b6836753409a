"""Helpers for TCP transport tests: processes, logs, a library subscriber in a thread."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from wormhole.connectors.tcp.client import Subscriber
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

    def __init__(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            cli_command(*args),
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr_lines: list[str] = []
        self.stdout = ""
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 60) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.stdout = out or ""
        self._reader.join(5)
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
