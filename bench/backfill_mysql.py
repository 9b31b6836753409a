"""MariaDB backfill while streaming, against a plain ``SELECT *`` of the same table through
pymysql, and the stream's lag during the backfill.

Run: ``make bench`` (or ``python bench/backfill_mysql.py --rows 200000``). Needs the MariaDB
server (Debian package mariadb-server).

A throwaway server is started and one table filled (``id INT PRIMARY KEY, rider INT, lat
DOUBLE, lon DOUBLE, note VARCHAR(40), at DATETIME(3), fare DECIMAL(8, 2)``). Baselines, in
the same run:

* ``SELECT * FROM events`` through pymysql's default cursor, every row fetched (what a
  Python program pays to take the table out of MariaDB);
* the same through an unbuffered cursor, ``fetchmany(8192)`` (the snapshot's reader);
* ``SELECT *`` again with DECIMAL and temporal values left as the server's text, as the
  backfill's connection leaves them (pymysql parses them into Python objects by default).

Then the source's chunks alone (``backfill_chunk`` over the whole table: key-order ``SELECT
… LIMIT`` turned into updates; no watermarks, no pipeline), and a pipeline (``mysql``
source, ``inprocess`` transport, a ``null`` sink for the table, a ``jsonl`` sink for a small
``ticks`` table a writer updates ~300 times a second). The stream's lag is the time from a
tick's write (the writer's clock in milliseconds, in the row: the binlog's own timestamps
are whole seconds) to its line in the jsonl file: first with no backfill, then during each
of ``--repeat`` backfills of the whole table (queued as ``wormhole backfill`` queues them).
A backfill's rate is its rows over the time from ``running`` to ``done``: rows read in
key-order chunks between watermarks written to the signal table, turned into updates,
sharded, appended and fsynced to the publisher log, fanned out to the null sink.
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

import pymysql.converters
import pymysql.cursors

sys.path.insert(0, str(Path(__file__).parent))
from events import mariadb_events
from lag import LagSampler, figures, time_backfills

from wormhole.core.backfill import BackfillStore
from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.testing.mysql import MariaDBServer, start_mariadb

BATCH = 8192


def select_rate(server: MariaDBServer, database: str, rows: int, text: bool = False) -> float:
    conv = None
    if text:
        conv = dict(pymysql.converters.conversions)
        for field_type in (0, 246, 7, 10, 11, 12, 13, 14):  # DECIMAL, dates and times, YEAR
            conv.pop(field_type, None)
    conn = server.connect(database, **({"conv": conv} if conv else {}))
    try:
        started = time.perf_counter()
        with conn.cursor() as cur:
            cur.execute("SELECT * FROM events")
            read = len(cur.fetchall())
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    assert read == rows, read
    return rows / elapsed


def unbuffered_rate(server: MariaDBServer, database: str, rows: int) -> float:
    conn = server.connect(database, cursorclass=pymysql.cursors.SSCursor)
    try:
        started = time.perf_counter()
        read = 0
        with conn.cursor() as cur:
            cur.execute("SELECT * FROM events")
            while batch := cur.fetchmany(BATCH):
                read += len(batch)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    assert read == rows, read
    return rows / elapsed


def chunks_rate(dsn: str, database: str, rows: int, chunk_size: int) -> float:
    """The backfill's own reads alone: every chunk through the source's ``backfill_chunk``
    (key-order SELECT, rows converted, updates built), no watermarks and no pipeline."""
    from wormhole.connectors.mysql.options import MySQLOptions
    from wormhole.connectors.mysql.source import MySQLSource

    source = MySQLSource(MySQLOptions(dsn=dsn, tables=[f"{database}.events"]))
    try:
        plan = source.backfill_plan("bench", f"{database}.events", None)
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

    def __init__(self, server: MariaDBServer, database: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.server, self.database, self.interval = server, database, interval
        self.halt = threading.Event()

    def run(self) -> None:
        conn = self.server.connect(self.database)
        with conn.cursor() as cur:
            n = 0
            while not self.halt.wait(self.interval):
                n += 1
                cur.execute(
                    "UPDATE ticks SET n = %s, at_ms = %s WHERE id = 1",
                    (n, int(time.time() * 1000)),
                )
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=4096)
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-backfill-mysql-"))
    servers = start_mariadb()
    server = next(servers)
    try:
        db = server.create_database()
        server.sql(
            *mariadb_events(args.rows),
            "CREATE TABLE ticks (id INT PRIMARY KEY, n INT, at_ms BIGINT)",
            "INSERT INTO ticks VALUES (1, 0, 0)",
            database=db,
        )
        selects = [select_rate(server, db, args.rows) for _ in range(args.repeat)]
        unbuffered = [unbuffered_rate(server, db, args.rows) for _ in range(args.repeat)]
        texts = [select_rate(server, db, args.rows, text=True) for _ in range(args.repeat)]
        dsn = server.dsn()
        chunks = [chunks_rate(dsn, db, args.rows, args.chunk_size) for _ in range(args.repeat)]
        ticks = work / "ticks.jsonl"
        text = f"""
pipeline: bench
state_dir: {work / "state"}
source: {{type: mysql, dsn: "{dsn}", tables: [{db}.events, {db}.ticks], snapshot: never}}
transport: {{type: inprocess}}
applications:
  nulls: {{filter: {{tables: [{db}.events]}}, sink: {{type: "null"}}}}
  ticks: {{filter: {{tables: [{db}.ticks]}}, sink: {{type: jsonl, path: "{ticks}"}}}}
"""
        pipeline = parse_pipeline(text, "bench.yml", env={})
        Publisher(pipeline, once=True).run()  # the start position
        publisher = Publisher(pipeline)
        runner = threading.Thread(target=publisher.run, daemon=True)
        runner.start()
        ticker, sampler = (
            Ticker(server, db, 0.003),
            LagSampler(ticks, lambda e: e["after"]["at_ms"]),
        )
        ticker.start()
        sampler.start()
        store = BackfillStore(pipeline.state_dir)
        try:
            quiet_start = time.time()
            time.sleep(3.0)  # the stream alone: the lag baseline
            quiet_end = time.time()
            rates, windows = time_backfills(
                store, f"{db}.events", args.rows, args.chunk_size, args.repeat
            )
            time.sleep(0.5)
        finally:
            ticker.halt.set()
            sampler.halt.set()
            publisher.request_stop()
            runner.join(60)
            store.close()
        select, plain, text, chunk, ours = (
            statistics.median(x) for x in (selects, unbuffered, texts, chunks, rates)
        )
        print(
            f"{args.rows:,} rows (7 columns), chunks of {args.chunk_size:,}, median of "
            f"{args.repeat} runs"
        )
        print(f"{'measure':<56}  {'rows/s':>10}  {'ratio':>6}")
        print(f"{'SELECT * FROM events, fetchall (baseline)':<56}  {select:>10,.0f}  {1.0:>6.2f}")
        print(
            f"{'unbuffered cursor read, fetchmany(8192)':<56}  {plain:>10,.0f}  "
            f"{plain / select:>6.2f}"
        )
        label = "SELECT *, DECIMAL and temporal values as text"
        print(f"{label:<56}  {text:>10,.0f}  {text / select:>6.2f}")
        label = "the backfill's chunks alone (SELECT ... LIMIT, to updates)"
        print(f"{label:<56}  {chunk:>10,.0f}  {chunk / select:>6.2f}")
        print(
            f"{'backfill -> publisher log -> null sink':<56}  {ours:>10,.0f}  {ours / select:>6.2f}"
        )
        print(f"  each backfill: {', '.join(f'{r:,.0f}' for r in rates)} rows/s")
        print("stream lag (write -> jsonl sink) of ~300 ticks/s:")
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
