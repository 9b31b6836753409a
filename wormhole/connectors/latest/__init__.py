"""The ``latest`` sink: the current row of every key, in a SQLite file.

A materialised view of the stream: inserts, updates and snapshot reads upsert the
after image, deletes remove the key. Each batch is one transaction, committed
(``synchronous=FULL``) before the batch is acknowledged. Replaying a stream from
an older datamarker converges to the same state, because per-key order holds.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from pydantic import Field

from wormhole.core.errors import SinkError
from wormhole.core.shard import canonical_key
from wormhole.core.update import Update
from wormhole.plugins.components import ComponentSpec, Options, SinkContext
from wormhole.plugins.hookspecs import hookimpl

SCHEMA = """
CREATE TABLE IF NOT EXISTS latest (
    source_table TEXT NOT NULL,
    key TEXT NOT NULL,
    row TEXT NOT NULL,
    op TEXT NOT NULL,
    position TEXT NOT NULL,
    ts_ms INTEGER,
    PRIMARY KEY (source_table, key)
)
"""


class LatestOptions(Options):
    """Keep the latest row of every key."""

    path: str = Field(description="SQLite file; may contain {application}")


class LatestSink:
    def __init__(self, options: LatestOptions) -> None:
        self.options = options
        self.db: sqlite3.Connection | None = None

    def open(self, context: SinkContext) -> None:
        try:
            path = self.options.path.format(application=context.application)
        except (KeyError, IndexError, ValueError) as exc:
            raise SinkError(
                f"applications.{context.application}.sink.path: {self.options.path!r} has an "
                f"unknown placeholder ({exc}); only {{application}} is available"
            ) from exc
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise SinkError(
                f"applications.{context.application}.sink.path: cannot open SQLite file "
                f"{path!r} ({exc}); fix the path or its permissions"
            ) from exc
        self.db = db

    def write(self, updates: list[Update]) -> None:
        db = self.db
        if db is None or not updates:
            return
        upserts = []
        deletes = []
        for u in updates:
            key = canonical_key(u.key).decode()
            if u.op == "d":
                deletes.append((u.table, key))
            else:
                upserts.append((u.table, key, bytes(u.after).decode(), u.op, u.position, u.ts_ms))
        db.execute("BEGIN IMMEDIATE")
        try:
            # Per-key order matters: apply in stream order, grouping only runs of one kind.
            if deletes and upserts:
                for u in updates:
                    key = canonical_key(u.key).decode()
                    if u.op == "d":
                        db.execute(
                            "DELETE FROM latest WHERE source_table = ? AND key = ?", (u.table, key)
                        )
                    else:
                        db.execute(
                            "INSERT OR REPLACE INTO latest VALUES (?, ?, ?, ?, ?, ?)",
                            (u.table, key, bytes(u.after).decode(), u.op, u.position, u.ts_ms),
                        )
            elif deletes:
                db.executemany("DELETE FROM latest WHERE source_table = ? AND key = ?", deletes)
            else:
                db.executemany("INSERT OR REPLACE INTO latest VALUES (?, ?, ?, ?, ?, ?)", upserts)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


@hookimpl
def wormhole_sinks() -> list[ComponentSpec]:
    return [
        ComponentSpec(
            kind="sink",
            name="latest",
            factory=LatestSink,
            options=LatestOptions,
            description="Keep the latest row of every key in a SQLite table (a live view).",
        )
    ]
