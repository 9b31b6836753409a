"""The backfill queue: ``<state_dir>/backfills.sqlite``, where ``wormhole backfill`` (or an
application's ``start: {backfill: [T]}``) queues requests and the publisher's
:class:`~wormhole.core.backfill.Backfiller` records their progress.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wormhole.core.datamarkers import connect_durable, connect_read_only
from wormhole.core.errors import BackfillError, StateError, file_problem

FILENAME = "backfills.sqlite"
ACTIVE = ("queued", "running")
"""States of a request that is not finished."""
FINISHED = ("done", "cancelled", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS backfills (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    source_table TEXT NOT NULL,
    condition TEXT,
    application TEXT,
    chunk_size INTEGER NOT NULL,
    pause_ms INTEGER NOT NULL,
    state TEXT NOT NULL,
    after_key TEXT,
    rows INTEGER NOT NULL DEFAULT 0,
    read INTEGER NOT NULL DEFAULT 0,
    dropped INTEGER NOT NULL DEFAULT 0,
    chunks INTEGER NOT NULL DEFAULT 0,
    estimate INTEGER,
    origin TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL
)
"""
_COLUMNS = (
    "id, source_table, condition, application, chunk_size, pause_ms, state, after_key, rows, "
    "read, dropped, chunks, estimate, origin, error, created_ms, updated_ms"
)


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class BackfillRequest:
    """One backfill, as stored."""

    id: int
    table: str
    where: str | None
    application: str | None
    """The one application it is for; None: every application."""
    chunk_size: int
    pause_ms: int
    state: str
    """queued | running | done | cancelled | failed"""
    after: list[Any] | None
    """The key of the last row of the last chunk whose rows are durable (None: none yet)."""
    rows: int
    """Rows emitted (read, less those a change in the window made stale)."""
    read: int
    """Rows read from the table."""
    dropped: int
    """Rows dropped because the stream changed their key while their chunk was read."""
    chunks: int
    estimate: int | None
    origin: str
    """``command`` (``wormhole backfill``) or ``start`` (an application's start)."""
    error: str
    created_ms: int
    updated_ms: int

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> BackfillRequest:
        values = list(row)
        values[7] = None if values[7] is None else json.loads(values[7])
        return cls(*values)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "table": self.table,
            "where": self.where,
            "application": self.application,
            "state": self.state,
            "rows": self.rows,
            "read": self.read,
            "dropped": self.dropped,
            "chunks": self.chunks,
            "estimate": self.estimate,
            "after": self.after,
            "chunk_size": self.chunk_size,
            "pause_ms": self.pause_ms,
            "origin": self.origin,
            "error": self.error,
            "created_ms": self.created_ms,
            "updated_ms": self.updated_ms,
        }

    def describe(self) -> str:
        whom = f"application {self.application}" if self.application else "every application"
        where = f" where {self.where}" if self.where else ""
        return f"backfill {self.id} of {self.table}{where} for {whom}"


class BackfillStore:
    """``<state_dir>/backfills.sqlite``: the requests and their progress, shared by the
    publisher and the ``wormhole backfill`` command (another process)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILENAME
        self.lock = threading.Lock()
        try:
            self.db = connect_durable(self.path, busy_timeout_ms=30_000)
            self.db.execute(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise file_problem(self.path, exc, "open the backfill queue") from exc

    @classmethod
    def exists(cls, state_dir: Path) -> bool:
        return (Path(state_dir) / FILENAME).exists()

    def close(self) -> None:
        with self.lock:
            self.db.close()

    def _select(self, where: str = "", args: tuple[Any, ...] = ()) -> list[BackfillRequest]:
        with self.lock:
            rows = self.db.execute(
                f"SELECT {_COLUMNS} FROM backfills {where} ORDER BY id", args
            ).fetchall()
        return [BackfillRequest.from_row(r) for r in rows]

    def all(self) -> list[BackfillRequest]:
        return self._select()

    def active(self) -> list[BackfillRequest]:
        return self._select("WHERE state IN ('queued', 'running')")

    def get(self, request_id: int) -> BackfillRequest | None:
        found = self._select("WHERE id = ?", (request_id,))
        return found[0] if found else None

    def add(
        self,
        table: str,
        where: str | None,
        application: str | None,
        chunk_size: int,
        pause_ms: int,
        estimate: int | None = None,
        origin: str = "command",
    ) -> BackfillRequest:
        """Queue a backfill; BackfillError if one of the same table is already queued or
        running for an overlapping audience (every application, or the same one)."""
        now = _now_ms()
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                rows = self.db.execute(
                    "SELECT id, application, state FROM backfills WHERE source_table = ? AND "
                    "state IN ('queued', 'running')",
                    (table,),
                ).fetchall()
                for other_id, other_app, state in rows:
                    if other_app is None or application is None or other_app == application:
                        whom = f"application {other_app}" if other_app else "every application"
                        raise BackfillError(
                            f"--table {table}: backfill {other_id} of that table for {whom} is "
                            f"already {state}; wait for it (wormhole status shows it) or "
                            f"cancel it (wormhole backfill PIPELINE --cancel {other_id})"
                        )
                cursor = self.db.execute(
                    "INSERT INTO backfills (source_table, condition, application, chunk_size, "
                    "pause_ms, state, estimate, origin, created_ms, updated_ms) VALUES "
                    "(?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?)",
                    (table, where, application, chunk_size, pause_ms, estimate, origin, now, now),
                )
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        request = self.get(int(cursor.lastrowid or 0))
        assert request is not None
        return request

    def cancel(self, request_id: int) -> BackfillRequest:
        """Cancel a queued or running backfill; BackfillError if there is none such (one that
        is already finished says how it ended)."""
        with self.lock:
            cursor = self.db.execute(
                "UPDATE backfills SET state = 'cancelled', updated_ms = ? WHERE id = ? AND "
                "state IN ('queued', 'running')",
                (_now_ms(), request_id),
            )
        request = self.get(request_id)
        if request is None:
            raise BackfillError(
                f"--cancel {request_id}: there is no such backfill in {self.path} "
                f"(wormhole backfill PIPELINE --list lists them)"
            )
        if cursor.rowcount != 1:
            raise BackfillError(
                f"--cancel {request_id}: {request.describe()} is already {request.state}"
            )
        return request

    def start(self, request_id: int, estimate: int | None) -> bool:
        """queued -> running; False if it is no longer queued (cancelled meanwhile)."""
        with self.lock:
            cursor = self.db.execute(
                "UPDATE backfills SET state = 'running', estimate = COALESCE(?, estimate), "
                "updated_ms = ? WHERE id = ? AND state IN ('queued', 'running')",
                (estimate, _now_ms(), request_id),
            )
        return cursor.rowcount == 1

    def progress(
        self, request_id: int, after: list[Any] | None, rows: int, read: int, dropped: int
    ) -> bool:
        """A chunk's rows are durable: add them; False if the request is no longer running."""
        with self.lock:
            cursor = self.db.execute(
                "UPDATE backfills SET after_key = ?, rows = rows + ?, read = read + ?, "
                "dropped = dropped + ?, chunks = chunks + 1, updated_ms = ? WHERE id = ? AND "
                "state = 'running'",
                (
                    None if after is None else json.dumps(after),
                    rows,
                    read,
                    dropped,
                    _now_ms(),
                    request_id,
                ),
            )
        return cursor.rowcount == 1

    def finish(self, request_id: int, state: str, error: str = "") -> None:
        with self.lock:
            self.db.execute(
                "UPDATE backfills SET state = ?, error = ?, updated_ms = ? WHERE id = ? AND "
                "state IN ('queued', 'running')",
                (state, error, _now_ms(), request_id),
            )


def summary(state_dir: Path) -> list[dict[str, Any]]:
    """Every backfill of a state dir (for ``wormhole status``), oldest first; [] if none."""
    if not BackfillStore.exists(state_dir):
        return []
    path = Path(state_dir) / FILENAME
    try:
        db = connect_read_only(path)
    except sqlite3.Error as exc:
        raise StateError(
            f"cannot read the backfill queue {path}: {exc}; give this user read access to the "
            f"state_dir and its files"
        ) from exc
    try:
        rows = db.execute(f"SELECT {_COLUMNS} FROM backfills ORDER BY id").fetchall()
    except sqlite3.OperationalError:
        return []  # created but not initialised yet
    finally:
        db.close()
    return [BackfillRequest.from_row(r).as_dict() for r in rows]


__all__ = ["ACTIVE", "FILENAME", "FINISHED", "BackfillRequest", "BackfillStore", "summary"]
