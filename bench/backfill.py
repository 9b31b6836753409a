"""PostgreSQL backfill while streaming, beside ``COPY … TO STDOUT`` of the same table, and
the stream's lag during the backfill.

Run: ``make bench`` (or ``python bench/backfill.py --rows 200000``). Needs the PostgreSQL
server binaries (Debian package postgresql).

A throwaway cluster is started and one table filled. Baselines, in the same run:

* ``COPY events TO STDOUT`` through psycopg2's ``copy_expert`` into a writer that only
  counts bytes (the fastest way to take a table out of PostgreSQL; a reference, not a target:
  it turns no row into an update. ``bench/snapshots.py`` measures the backfill against
  Debezium's incremental snapshot);
* the same table through a server-side cursor, ``fetchmany(8192)`` (the snapshot's reader).

Then a pipeline runs (``postgres`` source, ``inprocess`` transport, a ``null`` sink for the
table, a ``jsonl`` sink for a small ``ticks`` table a writer updates ~300 times a second).
The stream's lag is the time from a tick's commit (its ``ts_ms``) to its line in the jsonl
file, sampled by a thread tailing the file: first with no backfill, then during each of
``--repeat`` backfills of the whole table (queued as ``wormhole backfill`` queues them).
A backfill's rate is its rows over the time from ``running`` to ``done``: rows read in
key-order chunks between watermarks, turned into updates, sharded, appended and fsynced to
the publisher log, fanned out to the null sink.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg2

sys.path.insert(0, str(Path(__file__).parent))
from events import postgres_events
from lag import LagSampler, figures, time_backfills

from wormhole.core.backfill import BackfillStore
from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.testing.postgres import run_sql as sql
from wormhole.testing.postgres import start_postgres

BATCH = 8192


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: Any) -> int:
        self.bytes += len(data)
        return len(data)


def copy_rate(dsn: str, rows: int) -> float:
    conn = psycopg2.connect(dsn)
    try:
        sink = _Counter()
        started = time.perf_counter()
        with conn.cursor() as cur:
            cur.copy_expert("COPY events TO STDOUT", sink)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    assert sink.bytes > rows * 10
    return rows / elapsed


def cursor_rate(dsn: str, rows: int) -> float:
    conn = psycopg2.connect(dsn)
    try:
        started = time.perf_counter()
        read = 0
        with conn.cursor(name="bench") as cur:
            cur.itersize = BATCH
            cur.execute("SELECT * FROM events")
            while batch := cur.fetchmany(BATCH):
                read += len(batch)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    assert read == rows, read
    return rows / elapsed


def chunks_rate(dsn: str, rows: int, chunk_size: int) -> float:
    """The backfill's own reads alone: every chunk through the source's ``backfill_chunk``
    (key-order SELECT, rows as JSON, updates built), no watermarks and no pipeline."""
    from wormhole.connectors.postgres.options import PostgresOptions
    from wormhole.connectors.postgres.source import PostgresSource

    source = PostgresSource(PostgresOptions(dsn=dsn, tables=["public.events"]))
    try:
        plan = source.backfill_plan("bench", "public.events", None)
        started = time.perf_counter()
        after, read = None, 0
        while updates := source.backfill_chunk(plan, after, chunk_size):
            read += len(updates)
            after = [updates[-1].key[k] for k in plan.keys]
        elapsed = time.perf_counter() - started
    finally:
        source.close()
    assert read == rows, read
    return rows / elapsed


class Ticker(threading.Thread):
    """Updates the ticks table every ``interval`` seconds until stopped."""

    def __init__(self, dsn: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.interval = dsn, interval
        self.halt = threading.Event()

    def run(self) -> None:
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            n = 0
            while not self.halt.wait(self.interval):
                n += 1
                cur.execute("UPDATE ticks SET n = %s WHERE id = 1", (n,))
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=4096)
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-backfill-"))
    servers = start_postgres()
    server = next(servers)
    try:
        dsn = server.dsn(server.create_database())
        sql(
            dsn,
            *postgres_events(args.rows),
            "CREATE TABLE ticks (id int PRIMARY KEY, n int)",
            "INSERT INTO ticks VALUES (1, 0)",
        )
        copies = [copy_rate(dsn, args.rows) for _ in range(args.repeat)]
        cursors = [cursor_rate(dsn, args.rows) for _ in range(args.repeat)]
        ticks = work / "ticks.jsonl"
        text = f"""
pipeline: bench
state_dir: {work / "state"}
source: {{type: postgres, dsn: "{dsn}", tables: [public.events, public.ticks],
          snapshot: never}}
transport: {{type: inprocess}}
applications:
  nulls: {{filter: {{tables: [public.events]}}, sink: {{type: "null"}}}}
  ticks: {{filter: {{tables: [public.ticks]}}, sink: {{type: jsonl, path: "{ticks}"}}}}
"""
        pipeline = parse_pipeline(text, "bench.yml", env={})
        Publisher(pipeline, once=True).run()  # the slot (and the publication)
        chunks = [chunks_rate(dsn, args.rows, args.chunk_size) for _ in range(args.repeat)]
        publisher = Publisher(pipeline)
        runner = threading.Thread(target=publisher.run, daemon=True)
        runner.start()
        ticker, sampler = Ticker(dsn, 0.003), LagSampler(ticks, lambda e: e["source"]["ts_ms"])
        ticker.start()
        sampler.start()
        store = BackfillStore(pipeline.state_dir)
        try:
            quiet_start = time.time()
            time.sleep(3.0)  # the stream alone: the lag baseline
            quiet_end = time.time()
            rates, windows = time_backfills(
                store, "public.events", args.rows, args.chunk_size, args.repeat
            )
            time.sleep(0.5)
        finally:
            ticker.halt.set()
            sampler.halt.set()
            publisher.request_stop()
            runner.join(60)
            store.close()
        copy, cursor, chunk, ours = (statistics.median(x) for x in (copies, cursors, chunks, rates))
        print(
            f"{args.rows:,} rows (5 columns), chunks of {args.chunk_size:,}, median of "
            f"{args.repeat} runs"
        )
        print(f"{'measure':<56}  {'rows/s':>10}  {'ratio':>6}")
        print(f"{'COPY events TO STDOUT (a reference)':<56}  {copy:>10,.0f}  {1.0:>6.2f}")
        print(
            f"{'server-side cursor read, fetchmany(8192)':<56}  {cursor:>10,.0f}  "
            f"{cursor / copy:>6.2f}"
        )
        label = "the backfill's chunks alone (SELECT ... LIMIT, to updates)"
        print(f"{label:<56}  {chunk:>10,.0f}  {chunk / copy:>6.2f}")
        print(
            f"{'backfill -> publisher log -> null sink':<56}  {ours:>10,.0f}  {ours / copy:>6.2f}"
        )
        print(f"  each backfill: {', '.join(f'{r:,.0f}' for r in rates)} rows/s")
        print("stream lag (commit -> jsonl sink) of ~300 ticks/s:")
        print(f"  {'without a backfill':<24} {figures(sampler.between(quiet_start, quiet_end))}")
        during = [lag for start, end in windows for lag in sampler.between(start, end)]
        print(f"  {'during the backfills':<24} {figures(during)}")
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
