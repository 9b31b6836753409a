"""Where an initial snapshot's time goes, stage by stage, against a backfill's chunks.

Run: ``python bench/snapshot_stages.py --db postgres --rows 200000`` (or ``mariadb``). Needs
the database's server (Debian packages postgresql, mariadb-server).

One table (as in ``bench/snapshots.py``) is read several ways in one process, each timed
from its start to its last row, with this process's CPU seconds and (PostgreSQL) the CPU
seconds of the server processes that served it (``/proc``), per row:

* the driver alone: the snapshot's own SELECT, fetched and dropped (server and driver);
* the source's snapshot alone: ``read()`` until the stream would start, updates built
  (adds turning rows into updates: decoding values, encoding each row's JSON);
* the backfill's chunks alone: ``backfill_chunk`` over the whole table;
* the initial snapshot in a pipeline, as ``wormhole run --once`` runs it, in-process (adds
  sharding, encoding the publisher-log records, writing and fsyncing them, fanning out to
  a ``null`` sink).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from events import mariadb_events, null_sink_pipeline, postgres_events

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.plugins.components import SourceContext

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system, every thread) of process ``root`` and of each child,
    by pid; ``root``'s own figure includes its children that exited (the kernel adds
    theirs to their parent's when it reaps them)."""
    found: dict[int, float] = {}
    for pid in [str(root), *(p for p in os.listdir("/proc") if p.isdigit())]:
        fields = _stat(pid)
        if fields is None or (pid != str(root) and fields[1] != str(root)):
            continue
        own = fields[11:15] if pid == str(root) else fields[11:13]
        found[int(pid)] = sum(int(f) for f in own) / TICKS
    return found


def server_cpu(before: dict[int, float], after: dict[int, float], root: int) -> float:
    """The CPU seconds the server spent between two :func:`tree_cpu` readings: a child
    that exited in between is in ``root``'s figure with its whole life, less what it had
    spent before."""
    total = after.get(root, 0.0) - before.get(root, 0.0)
    for pid, cpu in after.items():
        if pid != root:
            total += cpu - before.get(pid, 0.0)
    for pid, cpu in before.items():
        if pid != root and pid not in after:
            total -= cpu
    return total


class Stage:
    def __init__(self, label: str, rows: int, server: int) -> None:
        self.label, self.rows, self.server = label, rows, server

    def __enter__(self) -> Stage:
        gc.collect()
        self.before = tree_cpu(self.server)
        self.cpu = time.process_time()
        self.started = time.perf_counter()
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:
            return
        wall = time.perf_counter() - self.started
        cpu = time.process_time() - self.cpu
        server = server_cpu(self.before, tree_cpu(self.server), self.server)
        per_row = 1e6 / self.rows
        print(
            f"  {self.label:<46} {self.rows / wall:>10,.0f} {cpu * per_row:>8.2f} "
            f"{server * per_row:>8.2f}",
            flush=True,
        )


def context(work: Path, name: str) -> SourceContext:
    return SourceContext(
        pipeline=name,
        state_dir=work / name,
        shards=16,
        stop=threading.Event(),
        log=logging.getLogger("bench"),
    )


def read_snapshot(source: Any, rows: int) -> None:
    read = 0
    while source.phase == "snapshot":
        batch = source.read(1.0)
        if batch is not None:
            read += len(batch.updates)
    assert read == rows, read


def read_chunks(source: Any, table: str, rows: int, chunk_size: int) -> None:
    plan = source.backfill_plan("bench", table, None)
    after, read = None, 0
    while updates := source.backfill_chunk(plan, after, chunk_size):
        read += len(updates)
        after = [updates[-1].key[k] for k in plan.keys]
    assert read == rows, read


def pipeline_run(work: Path, name: str, source: str, rows: int) -> None:
    text = null_sink_pipeline(work, name, source)
    summary = Publisher(parse_pipeline(text, "bench.yml", env={}), once=True).run()
    assert summary.source_updates == rows, summary


def chunks_then_pipeline(
    work: Path, source: Any, table: str, spec: str, rows: int, chunk_size: int, server: int
) -> None:
    """The last two stages: the backfill's chunks alone (``source``, closed after), then
    the whole snapshot in a pipeline of source ``spec`` (YAML)."""
    try:
        with Stage(f"backfill chunks alone ({chunk_size:,} rows)", rows, server):
            read_chunks(source, table, rows, chunk_size)
    finally:
        source.close()
    with Stage("snapshot -> publisher log -> null sink", rows, server):
        pipeline_run(work, f"whole-{spec[7:12]}", spec, rows)


def postgres(work: Path, rows: int, chunk_size: int) -> None:
    import psycopg2

    from wormhole.connectors.postgres.options import PostgresOptions
    from wormhole.connectors.postgres.source import PostgresSource
    from wormhole.testing.postgres import run_sql, start_postgres

    servers = start_postgres()
    server = next(servers)
    try:
        dsn = server.dsn(server.create_database())
        run_sql(
            dsn,
            *postgres_events(rows),
            "CREATE PUBLICATION wormhole_bench FOR TABLE events",  # the chunks' pipeline
        )
        backends = int((server.directory / "data" / "postmaster.pid").read_text().split()[0])

        print(f"PostgreSQL: {rows:,} rows (5 columns)")
        print(f"  {'stage':<46} {'rows/s':>10} {'µs/row':>8} {'server':>8}")
        conn = psycopg2.connect(dsn)
        label = "driver: SELECT *, server-side cursor, 8192"
        with Stage(label, rows, backends), conn.cursor(name="bench") as cur:
            cur.itersize = 8192
            cur.execute("SELECT * FROM events")
            while cur.fetchmany(8192):
                pass
        conn.close()
        # Code from before snapshot_readers reads with one connection, whatever is asked.
        parallel = "snapshot_readers" in PostgresOptions.model_fields
        for n, readers in enumerate((1, 2) if parallel else (1,)):
            extra = {"snapshot_readers": readers} if parallel else {}
            source = PostgresSource(PostgresOptions(dsn=dsn, tables=["public.events"], **extra))
            try:
                source.open(context(work, f"stage{n}"), None)
                label = f"source's snapshot alone, {readers} reader(s)"
                with Stage(label, rows, backends):
                    read_snapshot(source, rows)
            finally:
                source.close()
        source = PostgresSource(PostgresOptions(dsn=dsn, tables=["public.events"]))
        spec = f'{{type: postgres, dsn: "{dsn}", tables: [public.events]}}'
        chunks_then_pipeline(work, source, "public.events", spec, rows, chunk_size, backends)
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)


def mariadb(work: Path, rows: int, chunk_size: int) -> None:
    import pymysql.cursors

    from wormhole.connectors.mysql.options import MySQLOptions
    from wormhole.connectors.mysql.source import MySQLSource
    from wormhole.testing.mysql import start_mariadb

    servers = start_mariadb()
    server = next(servers)
    try:
        db = server.create_database()
        server.sql(
            *mariadb_events(rows),
            database=db,
        )

        mariadbd = server.process.pid

        print(f"MariaDB: {rows:,} rows (7 columns)")
        print(f"  {'stage':<46} {'rows/s':>10} {'µs/row':>8} {'server':>8}")
        conn = server.connect(db, cursorclass=pymysql.cursors.SSCursor)
        label = "driver: SELECT *, unbuffered, fetchmany(8192)"
        with Stage(label, rows, mariadbd), conn.cursor() as cur:
            cur.execute("SELECT * FROM events")
            while cur.fetchmany(8192):
                pass
        conn.close()
        source = MySQLSource(MySQLOptions(dsn=server.dsn(), tables=[f"{db}.events"]))
        try:
            source.open(context(work, "stage"), None)
            with Stage("source's snapshot alone", rows, mariadbd):
                read_snapshot(source, rows)
        finally:
            source.close()
        source = MySQLSource(MySQLOptions(dsn=server.dsn(), tables=[f"{db}.events"]))
        spec = f'{{type: mysql, dsn: "{server.dsn()}", tables: [{db}.events]}}'
        chunks_then_pipeline(work, source, f"{db}.events", spec, rows, chunk_size, mariadbd)
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", choices=("postgres", "mariadb", "both"), default="both")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--chunk-size", type=int, default=4096)
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-stages-"))
    try:
        if args.db in ("postgres", "both"):
            postgres(work, args.rows, args.chunk_size)
        if args.db in ("mariadb", "both"):
            mariadb(work, args.rows, args.chunk_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
