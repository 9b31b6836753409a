"""MariaDB -> publisher log -> null sink, against a raw BinLogStreamReader iteration.

Run: ``make bench`` (or ``python bench/mysql_throughput.py --rows 1000000``).
Needs the MariaDB server (Debian package mariadb-server).

A throwaway server is started and one bulk of rows is inserted. The baseline
reads the same binlog range with python-mysql-replication's BinLogStreamReader
and touches every row (``event.rows``: the library's own value decoding); the
pipeline run is ``wormhole run --once`` in-process with the null sink (decode
the row images, build updates, shard, append + fsync to the publisher log, fan out,
acknowledge). Both are timed from start to the last row, in the same run.
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
from typing import Any

from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.row_event import WriteRowsEvent

from wormhole.core.pipeline import parse_pipeline
from wormhole.core.publisher import Publisher, tune_gc
from wormhole.testing.mysql import MariaDBServer, start_mariadb


def raw_iteration(server: MariaDBServer, file: str, pos: int, rows: int) -> float:
    stream = BinLogStreamReader(
        connection_settings={
            "host": server.host,
            "port": server.port,
            "user": server.user,
            "passwd": server.password,
        },
        server_id=4242,
        blocking=False,
        resume_stream=True,
        log_file=file,
        log_pos=pos,
        only_events=[WriteRowsEvent],
        enable_logging=False,
    )
    started = time.perf_counter()
    seen = 0
    for event in stream:
        seen += len(event.rows)
        if seen >= rows:
            break
    elapsed = time.perf_counter() - started
    stream.close()
    assert seen == rows, seen
    return rows / elapsed


def pipeline_for(server: MariaDBServer, database: str, work: Path, name: str) -> Any:
    text = f"""
pipeline: {name}
state_dir: {work / name}
source: {{type: mysql, dsn: "{server.dsn()}", tables: [{database}.events], snapshot: never}}
transport: {{type: inprocess}}
applications:
  nulls: {{sink: {{type: "null"}}}}
"""
    pipeline = parse_pipeline(text, "bench.yml", env={})
    Publisher(pipeline, once=True).run()  # records the start position (before the rows)
    return pipeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tune_gc()  # as `wormhole run`
    work = Path(tempfile.mkdtemp(prefix="wormhole-bench-mysql-"))
    servers = start_mariadb()
    server = next(servers)
    try:
        raw_rates, rates = [], []
        for attempt in range(args.repeat):
            database = server.create_database()
            server.sql(
                "CREATE TABLE events (id INT PRIMARY KEY, rider INT, lat DOUBLE, lon DOUBLE, "
                "note VARCHAR(40))",
                database=database,
            )
            pipeline = pipeline_for(server, database, work, f"bench{attempt}")
            file, pos = server.sql("SHOW MASTER STATUS")[0][:2]
            server.sql(
                f"INSERT INTO events SELECT seq, seq % 5000, 12.97 + seq * 1e-7, 77.59, "
                f"CONCAT('rider ', seq % 5000) FROM seq_1_to_{args.rows}",
                database=database,
            )
            raw_rates.append(raw_iteration(server, file, int(pos), args.rows))
            gc.collect()
            started = time.perf_counter()
            summary = Publisher(pipeline, once=True).run()
            elapsed = time.perf_counter() - started
            assert summary.source_updates == args.rows, summary
            rates.append(args.rows / elapsed)
            server.drop_database(database)
        raw, ours = statistics.median(raw_rates), statistics.median(rates)
        print(f"{args.rows:,} inserted rows (5 columns), median of {args.repeat} runs")
        print(f"{'measure':<52}  {'rows/s':>10}  {'ratio':>6}")
        print(
            f"{'raw BinLogStreamReader iteration (rows decoded)':<52}  {raw:>10,.0f}  {1.0:>6.2f}"
        )
        print(f"{'MariaDB -> publisher log -> null sink':<52}  {ours:>10,.0f}  {ours / raw:>6.2f}")
        print(f"target: >= 0.7 of the raw iteration ({ours / raw:.2f})")
    finally:
        with contextlib.suppress(StopIteration):
            next(servers)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
