"""SQLite helpers of the plugin contract, for a plugin that keeps state in a SQLite file
(the built-in ``sqlite`` datamarker store, the ``latest`` sink): a connection whose commits
are durable when they return, and one that only reads."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect_durable(path: str | Path, busy_timeout_ms: int = 10_000) -> sqlite3.Connection:
    """A SQLite connection in autocommit mode whose commits are durable when they return
    (WAL, synchronous=FULL), shared between threads, waiting out other writers."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


def connect_read_only(path: str | Path) -> sqlite3.Connection:
    """A read-only SQLite connection that writes nothing, not even in a directory this user
    may not write (``wormhole status`` as another user). A WAL database whose ``-wal`` and
    ``-shm`` files are gone (no writer open) is read as immutable."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError:
        db.close()
        if Path(f"{path}-wal").exists():
            raise
    return sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
