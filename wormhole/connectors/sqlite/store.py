"""The built-in ``sqlite`` datamarker store: ``<state_dir>/state.db``."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from wormhole.core.errors import StateError, file_problem
from wormhole.plugins.components import Datamarker
from wormhole.plugins.sqlite import connect_durable, connect_read_only

SCHEMA = """
CREATE TABLE IF NOT EXISTS datamarkers (
    application TEXT NOT NULL,
    shard INTEGER NOT NULL,
    position INTEGER NOT NULL,
    logical TEXT NOT NULL DEFAULT '',
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (application, shard)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class SqliteDatamarkerStore:
    """``<state_dir>/state.db``: one row per flow, written in one transaction per save."""

    def __init__(self, filename: str = "state.db") -> None:
        self.filename = filename
        self.db: sqlite3.Connection | None = None
        self.path: Path | None = None
        self.lock = threading.RLock()
        """One connection serves every thread (the publisher's supervisor, a transport's
        readers): one statement or transaction at a time."""

    def open(self, pipeline: str, state_dir: Path) -> None:
        self.path = state_dir / self.filename
        try:
            db = connect_durable(self.path)
            db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise file_problem(self.path, exc, "open the datamarker store") from exc
        self.db = db

    def open_read_only(self, pipeline: str, state_dir: Path) -> None:
        """Open to read (``load``, ``get_meta``) only: nothing is created or written."""
        self.path = state_dir / self.filename
        if not self.path.exists():
            self.db = sqlite3.connect(":memory:", check_same_thread=False)
            self.db.executescript(SCHEMA)
            return
        try:
            db = connect_read_only(self.path)
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        except (OSError, sqlite3.Error) as exc:
            raise StateError(
                f"cannot read the datamarker store {self.path}: {exc}; give this user read "
                f"access to the state_dir and its files"
            ) from exc
        if not {"datamarkers", "meta"} <= tables:
            # Created by a publisher that is starting: nothing stored yet.
            db.close()
            db = sqlite3.connect(":memory:", check_same_thread=False)
            db.executescript(SCHEMA)
        self.db = db

    def _conn(self) -> sqlite3.Connection:
        if self.db is None:
            raise RuntimeError("datamarker store is not open")
        return self.db

    def load(self) -> dict[tuple[str, int], Datamarker]:
        with self.lock:
            rows = (
                self._conn()
                .execute("SELECT application, shard, position, logical FROM datamarkers")
                .fetchall()
            )
        return {(a, s): Datamarker(a, s, p, lg) for a, s, p, lg in rows}

    def save(self, datamarkers: Iterable[Datamarker]) -> None:
        now = int(time.time() * 1000)
        rows = [(d.application, d.shard, d.position, d.logical, now) for d in datamarkers]
        if not rows:
            return
        with self.lock:
            self._save(rows)

    def _save(self, rows: list[tuple[str, int, int, str, int]]) -> None:
        db = self._conn()
        try:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO datamarkers (application, shard, position, logical, updated_ms) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (application, shard) DO UPDATE SET "
                "position = excluded.position, logical = excluded.logical, "
                "updated_ms = excluded.updated_ms",
                rows,
            )
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise file_problem(self.path, exc, "save datamarkers") from exc

    def forget(self, application: str) -> int:
        db = self._conn()
        try:
            with self.lock:
                cursor = db.execute("DELETE FROM datamarkers WHERE application = ?", (application,))
        except sqlite3.Error as exc:
            raise file_problem(self.path or "state.db", exc, "delete datamarkers") from exc
        return cursor.rowcount

    def get_meta(self, key: str) -> str | None:
        with self.lock:
            row = self._conn().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self.lock:
            self._set_meta(key, value)

    def _set_meta(self, key: str, value: str) -> None:
        try:
            self._conn().execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )
        except sqlite3.Error as exc:
            raise file_problem(self.path or "state.db", exc, "write the datamarker store") from exc

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
