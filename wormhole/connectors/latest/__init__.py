"""The ``latest`` sink: the current row of every key, in a SQLite file.

A materialised view of the stream: inserts, updates and snapshot reads upsert the
after image, deletes remove the key, a truncate empties the table. Each batch is
one transaction, committed (``synchronous=FULL``) before the batch is acknowledged.
Replaying a stream from an older datamarker converges to the same state, because
per-key order holds.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from pydantic import Field

from wormhole.core.errors import SinkError
from wormhole.core.shard import canonical_key
from wormhole.core.update import Update
from wormhole.plugins.components import (
    ComponentSpec,
    ComponentUse,
    Options,
    SinkContext,
    offer,
    template_problems,
)
from wormhole.plugins.sqlite import connect_durable

SCHEMA = """
CREATE TABLE IF NOT EXISTS latest (
    source_table TEXT NOT NULL,
    key TEXT NOT NULL,
    shard INTEGER NOT NULL,
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
            db = connect_durable(path, busy_timeout_ms=30_000)
            db.execute(SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(latest)")}
            if "shard" not in columns:  # a view made before truncates were kept per shard
                db.execute("ALTER TABLE latest ADD COLUMN shard INTEGER NOT NULL DEFAULT -1")
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
        db.execute("BEGIN IMMEDIATE")
        try:
            # Per-key order matters: apply in stream order, grouping runs of one kind.
            run: list[tuple[Any, ...]] = []
            run_kind = ""
            for u in updates:
                row: tuple[Any, ...]
                if u.op == "t":
                    kind, row = "t", (u.table, u.shard)
                elif u.op == "d":
                    kind, row = "d", (u.table, canonical_key(u.key).decode())
                else:
                    kind = "u"
                    row = (
                        u.table,
                        canonical_key(u.key).decode(),
                        u.shard,
                        bytes(u.after).decode(),
                        u.op,
                        u.position,
                        u.ts_ms,
                    )
                if kind != run_kind and run:
                    _apply(db, run_kind, run)
                    run = []
                run_kind = kind
                run.append(row)
            if run:
                _apply(db, run_kind, run)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


_STATEMENTS = {
    "u": "INSERT OR REPLACE INTO latest (source_table, key, shard, row, op, position, ts_ms) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)",
    "d": "DELETE FROM latest WHERE source_table = ? AND key = ?",
    # A truncate reaches every shard: each copy empties its own shard's rows.
    "t": "DELETE FROM latest WHERE source_table = ? AND shard = ?",
}


def _apply(db: sqlite3.Connection, kind: str, rows: list[tuple[Any, ...]]) -> None:
    db.executemany(_STATEMENTS[kind], rows)


def check_use(options: LatestOptions, use: ComponentUse) -> list[str]:
    """The path's placeholders, before any subscriber opens it."""
    hint = "only {application} is available"
    return template_problems(use, "path", options.path, hint, application="a")


wormhole_sinks = offer(
    ComponentSpec(
        kind="sink",
        name="latest",
        factory=LatestSink,
        options=LatestOptions,
        check=check_use,
        description="Keep the latest row of every key in a SQLite table (a live view).",
    )
)
