"""How far the ``mysql`` source is behind the server's binlog, for metrics (``lag()``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from wormhole.connectors.mysql.position import BinlogPosition, file_number
from wormhole.plugins.database_source import close_quietly

try:  # optional dependency: the `mysql` extra
    import pymysql

    HAVE_DRIVER = True
except ImportError:  # pragma: no cover - reported at open()
    HAVE_DRIVER = False


@dataclass(frozen=True, slots=True)
class Idle:
    """The stream waited between transactions with nothing read since the checkpoint
    ``emitted``: the binlog up to ``file:pos`` holds nothing more for the publisher log."""

    emitted: tuple[str, int]
    file: str
    pos: int
    at: float
    """When (``time.time()``)."""


class BinlogLag:
    """What the publisher log holds (the confirmed position), the stream's position when it
    last waited with nothing left to read, and the server's binlog sizes, asked on a
    connection of its own (``lag()`` is called at scrape time, from another thread)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.confirmed: tuple[str, int] | None = None
        self.idle: Idle | None = None
        self.read_ts_ms = int(time.time() * 1000)
        """When the last transaction read was written (until one is read: when the source
        was created, which makes ``lag_seconds`` a lower bound after a restart)."""
        self.conn: Any = None
        self.lock = threading.Lock()

    def confirm(self, position: BinlogPosition) -> None:
        self.confirmed = (position.file, position.pos)

    def nothing_pending(self, emitted: BinlogPosition | None, file: str, pos: int) -> None:
        """Between transactions, with nothing read since ``emitted``: the binlog up to
        ``file:pos`` (where the stream stands) holds nothing more for the publisher log."""
        done = (emitted.file, emitted.pos) if emitted is not None else ("", 0)
        self.idle = Idle(done, str(file), int(pos), time.time())

    def measure(self) -> dict[str, float]:
        """``lag_bytes``, binlog between what the publisher log holds and the server's binlog
        end; ``lag_seconds``, how long ago the last transaction read was written, while
        behind (else 0)."""
        confirmed = self.confirmed
        if confirmed is None:
            return {}  # still in the initial snapshot
        file, pos = confirmed
        idle = self.idle
        if idle is not None and idle.emitted == confirmed:
            file, pos = idle.file, idle.pos
        here = file_number(file)
        behind = 0
        for name, size in self._binlogs():
            number = file_number(name)
            if number > here:
                behind += size
            elif number == here:
                behind += max(0, size - pos)
        seconds = 0.0
        if behind:
            since = max(self.read_ts_ms / 1000.0, idle.at if idle is not None else 0.0)
            seconds = max(0.0, time.time() - since) if since else 0.0
        return {"lag_bytes": float(behind), "lag_seconds": seconds}

    def _binlogs(self) -> list[tuple[str, int]]:
        """The server's binlog files and their sizes."""
        with self.lock:
            try:
                if self.conn is None:
                    self.conn = pymysql.connect(
                        **{**self.settings, "read_timeout": 5, "connect_timeout": 5},
                        autocommit=True,
                    )
                with self.conn.cursor() as cur:
                    cur.execute("SHOW BINARY LOGS")
                    return [(str(r[0]), int(r[1])) for r in cur.fetchall()]
            except pymysql.err.Error:
                close_quietly(self.conn)
                self.conn = None
                raise

    def close(self) -> None:
        with self.lock:
            close_quietly(self.conn)
            self.conn = None
