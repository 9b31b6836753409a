"""A backfill chunk and a transaction PostgreSQL has logged but not yet made visible.

A transaction writes its commit record into the WAL, and only a moment later is it marked
committed and visible to new snapshots. A low watermark written in that moment comes after
the transaction in the stream, while the chunk read right after it does not see the
transaction: the chunk's row is older than the change the stream delivers before the
watermark, and must not follow it. The moment is microseconds long on an idle server and
cannot be produced on demand, so this test produces its order of events with a real server,
a real stream and a real chunk, moving one step: the transaction commits after the chunk
is read and before the low watermark is written, which gives the stream and the chunk
exactly what the race gives them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import psycopg2

from wormhole.connectors.postgres.backfill import Invisible
from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.connectors.postgres.source import PostgresSource
from wormhole.core.backfill import Backfiller, BackfillStore
from wormhole.core.update import Update
from wormhole.plugins.components import SourceContext
from wormhole.plugins.progress import Progress
from wormhole.testing.helpers import read_updates
from wormhole.testing.postgres import run_sql as sql


class _CommitBeforeTheLowWatermark:
    """The real source, whose chunk is read while ``writer``'s transaction runs; that
    transaction commits right after, and the low watermark is written only then."""

    def __init__(self, source: PostgresSource, writer: Any) -> None:
        self.source = source
        self.writer = writer
        self.low: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def backfill_watermark(self, token: str) -> None:
        if token.endswith(".low") and self.low is None:
            self.low = token  # written once the chunk is read
            return
        self.source.backfill_watermark(token)

    def backfill_chunk(self, plan: Any, after: Any, limit: int) -> list[Update]:
        rows = self.source.backfill_chunk(plan, after, limit)
        if self.writer is not None:
            self.writer.commit()
            self.writer = None
        assert self.low is not None
        self.source.backfill_watermark(self.low)
        return rows


def test_a_change_committed_before_the_low_watermark_but_unseen_by_the_chunk_wins(
    tmp_path: Path, postgres_dsn: str
) -> None:
    sql(
        postgres_dsn,
        "CREATE TABLE items (id int PRIMARY KEY, note text)",
        "INSERT INTO items SELECT g, 'old' FROM generate_series(1, 5) g",
    )
    source = PostgresSource(PostgresOptions(dsn=postgres_dsn, tables=["public.items"], slot="vis"))
    stop = threading.Event()
    source.open(SourceContext("vis", tmp_path / "vis", 1, stop, logging.getLogger("t")), None)
    writer = psycopg2.connect(postgres_dsn)
    store = BackfillStore(tmp_path)
    try:
        assert len(read_updates(source, 5)) == 5  # the initial snapshot
        with writer.cursor() as cur:
            cur.execute("SET synchronous_commit TO on")
            cur.execute("UPDATE items SET note = 'new' WHERE id = 3")
        scripted = _CommitBeforeTheLowWatermark(source, writer)
        backfiller = Backfiller(scripted, store, "vis", Progress(), lambda: set())  # type: ignore[arg-type]
        store.add("public.items", None, None, chunk_size=100, pause_ms=0)
        streamed: list[Update] = []
        emitted: list[Update] = []
        for _ in range(200):
            if backfiller.step() is not None:
                break  # the table's end
            batch = source.read(0.2)
            if batch is None:
                continue
            streamed.extend(batch.updates)
            emission = backfiller.observe(batch)
            if emission is not None:
                emitted.extend(emission.updates)
                if emission.updates:
                    break
        assert scripted.low is not None and scripted.writer is None, "no chunk was read"
    finally:
        writer.close()
        source.close()
        store.close()
    changes = [(u.op, u.key["id"]) for u in streamed if u.table == "public.items"]
    assert changes == [("u", 3)], changes
    rows = {u.key["id"]: bytes(u.after) for u in emitted}
    # The chunk read the row as 'old'; the stream's 'new' came before the low watermark and
    # is the newer one: the chunk's row of key 3 is dropped, the others are emitted.
    assert sorted(rows) == [1, 2, 4, 5], rows


def test_the_invisible_transactions_follow_the_32_bit_circle_of_transaction_ids() -> None:
    # xid8 values from pg_current_snapshot() carry an epoch; the stream's ids do not.
    epoch = 3 << 32
    unseen = Invisible(epoch + 1000, [epoch + 990, epoch + 995])
    assert 990 in unseen and 995 in unseen
    assert 1000 in unseen and 1001 in unseen  # from xmax on
    assert 989 not in unseen and 999 not in unseen
    # xmax just before the 32-bit wrap: the ids after the wrap are newer, so not seen.
    wrapping = Invisible(epoch + 0xFFFFFFF0, [epoch + 0xFFFFFFE0])
    assert 0xFFFFFFE0 in wrapping and 0xFFFFFFF5 in wrapping and 5 in wrapping
    assert 0xFFFFFFE1 not in wrapping and 0xFFFFFF00 not in wrapping
