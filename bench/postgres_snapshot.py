"""PostgreSQL initial snapshot -> publisher log -> null sink, against a raw cursor read.

Run: ``make bench`` (or ``python bench/postgres_snapshot.py --rows 500000``). Needs the
PostgreSQL server binaries (Debian package postgresql).

A throwaway cluster is started and one table filled. The baseline reads the table through
a psycopg2 server-side cursor, ``fetchmany`` in batches as the source does (no conversion:
the ceiling for any Python reader). Then ``wormhole run --once`` semantics in-process take
the initial snapshot of the same table to a null sink (rows to updates, shard, append +
fsync to the publisher log, fan out, acknowledge), with progress reported as log lines.
Both are timed from start to the last row; the median of ``--repeat`` runs is printed with
its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg2

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.testing.postgres import run_sql as sql
from wormhole.testing.postgres import start_postgres

BATCH = 8192


def raw_read(dsn: str, rows: int) -> float:
    conn = psycopg2.connect(dsn)
    try:
        started = time.perf_counter()
        with conn.cursor(name="bench") as cur:
            cur.itersize = BATCH
            cur.execute("SELECT * FROM events")
            read = 0
            while batch := cur.fetchmany(BATCH):
                read += len(batch)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    assert read == rows, read
    return rows / elapsed


def snapshot_rate(dsn: str, work: Path, name: str, rows: int) -> float:
    text = f"""
pipeline: {name}
state_dir: {work / name}
source: {{type: postgres, dsn: "{dsn}", tables: [public.events], snapshot: initial}}
transport: {{type: inprocess}}
applications:
  nulls: {{sink: {{type: "null"}}}}
"""
    pipeline = parse_pipeline(text, "bench.yml", env={})
    gc.collect()
    started = time.perf_counter()
    summary = Publisher(pipeline, once=True).run()
    elapsed = time.perf_counter() - started
    assert summary.source_updates == rows, summary
    return rows / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-pg-snapshot-"))
    servers = start_postgres()
    server = next(servers)
    try:
        raw_rates, rates = [], []
        for attempt in range(args.repeat):
            dsn = server.dsn(server.create_database())
            sql(
                dsn,
                "CREATE TABLE events (id int PRIMARY KEY, rider int, lat float8, lon float8, "
                "note text)",
                f"INSERT INTO events SELECT g, g % 5000, 12.97 + g * 1e-7, 77.59, "
                f"'rider ' || (g % 5000) FROM generate_series(1, {args.rows}) g",
                "ANALYZE events",
            )
            raw_rates.append(raw_read(dsn, args.rows))
            rates.append(snapshot_rate(dsn, work, f"bench{attempt}", args.rows))
            server.drop_database(dsn.rsplit("dbname=", 1)[1].split()[0])
        raw, ours = statistics.median(raw_rates), statistics.median(rates)
        print(f"{args.rows:,} rows (5 columns), median of {args.repeat} runs")
        print(f"{'measure':<52}  {'rows/s':>10}  {'ratio':>6}")
        print(f"{'raw psycopg2 server-side cursor read':<52}  {raw:>10,.0f}  {1.0:>6.2f}")
        print(f"{'snapshot -> publisher log -> null sink':<52}  {ours:>10,.0f}  {ours / raw:>6.2f}")
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
