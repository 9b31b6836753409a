"""The backfill's drop window opens when the chunk is read, not only at its low watermark.

A database may show a transaction to the chunk's SELECT later than its commit record sorts
in the log: PostgreSQL makes a transaction visible when it leaves the proc array, after it
wrote its commit record, so a transaction committed just before the low watermark can be
invisible to the chunk read just after it (and InnoDB has the same gap). Its change then
reaches the stream *before* the low watermark, after the chunk was read: the chunk's older
row of that key must be dropped, or it overwrites the newer change at the high watermark.
Seen under load as one stale row in tests/test_backfill_postgres.py (the writer test). The
interleaving cannot be forced on a real server, so this test scripts it: its source is a
plugin-contract source double that replays a chosen stream (no service is replaced here).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from wormhole.core.backfill import Backfiller, BackfillStore
from wormhole.core.progress import Progress
from wormhole.core.update import Update
from wormhole.plugins.components import BackfillPlan, SourceBatch, Watermark

TABLE = "public.orders"


class ScriptedSource:
    """Backfills one table whose chunk the test gives; records the watermarks written."""

    def __init__(self, chunk: list[Update]) -> None:
        self.chunk = chunk
        self.watermarks: list[str] = []
        self.read = False

    def backfill_ready(self) -> bool:
        return True

    def backfill_plan(self, pipeline: str, table: str, where: str | None) -> BackfillPlan:
        return BackfillPlan(table=table, keys=["id"], estimate=len(self.chunk))

    def backfill_watermark(self, token: str) -> None:
        self.watermarks.append(token)

    def backfill_chunk(self, plan: BackfillPlan, after: Any, limit: int) -> list[Update]:
        if self.read:
            return []
        self.read = True
        return list(self.chunk)


def row(key: int, n: int, op: str = "r") -> Update:
    return Update.create(op=op, key={"id": key}, table=TABLE, after={"id": key, "n": n})


def test_a_change_between_the_chunk_read_and_its_low_watermark_drops_the_row(
    tmp_path: Path,
) -> None:
    source = ScriptedSource([row(1, 10), row(2, 20), row(3, 30)])
    store = BackfillStore(tmp_path)
    store.add(TABLE, None, None, chunk_size=10, pause_ms=0)
    backfiller = Backfiller(source, store, "p", Progress(logging.getLogger("t")), set)
    assert backfiller.step() is None  # picks up the request, reads its first chunk
    low, high = source.watermarks
    # The stream: key 2 changed by a transaction the chunk's read did not see, whose commit
    # sorts before the low watermark; then the low watermark; then key 3 changed.
    assert (
        backfiller.observe(SourceBatch([row(2, 21, "u")], None, Watermark(low, "0/10", "l1")))
        is None
    )
    emitted = backfiller.observe(
        SourceBatch([row(3, 31, "u")], None, Watermark(high, "0/20", "l2"))
    )
    assert emitted is not None
    assert [u.key for u in emitted.updates] == [{"id": 1}], emitted.updates
    store.close()
